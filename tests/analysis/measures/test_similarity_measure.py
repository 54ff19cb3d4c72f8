"""The ``similarity`` measure (analysis/measures/similarity.py): its map is the estimator called directly on the same
features, its null is permutation_map's, a model against itself (``--against``) peaks on the diagonal and is
significant, an untrained model of another seed is less alike, features of unpaired images are not significant, the
options reach it from the recipe and the command line, and its results are cached, at checkpoints and across runs."""

from __future__ import annotations

import functools
import json

import numpy as np
import pytest
import torch
import yaml
from conftest import TINY, _merge, class_split, read_scalars, tiny_resnet, tiny_vit

from analysis.engine import suite as S
from analysis.engine.measure import MeasureError, load_result
from analysis.engine.reduce import ORDER_SEED, Minibatches
from analysis.engine.taps import Taps
from analysis.estimators.features import stored
from analysis.frontends.cli import main
from analysis.measures.similarity import SimilarityMeasure, SimilarityOptions, similarity_map
from analysis.reports import cross as XC
from analysis.results import runs as RF
from analysis.similarity import (
    cka,
    cknna,
    mutual_knn,
    permutation_map,
    procrustes_angle,
    procrustes_distance,
    pwcca,
    rbf_cka,
    svcca,
)

pytestmark = pytest.mark.usefixtures("one_thread")

BS = 32


def _data(n: int = 64, seed: int = 1):
    from analysis.frontends.api import Data
    from train.splits import TensorBatches

    a, p = class_split(n, seed), class_split(40, 2)
    return Data(TensorBatches(a.images, a.labels), TensorBatches(p.images, p.labels), 10)


def _reference_features(model, data, n_keep: int) -> list[torch.Tensor]:
    """Every block output's mean of the spatial tokens for the first ``n_keep`` images of the suite's minibatch order,
    rounded to float16 as the measure keeps them, computed here with plain taps (not the measure's code)."""
    mb = Minibatches(len(data.analysis), BS, ORDER_SEED)
    taps = [f"blocks.{i}.out" for i in range(len(model.blocks))]
    rows: list[list[torch.Tensor]] = [[] for _ in taps]
    with torch.no_grad():
        for j in range(len(mb)):
            x = data.normalize(mb.take(data.analysis.images, j))
            with Taps(model, taps) as cap:
                model(x)
            for i, t in enumerate(taps):
                rows[i].append(stored(cap[t][:, 1:].mean(1)).float())  # token 0 is the class token
    return [torch.cat(r)[:n_keep] for r in rows]


REFERENCES = {
    "cka": functools.partial(cka, unbiased=True),
    "rbf_cka": rbf_cka,
    "mutual_knn": functools.partial(mutual_knn, k=10),
    "cknna": functools.partial(cknna, k=10),
    "procrustes": procrustes_distance,
    "procrustes_angle": procrustes_angle,
    "svcca": functools.partial(svcca, keep=0.99),
    "pwcca": pwcca,
}


@pytest.mark.parametrize("estimator", sorted(REFERENCES))
def test_the_map_is_the_estimator_on_the_same_features(estimator):
    """Each cell equals the estimator called directly on features computed here (1e-9: float64 arithmetic in another
    order); z, p and the FWER mask are permutation_map's on those features with the same seed, exactly."""
    model, data = tiny_vit(), _data(64)
    opts = S.suite_options(["similarity"], BS, {"similarity": {"estimator": estimator, "n_perm": 30, "seed": 3}})
    r = S.run_suite(model, data, opts)["similarity"]
    feats = _reference_features(model, data, 64)
    score = REFERENCES[estimator]
    want = np.array([[score(x, y) for y in feats] for x in feats])
    np.testing.assert_allclose(r["score"], want, rtol=1e-9, atol=1e-9)
    raw = similarity_map(feats, None, SimilarityOptions(estimator=estimator, n_perm=0))  # no null: score_map
    np.testing.assert_allclose(raw["score"], want, rtol=1e-9, atol=1e-9)
    m = permutation_map(score, feats, n_perm=30, seed=3)
    np.testing.assert_allclose(r["z"], m.z, rtol=1e-9, atol=1e-9)
    np.testing.assert_array_equal(r["p_fwer"], m.p_fwer)
    assert r["significant"].shape == (2, 2) and r["significant"].dtype == np.int8
    np.testing.assert_array_equal(r["significant"], (m.p_fwer <= 0.05).astype(np.int8))
    assert (
        r["labels"] == r["labels_b"] == ["0.mlp", "1.mlp"]
        and r["n_images"] == 64
        and r["lower"] == int(estimator.startswith("procrustes"))
    )


