"""Help and bad input before the heavy imports: every command's --help, and a recipe or run folder it refuses, are
answered without importing torch, timm, accelerate, datasets or matplotlib (5-20 s on a loaded machine before the
user's one sentence). Each case runs in a fresh interpreter and asserts which modules it imported, not how long it
took, so the tests hold on any host."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from conftest import ROOT

HEAVY = ("torch", "timm", "accelerate", "datasets", "matplotlib")

# Runs MODULE as ``python -m MODULE ARGS`` in this interpreter, then prints its exit code and the heavy modules it
# imported as the last line of stdout.
RUN = """
import json, runpy, sys
module, heavy, *args = sys.argv[1:]
sys.argv = [module, *args]
code = 0
try:
    runpy.run_module(module, run_name="__main__", alter_sys=True)
except SystemExit as e:
    code = e.code
print(json.dumps({"code": code, "heavy": [m for m in heavy.split(",") if m in sys.modules]}))
"""


def run_module(module: str, *args: str, cwd=ROOT) -> tuple[dict, str]:
    """({"code": exit code, "heavy": heavy modules imported}, stderr) of ``python -m module args``."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    r = subprocess.run(
        [sys.executable, "-c", RUN, module, ",".join(HEAVY), *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.stdout.strip(), r.stderr
    return json.loads(r.stdout.strip().splitlines()[-1]), r.stderr


@pytest.mark.parametrize(
    "module", ["train", "train.sweep", "analysis", "analysis.studies.study", "analysis.sources.pretrained"]
)
def test_help_imports_nothing_heavy(module):
    out, err = run_module(module, "--help")
    assert out == {"code": 0, "heavy": []}, err


@pytest.mark.parametrize(
    ("text", "words"),
    [
        (None, "does not exist"),
        ("train: {steps: [1\n", "is not valid YAML at line"),
        ("train:\n  stepz: 10\n", "unknown key 'train.stepz'"),
        ("model:\n  depth: six\n", "key 'model.depth'"),
        ("model:\n  patch_size: 5\n", "must divide 'data.img_size'"),
        ("interventions:\n  no_skip: {blocks: [9]}\n", "interventions.no_skip.blocks"),
        ("train: {objective: mae}\nobjectives:\n  mae: {decoder_heads: 3}\n", "objectives.mae.decoder_dim"),
    ],
    ids=["missing", "not-yaml", "key-typo", "wrong-type", "cross-check", "intervention", "objective"],
)
@pytest.mark.parametrize("check", [False, True], ids=["train", "check"])
def test_a_bad_recipe_is_refused_before_torch(text, words, check, tmp_path):
    recipe = tmp_path / "r.yaml"
    if text is not None:
        recipe.write_text(text)
    out, err = run_module("train", *(["--check"] if check else []), str(recipe), cwd=tmp_path)
    assert out == {"code": 2, "heavy": []}, err
    assert err.startswith("error: ") and words in err and err.count("\n") == 1, err


def test_a_bad_sweep_is_refused_before_torch(tmp_path):
    (tmp_path / "r.yaml").write_text("train:\n  steps: 10\n")
    out, err = run_module("train.sweep", "r.yaml", "--grid", "train.stepz=1,2", cwd=tmp_path)
    assert out == {"code": 2, "heavy": []}, err
    assert "unknown key 'train.stepz'" in err


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (["runs/nope"], "run folder 'runs/nope' does not exist"),
        (["runs/nope", "--measures", "ckaa"], "run folder 'runs/nope' does not exist"),
        (["."], "is not a vitlab run folder (no recipe.yaml)"),
        ([], "no run given"),
        (["--images", "photos"], "--images analyses a model from elsewhere"),
        (["--model", "timm:vit_tiny_patch16_224"], "--model timm:vit_tiny_patch16_224 needs --weights"),
        (["runs/x", "--mesures", "cka"], "did you mean --measures?"),
    ],
)
def test_analysis_input_errors_come_before_torch(args, words, tmp_path):
    out, err = run_module("analysis", *args, cwd=tmp_path)
    assert out == {"code": 2, "heavy": []}, err
    assert words in err.splitlines()[-1], err  # argparse's usage lines come before its error


def test_a_missing_study_file_is_refused_before_torch(tmp_path):
    out, err = run_module("analysis.studies.study", "nope.yaml", cwd=tmp_path)
    assert out == {"code": 2, "heavy": []}, err
    assert "study file 'nope.yaml' does not exist" in err


@pytest.mark.parametrize("recipe", sorted(p.name for p in (ROOT / "recipes").glob("*.yaml")))
def test_every_shipped_recipe_loads_without_torch(recipe):
    """Discovery imports every intervention and objective module to read its Config: they keep torch and timm for
    when a model is built (a recipe that mixes images asks its objective's class whether it uses labels, which
    imports it)."""
    code = (
        "import sys\n"
        "from train.recipe import load_recipe\n"
        f"a = load_recipe('recipes/{recipe}').data.augment\n"
        "print(a.mixup_alpha > 0 or a.cutmix_alpha > 0, [m for m in ('torch', 'timm') if m in sys.modules])\n"
    )
    r = subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.stdout.strip() in ("False []", "True ['torch', 'timm']"), r.stderr
