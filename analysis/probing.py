"""Few-shot linear probes on frozen features.

The probe is the one of the ViT paper (Dosovitskiy et al. 2021, §4.1 "few-shot linear accuracy", Fig. 6 and App. D),
used per layer by Raghu et al. 2021 (App. A, Fig. 11 and Fig. 13) and implemented in big_vision's
``evaluators/fewshot_lsr``: a closed-form, L2-regularised least-squares regression of frozen features onto
{-1, 1}^K targets, scored by top-1 accuracy of the argmax.

Definition (all in float64). With training features ``X`` [n, d], labels ``y`` and ``K`` classes:

    Y      = 2 * one_hot(y, K) - 1                                   targets in {-1, 1}^K, [n, K]
    Xc     = X - mean(X),   Yc = Y - mean(Y)                          centred by the training means
    W      = Xc^T (Xc Xc^T + l2 I_n)^-1 Yc                            [d, K], the DUAL ridge solution (n x n system)
    b      = mean(Y) - mean(X) W                                     [K], the (unregularised) bias
    pred   = argmax_k (x W + b)_k

The dual form equals the primal ridge solution ``W = (Xc^T Xc + l2 I_d)^-1 Xc^T Yc`` (push-through identity) and
costs an n x n solve, which is small in the few-shot regime (n = shots * K) whatever the feature width d.

Default regulariser grid (:func:`default_l2_grid`): ``l2 = s * 2 ** e`` for e in -10, -8, ..., 10 (11 values), where
``s = mean_i ||x_i - mean(X)||^2`` is the mean squared norm of the centred training features (the mean diagonal of the
centred Gram matrix), so the grid is invariant to the scale of the features. ``l2`` is picked from the grid by top-1
on a validation set when one is given, else on a per-class held-out part of the training set (then refit on all of it).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import torch
from torch import Tensor

from analysis.features import pool_features, pool_tokens  # noqa: F401 -- pooling is part of the probe's definition
from train.splits import balanced_indices

L2_EXPONENTS: tuple[int, ...] = tuple(range(-10, 11, 2))
HOLDOUT_FRACTION_DENOM = 5  # hold out 1/5 of each class (at least 1 when the class has >= 2 examples)
HOLDOUT_SEED = 0


def signed_one_hot(labels: Tensor, num_classes: int) -> Tensor:
    """Targets in {-1, 1}^K: ``2 * one_hot(labels, K) - 1`` as float64 [n, K] (ViT §4.1, big_vision fewshot_lsr)."""
    return torch.nn.functional.one_hot(labels.long(), num_classes).double() * 2 - 1


def default_l2_grid(train_x: Tensor) -> Tensor:
    """The default grid ``s * 2 ** arange(-10, 11, 2)`` with ``s = mean_i ||x_i - mean(X)||^2`` (float64, ascending).

    Scaling by ``s`` (the mean diagonal of the centred Gram matrix ``Xc Xc^T``) puts the grid on the scale of the
    eigenvalues the regulariser competes with, so it does not depend on the features' units. ``s = 0`` becomes 1.
    """
    x = train_x.double()
    scale = (x - x.mean(0)).pow(2).sum(1).mean().item()
    scale = scale if scale > 0 else 1.0
    return scale * 2.0 ** torch.tensor(L2_EXPONENTS, dtype=torch.float64)


def fit_ridge_dual(x: Tensor, labels: Tensor, l2: float, num_classes: int) -> tuple[Tensor, Tensor]:
    """Closed-form ridge regression with a bias onto {-1, 1}^K targets, solved in the dual (float64).

    ``W = Xc^T (Xc Xc^T + l2 I_n)^-1 Yc`` and ``b = mean(Y) - mean(X) W`` with ``Xc, Yc`` centred by the training
    means (ViT paper §4.1; big_vision fewshot_lsr). Returns ``(W [d, K], b [K])``; scores are ``x @ W + b``.
    """
    if l2 <= 0:
        raise ValueError(f"l2 must be > 0, got {l2}")
    x = x.double()
    y = signed_one_hot(labels.to(x.device), num_classes)
    x_mean, y_mean = x.mean(0), y.mean(0)
    xc, yc = x - x_mean, y - y_mean
    gram = xc @ xc.T
    gram.diagonal().add_(l2)
    alpha = torch.linalg.solve(gram, yc)
    w = xc.T @ alpha
    return w, y_mean - x_mean @ w


def _accuracy(scores: Tensor, labels: Tensor) -> float:
    return (scores.argmax(1) == labels.to(scores.device).long()).double().mean().item()


def _grid_accuracies(fit_x: Tensor, fit_y: Tensor, eval_x: Tensor, eval_y: Tensor, grid: Tensor, num_classes: int) -> Tensor:
    """Top-1 on (eval_x, eval_y) of the dual ridge fit on (fit_x, fit_y) for every l2 in ``grid``, sharing one eigh.

    With ``Xc Xc^T = U diag(s) U^T``: ``(Xc Xc^T + l2 I)^-1 = U diag(1 / (s + l2)) U^T``.
    """
    x = fit_x.double()
    x_mean = x.mean(0)
    xc = x - x_mean
    y = signed_one_hot(fit_y.to(x.device), num_classes)
    y_mean = y.mean(0)
    evals, evecs = torch.linalg.eigh(xc @ xc.T)
    evals = evals.clamp_min(0)
    proj = evecs.T @ (y - y_mean)  # [n, K]
    kern = ((eval_x.double() - x_mean) @ xc.T) @ evecs  # [m, n]
    accs = [_accuracy(kern @ (proj / (evals + l2)[:, None]) + y_mean, eval_y) for l2 in grid.tolist()]
    return torch.tensor(accs, dtype=torch.float64)


def _best_l2(grid: Tensor, accs: Tensor) -> float:
    """The l2 with the highest accuracy; ties go to the largest l2 (the smoothest fit)."""
    best = accs.max()
    return grid[accs == best].max().item()


def holdout_split(labels: Tensor, seed: int = HOLDOUT_SEED) -> tuple[Tensor, Tensor]:
    """Seeded per-class split ``(fit_idx, holdout_idx)``: ``max(1, n_c // 5)`` of each class with ``n_c >= 2`` held out."""
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


def select_l2(train_x: Tensor, train_y: Tensor, l2_grid: Sequence[float] | Tensor | None = None, val_x: Tensor | None = None,
              val_y: Tensor | None = None, *, num_classes: int | None = None) -> float:
    """Pick the ridge ``l2`` from ``l2_grid`` (default :func:`default_l2_grid` of ``train_x``) by top-1 accuracy.

    One value: that value. Else on ``(val_x, val_y)`` when given (fit on all of train), else on a seeded held-out
    1/5 of each training class (:func:`holdout_split`, fit on the rest). If nothing can be held out (every class
    has a single example) the median of the sorted grid is used. Ties go to the largest l2.
    """
    grid = default_l2_grid(train_x) if l2_grid is None else torch.as_tensor(l2_grid, dtype=torch.float64).flatten()
    if grid.numel() == 0:
        raise ValueError("l2_grid is empty")
    if grid.numel() == 1:
        return grid.item()
    k = num_classes or _num_classes(train_y, val_y)
    if (val_x is None) != (val_y is None):
        raise ValueError("give both val_x and val_y, or neither")
    if val_x is not None:
        return _best_l2(grid, _grid_accuracies(train_x, train_y, val_x, val_y, grid, k))
    fit_idx, hold_idx = holdout_split(train_y)
    if hold_idx.numel() == 0 or fit_idx.numel() == 0:
        return grid.sort().values[(grid.numel() - 1) // 2].item()
    train_y_cpu = train_y.cpu()
    dev = train_x.device
    accs = _grid_accuracies(train_x[fit_idx.to(dev)], train_y_cpu[fit_idx], train_x[hold_idx.to(dev)], train_y_cpu[hold_idx], grid, k)
    return _best_l2(grid, accs)


def fewshot_probe_with_l2(train_x: Tensor, train_y: Tensor, test_x: Tensor, test_y: Tensor,
                          l2_grid: Sequence[float] | Tensor | None = None, val_x: Tensor | None = None, val_y: Tensor | None = None,
                          *, num_classes: int | None = None) -> tuple[float, float]:
    """:func:`fewshot_probe` that also returns the chosen regulariser: ``(top1, l2)``."""
    if test_x.shape[0] == 0:
        raise ValueError("empty test set")
    k = num_classes or _num_classes(train_y, test_y, val_y)
    l2 = select_l2(train_x, train_y, l2_grid, val_x, val_y, num_classes=k)
    w, b = fit_ridge_dual(train_x, train_y, l2, k)
    return _accuracy(test_x.double() @ w + b, test_y), l2


def fewshot_probe(train_x: Tensor, train_y: Tensor, test_x: Tensor, test_y: Tensor, l2_grid: Sequence[float] | Tensor | None = None,
                  val_x: Tensor | None = None, val_y: Tensor | None = None, *, num_classes: int | None = None) -> float:
    """Few-shot linear probe top-1 (ViT paper §4.1 / Fig. 6; Raghu et al. 2021 App. A, Fig. 11/13; big_vision fewshot_lsr).

    ``W = Xc^T (Xc Xc^T + l2 I_n)^-1 Yc``, ``b = mean(Y) - mean(X) W`` with ``Y = 2 one_hot(y) - 1`` in {-1, 1}^K and
    ``Xc, Yc`` centred by the training means (float64, dual n x n solve); returns
    ``mean_i [argmax_k (x_i W + b)_k == y_i]`` over the test set. ``K = num_classes`` or max label over train/test/val + 1.
    ``l2`` is chosen by :func:`select_l2` (default grid ``mean ||x - mean(X)||^2 * 2 ** arange(-10, 11, 2)``).
    Use :func:`fewshot_probe_with_l2` to also get the chosen ``l2``.
    """
    return fewshot_probe_with_l2(train_x, train_y, test_x, test_y, l2_grid, val_x, val_y, num_classes=num_classes)[0]


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


def probe_layers(train_feats: Mapping[str, Tensor], train_y: Tensor, test_feats: Mapping[str, Tensor], test_y: Tensor, shots: int = 10,
                 seeds: Sequence[int] = (0, 1, 2), val_feats: Mapping[str, Tensor] | None = None, val_y: Tensor | None = None,
                 l2_grid: Sequence[float] | Tensor | None = None, num_classes: int | None = None) -> dict[str, tuple[float, float]]:
    """Per-layer few-shot probes (Raghu et al. 2021 App. A, Fig. 11/13; ViT paper §4.1): ``{layer: (mean, std)}`` of top-1.

    For every seed, ``idx = sample_shots(train_y, shots, seed)`` (the same images for every layer) and each layer gets
    ``fewshot_probe(train_feats[layer][idx], train_y[idx], test_feats[layer], test_y)``, its l2 picked on
    ``val_feats[layer], val_y`` when given. ``mean`` is over seeds; ``std`` is the sample standard deviation over seeds
    (Bessel-corrected, n - 1), 0.0 for a single seed. K is fixed once over all labels so every seed uses the same K.
    """
    if set(train_feats) != set(test_feats) or (val_feats is not None and set(val_feats) != set(train_feats)):
        raise ValueError("train_feats, test_feats (and val_feats) must have the same layer names")
    if not seeds:
        raise ValueError("need at least one seed")
    k = num_classes or _num_classes(train_y, test_y, val_y)
    train_y_cpu = train_y.cpu()
    accs: dict[str, list[float]] = {name: [] for name in train_feats}
    for seed in seeds:
        idx = sample_shots(train_y_cpu, shots, seed)
        for name, feats in train_feats.items():
            val_x = None if val_feats is None else val_feats[name]
            accs[name].append(fewshot_probe(feats[idx.to(feats.device)], train_y_cpu[idx], test_feats[name], test_y, l2_grid,
                                            val_x, val_y, num_classes=k))
    out = {}
    for name, values in accs.items():
        v = torch.tensor(values, dtype=torch.float64)
        out[name] = (v.mean().item(), v.std().item() if len(values) > 1 else 0.0)
    return out


# ---------------------------------------------------------------- the probe-train split and pooling, shared by the probe measures

PROBE_SPLIT_SEED = 12345


def probe_split(labels: Tensor) -> tuple[Tensor, Tensor]:
    """The probe-train split's two halves (class-balanced, fixed seed): (shot pool, validation set for l2)."""
    half = balanced_indices(labels.numpy(), len(labels) // 2, seed=PROBE_SPLIT_SEED)
    rest = np.setdiff1d(np.arange(len(labels)), half)
    return torch.as_tensor(half), torch.as_tensor(rest)


def probe_split_problem(data, shots: int, option: str = "shots") -> str | None:
    """One sentence if the probe-train split cannot give ``shots`` per class from its shot half, else None."""
    counts = torch.bincount(data.probe_train.labels, minlength=data.num_classes)
    if len(counts) and int(counts.min()) // 2 >= shots:
        return None
    return (f"few-shot probes draw {shots} shots per class from half of the probe-train split, whose rarest class has "
            f"{int(counts.min()) if len(counts) else 0} images: raise data.probe_train_size to at least {2 * shots * data.num_classes} "
            f"or lower the option {option}.")
