"""Orthogonal Procrustes distance between two representations (Ding et al. 2021) and its angular form (Williams et
al. 2021).

Definitions. X [n, p] and Y [n, q], one row per example, are mean-centred over the examples and scaled to unit
Frobenius norm. The orthogonal Procrustes problem min_Q ||X Q - Y||_F over Q with orthonormal columns (zero-padding
the narrower side) has the value ||X||_F^2 + ||Y||_F^2 - 2 ||X^T Y||_* (Schönemann 1966), so

    procrustes_distance = 2 - 2 ||X^T Y||_*          (Ding, Denain, Steinhardt 2021, "Grounding Representation
                                                      Similarity with Statistical Testing", NeurIPS, Sec. 2.2)
    procrustes_angle    = arccos ||X^T Y||_*          (Williams, Kunz, Kornblith, Linderman 2021, "Generalized
                                                      Shape Metrics on Neural Representations", NeurIPS, Eq. 3,
                                                      the angular Procrustes metric)

with ||.||_* the nuclear norm (sum of singular values). Both are 0 for identical, rotated, translated or isotropically
scaled representations and grow with dissimilarity (the distance to at most 2, the angle to pi/2): smaller is more
alike. Neither paper has public code for exactly this function; the tests check it against the definition (an
explicit SVD of X^T Y) and against scipy's orthogonal Procrustes solution.

Computation: ||X^T Y||_* = ||A^T B||_* for any A, B with X X^T = A A^T and Y Y^T = B B^T (X = A Q^T with Q of
orthonormal columns). With at most n features a side is its own factor (A = X, float64); wider, A = U sqrt(w) from
the eigendecomposition of the centred float64 Gram, streamed over column chunks. Cost O(n p min(n, p) + n q
min(n, q) + r^3) with r = min(n, p, q); memory O(n min(n, p) + n min(n, q)), never p x q.
"""

from __future__ import annotations

import math

import torch

from analysis.estimators.kernels import as_rows, gram64

# Eigenvalues of the normalised Gram below this fraction of the largest are rounding: their directions are dropped.
_RANK_TOL = 1e-12


@torch.no_grad()
def procrustes_factor(x) -> torch.Tensor:
    """A [n, r], float64, with A A^T the Gram of x's centred, Frobenius-normalised representation (:mod:`docstring
    <analysis.estimators.procrustes>`): the representation itself when it has at most n features, else from its
    Gram. A zero (constant) representation gives NaN."""
    x = as_rows(x)
    n, p = x.shape
    if p <= n:
        a = x.to(torch.float64)
        a = a - a.mean(0, keepdim=True)
        return a / a.norm()
    k = gram64(x, centre=True)
    k = k / k.trace()
    w, u = torch.linalg.eigh(k)
    keep = w > _RANK_TOL * w[-1]
    return u[:, keep] * w[keep].sqrt()


def procrustes_nuclear(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """||A^T B||_* for factors a [n, r] and b [..., n, s] (leading dimensions: reorderings of b's examples)."""
    return torch.linalg.svdvals(a.transpose(-1, -2) @ b).sum(-1)


def _nuclear(x, y, name: str) -> float:
    x, y = as_rows(x), as_rows(y)
    if x.shape[0] != y.shape[0]:
        raise ValueError(f"{name} needs the same examples in both: {x.shape[0]} vs {y.shape[0]} rows.")
    return float(procrustes_nuclear(procrustes_factor(x), procrustes_factor(y)))


def procrustes_distance(x, y) -> float:
    """2 - 2 ||X^T Y||_* of the centred, unit-Frobenius representations x [n, ...] and y [n, ...] (Ding et al. 2021;
    module docstring): 0 for the same representation up to rotation, translation and scale, at most 2. float64."""
    return 2.0 - 2.0 * _nuclear(x, y, "procrustes_distance")


def procrustes_angle(x, y) -> float:
    """arccos ||X^T Y||_* (Williams et al. 2021's angular Procrustes metric; module docstring), in [0, pi/2]."""
    return math.acos(min(1.0, max(-1.0, _nuclear(x, y, "procrustes_angle"))))
