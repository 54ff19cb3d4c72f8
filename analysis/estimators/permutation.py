"""Permutation nulls for the similarity scores: one pair of representations, a layer x layer map with family-wise
error control, and minibatch CKA's null in the same pass as CKA.

The null. Under "X and Y carry no shared information about the examples", pairing Y's examples with X's at random
changes nothing, so the score of X against Y with Y's examples (rows) permuted is a draw from the score's null
distribution. Over ``n_perm`` uniform random permutations (seeded):

    null mean m, null SD s (n_perm - 1 in the denominator),
    calibrated score z = (score - m) / s, and the excess score - m (the score above chance),
    p = (1 + #{null at least as extreme as the score}) / (n_perm + 1)

(Phipson and Smyth 2010: the +1 keeps p valid, never 0, and puts its floor at 1 / (n_perm + 1)). "As extreme" is >=
for similarities and <= for the Procrustes distance and angle (smaller is more alike); z keeps the raw sign. The same
p-value is exact for any score: it only needs the permuted units exchangeable under the null.

The exchangeable unit. By default each example (row) is its own unit. When examples come in groups that are not
independent of each other -- 16 crops of one photo, frames of one video -- rows are not exchangeable: two crops of a
photo are alike in X and alike in Y whether or not X and Y share anything about photos, so a null that scatters the
crops across photos scores far below the observed pairing and p comes out too small (the test of
``tests/analysis/estimators/test_permutation_nulls.py``: 5% nominal read as most of the replicates on clustered data
with X and Y independent at the photo level). ``groups=`` [n] (a label per row) makes the group the unit
(:func:`group_permutations`): a permutation pi of the groups sends the k-th row of group g (k counting its rows in
order) to the k-th row of group pi(g), so every group keeps its rows together and its internal structure. Groups of
unequal size cannot be matched row for row, so pi permutes the groups within each size class (groups of 16 rows among
themselves, groups of 12 among themselves; a group alone in its size class stays in place): the test stays exact under
"groups of one size are exchangeable", which is what independent draws of units give, and no row is dropped
(restricting to the commonest size would drop whole groups). Distinct permutations: the product over size classes of
(groups in the class)! (:func:`distinct_permutations`; 19 photos of 16 crops: 19! ~ 1.2e17); seeded draws with
replacement, so p never falls below 1 / (n_perm + 1) however many there are. Groups of one row each give exactly the
row-level draws.

Maps. ``permutation_map(score, Xs, Ys)`` scores every layer of one model against every layer of the other; one
permutation reorders the examples of every layer of Y alike (so cells keep their dependence), and the family-wise
error over cells is controlled by the max statistic (Westfall and Young 1993; Nichols and Holmes 2002): with each
cell standardised by its own mean and SD over the observed and permuted scores (cells differ in null mean and
spread, e.g. by width), the adjusted p of a cell is (1 + #{permutations whose largest standardised score over
all cells >= the cell's}) / (n_perm + 1). A cell with adjusted p <= alpha is significant with family-wise error at
most alpha.

Cost. Every estimator known here (:data:`analysis.similarity` lists them) is split into what one representation
needs, computed once (its centred Gram, k-NN table, Procrustes factor or CCA basis), and the score of a pair with
one side's examples reordered, which needs no pass over the features: a permutation of a Gram-based CKA costs
O(n^2) (permute the rows and columns of the centred Gram, one Frobenius product), mutual k-NN O(n k^2), CKNNA O(n^2),
Procrustes and CCA O(n r^2) for r retained directions. Any other callable ``score(x, y)`` works too, called once per
permutation on ``y[perm]``. Minibatch CKA (:class:`PermutedMinibatchCKA`) permutes within each minibatch and reuses
that minibatch's centred Grams, so its null of 1,000 permutations adds O(1000 L_y (L_x + 1) n^2) to CKA's
O((L_x + L_y) n^2 p): measured in docs/analysis.md.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from analysis.engine.reduce import all_reduce_tree
from analysis.estimators import cca as _cca
from analysis.estimators import kernels as _kernels
from analysis.estimators import neighbours as _nn
from analysis.estimators import procrustes as _proc
from analysis.estimators.similarity import MinibatchCKA, cka, hsic_gram

# Elements of the permuted representations held at once (float64: 32 MiB): permutations are scored in batches.
_BATCH_ELEMENTS = 1 << 22
# Relative tolerance when counting null scores at least as extreme as the observed one: a permutation that leaves
# the score unchanged in exact arithmetic counts, whatever its rounding.
_TIE = 1e-12


@dataclass(frozen=True)
class Permuted:
    """One score and its permutation null (module docstring): ``z`` = (score - null_mean) / null_sd, ``excess`` =
    score - null_mean, ``p`` with the +1 correction, ``null`` the permuted scores, ``lower`` whether smaller
    scores mean more alike (distances)."""

    score: float
    null_mean: float
    null_sd: float
    z: float
    excess: float
    p: float
    null: np.ndarray
    lower: bool = False


@dataclass(frozen=True)
class PermutedMap:
    """A layer x layer map [L_x, L_y] and its null: the raw ``score``, ``null_mean`` / ``null_sd``, the calibrated
    ``z`` and ``excess``, each cell's ``p`` and the family-wise ``p_fwer`` (max statistic over cells); ``null``
    [n_perm, L_x, L_y]."""

    score: np.ndarray
    null_mean: np.ndarray
    null_sd: np.ndarray
    z: np.ndarray
    excess: np.ndarray
    p: np.ndarray
    p_fwer: np.ndarray
    null: np.ndarray
    lower: bool = False


@dataclass(frozen=True)
class _Null:
    """An estimator split for permutations: ``side(x, **kw)`` once per representation, ``permute(s, perms)`` a batch
    of reorderings of one side [B, n], ``pair(sx, sy_batch, **kw)`` -> [B] scores."""

    side: Callable
    permute: Callable
    pair: Callable
    lower: bool = False


@functools.cache
def _triangle(n: int) -> tuple[np.ndarray, np.ndarray]:
    """Row and column indices of the strict upper triangle of an n x n matrix."""
    return np.triu_indices(n, 1)


def _take_rows(a: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """a[index] along the first axis; on CPU by numpy's take (torch's indexing at 2 threads on the loaded 2-core
    host took 2-70x as long, numpy's fancy indexing 3.6x as long as its take)."""
    if a.device.type == "cpu":
        return torch.from_numpy(np.take(a.numpy(), index.numpy(), axis=0))
    return a[index.to(a.device)]


