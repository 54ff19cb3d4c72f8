"""ViT attention heads, sorted from local to global, compared with a ResNet's lower layers by CKA
(Raghu et al. 2021 §4, "Does access to global information result in different features?", Fig. 5).

A cross-model measure (two models, so a function rather than a registered single-model Measure):
:func:`head_subset_cka`, run by ``python -m analysis RUN --against RESNET_RUN``.

Definitions. ViT block ``block`` (default 0, the first encoder block) has H heads of width dh.

- Head distance: the mean attention distance of each head
(:func:`analysis.measures.attention_distance.attention_distance`: spatial
  queries and keys, rows renormalised over spatial keys; patch-centre pixels by default, ``unit`` picks another) over
  ALL the given images. Heads are
  ordered by it, ascending (most local first; stable sort, ties by head index): ``head_order``.
- Head representation: the head's attention output BEFORE the output projection, ``(A_h V_h)`` [T, dh] per image,
  spatial tokens only (prefix/CLS rows dropped), flattened to [N * dh]. It is read from the input of ``attn.norm``
  (timm's Attention computes ``x = (attn @ v).transpose(1, 2).reshape(B, T, H * dh)``, so channels
  ``h*dh:(h+1)*dh`` are head h; then ``norm`` -- Identity unless scale_norm --, an optional gate, and ``proj``; for
  the default Attention this is the input of ``proj``), through the ``heads`` tap (analysis/engine/taps.py).
- Subsets (Raghu §4, "we take subsets of the ViT attention heads from the first encoder block, ranging from the
  subset corresponding to the most local attention heads to a subset of the representation corresponding to the
  most global attention heads ... plot the mean distance for each subset against CKA similarity"; Fig. 5 caption
  likewise): the paper states neither the subset size nor how the subsets step, and Raghu's code is not public.
  We take WINDOWS of k consecutive heads in the distance order, sliding one head at a time from the k most local
  (``head_order[0:k]``) to the k most global (``head_order[H-k:H]``): H - k + 1 subsets, subset i =
  ``head_order[i:i+k]``, whose mean distances rise with i. Sliding windows, not growing sets, because the paper's
  last subset is "the most global attention heads" (a growing set would end with all heads) and because its x axis
  is each subset's mean distance, which windows spread over the whole range. k = H // 2 by default (at least 1),
  so the first and last windows are the local and the global half; k = 1 gives the single heads. Each subset's
  representation: its heads' spatial outputs concatenated along the channel axis, flattened per image. The single
  heads are kept as their own rows (``cka``).
- ResNet layers: by default the outputs of the residual blocks of the first two stages (taps ``layer{s}.{j}.out``,
  s = 1, 2), flattened per image.
- CKA: minibatch linear CKA (:class:`analysis.estimators.similarity.MinibatchCKA` with ``ys``, unbiased HSIC by
default) over the same
  fixed minibatches of ``batch_size`` images for both models; every minibatch needs >= 4 images.

Two passes over the images: attention distances first (they fix the order and the subsets), then features.
With an ``accelerator`` (N processes), minibatch j goes to process j mod N and all sums are added over processes,
so 1 and N processes agree.
"""

from __future__ import annotations

import matplotlib
import numpy as np
import torch
from torch import Tensor

from analysis.engine.figures import subplots
from analysis.engine.measure import as_list
from analysis.engine.reduce import ORDER_SEED, Minibatches
from analysis.engine.taps import Taps, grid_of, is_vit
from analysis.estimators.similarity import MinibatchCKA, represent
from analysis.families import family_of
from analysis.families.timm_resnet import resnet_blocks
from analysis.measures.attention_distance import UNITS, AttentionDistance


def default_resnet_layers(resnet, stages: tuple[int, ...] = (1, 2)) -> list[str]:
    """Taps ``layer{s}.{j}.out`` of every residual block of the given stages (Raghu Fig. 5: 'lower layers')."""
    names = [n for n, _ in resnet_blocks(resnet) if int(n.split(".")[0][len("layer") :]) in stages]
    if not names:
        raise ValueError(f"{type(resnet).__name__} has no residual blocks in stages {stages}")
    return [f"{n}.out" for n in names]


