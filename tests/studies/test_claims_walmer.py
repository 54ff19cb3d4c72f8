"""Walmer et al. 2023's claims (analysis/studies/walmer2023/) on synthetic per-seed values, three seeds each: shaped
like the paper's figure with a clearly significant effect (held), like its negation (did not hold), within the
seed-to-seed noise (inconclusive), and with a failed precondition -- a self-supervised model below its paper's k-NN
regime, every head at uniform attention, too few seeds, a missing measure (not testable)."""

import os
import re
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from analysis.studies import claims as C
from analysis.studies import paper
from analysis.studies.locality import LOCALITY_PRECONDITION, uniform_distance
from analysis.studies.walmer2023 import claims as W
from analysis.studies.walmer2023 import numbers as N

# a folder with the papers' text (walmer2023-teaching-matters.txt): set VITLAB_PAPERS to check every passage verbatim
PAPERS = Path(os.environ.get("VITLAB_PAPERS") or "/nonexistent")
OFFSETS = (0.0, 1.0, -1.0)  # three seeds: the value, and the value +- eps


def _seeds(x, eps=0.005):
    """Three seeds of ``x`` that agree to +-1.5 eps: an effect of 0.05 or more is clearly significant. The offset
    varies along x, so a difference within a seed (e.g. of two blocks) varies over seeds too: a part whose seeds all
    agree exactly has no test (stats.DEGENERATE)."""
    x = np.asarray(x, dtype=float)
    wobble = 1 + 0.5 * np.cos(np.arange(x.size)).reshape(x.shape)
    return [x + o * eps * wobble for o in OFFSETS]


def _noisy(x, spread=0.5):
    return [np.asarray(x, dtype=float) + o * spread for o in (0.0, 1.0, -0.7)]


GOOD = [C.Precondition("x", True, "fine")]


def test_every_claim_quotes_walmer_with_a_figure_and_a_rule():
    p = paper("walmer2023")
    assert p.name == "walmer2023" and p.title == "Teaching matters: the training objective"
    assert p.defaults == {"seeds": [0, 1, 2]}
    assert len(p.claims) == 13 and p.claims.ids()[0] == "offset_heads_every_objective"
    for c in p.claims:
        assert c.source.startswith("Walmer et al. 2023") and c.figure.startswith("Walmer Fig.")
        assert len(c.passage) > 60 and c.rule and c.claim and c.paper_value and c.test is not None
    assert "76.06" in p.claims["contrastive_beats_reconstruction"].paper_value
    assert "45.19" in p.claims["contrastive_beats_reconstruction"].paper_value
    # the attention claim quotes the caption about attention and tests attention maps, not feature CKA
    div = p.claims["attention_diverges_late"]
    assert "attention" in div.passage and "CLS attention maps" in div.rule and "CKA" not in div.rule
    with pytest.raises(KeyError, match="did you mean 'supervised_most_semantic'"):
        p.claims["supervised_most_semantc"]


def test_applies_to_a_study_with_two_objectives():
    p = paper("walmer2023")
    assert p.applies({"supervised": [], "mae": []})
    assert not p.applies({"supervised": [], "vit_cls": []})
    assert not p.applies({"vit_cls": [], "resnet": []})


def _unhyphenated(text: str) -> str:
    """Whitespace collapsed and every hyphen dropped (the text's line-end hyphenation splits words with and without
    a hyphen of their own: "object-/centered", "clus-/ter"), so a passage matches the text either way."""
    return re.sub(r"(\w)- (\w)", r"\1\2", " ".join(text.split())).replace("-", "")


@pytest.mark.skipif(not PAPERS.is_dir(), reason="VITLAB_PAPERS (a folder with the papers' text) is not set")
def test_every_passage_is_quoted_verbatim():
    text = _unhyphenated((PAPERS / "walmer2023-teaching-matters.txt").read_text())
    for c in paper("walmer2023").claims:
        for piece in c.passage.split(" […] "):  # a figure the layout put inside the sentence, or a skipped sentence
            assert _unhyphenated(piece) in text, (c.id, piece)


# -------------------------------------------------------------- preconditions