class GramHalves:
    """Centred Grams of one or more layers, split for permuted Frobenius products: for symmetric A and B,
    <A, B> = 2 sum_{i<j} A_ij B_ij + sum_i A_ii B_ii, so a permutation needs the n(n - 1)/2 upper entries of the
    permuted Gram, not all n^2, and one matrix product gives every layer pair of a batch of permutations."""

    def __init__(self, grams: torch.Tensor, n: int):
        flat = grams.reshape(-1, n * n)  # [L, n*n] from [L, n, n] or flattened
        ti, tj = _triangle(n)
        self.n = n
        self.upper = flat[:, torch.from_numpy(ti * n + tj).to(flat.device)]  # [L, T]
        self.diag = flat[:, :: n + 1]  # [L, n]
        self.entries = flat.T.contiguous()  # [n*n, L]: one entry's value in every layer side by side

    def products(self, other: GramHalves, perms: torch.Tensor) -> torch.Tensor:
        """[B, L_self, L_other]: <G_self_i, P G_other_j P^T> for each permutation P of ``perms`` [B, n] (row i of
        the reordered Gram is old row perm[i])."""
        n, b = self.n, perms.shape[0]
        ti, tj = _triangle(n)
        p = perms.cpu().numpy()  # index arithmetic in numpy: torch's took 3x as long on the loaded host
        up = _take_rows(other.entries, torch.from_numpy((p[:, ti] * n + p[:, tj]).T))  # [T, B, L_other]
        dg = _take_rows(other.entries, torch.from_numpy((p * (n + 1)).T))  # [n, B, L_other]
        r = 2 * (self.upper @ up.reshape(up.shape[0], -1)) + self.diag @ dg.reshape(n, -1)  # [L_self, B*L_other]
        return r.reshape(-1, b, other.entries.shape[1]).transpose(0, 1)


