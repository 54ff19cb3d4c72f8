"""Raghu et al.'s claims (analysis/studies/raghu2021/) on synthetic per-seed results shaped like the paper's figure
(held), like its negation (did not hold), within the seed-to-seed noise (inconclusive), and with a failed precondition
(not testable); the claim engine (analysis/studies/claims.py): ids, plug-in discovery, the JSON record; the passages are
the papers' own sentences."""

import os
import re
import types
from pathlib import Path

import numpy as np
import pytest

from analysis import studies
from analysis.studies import claims as C
from analysis.studies.locality import uniform_distance
from analysis.studies.raghu2021 import PAPER
from analysis.studies.raghu2021 import numbers as N
from analysis.studies.raghu2021 import pilots as P
from analysis.studies.study_report import unformatted

CLAIMS = PAPER.claims
rng = np.random.default_rng(0)
# a folder with the papers' text (raghu2021-do-vits-see-like-cnns.md, walmer2023-teaching-matters.txt), e.g. converted
# from the PDFs: set VITLAB_PAPERS to check that every quoted passage is verbatim
PAPERS = Path(os.environ.get("VITLAB_PAPERS") or "/nonexistent")


class FakeRun:
    def __init__(self, name, tmp, depth=6, patch=4, img=28, width=96):
        self.name, self.path = name, Path(tmp) / name
        self.checkpoints = {100: self.path / "c100", 200: self.path / "c200"}
        self.recipe = types.SimpleNamespace(
            model=types.SimpleNamespace(depth=depth, patch_size=patch, embed_dim=width),
            data=types.SimpleNamespace(img_size=img),
        )


class FakeCtx:
    """What a claim reads, from a dict {(run name, measure): result} (and (run name, measure, "previous"))."""

    def __init__(self, tmp, results, configs, shared=None):
        self.results, self.configs = results, configs
        self.shared = shared or {}
        self.study = types.SimpleNamespace(root=Path(tmp))
        self.opts, self.notes = None, []

    def last(self, run, measure, step=None, optional=False):
        res = self.results.get((run.name, measure))
        if res is None and not optional:
            raise C.MissingResult(f"{measure} was not measured on {run.name}")
        return res

    def previous(self, run, measure):
        return self.results.get((run.name, measure, "previous"))

    def top1(self, run, step=None):
        return self.results.get((run.name, "top1"), float("nan"))


def _ctx(tmp_path, per_config: dict, measure: str, **kw):
    """A context whose configurations have one run per value of ``per_config[config]`` (seeds in order), each with
    that value as its result of ``measure``."""
    configs, results = {}, {}
    for c, values in per_config.items():
        configs[c] = []
        for i, v in enumerate(values):
            r = FakeRun(f"{c}_s{i}", tmp_path, **kw)
            configs[c].append(r)
            results[(r.name, measure)] = v
    return FakeCtx(tmp_path, results, configs)


# -------------------------------------------------------------- numbers of one model


def test_partition_uniformity_and_the_middle_half():
    m = np.full((4, 4), 0.2)
    m[:2, :2] = m[2:, 2:] = 0.9
    np.fill_diagonal(m, 1.0)
    p = N.partition(m, ["0.attn", "0.mlp", "1.attn", "1.mlp"], 1)
    assert p == {"across": pytest.approx(0.2), "within": pytest.approx(0.9)}
    assert N.uniformity(m) == {"mean_offdiag": pytest.approx((0.9 * 4 + 0.2 * 8) / 12), "first_last": 0.2}
    assert N.middle_mean([0, 1, 2, 3]) == pytest.approx(1.5)  # (l+1)/L = .25 .5 .75 1 -> blocks 1, 2
    assert N.middle_mean([0, 10, 20, 30, 40, 50]) == pytest.approx(20.0)  # blocks 1-3 of 6


def test_cls_phase_reads_log_ratios_and_leaves_out_block_zero():
    r = np.ones((2, 12, 5))
    r[:, :6, 0] = np.e  # CLS carried by the skip path in the first half: log gap +1 ...
    r[:, 6:, 1:] = np.e**2  # ... and the spatial tokens in the second: log gap -2
    r[:, 0, 0] = 1e6  # block 0: the image-independent CLS input, which the rule leaves out
    ph = N.cls_phase(r, 0, 1)
    assert ph["gap_first"] == pytest.approx(1.0) and ph["gap_second"] == pytest.approx(-2.0)
    assert (ph["blocks_first"], ph["blocks_second"]) == (5, 6)
    assert N.cls_phase(r[:, :6], 0, 1)["blocks_first"] == 2  # 6 blocks: blocks 1-2 in the first half


