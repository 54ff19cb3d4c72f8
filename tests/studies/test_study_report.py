"""The study report's pilot section, its choice of the configuration the locality claims read, and the CKA floors
(analysis/studies/study_report.py, analysis/estimators/baselines.py), on synthetic run folders: a recipe.yaml,
checkpoint meta.json files and saved attention distances, no training. The full report on trained tiny runs is in
tests/e2e/test_study.py."""

import dataclasses
import json
import types

import numpy as np
import pytest
import torch
import yaml
from conftest import TINY, _merge, class_split

from analysis.engine.measure import save_result
from analysis.engine.suite import make_context, run_suite, suite_options
from analysis.estimators import baselines as B
from analysis.measures.cka import cka_layers
from analysis.studies import study_report as R
from analysis.studies import study_runs as SR
from analysis.studies.locality import uniform_distance
from analysis.studies.raghu2021 import pilots as C
from analysis.studies.study import load_study
from train.checkpoint import step_dir_name
from train.models import build_model
from train.recipe import dump, from_dict

pytestmark = pytest.mark.usefixtures("one_thread")

HEADS, DEPTH, STEPS = 4, 3, 4500
UNIFORM = uniform_distance(7, 4)  # 14.44 px on the 7x7 grid of 4-pixel patches


def _recipe(tmp_path) -> str:
    (tmp_path / "tiny.yaml").write_text(
        yaml.safe_dump(
            _merge(
                TINY,
                {
                    "model": {"depth": DEPTH, "num_heads": HEADS},
                    "callbacks": [],
                    "train": {"steps": STEPS, "eval_every": 1500, "checkpoint_every": 1500},
                },
            )
        )
    )
    return "tiny.yaml"


def _study(tmp_path, configs=("vit_cls", "vit_local", "vit_local_nomix")):
    runs = {c: {"recipe": _recipe(tmp_path)} for c in configs}
    if "vit_local_nomix" in runs:
        runs["vit_local_nomix"]["seeds"] = [0]
    p = tmp_path / "s.yaml"
    p.write_text(
        yaml.safe_dump(
            {
                "study": "mini",
                "paper": "raghu2021",
                "root": str(tmp_path / "runs"),
                "report": str(tmp_path / "docs" / "r.md"),
                "seeds": [0, 1],
                "runs": runs,
            }
        )
    )
    return load_study(p)


def _fake_run(study, name: str, distances: dict, final: bool = False) -> None:
    """A run folder of study run ``name`` with a checkpoint (meta.json only) at every step of ``distances`` and, where
    the value is not None, a saved attention distance [DEPTH, HEADS] there."""
    sr = study.runs[name]
    d = sr.run_dir
    d.mkdir(parents=True)
    recipe = from_dict(yaml.safe_load((sr.recipe.parent / sr.recipe.name).read_text()), name=name)
    (d / "recipe.yaml").write_text(dump(recipe))
    for step, dist in distances.items():
        ck = d / "checkpoints" / step_dir_name(step)
        ck.mkdir(parents=True)
        meta = {"step": step, "final": final and step == max(distances), "eval": {"top1": 0.8, "n": 250}, "files": {}}
        (ck / "meta.json").write_text(json.dumps(meta))
        if dist is not None:
            a = d / "analysis" / step_dir_name(step)
            a.mkdir(parents=True)
            px = np.asarray(dist, dtype=float)
            save_result(
                {
                    "pixels": px,
                    "unit_square": px / 24,
                    "pixel_level": px + 1,
                    "blocks": [f"blocks.{i}" for i in range(DEPTH)],
                    "patch_size": 4,
                },
                a / "attention_distance.npz",
            )


FLAT = np.full((DEPTH, HEADS), 14.0)
LOCAL = FLAT.copy()
LOCAL[0, 2] = 5.0  # block 0, head 2: 0.35 x uniform, a local head