def split_heads(x: Tensor, num_heads: int, num_prefix_tokens: int) -> Tensor:
    """[B, T, H * dh] (heads contiguous) -> [B, H, N, dh], spatial tokens only."""
    b, t, c = x.shape
    if c % num_heads:
        raise ValueError(f"{c} channels do not split into {num_heads} heads")
    return x[:, num_prefix_tokens:].reshape(b, t - num_prefix_tokens, num_heads, c // num_heads).transpose(1, 2)


@torch.no_grad()
def head_subset_cka(
    vit,
    resnet,
    images: Tensor,
    normalize,
    batch_size: int = 256,
    block: int = 0,
    resnet_layers: list[str] | None = None,
    k: int | None = None,
    unit: str = "pixels",
    unbiased: bool = True,
    accelerator=None,
    order_seed: int | None = ORDER_SEED,
) -> dict:
    """Raghu et al. 2021 Fig. 5: CKA between single ViT attention heads (sorted local -> global) / windows of ``k``
    consecutive heads sliding from the most local to the most global, and the ResNet's lower layers (module docstring).

    ``images`` [N, C, H, W] (e.g. uint8), ``normalize`` maps a minibatch to model inputs; both models see the same
    minibatches. ``unit``: the attention distance that orders the heads (``pixels``: patch centres, the default;
    ``unit_square``; ``pixel_level``; see analysis/measures/attention_distance.py). Returns a flat dict:
    ``head_order`` [H] int (heads by ascending mean attention distance), ``head_distance`` [H] (distance of head
    ``head_order[i]``, in ``unit``), ``cka`` [H, R] (row i: head ``head_order[i]`` alone; column r:
    ``resnet_layers[r]``), ``subset_cka`` [S, R] (S = H - k + 1 windows, row i: heads ``head_order[i:i+k]``),
    ``subset_heads`` [S, k], ``subset_distance`` [S] (mean distance of the window's heads, non-decreasing),
    ``subsets`` [S] names (``sorted i-j``: positions in the distance order), ``k``, ``resnet_layers`` [R], ``block``,
    ``unit``, ``n_images``.
    """
    if not is_vit(vit):
        raise ValueError(f"head_subset_cka needs a vision transformer first, got {type(vit).__name__}")
    if unit not in UNITS:
        raise ValueError(f"unit must be one of {UNITS}, got {unit!r}")
    n = len(images)
    tail = n % batch_size
    if n < 4 or 0 < tail < 4:
        raise ValueError(
            f"{n} images in minibatches of {batch_size} leave a minibatch of {tail or n} < 4 images; "
            "unbiased CKA needs >= 4 per minibatch: change batch_size or the number of images."
        )
    layers = list(resnet_layers) if resnet_layers is not None else default_resnet_layers(resnet)
    fam = family_of(vit)  # the model's family gives its tokens (timm and transformers ViTs alike)
    prefix = fam.prefix(vit)
    grid = grid_of(vit)
    tap = f"blocks.{block}.attn_probs"
    vdev, rdev = next(vit.parameters()).device, next(resnet.parameters()).device
    modes = vit.training, resnet.training
    vit.eval()
    resnet.eval()
    try:
        with Taps(vit, [tap]) as cap:  # the head count: the block's attention on one image
            vit(normalize(images[:1].to(vdev)))
        heads = int(cap[tap].shape[1])
        k = max(1, heads // 2) if k is None else int(k)
        if not 1 <= k <= heads:
            raise ValueError(f"subset size k={k} must be in 1..{heads}")
        # pass 1: attention distances of the block's heads over all images
        ad = AttentionDistance(grid, fam.patch_size(vit), prefix)
        mb = Minibatches(n, batch_size, order_seed)  # the suite's minibatches (random: CKA's estimator assumes so)
        for j in mb.mine(accelerator):
            x = mb.take(images, j)
            with Taps(vit, [tap]) as cap:
                vit(normalize(x.to(vdev)))
            ad.update(block, cap[tap])
        ad.sync(accelerator)
        dist = ad.compute(unit)[block].numpy()
        order = np.argsort(dist, kind="stable")
        subsets = np.stack([order[i : i + k] for i in range(heads - k + 1)])  # windows, local -> global

        # pass 2: head outputs and ResNet features, minibatch CKA
        cka = MinibatchCKA(unbiased=unbiased)
        sel = [torch.as_tensor(s, dtype=torch.long) for s in subsets]
        for j in mb.mine(accelerator):
            x = mb.take(images, j)
            with Taps(vit, [f"blocks.{block}.heads"]) as hcap:
                vit(normalize(x.to(vdev)))
            hs = split_heads(hcap[f"blocks.{block}.heads"], heads, prefix)  # [b, H, N, dh]
            xs = [hs[:, h].reshape(len(x), -1) for h in order.tolist()]
            xs += [hs[:, s.to(hs.device)].transpose(1, 2).reshape(len(x), -1) for s in sel]  # [b, N, k, dh] flattened
            with Taps(resnet, layers) as cap:
                resnet(normalize(x.to(rdev)))
            ys = [represent(cap[t], "flatten").to(hs.device) for t in layers]
            cka.update(xs, ys)
        cka.sync(accelerator)
        m = cka.compute().cpu().numpy()
    finally:
        vit.train(modes[0])
        resnet.train(modes[1])
    return {
        "head_order": order.astype(np.int64),
        "head_distance": dist[order],
        "cka": m[:heads],
        "subset_cka": m[heads:],
        "subset_heads": subsets.astype(np.int64),
        "subset_distance": np.array([dist[s].mean() for s in subsets]),
        "subsets": [f"sorted {i}-{i + k - 1}" for i in range(len(subsets))],
        "k": int(k),
        "resnet_layers": layers,
        "block": int(block),
        "unit": unit,
        "n_images": int(n),
    }


def head_subset_figure(r: dict, title: str | None = None):
    """Raghu Fig. 5: x = mean attention distance of a subset of the block's heads, y = its CKA to a ResNet layer; one
    line per ResNet layer through the sliding windows of k heads (local -> global), and each single head as a small
    hollow marker at its own distance (same colour)."""
    cka, sub = np.asarray(r["cka"]), np.asarray(r["subset_cka"])
    dist, sub_dist = np.asarray(r["head_distance"]), np.asarray(r["subset_distance"])
    layers, unit = as_list(r["resnet_layers"]), str(np.asarray(r["unit"]))
    k = int(r["k"]) if "k" in r else np.asarray(r["subset_heads"]).shape[1]
    fig, ax = subplots(figsize=(5.5, 3.8))
    colors = matplotlib.colormaps["viridis"](np.linspace(0, 0.9, max(1, len(layers))))
    for i, name in enumerate(layers):
        ax.plot(sub_dist, sub[:, i], marker="o", ms=4, color=colors[i], label=f"{name}: windows of {k} heads")
        ax.scatter(dist, cka[:, i], marker="o", s=14, facecolors="none", edgecolors=colors[i], linewidths=0.8, zorder=3)
    ax.scatter([], [], marker="o", s=14, facecolors="none", edgecolors="grey", label="single heads")
    ax.set_xlabel(f"mean attention distance of the heads ({unit}), block {int(r['block'])}")
    ax.set_ylabel("CKA to ResNet layer")
    lo = min(0.0, float(np.nanmin(cka)), float(np.nanmin(sub)))  # unbiased CKA can dip below 0
    ax.set_ylim(lo, 1)
    ax.ticklabel_format(axis="x", useOffset=False)  # near-equal distances (untrained heads) would get an offset label
    ax.legend(fontsize=6, loc="best")
    ax.set_title(title or "ViT head subsets (local -> global) vs ResNet lower layers", fontsize=9)
    fig.tight_layout()
    return fig
