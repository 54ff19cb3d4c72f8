"""``import vitlab``: the public face under a name a user's file cannot shadow, without torch until something is used,
and one sentence naming the file (or the other checkout) in the way of ``train``, ``analysis`` or ``interventions``."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from conftest import ROOT

# imports vitlab in a fresh interpreter (cwd: the folder given), then prints whether torch came with it
RUN = """
import json, sys
try:
    import vitlab
except ImportError as e:
    print(json.dumps({"error": str(e)}))
else:
    print(json.dumps({"torch": "torch" in sys.modules, "names": sorted(vitlab.__all__), "root": str(vitlab.ROOT)}))
"""


def import_vitlab(cwd, before: str = "") -> dict:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    r = subprocess.run(
        [sys.executable, "-c", before + RUN], cwd=cwd, env=env, capture_output=True, text=True, timeout=60
    )
    assert r.stdout.strip(), r.stderr
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_import_vitlab_is_light_and_gives_the_public_face(tmp_path):
    out = import_vitlab(tmp_path)
    assert out["torch"] is False and out["root"] == str(ROOT)
    assert {"analyze", "activations", "Measure", "register", "train", "load_recipe"} <= set(out["names"])


def test_the_attributes_are_the_projects_own():
    import vitlab
    from analysis.engine import measure
    from analysis.frontends import api

    assert vitlab.analyze is api.analyze and vitlab.activations is api.activations and vitlab.Measure is measure.Measure
    assert "analyze" in dir(vitlab)
    with pytest.raises(AttributeError, match="no attribute 'analyse'"):
        vitlab.analyse  # noqa: B018


@pytest.mark.parametrize("name", ["train.py", "analysis.py", "interventions"])
def test_a_file_of_the_users_that_shadows_a_package_is_named(tmp_path, name):
    (tmp_path / name).mkdir() if "." not in name else (tmp_path / name).write_text("x = 1\n")
    if "." not in name:
        (tmp_path / name / "__init__.py").write_text("")
    stem = name.removesuffix(".py")
    out = import_vitlab(tmp_path, "import sys; sys.path.insert(0, '')\n")
    assert out["error"] == (
        f"{tmp_path / name} shadows vitlab's '{stem}' package (Python finds it first on sys.path): rename it (e.g. to "
        f"my_{name}) and restart Python (a notebook's kernel)."
    )


def test_every_file_in_the_way_is_named_in_one_sentence(tmp_path):
    for f in ("train.py", "analysis.py"):
        (tmp_path / f).write_text("x = 1\n")
    assert import_vitlab(tmp_path)["error"] == (
        f"{tmp_path / 'train.py'} and {tmp_path / 'analysis.py'} shadow vitlab's 'train' and 'analysis' packages "
        "(Python finds them first on sys.path): rename them (e.g. to my_train.py, my_analysis.py) and restart Python "
        "(a notebook's kernel)."
    )


def test_another_checkouts_packages_are_named(tmp_path):
    other = tmp_path / "other"
    for p in ("train", "analysis", "interventions"):
        (other / p).mkdir(parents=True)
        (other / p / "__init__.py").write_text("")
    out = import_vitlab(tmp_path, f"import sys; sys.path.insert(0, {str(other)!r}); import analysis\n")
    assert out["error"].startswith(f"vitlab comes from {ROOT} but its 'train' package from {other}, another checkout")
    assert f"PYTHONPATH={ROOT}" in out["error"]


def test_train_refuses_overrides_with_a_recipe_object():
    import vitlab
    from train.recipe import from_dict

    with pytest.raises(ValueError, match="overrides= go with a recipe file"):
        vitlab.train(from_dict({}), ["train.steps=3"])
