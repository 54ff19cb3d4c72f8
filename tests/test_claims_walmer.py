"""Walmer et al. 2023's claims (analysis/reports/claims_walmer.py) on synthetic per-seed values shaped like the paper's
figure (held), like its negation (did not hold), within the seed-to-seed noise (inconclusive), and with a failed
precondition (not testable)."""

import numpy as np
import pytest

from analysis.reports import claims as C
from analysis.reports import claims_walmer as W

rng = np.random.default_rng(0)


def _jitter(x, eps):
    return np.asarray(x, dtype=float) + rng.uniform(-eps, eps, np.shape(x))


def _seeds(x, eps=0.005):
    return [np.asarray(x, dtype=float), _jitter(x, eps)]


def test_every_claim_quotes_walmer_with_a_figure_and_a_rule():
    for c in W.CLAIMS.values():
        assert c.source.startswith("Walmer et al. 2023") and c.figure.startswith("Walmer Fig.")
        assert len(c.passage) > 60 and c.rule and c.claim
    assert set(W.CLAIMS).isdisjoint(C.CLAIMS)  # ids are unique across the two reports' JSON
    assert "76.06" in W.CLAIMS["contrastive_beats_reconstruction"].paper_value
    assert "45.19" in W.CLAIMS["contrastive_beats_reconstruction"].paper_value


def test_halves():
    h = W.halves(np.array([[1.0, 3.0], [2.0, 2.0], [5.0, 5.0], [7.0, 9.0]]))
    assert h == {"first": 2.0, "later": 6.5, "first_block": 2.0, "last_block": 8.0}
    assert W.halves([0.4])["first"] == 0.4  # one block: it is both


# -------------------------------------------------------------- offset local heads (Fig. 3)


def _heads(local, offset):
    loc, off = np.zeros((6, 4), bool), np.zeros((6, 4), bool)
    loc.flat[:local] = True
    off.flat[:offset] = True
    return {"local": loc, "offset_local": off}


def test_offset_heads_in_every_objective():
    paper = {o: [_heads(3, 1), _heads(2, 2)] for o in W.OBJECTIVES}
    v = W.rule_offset_heads(paper)
    assert v.outcome == C.HELD and "mae 2 of 2 seeds" in v.ours
    neg = {**paper, "dino": [_heads(3, 0), _heads(1, 0)]}  # DINO has local heads but none offset
    v = W.rule_offset_heads(neg)
    assert v.outcome == C.NOT_HELD and "dino: 0 of 2 seeds" in v.why
    mixed = {**paper, "mae": [_heads(3, 1), _heads(2, 0)]}  # one seed of MAE has one, the other not
    assert W.rule_offset_heads(mixed).outcome == C.INCONCLUSIVE
    none = {o: [_heads(0, 0), _heads(0, 0)] for o in W.OBJECTIVES}
    v = W.rule_offset_heads(none)
    assert v.outcome == C.NOT_TESTABLE and "0 of 144 heads in 6 runs" in v.why and v.ours == "0 of 144 heads local"
    one = {o: [_heads(3, 1)] for o in W.OBJECTIVES}
    assert W.rule_offset_heads(one).outcome == C.NOT_TESTABLE
    assert "No aligned_attention result for mae" in W.rule_offset_heads({**paper, "mae": []}).why


# -------------------------------------------------------------- attention distance by depth (Fig. 4)


def _dist(curve, heads=4):
    return np.repeat(np.asarray(curve, dtype=float)[:, None], heads, 1)


def test_reconstruction_stays_local():
    # Walmer Fig. 4 right: high, a dip around the middle, then up for supervised and DINO; MAE stays low
    sup, dino, mae = (
        [0.45, 0.3, 0.25, 0.35, 0.45, 0.5],
        [0.45, 0.3, 0.28, 0.38, 0.47, 0.5],
        [0.45, 0.3, 0.22, 0.2, 0.2, 0.22],
    )
    paper = {"supervised": _seeds(_dist(sup)), "dino": _seeds(_dist(dino)), "mae": _seeds(_dist(mae))}
    v = W.rule_reconstruction_local(paper)
    assert v.outcome == C.HELD and set(v.measured) == {
        "later-half attention distance, supervised - mae",
        "later-half attention distance, dino - mae",
    }
    neg = {"supervised": _seeds(_dist(mae)), "dino": _seeds(_dist(mae)), "mae": _seeds(_dist(sup))}
    assert W.rule_reconstruction_local(neg).outcome == C.NOT_HELD
    noisy = {
        "supervised": _seeds(_dist(sup)),
        "dino": _seeds(_dist(dino)),
        "mae": [_dist(mae), _dist([0.45, 0.3, 0.3, 0.5, 0.6, 0.6])],
    }  # MAE's seeds disagree by more than the effect
    assert W.rule_reconstruction_local(noisy).outcome == C.INCONCLUSIVE
    assert W.rule_reconstruction_local({"supervised": paper["supervised"]}).outcome == C.NOT_TESTABLE
    v = W.rule_reconstruction_local({**paper, "mae": paper["mae"][:1]})
    assert v.outcome == C.NOT_TESTABLE and "Fewer than two seeds of mae" in v.why
    # only supervised to compare with: one part
    assert len(W.rule_reconstruction_local({"supervised": paper["supervised"], "mae": paper["mae"]}).measured) == 1


