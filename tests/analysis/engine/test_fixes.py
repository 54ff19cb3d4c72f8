"""Each precondition names the piece that is missing and the fix in the words of the front end that was used: the recipe
(callback), the command line on a run folder, on a recipe's data (--model) and on --images, and the API with tensors or
a folder (analysis/engine/fixes.py). No model runs here: the suite's checks read the data alone."""

from __future__ import annotations

import types

import pytest
import torch

from analysis.engine import suite as S
from analysis.engine.fixes import VOCAB, BatchSizes, Missing, skip_lines
from train.splits import TensorBatches

FRONTS = ("recipe", "run", "model", "images", "api", "api_folder")


def _data(n=16, probe_per_class=None, labelled=True, probe_labelled=True):
    y = torch.arange(n) % 10 if labelled else torch.full((n,), -1)
    x = torch.zeros(n, 1, 4, 4, dtype=torch.uint8)
    k = 10 * (probe_per_class or 0)
    py = torch.arange(k) % 10 if probe_labelled else torch.full((k,), -1)
    return types.SimpleNamespace(
        analysis=TensorBatches(x, y), probe_train=TensorBatches(x[:1].expand(k, -1, -1, -1), py), num_classes=10
    )


def _say(data, front, measures=("fewshot_probe",), batch_size=8):
    return S.problem(data, S.suite_options(list(measures), batch_size), front)


def test_every_front_end_has_the_same_words():
    assert {frozenset(v) for v in VOCAB.values()} == {frozenset(VOCAB["api"])}


# (front end, words the sentence must hold, words it must not): labels given, no probe images
NO_PROBE = [
    ("api", "pass probe_images= and probe_labels=", "pass labels="),
    ("api_folder", "pass probe_images= a folder", "one subfolder per class"),
    ("images", "--probe-images DIR2", "put the images of --images in one subfolder per class"),
    ("model", "--set data.probe_train_size=N", "--probe-images"),
    ("recipe", "set data.probe_train_size above 0", "--"),
]


@pytest.mark.parametrize(("front", "has", "lacks"), NO_PROBE)
def test_no_probe_images_names_the_probe_images_not_the_labels(front, has, lacks):
    s = _say(_data(), front)
    assert "there are no" in s and "the images to analyse have no class labels" not in s
    assert has in s and lacks not in s and s.endswith(".") and "\n" not in s


# too few probe images per class (10) for 10 shots (20 per class)
TOO_FEW = [
    ("api", ["at least 20 images per class", "options={'fewshot_probe': {'shots': 5}}"]),
    ("api_folder", ["probe_images= folder with at least 20 images per class", "{'shots': 5}"]),
    ("images", ["--probe-images at least 20 images per class", "--opt fewshot_probe.shots=5"]),
    ("model", ["--set data.probe_train_size=200", "--opt fewshot_probe.shots=5"]),
    ("run", ["--opt fewshot_probe.shots=5"]),
    ("recipe", ["raise data.probe_train_size to at least 200", "lower the option fewshot_probe.shots to 5"]),
]


@pytest.mark.parametrize(("front", "has"), TOO_FEW)
def test_too_few_probe_images_names_the_front_ends_fix(front, has):
    s = _say(_data(probe_per_class=10), front)
    assert s.startswith("measure fewshot_probe draws 10 shots per class") and "rarest class has 10 images" in s
    assert all(h in s for h in has), s
    assert ("probe_train_size" in s) == (front in ("recipe", "model", "run")), s  # a recipe key only where one applies


def test_unlabelled_images_name_labels_and_probe_images_together():
    s = _say(_data(labelled=False), "api", ["knn", "clustering"])
    assert s.startswith("measure knn reads class labels, and the images to analyse have no class labels; there are")
    assert "pass labels= for the images and pass probe_images= and probe_labels=" in s
    assert "the probe_images have no class labels: pass probe_labels=" in _say(
        _data(probe_per_class=20, probe_labelled=False), "api", ["knn"]
    )
    assert "put the images of --images in the same class subfolders" not in _say(_data(labelled=False), "images")


def test_skipped_measures_are_grouped_by_what_they_lack():
    problems = S.data_problems(_data(labelled=False), S.suite_options("all"))
    assert problems["clustering"] == Missing(("labels",)) and problems["knn"] == Missing(("labels", "probe_images"))
    lines = skip_lines(problems, "images")
    assert lines[0] == (
        "skipped clustering: it reads class labels, and the images to analyse have no class labels: put the images of "
        "--images in one subfolder per class (DIR/<class>/...)."
    )
    assert any(line.startswith("skipped fewshot_probe, knn, token_probes: they read") for line in lines), lines


@pytest.mark.parametrize(
    ("front", "says"),
    [
        ("api", "pass another batch_size= (e.g. batch_size=7)"),
        ("images", "pass another --batch-size (e.g. --batch-size 7)"),
        ("recipe", "change data.analysis_size or the callback's batch_size (e.g. batch_size: 7)"),
    ],
)
def test_a_last_minibatch_too_small_names_the_front_ends_batch_size(front, says):
    s = _say(_data(n=18), front, ["cka"])
    assert s.startswith("18 analysis images in minibatches of 8 leave a last minibatch of 2 images") and says in s
    assert BatchSizes(18, 8).suggestion == 7 and BatchSizes(3, 8).suggestion is None