def _gram_side(g: torch.Tensor) -> tuple[GramHalves, torch.Tensor]:
    return GramHalves(g, g.shape[0]), g.square().sum().sqrt()


def _gram_pair(sx, sy) -> torch.Tensor:
    (hx, nx), ((hy, perms), ny) = sx, sy
    return hx.products(hy, perms)[:, 0, 0] / (nx * ny)


def _permute_gram_side(s, perms):
    return (s[0], perms), s[1]  # the permutation is applied inside the product: no permuted Gram is formed


def _rows(b: torch.Tensor, perms: torch.Tensor) -> torch.Tensor:
    return b[perms]


def _pwcca_side(x):
    q, loadings = _cca.pwcca_side(x)
    return q, loadings, _kernels.as_rows(x).shape[1]


def _pwcca_pair(sx, sy):
    (qx, lx, px), (qy, ly, py) = sx, sy
    return _cca.pwcca_from(qx, qy, lx if px <= py else ly, px <= py)


_NULLS: dict[Callable, _Null] = {
    cka: _Null(
        lambda x, unbiased=True: _gram_side(hsic_gram(_kernels.as_rows(x), unbiased)[0]), _permute_gram_side, _gram_pair
    ),
    _kernels.rbf_cka: _Null(
        lambda x, threshold=1.0, unbiased=False: _gram_side(_kernels.centred_rbf_gram(x, threshold, unbiased)),
        _permute_gram_side,
        _gram_pair,
    ),
    _nn.mutual_knn: _Null(lambda x, k=10: _nn.knn_table(x, k), _nn.permute_table, lambda a, b: _nn.knn_overlap(a, b)),
    _nn.cknna: _Null(lambda x, k=10: _nn.cknna_side(x, k), _nn.permute_cknna_side, lambda a, b: _nn.cknna_pair(a, b)),
    _proc.procrustes_distance: _Null(
        lambda x: _proc.procrustes_factor(x), _rows, lambda a, b: 2 - 2 * _proc.procrustes_nuclear(a, b), lower=True
    ),
    _proc.procrustes_angle: _Null(
        lambda x: _proc.procrustes_factor(x),
        _rows,
        lambda a, b: torch.acos(_proc.procrustes_nuclear(a, b).clamp(-1, 1)),
        lower=True,
    ),
    _cca.svcca: _Null(
        lambda x, keep=0.99: _cca.principal_basis(x, keep),
        _rows,
        lambda a, b: _cca.canonical_correlations(a, b).mean(-1),
    ),
    _cca.pwcca: _Null(_pwcca_side, lambda s, perms: (s[0][perms], s[1], s[2]), _pwcca_pair),
}


def _generic(score: Callable) -> _Null:
    """Any ``score(x, y, **options)``: one call per permutation on y's rows reordered (numpy or torch alike)."""

    def permute(y, perms):
        return [y[p.numpy()] if isinstance(y, np.ndarray) else y[p] for p in perms]

    def pair(sx, sys_):
        x, options = sx
        return torch.tensor([float(score(x, y, **options)) for y in sys_], dtype=torch.float64)

    def side(x, **options):
        return x, options

    return _Null(side, lambda s, perms: permute(s[0], perms), pair, lower=getattr(score, "lower_is_closer", False))


def _resolve(score: Callable) -> tuple[_Null, dict]:
    """The estimator's permutation split and its options, for a function or a functools.partial of one."""
    options: dict[str, Any] = {}
    fn = score
    while isinstance(fn, functools.partial):
        if fn.args:
            raise ValueError("permutation_test takes a score's options by keyword (functools.partial(f, k=5)).")
        options = {**fn.keywords, **options}
        fn = fn.func
    return _NULLS.get(fn) or _generic(fn), options


