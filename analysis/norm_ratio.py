"""How much of each residual sublayer's output comes through the skip connection (Raghu et al. 2021 §6,
Fig. 7 and E.1; cosine: Fig. E.2).

For block i and sublayer s in {attn, mlp}, with z the residual-stream input to the sublayer (the skip path)
and f(z) its branch output (after layer scale / drop path), per token t:

    norm ratio   r_t = ||z_t||_2 / ||f(z)_t||_2,   averaged over images (the mean of per-image ratios);
    cosine       c_t = <z_t, f(z)_t> / (||z_t|| ||f(z)_t||), averaged over images.

Token 0 is CLS in CLS ViTs. For a ResNet block, z is the shortcut (identity or downsample output), f(z) the
residual branch, and the "tokens" are the spatial positions of the feature map (channels are the vector).
"""
from __future__ import annotations

import torch

from analysis.reduce import all_reduce_sum

EPS = 1e-12


def _tokens(t: torch.Tensor) -> torch.Tensor:
    """[B, T, D] stays; [B, C, H, W] -> [B, H*W, C]."""
    return t.flatten(2).transpose(1, 2) if t.ndim == 4 else t


def norm_ratio(skip: torch.Tensor, branch: torch.Tensor) -> torch.Tensor:
    """[T]: mean over images of ||skip_t|| / ||branch_t|| (see the module docstring)."""
    z, f = _tokens(skip).double(), _tokens(branch).double()
    return (z.norm(dim=-1) / f.norm(dim=-1).clamp_min(EPS)).mean(0)


def cosine(skip: torch.Tensor, branch: torch.Tensor) -> torch.Tensor:
    """[T]: mean over images of the cosine similarity of skip_t and branch_t."""
    z, f = _tokens(skip).double(), _tokens(branch).double()
    return torch.nn.functional.cosine_similarity(z, f, dim=-1, eps=EPS).mean(0)


class NormRatio:
    """Accumulates per-token sums of the norm ratio and cosine over images, per (block, sublayer)."""

    def __init__(self):
        self.ratio: dict[tuple[str, str], torch.Tensor] = {}
        self.cos: dict[tuple[str, str], torch.Tensor] = {}
        self.count: dict[tuple[str, str], torch.Tensor] = {}

    @torch.no_grad()
    def update(self, block: str, sublayer: str, skip: torch.Tensor, branch: torch.Tensor) -> None:
        z, f = _tokens(skip).double(), _tokens(branch).double()
        r = (z.norm(dim=-1) / f.norm(dim=-1).clamp_min(EPS)).sum(0).cpu()
        c = torch.nn.functional.cosine_similarity(z, f, dim=-1, eps=EPS).sum(0).cpu()
        key = (block, sublayer)
        if key not in self.ratio:
            self.ratio[key], self.cos[key], self.count[key] = r, c, torch.tensor(float(z.shape[0]), dtype=torch.float64)
        else:
            self.ratio[key] += r
            self.cos[key] += c
            self.count[key] += z.shape[0]

    def sync(self, accelerator=None) -> None:
        """Sum the accumulators over processes (a no-op with one process)."""
        for key in sorted(self.ratio):
            self.ratio[key], self.cos[key], self.count[key] = (
                all_reduce_sum(t, accelerator) for t in (self.ratio[key], self.cos[key], self.count[key]))

    def compute(self) -> dict[tuple[str, str], tuple[torch.Tensor, torch.Tensor]]:
        """{(block, sublayer): (ratio [T], cosine [T])}."""
        return {k: (self.ratio[k] / self.count[k], self.cos[k] / self.count[k]) for k in self.ratio}
