"""Studies (analysis/reports/study.py): the study file, the claim numbers (analysis/reports/claims.py) on cases with known answers,
and a tiny study end to end: train, analyse, report."""
import numpy as np
import pytest
import yaml
from conftest import ROOT, TINY, _merge

from analysis.reports import claims as C
from analysis.reports.study import load_study, main
from train.recipe import RecipeError


def test_partition_finds_the_block_structure_of_a_no_skip_map():
    labels = [f"{b}.{s}" for b in range(4) for s in ("attn", "mlp")]
    m = np.full((8, 8), 0.2)
    m[:4, :4] = m[4:, 4:] = 0.9  # blocks 0-1 vs 2-3
    np.fill_diagonal(m, 1.0)
    p = C.partition(m, labels, 2)
    assert p["across"] == pytest.approx(0.2) and p["within"] == pytest.approx(0.9)
    assert C.partition(m, labels, 1)["across"] > 0.2  # a boundary inside a block mixes both
    with pytest.raises(ValueError):
        C.partition(m, labels, 0)


def test_claim_numbers_on_constructed_results():
    u = C.uniformity(np.array([[1, 0.5, 0.1], [0.5, 1, 0.3], [0.1, 0.3, 1]]))
    assert u["mean_offdiag"] == pytest.approx(0.3) and u["first_last"] == pytest.approx(0.1)
    ratio = np.ones((2, 4, 5))
    ratio[0, 0, 0], ratio[0, -1, 0], ratio[0, 0, 1:], ratio[0, -1, 1:] = 0.2, 3.0, 2.0, 1.5
    ph = C.cls_phase(ratio, 0, 1)
    assert (ph["cls_first"], ph["cls_last"], ph["spatial_first"], ph["spatial_last"]) == (0.2, 3.0, 2.0, 1.5)
    assert C.skip_dominance(ratio) == 1.0
    d = np.array([[2, 20], [3, 19], [14, 15], [15, 16]], dtype=float)  # local + global heads low, global high
    hm = C.head_mix(d)
    assert hm["spread_lower"] == pytest.approx(17) and hm["spread_upper"] == pytest.approx(1) and hm["mean_upper"] > hm["mean_lower"]
    dr = C.drift([0.9, 0.8, 0.5, 0.3])
    assert dr == {"lower": pytest.approx(0.85), "upper": pytest.approx(0.4)}
    o = C.offset_heads(np.array([[False, True], [False, False]]))
    assert o == {"count": 1, "where": ["block 0 head 1"]}
    assert C.last_layer([0.5, 0.7, np.nan]) == 0.7


def _study(tmp_path, runs: dict, **extra) -> str:
    base = _merge(TINY, {"data": {"probe_train_size": 200}, "callbacks": []})
    (tmp_path / "tiny.yaml").write_text(yaml.safe_dump(base))
    d = {"study": "mini", "root": str(tmp_path / "runs"), "report": str(tmp_path / "docs" / "repro.md"), "runs": runs, **extra}
    p = tmp_path / "mini.yaml"
    p.write_text(yaml.safe_dump(d))
    return str(p)


def test_study_files_are_checked_before_anything_runs(tmp_path, capsys):
    s = load_study(ROOT / "recipes" / "studies" / "raghu2021.yaml")
    assert {"vit_cls", "vit_gap", "resnet", "noskip_b1", "noskip_b3", "noskip_b5", "subset_03", "subset_10", "subset_30"} == set(s.runs)
    assert "erf" in s.runs["vit_cls"].measures and s.runs["resnet"].measures is None and "aligned_attention" in s.measures
    bad = _study(tmp_path, {"a": {"recipe": "tiny.yaml", "set": ["model.depht=3"]}})
    with pytest.raises(RecipeError, match="study run 'a': unknown key 'model.depht'"):
        load_study(bad)
    assert main([bad]) == 2 and capsys.readouterr().err.count("\n") == 1
    assert not (tmp_path / "runs").exists()
    with pytest.raises(RecipeError, match="unknown measure 'nope'"):
        load_study(_study(tmp_path, {"a": {"recipe": "tiny.yaml"}}, measures=["cka", "nope"]))
    with pytest.raises(RecipeError, match="unknown key"):
        load_study(_study(tmp_path, {"a": {"recipe": "tiny.yaml"}}, studdy=1))


def test_a_tiny_study_trains_analyses_and_reports(tmp_path, capsys):
    resnet = ["model.arch=resnet", "model.resnet_layers=[1,1,1,1]", "model.resnet_channels=[8,8,16,16]"]
    p = _study(tmp_path, {"vit_cls": {"recipe": "tiny.yaml", "measures": "all"}, "resnet": {"recipe": "tiny.yaml", "set": resnet}},
               measures=["cka", "norm_ratio", "fewshot_probe"])
    assert main([p]) == 0
    report = tmp_path / "docs" / "repro.md"
    text = report.read_text()
    for claim in ("## 1. ViT representations are more uniform", "## 3. Skip connections dominate", "## 4. Lower layers mix",
                  "## 7. Offset local attention heads", "| vit_cls |", "Claims at a glance"):
        assert claim in text, claim
    assert "held" in text and "missing" not in text
    from analysis.reports.run_report import check_report

    assert check_report(report) == []
    assert (tmp_path / "runs" / "vit_cls" / "analysis" / "step_0000008" / "erf.npz").is_file()  # measures: all
    assert not (tmp_path / "runs" / "resnet" / "analysis" / "step_0000008" / "knn.npz").exists()  # the study's list
    capsys.readouterr()
    assert main([p]) == 0  # rerun: nothing trained again, everything cached, the report regenerated
    out = capsys.readouterr().out
    assert "2 already finished, 0 started" in out and report.is_file()
