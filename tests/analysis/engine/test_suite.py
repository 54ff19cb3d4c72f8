"""The analysis suite in one pass, its callbacks at training time, on every model variant."""

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import class_split, read_scalars, tiny_vit

from analysis.engine.suite import DEFAULT, run_suite, suite_options
from analysis.estimators.probing import probe_split, sample_shots
from analysis.measures.fewshot_probe import FewShotProbeMeasure
from train.data import build_data
from train.models import build_model
from train.recipe import from_dict, load_recipe
from train.trainer import train

DATA = {"train_size": 256, "eval_size": 128, "probe_train_size": 200, "analysis_size": 64}


def _setup(model_cfg=None, interventions=None):
    r = from_dict(
        {
            "data": DATA,
            "model": {"depth": 3, "embed_dim": 32, "num_heads": 2, **(model_cfg or {})},
            "interventions": interventions or {},
        }
    )
    torch.manual_seed(0)
    return build_model(r, 10), build_data(r)


@pytest.mark.parametrize("variant", ["cls", "gap", "noskip", "resnet", "mixer"])
def test_suite_on_every_variant(variant):
    cfg = {
        "cls": ({}, None),
        "gap": ({"head": "gap"}, None),
        "noskip": ({}, {"no_skip": {"blocks": [1]}}),
        "resnet": ({"arch": "resnet", "resnet_layers": [1, 1, 1, 1], "resnet_channels": [8, 8, 16, 16]}, None),
        "mixer": ({"arch": "mixer"}, None),
    }[variant]
    model, data = _setup(*cfg)
    res = run_suite(model, data, suite_options(None, 32, {"fewshot_probe": {"seeds": [0, 1]}}))
    m = res["cka"]["matrix"]
    L = 6 if variant != "resnet" else 4
    assert m.shape == (L, L) and np.allclose(np.diag(m), 1.0) and np.allclose(m, m.T)
    assert np.isfinite(res["norm_ratio"]["ratio"]).all()
    fp = res["fewshot_probe"]
    assert fp["mean"].shape[1] == (3 if variant != "resnet" else 4) and ((fp["mean"] >= 0) & (fp["mean"] <= 1)).all()
    assert (
        fp["baseline"].shape == fp["mean"].shape and fp["baseline"].mean() < 0.3
    )  # Gaussian features: near chance (0.1)
    if variant == "mixer":  # Raghu App. H: token mixing in place of attention, in the CKA analyses
        assert res["cka"]["labels"][:2] == ["0.token", "0.channel"] and "attention_distance" not in res
        assert res["norm_ratio"]["ratio"].shape == (2, 3, 49) and fp["pools"] == ["mean", "mean_spatial"]
        more = run_suite(
            model,
            data,
            suite_options(None, 32, {"fewshot_probe": {"seeds": [0]}, "token_probes": {"seeds": [0]}}),
            measures=["localization", "token_probes", "residual_cka"],
        )
        assert (
            more["localization"]["own_share"].shape == (3,) and more["localization"]["own_share"][0] > 0.5
        )  # tokens start as their patch
        assert more["token_probes"]["acc"].shape == (3, 49) and "cls_acc" not in more["token_probes"]
        assert more["residual_cka"]["skip_branch"].shape == (2, 3)
    elif variant == "resnet":
        assert "attention_distance" not in res and fp["pools"] == ["mean"]
    else:
        ad = res["attention_distance"]["pixels"]
        assert ad.shape == (3, 2) and (ad > 0).all() and (ad < 28 * 1.5).all()
        assert fp["pools"] == (["mean", "mean_spatial"] if variant == "gap" else ["cls", "mean", "mean_spatial"])
        assert res["norm_ratio"]["ratio"].shape == (2, 3, 49 + (0 if variant == "gap" else 1))