def test_pilot_section_go_no_go_and_runs_missing_or_unfinished(tmp_path):
    s = _study(tmp_path)
    _fake_run(s, "vit_cls_s0", {1500: FLAT, 3000: FLAT, 4500: FLAT}, final=True)
    _fake_run(s, "vit_cls_s1", {1500: FLAT}, final=False)
    _fake_run(s, "vit_local_s0", {1500: FLAT, 3000: LOCAL, 4500: None})  # unfinished, last checkpoint not measured yet
    _fake_run(s, "vit_local_nomix_s0", {1500: FLAT, 3000: FLAT, 4500: FLAT}, final=True)
    (s.runs["vit_local_s1"].run_dir / "checkpoints").mkdir(parents=True)  # started, no complete checkpoint
    runs, absent = R.open_runs(s)
    assert set(runs) == {"vit_cls_s0", "vit_cls_s1", "vit_local_s0", "vit_local_nomix_s0"}
    assert absent == {"vit_local_s1": "no complete checkpoint yet"}
    text, records, _notes, extra, _paper = R._report(s, runs, absent)  # no ResNet: every claim said, none decided
    assert "## Pilot runs: choosing a regime where local heads can appear" in text and not R.unformatted(
        text.replace("{REPORT_S}", "1")
    )
    verdicts = {r["id"]: r["verdict"] for r in records}
    assert set(verdicts) == set(_paper.claims.ids()) and set(verdicts.values()) <= {"not testable", "inconclusive"}
    assert "no runs of resnet" in next(r["why"] for r in records if r["id"] == "uniformity")
    assert f"below {C.LOCALITY_PRECONDITION:g} x uniform" in text and "0.28 x" in text  # the claims' own threshold
    go = extra["pilots"]
    assert {k: v["go"] for k, v in go.items()} == {
        "vit_cls_s0": C.NO_GO,
        "vit_cls_s1": C.UNDECIDED,
        "vit_local_s0": C.GO,
        "vit_local_s1": C.UNDECIDED,
        "vit_local_nomix_s0": C.NO_GO,
    }
    assert (
        "**vit_local_s0** (unfinished (step 4500 of 4500); 7x7 grid of 4-pixel patches, 4 heads; uniform attention "
        "14.44 px)" in text
    )
    assert (
        "Go/no-go: **go**: at the second checkpoint (step 3000) the most local head (block 0, head 2) "
        "attends at 5.00 px = 0.35 x uniform" in text
    )
    assert (
        "**vit_local_s1**: no complete checkpoint yet: no attention distance to show. Go/no-go: **undecided**." in text
    )
    assert (
        "the check reads the second scheduled checkpoint (step 3000), which the run has not reached yet" in text
    )  # vit_cls_s1
    # the table: smallest head / mean over heads by block at every checkpoint, "-" where not measured
    assert "| block | step 1500 | step 3000 | step 4500 |" in text
    assert (
        "| 0 | 14.0 / 14.0 | 5.0 / 11.8 | - |" in text and "| any block: smallest / uniform | 0.97 | 0.35 | - |" in text
    )
    # the runs table says which runs are missing or unfinished
    assert "| vit_local_s1 | vit_local | 1 |" in text and "no complete checkpoint yet | - |" in text
    assert "(unfinished (step 1500 of 4500))" in text
    fig = tmp_path / "docs" / "figures" / "mini" / "pilot_attention_distance.png"
    assert fig.is_file() and "figures/mini/pilot_attention_distance.png" in text
    assert go["vit_local_s0"]["smallest_px"] == {1500: 14.0, 3000: 5.0, 4500: None}
    thresholds = extra["go_no_go_preregistered"]  # the go/no-go's limits, with when they were fixed
    assert thresholds["locality"]["value"] == 0.8 and thresholds["still_falling"]["fixed"]["date"] == "2026-11-27"


def test_a_missing_pilot_is_said_but_a_missing_study_run_is_an_error(tmp_path):
    s = _study(tmp_path)
    _fake_run(s, "vit_cls_s0", {1500: FLAT}, final=True)
    _fake_run(s, "vit_cls_s1", {1500: FLAT}, final=True)
    runs, absent = R.open_runs(s)  # no vit_local run exists at all
    assert set(absent) == {"vit_local_s0", "vit_local_s1", "vit_local_nomix_s0"}
    assert set(absent.values()) == {"not started (no run folder)"}
    text = R._report(s, runs, absent)[0]
    assert text.count("not started (no run folder): no attention distance to show") == 3
    (tmp_path / "b").mkdir()
    s2 = _study(tmp_path / "b")  # a second study with nothing trained: vit_cls missing is an error, not a pilot
    with pytest.raises(R.RF0.AnalysisError, match="study run 'vit_cls_s0' is not trained yet"):
        R.open_runs(s2)
    # a run named alone is opened while its study's other runs are still untrained (analysis as each run finishes)
    _fake_run(s2, "vit_cls_s1", {1500: FLAT}, final=True)
    runs, absent = R.open_runs(s2, {"vit_cls_s1"})
    assert set(runs) == {"vit_cls_s1"} and absent == {}


