"""Weighted k-NN per layer (DINO / Walmer §6.1) and the Gaussian baseline: known answers, an explicit-loop reference,
edge cases, the Measure protocol end to end on a tiny timm ViT / ResNet, and the save/load round-trip."""

from __future__ import annotations

import math
import types

import numpy as np
import pytest
import torch
from conftest import class_split, tiny_resnet, tiny_vit

from analysis.engine.measure import REGISTRY, Context, load_result, make_options, save_result
from analysis.engine.taps import Taps, block_names
from analysis.estimators.baselines import gaussian_like, gaussian_like_layers, noise_like, uniform_like
from analysis.estimators.features import pool_features
from analysis.measures.knn import KNNMeasure, knn_accuracy, knn_predict

pytestmark = pytest.mark.usefixtures("one_thread")


def _blobs(n_per, classes, dim, sep, seed):
    g = torch.Generator().manual_seed(seed)
    centres = torch.randn(classes, dim, generator=g)
    centres = sep * centres / centres.norm(dim=1, keepdim=True)
    y = torch.arange(classes).repeat_interleave(n_per)
    return centres[y] + 0.05 * torch.randn(len(y), dim, generator=g), y


def _reference_predict(bank, bank_y, queries, k, temperature, num_classes):
    """Explicit loops: per query compute every cosine, sort descending, take k, weight exp(s / T), vote."""
    preds = []
    bank_rows, labels = bank.double().tolist(), [int(v) for v in bank_y]
    for q in queries.double().tolist():
        sims = []
        for i, b in enumerate(bank_rows):
            cos = sum(u * v for u, v in zip(q, b)) / (
                math.sqrt(sum(u * u for u in q)) * math.sqrt(sum(v * v for v in b))
            )
            sims.append((cos, i))
        sims.sort(key=lambda t: -t[0])
        votes = [0.0] * num_classes
        for cos, i in sims[:k]:
            votes[labels[i]] += math.exp(cos / temperature)
        preds.append(max(range(num_classes), key=lambda c: (votes[c], -c)))  # argmax, ties to the lowest class
    return torch.tensor(preds)


def test_well_separated_clusters_give_accuracy_one():
    torch.manual_seed(0)
    bank, bank_y = _blobs(30, 6, 16, sep=10.0, seed=1)
    q, q_y = _blobs(10, 6, 16, sep=10.0, seed=1)  # the same centres, new noise
    q = q + 0.05 * torch.randn_like(q)
    assert knn_accuracy(bank, bank_y, q, q_y) == 1.0
    # a permutation of the bank does not matter
    perm = torch.randperm(len(bank))
    assert knn_accuracy(bank[perm], bank_y[perm], q, q_y) == 1.0


def test_noise_features_give_chance():
    # 2000 queries: the std of the accuracy around chance 0.1 is sqrt(0.09 / 2000) ~ 0.007; tolerance 0.04 (~6 sigma)
    g = torch.Generator().manual_seed(3)
    bank, q = torch.randn(2000, 32, generator=g), torch.randn(2000, 32, generator=g)
    bank_y, q_y = torch.randint(10, (2000,), generator=g), torch.randint(10, (2000,), generator=g)
    acc = knn_accuracy(bank, bank_y, q, q_y, num_classes=10)
    assert abs(acc - 0.1) < 0.04


@pytest.mark.parametrize("k,temperature", [(20, 0.07), (1, 0.07), (7, 0.5)])
def test_vectorised_equals_explicit_loop(k, temperature):
    g = torch.Generator().manual_seed(k)
    bank = torch.randn(120, 8, generator=g) + torch.randn(120, 1, generator=g)
    bank_y = torch.randint(5, (120,), generator=g)
    q = torch.randn(40, 8, generator=g)
    got = knn_predict(bank, bank_y, q, k, temperature, num_classes=5)
    want = _reference_predict(bank, bank_y, q, k, temperature, 5)
    assert torch.equal(got.cpu(), want)
    # scale invariance of the L2-normalised cosine
    assert torch.equal(knn_predict(3.0 * bank, bank_y, 0.1 * q, k, temperature, num_classes=5), got)


