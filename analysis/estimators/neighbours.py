"""Nearest-neighbour alignment of two representations (Huh et al. 2024): mutual k-NN and CKNNA.

Definitions (Huh, Cheung, Wang, Isola 2024, "The Platonic Representation Hypothesis", ICML, Sec. 2 and App. A, as
the authors' code defines them: minyoungg/platonic-rep ``metrics.py``, ``AlignmentMetrics.mutual_knn`` and
``.cknna``, called by ``measure_alignment.py`` on L2-normalised features). Each example's features are L2-normalised
(a zero vector stays zero), K_ij = <x_i, x_j> / (||x_i|| ||x_j||) and likewise L for Y; knn_K(i) is the set of the k
examples j != i of largest K_ij (inner-product neighbours, self excluded).

* mutual k-NN: mean over i of |knn_K(i) ∩ knn_L(i)| / k. 1 for identical, rotated or isotropically scaled
  representations; about k / (n - 1) for independent ones.
* CKNNA (centred kernel nearest-neighbour alignment): with the mask M_ij = 1[j in knn_K(i)] 1[j in knn_L(i)],

      CKNNA = HSIC_1(M * K, M * L) / sqrt( HSIC_1(M_K * K, M_K * K) HSIC_1(M_L * L, M_L * L) )

  with M_K = 1[j in knn_K(i)] (so M_K * M_K = M_K) and HSIC_1 the unbiased estimator of Song et al. 2012 written
  for the (asymmetric) masked matrices A, B as the authors do: [tr(A B) + 1^T A 1 1^T B 1 / ((n - 1)(n - 2))
  - 2/(n - 2) 1^T A B 1] / (n (n - 3)) after zeroing the diagonals. This is their code's form (centre the masked
  kernels), not App. A's formula (mask the centred kernels); their denominator adds 1e-6, a guard left out here.
  Their pipeline also clips each feature at its 95th percentile of |value| before normalising
  (``remove_outliers``), a preprocessing left to the caller.

Cost and memory: the k-NN tables take O(n^2 p) multiply-adds (float64), streamed over blocks of ``_ROW_BLOCK`` rows:
memory O(block n + n k), never n x n; mutual k-NN is then O(n k^2). CKNNA needs the whole masked kernels:
O(n^2 p) time, O(n^2) memory.
"""

from __future__ import annotations

import torch

from analysis.estimators.kernels import as_rows, chunk_columns, gram64, permute_gram

# Rows of the similarity matrix formed at once when finding neighbours: memory _ROW_BLOCK x n float64.
_ROW_BLOCK = 1024


def _norms(x: torch.Tensor) -> torch.Tensor:
    """||x_i||, float64 [n], clamped as torch's F.normalize (a zero row keeps zero similarities)."""
    sq = torch.zeros(x.shape[0], dtype=torch.float64, device=x.device)
    cols = chunk_columns(x.shape[0])
    for c in range(0, x.shape[1], cols):
        sq += x[:, c : c + cols].to(torch.float64).square().sum(1)
    return sq.sqrt().clamp_min(1e-12)


def _check(x, y, k: int, name: str) -> tuple[torch.Tensor, torch.Tensor]:
    x, y = as_rows(x), as_rows(y)
    if x.shape[0] != y.shape[0]:
        raise ValueError(f"{name} needs the same examples in both: {x.shape[0]} vs {y.shape[0]} rows.")
    if not 1 <= k < x.shape[0]:
        raise ValueError(f"{name} needs 1 <= k < n (the examples other than itself): k = {k}, n = {x.shape[0]}.")
    return x, y


@torch.no_grad()
def knn_table(x, k: int = 10) -> torch.Tensor:
    """The indices of each example's k nearest neighbours by cosine similarity, self excluded, [n, k] (most similar
    first), computed over blocks of rows (memory O(block n))."""
    x = as_rows(x)
    n = x.shape[0]
    norms = _norms(x)
    out = torch.empty(n, k, dtype=torch.long, device=x.device)
    for r in range(0, n, _ROW_BLOCK):
        rows = slice(r, min(r + _ROW_BLOCK, n))
        s = gram64(x, rows=rows) / (norms[rows, None] * norms[None, :])
        idx = torch.arange(rows.start, rows.stop, device=x.device)
        s[idx - r, idx] = float("-inf")
        out[rows] = s.topk(k, dim=1).indices
    return out