def test_the_locality_claims_prefer_vit_local_when_all_its_seeds_have_finished(tmp_path):
    s = _study(tmp_path)
    for n in ("vit_cls_s0", "vit_cls_s1", "vit_local_s0"):
        _fake_run(s, n, {1500: FLAT, 3000: LOCAL, 4500: LOCAL}, final=True)
    _fake_run(s, "vit_local_s1", {1500: FLAT, 3000: LOCAL})  # still training

    def choice():
        runs, absent = R.open_runs(s)
        return C.choose_locality(s, runs, absent, SR.configs(s, runs))

    loc = choice()
    assert loc["config"] == "vit_cls" and [r.name for r in loc["runs"]] == ["vit_cls_s0", "vit_cls_s1"]
    assert "vit_local has not finished (vit_local_s1: unfinished (step 3000 of 4500))" in loc["why"]
    assert "not enough data" in loc["why"]
    meta = s.runs["vit_local_s1"].run_dir / "checkpoints" / step_dir_name(4500)
    meta.mkdir()
    (meta / "meta.json").write_text(
        json.dumps({"step": 4500, "final": True, "eval": {"top1": 0.8, "n": 250}, "files": {}})
    )
    loc = choice()
    assert loc["config"] == "vit_local" and [r.name for r in loc["runs"]] == ["vit_local_s0", "vit_local_s1"]
    assert "seeds 0, 1" in loc["why"] and "not enough data" in loc["why"]
    # a study without the configuration reads vit_cls and says so
    (tmp_path / "c").mkdir()
    s3 = _study(tmp_path / "c", ("vit_cls",))
    for n in ("vit_cls_s0", "vit_cls_s1"):
        _fake_run(s3, n, {1500: FLAT}, final=True)
    runs, absent = R.open_runs(s3)
    loc = C.choose_locality(s3, runs, absent, SR.configs(s3, runs))
    assert loc["config"] == "vit_cls" and "has no vit_local configuration" in loc["why"]


def test_the_check_reads_the_second_scheduled_checkpoint_and_a_no_go_stops_the_locality_family(tmp_path):
    # a clean stop wrote a checkpoint at 2614 between the scheduled 1500 and 3000: the check still reads 3000
    by = {1500: FLAT, 2614: LOCAL, 3000: FLAT}
    assert C.go_no_go(by, UNIFORM, 3000)[0] == C.NO_GO and C.go_no_go(by, UNIFORM)[0] == C.GO  # (unscheduled: shifted)
    outcome, why = C.go_no_go({1500: FLAT, 2614: FLAT}, UNIFORM, 3000)
    assert outcome == C.UNDECIDED and "has not reached yet (checkpoints: 1500, 2614)" in why
    s = _study(tmp_path)
    for n in ("vit_cls_s0", "vit_cls_s1"):
        _fake_run(s, n, {1500: FLAT, 3000: FLAT, 4500: FLAT}, final=True)
    _fake_run(s, "vit_local_s0", {1500: FLAT, 2614: LOCAL, 3000: FLAT})  # stopped at its check: no-go
    runs, absent = R.open_runs(s)
    assert C.pilot_check(runs["vit_local_s0"])[0] == C.NO_GO
    loc = C.choose_locality(s, runs, absent, SR.configs(s, runs))
    assert loc["config"] == "vit_cls" and loc.get("stopped")
    assert (
        "vit_local stopped at its go/no-go check (vit_local_s0, step 3000 of 4500: at the second checkpoint"
        in loc["why"]
    )
    # it stopped a third of the way: the report must not say that the longer regime shows no local heads
    assert "whether it would show local heads there is not known" in loc["why"] and "either" not in loc["why"]
    assert "0.97 x uniform" in loc["why"] and "not enough data" in loc["why"]
    # the configuration's other seed is absent by design, and said so
    assert absent == {
        "vit_local_s1": "not trained: its configuration stopped at the go/no-go check of vit_local_s0",
        "vit_local_nomix_s0": "not started (no run folder)",
    }