def test_grouped_images_make_the_photo_the_null_unit():
    """Images that carry ``groups`` (the bundled photos' crops carry their photo): the measure's null is
    permutation_map's with those groups, taken in the order the images are kept (the suite's minibatch order), and
    the result says how many units it permuted; without groups the null is the image-level one."""
    model, data = tiny_vit(), _data(64)
    data.groups = np.arange(64) // 4  # 16 "photos" of 4 images each, stored in a row
    opts = S.suite_options(["similarity"], BS, {"similarity": {"n_perm": 30, "seed": 3}})
    r = S.run_suite(model, data, opts)["similarity"]
    feats = _reference_features(model, data, 64)
    kept = data.groups[Minibatches(64, BS, ORDER_SEED).order.numpy()]
    m = permutation_map(functools.partial(cka, unbiased=True), feats, n_perm=30, seed=3, groups=kept)
    np.testing.assert_allclose(r["z"], m.z, rtol=1e-9, atol=1e-9)
    np.testing.assert_array_equal(r["p_fwer"], m.p_fwer)
    assert r["n_units"] == 16 and r["n_images"] == 64
    views = permutation_map(functools.partial(cka, unbiased=True), feats, n_perm=30, seed=3)
    assert not np.allclose(m.z, views.z)  # the unit matters


def test_options_reach_the_measure_and_images_caps_the_sample():
    """k, images and n_perm = 0 (the raw map alone): the map is mutual k-NN with k = 5 on the first 40 images."""
    model, data = tiny_vit(), _data(64)
    o = {"estimator": "mutual_knn", "k": 5, "images": 40, "n_perm": 0}
    r = S.run_suite(model, data, S.suite_options(["similarity"], BS, {"similarity": o}))["similarity"]
    feats = _reference_features(model, data, 40)
    want = np.array([[mutual_knn(x, y, k=5) for y in feats] for x in feats])
    np.testing.assert_array_equal(r["score"], want)
    assert r["n_images"] == 40 and r["n_perm"] == 0 and "z" not in r and r["estimator"] == "mutual_knn"
    # minibatches forwarded in chunks (3 images at a time within 90 kB): the same 40 images, the same map
    chunked, stages = S.suite_options(["similarity"], BS, {"similarity": o}, max_memory=90_000), []
    c = S.run_suite(model, data, chunked, on_stage=stages.append)["similarity"]
    assert any("images per forward" in t for t in stages) and np.array_equal(c["score"], r["score"])
    # the command line's --opt goes through the same options
    opts = S.suite_options(["similarity"], BS, S.parse_opt_args(["similarity.estimator=svcca", "similarity.keep=0.9"]))
    assert opts.of("similarity").estimator == "svcca" and opts.of("similarity").keep == 0.9
    for bad, words in (({"n_perm": 1}, "n_perm must be 0"), ({"estimator": "cca"}, "must be one of")):
        with pytest.raises(MeasureError, match=words):
            S.suite_options(["similarity"], BS, {"similarity": bad})
    with pytest.raises(MeasureError, match="mutual_knn needs at least 11 images and keeps 8: analyse more images"):
        S.run_suite(model, _data(8), S.suite_options(["similarity"], 4, {"similarity": {"estimator": "mutual_knn"}}))
    few = S.suite_options(["similarity"], BS, {"similarity": {"estimator": "cknna", "images": 6}})
    with pytest.raises(
        MeasureError, match="raise the similarity option images .now 6. or lower the similarity option k"
    ):
        S.run_suite(model, data, few)