def test_chunking_does_not_change_predictions(monkeypatch):
    import train.knn as knn  # the definition (the analysis measure and the trainer's monitor share it)

    g = torch.Generator().manual_seed(5)
    bank, bank_y, q = (
        torch.randn(50, 4, generator=g),
        torch.randint(3, (50,), generator=g),
        torch.randn(37, 4, generator=g),
    )
    whole = knn_predict(bank, bank_y, q)
    monkeypatch.setattr(knn, "_CHUNK", 5)
    assert torch.equal(knn_predict(bank, bank_y, q), whole)


def test_k_larger_than_bank_uses_the_whole_bank():
    g = torch.Generator().manual_seed(7)
    bank, bank_y, q = torch.randn(6, 5, generator=g), torch.tensor([0, 1, 1, 2, 2, 2]), torch.randn(15, 5, generator=g)
    got = knn_predict(bank, bank_y, q, k=20, num_classes=4)
    assert torch.equal(got, _reference_predict(bank, bank_y, q, 6, 0.07, 4))
    assert torch.equal(got, knn_predict(bank, bank_y, q, k=6, num_classes=4))
    with pytest.raises(ValueError):
        knn_predict(bank[:0], bank_y[:0], q)
    with pytest.raises(ValueError):
        knn_predict(bank, bank_y, q, k=0)


def test_weights_follow_exp_sim_over_t():
    # two neighbours of class 0 at cosine 1 and 0, three of class 1 at cosine 0.9: with T = 0.07 the single
    # exact match wins (e^14.3 > 3 e^12.9); with T = 10 the three class-1 votes win
    bank = torch.tensor(
        [[1.0, 0.0], [0.0, 1.0], [0.9, math.sqrt(1 - 0.81)], [0.9, math.sqrt(1 - 0.81)], [0.9, math.sqrt(1 - 0.81)]]
    )
    bank_y = torch.tensor([0, 0, 1, 1, 1])
    q = torch.tensor([[1.0, 0.0]])
    assert knn_predict(bank, bank_y, q, k=5, temperature=0.07).item() == 0
    assert knn_predict(bank, bank_y, q, k=5, temperature=10.0).item() == 1


def test_gaussian_like():
    x = torch.rand(500, 40, dtype=torch.float64) * 7 + 3
    a, b = gaussian_like(x, 0), gaussian_like(x, 0)
    assert a.shape == x.shape and a.dtype == torch.float64 and a.device == x.device
    assert torch.equal(a, b) and not torch.equal(a, gaussian_like(x, 1))
    assert torch.equal(gaussian_like(x * 0, 0), a)  # only the shape is used
    assert abs(a.mean().item()) < 0.02 and abs(a.var().item() - 1) < 0.03
    assert gaussian_like(torch.zeros(3, 4, dtype=torch.uint8), 0).dtype == torch.float32
    layers = gaussian_like_layers({"a": x, "b": x[:, :5]}, 3)
    assert torch.equal(layers["a"], gaussian_like(x, 3)) and torch.equal(layers["b"], gaussian_like(x[:, :5], 4))
    assert [t.shape for t in gaussian_like_layers([x, x], 0)] == [x.shape, x.shape]


def test_uniform_like_is_the_authors_code_draw():
    """Walmer et al.'s code (wrapper_random.py) draws torch.rand: uniform [0, 1), mean 1/2, variance 1/12."""
    x = torch.zeros(500, 40, dtype=torch.float64)
    u = uniform_like(x, 0)
    assert (
        u.shape == x.shape
        and u.dtype == torch.float64
        and torch.equal(u, uniform_like(x, 0))
        and not torch.equal(u, uniform_like(x, 1))
    )
    assert u.min() >= 0 and u.max() < 1 and abs(u.mean().item() - 0.5) < 0.01 and abs(u.var().item() - 1 / 12) < 0.005
    assert torch.equal(noise_like(x, 2, "uniform"), uniform_like(x, 2)) and torch.equal(
        noise_like(x, 2), gaussian_like(x, 2)
    )
    assert torch.equal(gaussian_like_layers([x], 4, "uniform")[0], uniform_like(x, 4))
    with pytest.raises(ValueError):
        noise_like(x, 0, "normal")