def test_regime_precondition_needs_08_of_the_papers_knn_share():
    ok, low = W.regime_precondition({"dino": 0.80, "mae": 0.40})
    assert ok.passed and "dino reaches 0.80" in ok.sentence  # 0.80 >= 0.8 x 0.91 = 0.73
    assert not low.passed and "0.40" in low.sentence and "0.43" in low.sentence  # 0.8 x 0.54 = 0.43
    (none,) = W.regime_precondition({"dino": None})
    assert not none.passed and "cannot be computed" in none.sentence
    (dino,) = W.regime_precondition({"dino": 0.64})  # the CPU study's DINO (issue: 0.64 against 0.91)
    assert not dino.passed and dino.numbers["needed"] == pytest.approx(0.8 * 76.06 / 83.79)


def test_locality_precondition():
    u = uniform_distance(7, 4)
    assert W.locality_precondition(0.5 * u, u, "m").passed
    fail = W.locality_precondition(0.95 * u, u, "supervised and mae")
    assert not fail.passed and "no head of supervised and mae has left uniform attention" in fail.sentence
    assert f"{LOCALITY_PRECONDITION:g} x" in fail.sentence


# -------------------------------------------------------------- offset local heads (Fig. 3)


def _heads(local, offset):
    loc, off = np.zeros((6, 4), bool), np.zeros((6, 4), bool)
    loc.flat[:local] = True
    off.flat[:offset] = True
    return {"local": loc, "offset_local": off}


def test_offset_heads_in_every_objective():
    paper_ = {o: [_heads(3, 1), _heads(2, 2), _heads(2, 1)] for o in N.OBJECTIVES}
    r = W.rule_offset_heads(paper_, GOOD)
    assert r.outcome == C.HELD and "mae 3 of 3 seeds" in r.ours
    neg = {**paper_, "dino": [_heads(3, 0), _heads(1, 0), _heads(1, 0)]}  # DINO has local heads but none offset
    r = W.rule_offset_heads(neg, GOOD)
    assert r.outcome == C.NOT_HELD and "dino: 0 of 3 seeds" in r.why
    mixed = {**paper_, "mae": [_heads(3, 1), _heads(2, 0), _heads(2, 0)]}
    assert W.rule_offset_heads(mixed, GOOD).outcome == C.INCONCLUSIVE
    none = {o: [_heads(0, 0)] * 3 for o in N.OBJECTIVES}
    r = W.rule_offset_heads(none, GOOD)
    assert r.outcome == C.NOT_TESTABLE and "0 of 216 heads in 9 runs" in r.why
    assert W.rule_offset_heads({o: [_heads(3, 1)] for o in N.OBJECTIVES}, GOOD).outcome == C.NOT_TESTABLE
    assert W.rule_offset_heads({"mae": paper_["mae"]}, GOOD).outcome == C.NOT_TESTABLE  # one objective
    failed = [C.Precondition("locality", False, "no head of x has left uniform attention")]
    r = W.rule_offset_heads(paper_, failed)
    assert r.outcome == C.NOT_TESTABLE and r.why.startswith("No head of x")


# -------------------------------------------------------------- attention distance by depth (Fig. 4)


def _dist(curve, heads=4):
    return np.repeat(np.asarray(curve, dtype=float)[:, None], heads, 1)


# Walmer Fig. 4 right: high, a dip around layers 3-6, then up for supervised and DINO; MAE stays low
SUP, DINO, MAE = (
    [0.45, 0.3, 0.25, 0.35, 0.45, 0.5],
    [0.45, 0.3, 0.28, 0.38, 0.47, 0.5],
    [0.45, 0.3, 0.22, 0.2, 0.2, 0.22],
)


def test_reconstruction_stays_local():
    paper_ = {"supervised": _seeds(_dist(SUP)), "dino": _seeds(_dist(DINO)), "mae": _seeds(_dist(MAE))}
    r = W.rule_reconstruction_local(paper_, GOOD)
    assert r.outcome == C.HELD
    assert [p.name for p in r.decision.parts] == [
        "later-half attention distance, supervised - mae",
        "later-half attention distance, dino - mae",
    ]
    assert all(p.ci[0] > 0 and p.test.startswith("Welch") for p in r.decision.parts)
    neg = {"supervised": _seeds(_dist(MAE)), "dino": _seeds(_dist(MAE)), "mae": _seeds(_dist(SUP))}
    assert W.rule_reconstruction_local(neg, GOOD).outcome == C.NOT_HELD
    noisy = {"supervised": _noisy(_dist(SUP)), "dino": _noisy(_dist(DINO)), "mae": _noisy(_dist(MAE))}
    assert W.rule_reconstruction_local(noisy, GOOD).outcome == C.INCONCLUSIVE
    assert W.rule_reconstruction_local({"mae": paper_["mae"]}, GOOD).outcome == C.NOT_TESTABLE
    r = W.rule_reconstruction_local({**paper_, "mae": paper_["mae"][:1]}, GOOD)
    # the failed seeds precondition is the reason; the part it leaves uncomputable is not reported twice
    assert r.outcome == C.NOT_TESTABLE and r.why.startswith("Fewer than 2 seeds of mae (1)") and "part '" not in r.why
    # only supervised to compare with: one part
    two = W.rule_reconstruction_local({"supervised": paper_["supervised"], "mae": paper_["mae"]}, GOOD)
    assert len(two.decision.parts) == 1