def test_erf_concentration_tells_gradual_from_midway():
    assert N.erf_concentration([1, 2, 3, 4, 5, 6, 7, 8, 9]) == pytest.approx(1 / 8)  # gradual
    assert N.erf_concentration([5, 5.5, 6, 14, 14.5, 15]) == pytest.approx(0.8)  # global midway
    assert np.isnan(N.erf_concentration([3, 2, 1]))


def test_checkpoint_selection_reads_validation_never_test():
    metas = {600: {"eval": {"top1": 0.80}}, 1200: {"eval": {"top1": 0.85}}, 1800: {"eval": {"top1": 0.83}}}
    step, why = N.select_checkpoint(metas)
    assert step == 1800 and "no held-out validation" in why and "1200: 0.8500" in why
    metas = {s: {**m, "val": {"top1": v}} for (s, m), v in zip(metas.items(), (0.9, 0.8, 0.85))}
    assert N.select_checkpoint(metas)[0] == 600


def test_go_no_go_reads_the_second_checkpoint_with_the_claims_own_threshold():
    u = uniform_distance(7, 4)  # 14.44 px; the claims' locality threshold is 0.8 x = 11.55 px
    flat = np.full((6, 8), 14.0)
    local = flat.copy()
    local[1, 3] = 5.0
    late = flat.copy()
    late[4, 0] = 2.0  # a local head in block 4: the claims count any block, so the pilot does too
    out, why = P.go_no_go({1500: flat, 3000: local, 4500: local}, u)
    assert out == P.GO and "step 3000" in why and "block 1, head 3" in why and "0.35 x" in why
    out, why = P.go_no_go({1500: local, 3000: late}, u)
    assert out == P.GO and "block 4, head 0" in why and "11.55 px" in why
    # vit_local_nomix_s0 (the case): a block-2 head at 11.3 px = 0.78 x, falling from 0.87 x: go (below 0.8 x)
    nomix0, nomix1 = flat.copy(), flat.copy()
    nomix0[2, 1], nomix1[2, 1] = 0.87 * u, 11.3
    assert P.go_no_go({1500: nomix0, 3000: nomix1}, u)[0] == P.GO  # the old check (0.7 x, blocks 0-1) said no-go
    # not below 0.8 x, but the most local head still falling by 10% or more of its distance: trains on
    falling0, falling1 = flat.copy(), flat.copy()
    falling0[3, 0], falling1[3, 0] = 0.97 * u, 0.85 * u  # a fall of 14% of 0.85 x
    out, why = P.go_no_go({1500: falling0, 3000: falling1}, u)
    assert out == P.GO and "still falling" in why and "14%" in why
    slow = falling1.copy()
    slow[3, 0] = 0.90 * u  # 0.97 -> 0.90: a fall of 8%, below the 10% that trains on
    out, why = P.go_no_go({1500: falling0, 3000: slow}, u)
    assert out == P.NO_GO and "0.90 x" in why and "11.55 px" in why and "not falling by 10%" in why
    assert P.go_no_go({1500: flat, 3000: flat}, u)[0] == P.NO_GO
    assert P.go_no_go({1500: local}, u)[0] == P.UNDECIDED
    assert P.go_no_go({1500: flat, 3000: None}, u)[0] == P.UNDECIDED


# -------------------------------------------------------------- the claims' four outcomes


def _phase(first: float, second: float, depth: int = 12, noise: float = 0.0) -> np.ndarray:
    r = np.ones((2, depth, 5))
    h = depth // 2
    r[:, 1:h, 0] = np.exp(first + rng.normal(0, noise))
    r[:, h:, 0] = np.exp(second + rng.normal(0, noise))
    return r


def _norm(ratio):
    return {"ratio": ratio, "sublayers": ["attn", "mlp"], "num_prefix_tokens": 1, "blocks": []}