def _permutations(n: int, n_perm: int, seed: int, groups=None) -> torch.Tensor:
    if groups is not None:
        return group_permutations(groups, n_perm, seed, n)
    g = torch.Generator().manual_seed(seed)
    return torch.rand(n_perm, n, generator=g).argsort(1)


def _size_classes(groups, n: int | None = None) -> list[np.ndarray]:
    """The groups' rows by size class: one [m, s] array per size s (ascending), row a of it the indices of the a-th
    group of that size (groups in order of their first row, a group's rows in their order)."""
    g = np.asarray(groups).reshape(-1)
    if n is not None and len(g) != n:
        raise ValueError(f"groups must give one label per example: {len(g)} labels for {n} examples.")
    _, first, inverse = np.unique(g, return_index=True, return_inverse=True)
    order = np.argsort(first, kind="stable")  # the groups in order of their first row
    members = [np.flatnonzero(inverse == u) for u in order]
    sizes = sorted({len(m) for m in members})
    return [np.stack([m for m in members if len(m) == s]) for s in sizes]


def distinct_permutations(groups) -> int:
    """How many distinct permutations :func:`group_permutations` draws from: the product over size classes of (groups
    of that size)! (n! for one row per group)."""
    return math.prod(math.factorial(len(c)) for c in _size_classes(groups))


def group_permutations(groups, n_perm: int, seed: int, n: int | None = None) -> torch.Tensor:
    """[n_perm, n] seeded permutations of the rows that move whole groups (module docstring, "The exchangeable
    unit"): within each size class, a uniform permutation pi of its groups; row k of group g is sent the k-th row of
    group pi(g) (``y[perm]``: row i of the result is old row perm[i]). One generator draws the size classes in
    ascending size, so one row per group gives exactly the row-level draws. ValueError (one sentence) when no size
    class holds two groups: nothing could move."""
    classes = _size_classes(groups, n)
    if all(len(c) < 2 for c in classes):
        raise ValueError(
            "a permutation null over groups needs at least two groups of the same size to exchange; these groups' "
            f"sizes are {sorted(c.shape[1] for c in classes)}: pass groups with repeated sizes, or groups=None."
        )
    rows = sum(c.size for c in classes)
    gen = torch.Generator().manual_seed(seed)
    out = np.empty((n_perm, rows), dtype=np.int64)
    for c in classes:  # c [m, s]: the m groups of size s
        sigma = torch.rand(n_perm, len(c), generator=gen).argsort(1).numpy()  # [n_perm, m]
        out[:, c.reshape(-1)] = c[sigma].reshape(n_perm, -1)
    return torch.from_numpy(out)


