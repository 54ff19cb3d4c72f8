"""Random-chance baselines: the same metric on Gaussian features of the same shape (Walmer et al. 2023, App. B.3).

Walmer et al. report a "random chance score" beside every clustering and downstream-task curve (§5.2, §6, App. B.3):
"we repeat the task analysis replacing all ViT features with [...] Gaussian noise [...] with the exact same
dimensions as the extracted feature arrays". Following that, :func:`gaussian_like` draws i.i.d. STANDARD normal
entries (mean 0, unit variance) of exactly ``x``'s shape. The values of ``x`` are not used (only its shape, dtype and
device), so the baseline carries no information about the images at all. Unit variance (rather than the per-feature
variance of ``x``) is what the paper describes; for the metrics used here it makes no difference in expectation:
k-NN L2-normalises features and compares by cosine (invariant to a global scale), and isotropic noise has no
cluster structure at any scale.

Determinism: the noise is drawn on the CPU from ``torch.Generator().manual_seed(seed)`` in float32 (then cast to
``x``'s floating dtype and moved to ``x``'s device), so a seed gives the same numbers on every machine, device and
process count. Draw bank and query noise in ONE call (e.g. on ``torch.cat([bank, queries])``) or with different seeds:
two calls with the same seed give identical leading rows.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from torch import Tensor


def gaussian_like(x: Tensor, seed: int) -> Tensor:
    """I.i.d. standard normal noise (mean 0, variance 1) of ``x``'s shape, deterministic per ``seed`` (Walmer App. B.3).

    Drawn in float32 on the CPU from ``torch.Generator().manual_seed(seed)``, returned in ``x``'s dtype when that is
    floating (else float32) on ``x``'s device. Only the shape of ``x`` is used, never its values.
    """
    gen = torch.Generator().manual_seed(int(seed))
    noise = torch.randn(tuple(x.shape), generator=gen, dtype=torch.float32)
    dtype = x.dtype if x.is_floating_point() else torch.float32
    return noise.to(device=x.device, dtype=dtype)


def gaussian_like_layers(feats: Mapping[str, Tensor] | Sequence[Tensor], seed: int) -> dict[str, Tensor] | list[Tensor]:
    """:func:`gaussian_like` for every layer: entry ``i`` (in the mapping's / sequence's order) gets seed ``seed + i``,
    so layers get independent noise. Returns a dict with the same keys for a mapping, else a list."""
    if isinstance(feats, Mapping):
        return {name: gaussian_like(x, seed + i) for i, (name, x) in enumerate(feats.items())}
    return [gaussian_like(x, seed + i) for i, x in enumerate(feats)]
