"""Random-chance baselines: the same metric on random features of the same shape (Walmer et al. 2023, App. B.3).

Walmer et al. report a "random chance score" beside every clustering and downstream-task curve (§5.2, §6, App. B.3):
"we repeat the task analysis replacing all ViT features with [...] Gaussian noise [...] with the exact same
dimensions as the extracted feature arrays". Their code (mwalmer-umd/vit_analysis, ``wrapper_random.py``, whose
docstring also says "random Gaussian noise") draws ``torch.rand``: i.i.d. UNIFORM [0, 1) entries, one array per
block of the full token shape [batch, tokens, features], which their pipeline then pools (CLS token, or the mean of
the spatial tokens) like real features.

Which we use, and why. The default is the paper's text, :func:`gaussian_like`: i.i.d. STANDARD normal entries (mean
0, unit variance) of exactly the pooled features' shape. The text is the published definition and the code
contradicts its own docstring, so we follow the text; for the metrics here the choice does not change the score in
expectation: the noise carries no information about the labels, so k-NN, k-means and probes are at chance either
way (uniform noise's 0.5 mean only makes every cosine similarity large and positive; the probes standardise or
centre features). :func:`uniform_like` is the authors' code's draw, offered as the option ``baseline: uniform`` of
the measures that report a baseline (knn, clustering, fewshot_probe). Where both depart from the authors' code: the
noise is drawn at the POOLED shape [N, D], not per token and then pooled (the mean of T uniform tokens would
concentrate near 0.5 with variance 1 / (12 T); at chance all the same).

The values of ``x`` are never used (only its shape, dtype and device). Determinism: the noise is drawn on the CPU
from ``torch.Generator().manual_seed(seed)`` in float32 (then cast to ``x``'s floating dtype and moved to ``x``'s
device), so a seed gives the same numbers on every machine, device and process count. Draw bank and query noise in
ONE call (e.g. on ``torch.cat([bank, queries])``) or with different seeds: two calls with the same seed give
identical leading rows.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from torch import Tensor

BASELINES: tuple[str, ...] = ("gaussian", "uniform")
DEFAULT_BASELINE = "gaussian"


def _out(noise: Tensor, x: Tensor) -> Tensor:
    dtype = x.dtype if x.is_floating_point() else torch.float32
    return noise.to(device=x.device, dtype=dtype)


def gaussian_like(x: Tensor, seed: int) -> Tensor:
    """I.i.d. standard normal noise (mean 0, variance 1) of ``x``'s shape, deterministic per ``seed`` (Walmer App. B.3).

    Drawn in float32 on the CPU from ``torch.Generator().manual_seed(seed)``, returned in ``x``'s dtype when that is
    floating (else float32) on ``x``'s device. Only the shape of ``x`` is used, never its values.
    """
    gen = torch.Generator().manual_seed(int(seed))
    return _out(torch.randn(tuple(x.shape), generator=gen, dtype=torch.float32), x)


def uniform_like(x: Tensor, seed: int) -> Tensor:
    """I.i.d. uniform [0, 1) noise of ``x``'s shape (``torch.rand``, as Walmer et al.'s code, wrapper_random.py),
    deterministic per ``seed``; drawn and returned like :func:`gaussian_like`."""
    gen = torch.Generator().manual_seed(int(seed))
    return _out(torch.rand(tuple(x.shape), generator=gen, dtype=torch.float32), x)


def noise_like(x: Tensor, seed: int, kind: str = DEFAULT_BASELINE) -> Tensor:
    """:func:`gaussian_like` (``kind="gaussian"``, Walmer's text) or :func:`uniform_like` (``"uniform"``, their code)."""
    if kind == "gaussian":
        return gaussian_like(x, seed)
    if kind == "uniform":
        return uniform_like(x, seed)
    raise ValueError(f"unknown baseline {kind!r}: use one of {', '.join(BASELINES)}")


def gaussian_like_layers(feats: Mapping[str, Tensor] | Sequence[Tensor], seed: int, kind: str = DEFAULT_BASELINE) -> dict[str, Tensor] | list[Tensor]:
    """:func:`noise_like` for every layer: entry ``i`` (in the mapping's / sequence's order) gets seed ``seed + i``,
    so layers get independent noise. Returns a dict with the same keys for a mapping, else a list."""
    if isinstance(feats, Mapping):
        return {name: noise_like(x, seed + i, kind) for i, (name, x) in enumerate(feats.items())}
    return [noise_like(x, seed + i, kind) for i, x in enumerate(feats)]
