"""CKA with an RBF kernel (Kornblith et al. 2019), and the float64 Grams the other similarity estimators share.

Definition (Kornblith, Norouzi, Lee, Hinton 2019, "Similarity of Neural Network Representations Revisited", ICML,
Sec. 3 and the authors' notebook google-research/representation_similarity/Demo.ipynb, ``gram_rbf`` / ``cka``). For
X [n, p] (one row per example), D_ij = ||x_i - x_j||^2 and

    K_ij = exp(-D_ij / (2 sigma^2)),   sigma^2 = threshold^2 * median(D)

where the median is over all n^2 entries of D, its zero diagonal included (as ``np.median(sq_distances)`` in the
notebook: sigma is ``threshold`` times the median distance). Then, with the same for Y giving L,

    RBF-CKA = <K~, L~>_F / (||K~||_F ||L~||_F)

with K~ = H K H (biased HSIC_0, the notebook's default and ``unbiased=False`` here) or the unbiased U-centring of
Song et al. 2012 (``unbiased=True``; the notebook's ``debiased=True``). Invariant to rotations, translations and
isotropic scaling of either side (the bandwidth scales with the distances); 1 for identical (or rotated)
representations.

Cost and memory: one Gram X X^T in float64, O(n^2 p) multiply-adds formed over column chunks of
``_CHUNK_ELEMENTS`` (X is never copied whole to float64), and O(n^2) memory for the kernel: the definition needs
every pairwise distance and their median, so it does not stream further.
"""

from __future__ import annotations

import numpy as np
import torch

from analysis.estimators.similarity import center_biased, center_unbiased

# Elements of one float64 column chunk in gram64 (32 MiB): the float64 copy of X is made one chunk at a time.
_CHUNK_ELEMENTS = 1 << 22


def as_rows(x) -> torch.Tensor:
    """A torch tensor [n, p] (features flattened per example) of ``x``: a tensor or a numpy array [n, ...]."""
    if isinstance(x, np.ndarray):
        x = torch.from_numpy(x)
    return x.reshape(x.shape[0], -1)


def chunk_columns(n: int) -> int:
    """Columns per float64 chunk of an [n, p] representation (``_CHUNK_ELEMENTS`` elements)."""
    return max(1, _CHUNK_ELEMENTS // max(n, 1))


@torch.no_grad()
def gram64(x, rows: slice | None = None, centre: bool = False) -> torch.Tensor:
    """X[rows] X^T in float64, [r, n], for x [n, ...] (flattened per example); ``centre`` subtracts the column means
    over all n examples first (then the full Gram is H K H). Formed over column chunks in float64: O(r n p)
    multiply-adds, memory O(r n + n * chunk)."""
    x = as_rows(x)
    n, p = x.shape
    cols = chunk_columns(n)
    sel = slice(None) if rows is None else rows
    out = None
    for c in range(0, p, cols):
        b = x[:, c : c + cols].to(torch.float64)
        if centre:
            b = b - b.mean(0, keepdim=True)
        part = b[sel] @ b.T
        out = part if out is None else out.add_(part)
    if out is None:  # no features
        out = torch.zeros(n if rows is None else len(range(n)[sel]), n, dtype=torch.float64, device=x.device)
    return out


def _median(v: torch.Tensor) -> torch.Tensor:
    """The median of all entries, averaging the two middle ones for an even count (numpy's ``np.median``)."""
    v = v.reshape(-1)
    m = v.numel()
    lo = torch.kthvalue(v, (m + 1) // 2).values
    hi = torch.kthvalue(v, m // 2 + 1).values
    return (lo + hi) / 2


def rbf_gram(x, threshold: float = 1.0) -> torch.Tensor:
    """The RBF kernel K_ij = exp(-||x_i - x_j||^2 / (2 threshold^2 median(D))), float64 [n, n] (the notebook's
    ``gram_rbf``: the median over all n^2 squared distances, the zero diagonal included). Distances come from the
    Gram of the mean-centred features (translation does not change them; centring keeps their precision). A
    representation with a zero median distance (more than half its pairs identical) has no bandwidth: NaN."""
    k = gram64(x, centre=True)
    d = k.diagonal()
    sq = (d[:, None] + d[None, :] - 2 * k).clamp_min_(0)
    sq.fill_diagonal_(0)
    med = _median(sq)
    if not med > 0:
        return torch.full_like(sq, float("nan"))
    return torch.exp(-sq / (2 * threshold**2 * med))


def centred_rbf_gram(x, threshold: float = 1.0, unbiased: bool = False) -> torch.Tensor:
    """H K H (biased) or the unbiased U(K) of the RBF kernel of x (:func:`rbf_gram`), float64 [n, n]."""
    k = rbf_gram(x, threshold)
    return center_unbiased(k) if unbiased else center_biased(k)


def gram_cka(gx: torch.Tensor, gy: torch.Tensor) -> float:
    """<G_x, G_y>_F / (||G_x||_F ||G_y||_F) of two centred Grams (HSIC's scale cancels)."""
    return float((gx * gy).sum() / torch.sqrt((gx * gx).sum() * (gy * gy).sum()))


def rbf_cka(x, y, threshold: float = 1.0, unbiased: bool = False) -> float:
    """CKA of x [n, ...] and y [n, ...] with Kornblith et al. 2019's RBF kernel, bandwidth ``threshold`` times the
    median pairwise distance of each side (see the module docstring); biased HSIC by default, as the authors'
    notebook, or the unbiased HSIC_1 (``unbiased=True``, needs n >= 4). float64 throughout. Cost O(n^2 (p + q)),
    memory O(n^2)."""
    x, y = as_rows(x), as_rows(y)
    if x.shape[0] != y.shape[0]:
        raise ValueError(f"rbf_cka needs the same examples in both: {x.shape[0]} vs {y.shape[0]} rows.")
    return gram_cka(centred_rbf_gram(x, threshold, unbiased), centred_rbf_gram(y, threshold, unbiased))


def permute_gram(g: torch.Tensor, perms: torch.Tensor) -> torch.Tensor:
    """The Gram of the examples reordered by each permutation: ``g[perm][:, perm]`` for each row of ``perms``
    [B, n], [B, n, n]. Both centrings commute with it (U(P K P^T) = P U(K) P^T), so a centred Gram is permuted
    as is. On CPU by numpy's indexing: torch's, at 2 threads on a loaded 2-core host, took 2-70x as long."""
    if g.device.type == "cpu":
        p = perms.numpy()
        return torch.from_numpy(g.numpy()[p[:, :, None], p[:, None, :]])
    return g[perms[:, :, None], perms[:, None, :]]