def test_the_positive_control_section_says_whether_the_detectors_find_the_forced_heads(tmp_path):
    forced = [
        {"blocks": [0], "heads": [0], "offset": [0, 0], "radius": 1},
        {"blocks": [0], "heads": [1], "offset": [0, 1], "radius": 0},
    ]
    (tmp_path / "control.yaml").write_text(
        yaml.safe_dump(
            _merge(
                yaml.safe_load((tmp_path / _recipe(tmp_path)).read_text()),
                {"interventions": {"local_attention": forced}},
            )
        )
    )
    p = tmp_path / "s.yaml"
    p.write_text(
        yaml.safe_dump(
            {
                "study": "mini",
                "paper": "raghu2021",
                "root": str(tmp_path / "runs"),
                "report": str(tmp_path / "docs" / "r.md"),
                "runs": {"control": {"recipe": "control.yaml", "seeds": [0]}},
            }
        )
    )
    s = load_study(p)
    dist = FLAT.copy()
    dist[0, 0], dist[0, 1], dist[2, 3] = 4.1, 3.5, 6.0  # the forced heads, and a free head that is local too
    _fake_run(s, "control_s0", {1500: dist}, final=True)
    local = np.zeros((DEPTH, HEADS), bool)
    local[0, :2] = True
    peaks = np.zeros((DEPTH, HEADS, 2), int)
    peaks[0, 1] = (0, 1)

    def aligned(peak):
        peaks[0, 1] = peak
        save_result(
            {"local": local, "offset_local": local & (np.abs(peaks).max(-1) > 0), "peak_offset": peaks},
            s.runs["control_s0"].run_dir / "analysis" / step_dir_name(1500) / "aligned_attention.npz",
        )
        runs, _ = R.open_runs(s)
        return C.control_check(runs["control_s0"], UNIFORM)

    c = aligned((0, 1))
    assert c["passed"] and [(x["block"], x["head"]) for x in c["heads"]] == [(0, 0), (0, 1)]
    assert c["heads"][1]["distance_px"] == 3.5 and c["free_local"] == ["block 2 head 3"]
    c = aligned((1, 0))  # the offset head found local but at the wrong offset: the detector failed
    assert not c["passed"] and c["heads"][1]["found"] == {"distance": True, "aligned_local": True, "offset": False}
    runs, _ = R.open_runs(s)
    doc = R.Doc(s)
    C.control_section(R.Context(s, runs, {}, SR.configs(s, runs), doc, None))
    text = "\n".join(doc.lines)
    assert doc.data["positive_control"]["passed"] is False
    assert "| block 0 head 1 | offset (0, 1), radius 0 | 3.50 (0.24 x) | yes | yes | **no** (1, 0) |" in text
    assert "Detectors: **FAILED**; heads that are local without being forced: block 2 head 3." in text


# -------------------------------------------------------------- CKA floors (analysis/estimators/baselines.py)


def _vit(seed: int):
    torch.manual_seed(seed)
    return build_model(from_dict(_merge(TINY, {"model": {"depth": 2}})), 10).eval()


class _Split(types.SimpleNamespace):
    def __len__(self):
        return len(self.labels)


