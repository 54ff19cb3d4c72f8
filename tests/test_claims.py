"""The claim rules (analysis/reports/claims.py) on synthetic inputs shaped like the paper's figure (held), like its
negation (did not hold), within the seed-to-seed noise (inconclusive), and with a failed precondition (not testable);
the passages are the papers' own sentences; the JSON record reads back."""

import os
from pathlib import Path

import numpy as np
import pytest

from analysis.reports import claims as C

rng = np.random.default_rng(0)
# a folder with the papers' text (raghu2021-do-vits-see-like-cnns.md, walmer2023-teaching-matters.txt), e.g. converted
# from the PDFs: set VITLAB_PAPERS to check that every quoted passage is verbatim
PAPERS = Path(os.environ.get("VITLAB_PAPERS") or "/nonexistent")


def _jitter(x, eps):
    return np.asarray(x, dtype=float) + rng.uniform(-eps, eps, np.shape(x))


# -------------------------------------------------------------- uniformity (Fig. 1, 2)


def _cka(first_last: float, off: float, n: int = 6):
    m = np.full((n, n), off)
    m[0, -1] = m[-1, 0] = first_last
    np.fill_diagonal(m, 1.0)
    return m


def test_uniformity_four_outcomes():
    vit, res = [_cka(0.8, 0.9), _cka(0.79, 0.89)], [_cka(0.3, 0.5), _cka(0.31, 0.52)]
    assert C.rule_uniformity(vit, res, 5, 8).outcome == C.HELD
    assert C.rule_uniformity(res, vit, 5, 8).outcome == C.NOT_HELD
    close = [_cka(0.80, 0.90), _cka(0.70, 0.80)]  # seed spread 0.1 against a 0.02 effect
    assert C.rule_uniformity(close, [_cka(0.77, 0.87), _cka(0.77, 0.87)], 5, 8).outcome == C.INCONCLUSIVE
    v = C.rule_uniformity(vit, res, 0, 4)
    assert v.outcome == C.NOT_TESTABLE and "0 of its 4 blocks" in v.why
    one = C.rule_uniformity(vit[:1], res[:1], 5, 8)
    assert (
        one.outcome == C.NOT_TESTABLE
        and "Fewer than two seeds" in one.why
        and "mean_offdiag: effect +0.407;" in one.why
    )


# -------------------------------------------------------------- no-skip partitions (Fig. 8)


def _labels(depth=6):
    return [f"{b}.{s}" for b in range(depth) for s in ("attn", "mlp")]


def _block_map(cut: int | None, across: float, depth: int = 6):
    n = 2 * depth
    m = np.full((n, n), 0.9)
    if cut is not None:
        m[: 2 * cut, 2 * cut :] = m[2 * cut :, : 2 * cut] = across
    np.fill_diagonal(m, 1.0)
    return m


def _run(m, top1, n=10000):
    return {"matrix": m, "labels": _labels(), "top1": top1, "n": n}


def test_noskip_partition_held_negated_noisy():
    base = [_run(_block_map(None, 0), 0.88), _run(_block_map(None, 0), 0.881)]
    cut = {3: [_run(_block_map(3, 0.3), 0.84), _run(_block_map(3, 0.31), 0.842)]}
    v = C.rule_noskip(base, cut, 6)
    assert v.outcome == C.HELD and "block 3" in v.ours and "3.95 ± 0.35 points" in v.ours  # next to the paper's 4%
    # negation: the no-skip map is MORE uniform across block 3 than the normal one, and top-1 rises
    neg = {3: [_run(_block_map(None, 0), 0.92), _run(_block_map(None, 0), 0.921)]}
    assert (
        C.rule_noskip([_run(_block_map(3, 0.5), 0.88), _run(_block_map(3, 0.5), 0.881)], neg, 6).outcome == C.NOT_HELD
    )
    # a 0.5-point drop on 10,000 images (SE of the mean difference over two seeds 0.33 points) is within 2 SE
    small = {3: [_run(_block_map(3, 0.3), 0.875), _run(_block_map(3, 0.3), 0.876)]}
    v = C.rule_noskip(base, small, 6)
    assert v.outcome == C.INCONCLUSIVE and v.noise_floor["block 3 top-1 drop"]["binomial_se"] == pytest.approx(
        0.00327, abs=1e-4
    )
    # block 5 is not a middle block: only the partition counts there
    assert (
        C.rule_noskip(base, {5: [_run(_block_map(5, 0.3), 0.95), _run(_block_map(5, 0.3), 0.95)]}, 6).outcome == C.HELD
    )