# -------------------------------------------------------------- CLS attention entropy (Fig. 2)


def test_reconstruction_cls_attention_covers_more():
    dino, mae = _dist([3.5, 3.2, 2.6, 2.2, 2.0, 1.9]), _dist([3.5, 3.3, 3.1, 3.2, 3.3, 3.4])  # nats, log 49 = 3.89
    assert W.rule_cls_covers_more({"dino": _seeds(dino), "mae": _seeds(mae)}).outcome == C.HELD
    assert W.rule_cls_covers_more({"dino": _seeds(mae), "mae": _seeds(dino)}).outcome == C.NOT_HELD
    assert W.rule_cls_covers_more({"dino": [dino, mae], "mae": [mae, dino]}).outcome == C.INCONCLUSIVE
    v = W.rule_cls_covers_more({"dino": _seeds(dino), "mae": []})  # e.g. an MAE model without a CLS token
    assert v.outcome == C.NOT_TESTABLE and "No CLS attention map for mae" in v.why


def test_supervised_cls_attention_is_sparse():
    sup, dino = _dist([3.0, 2.5, 1.2, 0.8, 0.7, 0.7]), _dist([3.0, 2.6, 2.2, 2.0, 1.9, 1.9])
    assert W.rule_cls_sparse({"supervised": _seeds(sup), "dino": _seeds(dino)}).outcome == C.HELD
    assert W.rule_cls_sparse({"supervised": _seeds(dino), "dino": _seeds(sup)}).outcome == C.NOT_HELD
    assert W.rule_cls_sparse({"supervised": [sup, dino], "dino": [dino, sup]}).outcome == C.INCONCLUSIVE
    assert W.rule_cls_sparse({"supervised": _seeds(sup)}).outcome == C.NOT_TESTABLE


# -------------------------------------------------------------- k-NN and clustering (Fig. 7, 9)


def _knn(*top1, n=2560, baseline=0.1):
    return [{"top1": t, "n": n, "baseline": baseline} for t in top1]


def test_contrastive_beats_reconstruction():
    knn = {"dino": _knn(0.80, 0.81), "mae": _knn(0.70, 0.705)}
    purity = {"dino": [0.6, 0.61], "mae": [0.45, 0.46]}
    v = W.rule_more_semantic(knn, purity, "dino", "mae")
    assert v.outcome == C.HELD and "k-NN top-1 dino 80.50, mae 70.25" in v.ours
    assert v.noise_floor["last-block k-NN top-1, dino - mae"]["binomial_se"] == pytest.approx(0.0084, abs=2e-4)
    assert (
        W.rule_more_semantic(
            {"dino": knn["mae"], "mae": knn["dino"]}, {"dino": purity["mae"], "mae": purity["dino"]}, "dino", "mae"
        ).outcome
        == C.NOT_HELD
    )
    # a 1-point gap is within 2 binomial SE on 2,560 images although the seeds agree exactly
    small = W.rule_more_semantic({"dino": _knn(0.80, 0.80), "mae": _knn(0.79, 0.79)}, purity, "dino", "mae")
    assert (
        small.outcome == C.INCONCLUSIVE and small.noise_floor["last-block k-NN top-1, dino - mae"]["seed_spread"] == 0
    )
    v = W.rule_more_semantic(knn, {"dino": purity["dino"]}, "dino", "mae")
    assert v.outcome == C.NOT_TESTABLE and "No clustering result on a CLS token for mae" in v.why


def test_supervised_most_semantic_and_mae_above_chance():
    knn = {"supervised": _knn(0.88, 0.885), "dino": _knn(0.80, 0.81)}
    purity = {"supervised": [0.8, 0.81], "dino": [0.6, 0.61]}
    assert W.rule_more_semantic(knn, purity, "supervised", "dino").outcome == C.HELD
    mae_knn, mae_purity = _knn(0.70, 0.71), [{"value": 0.45, "baseline": 0.12}, {"value": 0.46, "baseline": 0.13}]
    v = W.rule_above_chance(mae_knn, mae_purity)
    assert v.outcome == C.HELD and "random 10.00" in v.ours
    chance = [{"value": 0.12, "baseline": 0.12}, {"value": 0.13, "baseline": 0.12}]
    assert W.rule_above_chance(_knn(0.05, 0.06, baseline=0.1), chance).outcome == C.NOT_HELD  # below random features
    assert W.rule_above_chance(_knn(0.1, 0.101), chance).outcome == C.INCONCLUSIVE
    assert W.rule_above_chance([], []).outcome == C.NOT_TESTABLE


