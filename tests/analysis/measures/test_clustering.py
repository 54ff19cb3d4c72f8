"""k-means clustering per layer (Walmer §5.2, App. D.5): known answers for purity / NMI / ARI, an explicit-loop purity,
k-means quality against plain random-init Lloyd, determinism, the Measure protocol end to end and the round-trip."""

from __future__ import annotations

import math
import types

import numpy as np
import pytest
import torch
from conftest import class_split, tiny_resnet, tiny_vit

from analysis.engine.measure import REGISTRY, Context, load_result, make_options, save_result
from analysis.engine.taps import Taps, block_names
from analysis.estimators.baselines import gaussian_like, uniform_like
from analysis.measures.clustering import ClusteringMeasure, cluster_scores, kmeans, purity

pytestmark = pytest.mark.usefixtures("one_thread")


def _blobs(n_per, classes, dim, sep, noise, seed):
    g = torch.Generator().manual_seed(seed)
    centres = sep * torch.randn(classes, dim, generator=g)
    y = torch.arange(classes).repeat_interleave(n_per)
    return centres[y] + noise * torch.randn(len(y), dim, generator=g), y


def _purity_loop(pred, target):
    counts: dict = {}
    for a, t in zip(pred.tolist(), target.tolist()):
        counts.setdefault(a, {}).setdefault(t, 0)
        counts[a][t] += 1
    return sum(max(c.values()) for c in counts.values()) / len(pred)


def _lloyd_random_init(x, k, seed, iters=100):
    """Plain Lloyd from k distinct random points, written independently (cdist, per-cluster means)."""
    g = torch.Generator().manual_seed(seed)
    c = x[torch.randperm(len(x), generator=g)[:k]].clone()
    for _ in range(iters):
        a = torch.cdist(x, c).argmin(1)
        new = torch.stack([x[a == j].mean(0) if (a == j).any() else c[j] for j in range(k)])
        if torch.allclose(new, c):
            break
        c = new
    a = torch.cdist(x, c).argmin(1)
    return sum(((x[a == j] - c[j]) ** 2).sum().item() for j in range(k))


def test_separated_blobs_give_perfect_scores():
    x, y = _blobs(40, 8, 12, sep=10.0, noise=0.3, seed=0)
    assign, centres, inertia = kmeans(x, 8, seed=0)
    s = cluster_scores(assign, y)
    assert s["purity"] == 1.0
    assert s["nmi"] == pytest.approx(1.0, abs=1e-6) and s["ari"] == pytest.approx(1.0, abs=1e-6)
    assert assign.dtype == torch.long and centres.shape == (8, 12) and centres.dtype == torch.float64
    # inertia is the sum of squared distances to the assigned (nearest) centres
    d = torch.cdist(x.double(), centres)
    assert torch.equal(assign, d.argmin(1))
    assert inertia == pytest.approx((d.min(1).values ** 2).sum().item(), rel=1e-9)


def test_noise_gives_chance_scores():
    # N = 2000, K = 10 random labels: NMI of independent labellings ~ (K-1)^2 / (2 N ln K) ~ 0.01, ARI ~ 0 +- 0.003,
    # purity ~ 1/K + the excess of a cluster's largest of 10 class counts (~ 0.04 here); tolerances below are generous
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(2000, 16, generator=g), torch.randint(10, (2000,), generator=g)
    s = cluster_scores(kmeans(x, 10, seed=0, n_init=2)[0], y)
    assert s["nmi"] < 0.03 and abs(s["ari"]) < 0.01
    assert 0.1 <= s["purity"] < 0.1 + 0.07


def test_purity_matches_explicit_loop():
    g = torch.Generator().manual_seed(2)
    for n, k, c in ((50, 4, 3), (200, 10, 7), (31, 31, 2)):
        pred = torch.randint(k, (n,), generator=g) * 3 + 5  # non-contiguous cluster ids
        target = torch.randint(c, (n,), generator=g) - 1
        assert purity(pred, target) == pytest.approx(_purity_loop(pred, target), abs=1e-15)
    assert purity(torch.tensor([0, 0, 1, 1, 1]), torch.tensor([2, 2, 2, 0, 0])) == pytest.approx(4 / 5)