def test_a_model_against_itself_a_random_pair_and_unpaired_images():
    """Against itself (the cross-model path of --against), every layer is most alike its own copy and significantly
    so. An untrained ViT of another seed: linear CKA of the pooled features reads 0.9993 on the diagonal (the mean of
    the tokens is close to linear in the image in an untrained ViT), mutual k-NN tells the pair apart (0.65 against 1,
    calibrated z 31-34 against 48-50). The same features with the images unpaired (B's rows shuffled) are not
    significant anywhere, their calibrated scores near 0."""
    data = _data(64)
    a = tiny_vit(depth=3)
    b = tiny_vit(depth=3)
    torch.manual_seed(7)  # another seed's initialisation (tiny_vit seeds itself with 0)
    b.init_weights()
    opts = S.suite_options(["similarity"], BS, {"similarity": {"estimator": "cka", "n_perm": 50}})
    same = XC.cross_similarity(a, a, data, opts, "A", "A")
    s = same["score"]
    assert s.shape == (3, 3) and np.allclose(np.diag(s), 1.0, atol=1e-9)
    assert all(s[i, i] >= s[i].max() - 1e-12 for i in range(3))
    assert same["significant"].diagonal().all() and (same["p_fwer"].diagonal() == 1 / 51).all()
    assert same["name_a"] == "A" == same["name_b"]
    other = XC.cross_similarity(a, b, data, opts, "A", "B")
    assert (np.diag(other["score"]) < 1 - 1e-4).all()
    knn = S.suite_options(["similarity"], BS, {"similarity": {"estimator": "mutual_knn", "n_perm": 50}})
    same, other = XC.cross_similarity(a, a, data, knn, "A", "A"), XC.cross_similarity(a, b, data, knn, "A", "B")
    assert (np.diag(same["score"]) == 1).all() and (np.diag(other["score"]) < 0.8).all()
    assert (np.diag(other["z"]) < np.diag(same["z"]) - 5).all() and other["significant"].diagonal().all()
    m = SimilarityMeasure(S.make_context(a, data, BS), opts.of("similarity"))
    for j in range(2):
        with Taps(a, sorted(m.taps())) as cap, torch.no_grad():
            a(data.normalize(Minibatches(64, BS).take(data.analysis.images, j)))
        m.update(j, cap, None, None)
    feats = m.features()
    perm = torch.randperm(64, generator=torch.Generator().manual_seed(5))
    unpaired = similarity_map(feats, [f[perm] for f in feats], opts.of("similarity"))
    assert not unpaired["significant"].any() and np.abs(unpaired["z"]).max() < 3.5


def test_the_fwer_mask_of_a_vit_against_a_resnet_is_rows_by_columns():
    data = _data(64)
    opts = S.suite_options(["similarity"], BS, {"similarity": {"estimator": "procrustes", "n_perm": 20}})
    r = XC.cross_similarity(tiny_vit(), tiny_resnet(), data, opts, "vit", "resnet")
    assert r["score"].shape == r["z"].shape == r["significant"].shape == (2, 4) and r["lower"] == 1
    assert r["labels_b"] == ["layer1.0", "layer2.0", "layer3.0", "layer4.0"]
    cls = S.suite_options(["similarity"], BS, {"similarity": {"repr": "cls"}})
    with pytest.raises(Exception, match="resnet: option repr=cls reads the class token"):
        XC.cross_similarity(tiny_vit(), tiny_resnet(), data, cls, "vit", "resnet")


# ---------------------------------------------------------------- recipe, command line, cache, --against