def test_attention_depth_profile():
    paper_ = {"supervised": _seeds(_dist(SUP)), "dino": _seeds(_dist(DINO)), "mae": _seeds(_dist(MAE))}
    r = W.rule_depth_profile(paper_, GOOD)
    assert r.outcome == C.HELD and len(r.decision.parts) == 5  # a dip per objective, a later slope for two
    flip = [0.2, 0.35, 0.4, 0.3, 0.2, 0.15]  # distances rise after the first block, then fall
    neg = {o: _seeds(_dist(flip)) for o in N.OBJECTIVES}
    assert W.rule_depth_profile(neg, GOOD).outcome == C.NOT_HELD
    mixed = [_dist(SUP), _dist(flip), _dist([0.3, 0.32, 0.3, 0.31, 0.3, 0.31])]  # the seeds disagree on the shape
    assert W.rule_depth_profile({o: mixed for o in N.OBJECTIVES}, GOOD).outcome == C.INCONCLUSIVE
    assert W.rule_depth_profile({"mae": _seeds(_dist(MAE[:3]))}, GOOD).outcome == C.NOT_TESTABLE


# -------------------------------------------------------------- CLS attention (Fig. 2)


def test_reconstruction_cls_attention_covers_more():
    dino, mae = _dist([3.5, 3.2, 2.6, 2.2, 2.0, 1.9]), _dist([3.5, 3.3, 3.1, 3.2, 3.3, 3.4])  # nats, log 49 = 3.89
    name = "mae - dino"
    assert W.rule_later_difference({"dino": _seeds(dino), "mae": _seeds(mae)}, "mae", "dino", name).outcome == C.HELD
    assert W.rule_later_difference({"dino": _seeds(mae), "mae": _seeds(dino)}, "mae", "dino", name).outcome == (
        C.NOT_HELD
    )
    noisy = {"dino": _noisy(dino, 2.0), "mae": _noisy(dino, 2.0)}
    assert W.rule_later_difference(noisy, "mae", "dino", name).outcome == C.INCONCLUSIVE
    r = W.rule_later_difference({"dino": _seeds(dino), "mae": [None] * 3}, "mae", "dino", name)
    assert r.outcome == C.NOT_TESTABLE and "no cls attention map on every seed of mae" in r.why.lower()