def test_nmi_ari_known_values():
    a, b = torch.tensor([0, 0, 1, 1]), torch.tensor([0, 0, 1, 2])
    s = cluster_scores(b, a)
    # MI = ln 2, H(a) = ln 2, H(b) = 1.5 ln 2: NMI = ln 2 / (1.25 ln 2) = 0.8; ARI = 0.5714 (the scikit-learn doc
    # example)
    assert s["nmi"] == pytest.approx(0.8, abs=1e-6) and s["ari"] == pytest.approx(4 / 7, abs=1e-6)
    s = cluster_scores(torch.tensor([2, 2, 0, 0, 1, 1]), torch.tensor([0, 0, 1, 1, 2, 2]))  # a relabelling
    assert s == pytest.approx({"purity": 1.0, "nmi": 1.0, "ari": 1.0}, abs=1e-6)


def test_inertia_not_worse_than_random_init_lloyd():
    # 10 blobs close enough that random-init Lloyd often merges two of them and splits another (a local minimum)
    better = 0
    for data_seed in range(3):
        x, _ = _blobs(30, 10, 6, sep=4.0, noise=1.0, seed=data_seed)
        x = x.double()
        best_random = min(_lloyd_random_init(x, 10, s) for s in range(5))
        _, _, inertia = kmeans(x, 10, seed=0)
        assert inertia <= best_random * (1 + 1e-9)
        better += inertia < best_random * 0.99
    assert better >= 1  # k-means++ with restarts does find better optima than random inits here


def test_deterministic_per_seed_and_handles_duplicate_init():
    g = torch.Generator().manual_seed(4)
    x = torch.randn(300, 5, generator=g)
    a1, c1, i1 = kmeans(x, 6, seed=7)
    a2, c2, i2 = kmeans(x.clone(), 6, seed=7)
    assert torch.equal(a1, a2) and torch.equal(c1, c2) and i1 == i2
    _a3, c3, _ = kmeans(x, 6, seed=8)
    assert not torch.equal(c1, c3)
    # two identical initial centres: the empty cluster is re-seeded, all K clusters end up used
    xb, _ = _blobs(20, 3, 4, sep=10.0, noise=0.1, seed=5)
    init = torch.stack([xb[0], xb[0], xb[20]])
    a, _, _ = kmeans(xb, 3, init=init)
    assert torch.bincount(a, minlength=3).min() > 0
    with pytest.raises(ValueError):
        kmeans(x[:3], 4)


# --------------------------------------------------------------------------------------------------------------
# the Measure, end to end
# --------------------------------------------------------------------------------------------------------------


def _ctx(model, arch, prefix):
    data = types.SimpleNamespace(
        analysis=class_split(60, 1), probe_train=class_split(20, 2), normalize=lambda x: x.float() / 255, num_classes=10
    )
    return Context(
        model=model, data=data, device=torch.device("cpu"), arch=arch, blocks=tuple(block_names(model)), prefix=prefix
    )


