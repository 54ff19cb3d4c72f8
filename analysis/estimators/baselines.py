"""Baselines: what a metric gives without learned features. Two kinds:

- random-chance scores: the same metric on random features of the same shape (Walmer et al. 2023, App. B.3),
  below;
- CKA floors (:func:`cka_floors`): each layer's CKA with the raw pixels and with the same layer of the same
  architecture at random initialisation, the references a CKA map is read against (end of this docstring).

Random-chance baselines (Walmer et al. 2023, App. B.3).

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

CKA floors. Raghu et al. 2021 read their CKA maps (Fig. 1, 2, 8, 12) as learned structure, and compare tokens with
input patches (Fig. 9); a map means something only above what needs no learning: (1) the raw pixels -- a layer's CKA
with the flattened input image (the model's normalised input, one row per image) says how much of that layer's
similarity structure the input already has; (2) the architecture at random initialisation -- a randomly initialised
ViT carries its input through every block on the skip connections, so its own map is already near-uniform (its mean
off-diagonal CKA is the floor of "ViT maps are uniform"), and a trained layer's CKA with the same layer at
initialisation says how far training moved it. :func:`cka_floors` computes both in one pass over the images, with the
same minibatch CKA estimator (analysis/estimators/similarity.py) and layer representation as the maps.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import torch
from torch import Tensor

from analysis.engine.reduce import ORDER_SEED, Minibatches
from analysis.engine.taps import Taps
from analysis.estimators.similarity import MinibatchCKA, represent

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
    """:func:`gaussian_like` (``kind="gaussian"``, Walmer's text) or :func:`uniform_like` (``"uniform"``, their
    code)."""
    if kind == "gaussian":
        return gaussian_like(x, seed)
    if kind == "uniform":
        return uniform_like(x, seed)
    raise ValueError(f"unknown baseline {kind!r}: use one of {', '.join(BASELINES)}")


def gaussian_like_layers(
    feats: Mapping[str, Tensor] | Sequence[Tensor], seed: int, kind: str = DEFAULT_BASELINE
) -> dict[str, Tensor] | list[Tensor]:
    """:func:`noise_like` for every layer: entry ``i`` (in the mapping's / sequence's order) gets seed ``seed + i``,
    so layers get independent noise. Returns a dict with the same keys for a mapping, else a list."""
    if isinstance(feats, Mapping):
        return {name: noise_like(x, seed + i, kind) for i, (name, x) in enumerate(feats.items())}
    return [noise_like(x, seed + i, kind) for i, x in enumerate(feats)]


@torch.no_grad()
def cka_floors(
    model,
    init_model,
    images: Tensor,
    normalize,
    layers: Sequence[tuple[str, str]],
    num_prefix_tokens: int,
    how: str = "flatten",
    batch_size: int = 256,
    unbiased: bool = True,
    order_seed: int | None = ORDER_SEED,
) -> dict:
    """The CKA floors of a trained ``model`` (module docstring): ``init_model`` is the same architecture at random
    initialisation, ``layers`` (tap name, label) pairs as :func:`analysis.measures.cka.cka_layers` gives them (the same
    taps exist in both models), ``how`` the layer representation (``flatten``, ``cls``, ``mean_spatial``; the pixels are
    always the flattened normalised image). ``images`` [N, C, H, W] go through ``normalize`` in minibatches of
    ``batch_size`` (each >= 4 images; runs of a permutation drawn from ``order_seed``, as the suite's minibatches,
    :class:`analysis.engine.reduce.Minibatches`). One self-CKA over [pixels, trained layers, init layers]; returns
    ``labels`` [L], ``taps`` [L], ``pixels`` [L] (trained layer vs pixels), ``init_pixels`` [L] (init layer vs pixels),
    ``init_same`` [L] (trained layer vs the same layer at init), ``matrix`` [L, L] (the trained model's map, for the
    same images) and ``init_matrix`` [L, L] (the random-init model's map)."""
    n = len(images)
    if n < 4 or 0 < n % batch_size < 4:
        raise ValueError(
            f"{n} images in minibatches of {batch_size} leave a minibatch of fewer than 4 images: CKA needs >= 4."
        )
    taps = [t for t, _ in layers]
    modes = model.training, init_model.training
    model.eval()
    init_model.eval()
    dev, idev = next(model.parameters()).device, next(init_model.parameters()).device
    acc = MinibatchCKA(unbiased=unbiased)
    try:
        mb = Minibatches(n, batch_size, order_seed)
        for j in range(len(mb)):
            x = normalize(mb.take(images, j))
            with Taps(model, taps) as cap:
                model(x.to(dev))
            with Taps(init_model, taps) as icap:
                init_model(x.to(idev))
            reps = [x.reshape(len(x), -1).to(dev)]
            reps += [represent(cap[t], how, num_prefix_tokens) for t in taps]
            reps += [represent(icap[t], how, num_prefix_tokens).to(dev) for t in taps]
            acc.update(reps)
    finally:
        model.train(modes[0])
        init_model.train(modes[1])
    m = acc.compute().cpu().numpy()
    k = len(taps)
    trained, init = slice(1, 1 + k), slice(1 + k, 1 + 2 * k)
    return {
        "labels": [lab for _, lab in layers],
        "taps": taps,
        "pixels": m[0, trained].copy(),
        "init_pixels": m[0, init].copy(),
        "init_same": np.diag(m[trained, init]).copy(),
        "matrix": m[trained, trained].copy(),
        "init_matrix": m[init, init].copy(),
    }
