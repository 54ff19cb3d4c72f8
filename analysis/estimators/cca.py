"""Canonical correlation similarities: SVCCA (Raghu et al. 2017) and projection-weighted CCA (Morcos et al. 2018).

Definitions. X [n, p] and Y [n, q], one row per example, are mean-centred over the examples. Their canonical
correlations rho_1 >= ... >= rho_m (m = min(rank X, rank Y)) are the singular values of Q_X^T Q_Y, with Q_X [n, r]
an orthonormal basis of X's column space (CCA is invariant to any invertible linear map of either side).

* SVCCA (Raghu, Gilmer, Yosinski, Sohl-Dickstein 2017, "SVCCA: Singular Vector Canonical Correlation Analysis for
  Deep Learning Dynamics and Interpretability", NeurIPS, Sec. 2): first reduce each side to its top singular
  directions, the fewest that keep ``keep`` of its variance (sum of squared singular values; the paper keeps 99%),
  then CCA between the reduced sides; the similarity is the mean canonical correlation, (1/m) sum_i rho_i. The
  authors' google/svcca ``cca_core.get_cca_similarity`` (covariance, whitening by its inverse square root, SVD) on
  the SVD-reduced activations gives the same coefficients (their tutorial's recipe).
* PWCCA (Morcos, Raghu, Bengio 2018, "Insights on representational similarity in neural networks with canonical
  correlation", NeurIPS, Sec. 2.2): CCA without the reduction, each correlation weighted by how much of the
  representation its canonical variate accounts for: with h_i = Q_X u_i the i-th canonical variate of X (unit norm)
  and x_j X's j-th centred neuron, alpha_i = sum_j |<h_i, x_j>|, and PWCCA = sum_i alpha_i rho_i / sum_i alpha_i.
  The weights are taken on the side with fewer neurons (X on a tie), as google/svcca's ``pwcca.compute_pwcca``
  does. That code forms the variates without the whitening (``coef_x`` times the raw activations) and, on the Y
  side, multiplies X's activations by Y's directions; here the variates are the paper's, which coincide with the
  code's when X's neurons are already uncorrelated with equal variance (a test checks that case).

Both need more examples than directions: with rank X + rank Y > n the column spaces intersect and canonical
correlations of 1 appear whatever the data (reduce first: SVCCA does); PWCCA is then not even well defined, as the
weights of tied correlations depend on which basis of their shared subspace the SVD returns. Directions whose
variance is below ``_RANK_TOL`` of the largest are rounding and dropped.

Computation: Q_X and the singular values come from the eigendecomposition of the centred float64 Gram X X^T,
streamed over column chunks: O(n^2 p + n^3) time, O(n^2) memory, never p x p. PWCCA also forms Q_X^T X [r, p] for
the weights: O(n r p) more time and O(r p) memory.
"""

from __future__ import annotations

import torch

from analysis.estimators.kernels import as_rows, chunk_columns, gram64

_RANK_TOL = 1e-12


@torch.no_grad()
def principal_basis(x, keep: float = 1.0) -> torch.Tensor:
    """Q [n, k], float64: the top left singular vectors of x's centred representation, the fewest keeping ``keep``
    of its variance (all with non-negligible variance for keep = 1)."""
    if not 0 < keep <= 1:
        raise ValueError(f"keep is a fraction of variance in (0, 1]: got {keep}.")
    w, u = torch.linalg.eigh(gram64(x, centre=True))
    w, u = w.flip(0), u.flip(1)  # largest first
    rank = int((w > _RANK_TOL * w[0]).sum()) if w[0] > 0 else 0
    if rank == 0:
        raise ValueError("CCA of a constant representation (no variance over the examples) is undefined.")
    w = w[:rank].clamp_min(0)
    share = torch.cumsum(w, 0) / w.sum()
    k = rank if keep >= 1 else int((share < keep - 1e-12).sum()) + 1
    return u[:, : min(k, rank)]


def canonical_correlations(qx: torch.Tensor, qy: torch.Tensor) -> torch.Tensor:
    """rho [..., m] of orthonormal bases qx [n, r] and qy [..., n, s] (leading dimensions: reorderings of y)."""
    return torch.linalg.svdvals(qx.transpose(-1, -2) @ qy).clamp_max(1.0)


def _pair(x, y, name: str) -> tuple[torch.Tensor, torch.Tensor]:
    x, y = as_rows(x), as_rows(y)
    if x.shape[0] != y.shape[0]:
        raise ValueError(f"{name} needs the same examples in both: {x.shape[0]} vs {y.shape[0]} rows.")
    return x, y


def svcca(x, y, keep: float = 0.99) -> float:
    """Raghu et al. 2017's SVCCA of x [n, ...] and y [n, ...]: the mean canonical correlation between the top
    singular directions of each side that keep ``keep`` of its variance (module docstring). float64."""
    x, y = _pair(x, y, "svcca")
    return float(canonical_correlations(principal_basis(x, keep), principal_basis(y, keep)).mean())


@torch.no_grad()
def neuron_loadings(x, q: torch.Tensor) -> torch.Tensor:
    """Q^T X_c [r, p] (float64, X centred), over column chunks."""
    x = as_rows(x)
    n, p = x.shape
    cols = chunk_columns(n)
    out = torch.empty(q.shape[1], p, dtype=torch.float64, device=x.device)
    for c in range(0, p, cols):
        b = x[:, c : c + cols].to(torch.float64)
        out[:, c : c + cols] = q.T @ (b - b.mean(0, keepdim=True))
    return out


def pwcca_side(x) -> tuple[torch.Tensor, torch.Tensor]:
    """(Q_X, Q_X^T X_c) of one representation: what PWCCA needs of the side its weights come from."""
    x = as_rows(x)
    q = principal_basis(x, 1.0)
    return q, neuron_loadings(x, q)


def pwcca_from(qx: torch.Tensor, qy: torch.Tensor, loadings: torch.Tensor, weigh_x: bool) -> torch.Tensor:
    """PWCCA from the bases (qy may carry leading reordering dimensions) and the loadings Q^T X_c of the weighed
    side: alpha_i = sum_j |(u_i^T Q^T X_c)_j| with u_i that side's i-th canonical direction in its basis."""
    u, rho, vh = torch.linalg.svd(qx.transpose(-1, -2) @ qy, full_matrices=False)
    m = rho.shape[-1]
    dirs = u[..., :m] if weigh_x else vh[..., :m, :].transpose(-1, -2)  # [..., r, m]
    alpha = (dirs.transpose(-1, -2) @ loadings).abs().sum(-1)  # [..., m]
    return (alpha * rho.clamp_max(1.0)).sum(-1) / alpha.sum(-1)


def pwcca(x, y) -> float:
    """Morcos et al. 2018's projection-weighted CCA of x [n, ...] and y [n, ...]: canonical correlations weighted by
    the share of the representation (of the side with fewer neurons) their variates account for (module
    docstring). float64; needs n > rank X + rank Y to mean anything."""
    x, y = _pair(x, y, "pwcca")
    weigh_x = x.shape[1] <= y.shape[1]
    qx, lx = pwcca_side(x) if weigh_x else (principal_basis(x), None)
    qy, ly = (principal_basis(y), None) if weigh_x else pwcca_side(y)
    return float(pwcca_from(qx, qy, lx if weigh_x else ly, weigh_x))