def test_cls_phase_four_outcomes(tmp_path):
    def run(values, depth=12):
        return CLAIMS["cls_phase"].test(_ctx(tmp_path, {"vit_cls": [_norm(v) for v in values]}, "norm_ratio"))

    paper = [_phase(1.0, -1.0, noise=0.05) for _ in range(3)]
    assert run(paper).outcome == C.HELD
    r = run([_phase(-1.0, 1.0, noise=0.05) for _ in range(3)])
    assert r.outcome == C.NOT_HELD and "Holm" in r.why
    assert run([_phase(0.0, 0.0, noise=0.5) for _ in range(3)]).outcome == C.INCONCLUSIVE
    six = run([_phase(1.0, -1.0, depth=6, noise=0.05) for _ in range(3)])  # 2 kept blocks in the first half: enough
    assert six.outcome == C.HELD
    four = run([_phase(1.0, -1.0, depth=4, noise=0.05) for _ in range(3)])  # block 1 alone in the first half
    assert four.outcome == C.NOT_TESTABLE and "halves keep 1 and 2 blocks" in four.why
    assert C.ungated(four).outcome == C.HELD  # what the parts say with the gate off, reported beside it
    assert run(paper[:1]).outcome == C.NOT_TESTABLE  # one seed: no seed-to-seed variation


def test_cls_phase_is_not_testable_while_the_ratios_still_move(tmp_path):
    ctx = _ctx(tmp_path, {"vit_cls": [_norm(_phase(1.0, -1.0, noise=0.05)) for _ in range(3)]}, "norm_ratio")
    for r in ctx.configs["vit_cls"]:
        ctx.results[(r.name, "norm_ratio", "previous")] = _norm(_phase(0.5, -1.0))  # the first-half gap doubled
    res = CLAIMS["cls_phase"].test(ctx)
    assert res.outcome == C.NOT_TESTABLE and "still moving" in res.why