def _batch(n: int) -> int:
    return max(1, min(256, _BATCH_ELEMENTS // max(n * n, 1)))


def _nrows(x) -> int:
    return x.shape[0]


def _null_scores(null: _Null, sx, sy, perms: torch.Tensor) -> torch.Tensor:
    out = []
    step = _batch(perms.shape[1])
    for b in range(0, perms.shape[0], step):
        out.append(torch.as_tensor(null.pair(sx, null.permute(sy, perms[b : b + step]))).reshape(-1))
    return torch.cat(out).to(torch.float64)


def _identity(n: int) -> torch.Tensor:
    return torch.arange(n)[None]


def _summary(score: np.ndarray, null: np.ndarray, lower: bool) -> dict:
    mean = null.mean(0)
    sd = null.std(0, ddof=1)
    with np.errstate(invalid="ignore", divide="ignore"):
        z = (score - mean) / sd
    tie = _TIE * np.maximum(1.0, np.abs(score))
    extreme = (null <= score + tie) if lower else (null >= score - tie)
    p = (1 + extreme.sum(0)) / (null.shape[0] + 1)
    p = np.where(np.isnan(score), np.nan, p)
    return {"score": score, "null_mean": mean, "null_sd": sd, "z": z, "excess": score - mean, "p": p}


def permutation_test(score: Callable, x, y, n_perm: int = 1000, seed: int = 0, groups=None) -> Permuted:
    """The permutation null of ``score(x, y)`` (module docstring): y's examples permuted ``n_perm`` times (seeded);
    the exchangeable unit is the example, or with ``groups`` [n] (a label per example) the group: whole groups are
    permuted within their size class, each row going to the row of the same index in the other group
    (:func:`group_permutations`; one example per group is exactly the default). Returns the score, null mean and
    SD, calibrated score and excess, and the +1-corrected p-value. ``score`` is one of the estimators of
    :mod:`analysis.similarity` (options by ``functools.partial``, e.g. ``partial(rbf_cka, threshold=0.5)``), each
    permuted without a pass over the features, or any callable ``score(x, y)`` (called on ``y[perm]``; one whose
    smaller values mean more alike says so by an attribute ``lower_is_closer = True``)."""
    if n_perm < 2:
        raise ValueError(f"permutation_test needs n_perm >= 2 to estimate the null's spread, got {n_perm}.")
    n = _nrows(x)
    if _nrows(y) != n:
        raise ValueError(f"permutation_test needs the same examples in both: {n} vs {_nrows(y)} rows.")
    null, options = _resolve(score)
    sx, sy = null.side(x, **options), null.side(y, **options)
    observed = float(_null_scores(null, sx, sy, _identity(n))[0])
    draws = _null_scores(null, sx, sy, _permutations(n, n_perm, seed, groups)).numpy()
    s = _summary(np.float64(observed), draws, null.lower)
    return Permuted(**{k: float(v) for k, v in s.items()}, null=draws, lower=null.lower)


def fwer_adjusted(score: np.ndarray, null: np.ndarray, lower: bool = False) -> np.ndarray:
    """Max-statistic family-wise adjusted p-values of a map ``score`` [...] given its null [n_perm, ...] (module
    docstring); NaN cells (a constant layer) are left out of the maximum and stay NaN. Each cell is standardised
    by the mean and SD of its null and observed scores together: a function of the set of all n_perm + 1, which the
    permutations leave exchangeable, so the max statistic keeps its exact level (on the same 1,000 simulated 4 x 4
    maps of independent layers, 199 permutations, family-wise error at 5% read 5.5% so and 6.3% standardised by the
    null alone, SE 0.7%)."""
    both = np.concatenate([score[None], null])
    mean, sd = both.mean(0), both.std(0, ddof=1)
    sign = -1.0 if lower else 1.0
    with np.errstate(invalid="ignore", divide="ignore"):
        t_null = sign * (null - mean) / sd
        t_obs = sign * (score - mean) / sd
    flat = t_null.reshape(null.shape[0], -1)
    top = np.full(null.shape[0], -np.inf)
    finite = np.isfinite(flat)
    if finite.any():
        top = np.where(finite, flat, -np.inf).max(1)
    tie = _TIE * np.maximum(1.0, np.abs(t_obs))
    count = (top.reshape((-1,) + (1,) * score.ndim) >= t_obs - tie).sum(0)
    return np.where(np.isfinite(t_obs), (1 + count) / (null.shape[0] + 1), np.nan)


def _map_result(score: np.ndarray, null: np.ndarray, lower: bool) -> PermutedMap:
    return PermutedMap(**_summary(score, null, lower), p_fwer=fwer_adjusted(score, null, lower), null=null, lower=lower)


def _gram_map(sxs: list, sys_: list, perms: torch.Tensor, n: int) -> PermutedMap:
    """permutation_map for the Gram-based CKAs: the layers' centred Grams stacked into one :class:`GramHalves` per
    side, so a batch of permutations gathers each entry of every layer of y once (as :class:`PermutedMinibatchCKA`)."""

    def stacked(sides):
        grams = torch.stack([h.entries[:, 0] for (h, _) in sides])  # [L, n*n]
        return GramHalves(grams, n), torch.stack([norm for (_, norm) in sides])

    hx, nx = stacked(sxs)
    hy, ny = (hx, nx) if sys_ is sxs else stacked(sys_)
    scale = nx[:, None] * ny[None, :]
    observed = (hx.products(hy, _identity(n))[0] / scale).cpu().numpy()
    draws = np.empty((perms.shape[0], len(sxs), len(sys_)))
    step = max(1, _BATCH_ELEMENTS // 2 // (n * n * len(sys_)))
    for b in range(0, perms.shape[0], step):
        draws[b : b + step] = (hx.products(hy, perms[b : b + step]) / scale).cpu().numpy()
    return _map_result(observed, draws, lower=False)


def _observed(null: _Null, sxs: list, sys_: list, n: int) -> np.ndarray:
    """[L_x, L_y] scores of prepared sides, the examples in their own order."""
    out = np.empty((len(sxs), len(sys_)))
    for j, sy in enumerate(sys_):
        same = null.permute(sy, _identity(n))
        for i, sx in enumerate(sxs):
            out[i, j] = float(torch.as_tensor(null.pair(sx, same)).reshape(-1)[0])
    return out


def score_map(score: Callable, xs: list, ys: list | None = None) -> np.ndarray:
    """``score`` of every layer of ``xs`` against every layer of ``ys`` (``None``: xs against itself), [L_x, L_y],
    each representation prepared once (as :func:`permutation_map` does, without the null)."""
    null, options = _resolve(score)
    sxs = [null.side(x, **options) for x in xs]
    sys_ = sxs if ys is None else [null.side(y, **options) for y in ys]
    return _observed(null, sxs, sys_, _nrows(xs[0]))


def permutation_map(
    score: Callable, xs: list, ys: list | None = None, n_perm: int = 1000, seed: int = 0, groups=None
) -> PermutedMap:
    """``score`` of every layer of ``xs`` against every layer of ``ys`` (``None``: xs against itself) and its
    permutation null, one permutation reordering every layer of ys alike; p-values per cell and family-wise
    adjusted by the max statistic over cells (module docstring). Each representation is prepared once. The
    exchangeable unit is the example, or with ``groups`` [n] the group (as :func:`permutation_test`; the Gram-based
    CKAs' reuse of the centred Grams takes the group permutations as it takes any other)."""
    ys = xs if ys is None else ys
    n = _nrows(xs[0])
    if any(_nrows(r) != n for r in [*xs, *ys]):
        raise ValueError("permutation_map needs every layer's representation to hold the same examples.")
    if n_perm < 2:
        raise ValueError(f"permutation_map needs n_perm >= 2 to estimate the null's spread, got {n_perm}.")
    null, options = _resolve(score)
    sxs = [null.side(x, **options) for x in xs]
    sys_ = sxs if ys is xs else [null.side(y, **options) for y in ys]
    perms = _permutations(n, n_perm, seed, groups)
    if null.pair is _gram_pair:  # Gram-based: every layer pair of a batch of permutations in one product
        return _gram_map(sxs, sys_, perms, n)
    observed = _observed(null, sxs, sys_, n)
    draws = np.empty((n_perm, len(xs), len(ys)))
    step = _batch(n)
    for j, sy in enumerate(sys_):
        for b in range(0, n_perm, step):
            permuted = null.permute(sy, perms[b : b + step])  # once per batch and layer of y, for every layer of x
            for i, sx in enumerate(sxs):
                draws[b : b + step, i, j] = torch.as_tensor(null.pair(sx, permuted)).reshape(-1).numpy()
    return _map_result(observed, draws, null.lower)


class PermutedMinibatchCKA(MinibatchCKA):
    """:class:`MinibatchCKA` and its permutation null in one pass: in each minibatch, the centred Gram of every
    layer (computed once, as for CKA) is also taken with y's examples reordered by ``n_perm`` seeded permutations
    within that minibatch, and each permutation's HSIC sums accumulate like CKA's. One permutation reorders every
    layer of y alike; a permutation's null CKA map is its sums over the unchanged denominators. :meth:`compute` is
    CKA exactly as :class:`MinibatchCKA`'s; :meth:`result` adds the null (a :class:`PermutedMap`, family-wise p by
    the max statistic). Per minibatch and permutation the null gathers n(n - 1)/2 entries of every layer of y and
    costs L_x L_y n^2 / 2 multiply-adds (:class:`GramHalves`), against CKA's (L_x + L_y) n^2 p / 2 for the Grams;
    it holds n_perm L_x L_y float64 sums. Processes seeded alike draw the same permutations for their own
    minibatches: still a valid null, as each minibatch's examples are permuted uniformly. Its exchangeable unit is the
    example: random minibatches split a group's rows, so whole groups cannot be permuted within one; for grouped
    examples (crops of photos) use :func:`permutation_map` with ``groups=`` on the pooled features."""

    def __init__(self, unbiased: bool = True, n_perm: int = 1000, seed: int = 0):
        super().__init__(unbiased)
        if n_perm < 2:
            raise ValueError(f"PermutedMinibatchCKA needs n_perm >= 2, got {n_perm}.")
        self.n_perm = n_perm
        self._generator = torch.Generator().manual_seed(seed)
        self.null_xy: torch.Tensor | None = None  # [n_perm, Lx, Ly]: sum_b HSIC(K_i, P_b L_j P_b^T)

    @torch.no_grad()
    def update(self, xs: list[torch.Tensor], ys: list[torch.Tensor] | None = None) -> None:
        n = self._examples(xs, ys)
        scale = 1.0 / (n * (n - 3)) if self.unbiased else 1.0 / (n - 1) ** 2
        gx = self._centred(xs)  # [Lx, n*n], one Gram per layer as MinibatchCKA
        gy = gx if ys is None else self._centred(ys)
        xy = (gx @ gy.T) * scale
        xx, yy = (gx * gx).sum(1) * scale, (gy * gy).sum(1) * scale
        self.self_similarity = self.self_similarity or ys is None
        null = self._null(gx, gy, n) * scale
        if self.xy is None:
            self.xy, self.xx, self.yy, self.null_xy = xy, xx, yy, null
        else:
            self.xy += xy
            self.xx += xx
            self.yy += yy
            self.null_xy += null
        self.batches += 1

    def _null(self, gx: torch.Tensor, gy: torch.Tensor, n: int) -> torch.Tensor:
        """[n_perm, Lx, Ly] Frobenius products of x's centred Grams with y's, y's examples permuted in this
        minibatch (:class:`GramHalves`: upper triangles, all layers of a batch of permutations in one product)."""
        perms = torch.rand(self.n_perm, n, generator=self._generator).argsort(1)
        hx = GramHalves(gx, n)
        hy = hx if gy is gx else GramHalves(gy, n)
        out = torch.empty(self.n_perm, gx.shape[0], gy.shape[0], dtype=torch.float64, device=gx.device)
        step = max(1, _BATCH_ELEMENTS // 2 // (n * n * gy.shape[0]))
        for b in range(0, self.n_perm, step):
            out[b : b + step] = hx.products(hy, perms[b : b + step])
        return out

    def sync(self, accelerator=None) -> None:
        """Sums CKA's and the null's HSIC accumulators over processes (:meth:`MinibatchCKA.sync`)."""
        super().sync(accelerator)
        state = all_reduce_tree(None if self.null_xy is None else {"null": self.null_xy}, accelerator)
        self.null_xy = None if state is None else state["null"]

    def null(self) -> torch.Tensor:
        """The null CKA maps [n_perm, Lx, Ly]."""
        if self.null_xy is None:
            raise RuntimeError("PermutedMinibatchCKA.null() before any update().")
        return self.null_xy / torch.sqrt(self.xx[:, None] * self.yy[None, :])

    def result(self) -> PermutedMap:
        """CKA map, its null, calibrated maps, per-cell and family-wise p (:class:`PermutedMap`)."""
        return _map_result(self.compute().cpu().numpy(), self.null().cpu().numpy(), lower=False)