CB = {
    "name": "analysis_suite",
    "measures": ["similarity"],
    "batch_size": 32,
    "similarity": {"estimator": "mutual_knn", "n_perm": 20},
}
ARGS = ["--batch-size", "32", "--no-progress", "--no-tensorboard", "--measures", "similarity"]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A tiny run trained 8 steps whose recipe runs the similarity measure (mutual k-NN, 20 permutations)."""
    from train.recipe import load_recipe
    from train.trainer import train

    root = tmp_path_factory.mktemp("runs")
    p = root / "sim.yaml"
    p.write_text(yaml.safe_dump(_merge(TINY, {"callbacks": [CB], "run": {"root": str(root)}})))
    return RF.open_run(train(load_recipe(p), progress=False)["run_dir"]).path


def test_recipe_options_tensorboard_and_the_offline_cache(run, capsys):
    r = load_result(run / "analysis" / "step_0000008" / "similarity.npz")
    assert str(r["estimator"]) == "mutual_knn" and int(r["n_perm"]) == 20 and r["z"].shape == (2, 2)
    tags = read_scalars(run)
    assert {"analysis/similarity/mutual_knn/mean_offdiag", "analysis/similarity/mutual_knn/mean_offdiag_z"} <= set(tags)
    assert (run / "figures" / "step_0000008" / "similarity_map.png").is_file()
    summary = json.loads((run / "analysis" / "step_0000008" / "summary.json").read_text())["similarity"]
    assert summary["estimator"] == "mutual_knn" and 0 <= summary["significant_share"] <= 1
    # the same options offline: the training-time results are reused; another estimator is computed, then cached
    same = ["--opt", "similarity.estimator=mutual_knn", "--opt", "similarity.n_perm=20"]
    assert main([str(run), *ARGS, *same]) == 0
    assert "0 results computed, 2 reused" in capsys.readouterr().out
    other = ["--opt", "similarity.estimator=procrustes", "--opt", "similarity.n_perm=20", "--steps", "8"]
    assert main([str(run), *ARGS, *other]) == 0
    assert "1 results computed, 0 reused" in capsys.readouterr().out
    assert str(load_result(run / "analysis" / "step_0000008" / "similarity.npz")["estimator"]) == "procrustes"
    assert main([str(run), *ARGS, *other]) == 0
    assert "0 results computed, 1 reused" in capsys.readouterr().out


def test_against_itself_on_the_command_line_is_cached(run, monkeypatch, capsys):
    opts = ["--opt", "similarity.n_perm=20", "--steps", "8"]
    assert main([str(run), "--against", f"{run}:8", *ARGS, *opts]) == 0
    out = capsys.readouterr().out
    line = next(ln for ln in out.splitlines() if "linear CKA mean" in ln)
    assert "calibrated z" in line and "% of layer pairs significant (family-wise error 0.05, 20 permutations" in line
    r = RF.open_run(run)
    d = XC.against_dir(r, 8, r, 8)
    res = load_result(d / "similarity.npz")
    assert np.allclose(np.diag(res["score"]), 1.0, atol=1e-9) and res["significant"].diagonal().all()
    assert str(res["name_a"]) == str(res["name_b"]) == f"{r.label}@8"
    s = SimilarityMeasure.summary(res)  # across models the diagonal counts: same-index layers
    assert s["mean_diag"] == pytest.approx(1.0, abs=1e-9) and s["mean"] == pytest.approx(res["score"].mean())
    assert s["mean_diag_z"] == pytest.approx(np.diag(res["z"]).mean()) and "mean_offdiag" not in s
    assert (run / "figures" / "against" / f"{run.name}_step_0000008" / "step_0000008" / "similarity_map.png").is_file()
    assert "linear CKA mean" in (run / "report.md").read_text()
    calls = []
    real = XC.cross_similarity
    monkeypatch.setattr(XC, "cross_similarity", lambda *a, **k: calls.append(1) or real(*a, **k))
    monkeypatch.setattr(XC, "cross_cka", lambda *a, **k: calls.append(2) or pytest.fail("cross CKA recomputed"))
    assert main([str(run), "--against", f"{run}:8", *ARGS, *opts]) == 0
    assert calls == []  # both cross-run results reused
    assert main([str(run), "--against", f"{run}:8", *ARGS, *opts, "--opt", "similarity.estimator=cknna"]) == 0
    assert calls == [1] and str(load_result(d / "similarity.npz")["estimator"]) == "cknna"