def _dist(lowest: float, depth: int = 6, heads: int = 4) -> dict:
    d = np.full((depth, heads), 14.0) + rng.normal(0, 0.1, (depth, heads))
    d[: depth // 2, 0] = lowest  # one local head per lower block
    return {"pixels": d}


def test_head_mix_needs_a_head_that_left_uniform_attention(tmp_path):
    def run(values):
        return CLAIMS["head_mix"].test(_ctx(tmp_path, {"vit_cls": values}, "attention_distance"))

    assert run([_dist(3.0) for _ in range(3)]).outcome == C.HELD
    flat = run([_dist(14.0) for _ in range(3)])  # every head near uniform (14.44 px)
    assert flat.outcome == C.NOT_TESTABLE and "has left uniform attention" in flat.why and "0.8 x" in flat.why


def test_cls_vs_gap_pools_the_two_configurations(tmp_path):
    def run(cls, gap):
        loc = [{"own_share": [0.5, v]} for v in cls]
        ctx = _ctx(tmp_path, {"vit_cls": loc, "vit_gap": [{"own_share": [0.5, v]} for v in gap]}, "localization")
        return CLAIMS["cls_localization"].test(ctx)

    held = run([0.70, 0.72, 0.71], [0.60, 0.61, 0.59])
    assert held.outcome == C.HELD and held.decision.parts[0].df == 4  # pooled over 2 configurations of 3 seeds
    assert run([0.60, 0.61, 0.59], [0.70, 0.72, 0.71]).outcome == C.NOT_HELD
    assert run([0.70, 0.60, 0.65], [0.66, 0.64, 0.69]).outcome == C.INCONCLUSIVE
    assert run([0.7], [0.6]).outcome == C.NOT_TESTABLE


def test_erf_four_outcomes(tmp_path):
    vit = [np.array([6.0, 6.5, 7.0, 13.0, 13.5, 14.0]) + e for e in (0.0, 0.1, -0.1)]  # wide early, global midway
    res = [np.array([1.0, 1.5, 2.0, 3.0, 4.0, 5.0, 7.0, 9.0]) * (1 + e) for e in (0.0, 0.05, -0.05)]  # gradual

    def run(a, b):
        ctx = _ctx(
            tmp_path,
            {"vit_cls": [{"mean_distance": np.c_[c]} for c in a], "resnet": [{"mean_distance": np.c_[c]} for c in b]},
            "erf",
        )
        return CLAIMS["erf"].test(ctx)

    assert run(vit, res).outcome == C.HELD
    assert run(res, vit).outcome == C.NOT_HELD
    assert run(vit[:1], res[:1]).outcome == C.NOT_TESTABLE


def test_a_claim_whose_configurations_are_missing_is_still_reported(tmp_path):
    ctx = _ctx(tmp_path, {"vit_cls": [_norm(_phase(1.0, -1.0, noise=0.05)) for _ in range(3)]}, "norm_ratio")
    ctx.configs = {"vit_cls": ctx.configs["vit_cls"]}
    slim = C.Paper("slim", "t", C.Claims("slim"))
    slim.claims._items = {k: CLAIMS[k] for k in ("cls_phase", "cls_localization")}
    out = C.run_claims(slim, ctx)
    assert [c.id for c, _ in out] == ["cls_phase", "cls_localization"]
    assert out[0][1].outcome == C.HELD
    assert out[1][1].outcome == C.NOT_TESTABLE and "no runs of vit_gap" in out[1][1].why


# -------------------------------------------------------------- the engine: ids, plug-ins, records


def test_claim_ids_are_unique_and_checked():
    cs = C.Claims("p")
    cs.claim("a", figure="f", claim="c", source="s", passage="p", rule="r")(lambda ctx: None)
    with pytest.raises(ValueError, match="declared twice"):
        cs.claim("a", figure="f", claim="c", source="s", passage="p", rule="r")(lambda ctx: None)
    with pytest.raises(KeyError, match="did you mean 'head_mix'"):
        CLAIMS.check(["head_mx"])
    CLAIMS.check(["head_mix", "cls_phase"])


PLUGIN = """
from analysis.studies.claims import Claims, Paper, Result, judge, one_part

CLAIMS = Claims("toy2030")


@CLAIMS.claim("bigger", figure="Fig. 1", claim="x is positive", source="Toy 2030", passage="x > 0.", rule="t test")
def bigger(ctx):
    return Result(judge([one_part("x", [ctx.last(r, "x") for r in ctx.configs["a"]])]))
"""


def test_a_paper_is_one_folder_and_a_claim_is_one_function(tmp_path, monkeypatch):
    pkg = tmp_path / "toy2030"
    pkg.mkdir()
    (pkg / "__init__.py").write_text(
        PLUGIN + 'PAPER = Paper("toy2030", "Toy", CLAIMS, applies=lambda configs: "a" in configs)\n'
    )
    monkeypatch.setattr(studies, "__path__", [*studies.__path__, str(tmp_path)])
    found = studies.papers(refresh=True)
    try:
        assert {"raghu2021", "toy2030"} <= set(found)
        toy = studies.paper("toy2030")
        ctx = _ctx(tmp_path, {"a": [1.0, 1.1, 0.9]}, "x")
        assert [c.id for c, _ in C.run_claims(toy, ctx)] == ["bigger"]
        assert C.run_claims(toy, ctx)[0][1].outcome == C.HELD
        with pytest.raises(KeyError, match="did you mean 'toy2030'"):
            studies.paper("toy2031")
        # a study file without a paper key is judged by the paper whose configurations it has
        study = types.SimpleNamespace(name="mine", paper=None)
        assert studies.paper_for(study, {"a": []}).name == "toy2030"
    finally:
        monkeypatch.undo()
        studies.papers(refresh=True)


def test_the_record_holds_every_part_with_its_interval(tmp_path):
    ctx = _ctx(tmp_path, {"vit_cls": [_norm(_phase(1.0, -1.0, noise=0.05)) for _ in range(3)]}, "norm_ratio")
    res = CLAIMS["cls_phase"].test(ctx)
    C.write_json(tmp_path / "r.json", "mini", "raghu2021", [C.record(CLAIMS["cls_phase"], res)], ["a note"])
    back = C.read_json(tmp_path / "r.json")
    rec = back["claims"]["cls_phase"]
    assert back["alpha"] == 0.05 and back["notes"] == ["a note"] and rec["verdict"] == "held"
    parts = rec["decision"]["parts"]
    assert len(parts) == 4 and all(p["ci"][0] > 0 for p in parts) and all(p["test"] == "one-sample t" for p in parts)
    md = "\n".join(C.section(1, CLAIMS["cls_phase"], res))
    assert "| attn: first-half log(CLS / spatial) | +" in md and "95% CI" in md and not unformatted(md)
    assert "- not checked: attn gap: no earlier checkpoint measured" in md


def test_unformatted_placeholders_are_found():
    assert unformatted("Why {C.GO_FRACTION:g}: and {REPORT_S} s") == ["{C.GO_FRACTION:g}", "{REPORT_S}"]
    assert unformatted('options {"cka": {"layers": "paper"}} and a set {1, 2}') == []


def test_claims_state_the_papers_direction_and_its_number():
    assert "first half" in CLAIMS["cls_phase"].claim and "reversed" in CLAIMS["cls_phase"].claim
    assert "4%" in CLAIMS["noskip_partition"].paper_value
    assert all(c.paper_value for c in CLAIMS)
    assert "30" in CLAIMS["data_probes"].paper_value
    assert "Fashion-MNIST" in CLAIMS["intermediate_probes"].rule  # what differs from the paper's setting


@pytest.mark.skipif(not PAPERS.is_dir(), reason="VITLAB_PAPERS (a folder with the papers' text) is not set")
def test_every_passage_is_quoted_from_its_paper():
    texts = {
        "Raghu": (PAPERS / "raghu2021-do-vits-see-like-cnns.md").read_text(),
        "Walmer": (PAPERS / "walmer2023-teaching-matters.txt").read_text(),
    }

    def flat(t: str) -> str:  # whitespace collapsed, hyphens dropped (line-end hyphenation splits words both ways)
        return re.sub(r"(\w)- (\w)", r"\1\2", " ".join(t.split())).replace("-", "")

    for c in PAPER.claims:  # Walmer's own plug-in checks its passages (tests/studies/test_claims_walmer.py)
        text = flat(texts[c.source.split()[0]])
        at = 0
        for piece in c.passage.split(" […] "):  # a figure the layout put inside the sentence
            at = text.find(flat(piece), at)
            assert at >= 0, (c.id, piece)


def test_no_committed_report_has_an_unformatted_placeholder():
    # the generated reports (a .json beside each); the hand-written pages quote YAML such as {k: 10}, which reads as
    # a format field
    docs = Path(__file__).resolve().parents[2] / "docs"
    reports = [f for f in sorted(docs.glob("*.md")) if f.with_suffix(".json").exists()]
    assert len(reports) >= 4
    for f in reports:
        assert unformatted(f.read_text()) == [], f.name


# -------------------------------------------------------------- the passages' key words: throughout, midway, poorly


def test_matched_blocks_and_block_ratios_by_hand():
    # ViT block b at (b + 0.5) / 6 against ResNet block j at (j + 0.5) / 8, nearest (ties: the lower block)
    assert N.matched_blocks(6, [True] * 8) == [0, 1, 3, 4, 5, 7]
    assert N.matched_blocks(6, [False] + [True] * 7) == [1, 1, 3, 4, 5, 7]  # block 0 a projection: not comparable
    r = np.ones((2, 3, 4))
    r[0, 1] = [1, 2, 3, 4]
    r[1, 1] = [5, 6, 7, 8]  # block 1: the median of 1..8 = 4.5
    assert np.allclose(N.block_ratios(r), [1.0, 4.5, 1.0])


def test_erf_midway_by_hand():
    # steps 10, 1, 1, 1, 1 of a 14-wide increase; the steps into blocks 2 and 3 (the middle third of 6) make 2 / 14 of
    # it, against 2 / 5 for an even growth
    assert np.isclose(N.erf_midway([0, 10, 11, 12, 13, 14]), 2 / 14 - 2 / 5)
    assert np.isclose(N.erf_midway([0, 1, 6, 11, 12, 13]), 10 / 13 - 2 / 5)  # global midway: positive
    assert np.isnan(N.erf_midway([3, 2, 1]))  # no increase


def test_erf_jump_at_the_first_block_is_not_midway(tmp_path):
    """The issue's case: the ViT's ERF jumps at block 0 -> 1, so "much more global midway" is reversed."""
    early = [np.array([1.0, 12.0 + e, 12.5, 13.0, 13.5, 14.0]) for e in (0.0, 0.3, -0.3)]  # seeds differ
    res = [np.array([1.0, 1.5, 2.0, 3.0, 4.0, 5.0, 7.0, 9.0]) * (1 + e) for e in (0.0, 0.05, -0.05)]
    ctx = _ctx(
        tmp_path,
        {"vit_cls": [{"mean_distance": np.c_[c]} for c in early], "resnet": [{"mean_distance": np.c_[c]} for c in res]},
        "erf",
    )
    r = CLAIMS["erf"].test(ctx)
    mid = r.decision.parts[2]
    assert "middle third" in mid.name and mid.effect < 0 and r.outcome == C.NOT_HELD


def test_cls_tokens_probing_as_well_as_the_resnets_do_not_do_poorly(tmp_path):
    """The issue's case: CLS-ViT spatial tokens at 0.72-0.75, the ResNet's about as good: GAP may beat CLS, but the
    CLS tokens do not "do poorly", so the claim does not hold as the passage words it."""
    per = {"vit_cls": [0.72, 0.75, 0.73], "vit_gap": [0.80, 0.82, 0.81], "resnet": [0.70, 0.71, 0.69]}
    ctx = _ctx(tmp_path, {c: [{"mean_over_tokens": [0.5, v]} for v in vs] for c, vs in per.items()}, "token_probes")
    r = CLAIMS["gap_token_probes"].test(ctx)
    assert [p.name.split(":")[0] for p in r.decision.parts] == [
        "last-block mean token-probe accuracy, GAP - CLS",
        "CLS ViT's tokens do poorly",
    ]
    assert r.decision.parts[0].effect > 0 and r.decision.parts[1].effect < 0 and r.outcome == C.NOT_HELD
    per["resnet"] = [0.90, 0.91, 0.92]  # the ResNet's tokens perform well, the CLS ViT's poorly: held
    ctx = _ctx(tmp_path, {c: [{"mean_over_tokens": [0.5, v]} for v in vs] for c, vs in per.items()}, "token_probes")
    assert CLAIMS["gap_token_probes"].test(ctx).outcome == C.HELD


def test_noskip_partition_tests_the_papers_4_points_beside_its_verdict(tmp_path, monkeypatch):
    """Raghu Fig. 8's caption gives a 4% drop for a middle block without its skip: the claim says whether 4 points lie
    inside our interval of the middle block's top-1 drop (here about 0.5 points, seeds tight: outside), in its Result,
    its JSON record and its report section, without changing the verdict."""
    import analysis.studies.raghu2021.claims as RC

    monkeypatch.setattr(RC, "compare", lambda *a, **k: None)  # the CKA grid figure needs real runs
    labels = [f"{i}.out" for i in range(6)]

    def cka(cross: float) -> dict:
        m = np.full((6, 6), 0.9)
        m[:3, 3:] = m[3:, :3] = cross
        np.fill_diagonal(m, 1.0)
        return {"matrix": m, "labels": labels}

    ctx = _ctx(
        tmp_path, {"vit_cls": [cka(0.8), cka(0.82), cka(0.81)], "noskip_b3": [cka(0.4), cka(0.42), cka(0.41)]}, "cka"
    )
    for c, top in (("vit_cls", [0.861, 0.868, 0.871]), ("noskip_b3", [0.858, 0.864, 0.862])):
        for r, t in zip(ctx.configs[c], top):
            ctx.results[(r.name, "top1")] = t
    r = CLAIMS["noskip_partition"].test(ctx)
    assert [m["part"] for m in r.magnitudes] == ["block 3 top-1 drop"]
    m = r.magnitudes[0]
    assert m["paper"] == 0.04 and not m["inside_ci"] and m["p"] < 0.05 and m["ours"] == pytest.approx(0.0053, abs=1e-4)
    rec = C.record(CLAIMS["noskip_partition"], r)
    assert rec["magnitudes"][0]["sentence"] == m["sentence"]
    text = "\n".join(C.section(2, CLAIMS["noskip_partition"], r))
    assert "The paper's number against ours:" in text and "the paper's +4 points lies outside our 95% CI" in text
