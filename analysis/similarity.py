"""Centered kernel alignment (CKA) between layer representations (Raghu et al. 2021 Fig. 1, 2, 8, 12).

Definitions (Kornblith et al. 2019; minibatch form of Nguyen et al. 2021). For a minibatch of n >= 4 examples,
X [n, p] and Y [n, q] are two layers' representations, K = X X^T and L = Y Y^T their linear Gram matrices,
and K~, L~ the Grams with zeroed diagonals. The unbiased HSIC estimator (Song et al. 2012) is

    HSIC_1(K, L) = 1 / (n (n - 3)) * [ tr(K~ L~) + (1^T K~ 1)(1^T L~ 1) / ((n - 1)(n - 2)) - 2/(n - 2) 1^T K~ L~ 1 ].

It equals <U(K), U(L)>_F / (n (n - 3)) with U the "unbiased centring" of a Gram (zero the diagonal, subtract
row/column means with the n - 2 / 2(n - 1) corrections, zero the diagonal again), which lets every layer pair
come from one matrix product of the flattened U's. Over minibatches b,

    CKA(X, Y) = sum_b HSIC_1(K_b, L_b) / sqrt( sum_b HSIC_1(K_b, K_b) * sum_b HSIC_1(L_b, L_b) ).

The biased form (``unbiased=False``) uses HSIC_0 = tr(K H L H) / (n - 1)^2 with H = I - 11^T/n. Sums are
float64. A layer's representation of one image is, by choice, all tokens flattened (default), the CLS token,
or the mean of the spatial tokens (:func:`represent`).
"""
from __future__ import annotations

import torch

from analysis.reduce import all_reduce_tree


def represent(t: torch.Tensor, how: str = "flatten", num_prefix_tokens: int = 1) -> torch.Tensor:
    """[B, T, D] tokens (or [B, C, H, W] feature maps) -> [B, p]: 'flatten' (all tokens), 'cls' (token 0),
    'mean_spatial' (mean over spatial tokens / positions)."""
    if t.ndim == 4:  # ResNet feature map: positions are the tokens
        t = t.flatten(2).transpose(1, 2)
        num_prefix_tokens = 0
    if how == "flatten":
        return t.reshape(t.shape[0], -1)
    if how == "cls":
        if num_prefix_tokens == 0:
            raise ValueError("representation 'cls' needs a class token; this model has none (GAP ViT or ResNet): use 'mean_spatial' or 'flatten'.")
        return t[:, 0]
    if how == "mean_spatial":
        return t[:, num_prefix_tokens:].mean(1)
    raise ValueError(f"unknown representation '{how}': choose flatten, cls or mean_spatial.")


def gram(x: torch.Tensor) -> torch.Tensor:
    x = x.reshape(x.shape[0], -1).to(torch.float64)
    return x @ x.T


def center_unbiased(k: torch.Tensor) -> torch.Tensor:
    """U(K): <U(K), U(L)>_F = n (n - 3) HSIC_1(K, L) (Song et al. 2012; as in Kornblith et al.'s reference code)."""
    n = k.shape[0]
    if n < 4:
        raise ValueError(f"unbiased CKA needs at least 4 examples per minibatch, got {n}: use a larger analysis batch.")
    k = k.clone()
    k.fill_diagonal_(0)
    means = k.sum(0) / (n - 2)
    means = means - means.sum() / (2 * (n - 1))
    k = k - means[:, None] - means[None, :]
    k.fill_diagonal_(0)
    return k


def center_biased(k: torch.Tensor) -> torch.Tensor:
    """H K H with H = I - 11^T/n: <HKH, HLH>_F = (n - 1)^2 HSIC_0(K, L)."""
    k = k - k.mean(0, keepdim=True)
    return k - k.mean(1, keepdim=True)


def _hsic_scale(n: int, unbiased: bool) -> float:
    return 1.0 / (n * (n - 3)) if unbiased else 1.0 / (n - 1) ** 2


def cka(x: torch.Tensor, y: torch.Tensor, unbiased: bool = True) -> float:
    """Linear CKA of one pair of full matrices x [n, p], y [n, q] (one minibatch holding every example)."""
    if x.shape[0] != y.shape[0]:
        raise ValueError(f"cka needs the same examples in both: {x.shape[0]} vs {y.shape[0]} rows.")
    c = center_unbiased if unbiased else center_biased
    kx, ky = c(gram(x)), c(gram(y))
    return float((kx * ky).sum() / torch.sqrt((kx * kx).sum() * (ky * ky).sum()))


class MinibatchCKA:
    """All-pairs minibatch CKA between the layers of one model (``ys=None``) or of two models.

    ``update(xs, ys)`` takes one minibatch: a list of per-layer representations [n, ...] (flattened per example).
    Each layer's Gram is computed once per minibatch and every pair's HSIC comes from one matrix product of the
    flattened centred Grams; HSIC sums are float64 and reduced across processes by :meth:`sync`.
    """

    def __init__(self, unbiased: bool = True):
        self.unbiased = unbiased
        self.xy: torch.Tensor | None = None  # sum_b HSIC(K_i, L_j)  [Lx, Ly]
        self.xx: torch.Tensor | None = None  # sum_b HSIC(K_i, K_i)  [Lx]
        self.yy: torch.Tensor | None = None  # sum_b HSIC(L_j, L_j)  [Ly]
        self.batches = 0
        self.self_similarity = False

    def _centred(self, reps: list[torch.Tensor]) -> torch.Tensor:
        c = center_unbiased if self.unbiased else center_biased
        return torch.stack([c(gram(r)).reshape(-1) for r in reps])  # [L, n*n]

    @torch.no_grad()
    def update(self, xs: list[torch.Tensor], ys: list[torch.Tensor] | None = None) -> None:
        n = xs[0].shape[0]
        if n < 4:
            raise ValueError(f"MinibatchCKA needs minibatches of at least 4 examples, got {n}: raise the analysis batch size.")
        if any(r.shape[0] != n for r in xs + (ys or [])):
            raise ValueError("every layer's representation in a minibatch must hold the same examples.")
        scale = _hsic_scale(n, self.unbiased)
        gx = self._centred(xs)
        if ys is None:
            self.self_similarity = True
            xy = (gx @ gx.T) * scale
            xx, yy = torch.diagonal(xy).clone(), torch.diagonal(xy).clone()  # two tensors: both are summed in place
        else:
            gy = self._centred(ys)
            xy = (gx @ gy.T) * scale
            xx = (gx * gx).sum(1) * scale
            yy = (gy * gy).sum(1) * scale
        if self.xy is None:
            self.xy, self.xx, self.yy = xy, xx, yy
        else:
            self.xy += xy
            self.xx += xx
            self.yy += yy
        self.batches += 1

    def sync(self, accelerator=None) -> None:
        """Sum the HSIC accumulators over processes in one all-reduce (a no-op with one process; a process that
        saw no minibatch adds zeros)."""
        state = None if self.xy is None else {"xy": self.xy, "xx": self.xx, "yy": self.yy}
        state = all_reduce_tree(state, accelerator)
        if state is not None:
            self.xy, self.xx, self.yy = state["xy"], state["xx"], state["yy"]

    def compute(self) -> torch.Tensor:
        if self.xy is None:
            raise RuntimeError("MinibatchCKA.compute() before any update().")
        return self.xy / torch.sqrt(self.xx[:, None] * self.yy[None, :])

    def state(self) -> dict:
        return {"xy": self.xy, "xx": self.xx, "yy": self.yy}
