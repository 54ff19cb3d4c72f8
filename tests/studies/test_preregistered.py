"""Preregistration (analysis/studies/claims.py Threshold, Preregistration; each paper's preregistered.py): every gate
of every paper plug-in can pass in at least one shipped study file (by its model shape and budget), read from the one
place each paper declares its thresholds; the records carry ``preregistered`` (with the date and commit of each
threshold, and ``fixed_after_data`` where a gate came after the data) and ``verdict_ungated``; a sanity check is left
out of the tally."""

from functools import cache
from pathlib import Path

import numpy as np
import pytest
import yaml

from analysis.studies import claims as C
from analysis.studies import papers
from analysis.studies.raghu2021 import PAPER as RAGHU
from analysis.studies.raghu2021.preregistered import _halves
from analysis.studies.study import load_study
from train.recipe import load_recipe

ROOT = Path(__file__).resolve().parents[2]
STUDIES = sorted((ROOT / "recipes" / "studies").glob("*.yaml"))


@cache
def shipped() -> dict[str, list[tuple[str, str, dict]]]:
    """{paper: [(study file, configuration, shape)]} over the shipped study files (sweep files left out): each
    configuration's model shape and budget, from its recipe with the study's overrides, and its number of seeds."""
    out: dict[str, list] = {}
    for f in STUDIES:
        d = yaml.safe_load(f.read_text())
        if not isinstance(d, dict) or "study" not in d or "runs" not in d:
            continue  # a sweep file, not a study
        study = load_study(f)
        every = study.every_checkpoint or []
        for config, runs in study.configs().items():
            rec = load_recipe(runs[0].recipe, runs[0].overrides)
            shape = {
                "arch": rec.model.arch,
                "depth": int(rec.model.depth),
                "width": int(rec.model.embed_dim),
                "steps": int(rec.train.steps),
                "checkpoint_every": int(rec.train.checkpoint_every or 0),
                "seeds": len(runs),
                "every_checkpoint": list(every),
            }
            out.setdefault(study.paper or study.name, []).append((f.name, config, shape))
    return out


def test_every_paper_with_a_shipped_study_declares_its_thresholds_in_one_place():
    found = papers()
    assert {"raghu2021", "walmer2023", "registers"} <= set(shipped())
    for name in shipped():
        pre = found[name].preregistered
        assert pre is not None, name
        assert set(pre.gates) == set(found[name].claims.ids()), name  # every claim, () where it reads none
        for t in pre.thresholds:
            assert t.fixed.date and t.fixed.commit and t.means, (name, t.name)
            # no time: the commit that landed these (THIS_COMMIT), or "this commit (branch ...)" until it lands
            pending = t.fixed.commit == C.THIS_COMMIT or t.fixed.commit.startswith("this commit")
            assert pending == (t.fixed.when == ""), (name, t.name)


def test_every_gate_of_every_paper_can_pass_in_a_shipped_study():
    for name, shapes in shipped().items():
        for t in papers()[name].preregistered.thresholds:
            if t.kind not in ("gate", "go"):
                continue
            assert t.feasible is not None, f"{name}: gate {t.name} does not say what it needs of a study"
            passing = [(f, c) for f, c, s in shapes if t.can_pass(s)]
            assert passing, f"{name}: gate {t.name} = {t} cannot pass in any shipped study file"


def test_the_feasibility_check_catches_the_gates_that_could_never_pass():
    """The old gates the issue names, fed through the same check: each fails every shipped study of its paper."""
    shapes = shipped()
    old_phase = C.Threshold(
        4, "min_blocks_per_half", "old", C.TODAY, feasible=RAGHU.preregistered["min_blocks_per_half"].feasible
    )
    assert not any(old_phase.can_pass(s) for _, _, s in shapes["raghu2021"])  # 4 per half needs 10 blocks
    assert [_halves(d) for d in (6, 8, 10)] == [(2, 3), (3, 4), (4, 5)]  # counted as numbers.cls_phase counts them
    vit_l = C.Threshold(24, "regime_depth", "as a gate", C.TODAY, feasible=lambda v, s: s["depth"] >= v)
    assert not any(vit_l.can_pass(s) for _, _, s in shapes["registers"])  # registers claim 1's old gate
    assert RAGHU.preregistered["min_blocks_per_half"].can_pass({"depth": 6})