def permute_table(table: torch.Tensor, perms: torch.Tensor) -> torch.Tensor:
    """The k-NN tables of the examples reordered by each permutation [B, n]: row i of the reordered data is old row
    perm[i], whose neighbours perm^-1[old neighbours] are renamed to their new places. [B, n, k]."""
    inv = torch.argsort(perms, dim=1)
    return torch.gather(inv, 1, table[perms].reshape(perms.shape[0], -1)).reshape(*perms.shape, table.shape[1])


def knn_overlap(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Mean over examples of |a_i ∩ b_i| / k for tables a [..., n, k] and b [..., n, k] (rows without repeats)."""
    shared = (a[..., :, None] == b[..., None, :]).any(-1).sum(-1)
    return shared.to(torch.float64).mean(-1) / a.shape[-1]


def mutual_knn(x, y, k: int = 10) -> float:
    """Huh et al. 2024's mutual k-NN alignment of x [n, ...] and y [n, ...]: the mean fraction of each example's k
    nearest neighbours (cosine, self excluded) shared by both representations (module docstring). Streams over
    rows: O(n^2 (p + q)) time, O(block n + n k) memory."""
    x, y = _check(x, y, k, "mutual_knn")
    return float(knn_overlap(knn_table(x, k), knn_table(y, k)))


def cosine_gram(x) -> torch.Tensor:
    """K_ij = <x_i, x_j> / (||x_i|| ||x_j||), float64 [n, n]."""
    x = as_rows(x)
    norms = _norms(x)
    return gram64(x) / (norms[:, None] * norms[None, :])


def knn_mask(k_mat: torch.Tensor, k: int) -> torch.Tensor:
    """M_ij = 1 when j is among the k largest K_ij of row i, j != i; float64 [n, n] (the authors' ``topk`` of K
    with a -inf diagonal)."""
    hat = k_mat.clone().fill_diagonal_(float("-inf"))
    return torch.zeros_like(k_mat).scatter_(1, hat.topk(k, dim=1).indices, 1.0)


def masked_hsic(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """The unbiased HSIC of (possibly asymmetric) matrices a, b [..., n, n], as the authors' ``hsic_unbiased``:
    diagonals zeroed, [tr(A B) + sum(A) sum(B) / ((n - 1)(n - 2)) - 2/(n - 2) 1^T A B 1] / (n (n - 3))."""
    n = a.shape[-1]
    eye = torch.eye(n, dtype=torch.bool, device=a.device)
    a, b = a.masked_fill(eye, 0), b.masked_fill(eye, 0)
    trace = (a * b.transpose(-1, -2)).sum((-1, -2))
    sums = a.sum((-1, -2)) * b.sum((-1, -2)) / ((n - 1) * (n - 2))
    cross = (a.sum(-2) * b.sum(-1)).sum(-1)  # 1^T A B 1 = (A^T 1) . (B 1)
    return (trace + sums - 2 * cross / (n - 2)) / (n * (n - 3))


def cknna_side(x, k: int = 10) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """What CKNNA needs of one representation: its cosine kernel K, k-NN mask M_K and HSIC_1(M_K K, M_K K)."""
    kk = cosine_gram(x)
    m = knn_mask(kk, k)
    return kk, m, masked_hsic(m * kk, m * kk)


def cknna_pair(sx, sy) -> torch.Tensor:
    """CKNNA from :func:`cknna_side` of x and of y; y's kernel and mask may carry leading batch dimensions (one per
    reordering of y's examples)."""
    (kx, mx, hx), (ky, my, hy) = sx, sy
    m = mx * my
    return masked_hsic(m * kx, m * ky) / torch.sqrt(hx * hy)


def permute_cknna_side(s, perms: torch.Tensor):
    kk, m, h = s
    return permute_gram(kk, perms), permute_gram(m, perms), h


def cknna(x, y, k: int = 10) -> float:
    """Huh et al. 2024's CKNNA of x [n, ...] and y [n, ...] as their code defines it: unbiased HSIC of the cosine
    kernels restricted to mutual k-NN pairs, normalised as CKA (module docstring). Needs 2 <= k < n and n >= 4.
    float64; O(n^2 (p + q)) time, O(n^2) memory."""
    x, y = _check(x, y, k, "cknna")
    if k < 2 or x.shape[0] < 4:
        raise ValueError(f"cknna needs k >= 2 and at least 4 examples: k = {k}, n = {x.shape[0]}.")
    return float(cknna_pair(cknna_side(x, k), cknna_side(y, k)))