def test_uniform_baseline_option():
    model = tiny_vit()
    ctx = _ctx(model, "vit", 1)
    m = KNNMeasure(ctx, make_options(KNNMeasure, {"baseline": "uniform"}))
    _drive(m, ctx)
    r = m.finish()
    bank = _features_at_once(model, ctx.data.probe_train, "blocks.1.out", "mean_spatial", 1)
    q = _features_at_once(model, ctx.data.analysis, "blocks.1.out", "mean_spatial", 1)
    noise = uniform_like(torch.cat([bank, q]).double(), 1 * 2 + 1)
    base = (
        _reference_predict(noise[:60], ctx.data.probe_train.labels, noise[60:], 20, 0.07, 10)
        == ctx.data.analysis.labels
    )
    assert r["baseline"][1, 1] == pytest.approx(base.double().mean().item(), abs=1e-12)


def test_pool_features():
    t = torch.randn(2, 5, 3)
    torch.testing.assert_close(pool_features(t, "cls", 1), t[:, 0])
    torch.testing.assert_close(pool_features(t, "mean_spatial", 1), t[:, 1:].mean(1))
    m = torch.randn(2, 3, 4, 4)
    torch.testing.assert_close(pool_features(m, "mean_spatial", 0), m.mean((2, 3)))
    with pytest.raises(ValueError):
        pool_features(m, "cls", 0)


# --------------------------------------------------------------------------------------------------------------
# the Measure, end to end
# --------------------------------------------------------------------------------------------------------------


def _ctx(model, arch, prefix):
    data = types.SimpleNamespace(
        analysis=class_split(40, 1), probe_train=class_split(60, 2), normalize=lambda x: x.float() / 255, num_classes=10
    )
    return Context(
        model=model, data=data, device=torch.device("cpu"), arch=arch, blocks=tuple(block_names(model)), prefix=prefix
    )