def test_attention_diverges_late_against_the_cross_seed_baseline():
    grid = (4, 2, 3, 3)  # blocks 0-1 early, 2-3 late; 2 heads; a 3x3 grid
    rng = np.random.default_rng(0)

    def maps(late_peak, jitter=0.002):
        m = np.full(grid, 1 / 9) + rng.uniform(-jitter, jitter, grid)
        m[2:, :, late_peak // 3, late_peak % 3] += 0.5  # each objective's late maps peak somewhere of its own
        return m / m.sum((2, 3), keepdims=True)

    paper_ = {"supervised": [maps(0) for _ in OFFSETS], "dino": [maps(4) for _ in OFFSETS]}
    r = W.rule_attention_diverges(paper_, GOOD)
    assert r.outcome == C.HELD and "above cross-seed" in r.decision.parts[0].name
    same = {"supervised": [maps(0) for _ in OFFSETS], "dino": [maps(0) for _ in OFFSETS]}
    assert W.rule_attention_diverges(same, GOOD).outcome in (C.NOT_HELD, C.INCONCLUSIVE)
    assert W.rule_attention_diverges(same, GOOD).decision.parts[0].effect < 0.01

    def early(i):  # the objectives differ in the first blocks and agree late: reversed
        m = np.full(grid, 1 / 9) + rng.uniform(-0.002, 0.002, grid)
        m[:2, :, i // 3, i % 3] += 0.5
        return m / m.sum((2, 3), keepdims=True)

    rev = {"supervised": [early(0) for _ in OFFSETS], "dino": [early(4) for _ in OFFSETS]}
    assert W.rule_attention_diverges(rev, GOOD).outcome == C.NOT_HELD
    noisy = {"supervised": [maps(0, 0.1) for _ in OFFSETS], "dino": [maps(int(rng.integers(9)), 0.1) for _ in OFFSETS]}
    noisy["dino"][0] = noisy["supervised"][0]
    assert W.rule_attention_diverges(noisy, GOOD).outcome != C.HELD
    assert W.rule_attention_diverges({"dino": paper_["dino"]}, GOOD).outcome == C.NOT_TESTABLE


# -------------------------------------------------------------- k-NN and clustering (Fig. 7, 9)


def _knn(*top1, n=2560, baseline=0.1):
    return [{"top1": t, "n": n, "baseline": baseline} for t in top1]


def test_contrastive_beats_reconstruction():
    knn = {"dino": _knn(0.80, 0.81, 0.805), "mae": _knn(0.70, 0.705, 0.71)}
    purity = {"dino": [0.6, 0.61, 0.605], "mae": [0.45, 0.46, 0.455]}
    r = W.rule_more_semantic(knn, purity, "dino", "mae", GOOD)
    assert r.outcome == C.HELD and "k-NN top-1 dino 80.50 (binomial SE 0.78), mae 70.50" in r.ours
    swapped = W.rule_more_semantic(
        {"dino": knn["mae"], "mae": knn["dino"]}, {"dino": purity["mae"], "mae": purity["dino"]}, "dino", "mae", GOOD
    )
    assert swapped.outcome == C.NOT_HELD
    noisy = W.rule_more_semantic(
        {"dino": _knn(0.80, 0.60, 0.75), "mae": _knn(0.79, 0.62, 0.70)},
        {"dino": [0.6, 0.4, 0.5], "mae": [0.55, 0.45, 0.5]},
        "dino",
        "mae",
        GOOD,
    )
    assert noisy.outcome == C.INCONCLUSIVE
    r = W.rule_more_semantic(knn, {"dino": purity["dino"]}, "dino", "mae", GOOD)
    assert r.outcome == C.NOT_TESTABLE and "no clustering result on a cls token on every seed of mae" in r.why.lower()
    # the CPU study's DINO: far below its paper's k-NN share, so an effect in the data is not a verdict on DINO
    r = W.rule_more_semantic(knn, purity, "dino", "mae", W.regime_precondition({"dino": 0.64, "mae": 0.86}))
    assert r.outcome == C.NOT_TESTABLE and r.why.startswith("Dino reaches 0.64") and r.decision.parts


def test_supervised_most_semantic_and_mae_above_chance_and_a_random_network():
    knn = {"supervised": _knn(0.88, 0.885, 0.89), "dino": _knn(0.80, 0.81, 0.805)}
    purity = {"supervised": [0.8, 0.81, 0.805], "dino": [0.6, 0.61, 0.605]}
    assert W.rule_more_semantic(knn, purity, "supervised", "dino", GOOD).outcome == C.HELD
    mae_knn = _knn(0.70, 0.71, 0.705)
    mae_pur = [{"value": 0.45 + d, "baseline": 0.12} for d in (0, 0.01, 0.005)]
    init = [{"knn": [0.3, 0.4], "purity": [0.2, 0.25 + d]} for d in (0, 0.01, -0.01)]
    weak_px = [{"knn": 0.5 + d, "purity": 0.3 + d} for d in (0, 0.01, -0.01)]
    r = W.rule_above_chance(mae_knn, mae_pur, init, weak_px, GOOD)
    assert r.outcome == C.HELD and len(r.decision.parts) == 2
    # the strongest baseline is chosen per read-out: the raw pixels' k-NN (0.50) above the random network's (0.40)
    assert [p.name for p in r.decision.parts] == [
        "last-block k-NN top-1, mae - raw pixels (the strongest baseline, 0.5000)",
        "last-block cluster purity, mae - raw pixels (the strongest baseline, 0.3000)",
    ]
    assert "strongest baseline raw pixels 50.00" in r.ours and r.measured["strongest"]["k-NN top-1"]["value"] == 0.5
    # above Gaussian chance but not above what a random-initialised network of the same architecture gives
    strong_init = [{"knn": [0.8, 0.8 + d], "purity": [0.6, 0.6 + d]} for d in (0, 0.01, -0.01)]
    r = W.rule_above_chance(mae_knn, mae_pur, strong_init, weak_px, GOOD)
    assert r.outcome == C.NOT_HELD and "mae - random-init network" in r.why
    chance = [{"value": 0.12 + d, "baseline": 0.12} for d in (0, 0.1, -0.1)]
    assert W.rule_above_chance(_knn(0.1, 0.3, -0.05), chance, init, weak_px, GOOD).outcome == C.INCONCLUSIVE
    r = W.rule_above_chance(mae_knn, mae_pur, None, weak_px, GOOD)
    assert r.outcome == C.NOT_TESTABLE and "no random-init network measured" in r.why.lower()
    r = W.rule_above_chance(mae_knn, mae_pur, init, None, GOOD)
    assert r.outcome == C.NOT_TESTABLE and "no raw pixels measured" in r.why.lower() and len(r.decision.parts) == 2
    assert W.rule_above_chance([], [], init, weak_px, GOOD).outcome == C.NOT_TESTABLE


def test_mae_above_chance_is_tested_against_the_raw_pixels_where_they_beat_it():
    """The issue's case (docs/teaching-matters.md, three seeds): MAE's k-NN top-1 0.758 / 0.715 / 0.703 held against
    Gaussian features (0.09) and a random-initialised network (0.47), but the raw pixels reach 0.790: against the
    strongest baseline shown, MAE is not above it; the rule first reported said held, and the record says so."""
    mae_knn = _knn(0.7578, 0.7152, 0.7031, baseline=0.0935)
    mae_pur = [{"value": v, "baseline": 0.128} for v in (0.55, 0.51, 0.507)]
    init = [{"knn": [0.4, 0.47 + d], "purity": [0.3, 0.335 + d]} for d in (0, 0.01, -0.01)]
    pixels = [{"knn": 0.7898 + d, "purity": 0.559 + d} for d in (0, 0.002, -0.002)]
    r = W.rule_above_chance(mae_knn, mae_pur, init, pixels, GOOD)
    assert [p.name.split(" (")[0] for p in r.decision.parts] == [
        "last-block k-NN top-1, mae - raw pixels",
        "last-block cluster purity, mae - raw pixels",
    ]
    assert all(p.effect < 0 for p in r.decision.parts) and r.outcome != C.HELD
    assert r.measured["verdict_first_rule"] == C.HELD  # Gaussian features and the random network alone: held
    assert any("Under the rule first reported" in line and "**held**" in line for line in r.lines)
    assert any(line.startswith("| k-NN top-1 | 0.7254 |") and "0.7898 (strongest)" in line for line in r.lines)
    # declared: fixed after the claim's first report, so the section says so
    claim = paper("walmer2023").claims["reconstruction_cls_above_chance"]
    rec = C.record(claim, r)
    assert rec["preregistered"]["fixed_after_data"] and "strongest_baseline = 0" in rec["preregistered"]["note"]
    assert rec["preregistered"]["thresholds"]["strongest_baseline"]["kind"] == "rule"
    assert rec["verdict_ungated"] == r.outcome  # every precondition passed: the same verdict
    md = "\n".join(C.section(9, claim, r))
    late = md.split("**Fixed after the data:")[1]
    assert "strongest_baseline = 0 (fixed 2026-11-28, 7a197ea" in late and "first reported" in late


def test_contrastive_semantics_emerge_earlier():
    # Walmer Fig. 9 left / 24: DINO rises fast, supervised catches up at the end
    dino, sup = [0.5, 0.65, 0.72, 0.76, 0.78, 0.8], [0.3, 0.4, 0.5, 0.65, 0.8, 0.88]
    knn, pur = {"dino": _seeds(dino), "supervised": _seeds(sup)}, {"dino": _seeds(dino), "supervised": _seeds(sup)}
    assert W.rule_semantic_earlier(knn, pur, GOOD).outcome == C.HELD
    swapped = {"dino": knn["supervised"], "supervised": knn["dino"]}
    assert W.rule_semantic_earlier(swapped, swapped, GOOD).outcome == C.NOT_HELD
    noisy = {"dino": _noisy(dino), "supervised": _noisy(dino)}
    assert W.rule_semantic_earlier(noisy, noisy, GOOD).outcome == C.INCONCLUSIVE
    assert W.rule_semantic_earlier({"dino": knn["dino"]}, pur, GOOD).outcome == C.NOT_TESTABLE


def test_purity_rises_with_depth():
    up = [0.2, 0.3, 0.4, 0.5, 0.6, 0.7]
    r = W.rule_purity_rises({o: _seeds(up) for o in N.OBJECTIVES}, GOOD)
    assert r.outcome == C.HELD and r.decision.parts[0].name == "supervised: purity slope per block"
    assert W.rule_purity_rises({o: _seeds(up[::-1]) for o in N.OBJECTIVES}, GOOD).outcome == C.NOT_HELD
    flat = [[0.3, 0.5, 0.3, 0.5, 0.3, 0.4], [0.5, 0.3, 0.5, 0.3, 0.5, 0.3], [0.4, 0.4, 0.3, 0.5, 0.4, 0.4]]
    assert W.rule_purity_rises({"mae": [np.array(f) for f in flat]}, GOOD).outcome == C.INCONCLUSIVE
    assert W.rule_purity_rises({"mae": [None, None, None]}, GOOD).outcome == C.NOT_TESTABLE


# -------------------------------------------------------------- cross-model CKA (Fig. 6), residuals (Fig. 23)


def test_supervised_cls_closer_to_contrastive():
    ceiling = [0.9, 0.92, 0.91]
    r = W.rule_cls_groups([0.7, 0.72, 0.71], [0.35, 0.37, 0.36], ceiling, GOOD)
    assert r.outcome == C.HELD and "CKA supervised vs dino 0.710" in r.ours and "ceiling (supervised) 0.910" in r.ours
    assert len(r.decision.parts) == 2 and "cross-seed ceiling" in r.decision.parts[1].name
    assert r.decision.parts[1].effect == pytest.approx(0.91 - 0.36)  # ceiling minus CKA(supervised, mae)
    assert W.rule_cls_groups([0.35, 0.37, 0.36], [0.7, 0.72, 0.71], ceiling, GOOD).outcome == C.NOT_HELD
    assert W.rule_cls_groups([0.7, 0.5, 0.6], [0.6, 0.62, 0.61], ceiling, GOOD).outcome == C.INCONCLUSIVE
    # MAE as close to supervised as another seed of supervised: dino closer than mae, but not "similar supervision"
    near_ceiling = W.rule_cls_groups([0.95, 0.96, 0.955], [0.9, 0.93, 0.915], ceiling, GOOD)
    assert near_ceiling.outcome == C.INCONCLUSIVE and near_ceiling.decision.parts[0].outcome != "not significant"
    assert W.rule_cls_groups([0.7], [0.3], [0.9], GOOD).outcome == C.NOT_TESTABLE  # one seed pair
    assert W.rule_cls_groups([], [], ceiling, GOOD).outcome == C.NOT_TESTABLE
    # no ceiling: the cross-objective numbers have no reference, so not testable, saying why
    r = W.rule_cls_groups([0.7, 0.72, 0.71], [0.35, 0.37, 0.36], (), GOOD, "runs a and b differ")
    assert r.outcome == C.NOT_TESTABLE and "No cross-seed ceiling" in r.why and "runs a and b differ" in r.why
    assert C.ungated(r).outcome == C.HELD  # the part that could be computed


def test_the_cross_seed_ceiling_pairs_every_two_seeds_on_the_earlier_seeds_images(monkeypatch):
    """The ceiling is CKA between every two seeds of one objective, read on the earlier seed's images; on a known
    case (the CKA of two runs = a number of their seeds) it is the mean over the three pairs."""
    from analysis.studies.walmer2023 import reads as R

    runs = [SimpleNamespace(name=f"s{i}", seed=i) for i in range(3)]
    assert [(a.name, b.name) for a, b in R.seed_pairs(runs)] == [("s1", "s0"), ("s2", "s0"), ("s2", "s1")]
    calls = []

    def fake(a, b, study, on_other_images=False):
        calls.append(on_other_images)
        return 1.0 - 0.1 * abs(a.seed - b.seed)

    monkeypatch.setattr(R, "cls_cka", fake)
    assert R.cls_ceiling(runs, None) == pytest.approx([0.9, 0.8, 0.9]) and all(calls)


def test_residual_shift_in_supervised_not_dino():
    sup, dino = [0.8, 0.75, 0.7, 0.3, 0.2, 0.15], [0.8, 0.78, 0.75, 0.72, 0.7, 0.7]
    assert W.rule_residual_shift({"supervised": _seeds(sup), "dino": _seeds(dino)}, GOOD).outcome == C.HELD
    assert (
        W.rule_residual_shift({"supervised": _seeds(sup[::-1]), "dino": _seeds([0.1] * 6)}, GOOD).outcome == C.NOT_HELD
    )
    noisy = {"supervised": [np.array(sup), np.array(sup[::-1]), np.array(dino)], "dino": _noisy(dino, 0.3)}
    assert W.rule_residual_shift(noisy, GOOD).outcome == C.INCONCLUSIVE
    assert W.rule_residual_shift({"supervised": _seeds(sup), "dino": []}, GOOD).outcome == C.NOT_TESTABLE
    assert W.rule_residual_shift({"supervised": _seeds([0.8]), "dino": _seeds([0.7])}, GOOD).outcome == (C.NOT_TESTABLE)


# -------------------------------------------------------------- a claim read from a study (fake runs)


def _run(name, unit, knn_top1, prev_unit=None):
    recipe = SimpleNamespace(
        model=SimpleNamespace(patch_size=4, arch="vit", head="cls"), data=SimpleNamespace(img_size=28)
    )
    acc = np.array([[0.1] * 5 + [knn_top1]])
    res = {
        "attention_distance": {"unit_square": unit, "pixels": unit * 20.0},
        "knn": {"acc": acc, "baseline": acc * 0 + 0.1, "pools": ["cls"], "n_query": 2560},
    }
    prev = {"attention_distance": {"unit_square": prev_unit, "pixels": prev_unit * 20}} if prev_unit is not None else {}
    return SimpleNamespace(name=name, label=name, recipe=recipe, results=res, prev=prev)


class FakeCtx:
    def __init__(self, configs):
        self.configs, self.shared, self.notes = configs, {}, []

    def last(self, run, measure, step=None, optional=False):
        return run.results.get(measure)

    def previous(self, run, measure):
        return run.prev.get(measure)


def _study(curves, knn, prev=None):
    return FakeCtx(
        {
            o: [_run(f"{o}_s{i}", d, knn[o], prev and prev[o][i]) for i, d in enumerate(_seeds(_dist(c), 0.003))]
            for o, c in curves.items()
        }
    )


def test_mae_stays_local_is_not_testable_when_every_head_is_near_uniform():
    """Issue's case: every head of every model at 0.96-0.99 x uniform attention: nothing can be local, so the claim
    is not testable (it was "inconclusive")."""
    u = uniform_distance(7, 4) / 20.0  # the fake runs' pixels are 20 x the unit square
    flat = {o: [0.96 * u] * 6 for o in N.OBJECTIVES}
    flat["mae"] = [0.95 * u] * 6
    knn = {"supervised": 0.9, "dino": 0.85, "mae": 0.6}
    r = W.reconstruction_stays_local(_study(flat, knn))
    assert r.outcome == C.NOT_TESTABLE and "no head of mae and supervised and dino has left uniform" in r.why.lower()
    r = W.reconstruction_stays_local(_study({"supervised": SUP, "dino": DINO, "mae": MAE}, knn))
    assert r.outcome == C.HELD and all(c.passed for c in r.decision.preconditions)
    # DINO at 0.64 of supervised's k-NN (the CPU study's): the claim waits for a DINO that is DINO
    r = W.reconstruction_stays_local(_study({"supervised": SUP, "dino": DINO, "mae": MAE}, {**knn, "dino": 0.576}))
    assert r.outcome == C.NOT_TESTABLE and "dino reaches 0.64 of supervised's k-nn top-1" in r.why.lower()
    # still moving between the last two checkpoints
    prev = {
        o: [np.asarray(_dist(c)) * 0.5 for _ in OFFSETS]
        for o, c in {"supervised": SUP, "dino": DINO, "mae": MAE}.items()
    }
    r = W.reconstruction_stays_local(_study({"supervised": SUP, "dino": DINO, "mae": MAE}, knn, prev))
    assert r.outcome == C.NOT_TESTABLE and "is still moving" in r.why


def test_records_read_back(tmp_path):
    p = paper("walmer2023")
    r = W.rule_cls_groups([0.7, 0.72, 0.71], [0.35, 0.37, 0.36], [0.9, 0.92, 0.91], GOOD)
    C.write_json(tmp_path / "t.json", "walmer", "walmer2023", [C.record(p.claims["cls_similar_by_supervision"], r)], [])
    back = C.read_json(tmp_path / "t.json")["claims"]["cls_similar_by_supervision"]
    assert back["verdict"] == "held" and back["figure"] == "Walmer Fig. 6 left, 19" and back["source"].endswith("§5.1")
    part = back["decision"]["parts"][0]
    assert part["ci"][0] > 0 and part["p"] < 0.05 and part["df"] == 2


# -------------------------------------------------------------- semantic claims: gated on the plateau, not the level


def test_plateau_precondition_reads_the_last_checkpoints_change_not_the_level():
    settled, moving, one = W.plateau_precondition(
        {
            "dino": {600: 0.50, 1200: 0.55, 1800: 0.56},  # steps of 9.1% and 1.8% of the later value: settled
            "mae": {600: 0.40, 1200: 0.55, 1800: 0.56},  # 27% in one step: still moving
            "supervised": {1800: 0.9},
        }
    )
    assert settled.passed and "every step within 9.1%" in settled.sentence
    assert not moving.passed and "27% in one step" in moving.sentence and "less than 10%" in moving.sentence
    assert one.passed and "so not checked" in one.sentence
    (last3,) = W.plateau_precondition({"dino": {s: v for s, v in zip((1, 2, 3, 4), (0.1, 0.5, 0.52, 0.53))}})
    assert last3.passed and last3.numbers["steps"] == [2, 3, 4]  # the first, far lower, checkpoint is not read


def _semantic_study(knn, purity, curves):
    """Fake runs with k-NN and clustering results at their last checkpoint, and k-NN curves over checkpoints."""
    ctx = _study({o: SUP for o in knn}, knn)
    for k, (o, runs) in enumerate(ctx.configs.items()):
        for r, off in zip(runs, OFFSETS):  # seeds differ, and differ per objective: no part is exactly constant
            off = off * (1 + k)
            r.results["knn"] = {**r.results["knn"], "acc": r.results["knn"]["acc"] + 0.003 * off}
            r.checkpoints = {s: None for s in curves[o]}
            r.by_step = {
                s: {**r.results["knn"], "acc": np.array([[0.1] * 5 + [v + 0.003 * off]])} for s, v in curves[o].items()
            }
            pur = np.array([[0.1] * 5 + [purity[o] + 0.003 * off]])
            r.results["clustering"] = {"purity": pur, "baseline_purity": pur * 0 + 0.1, "pools": ["cls"]}
    ctx.last = lambda run, measure, step=None, optional=False: (
        run.by_step.get(step) if step is not None and measure == "knn" else run.results.get(measure)
    )
    return ctx


def test_supervised_most_semantic_is_judged_however_low_dino_lands():
    """The issue's case: DINO at 0.64 of supervised's k-NN top-1 was "not testable" under the regime gate exactly when
    supervised won; gated on the plateau, a settled DINO is judged where it landed."""
    knn = {"supervised": 0.9, "dino": 0.576}
    flat = {o: {600: v - 0.01, 1200: v, 1800: v} for o, v in knn.items()}
    ctx = _semantic_study(knn, {"supervised": 0.8, "dino": 0.5}, flat)
    r = W.supervised_most_semantic(ctx)
    assert r.outcome != C.NOT_TESTABLE and all(c.name == "plateau" for c in r.decision.preconditions[:2])
    rising = {**flat, "dino": {600: 0.30, 1200: 0.45, 1800: 0.576}}  # DINO still learning: not testable, said so
    r = W.supervised_most_semantic(_semantic_study(knn, {"supervised": 0.8, "dino": 0.5}, rising))
    assert r.outcome == C.NOT_TESTABLE and "dino's k-nn top-1 over steps 600, 1200, 1800" in r.why.lower()
    assert "regime" not in {c.name for c in r.decision.preconditions}