def test_a_gate_fixed_after_the_first_report_is_said_so(tmp_path):
    from test_claims import _ctx, _norm, _phase

    ctx = _ctx(tmp_path, {"vit_cls": [_norm(_phase(1.0, -1.0, depth=4, noise=0.05)) for _ in range(3)]}, "norm_ratio")
    claim = RAGHU.claims["cls_phase"]
    res = claim.test(ctx)
    rec = C.record(claim, res)
    pre = rec["preregistered"]
    assert set(pre["thresholds"]) == {"min_seeds", "min_blocks_per_half", "converged"}
    assert pre["thresholds"]["min_blocks_per_half"] == {
        "value": 2,
        "means": pre["thresholds"]["min_blocks_per_half"]["means"],
        "kind": "gate",
        "fixed": {"date": "2026-11-27", "commit": C.THIS_COMMIT},
        "previous": {"value": 4, "fixed": {"date": "2026-11-24", "commit": "b991488"}},
    }
    assert pre["thresholds"]["converged"]["fixed"] == {"date": "2026-11-24", "commit": "b991488"}
    assert pre["first_reported"] == {"date": "2026-11-23", "commit": "acd776f", "report": "docs/reproduction.md"}
    assert pre["fixed"] == {"date": "2026-11-27", "commit": C.THIS_COMMIT}  # the latest of its thresholds
    assert pre["fixed_after_data"] is True and "converged = 0.1 (fixed 2026-11-24, b991488)" in pre["note"]
    # 4 blocks: one kept block in the first half, so the gate fails; the parts themselves say held
    assert rec["verdict"] == C.NOT_TESTABLE and rec["verdict_ungated"] == C.HELD
    md = "\n".join(C.section(4, claim, res))
    assert "Preregistered thresholds: min_seeds = 2 (fixed 2026-11-23, 348f4ae)" in md
    assert "**Fixed after the data:" in md and "Verdict with the preconditions off: **held**." in md
    # a claim whose thresholds were all fixed before its first report: no such sentence
    drift = C.record(RAGHU.claims["data_locality"], res)["preregistered"]
    assert drift["fixed_after_data"] is False and drift["note"] is None
    # Walmer claim 4 (the issue's case): its regime gate came a day after the two-seed report
    w = papers()["walmer2023"].preregistered
    assert w.late("supervised_cls_sparse") == [w["regime"]] and w.sentence("supervised_cls_sparse")
    assert not papers()["registers"].preregistered.late("registers_cost_nothing")


def test_every_record_carries_preregistered_and_verdict_ungated(tmp_path):
    from test_claims import _ctx

    for name in shipped():
        p = papers()[name]
        for claim in p.claims:
            res = C.run_claims(C.Paper("one", "t", _only(claim)), _ctx(tmp_path, {}, "x"))[0][1]
            rec = C.record(claim, res)
            assert rec["preregistered"] is not None and "thresholds" in rec["preregistered"], claim.id
            assert rec["verdict_ungated"] in C.OUTCOMES and isinstance(rec["sanity"], bool), claim.id


def _only(claim):
    cs = C.Claims("one")
    cs._items = {claim.id: claim}
    return cs


def test_an_ungated_count_and_decision_agree_with_the_gated_one_when_every_gate_passes():
    good = C.Precondition("x", True, "fine")
    d = C.judge([C.one_part("a", [1.0, 1.1, 0.9])], [good])
    assert C.ungated(C.Result(d)) is d
    failed = C.judge([C.one_part("a", [1.0, 1.1, 0.9])], [C.Precondition("x", False, "no")])
    assert failed.outcome == C.NOT_TESTABLE and C.ungated(C.Result(failed)).outcome == C.HELD
    nothing = C.judge([C.one_part("a", [1.0])], [C.Precondition("x", False, "no")])  # one seed: no part at all
    assert C.ungated(C.Result(nothing)).outcome == C.NOT_TESTABLE


def test_the_sanity_check_is_shown_outside_the_tally():
    sanity = RAGHU.claims["skip_test_time"]
    assert sanity.sanity and sum(c.sanity for c in RAGHU.claims) == 1
    held = C.Result(C.judge([C.one_part("a", [1.0, 1.1, 0.9])]))
    none = C.Result(C.judge([C.one_part("a", [0.1, -0.2, 0.05])]))
    results = [(RAGHU.claims["cls_phase"], none), (RAGHU.claims["erf"], held), (sanity, held)]
    assert C.tally(results) == {C.HELD: 1, C.NOT_HELD: 0, C.INCONCLUSIVE: 1, C.NOT_TESTABLE: 0}
    lines = C.glance(results)
    tally_at = next(i for i, x in enumerate(lines) if x.startswith("Tally over the paper's 2 claim(s)"))
    assert "held 1" in lines[tally_at] and "inconclusive 1" in lines[tally_at]
    at = [i for i, x in enumerate(lines) if sanity.claim[:40] in x]
    assert len(at) == 1 and at[0] > tally_at and "Sanity checks" in "\n".join(lines[tally_at : at[0]])
    assert C.record(sanity, held)["sanity"] is True and C.record(RAGHU.claims["erf"], held)["sanity"] is False
    md = "\n".join(C.section(15, sanity, held))
    assert "left out of the tally" in md


@pytest.mark.parametrize("value", [0.0, 1.0])
def test_a_threshold_reads_as_its_number(value):
    t = C.Threshold(value + 0.5, "x", "a number", C.TODAY, kind="rule")
    assert t == value + 0.5 and f"{t}" == f"{value + 0.5:g}" and isinstance(t * 2, float)
    assert np.isclose(float(t), value + 0.5)
    with pytest.raises(ValueError, match="kind must be"):
        C.Threshold(1, "x", "y", C.TODAY, kind="limit")
