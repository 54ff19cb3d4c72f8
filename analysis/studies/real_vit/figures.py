"""The real-ViT report's own figures: every head's attention distance against uniform attention's, and the CLS
attention on a few photos."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from analysis.engine.figures import BLOCK_AXIS, grid_labels, save, subplots
from analysis.engine.taps import Taps, block_names, grid_of, num_prefix_tokens
from analysis.results.publish import figure_file, make_figures
from analysis.studies.locality import LOCAL_FRACTION


def suite_figures(res: dict, names) -> dict:
    """{file name: figure} of the measures' figures named in ``names``, drawn from the results ``res`` now rather than
    copied from the run's figure folder, where a figure drawn by an earlier version may lie beside a reused result:
    the model comes from elsewhere, so no title names a training step ("step 0"), and blocks are numbered from 0 on
    every axis (BLOCK_AXIS), as in the report's tables and text."""
    return {f: fig for tag, fig in make_figures(res, None).items() if (f := figure_file(tag)) in names}


def distance_figure(dist_mean: np.ndarray, uniform: float, path: Path) -> None:
    """ViT Fig. 7 / Raghu Fig. 3: every head's mean attention distance per block, against uniform attention's."""
    L, H = dist_mean.shape
    fig, ax = subplots(figsize=(6.4, 4))
    for h in range(H):
        ax.scatter(np.arange(L), dist_mean[:, h], s=18, label=f"head {h}")
    ax.plot(np.arange(L), dist_mean.mean(1), color="k", lw=1, label="mean of heads")
    ax.axhline(uniform, color="grey", ls="--", lw=1, label=f"uniform attention ({uniform:.0f} px)")
    ax.axhline(LOCAL_FRACTION * uniform, color="grey", ls=":", lw=1, label=f"{LOCAL_FRACTION:g} x uniform: local below")
    ax.set_xlabel(BLOCK_AXIS)
    ax.set_ylabel("mean attention distance (px, 224 x 224 input)")
    ax.set_ylim(0, 224 * 0.75)
    ax.set_xticks(np.arange(L))
    ax.set_title("Mean attention distance per head (cf. ViT Fig. 7, Raghu Fig. 3)")
    ax.legend(fontsize=6, ncol=3, loc="lower right")
    fig.tight_layout()
    save(fig, path)


@torch.no_grad()
def cls_maps(model, split, normalize, names: list, n: int = 4, blocks=(5, 11)) -> dict:
    """What :func:`cls_maps_figure` draws (Walmer Fig. 2): the CLS query's attention over the patches (mean over
    heads) at ``blocks`` on the whole view of the first ``n`` photos (``maps`` [len(blocks), n, gh, gw]), the views
    as 8-bit RGB (``images`` [n, H, W, 3]) and their photos' names."""
    idx = [
        int(i) for i in np.flatnonzero(np.r_[True, np.diff(split.labels.numpy()) != 0])[:n]
    ]  # each photo's whole view
    bn, p = block_names(model), num_prefix_tokens(model)
    gh, gw = grid_of(model)
    with Taps(model, [f"{bn[b]}.attn_probs" for b in blocks]) as cap:
        model(normalize(split.images[idx]))
    maps = [cap.captures[f"{bn[b]}.attn_probs"][:, :, 0, p:].mean(1).reshape(-1, gh, gw).numpy() for b in blocks]
    x = split.images[idx].permute(0, 2, 3, 1)  # uint8 as the photos are kept (analysis/sources/images.py)
    images = (x if x.dtype == torch.uint8 else (x.clamp(0, 1) * 255).round().to(torch.uint8)).numpy()
    return {
        "maps": np.stack(maps),
        "images": images,
        "blocks": np.asarray(blocks),
        "names": np.asarray([names[int(split.labels[i])] for i in idx]),
    }


def cls_maps_figure(res: dict, path: Path) -> None:
    """Walmer Fig. 2: the CLS attention maps of :func:`cls_maps` beside their photos, one colour scale."""
    maps, images, blocks = np.asarray(res["maps"]), np.asarray(res["images"]), [int(b) for b in res["blocks"]]
    names = [str(v) for v in np.asarray(res["names"])]
    vmax = float(maps.max())
    fig, axes = subplots(
        len(images), 1 + len(blocks), figsize=(2.2 * (1 + len(blocks)) + 0.6, 2.2 * len(images)), squeeze=False
    )
    im = None
    for r in range(len(images)):
        axes[r, 0].imshow(images[r])
        axes[r, 0].set_title(names[r], fontsize=8)
        for c, b in enumerate(blocks):
            im = axes[r, c + 1].imshow(maps[c, r], vmin=0, vmax=vmax, cmap="inferno")
            axes[r, c + 1].set_title(f"block {b}: CLS attention", fontsize=8)
        for a in axes[r]:
            a.set_xticks([])
            a.set_yticks([])
    fig.colorbar(
        im, ax=axes.ravel().tolist(), fraction=0.03, label="share of the CLS query's attention (mean of heads)"
    )
    grid_labels(fig, "in each map: patch column (left: the photo)", "in each map: patch row; rows: photos")
    fig.suptitle("CLS attention maps on photos (cf. Walmer Fig. 2)", fontsize=10)
    save(fig, path)