@torch.no_grad()
def _drive(m, ctx, batch=16, shard=None):
    """The suite's protocol: fixed minibatches j of the analysis (then probe-train) split; ``shard=(r, world)`` keeps j
    = r mod world."""
    for split, taps, update in (
        (ctx.data.analysis, m.taps(), m.update),
        (ctx.data.probe_train, m.probe_taps(), m.update_probe),
    ):
        if not taps:
            continue
        for j in range((len(split.labels) + batch - 1) // batch):
            if shard is not None and j % shard[1] != shard[0]:
                continue
            x = ctx.data.normalize(split.images[j * batch : (j + 1) * batch])
            with Taps(ctx.model, sorted(taps)) as cap:
                ctx.model(x)
            update(j, cap.captures, x, split.labels[j * batch : (j + 1) * batch])


@torch.no_grad()
def _features_at_once(model, split, tap, pool, prefix):
    x = split.images.float() / 255
    with Taps(model, [tap]) as cap:
        model(x)
    t = cap.captures[tap]
    f = t.mean((2, 3)) if t.ndim == 4 else (t[:, 0] if pool == "cls" else t[:, prefix:].mean(1))
    return f.half().float()  # the measure keeps per-image features as float16 (analysis.estimators.features.stored)


def test_measure_end_to_end_cls_vit(tmp_path):
    model = tiny_vit()
    ctx = _ctx(model, "vit", 1)
    assert REGISTRY["knn"] is KNNMeasure
    m = KNNMeasure(ctx)
    assert m.taps() == {"blocks.0.out", "blocks.1.out"} == m.probe_taps()
    _drive(m, ctx)
    r = m.finish()
    assert r["acc"].shape == r["baseline"].shape == (2, 2)
    assert r["pools"] == ["cls", "mean_spatial"] and r["layers"] == ["blocks.0", "blocks.1"]
    assert r["k"] == 20 and r["temperature"] == 0.07 and r["n_bank"] == 60 and r["n_query"] == 40
    # the independent path: features of one full-batch forward, pooled by hand
    for p, pool in enumerate(r["pools"]):
        for i, blk in enumerate(r["layers"]):
            bank = _features_at_once(model, ctx.data.probe_train, f"{blk}.out", pool, 1)
            q = _features_at_once(model, ctx.data.analysis, f"{blk}.out", pool, 1)
            ref = (
                (_reference_predict(bank, ctx.data.probe_train.labels, q, 20, 0.07, 10) == ctx.data.analysis.labels)
                .double()
                .mean()
            )
            assert r["acc"][p, i] == pytest.approx(ref.item(), abs=1e-12)
            noise = gaussian_like(torch.cat([bank, q]).double(), p * 2 + i)
            base = (
                _reference_predict(noise[:60], ctx.data.probe_train.labels, noise[60:], 20, 0.07, 10)
                == ctx.data.analysis.labels
            )
            assert r["baseline"][p, i] == pytest.approx(base.double().mean().item(), abs=1e-12)
    assert r["acc"].max() > 0.3  # the bright square is easy to find; chance is 0.1

    # two "processes": each sees every other minibatch; their parts put together give the same result
    m0, m1 = KNNMeasure(ctx), KNNMeasure(ctx)
    _drive(m0, ctx, shard=(0, 2))
    _drive(m1, ctx, shard=(1, 2))
    m1.queries.parts += m0.queries.parts  # what collect's gather does, in the wrong order on purpose
    m1.bank.parts += m0.bank.parts
    r2 = m1.finish()
    np.testing.assert_array_equal(r2["acc"], r["acc"])
    np.testing.assert_array_equal(r2["baseline"], r["baseline"])

    # round-trip through save_result / load_result
    save_result(r, tmp_path / "knn.npz")
    back = load_result(tmp_path / "knn.npz")
    assert KNNMeasure.summary(back) == KNNMeasure.summary(r)
    sc = KNNMeasure.scalars(back)
    assert sc == KNNMeasure.scalars(r) and set(sc) == {
        f"knn/{p}/block{i:02d}" for p in ("cls", "mean_spatial") for i in (0, 1)
    }
    assert sc["knn/mean_spatial/block01"] == r["acc"][1, 1]
    figs = KNNMeasure.figures(back, step=3)
    assert list(figs) == ["knn/accuracy"]
    import matplotlib.pyplot as plt

    for f in figs.values():
        plt.close(f)


def test_measure_gap_vit_and_resnet_pools():
    for model, arch, prefix, layers in (
        (tiny_vit(class_token=False), "vit", 0, ["blocks.0", "blocks.1"]),
        (tiny_resnet(), "resnet", 0, ["layer1.0", "layer2.0", "layer3.0", "layer4.0"]),
    ):
        ctx = _ctx(model, arch, prefix)
        m = KNNMeasure(ctx)
        _drive(m, ctx, batch=32)
        r = m.finish()
        assert r["pools"] == ["mean_spatial"] and r["layers"] == layers and r["acc"].shape == (1, len(layers))
        bank = _features_at_once(model, ctx.data.probe_train, f"{layers[-1]}.out", "mean_spatial", prefix)
        q = _features_at_once(model, ctx.data.analysis, f"{layers[-1]}.out", "mean_spatial", prefix)
        assert r["acc"][0, -1] == pytest.approx(
            knn_accuracy(bank, ctx.data.probe_train.labels, q, ctx.data.analysis.labels), abs=1e-12
        )


def test_small_bank_reports_effective_k():
    model = tiny_vit()
    ctx = _ctx(model, "vit", 1)
    ctx.data.probe_train = class_split(12, 4)
    m = KNNMeasure(ctx)
    _drive(m, ctx)
    assert m.finish()["k"] == 12
