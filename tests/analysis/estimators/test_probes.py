"""Few-shot linear probes: big_vision's fewshot_lsr (by hand and against a transcription) and the centred dual ridge
onto {-1, 1}^K, l2 selection, shot sampling, token pooling, per-layer runner."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from analysis.estimators.probing import (
    BIG_VISION_L2,
    _grid_accuracies,
    big_vision_l2_grid,
    default_l2_grid,
    fewshot_probe,
    fewshot_probe_with_l2,
    fit_probe,
    fit_ridge_dual,
    holdout_split,
    pool_tokens,
    probe_layers,
    sample_shots,
    select_l2,
    signed_one_hot,
)


def _gaussians(num_classes=10, per_class=10, dim=50, sep=10.0, noise=1.0, seed=0, means=None):
    """Well separated Gaussian classes: means ~ sep * N(0, I), within-class noise ~ noise * N(0, I)."""
    g = torch.Generator().manual_seed(seed)
    if means is None:
        means = sep * torch.randn(num_classes, dim, generator=torch.Generator().manual_seed(1234))
    y = torch.arange(num_classes).repeat_interleave(per_class)
    x = means[y] + noise * torch.randn(len(y), dim, generator=g)
    return x, y


def _separable(num_classes=10, shots=10, test_per_class=50, dim=50):
    means = 10.0 * torch.randn(num_classes, dim, generator=torch.Generator().manual_seed(1234))
    return (
        *_gaussians(num_classes, shots, dim, seed=0, means=means),
        *_gaussians(num_classes, test_per_class, dim, seed=1, means=means),
    )


def test_separable_gaussians_are_classified_perfectly():
    tr_x, tr_y, te_x, te_y = _separable()
    assert fewshot_probe(tr_x, tr_y, te_x, te_y) == 1.0


def test_noise_features_with_random_labels_are_at_chance():
    g = torch.Generator().manual_seed(0)
    tr_x, te_x = torch.randn(100, 64, generator=g), torch.randn(3000, 64, generator=g)
    tr_y = torch.arange(10).repeat_interleave(10)
    te_y = torch.randint(0, 10, (3000,), generator=g)
    acc = fewshot_probe(tr_x, tr_y, te_x, te_y)
    assert 0.05 <= acc <= 0.2


def _primal_scores(x, y, l2, k, x_eval):
    """Independent primal ridge in numpy: W = (Xc^T Xc + l2 I_d)^-1 Xc^T Yc, b = mean(Y) - mean(X) W."""
    x, x_eval = x.numpy().astype(np.float64), x_eval.numpy().astype(np.float64)
    t = np.eye(k)[y.numpy()] * 2 - 1
    xm, tm = x.mean(0), t.mean(0)
    xc, tc = x - xm, t - tm
    w = np.linalg.solve(xc.T @ xc + l2 * np.eye(x.shape[1]), xc.T @ tc)
    return x_eval @ w + (tm - xm @ w)


@pytest.mark.parametrize("n,d", [(24, 8), (12, 30)])
def test_dual_solution_equals_primal_ridge(n, d):
    g = torch.Generator().manual_seed(n + d)
    x, x_eval = torch.randn(n, d, generator=g, dtype=torch.float64), torch.randn(7, d, generator=g, dtype=torch.float64)
    y = torch.arange(n) % 4
    for l2 in (0.01, 1.0, 30.0):
        w, b = fit_ridge_dual(x, y, l2, 4)
        assert w.dtype == torch.float64 and w.shape == (d, 4) and b.shape == (4,)
        np.testing.assert_allclose((x_eval @ w + b).numpy(), _primal_scores(x, y, l2, 4, x_eval), rtol=0, atol=1e-8)


def test_bias_handles_a_large_constant_offset():
    tr_x, tr_y, te_x, te_y = _separable()
    offset = 1000.0 * torch.ones(50)
    assert fewshot_probe(tr_x + offset, tr_y, te_x + offset, te_y, l2_grid=[1.0]) == 1.0
    assert fewshot_probe(tr_x + offset, tr_y, te_x + offset, te_y) == 1.0
    # centring + bias make the fitted scores translation invariant (offset added in float64: float32 would round it)
    tr64, te64, off64 = tr_x.double(), te_x.double(), offset.double()
    w0, b0 = fit_ridge_dual(tr64, tr_y, 1.0, 10)
    w1, b1 = fit_ridge_dual(tr64 + off64, tr_y, 1.0, 10)
    torch.testing.assert_close(w0, w1, rtol=0, atol=1e-9)
    torch.testing.assert_close(te64 @ w0 + b0, (te64 + off64) @ w1 + b1, rtol=0, atol=1e-8)
    assert not torch.allclose(b0, b1)  # the bias absorbs the offset


def test_targets_are_signed_one_hot():
    t = signed_one_hot(torch.tensor([2, 0]), 3)
    assert t.tolist() == [[-1, -1, 1], [1, -1, -1]]


def test_default_grid_is_scaled_by_mean_squared_centred_norm():
    x = torch.tensor([[1.0, 0.0], [-1.0, 0.0], [0.0, 2.0], [0.0, -2.0]]) + 5.0
    grid = default_l2_grid(x)
    assert grid.numel() == 11
    torch.testing.assert_close(grid, 2.5 * 2.0 ** torch.arange(-10, 11, 2, dtype=torch.float64))
    assert default_l2_grid(3 * x).div(grid).allclose(torch.full((11,), 9.0, dtype=torch.float64))


def test_l2_is_picked_on_validation_when_given():
    tr_x, tr_y, te_x, te_y = _separable()
    # centred fit: a huge l2 shrinks W to ~0 and scores to the bias (all classes tie): chance on validation, so the
    # small one wins. (Not so for big_vision's uncentred targets: there W -> Z^T Y / l2, a class-mean classifier.)
    acc, l2 = fewshot_probe_with_l2(
        tr_x, tr_y, te_x, te_y, l2_grid=[1e-3, 1e30], val_x=te_x, val_y=te_y, method="centred"
    )
    assert (acc, l2) == (1.0, 1e-3)
    assert select_l2(tr_x, tr_y, [1e-3, 1e30], method="centred") == 1e-3  # the held-out split agrees
    assert select_l2(tr_x, tr_y, [7.0]) == 7.0  # a single value is used as is
    assert select_l2(tr_x, tr_y, 7.0) == 7.0
    with pytest.raises(ValueError):
        select_l2(tr_x, tr_y, [1.0, 2.0], val_x=te_x)
    with pytest.raises(ValueError):
        select_l2(tr_x, tr_y, [1.0, 2.0], method="sklearn")


# ---------------------------------------------------------------- big_vision's fewshot_lsr


def test_big_vision_probe_by_hand():
    """Four 1-d shots x = 0, 0, 2, 2 with labels 0, 0, 0, 1 (K = 2). big_vision: mean 1, population std 1 (+1e-5), so
    z = +-a with a = 1 / (1 + 1e-5), design rows [-a, 100], [-a, 100], [a, 100], [a, 100]; targets rows [1, -1] x 3,
    [-1, 1]. Z^T Z = diag(4a^2, 40000) (the cross terms cancel), Z^T Y = [[-2a, 2a], [200, -200]], so
    W = [[-2a / (4a^2 + l2), 2a / (4a^2 + l2)], [200 / (40000 + l2), -200 / (40000 + l2)]] and the class-0 score of x
    is s0(x) = -2a^2 (x - 1) / (4a^2 + l2) + 20000 / (40000 + l2) = -s1(x): class 1 iff s0 < 0."""
    x = torch.tensor([[0.0], [0.0], [2.0], [2.0]])
    y = torch.tensor([0, 0, 0, 1])
    a = 1 / (1 + 1e-5)
    for l2 in (1.0, 1024.0):
        p = fit_probe(x, y, l2, 2, "big_vision")
        assert p.mean.tolist() == [1.0] and p.std.tolist() == pytest.approx([1 + 1e-5], abs=1e-15)
        want_w = [[-2 * a / (4 * a * a + l2), 2 * a / (4 * a * a + l2)], [200 / (40000 + l2), -200 / (40000 + l2)]]
        np.testing.assert_allclose(p.w.numpy(), want_w, rtol=1e-10)
        xs = torch.tensor([[-3.0], [2.0], [3.0], [300.0]])
        s0 = -2 * a * a * (xs[:, 0].double() - 1) / (4 * a * a + l2) + 20000 / (40000 + l2)
        np.testing.assert_allclose(p.scores(xs).numpy(), torch.stack([s0, -s0], 1).numpy(), rtol=1e-10, atol=1e-12)
    # the threshold s0 = 0: x > 1 + 20000 (4a^2 + l2) / (2a^2 (40000 + l2)) -- 2.25 at l2 = 1, 251.6 at big_vision's
    # 1024
    # (the nearly unregularised bias carries the 3:1 class prior)
    test_x, test_y = torch.tensor([[2.0], [3.0], [200.0], [300.0]]), torch.tensor([0, 1, 1, 1])
    assert fewshot_probe(x, y, test_x, test_y, l2_grid=1.0, num_classes=2) == 1.0  # 2 -> 0; 3, 200, 300 -> 1
    assert fewshot_probe(x, y, test_x, test_y, l2_grid=BIG_VISION_L2, num_classes=2) == 0.5  # 2, 3, 200 -> 0; 300 -> 1


def _fewshot_lsr_numpy(x, y, x_test, num_classes, l2):
    """A line-by-line numpy transcription of big_vision evaluators/fewshot_lsr.py (_precompute_cache and
    _eig_fewshot_acc_fn: primal when N >= D, dual otherwise; eigh of the Gram), in float64; returns the predictions."""
    mean = x.mean(0, keepdims=True)
    std = x.std(0, keepdims=True) + 1e-5
    x = np.pad((x - mean) / std, ((0, 0), (0, 1)), constant_values=100.0)
    y = 2.0 * np.eye(num_classes)[y] - 1.0
    if x.shape[0] >= x.shape[1]:
        eigs, q = np.linalg.eigh(x.T @ x)
        rhs, lhs = q.T @ (x.T @ y), q
    else:
        eigs, q = np.linalg.eigh(x @ x.T)
        rhs, lhs = q.T @ y, x.T @ q
    x_test = np.pad((x_test - mean) / std, ((0, 0), (0, 1)), constant_values=100.0)
    w = (lhs * (1.0 / (eigs + l2)).reshape(1, -1)) @ rhs
    return x_test @ w


@pytest.mark.parametrize("n_per_class,d", [(10, 5), (3, 40)])  # N >= D (primal branch) and D > N (dual branch)
def test_big_vision_equals_a_transcription_of_fewshot_lsr(n_per_class, d):
    g = torch.Generator().manual_seed(d)
    means = 2.0 * torch.randn(4, d, generator=g, dtype=torch.float64)
    y = torch.arange(4).repeat_interleave(n_per_class)
    x = (
        means[y] * torch.linspace(0.1, 10, d, dtype=torch.float64)
        + 3.0
        + torch.randn(len(y), d, generator=g, dtype=torch.float64)
    )
    x_test = torch.randn(50, d, generator=g, dtype=torch.float64) * 4
    ref = _fewshot_lsr_numpy(x.numpy(), y.numpy(), x_test.numpy(), 4, BIG_VISION_L2)
    p = fit_probe(x, y, BIG_VISION_L2, 4, "big_vision")
    np.testing.assert_allclose(p.scores(x_test).numpy(), ref, rtol=1e-8, atol=1e-10)
    y_test = torch.as_tensor(ref.argmax(1))
    assert fewshot_probe(x, y, x_test, y_test, l2_grid=BIG_VISION_L2) == 1.0  # same predictions as big_vision's


def test_big_vision_standardises_features_and_centred_does_not():
    """The label lives in a feature of scale 1e-3, next to a noise feature of scale 1e3. Standardised (big_vision) it
    weighs as much as the noise and the probe is perfect; centred with the same l2 it is shrunk away: chance."""
    g = torch.Generator().manual_seed(0)

    def feats(n):
        y = torch.arange(n) % 2
        x = torch.stack(
            [1e-3 * (2.0 * y - 1 + 0.1 * torch.randn(n, generator=g)), 1e3 * torch.randn(n, generator=g)], 1
        )
        return x.double(), y

    (tr_x, tr_y), (te_x, te_y) = feats(20), feats(400)
    assert fewshot_probe(tr_x, tr_y, te_x, te_y, l2_grid=1.0, method="big_vision") == 1.0
    assert fewshot_probe(tr_x, tr_y, te_x, te_y, l2_grid=1.0, method="centred") < 0.65


@pytest.mark.parametrize(
    "dim,grid_size", [(8, 5), (600, 5), (600, 40)]
)  # 40 x 10 classes > 100 shots: the kernel first
@pytest.mark.parametrize("method", ["big_vision", "centred"])
def test_grid_accuracies_equal_one_fit_per_l2(method, dim, grid_size):
    tr_x, tr_y, te_x, te_y = _separable(dim=dim)
    te_x = te_x + (3.0 if dim == 8 else 60.0) * torch.randn(te_x.shape, generator=torch.Generator().manual_seed(3))
    grid = torch.logspace(-2, 5, grid_size, dtype=torch.float64)
    n, gk = (
        100,
        grid_size * 10,
    )  # analysis/estimators/probing.py's rule: weights first while d * G * K < d * n + n * (n + G * K)
    assert (dim * gk >= dim * n + n * (n + gk)) == (grid_size == 40)  # so both orders are tested
    accs = _grid_accuracies(tr_x, tr_y, te_x, te_y, grid, 10, method)
    want = [fewshot_probe(tr_x, tr_y, te_x, te_y, l2_grid=float(v), num_classes=10, method=method) for v in grid]
    assert accs.tolist() == pytest.approx(want, abs=1e-12) and len(set(want)) > 1


def test_default_is_big_vision_with_l2_picked_on_held_out_data():
    tr_x, tr_y, te_x, te_y = _separable(dim=8)
    te_x = te_x + 6.0 * torch.randn(te_x.shape, generator=torch.Generator().manual_seed(3))
    acc, l2 = fewshot_probe_with_l2(tr_x, tr_y, te_x, te_y, val_x=te_x, val_y=te_y)
    assert l2 in big_vision_l2_grid().tolist() and big_vision_l2_grid().tolist() == [2.0**e for e in range(0, 21, 2)]
    assert (acc, l2) == fewshot_probe_with_l2(
        tr_x, tr_y, te_x, te_y, val_x=te_x, val_y=te_y, method="big_vision", l2_grid=big_vision_l2_grid()
    )
    assert acc == max(
        fewshot_probe(tr_x, tr_y, te_x, te_y, l2_grid=float(v), method="big_vision") for v in big_vision_l2_grid()
    )


def test_holdout_split_is_per_class_fifth():
    y = torch.tensor([0] * 10 + [1] * 5 + [2] * 2 + [3])
    fit, hold = holdout_split(y)
    assert torch.bincount(y[hold], minlength=4).tolist() == [2, 1, 1, 0]
    assert sorted(fit.tolist() + hold.tolist()) == list(range(len(y)))


def test_sample_shots_exact_per_class_deterministic_and_seeded():
    y = torch.arange(5).repeat(40)[torch.randperm(200, generator=torch.Generator().manual_seed(0))]
    a = sample_shots(y, 7, seed=3)
    assert a.dtype == torch.long and len(a) == 35 and len(set(a.tolist())) == 35
    assert torch.bincount(y[a], minlength=5).tolist() == [7] * 5
    assert torch.equal(a, sample_shots(y, 7, seed=3))
    assert not torch.equal(a, sample_shots(y, 7, seed=4))
    with pytest.raises(ValueError):
        sample_shots(y, 41, seed=0)


def test_pool_tokens_on_a_hand_built_tensor():
    tokens = torch.arange(2 * 4 * 3, dtype=torch.float32).reshape(2, 4, 3)  # B=2, T=4 (1 prefix + 3), D=3
    assert pool_tokens(tokens, "cls", 1).tolist() == [[0, 1, 2], [12, 13, 14]]
    assert pool_tokens(tokens, "mean", 1).tolist() == [[4.5, 5.5, 6.5], [16.5, 17.5, 18.5]]
    assert pool_tokens(tokens, "mean_spatial", 1).tolist() == [[6, 7, 8], [18, 19, 20]]
    assert pool_tokens(tokens, "mean_spatial", 2).tolist() == [[7.5, 8.5, 9.5], [19.5, 20.5, 21.5]]
    assert pool_tokens(tokens, "mean_spatial", 0).tolist() == pool_tokens(tokens, "mean", 0).tolist()
    assert pool_tokens(tokens, "token:2", 1).tolist() == [[6, 7, 8], [18, 19, 20]]
    for how, prefix in [("cls", 0), ("max", 1), ("token:4", 1), ("mean_spatial", 4)]:
        with pytest.raises(ValueError):
            pool_tokens(tokens, how, prefix)


def test_probe_layers_mean_and_std_over_seeds():
    means = 10.0 * torch.randn(10, 50, generator=torch.Generator().manual_seed(1234))
    tr_x, tr_y = _gaussians(per_class=20, means=means, seed=0)
    te_x, te_y = _gaussians(per_class=30, means=means, seed=1)
    g = torch.Generator().manual_seed(5)
    train = {"sep": tr_x, "shifted": tr_x + 100.0, "noise": torch.randn(200, 32, generator=g)}
    test = {"sep": te_x, "shifted": te_x + 100.0, "noise": torch.randn(300, 32, generator=g)}
    out = probe_layers(train, tr_y, test, te_y, shots=5, seeds=(0, 1, 2))
    assert set(out) == {"sep", "shifted", "noise"}
    assert out["sep"] == (1.0, 0.0) and out["shifted"] == (1.0, 0.0)
    mean, std = out["noise"]
    assert 0.0 <= mean <= 0.3 and std > 0.0
    # the runner is the per-seed probe on the seed's shots, averaged; std is the sample (n - 1) std
    accs = [
        fewshot_probe(train["noise"][i], tr_y[i], test["noise"], te_y, num_classes=10)
        for i in (sample_shots(tr_y, 5, s) for s in (0, 1, 2))
    ]
    assert mean == pytest.approx(float(np.mean(accs))) and std == pytest.approx(float(np.std(accs, ddof=1)))
    val = probe_layers(train, tr_y, test, te_y, shots=5, seeds=(0,), val_feats=test, val_y=te_y)
    assert val["sep"] == (1.0, 0.0)


@pytest.mark.parametrize("method", ["big_vision", "centred"])
def test_layers_of_one_shape_are_probed_at_once_as_each_alone(method, monkeypatch):
    """With l2 picked on validation features and every layer's features of one shape, probe_layers fits all layers
    per seed in batched products: each layer's top-1 is the one its own fewshot_probe gives (the centred method
    with each layer's own feature-scaled grid), on layers whose picks and accuracies differ."""
    from analysis.estimators import probing as P

    means = 3.0 * torch.randn(10, 40, generator=torch.Generator().manual_seed(1234))
    g = torch.Generator().manual_seed(8)
    feats = {}
    for name, noise, scale in (("a", 1.0, 1.0), ("b", 4.0, 30.0), ("c", 8.0, 0.01)):
        tr, tr_y = _gaussians(per_class=20, dim=40, means=means, noise=noise, seed=0)
        va, va_y = _gaussians(per_class=15, dim=40, means=means, noise=noise, seed=1)
        te, te_y = _gaussians(per_class=25, dim=40, means=means, noise=noise, seed=2)
        feats[name] = [scale * (x + 0.1 * torch.randn(x.shape, generator=g)) for x in (tr, va, te)]
    train, val, test = ({n: f[i] for n, f in feats.items()} for i in range(3))
    kw = dict(shots=5, seeds=(0, 1, 2), val_feats=val, val_y=va_y, method=method)
    calls = []
    real, one_shape = P._grid_accuracies_on, P._one_shape
    monkeypatch.setattr(P, "_grid_accuracies_on", lambda fit, *a: calls.append(fit.ndim) or real(fit, *a))
    batched = probe_layers(train, tr_y, test, te_y, **kw)
    assert calls == [3, 3, 3]  # one batched fit per seed
    monkeypatch.setattr(P, "_one_shape", lambda *a: False)
    alone = probe_layers(train, tr_y, test, te_y, **kw)
    assert batched == alone
    assert len({v[0] for v in alone.values()}) == 3  # the layers differ: not one result copied to all
    for name in train:  # and each is the per-seed fewshot_probe_with_l2, averaged
        accs = [
            fewshot_probe_with_l2(train[name][i], tr_y[i], test[name], te_y, None, val[name], va_y, method=method)[0]
            for i in (sample_shots(tr_y, 5, s) for s in (0, 1, 2))
        ]
        assert batched[name][0] == pytest.approx(float(np.mean(accs)), abs=1e-15)
    train["c"] = train["c"][:, :20]  # another shape: layer by layer
    val["c"], test["c"] = val["c"][:, :20], test["c"][:, :20]
    calls.clear()
    monkeypatch.setattr(P, "_one_shape", one_shape)
    probe_layers(train, tr_y, test, te_y, **kw)
    assert calls and set(calls) == {2}