def test_cka_floors_against_the_maps_and_the_random_init():
    split = _Split(**vars(class_split(32, seed=3)))
    data = types.SimpleNamespace(analysis=split, probe_train=split, normalize=lambda x: x.float() / 255, num_classes=10)
    model = _vit(0)
    ctx = make_context(model, data, 16)
    layers = cka_layers(ctx, "paper")
    same = B.cka_floors(model, _vit(0), split.images, data.normalize, layers, ctx.prefix, batch_size=16)
    other = B.cka_floors(model, _vit(1), split.images, data.normalize, layers, ctx.prefix, batch_size=16)
    # the floors' map of the trained model is the map the cka measure draws (same layers, images, estimator)
    cka = run_suite(model, data, suite_options(["cka"], 16, {"cka": {"layers": "paper"}}))["cka"]
    assert [str(x) for x in same["labels"]] == [str(x) for x in cka["labels"]]
    np.testing.assert_allclose(same["matrix"], cka["matrix"], atol=1e-6)
    # the same weights at "init": every layer matches itself, and the init map and pixel CKA are the trained ones
    np.testing.assert_allclose(same["init_same"], 1.0, atol=1e-6)
    np.testing.assert_allclose(same["init_matrix"], same["matrix"], atol=1e-6)
    np.testing.assert_allclose(same["init_pixels"], same["pixels"], atol=1e-6)
    # another initialisation: a layer is no longer identical to its counterpart, and pixel CKA is a proper CKA
    assert other["init_same"].min() < 0.99 and np.all((other["pixels"] > -0.1) & (other["pixels"] <= 1 + 1e-6))
    assert len(other["taps"]) == len(layers) and other["taps"][-1].endswith(".out")
    with pytest.raises(ValueError, match="fewer than 4"):
        B.cka_floors(model, model, split.images[:18], data.normalize, layers, ctx.prefix, batch_size=16)


def test_analyze_and_report_stages_go_on_without_the_pilot_runs(tmp_path, capsys):
    s = _study(tmp_path, ("vit_local", "vit_local_nomix"))
    assert R.analyze_study(s) == 0 and R.write_report(s) == 0
    out = capsys.readouterr().out
    assert "pilot run vit_local_s1: not started (no run folder); left out of the analysis" in out
    text = s.report.read_text()
    assert "| vit_local_nomix_s0 | vit_local_nomix | 0 |" in text and text.count("not started (no run folder)") == 6
    back = json.loads(s.report.with_suffix(".json").read_text())  # every claim, not testable without a ResNet
    assert {c["id"]: c["verdict"] for c in back["claims"]}["uniformity"] == "not testable"
    assert back["across_claims"]["tested"] == 0 and back["across_claims"]["claims"] == {}
    assert "Across claims: no claim was tested" in text


def test_the_json_and_the_report_correct_across_claims(tmp_path):
    """write_json's across_claims (Holm and Benjamini-Hochberg over the tested claims, a sanity check left out) and
    the report's paragraph and table; every t part carries power_2sd and mde."""
    from analysis.studies import claims as CL
    from analysis.studies import stats as S

    def claim(i, sanity=False):
        c = CL.Claim(i, "Fig. 1", f"claim {i}", "Someone 2030", "a passage", "a rule")
        return dataclasses.replace(c, sanity=True) if sanity else c

    ok = [1.0, 1.1, 0.9]
    results = [
        (claim("strong"), CL.Result(S.decide([S.one_sample_part("a", [3.0, 3.1, 2.9])]))),  # p 0.00035
        (claim("weak"), CL.Result(S.decide([S.two_sample_part("b", ok, [0.0, 0.5, 0.2])]))),  # Welch, p 0.016
        (claim("none"), CL.Result(S.decide([S.one_sample_part("c", [0.2, -0.5, 0.6])]))),
        (claim("sane", sanity=True), CL.Result(S.decide([S.one_sample_part("d", ok)]))),
        (claim("nt"), CL.Result(S.decide([S.one_sample_part("e", ok)], False))),
    ]
    records = [CL.record(c, r) for c, r in results]
    CL.write_json(tmp_path / "s.json", "mini", "toy", records, [])
    back = json.loads((tmp_path / "s.json").read_text())
    acc = back["across_claims"]
    assert set(acc["claims"]) == {"strong", "weak", "none"} and acc["tested"] == 3 and acc["alpha"] == 0.05
    p = {k: v["p"] for k, v in acc["claims"].items()}
    assert p["strong"] == pytest.approx(results[0][1].decision.parts[0].p) and p["weak"] > p["strong"]
    hp = sorted(p.values())  # Holm by hand: 3 p1, max(3 p1, 2 p2), max(.., p3)
    assert acc["claims"]["strong"]["holm_p"] == pytest.approx(3 * hp[0])
    assert acc["claims"]["weak"]["holm_p"] == pytest.approx(max(3 * hp[0], 2 * hp[1]))
    assert (acc["held"], acc["held_after_holm"]) == (2, 1 + (2 * p["weak"] < 0.05))
    assert acc["held_after_bh"] == 1 + (1.5 * p["weak"] < 0.05)  # BH: q = min(3/2 p_(2), p_(3))
    parts = [q for r in back["claims"] for q in r["decision"]["parts"]]
    assert all(0 < q["power_2sd"] < 1 and q["mde"] > 0 for q in parts)
    assert next(r for r in back["claims"] if r["id"] == "sane")["sanity"] is True
    lines = "\n".join(R.across_lines(acc))
    assert "Over the 3 tested claim(s)" in lines and "| strong | held |" in lines and "| none | inconclusive |" in lines
    assert "sane" not in lines and "| claim | verdict | p | Holm p | BH q | held after Holm / BH |" in lines
    # the claim's section: a part that is not significant says what it could detect; a degenerate part has no p
    part = results[2][1].decision.parts[0]
    md = "\n".join(CL.section(3, results[2][0], results[2][1]))
    assert f"| not significant (power at 2 SD {100 * part.power_2sd:.0f}%, MDE {part.mde:.2g}) |" in md
    flat = CL.Result(S.decide([S.one_sample_part("f", [0.5, 0.5, 0.5])]))
    md = "\n".join(CL.section(4, results[0][0], flat))
    assert "| f | +0.5 | [+0.5, +0.5] | - | one-sample t, df 2 | 1 | degenerate |" in md and "not testable" in md