def test_suite_in_training_writes_arrays_figures_and_tensorboard(write_recipe, tmp_path):
    p = write_recipe(
        callbacks=[{"name": "analysis_suite", "batch_size": 32, "fewshot_probe": {"seeds": [0]}}],
        train={"log_every": 4},
        data={"probe_train_size": 200},
    )
    out = train(load_recipe(p), progress=False)
    run = Path(out["run_dir"])
    for step in (4, 8):
        d = run / "analysis" / f"step_{step:07d}"
        for f in (
            "cka.npz",
            "norm_ratio.npz",
            "attention_distance.npz",
            "fewshot_probe.npz",
            "summary.json",
            "cache.json",
        ):
            assert (d / f).is_file(), (d, f)
        for f in ("cka_self.png", "probe_10shot.png"):
            assert (run / "figures" / d.name / f).is_file(), (d, f)
        s = json.loads((d / "summary.json").read_text())
        assert s["step"] == step and len(s["fewshot_probe"]["cls"]) == 2
    sc = read_scalars(run)
    for tag in (
        "cka/mean_offdiag",
        "norm_ratio/attn/cls/block00",
        "norm_ratio/mlp/spatial/block01",
        "attn_dist/min/block01",
        "probe/10shot/cls/block01",
    ):
        assert "analysis/" + tag in sc and [s for s, _ in sc["analysis/" + tag]] == [4, 8], tag
    cb = dict(sc["time/callbacks_s"])
    assert cb[4] > 0 and {4, 8} <= set(cb)  # the suite ran there (its figures are drawn in the background)
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    ea = EventAccumulator(str(run), size_guidance={"images": 0})
    ea.Reload()
    images = {"cka/self", "norm_ratio/lines", "attn_dist/heads", "probe/10shot"}  # beside the scalars, in analysis/
    assert {"analysis/" + t for t in images} <= set(ea.Tags()["images"])


def test_figures_are_drawn_off_the_main_thread_and_land_even_when_a_run_stops_early(
    write_recipe, tmp_path, monkeypatch, capsys
):
    """The callback's figures are drawn in a background thread; a run stopped by --stop-after (no on_train_end)
    still gets every checkpoint's figures in PNG and TensorBoard before TensorBoard closes; a figure that fails to
    draw is a warning, not a failed run."""
    import threading

    from analysis.results import publish

    threads, real = [], publish.publish_figures

    def spy(res, figure_dir, writer=None, step=None, *a, **kw):
        threads.append(threading.current_thread().name)
        if step == 8:
            raise RuntimeError("no font")
        return real(res, figure_dir, writer, step, *a, **kw)

    monkeypatch.setattr(publish, "publish_figures", spy)
    p = write_recipe(
        callbacks=[{"name": "analysis_suite", "batch_size": 32, "measures": ["cka"]}],
        train={"steps": 12, "checkpoint_every": 4, "log_every": 4},
    )
    from train.trainer import TrainingStopped

    with pytest.raises(TrainingStopped):
        train(load_recipe(p), progress=False, stop_after=8)
    run = tmp_path / "runs/tiny"
    assert not (run / "result.json").exists()
    assert threads and all(t.startswith("vitlab-figures") for t in threads), threads
    assert threading.current_thread().name not in threads
    assert (run / "figures/step_0000004/cka_self.png").is_file()
    assert not (run / "figures/step_0000008").exists()  # its drawing failed ...
    assert (run / "analysis/step_0000008/cka.npz").is_file()  # ... its results did not
    assert (
        "warning: callback 'analysis_suite' could not draw its figures (RuntimeError: no font)"
        in capsys.readouterr().err
    )
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    ea = EventAccumulator(str(run), size_guidance={"images": 0})
    ea.Reload()
    assert [e.step for e in ea.Images("analysis/cka/self")] == [4]