@torch.no_grad()
def _drive(m, ctx, batch=16, shard=None):
    """The suite's protocol on the analysis split (clustering asks for no probe-train pass)."""
    assert not m.probe_taps()
    split = ctx.data.analysis
    for j in range((len(split.labels) + batch - 1) // batch):
        if shard is not None and j % shard[1] != shard[0]:
            continue
        x = ctx.data.normalize(split.images[j * batch : (j + 1) * batch])
        with Taps(ctx.model, sorted(m.taps())) as cap:
            ctx.model(x)
        m.update(j, cap.captures, x, split.labels[j * batch : (j + 1) * batch])


@torch.no_grad()
def _features_at_once(model, split, tap, pool, prefix):
    with Taps(model, [tap]) as cap:
        model(split.images.float() / 255)
    t = cap.captures[tap]
    f = t.mean((2, 3)) if t.ndim == 4 else (t[:, 0] if pool == "cls" else t[:, prefix:].mean(1))
    return f.half().float()  # the measure keeps per-image features as float16 (analysis.estimators.features.stored)


def test_measure_end_to_end_cls_vit(tmp_path):
    model = tiny_vit()
    ctx = _ctx(model, "vit", 1)
    assert REGISTRY["clustering"] is ClusteringMeasure
    m = ClusteringMeasure(ctx)
    assert m.taps() == {"blocks.0.out", "blocks.1.out"}
    _drive(m, ctx)
    r = m.finish()
    for key in ("purity", "nmi", "ari", "baseline_purity", "baseline_nmi", "baseline_ari", "inertia"):
        assert r[key].shape == (2, 2), key
    assert r["pools"] == ["cls", "mean_spatial"] and r["layers"] == ["blocks.0", "blocks.1"]
    assert r["num_classes"] == 10 and r["n_images"] == 60
    y = ctx.data.analysis.labels
    for p, pool in enumerate(r["pools"]):
        for i, blk in enumerate(r["layers"]):
            x = _features_at_once(model, ctx.data.analysis, f"{blk}.out", pool, 1)
            s = cluster_scores(kmeans(x, 10, seed=0, n_init=5)[0], y)
            b = cluster_scores(kmeans(gaussian_like(x.double(), p * 2 + i), 10, seed=0, n_init=5)[0], y)
            for metric in ("purity", "nmi", "ari"):
                assert r[metric][p, i] == pytest.approx(s[metric], abs=1e-9)
                assert r[f"baseline_{metric}"][p, i] == pytest.approx(b[metric], abs=1e-9)
    assert (r["purity"] >= 0.1).all() and (r["purity"] <= 1).all()

    # two "processes", parts put together out of order: the same numbers
    m0, m1 = ClusteringMeasure(ctx), ClusteringMeasure(ctx)
    _drive(m0, ctx, shard=(0, 2))
    _drive(m1, ctx, shard=(1, 2))
    m1.feats.parts += m0.feats.parts
    r2 = m1.finish()
    for key in ("purity", "nmi", "ari", "baseline_purity", "inertia"):
        np.testing.assert_array_equal(r2[key], r[key])

    save_result(r, tmp_path / "clustering.npz")
    back = load_result(tmp_path / "clustering.npz")
    assert ClusteringMeasure.summary(back) == ClusteringMeasure.summary(r)
    sc = ClusteringMeasure.scalars(back)
    assert sc == ClusteringMeasure.scalars(r)
    assert set(sc) == {
        f"clustering/{m}/{p}/block{i:02d}"
        for m in ("purity", "nmi", "ari")
        for p in ("cls", "mean_spatial")
        for i in (0, 1)
    }
    assert sc["clustering/ari/cls/block01"] == r["ari"][0, 1]
    figs = ClusteringMeasure.figures(back, step=5)
    assert list(figs) == ["clustering/metrics"] and len(figs["clustering/metrics"].axes) == 3
    import matplotlib.pyplot as plt

    for f in figs.values():
        plt.close(f)


def test_measure_gap_vit_and_resnet():
    for model, arch, n_layers in ((tiny_vit(class_token=False), "vit", 2), (tiny_resnet(), "resnet", 4)):
        ctx = _ctx(model, arch, 0)
        m = ClusteringMeasure(ctx)
        _drive(m, ctx, batch=32)
        r = m.finish()
        assert r["pools"] == ["mean_spatial"] and r["purity"].shape == (1, n_layers)
        assert all(math.isfinite(v) for v in r["nmi"].ravel())


def test_uniform_baseline_option():
    """Option baseline=uniform: k-means on uniform [0, 1) features (Walmer et al.'s code) instead of Gaussian ones."""
    model = tiny_vit()
    ctx = _ctx(model, "vit", 1)
    m = ClusteringMeasure(ctx, make_options(ClusteringMeasure, {"baseline": "uniform", "restarts": 2}))
    _drive(m, ctx)
    r = m.finish()
    x = _features_at_once(model, ctx.data.analysis, "blocks.0.out", "cls", 1)
    b = cluster_scores(kmeans(uniform_like(x.double(), 0), 10, seed=0, n_init=2)[0], ctx.data.analysis.labels)
    assert r["baseline_nmi"][0, 0] == pytest.approx(b["nmi"], abs=1e-9)