def test_runs_table_shows_each_override_key_once_with_its_last_value():
    """The study's overrides come first and a configuration's after; the recipe applies them in order, so the
    table shows what the run got: val_size 0, not both 5000 and 0."""
    ov = ["callbacks=[]", "data.val_size=5000", "callbacks=[attention_distance]", "data.val_size=0", "seed=0"]
    assert R.effective_overrides(ov) == "callbacks=[attention_distance] data.val_size=0 seed=0"
    assert R.effective_overrides([]) == "-"


def test_analyze_only_some_configurations(tmp_path, monkeypatch, capsys):
    """``--stage analyze --only C``: only C's runs are analysed (so processes can split a study's analysis by
    configuration), and a partial pass is not recorded as the study's analysis time."""
    s = _study(tmp_path, ("vit_cls", "vit_gap"))
    runs = {name: types.SimpleNamespace(name=name) for name in s.runs}
    seen = []
    opened = []

    def open_runs(study, names=None):
        opened.append(names)
        return ({n: r for n, r in runs.items() if names is None or n in names}, {})

    monkeypatch.setattr(R, "open_runs", open_runs)
    monkeypatch.setattr(R.RN, "analyze_run", lambda run, steps, opts: seen.append((run.name, steps)))
    monkeypatch.setattr(R.R, "progress", lambda run: (True, "finished"))
    monkeypatch.setattr(R, "write_run_report", lambda run: None)
    assert R.analyze_study(s, ["vit_gap"]) == 0
    assert sorted({n for n, _ in seen}) == ["vit_gap_s0", "vit_gap_s1"] and ("vit_gap_s0", ["last"]) in seen
    assert "analysed vit_gap in" in capsys.readouterr().out
    assert "analyze_s" not in R._times(s)
    assert opened[-1] == {"vit_gap_s0", "vit_gap_s1"}  # the others are not opened: they may still be training
    seen.clear()
    assert R.analyze_study(s, ["vit_cls_s1"]) == 0 and sorted({n for n, _ in seen}) == ["vit_cls_s1"]
    seen.clear()
    assert R.analyze_study(s) == 0
    assert sorted({n for n, _ in seen}) == ["vit_cls_s0", "vit_cls_s1", "vit_gap_s0", "vit_gap_s1"]
    assert "analyze_s" in R._times(s)
    # the command line: a report reads every configuration, so --only with --stage report is refused
    from analysis.studies.study import main

    assert main([str(tmp_path / "s.yaml"), "--stage", "report", "--only", "vit_cls"]) == 2
    assert "a report reads them all: drop --only." in capsys.readouterr().err
    assert main([str(tmp_path / "s.yaml"), "--stage", "train", "--only", "vit_cls_s0"]) == 2
    assert "choose from vit_cls, vit_gap (or, with --stage analyze, runs)." in capsys.readouterr().err