def test_probe_split_too_small_is_a_recipe_error_before_the_run_folder(write_recipe, tmp_path, capsys):
    from train.cli import main

    p = write_recipe(callbacks=["analysis_suite"], data={"probe_train_size": 100})
    assert main([str(p), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "data.probe_train_size to at least 200" in err and err.count("\n") == 1
    assert not (tmp_path / "runs").exists()


# ---------------------------------------------------------------- the probe-train pass over the images read only


def _labelled(n_analysis=64, n_probe=400):
    from analysis.frontends.api import Data
    from train.splits import TensorBatches

    a, p = class_split(n_analysis, 1), class_split(n_probe, 2)
    return Data(TensorBatches(a.images, a.labels), TensorBatches(p.images, p.labels), 10)


def _forward_inputs(model):
    """The inputs of every forward of ``model`` (a list filled by a hook) and the hook's handle."""
    seen = []

    def record(mod, args, out):
        if args[0].device.type != "meta":  # the suite sizes its taps on the meta device first: no images there
            seen.append(args[0].clone())

    return seen, model.register_forward_hook(record)


def _read_by_fewshot(labels, shots, seeds, l2):
    """Independently of analysis.estimators.probing.probe_rows_read: the shot-half rows probe_layers draws for each seed
    (it samples from the labels of the shot half), and the held-out half when l2 is picked there."""
    shot, val = probe_split(labels)
    rows = {int(shot[i]) for s in seeds for i in sample_shots(labels[shot], shots, s)}
    return sorted(rows | (set(val.tolist()) if l2 is None else set()))


def _assert_identical(a, b):
    assert a.keys() == b.keys()
    for m in a:
        assert a[m].keys() == b[m].keys(), m
        for k in a[m]:
            x, y = np.asarray(a[m][k]), np.asarray(b[m][k])
            assert x.dtype == y.dtype and np.array_equal(x, y), (m, k)


@pytest.mark.parametrize("l2", [None, 64.0])
def test_probe_pass_forwards_only_the_fewshot_rows_and_the_results_are_identical(l2, monkeypatch):
    model, data = tiny_vit(), _labelled()
    opts = suite_options(None, 32, {"fewshot_probe": {"shots": 5, "l2": l2}})
    seen, hook = _forward_inputs(model)
    sub = run_suite(model, data, opts)
    sub_inputs = list(seen)
    seen.clear()
    monkeypatch.setattr(FewShotProbeMeasure, "probe_rows", lambda self, labels: None)  # the pass over every image
    full = run_suite(model, data, opts)
    hook.remove()
    _assert_identical(sub, full)
    want = _read_by_fewshot(data.probe_train.labels, 5, (0, 1, 2), l2)
    assert 0 < len(want) < (350 if l2 is None else 200)  # a real subset: ~316 with l2 picked, ~116 fixed
    # the analysis pass (64 images), then the probe pass over exactly the rows read, in order, in minibatches of 32
    assert [len(x) for x in seen] == [32, 32] + [32] * 12 + [16]
    assert [len(x) for x in sub_inputs[2:]] == [32] * (len(want) // 32) + ([len(want) % 32] if len(want) % 32 else [])
    probe_in = torch.cat(sub_inputs[2:])
    assert torch.equal(probe_in, data.normalize(data.probe_train.images[torch.tensor(want)]))


def test_token_probes_read_the_same_rows_with_identical_results(monkeypatch):
    from analysis.measures.token_probes import TokenProbes

    model, data = tiny_vit(), _labelled(n_probe=200)
    opts = suite_options(None, 32, {"token_probes": {"shots": 3, "seeds": [0, 1], "stride": 3, "l2": 64.0}})
    seen, hook = _forward_inputs(model)
    sub = run_suite(model, data, opts, measures=["token_probes"])
    n_sub = sum(len(x) for x in seen)
    monkeypatch.setattr(TokenProbes, "probe_rows", lambda self, labels: None)
    full = run_suite(model, data, opts, measures=["token_probes"])
    hook.remove()
    _assert_identical(sub, full)
    assert n_sub == 64 + len(_read_by_fewshot(data.probe_train.labels, 3, (0, 1), 64.0)) < 64 + 200


def test_knn_in_the_suite_forwards_every_probe_train_image():
    model, data = tiny_vit(), _labelled()
    seen, hook = _forward_inputs(model)
    res = run_suite(model, data, suite_options([*DEFAULT, "knn"], 32, {"fewshot_probe": {"shots": 5}}))
    hook.remove()
    assert sum(len(x) for x in seen) == 64 + 400 and int(res["knn"]["n_bank"]) == 400


def test_subset_probe_pass_on_two_processes_equals_one(monkeypatch):
    """Two processes played one after the other (rank 1 first): each forwards its share of the compacted probe-train
    minibatches, the gathered features are put back in order, and rank 0's result equals one process's."""
    import analysis.engine.reduce as R

    model, data = tiny_vit(), _labelled()
    opts = suite_options(None, 32, {"fewshot_probe": {"shots": 5}})
    one = run_suite(model, data, opts, measures=["fewshot_probe"])
    log: list = []

    class Rank:
        num_processes, device = 2, "cpu"

        def __init__(self, rank):
            self.process_index = rank

    def gather(items):  # rank 1 records its parts; rank 0 gets them added to its own
        if rank == 1:
            log.append(list(items))
            return items
        return log.pop(0) + list(items)

    monkeypatch.setattr(R, "gather_object", gather)
    seen, hook = _forward_inputs(model)
    rank = 1  # its finish gathers only its own parts in this replay: the check of the rows gathered refuses them
    with pytest.raises(RuntimeError, match="not those of the rows"):
        run_suite(model, data, opts, accelerator=Rank(1), measures=["fewshot_probe"])
    counts = [sum(len(x) for x in seen)]
    seen.clear()
    rank = 0
    out = run_suite(model, data, opts, accelerator=Rank(0), measures=["fewshot_probe"])
    counts.append(sum(len(x) for x in seen))
    hook.remove()
    n_read = len(_read_by_fewshot(data.probe_train.labels, 5, (0, 1, 2), None))
    assert sum(counts) == 64 + n_read and min(counts) > 0
    _assert_identical({"f": out["fewshot_probe"]}, {"f": one["fewshot_probe"]})


def test_probe_rows_read_treats_a_one_element_grid_as_fixed_like_select_l2():
    """select_l2 uses one value as is (a number or a one-element grid) and reads the held-out half only to pick among
    several: the rows the suite forwards follow the same rule."""
    from analysis.estimators.probing import probe_rows_read

    labels = _labelled().probe_train.labels
    fixed = _read_by_fewshot(labels, 5, (0, 1), 64.0)
    picked = _read_by_fewshot(labels, 5, (0, 1), None)
    assert probe_rows_read(labels, 5, (0, 1), 64.0).tolist() == fixed
    assert probe_rows_read(labels, 5, (0, 1), [64.0]).tolist() == fixed
    assert probe_rows_read(labels, 5, (0, 1), [16.0, 64.0]).tolist() == picked
    assert probe_rows_read(labels, 5, (0, 1), None).tolist() == picked and len(picked) > len(fixed)


def test_minibatches_are_runs_of_one_seeded_permutation_on_every_host_and_process_count():
    from analysis.engine.reduce import Minibatches

    mb = Minibatches(10, 4, 0)
    assert mb.order.tolist() == [4, 6, 2, 7, 3, 5, 9, 0, 8, 1]  # numpy's PCG64: the same wherever it runs
    assert len(mb) == 3 and [mb.rows(j).tolist() for j in range(3)] == [[4, 6, 2, 7], [3, 5, 9, 0], [8, 1]]
    t = torch.arange(100, 110)
    assert mb.take(t, 1).tolist() == [103, 105, 109, 100]
    stored = Minibatches(10, 4, None)
    assert stored.take(t, 2).tolist() == [108, 109] and stored.rows(0).tolist() == [0, 1, 2, 3]

    class Rank:
        def __init__(self, r):
            self.num_processes, self.process_index = 2, r

    assert sorted([*mb.mine(Rank(0)), *mb.mine(Rank(1))]) == list(mb.mine())
    o = suite_options(["cka"], 32)
    assert o.settings("cka")["order_seed"] == 0  # in every cached result's key
    assert o.settings("cka") != {**o.settings("cka"), "order_seed": 1}


def test_cka_does_not_depend_on_the_order_the_images_are_stored_in():
    """Minibatch CKA assumes random minibatches; images stored class by class (a folder per class) gave minibatches
    of one class. The suite cuts a seeded permutation: class-sorted and shuffled storage agree within sampling noise
    (first-last CKA 0.9568 vs 0.9571 here, 0.9623 vs 0.9655 with another initialisation; three more order seeds span
    0.956-0.957), where stored-order minibatches of the sorted images read 0.935 (the bias removed: the positive
    control)."""
    import dataclasses

    import timm

    from analysis.frontends.api import _model_and_data
    from train.sources import FASHION_MNIST_DIR, _read_idx

    f = Path(FASHION_MNIST_DIR)
    x = torch.from_numpy(_read_idx(f / "t10k-images-idx3-ubyte.gz")[:1000].copy())[:, None]
    y = torch.from_numpy(_read_idx(f / "t10k-labels-idx1-ubyte.gz")[:1000].astype(np.int64))
    idx = torch.cat([torch.nonzero(y == c)[:32, 0] for c in (0, 1, 5, 8)])  # 4 classes of 32, class by class
    shuffled = torch.randperm(len(idx), generator=torch.Generator().manual_seed(1))
    torch.manual_seed(0)
    m = timm.create_model(
        "vit_tiny_patch16_224", img_size=28, patch_size=4, in_chans=1, embed_dim=48, depth=4, num_heads=3
    ).eval()
    with torch.no_grad():  # blocks that outweigh the skip path: layers that differ, so CKA has structure to bias
        for mod in m.modules():
            if isinstance(mod, torch.nn.Linear):
                mod.weight.mul_(6)

    def first_last(rows, seed):
        net, data = _model_and_data(m, x[idx][rows], y[idx][rows], normalize=lambda t: (t.float() / 255 - 0.3) / 0.35)
        c = np.asarray(
            run_suite(net, data, dataclasses.replace(suite_options(["cka"], 32), order_seed=seed))["cka"]["matrix"]
        )
        return float(c[0, -1])

    every = torch.arange(len(idx))
    sorted_, shuffled_ = first_last(every, 0), first_last(shuffled, 0)
    assert abs(sorted_ - shuffled_) < 0.006
    assert shuffled_ - first_last(every, None) > 0.012  # stored order of grouped images: the bias removed above


def test_feed_gives_a_measure_the_features_of_each_analysis_image_and_keeps_the_models_mode():
    """``feed``: the suite's passes without the results, for a report that reads a measure's gathered state itself
    (the real-ViT report's similarity maps under two nulls): the features are those of a plain forward of each
    minibatch, in the minibatches' order, and the model's training mode is restored."""
    from analysis.engine.suite import feed, make_context
    from analysis.engine.taps import Taps
    from analysis.measures.similarity import SimilarityMeasure, SimilarityOptions

    model, data = _setup()
    fed = SimilarityMeasure(make_context(model, data, 32), SimilarityOptions(n_perm=20))
    model.train()
    feed(fed.ctx, [fed])
    assert model.training
    by_hand = SimilarityMeasure(make_context(model, data, 32), SimilarityOptions(n_perm=20))
    model.eval()
    mb = by_hand.ctx.minibatches
    for j in range(len(mb)):
        with torch.no_grad(), Taps(model, sorted(by_hand.taps())) as cap:
            model(data.normalize(mb.take(data.analysis.images, j)))
        by_hand.update(j, cap, None, None)
    a, b = fed.features(), by_hand.features()
    assert len(a) == 3 and all(f.shape[0] == len(data.analysis) for f in a)
    for x, y in zip(a, b):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-5, atol=1e-6)