# -------------------------------------------------------------- norm ratios (Fig. 7)


def _ratios(cls_first, cls_second, spatial, blocks=6, tokens=5):
    r = np.full((2, blocks, tokens), float(spatial))
    r[:, : blocks // 2, 0] = cls_first
    r[:, blocks // 2 :, 0] = cls_second
    return r


def test_cls_phase_is_tested_in_the_papers_direction():
    # the paper: CLS high (skip-carried) in the first half, spatial tokens high in the second half
    paper = [_ratios(8, 1, 3), _jitter(_ratios(8, 1, 3), 0.05)]
    v = C.rule_cls_phase(paper, ["attn", "mlp"], 1)
    assert v.outcome == C.HELD, v.why
    # the old rule's shape (CLS starts below the spatial tokens and rises) is the negation
    old = [_ratios(0.3, 4.05, 3.6), _jitter(_ratios(0.3, 4.05, 3.6), 0.05)]
    assert C.rule_cls_phase(old, ["attn", "mlp"], 1).outcome == C.NOT_HELD
    noisy = [_ratios(3.2, 2.8, 3), _ratios(2.4, 3.6, 3)]  # gaps of +-0.2 with seed spreads of 0.8
    assert C.rule_cls_phase(noisy, ["attn", "mlp"], 1).outcome == C.INCONCLUSIVE
    gap = C.rule_cls_phase(paper, ["attn", "mlp"], 0)
    assert gap.outcome == C.NOT_TESTABLE and "no CLS token" in gap.why


def test_skip_dominance_needs_an_identity_shortcut():
    vit = [np.full((2, 6, 5), 4.0), np.full((2, 6, 5), 4.1)]
    res = [np.full((1, 8, 49), 1.5), np.full((1, 8, 49), 1.6)]
    mask = np.array([1, 1, 0, 1, 0, 1, 0, 1], dtype=bool)
    assert C.rule_skip_dominance(vit, res, mask).outcome == C.HELD
    assert C.rule_skip_dominance(res, vit, np.ones(6, bool)).outcome == C.NOT_HELD
    assert (
        C.rule_skip_dominance([np.full((2, 6, 5), 1.55), np.full((2, 6, 5), 1.65)], res, mask).outcome == C.INCONCLUSIVE
    )
    # only the identity blocks of the ResNet count: projections with a huge ratio are left out
    proj = [r.copy() for r in res]
    for r in proj:
        r[:, ~mask] = 100.0
    assert C.rule_skip_dominance(vit, proj, mask).outcome == C.HELD
    v = C.rule_skip_dominance(vit, res, np.zeros(4, bool))
    assert v.outcome == C.NOT_TESTABLE and "0 of its 4 blocks" in v.why


# -------------------------------------------------------------- attention distance (Fig. 3)


def test_head_mix_four_outcomes():
    u = C.uniform_distance(7, 4)
    assert u == pytest.approx(14.44, abs=0.01)  # uniform attention on the default 7x7 grid of 4-pixel patches
    paper = np.array([[2, 4, 14, 15], [3, 6, 14, 16], [13, 14, 15, 16], [14, 15, 15, 16]], dtype=float)
    assert C.rule_head_mix([paper, _jitter(paper, 0.2)], u).outcome == C.HELD
    negation = paper[::-1]  # local heads high, global low
    assert C.rule_head_mix([negation, _jitter(negation, 0.2)], u).outcome == C.NOT_HELD
    noisy = [paper, np.array([[13, 14, 15, 16], [14, 15, 15, 16], [2, 4, 14, 15], [3, 6, 14, 16]], dtype=float)]
    assert C.rule_head_mix(noisy, u).outcome == C.INCONCLUSIVE
    # the numbers: every head 13.4-15.7 px on the 7x7 grid: no local head
    flat = _jitter(np.full((6, 4), 14.5), 1.0)
    v = C.rule_head_mix([flat, flat], u)
    assert v.outcome == C.NOT_TESTABLE and "No head is local" in v.why and "7.22" in v.why


def test_head_mix_names_the_configuration_it_read():
    u = C.uniform_distance(7, 4)
    paper = np.array([[2, 4, 14, 15], [3, 6, 14, 16], [13, 14, 15, 16], [14, 15, 15, 16]], dtype=float)
    v = C.rule_head_mix([paper], u, "vit_local")
    assert v.outcome == C.NOT_TESTABLE and "vit_local (1)" in v.why


# -------------------------------------------------------------- head subsets (Fig. 5)


def _subsets(cka_local, cka_global, block0_min=2.0, windows=5, layers=3):
    """A head-subset result: windows from local to global with CKA falling linearly from cka_local to cka_global."""
    cka = np.linspace(cka_local, cka_global, windows)[:, None] + np.zeros(layers)
    heads = np.r_[block0_min, np.linspace(max(block0_min, 8.0), 15.0, windows + 2)]
    return {"subset_cka": cka, "subset_distance": np.linspace(block0_min + 3, 15, windows), "head_distance": heads}


def test_head_subsets_four_outcomes():
    u = C.uniform_distance(7, 4)
    paper = [_subsets(0.8, 0.4), _subsets(0.78, 0.41)]  # local heads most like the ResNet's lower layers
    v = C.rule_head_subsets(paper, u, "vit_local")
    assert v.outcome == C.HELD and v.measured["rank_corr"] == [pytest.approx(-1.0)] * 2, v.why
    assert v.measured["smallest_block0_px"] == 2.0
    assert C.rule_head_subsets([_subsets(0.4, 0.8), _subsets(0.41, 0.78)], u).outcome == C.NOT_HELD
    noisy = [_subsets(0.7, 0.6), _subsets(0.5, 0.6)]  # effects +0.1 and -0.1: seed spread 0.2
    assert C.rule_head_subsets(noisy, u).outcome == C.INCONCLUSIVE
    flat = [_subsets(0.6, 0.5, block0_min=13.0), _subsets(0.6, 0.5, block0_min=12.9)]  # no block-0 head below 7.22 px
    v = C.rule_head_subsets(flat, u)
    assert v.outcome == C.NOT_TESTABLE and "12.90 px" in v.why and "7.22 px" in v.why
    one = C.rule_head_subsets(paper[:1], u, "vit_local")
    assert one.outcome == C.NOT_TESTABLE and "vit_local (1)" in one.why


# -------------------------------------------------------------- the pilot check


def test_go_no_go_reads_the_second_checkpoint():
    u = C.uniform_distance(7, 4)  # 14.44 px; the threshold is 0.7 x = 10.11 px
    flat = np.full((6, 8), 14.0)
    local = flat.copy()
    local[1, 3] = 5.0  # block 1, head 3 is local
    late = flat.copy()
    late[4, 0] = 2.0  # a local head, but in block 4: not an early block
    out, why = C.go_no_go({1500: flat, 3000: local, 4500: local}, u)
    assert out == C.GO and "step 3000" in why and "block 1, head 3" in why and "0.35 x" in why
    out, why = C.go_no_go({1500: local, 3000: late}, u)  # only the SECOND checkpoint counts, and only blocks 0-1
    assert out == C.NO_GO and "0.97 x" in why and "10.11 px" in why
    assert C.go_no_go({1500: local}, u)[0] == C.UNDECIDED
    out, why = C.go_no_go({1500: flat, 3000: None}, u)
    assert out == C.UNDECIDED and "run the analyze stage" in why
    assert C.go_no_go({}, u)[0] == C.UNDECIDED
    edge = flat.copy()
    edge[0, 0] = C.GO_FRACTION * u  # exactly at the threshold: not below it
    assert C.go_no_go({1: flat, 2: edge}, u)[0] == C.NO_GO


# -------------------------------------------------------------- CLS vs GAP (Fig. 9-11), data subsets (Fig. 12)


def test_difference_rule():
    assert C.rule_difference("x", [0.7, 0.72], [0.6, 0.61], ("a", "b")).outcome == C.HELD
    assert C.rule_difference("x", [0.6, 0.61], [0.7, 0.72], ("a", "b")).outcome == C.NOT_HELD
    assert C.rule_difference("x", [0.70, 0.60], [0.66, 0.64], ("a", "b")).outcome == C.INCONCLUSIVE
    assert C.rule_difference("x", [0.7], [0.6], ("a", "b")).outcome == C.NOT_TESTABLE


def _curve(lower, upper, n=12):
    return np.r_[np.full(n // 2, lower), np.full(n // 2, upper)]


def test_data_drift():
    paper = {0.03: [_curve(0.95, 0.5), _curve(0.94, 0.52)], 0.3: [_curve(0.97, 0.85), _curve(0.97, 0.86)]}
    assert C.rule_data_drift(paper).outcome == C.HELD
    neg = {0.03: [_curve(0.5, 0.95), _curve(0.52, 0.94)], 0.3: [_curve(0.9, 0.4), _curve(0.9, 0.41)]}
    assert C.rule_data_drift(neg).outcome == C.NOT_HELD
    noisy = {0.03: [_curve(0.9, 0.7), _curve(0.8, 0.9)], 0.3: [_curve(0.9, 0.85), _curve(0.9, 0.75)]}
    assert C.rule_data_drift(noisy).outcome == C.INCONCLUSIVE
    assert C.rule_data_drift({0.03: paper[0.03]}).outcome == C.NOT_TESTABLE


def test_checkpoint_selection_reads_validation_never_test():
    metas = {600: {"eval": {"top1": 0.80}}, 1200: {"eval": {"top1": 0.85}}, 1800: {"eval": {"top1": 0.83}}}
    step, why = C.select_checkpoint(metas)
    assert step == 1800 and "no held-out validation" in why and "1200: 0.8500" in why
    metas = {s: {**m, "val": {"top1": v}} for (s, m), v in zip(metas.items(), (0.9, 0.8, 0.85))}
    assert C.select_checkpoint(metas)[0] == 600


# -------------------------------------------------------------- offset heads (Walmer)


def _heads(local, offset):
    loc, off = np.zeros((6, 4), bool), np.zeros((6, 4), bool)
    loc.flat[:local] = True
    off.flat[:offset] = True
    return {"local": loc, "offset_local": off}


def test_offset_heads():
    assert C.rule_offset_heads({"a": _heads(3, 1), "b": _heads(2, 2)}).outcome == C.HELD
    assert C.rule_offset_heads({"a": _heads(3, 0), "b": _heads(2, 0)}).outcome == C.NOT_HELD
    assert C.rule_offset_heads({"a": _heads(3, 1), "b": _heads(2, 0)}).outcome == C.INCONCLUSIVE
    v = C.rule_offset_heads({"a": _heads(0, 0), "b": _heads(0, 0)})
    assert v.outcome == C.NOT_TESTABLE and "0 of 48 heads" in v.why and v.ours == "0 of 48 heads local"


# -------------------------------------------------------------- passages and the JSON record


@pytest.mark.skipif(not PAPERS.is_dir(), reason="VITLAB_PAPERS (a folder with the papers' text) is not set")
def test_every_passage_is_quoted_from_its_paper():
    texts = {
        "Raghu": (PAPERS / "raghu2021-do-vits-see-like-cnns.md").read_text(),
        "Walmer": (PAPERS / "walmer2023-teaching-matters.txt").read_text(),
    }
    for c in C.CLAIMS.values():
        text = " ".join(texts[c.source.split()[0]].split())
        at = 0
        for piece in c.passage.split(" […] "):  # a figure the layout put inside the sentence
            at = text.find(" ".join(piece.split()), at)
            assert at >= 0, (c.id, piece)


def test_claims_state_the_papers_direction_and_the_json_reads_back(tmp_path):
    assert "first half" in C.CLAIMS["cls_phase"].claim and "reversed" in C.CLAIMS["cls_phase"].claim
    assert "4%" in C.CLAIMS["noskip_partition"].paper_value
    # every claim says the paper's number, or that its text states none
    assert all(c.paper_value for c in C.CLAIMS.values())
    assert [c.id for c in C.CLAIMS.values() if not c.paper_value.startswith("not stated as a number")] == [
        "noskip_partition",
        "offset_heads",
    ]
    v = C.rule_difference("x", [0.7, 0.72], [0.6, 0.61], ("a", "b"))
    recs = [C.record(C.CLAIMS["cls_localization"], v), C.record(C.CLAIMS["offset_heads"], C.rule_offset_heads({}))]
    C.write_json(
        tmp_path / "r.json", "mini", recs, ["a note"], {"pilots": {"a_s0": {"go": C.GO, "smallest": {3000: 5.0}}}}
    )
    back = C.read_json(tmp_path / "r.json")
    assert (
        back["noise_factor"] == C.NOISE_FACTOR and back["notes"] == ["a note"] and back["go_fraction"] == C.GO_FRACTION
    )
    assert back["pilots"] == {"a_s0": {"go": "go", "smallest": {"3000": 5.0}}}
    loc = back["claims"]["cls_localization"]
    assert (
        loc["verdict"] == "held"
        and loc["figure"] == "Raghu Fig. 9, 10"
        and loc["passage"].startswith("The results, shown in Figure 10")
    )
    assert loc["measured"]["x"]["a"] == [0.7, 0.72] and loc["noise_floor"]["x"]["threshold"] == pytest.approx(0.04)
    assert back["claims"]["offset_heads"]["verdict"] == "not testable"
    with pytest.raises(ValueError):
        C.Verdict("partly held")


# -------------------------------------------------------------- effective receptive fields (Fig. 6), probes (Fig. 13)


def test_erf_four_outcomes():
    vit = [np.array([6.0, 8.0, 11.0, 12.0, 12.5, 13.0]) + e for e in (0.0, 0.1)]  # wide early, global midway
    res = [np.array([1.0, 1.5, 2.0, 3.0, 4.0, 5.0, 7.0, 9.0]) + e for e in (0.0, 0.2)]  # local, growing gradually
    v = C.rule_erf(vit, res)
    assert v.outcome == C.HELD, v.why
    assert "lowest block ERF mean distance, ViT - ResNet (px): effect +4.9" in v.why
    assert C.rule_erf(res, vit).outcome == C.NOT_HELD  # the negation
    noisy = [vit[0], vit[0] * 0.3]  # the ViT's seeds disagree by more than the effect
    assert C.rule_erf(noisy, res).outcome == C.INCONCLUSIVE
    assert C.rule_erf(vit[:1], res[:1]).outcome == C.NOT_TESTABLE  # one seed: no floor


def test_middle_mean_reads_the_middle_half_of_any_depth():
    assert C.middle_mean([0, 1, 2, 3]) == pytest.approx(1.5)  # (l+1)/L = .25 .5 .75 1 -> blocks 1, 2
    assert C.middle_mean([0, 1, 2, 3, 4, 5, 6, 7]) == pytest.approx(3.5)  # blocks 2-5 of 8
    assert C.middle_mean([0, 10, 20, 30, 40, 50]) == pytest.approx(20.0)  # blocks 1-3 of 6 (.33 .5 .67)
    v = C.rule_difference("middle-half 10-shot accuracy, ViT - ResNet", [0.8, 0.81], [0.6, 0.62], ("vit_cls", "resnet"))
    assert v.outcome == C.HELD
