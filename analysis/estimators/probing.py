"""Few-shot linear probes on frozen features.

What the papers say. The ViT paper (Dosovitskiy et al. 2021, §4.1 "Metrics"): "Few-shot accuracies are obtained by
solving a regularized linear regression problem that maps the (frozen) representation of a subset of training images
to {-1, 1}^K target vectors" (Fig. 4, 6; no regulariser value, no preprocessing stated). Raghu et al. 2021 App. A
("Additional details on linear probes"), used per layer in Fig. 11 and 13: "regularized least-squares regression,
following Dosovitskiy et al. [...] {-1, 1}^N target vectors [...] recovered efficiently in closed form", and
(App. A, training details) the 10-shot probes "tuned hyperparameters on a heldout portion of the training set".
Neither text gives the regulariser or any feature preprocessing.

The authors' code (the ViT / Raghu teams' evaluator, published as google-research/big_vision
``big_vision/evaluators/fewshot_lsr.py`` with ``configs/common_fewshot.py``) fills that in: the features of the
shots are STANDARDISED by the mean and the population standard deviation (ddof 0) over the shots, plus 1e-5;
a constant feature ``BIAS_CONSTANT = 100`` is appended (a bias, "large so it's almost unregularized"); the targets
``2 one_hot(y) - 1`` are NOT centred; ``W = (Z^T Z + l2 I)^-1 Z^T Y`` with ONE fixed ``l2_reg = 2 ** 10``; the
prediction is ``argmax_k (z W)_k``. Its 3 seeds draw the shots per class with ``np.random.default_rng(seed)``.

Two methods here (option ``method`` of the probe measures; all in float64, big_vision runs float32):

``"big_vision"`` (the DEFAULT): big_vision's fit. With the shots ``X`` [n, d], labels ``y``, ``K`` classes:

    mu, sigma = mean(X, 0), std(X, 0, ddof=0) + 1e-5                   over the shots only
    Z      = [(X - mu) / sigma, 100]                                   [n, d + 1], bias column 100
    Y      = 2 * one_hot(y, K) - 1                                     [n, K], not centred
    W      = Z^T (Z Z^T + l2 I_n)^-1 Y                                 [d + 1, K] (dual; = (Z^T Z + l2 I)^-1 Z^T Y)
    pred   = argmax_k ([(x - mu) / sigma, 100] W)_k

  ``l2`` fixed (``l2=1024.0`` gives big_vision's evaluator exactly), or -- the default, l2 = None -- picked on
  held-out images from :func:`big_vision_l2_grid` ``2 ** (0, 2, ..., 20)`` (11 values around big_vision's 2 ** 10),
  because Raghu App. A says the hyperparameters of these probes were tuned on a held-out part of the training set.
  This default is what the reproduction uses: the papers' text (regularised least squares in closed form onto
  {-1, 1}, tuned on held-out data) filled in by the authors' code (standardisation, bias feature, the grid's centre).

``"centred"`` (this project's earlier probe; not from either paper or code): features and targets centred by the
training means, an unregularised bias, ``l2`` by default from a scale-invariant grid on held-out data:

    Xc     = X - mean(X),   Yc = Y - mean(Y)
    W      = Xc^T (Xc Xc^T + l2 I_n)^-1 Yc,   b = mean(Y) - mean(X) W
    pred   = argmax_k (x W + b)_k
    grid   = s * 2 ** (-10, -8, ..., 10),  s = mean_i ||x_i - mean(X)||^2   (:func:`default_l2_grid`)

Held-out selection (l2 None, both methods): top-1 on a validation set when one is given (the probe measures pass
the second half of the probe-train split), else on a per-class held-out fifth of the shots (then refit on all of
them); ties go to the largest l2. The dual form costs an n x n solve, small in the few-shot regime (n = shots * K).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from analysis.engine.fixes import TooFewShots
from analysis.estimators.features import pool_features, pool_tokens  # noqa: F401 -- pooling is part of the probe's definition
from train.splits import balanced_indices

METHODS: tuple[str, ...] = ("big_vision", "centred")
DEFAULT_METHOD = "big_vision"
BIG_VISION_L2 = 2.0**10  # big_vision configs/common_fewshot.py: config.l2_reg
BIG_VISION_BIAS = 100.0  # big_vision evaluators/fewshot_lsr.py: BIAS_CONSTANT
BIG_VISION_STD_EPS = 1e-5  # added to the shots' standard deviation (fewshot_lsr._precompute_cache)
BIG_VISION_L2_EXPONENTS: tuple[int, ...] = tuple(range(0, 21, 2))  # held-out grid 2 ** e around big_vision's 2 ** 10
L2_EXPONENTS: tuple[int, ...] = tuple(range(-10, 11, 2))  # the centred method's grid, times its feature scale
HOLDOUT_FRACTION_DENOM = 5  # hold out 1/5 of each class (at least 1 when the class has >= 2 examples)
HOLDOUT_SEED = 0


def _check_method(method: str) -> None:
    if method not in METHODS:
        raise ValueError(f"unknown probe method {method!r}: use one of {', '.join(METHODS)}")


def signed_one_hot(labels: Tensor, num_classes: int) -> Tensor:
    """Targets in {-1, 1}^K: ``2 * one_hot(labels, K) - 1`` as float64 [n, K] (ViT §4.1, big_vision fewshot_lsr)."""
    return torch.nn.functional.one_hot(labels.long(), num_classes).double() * 2 - 1


def default_l2_grid(train_x: Tensor) -> Tensor:
    """The centred method's grid ``s * 2 ** arange(-10, 11, 2)`` with ``s = mean_i ||x_i - mean(X)||^2`` (float64,
    ascending).

    Scaling by ``s`` (the mean diagonal of the centred Gram matrix ``Xc Xc^T``) puts the grid on the scale of the
    eigenvalues the regulariser competes with, so it does not depend on the features' units. ``s = 0`` becomes 1.
    """
    x = train_x.double()
    scale = (x - x.mean(0)).pow(2).sum(1).mean().item()
    scale = scale if scale > 0 else 1.0
    return scale * 2.0 ** torch.tensor(L2_EXPONENTS, dtype=torch.float64)


def big_vision_l2_grid() -> Tensor:
    """The big_vision method's held-out grid ``2 ** (0, 2, ..., 20)`` (float64, ascending; centred on big_vision's
    fixed ``2 ** 10``). Standardised features have unit variance, so fixed values are on a known scale."""
    return 2.0 ** torch.tensor(BIG_VISION_L2_EXPONENTS, dtype=torch.float64)


def l2_grid_for(train_x: Tensor, method: str = DEFAULT_METHOD) -> Tensor:
    """The default held-out grid of ``method``: :func:`big_vision_l2_grid` or :func:`default_l2_grid` of ``train_x``."""
    _check_method(method)
    return big_vision_l2_grid() if method == "big_vision" else default_l2_grid(train_x)


@dataclass
class LinearProbe:
    """A fitted probe: ``scores(x) = design(x) @ w + offset`` (see the module docstring for both methods).

    ``big_vision``: ``design(x) = [(x - mean) / std, 100]``, ``offset = 0``; ``centred``: ``design(x) = x - mean``,
    ``std = None``, ``offset = mean(Y)`` (the bias ``b = mean(Y) - mean(X) W``)."""

    method: str
    mean: Tensor  # [d]
    std: Tensor | None  # [d], big_vision only (population std over the shots + 1e-5)
    w: Tensor  # [d + 1, K] (big_vision) or [d, K] (centred)
    offset: Tensor  # [K]

    def design(self, x: Tensor) -> Tensor:
        return _design(x, self.mean, self.std)

    def scores(self, x: Tensor) -> Tensor:
        return self.design(x) @ self.w + self.offset


def _design(x: Tensor, mean: Tensor, std: Tensor | None) -> Tensor:
    """The design of ``x`` [..., m, d] from the shots' ``mean`` (and ``std``) [..., d] (a leading layer dimension
    or none)."""
    z = x.double() - mean.unsqueeze(-2)
    if std is None:
        return z
    return torch.nn.functional.pad(z / std.unsqueeze(-2), (0, 1), value=BIG_VISION_BIAS)


def _prepare(
    x: Tensor, labels: Tensor, num_classes: int, method: str
) -> tuple[Tensor, Tensor | None, Tensor, Tensor, Tensor]:
    """(mean, std, Z, T, offset): the design of the training features [..., n, d] (a leading layer dimension or
    none; the labels are the same for every layer), the regression targets and the score offset."""
    _check_method(method)
    x = x.double()
    y = signed_one_hot(labels.to(x.device), num_classes)
    mean = x.mean(-2)
    if method == "big_vision":
        std = x.std(-2, correction=0) + BIG_VISION_STD_EPS
        offset = torch.zeros(num_classes, dtype=torch.float64, device=x.device)
    else:
        std, offset = None, y.mean(0)
    return mean, std, _design(x, mean, std), y - offset, offset


def fit_probe(x: Tensor, labels: Tensor, l2: float, num_classes: int, method: str = DEFAULT_METHOD) -> LinearProbe:
    """Closed-form ridge regression onto {-1, 1}^K targets by ``method`` (module docstring), solved in the dual
    ``W = Z^T (Z Z^T + l2 I_n)^-1 T`` (float64) with ``Z`` the design and ``T`` the (centred or not) targets."""
    if l2 <= 0:
        raise ValueError(f"l2 must be > 0, got {l2}")
    mean, std, z, t, offset = _prepare(x, labels, num_classes, method)
    gram = z @ z.T
    gram.diagonal().add_(l2)
    return LinearProbe(method, mean, std, z.T @ torch.linalg.solve(gram, t), offset)


def fit_ridge_dual(x: Tensor, labels: Tensor, l2: float, num_classes: int) -> tuple[Tensor, Tensor]:
    """The ``centred`` method's fit in the original feature space: ``W = Xc^T (Xc Xc^T + l2 I_n)^-1 Yc`` and
    ``b = mean(Y) - mean(X) W`` with ``Xc, Yc`` centred by the training means. Returns ``(W [d, K], b [K])``; scores
    are ``x @ W + b``."""
    p = fit_probe(x, labels, l2, num_classes, "centred")
    return p.w, p.offset - p.mean @ p.w


def _accuracy(scores: Tensor, labels: Tensor) -> float:
    return (scores.argmax(1) == labels.to(scores.device).long()).double().mean().item()


def _grid_accuracies(
    fit_x: Tensor,
    fit_y: Tensor,
    eval_x: Tensor,
    eval_y: Tensor,
    grid: Tensor,
    num_classes: int,
    method: str = DEFAULT_METHOD,
) -> Tensor:
    """Top-1 on (eval_x, eval_y) of the fit on (fit_x, fit_y) for every l2 in ``grid``, sharing one eigh (as
    big_vision's cache): with ``Z Z^T = U diag(s) U^T``, ``(Z Z^T + l2 I)^-1 = U diag(1 / (s + l2)) U^T``."""
    return _grid_accuracies_on(fit_x, fit_y, [(eval_x, eval_y)], grid, num_classes, method)[0]


def _grid_accuracies_on(
    fit_x: Tensor,
    fit_y: Tensor,
    evals: Sequence[tuple[Tensor, Tensor]],
    grid: Tensor,
    num_classes: int,
    method: str = DEFAULT_METHOD,
) -> list[Tensor]:
    """:func:`_grid_accuracies` on several evaluation sets ``[(x, y), ...]`` from one fit and one eigh. Features may
    carry a leading layer dimension ([L, n, d], the same labels for every layer; ``grid`` [G] or one per layer
    [L, G]): every layer is then fitted and scored in the same batched products, and each result is [L, G]."""
    mean, std, z, t, offset = _prepare(fit_x, fit_y, num_classes, method)
    evals_, evecs = torch.linalg.eigh(z @ z.mT)
    evals_ = evals_.clamp_min(0)
    proj = evecs.mT @ t  # [..., n, K]
    grid = grid.to(evals_)
    coef = proj.unsqueeze(-2) / (evals_[..., None, None] + grid[..., None, :, None])  # [..., n, G, K]: every l2
    coef = coef.flatten(-2)  # [..., n, G*K]
    (n, gk), d = coef.shape[-2:], z.shape[-1]
    # few features: the weights Z^T U coef [d, G*K] of every l2 (made once for every set), then one product per
    # set; many features: the kernel to the shots [m, n] first
    weights = (z.mT @ evecs) @ coef if d * gk < d * n + n * (n + gk) else None
    out = []
    for eval_x, eval_y in evals:
        ev = _design(eval_x.to(z.device), mean, std)  # [..., m, d]
        scores = ev @ weights if weights is not None else ((ev @ z.mT) @ evecs) @ coef
        scores = scores.unflatten(-1, (grid.shape[-1], -1))  # [..., m, G, K]
        if method != "big_vision":  # big_vision's offset is 0
            scores = scores + offset
        hits = scores.argmax(-1) == eval_y.to(ev.device).long()[:, None]  # [..., m, G]
        out.append(hits.double().mean(-2).cpu())
    return out


def _pick(grid: Tensor, val_acc: Tensor, test_acc: Tensor) -> tuple[float, float]:
    """(test top-1, l2) at the l2 that :func:`_best_l2` picks on the validation accuracies."""
    i = int(torch.nonzero(grid == _best_l2(grid, val_acc))[0, 0])
    return test_acc[i].item(), grid[i].item()


def _picked_on_val(fit_x, fit_y, val_x, val_y, test_x, test_y, l2_grid, num_classes, method) -> list:
    """``[(test top-1, l2), ...]``, one per layer, of the fit on (fit_x, fit_y) with l2 picked on (val_x, val_y):
    one eigendecomposition scores both sets at every l2 of the layer's grid (:func:`_as_grid`). Features [n, d]
    (one layer) or [L, n, d] (layers of one shape, fitted in the same batched products). The fit at the chosen l2
    is :func:`fit_probe`'s ridge solution, reached through the eigendecomposition instead of a solve (the two
    agree to float64 rounding)."""
    layers = fit_x if fit_x.ndim == 3 else fit_x[None]
    grids = torch.stack([_as_grid(l2_grid, f, method) for f in layers])
    g = grids if fit_x.ndim == 3 else grids[0]
    val_acc, test_acc = _grid_accuracies_on(fit_x, fit_y, [(val_x, val_y), (test_x, test_y)], g, num_classes, method)
    if fit_x.ndim == 2:
        val_acc, test_acc = val_acc[None], test_acc[None]
    return [_pick(*a) for a in zip(grids, val_acc, test_acc)]


def _best_l2(grid: Tensor, accs: Tensor) -> float:
    """The l2 with the highest accuracy; ties go to the largest l2 (the smoothest fit)."""
    best = accs.max()
    return grid[accs == best].max().item()


def holdout_split(labels: Tensor, seed: int = HOLDOUT_SEED) -> tuple[Tensor, Tensor]:
    """Seeded per-class split ``(fit_idx, holdout_idx)``: ``max(1, n_c // 5)`` of each class with ``n_c >= 2`` held
    out."""
    labels = labels.long().cpu()
    gen = torch.Generator().manual_seed(seed)
    fit, hold = [], []
    for c in torch.unique(labels).tolist():
        idx = torch.nonzero(labels == c).flatten()
        idx = idx[torch.randperm(len(idx), generator=gen)]
        k = max(1, len(idx) // HOLDOUT_FRACTION_DENOM) if len(idx) >= 2 else 0
        hold.append(idx[:k])
        fit.append(idx[k:])
    return torch.cat(fit).sort().values, torch.cat(hold).sort().values


def _num_classes(*label_sets: Tensor | None) -> int:
    return int(max(int(y.max().item()) for y in label_sets if y is not None and y.numel() > 0)) + 1


def l2_is_fixed(l2_grid) -> bool:
    """One value (a number or a one-element grid) is used as is and reads no held-out data; None or several values
    are picked on the held-out half (:func:`select_l2`, :func:`probe_rows_read`)."""
    return l2_grid is not None and torch.as_tensor(l2_grid).numel() == 1


def _as_grid(l2_grid: Sequence[float] | Tensor | float | None, train_x: Tensor, method: str) -> Tensor:
    if l2_grid is None:
        return l2_grid_for(train_x, method)
    grid = torch.as_tensor(l2_grid, dtype=torch.float64).flatten()
    if grid.numel() == 0:
        raise ValueError("l2_grid is empty")
    return grid


def select_l2(
    train_x: Tensor,
    train_y: Tensor,
    l2_grid: Sequence[float] | Tensor | float | None = None,
    val_x: Tensor | None = None,
    val_y: Tensor | None = None,
    *,
    num_classes: int | None = None,
    method: str = DEFAULT_METHOD,
) -> float:
    """Pick the ridge ``l2`` from ``l2_grid`` (default: ``method``'s grid, :func:`l2_grid_for`) by top-1 accuracy.

    One value: that value. Else on ``(val_x, val_y)`` when given (fit on all of train), else on a seeded held-out
    1/5 of each training class (:func:`holdout_split`, fit on the rest). If nothing can be held out (every class
    has a single example) the median of the sorted grid is used. Ties go to the largest l2.
    """
    if l2_is_fixed(l2_grid):
        return _as_grid(l2_grid, train_x, method).item()
    grid = _as_grid(l2_grid, train_x, method)
    k = num_classes or _num_classes(train_y, val_y)
    if (val_x is None) != (val_y is None):
        raise ValueError("give both val_x and val_y, or neither")
    if val_x is not None:
        return _best_l2(grid, _grid_accuracies(train_x, train_y, val_x, val_y, grid, k, method))
    fit_idx, hold_idx = holdout_split(train_y)
    if hold_idx.numel() == 0 or fit_idx.numel() == 0:
        return grid.sort().values[(grid.numel() - 1) // 2].item()
    train_y_cpu = train_y.cpu()
    dev = train_x.device
    accs = _grid_accuracies(
        train_x[fit_idx.to(dev)],
        train_y_cpu[fit_idx],
        train_x[hold_idx.to(dev)],
        train_y_cpu[hold_idx],
        grid,
        k,
        method,
    )
    return _best_l2(grid, accs)


def fewshot_probe_with_l2(
    train_x: Tensor,
    train_y: Tensor,
    test_x: Tensor,
    test_y: Tensor,
    l2_grid: Sequence[float] | Tensor | float | None = None,
    val_x: Tensor | None = None,
    val_y: Tensor | None = None,
    *,
    num_classes: int | None = None,
    method: str = DEFAULT_METHOD,
) -> tuple[float, float]:
    """:func:`fewshot_probe` that also returns the chosen regulariser: ``(top1, l2)``."""
    if test_x.shape[0] == 0:
        raise ValueError("empty test set")
    k = num_classes or _num_classes(train_y, test_y, val_y)
    if val_x is not None and val_y is not None and not l2_is_fixed(l2_grid):  # l2 picked on val, fit on all of train
        return _picked_on_val(train_x, train_y, val_x, val_y, test_x, test_y, l2_grid, k, method)[0]
    l2 = select_l2(train_x, train_y, l2_grid, val_x, val_y, num_classes=k, method=method)
    probe = fit_probe(train_x, train_y, l2, k, method)
    return _accuracy(probe.scores(test_x.to(probe.w.device)), test_y), l2


def fewshot_probe(
    train_x: Tensor,
    train_y: Tensor,
    test_x: Tensor,
    test_y: Tensor,
    l2_grid: Sequence[float] | Tensor | float | None = None,
    val_x: Tensor | None = None,
    val_y: Tensor | None = None,
    *,
    num_classes: int | None = None,
    method: str = DEFAULT_METHOD,
) -> float:
    """Few-shot linear probe top-1 (ViT paper §4.1 / Fig. 6; Raghu et al. 2021 App. A, Fig. 11/13).

    ``mean_i [argmax_k scores(x_i)_k == y_i]`` over the test set of the probe :func:`fit_probe` by ``method``
    (default ``"big_vision"``: big_vision fewshot_lsr's standardised features, bias feature 100, {-1, 1} targets;
    ``"centred"``: centred features and targets, unregularised bias -- module docstring). ``l2``: one value (a
    number or a one-element grid) is used as is (``l2_grid=1024.0`` with the default method is big_vision's
    evaluator); else chosen on held-out data by :func:`select_l2` from ``l2_grid`` or the method's grid.
    ``K = num_classes`` or max label over train/test/val + 1. :func:`fewshot_probe_with_l2` also returns the ``l2``.
    """
    return fewshot_probe_with_l2(
        train_x, train_y, test_x, test_y, l2_grid, val_x, val_y, num_classes=num_classes, method=method
    )[0]


def sample_shots(labels: Tensor, shots: int, seed: int) -> Tensor:
    """Indices (LongTensor, sorted) of exactly ``shots`` examples of every class present in ``labels``.

    Seeded with ``torch.Generator().manual_seed(seed)``: one ``randperm`` per class in ascending class order, first
    ``shots`` kept, so the draw is deterministic per seed. Raises if a class has fewer than ``shots`` examples.
    """
    if shots < 1:
        raise ValueError(f"shots must be >= 1, got {shots}")
    labels = labels.long().cpu()
    gen = torch.Generator().manual_seed(seed)
    out = []
    for c in torch.unique(labels).tolist():
        idx = torch.nonzero(labels == c).flatten()
        if len(idx) < shots:
            raise ValueError(f"class {c} has {len(idx)} examples, fewer than shots={shots}")
        out.append(idx[torch.randperm(len(idx), generator=gen)[:shots]])
    return torch.cat(out).sort().values


def _one_shape(names: list, *feats: Mapping[str, Tensor]) -> bool:
    """Whether there are several layers and, in each of ``feats``, all of them have one shape and device."""
    return len(names) > 1 and all(len({(tuple(d[n].shape), d[n].device) for n in names}) == 1 for d in feats)


def probe_layers(
    train_feats: Mapping[str, Tensor],
    train_y: Tensor,
    test_feats: Mapping[str, Tensor],
    test_y: Tensor,
    shots: int = 10,
    seeds: Sequence[int] = (0, 1, 2),
    val_feats: Mapping[str, Tensor] | None = None,
    val_y: Tensor | None = None,
    l2_grid: Sequence[float] | Tensor | float | None = None,
    num_classes: int | None = None,
    method: str = DEFAULT_METHOD,
) -> dict[str, tuple[float, float]]:
    """Per-layer few-shot probes (Raghu et al. 2021 App. A, Fig. 11/13; ViT paper §4.1): ``{layer: (mean, std)}`` of
    top-1.

    For every seed, ``idx = sample_shots(train_y, shots, seed)`` (the same images for every layer) and each layer gets
    ``fewshot_probe(train_feats[layer][idx], train_y[idx], test_feats[layer], test_y, l2_grid, method=method)``, its
    l2 (when not fixed) picked on ``val_feats[layer], val_y`` when given. big_vision draws its shots with numpy's
    ``default_rng(seed)``; ours with :func:`sample_shots` (torch), so the same seed gives other images. ``mean`` is
    over seeds; ``std`` is the sample standard deviation over seeds
    (Bessel-corrected, n - 1), 0.0 for a single seed. K is fixed once over all labels so every seed uses the same K.
    """
    if set(train_feats) != set(test_feats) or (val_feats is not None and set(val_feats) != set(train_feats)):
        raise ValueError("train_feats, test_feats (and val_feats) must have the same layer names")
    if not seeds:
        raise ValueError("need at least one seed")
    k = num_classes or _num_classes(train_y, test_y, val_y)
    train_y_cpu = train_y.cpu()
    accs: dict[str, list[float]] = {name: [] for name in train_feats}
    names = list(train_feats)
    if (
        val_feats is not None
        and val_y is not None
        and not l2_is_fixed(l2_grid)
        and _one_shape(names, train_feats, val_feats, test_feats)
    ):  # all layers fitted at once per seed, each as fewshot_probe fits it: at few-shot sizes the per-layer calls
        # cost mostly their dispatch
        tr, va, te = (torch.stack([d[n] for n in names]) for d in (train_feats, val_feats, test_feats))
        for seed in seeds:
            idx = sample_shots(train_y_cpu, shots, seed)
            picks = _picked_on_val(
                tr[:, idx.to(tr.device)], train_y_cpu[idx], va, val_y, te, test_y, l2_grid, k, method
            )
            for name, (top1, _l2) in zip(names, picks):
                accs[name].append(top1)
    else:
        for seed in seeds:
            idx = sample_shots(train_y_cpu, shots, seed)
            for name, feats in train_feats.items():
                val_x = None if val_feats is None else val_feats[name]
                accs[name].append(
                    fewshot_probe(
                        feats[idx.to(feats.device)],
                        train_y_cpu[idx],
                        test_feats[name],
                        test_y,
                        l2_grid,
                        val_x,
                        val_y,
                        num_classes=k,
                        method=method,
                    )
                )
    out = {}
    for name, values in accs.items():
        v = torch.tensor(values, dtype=torch.float64)
        out[name] = (v.mean().item(), v.std().item() if len(values) > 1 else 0.0)
    return out


# ---------------------------------------------------------------- the probe-train split and pooling, shared by the
# probe measures

PROBE_SPLIT_SEED = 12345


def probe_split(labels: Tensor) -> tuple[Tensor, Tensor]:
    """The probe-train split's two halves (class-balanced, fixed seed): (shot pool, validation set for l2)."""
    half = balanced_indices(labels.numpy(), len(labels) // 2, seed=PROBE_SPLIT_SEED)
    rest = np.setdiff1d(np.arange(len(labels)), half)
    return torch.as_tensor(half), torch.as_tensor(rest)


def probe_split_problem(data, shots: int, measure: str, option: str = "shots") -> TooFewShots | None:
    """The problem (:class:`analysis.engine.fixes.TooFewShots`) if the probe-train split cannot give ``shots`` per class
    from its shot half for ``measure``'s option ``option``, else None."""
    counts = torch.bincount(data.probe_train.labels, minlength=data.num_classes)
    if len(counts) and int(counts.min()) // 2 >= shots:
        return None
    return TooFewShots(measure, option, shots, int(counts.min()) if len(counts) else 0, int(data.num_classes))


def probe_rows_read(labels: Tensor, shots: int, seeds: Sequence[int], l2) -> np.ndarray:
    """The probe-train rows (sorted) whose features a few-shot probe over :func:`probe_split` reads: for every seed
    the shots :func:`sample_shots` draws from the shot half (as :func:`probe_layers` does), and the whole held-out
    half unless ``l2`` is fixed (:func:`l2_is_fixed`: then :func:`select_l2` never reads it)."""
    labels = labels.long().cpu()
    shot_idx, val_idx = probe_split(labels)
    parts = [shot_idx[sample_shots(labels[shot_idx], shots, s)] for s in seeds]
    if not l2_is_fixed(l2):  # picked on the held-out half
        parts.append(val_idx)
    return np.unique(torch.cat(parts).numpy())


def expand_rows(
    feats: Mapping[str, Tensor], labels: Tensor, index: np.ndarray, all_labels: Tensor
) -> tuple[dict, Tensor]:
    """Features gathered over the probe-train rows ``index`` only (in that order) -> full-size ``[N, ...]`` features
    (rows not in ``index`` are zero, for code that reads only ``index``'s rows) and the whole split's labels, so
    that indices drawn from the labels (shots, halves) and shapes (random-feature baselines) are those of a pass over
    every image."""
    rows = torch.as_tensor(np.asarray(index), dtype=torch.long)
    if not torch.equal(labels.cpu(), all_labels.cpu()[rows]):
        raise RuntimeError("the probe-train features gathered are not those of the rows the suite said it forwarded.")
    out = {}
    for k, v in feats.items():
        full = v.new_zeros((len(all_labels), *v.shape[1:]))
        full[rows.to(v.device)] = v
        out[k] = full
    return out, all_labels


class StreamingRidge:
    """A ridge classifier on standardised features, fit from streamed moments: the same classifier as scikit-learn's
    ``make_pipeline(StandardScaler(), RidgeClassifier(alpha))`` on every row added (to float rounding), with memory
    D x D + D x C float64 whatever the number of rows.

    scikit-learn's RidgeClassifier encodes class c of C as +1 / -1 targets (one column per class present), fits a
    ridge with an intercept on features standardised with the rows' mean and (population) standard deviation (a
    constant feature keeps scale 1), and predicts the class of the largest score. With Z the standardised, hence
    centred, rows and Y the targets, the weights are ``W = (Z^T Z + alpha I)^-1 Z^T Y`` and the intercept is the
    targets' mean; ``Z^T Z`` and ``Z^T Y`` follow from the sums ``S1 = sum x``, ``S2 = sum x x^T`` and the per-class
    sums ``Sc = sum_{y=c} x``, accumulated in float64 by :meth:`add` one chunk of rows at a time."""

    def __init__(self, dim: int, num_classes: int, alpha: float = 1.0):
        self.alpha, self.num_classes = float(alpha), int(num_classes)
        self.n = torch.zeros((), dtype=torch.float64)
        self.s1 = torch.zeros(dim, dtype=torch.float64)
        self.s2 = torch.zeros(dim, dim, dtype=torch.float64)
        self.sc = torch.zeros(dim, num_classes, dtype=torch.float64)
        self.counts = torch.zeros(num_classes, dtype=torch.float64)

    def state(self) -> dict[str, Tensor]:
        """The sums, to reduce over processes (:func:`analysis.engine.reduce.all_reduce_tree`) and :meth:`load`."""
        return {"n": self.n, "s1": self.s1, "s2": self.s2, "sc": self.sc, "counts": self.counts}

    def load(self, state: dict[str, Tensor]) -> StreamingRidge:
        self.n, self.s1, self.s2, self.sc, self.counts = (state[k] for k in ("n", "s1", "s2", "sc", "counts"))
        return self

    def add(self, x: Tensor, y: Tensor) -> None:
        """Rows ``x`` [M, D] with classes ``y`` [M] (0 <= y < num_classes)."""
        x = x.detach().to("cpu", torch.float64)
        y = y.detach().to("cpu", torch.long)
        self.n += x.shape[0]
        self.s1 += x.sum(0)
        self.s2 += x.T @ x
        self.sc.index_add_(1, y, x.T)
        self.counts += torch.bincount(y, minlength=self.num_classes).to(torch.float64)

    def fit(self) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor] | None:
        """(mean, scale, W [D, C'], intercept [C'], classes [C']) over the classes present, or None with fewer than
        two classes (nothing to tell apart)."""
        present = torch.nonzero(self.counts > 0).flatten()
        if len(present) < 2:
            return None
        n = float(self.n)
        mean = self.s1 / n
        cov = self.s2 / n - torch.outer(mean, mean)  # population covariance, as StandardScaler's variance
        var = torch.diagonal(cov).clamp_min(0)
        scale = var.sqrt()
        eps = 10 * torch.finfo(torch.float64).eps  # scikit-learn's _handle_zeros_in_scale: a ~constant feature keeps 1
        scale = torch.where(scale < eps * mean.abs().clamp_min(1.0), torch.ones_like(scale), scale)
        zz = n * cov / torch.outer(scale, scale)
        counts = self.counts[present]
        if len(present) == 2:  # scikit-learn's binary case: one column, +1 for the second class
            zy = 2 * (self.sc[:, present[1:]] - torch.outer(mean, counts[1:])) / scale[:, None]
            intercept = (2 * counts[1:] - n) / n
        else:
            zy = 2 * (self.sc[:, present] - torch.outer(mean, counts)) / scale[:, None]
            intercept = (2 * counts - n) / n
        w = torch.linalg.solve(zz + self.alpha * torch.eye(len(zz), dtype=torch.float64), zy)
        return mean, scale, w, intercept, present

    @staticmethod
    def predict(fitted, x: Tensor) -> Tensor:
        """The classes of rows ``x`` [M, D] under ``fitted`` (:meth:`fit`)."""
        mean, scale, w, intercept, classes = fitted
        s = ((x.detach().to("cpu", torch.float64) - mean) / scale) @ w + intercept
        if len(classes) == 2:
            return classes[(s[:, 0] > 0).long()]
        return classes[s.argmax(1)]