def test_contrastive_semantics_emerge_earlier():
    # Walmer Fig. 9 left / 24: DINO rises fast, supervised catches up at the end
    dino, sup = [0.5, 0.65, 0.72, 0.76, 0.78, 0.8], [0.3, 0.4, 0.5, 0.65, 0.8, 0.88]

    def knn(curve, eps=0.003):
        return [{"curve": np.array(curve), "n": 2560}, {"curve": _jitter(curve, eps), "n": 2560}]

    purity = {"dino": _seeds(np.array(dino) - 0.2), "supervised": _seeds(np.array(sup) - 0.2)}
    v = W.rule_semantic_earlier({"dino": knn(dino), "supervised": knn(sup)}, purity)
    assert v.outcome == C.HELD and v.noise_floor["first-half k-NN top-1, dino - supervised"]["binomial_se"] > 0
    swapped = {"dino": purity["supervised"], "supervised": purity["dino"]}
    assert W.rule_semantic_earlier({"dino": knn(sup), "supervised": knn(dino)}, swapped).outcome == C.NOT_HELD
    assert (
        W.rule_semantic_earlier(
            {"dino": knn(dino), "supervised": [knn(dino)[0], knn(sup)[0]]},
            {"dino": purity["dino"], "supervised": [purity["dino"][0], purity["supervised"][0]]},
        ).outcome
        == C.INCONCLUSIVE
    )
    assert W.rule_semantic_earlier({"dino": knn(dino)}, purity).outcome == C.NOT_TESTABLE


# -------------------------------------------------------------- cross-model CKA (Fig. 6)


def test_objectives_agree_early_and_diverge_late():
    curve = [0.95, 0.9, 0.8, 0.6, 0.4, 0.3]
    pairs = {
        W.pair_name("supervised", "dino"): _seeds(curve),
        W.pair_name("supervised", "mae"): _seeds(curve),
        W.pair_name("dino", "mae"): _seeds(curve),
    }
    v = W.rule_diverge_late(pairs)
    assert v.outcome == C.HELD and len([k for k in v.noise_floor]) == 3
    assert W.rule_diverge_late({k: _seeds(curve[::-1]) for k in pairs}).outcome == C.NOT_HELD
    noisy = {k: [np.array(curve), np.array(curve[::-1])] for k in pairs}
    assert W.rule_diverge_late(noisy).outcome == C.INCONCLUSIVE
    assert W.rule_diverge_late({}).outcome == C.NOT_TESTABLE
    v = W.rule_diverge_late({k: [np.array(curve)] for k in pairs})
    assert v.outcome == C.NOT_TESTABLE and "Fewer than two seeds" in v.why and "+0.650" in v.why


def test_supervised_cls_closer_to_contrastive():
    near, far = W.pair_name("supervised", "dino"), W.pair_name("supervised", "mae")
    v = W.rule_cls_groups({near: [0.7, 0.72], far: [0.35, 0.37]})
    assert v.outcome == C.HELD and "CKA supervised vs dino 0.710" in v.ours
    assert W.rule_cls_groups({near: [0.35, 0.37], far: [0.7, 0.72]}).outcome == C.NOT_HELD
    assert W.rule_cls_groups({near: [0.7, 0.5], far: [0.6, 0.62]}).outcome == C.INCONCLUSIVE
    v = W.rule_cls_groups({near: [0.7, 0.72]})
    assert v.outcome == C.NOT_TESTABLE and "supervised vs mae" in v.why


# -------------------------------------------------------------- residual connections (Fig. 23)


def test_residual_shift_in_supervised_not_dino():
    sup, dino = [0.8, 0.75, 0.7, 0.3, 0.2, 0.15], [0.8, 0.78, 0.75, 0.72, 0.7, 0.7]
    assert W.rule_residual_shift({"supervised": _seeds(sup), "dino": _seeds(dino)}).outcome == C.HELD
    assert W.rule_residual_shift({"supervised": _seeds(sup[::-1]), "dino": _seeds([0.1] * 6)}).outcome == C.NOT_HELD
    assert (
        W.rule_residual_shift({"supervised": [np.array(sup), np.array(sup[::-1])], "dino": _seeds(dino)}).outcome
        == C.INCONCLUSIVE
    )
    assert W.rule_residual_shift({"supervised": _seeds(sup), "dino": []}).outcome == C.NOT_TESTABLE
    assert W.rule_residual_shift({"supervised": _seeds([0.8]), "dino": _seeds([0.7])}).outcome == C.NOT_TESTABLE


def test_records_read_back(tmp_path):
    v = W.rule_cls_groups(
        {W.pair_name("supervised", "dino"): [0.7, 0.72], W.pair_name("supervised", "mae"): [0.35, 0.37]}
    )
    C.write_json(tmp_path / "t.json", "walmer", [C.record(W.CLAIMS["cls_similar_by_supervision"], v)], [])
    back = C.read_json(tmp_path / "t.json")["claims"]["cls_similar_by_supervision"]
    assert back["verdict"] == "held" and back["figure"] == "Walmer Fig. 6 left, 19" and back["source"].endswith("§5.1")
