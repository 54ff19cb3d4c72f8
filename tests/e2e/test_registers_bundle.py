"""A trained study re-judged from its results bundle alone (analysis/studies/bundle.py): a tiny registers study (2
configurations x 2 seeds of the tiny recipe, token_norms at every checkpoint, its positive control computed at report
time) is trained, analysed and reported; its bundle is written beside the report; with the runs deleted, ``--stage
report`` regenerates the same JSON twin byte for byte and the same page but for its provenance line, without the
images or a model. The same on synthetic run folders, fast: tests/studies/test_bundle.py."""

import json
import shutil

import pytest
import yaml
from conftest import TINY, _merge

from analysis.sources import models as MS
from analysis.studies import bundle as B
from analysis.studies.study import main


@pytest.mark.slow  # about 1 min (3 on 2 busy cores): four tiny trainings; the bundle is tested fast in tests/studies
def test_a_trained_study_is_regenerated_from_its_bundle(tmp_path, capsys, monkeypatch):
    (tmp_path / "tiny.yaml").write_text(yaml.safe_dump(_merge(TINY, {"callbacks": []})))
    study = {
        "study": "mini",
        "paper": "registers",
        "root": str(tmp_path / "runs"),
        "report": str(tmp_path / "docs" / "registers.md"),
        "seeds": [0, 1],
        "every_checkpoint": ["token_norms"],
        "measures": ["token_norms", "knn"],
        "runs": {
            "vit_reg0": {"recipe": "tiny.yaml"},
            "vit_reg4": {"recipe": "tiny.yaml", "set": ["model.reg_tokens=4"]},
        },
    }
    p = tmp_path / "mini.yaml"
    p.write_text(yaml.safe_dump(study))
    assert main([str(p), "--jobs", "2"]) == 0
    report, bundle = tmp_path / "docs" / "registers.md", tmp_path / "docs" / "bundles" / "registers"
    manifest = json.loads((bundle / B.MANIFEST).read_text())
    files = set(manifest["files"])
    assert "registers_control.json" in files  # the report-time positive control, cached
    assert {f"vit_reg{r}_s{s}/analysis/step_0000004/token_norms.npz" for r in (0, 4) for s in (0, 1)} <= files
    assert not any(f.endswith(B.WEIGHTS) for f in files) and manifest["bytes"] < 1_000_000
    assert set(manifest["fingerprints"]) == {"vit_reg0_s0", "vit_reg0_s1", "vit_reg4_s0", "vit_reg4_s1"}
    md, twin = report.read_text().splitlines(), report.with_suffix(".json").read_bytes()
    assert json.loads(twin)["positive_control"]["runs"].keys() == {"vit_reg0_s0", "vit_reg0_s1"}
    shutil.rmtree(tmp_path / "runs")

    def absent(*args, **kwargs):  # a fresh clone: neither the images nor the weights are there
        raise AssertionError("a report from a bundle built the data or a model")

    monkeypatch.setattr(MS, "load_data", absent)
    monkeypatch.setattr(MS, "load_model", absent)
    capsys.readouterr()
    assert main([str(p), "--stage", "report"]) == 0
    assert "regenerated with `--stage report` from the results bundle" in capsys.readouterr().out
    again = report.read_text().splitlines()
    assert report.with_suffix(".json").read_bytes() == twin  # every verdict and number, tolerance 0
    assert again[:2] + again[3:] == md[:2] + md[3:] and again[2] != md[2]  # all but the provenance line
    assert not (tmp_path / "runs").exists()
