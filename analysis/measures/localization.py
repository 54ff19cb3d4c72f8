"""Localization: CKA between every token of a layer and every input patch (Raghu et al. 2021 §7, Fig. 9, 10, D.1-D.3).

Definition. A layer's tokens are its SPATIAL tokens on a grid (gh, gw) in row-major order: for a ViT the block output's
tokens with the prefix (CLS / register) tokens dropped; for a ResNet the channel vector at each position of the block's
feature map [B, C, H, W] (Raghu §7: "all the convolutional channels at a particular spatial location"). A ResNet feature
map whose side exceeds ``max_side`` (option ``resnet_max_side``, default 7, the grid of ViT-B/32 and of ResNet-50's last
stage at 224 px, and of this project's default ViT) is first average-pooled to at most that side
(``adaptive_avg_pool2d``: a token is then the mean channel vector over the positions it covers); ViT tokens are never
pooled. That is option ``resnet_tokens: pool``, the default here because it is §7's definition: Raghu App. A's patching
step ("before pooling we split the feature map into patches and flattened each patch [...] All results presented in the
paper include this additional patching step") is described for the linear probes, and Fig. 9 itself (ResNet-50's final
block, 7 x 7) is unchanged by it. ``resnet_tokens: patch`` applies it (p x p patches flattened to C p^2 values before
the pooling, same token grid; p as in analysis/estimators/features.py or option ``resnet_patch``); Raghu's code is not
published, so which one their earlier-layer Fig. D.3 uses is not known. The input patch at grid position (i, j) is the
block of NORMALISED input pixels it covers,

    rows [floor(i H / gh), ceil((i + 1) H / gh)),  cols [floor(j W / gw), ceil((j + 1) W / gw)),

flattened over channels and pixels to a vector of C * ph * pw values (for a ViT exactly its p x p patch; for a ResNet
stage with a coarser grid, a block of input side / grid side pixels). Over the analysis images, token t gives
X_t [n, D] and patch q gives P_q [n, C ph pw], and

    cka[t, q] = CKA(X_t, P_q)       linear, unbiased minibatch form (analysis.cka.MinibatchCKA with ys=...)

a [T, P] matrix with T = P = gh * gw. Row t drawn on the grid is one heatmap of Fig. 9: where in the input token t's
representation comes from. Per layer two scores summarise it:

    own_share = share of tokens t whose most similar patch argmax_q cka[t, q] is their own position q = t (chance 1/P)
    contrast  = mean_t cka[t, t] - mean_{t != q} cka[t, q]

A patch (or token) that is constant over all analysis images has no defined CKA (0/0): its entries are NaN, and the
scores skip NaN (a token whose own entry is NaN is left out of own_share). Each minibatch's representations are
shifted by their first row before the Grams (linear CKA is translation invariant), so a constant patch gives exactly
zero HSIC terms instead of rounding noise. Minibatches of fewer than 4 images (only a last, ragged one can be) are
skipped, on 1 and N processes alike.

Result (flat dict): ``layers`` [L] tap names, ``block_index`` [L], ``grid`` [L, 2] (gh, gw of each layer),
``cka`` [L, Tmax, Pmax] float64 (layer l's matrix is ``cka[l, :gh*gw, :gh*gw]``; layers with a smaller grid, e.g.
the last ResNet stage, are padded with NaN), ``own_share`` [L], ``contrast`` [L], ``chance`` [L] (1 / P),
``n_images``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch
from matplotlib.patches import Rectangle

from analysis.engine.figures import grid_labels, subplots
from analysis.engine.measure import Context, Measure, as_list, register
from analysis.engine.reduce import all_reduce_sum, gather_objects
from analysis.estimators.features import DEFAULT_MAX_SIDE, final_channels, layer_tag, resnet_patch_side, spatial_tokens
from analysis.estimators.similarity import MinibatchCKA

# ---------------------------------------------------------------- the definition, on tensors


def _bounds(size: int, parts: int) -> list[tuple[int, int]]:
    return [((i * size) // parts, -((-(i + 1) * size) // parts)) for i in range(parts)]


def input_patches(x: torch.Tensor, grid: tuple[int, int]) -> list[torch.Tensor]:
    """The input patch of every grid position, row-major: a list of P = gh * gw tensors [B, C * ph * pw] of the
    pixels rows [floor(i H / gh), ceil((i + 1) H / gh)) x cols [floor(j W / gw), ceil((j + 1) W / gw))."""
    rows, cols = _bounds(x.shape[-2], grid[0]), _bounds(x.shape[-1], grid[1])
    return [x[:, :, r0:r1, c0:c1].reshape(x.shape[0], -1) for r0, r1 in rows for c0, c1 in cols]


def _shifted(reps: list[torch.Tensor]) -> list[torch.Tensor]:
    """float64 and shifted by the first row: CKA is unchanged, a constant representation becomes exactly 0."""
    out = []
    for r in reps:
        r = r.reshape(r.shape[0], -1).double()
        out.append(r - r[:1])
    return out


def update_localization(acc: MinibatchCKA, tokens: torch.Tensor, x: torch.Tensor, grid: tuple[int, int]) -> None:
    """Add one minibatch to ``acc``: spatial tokens [n, T, D] against the input patches of ``x`` [n, C, H, W]."""
    acc.update(_shifted(list(tokens.unbind(1))), _shifted(input_patches(x, grid)))


def localization_cka(
    tokens: torch.Tensor, x: torch.Tensor, grid: tuple[int, int], batch_size: int | None = None, unbiased: bool = True
) -> torch.Tensor:
    """cka [T, P] (float64) between each spatial token (``tokens`` [N, T, D]) and each input patch of ``x`` [N, C, H, W]
    on ``grid``, in minibatches of ``batch_size`` (default: one) -- see the module docstring."""
    n = tokens.shape[0]
    b = batch_size or n
    acc = MinibatchCKA(unbiased=unbiased)
    for s in range(0, n, b):
        if min(b, n - s) >= 4:
            update_localization(acc, tokens[s : s + b], x[s : s + b], grid)
    return acc.compute()


def localization_scores(cka: np.ndarray | torch.Tensor) -> tuple[float, float]:
    """(own_share, contrast) of one layer's cka [T, P] with T = P (see the module docstring; NaN entries skipped)."""
    m = np.asarray(cka, dtype=np.float64)
    if m.ndim != 2 or m.shape[0] != m.shape[1]:
        raise ValueError(f"cka must be a square [T, T] matrix, got shape {m.shape}")
    n = m.shape[0]
    own = np.diagonal(m)
    ok = np.isfinite(own) & np.isfinite(m).any(1)
    best = np.nanargmax(np.where(np.isfinite(m), m, -np.inf)[ok], axis=1) if ok.any() else np.zeros(0, int)
    share = float(np.mean(best == np.flatnonzero(ok))) if ok.any() else math.nan
    off = m[~np.eye(n, dtype=bool)]
    own_f, off_f = own[np.isfinite(own)], off[np.isfinite(off)]
    contrast = float(own_f.mean() - off_f.mean()) if own_f.size and off_f.size else math.nan
    return share, contrast


def example_tokens(grid: tuple[int, int]) -> list[int]:
    """Up to 9 tokens for the Fig. 9 panels: rows and cols at the first, middle and last grid lines (corners, edges,
    centre), row-major indices."""
    rows = sorted({round(v) for v in np.linspace(0, grid[0] - 1, 3)})
    cols = sorted({round(v) for v in np.linspace(0, grid[1] - 1, 3)})
    return [r * grid[1] + c for r in rows for c in cols]


@dataclass(frozen=True)
class LocalizationOptions:
    kinds: tuple[str, ...] = (
        "out",
    )  # taps of every block compared with the input patches (analysis/engine/taps.py kinds)
    resnet_max_side: int = DEFAULT_MAX_SIDE  # ResNet maps larger than this per side are average-pooled to it
    resnet_tokens: Literal["patch", "pool"] = "pool"  # Raghu §7 (pool) or App. A's probe patching step (patch)
    resnet_patch: int = 0  # patch side for resnet_tokens=patch; 0: automatic (analysis/estimators/features.py)
    unbiased: bool = True  # HSIC_1 (false: HSIC_0)

    def check(self):
        if "attn_probs" in self.kinds:
            return "localization compares token representations; attn_probs is not one."
        if self.resnet_patch < 0 or self.resnet_max_side < 1:
            return (
                f"resnet_patch must be >= 0 and resnet_max_side >= 1, not {self.resnet_patch} and "
                f"{self.resnet_max_side}."
            )
        return None


# ---------------------------------------------------------------- the measure


@register
class Localization(Measure):
    """Whether tokens keep their place: CKA of each spatial token with every input patch, and localization scores.
    Raghu et al. 2021 §7, Fig. 9 (ViT CLS vs ResNet), Fig. 10 (ViT GAP), Fig. D.1-D.3 (more layers): CKA of every
    spatial token of a layer with every input patch, and per-layer localization scores.

    ``cka[l, t, q] = CKA(token t of layer l, input patch q)`` over the analysis images (linear, unbiased minibatch
    CKA; tokens without CLS; ResNet tokens = channel vectors per position, maps larger than ``resnet_max_side``
    average-pooled to it; input patch = the normalised pixels the position covers), ``own_share[l]`` = share of
    tokens whose best patch is their own, ``contrast[l]`` = mean own-patch CKA - mean other-patch CKA. Exact
    definitions in the module docstring. Options: ``kinds`` (the taps of each block, default ``out``),
    ``resnet_max_side`` (7), ``resnet_tokens`` (``pool``, Raghu §7; ``patch``: App. A's patching step),
    ``resnet_patch`` (0: auto), ``unbiased`` (True).
    """

    name = "localization"
    Options = LocalizationOptions

    def __init__(self, ctx: Context, opts=None):
        super().__init__(ctx, opts)
        self.layers = [f"{b}.{k}" for b in ctx.blocks for k in self.opts.kinds]
        self.max_side = self.opts.resnet_max_side
        self.final = final_channels(ctx.model) if ctx.arch == "resnet" else None
        self.acc = {lay: MinibatchCKA(unbiased=self.opts.unbiased) for lay in self.layers}
        self.grids: dict[str, tuple[int, int]] = {}
        self.images = 0

    def taps(self) -> set[str]:
        return set(self.layers)

    @torch.no_grad()
    def update(self, j, cap, x, y) -> None:
        if x.shape[0] < 4:
            return
        self.images += x.shape[0]
        for lay in self.layers:
            t = cap[lay]
            p = (
                resnet_patch_side(t.shape, self.final, self.opts.resnet_tokens, self.opts.resnet_patch, self.max_side)
                if t.ndim == 4
                else 1
            )
            tokens, grid = spatial_tokens(t, self.ctx.prefix, self.ctx.grid, self.max_side, p)
            if self.grids.setdefault(lay, grid) != grid:
                raise ValueError(f"{lay}: token grid changed from {self.grids[lay]} to {grid} between minibatches")
            update_localization(self.acc[lay], tokens, x, grid)

    def finish(self) -> dict:
        acc = self.ctx.accelerator
        grids: dict[str, tuple[int, int]] = {}
        for g in gather_objects([dict(self.grids)], acc):  # processes that saw no minibatch still take part in the sums
            grids.update(g)
        missing = [lay for lay in self.layers if lay not in grids]
        if missing:
            raise ValueError(
                f"localization saw no minibatch of at least 4 images for {missing[0]}: raise the analysis size."
            )
        n_images = int(all_reduce_sum(torch.tensor([float(self.images)], dtype=torch.float64), acc).item())
        mats = []
        for lay in self.layers:
            m = self.acc[lay]
            p = grids[lay][0] * grids[lay][1]
            if m.xy is None:
                m.xy = torch.zeros(p, p, dtype=torch.float64, device=self.ctx.device)
                m.xx = torch.zeros(p, dtype=torch.float64, device=self.ctx.device)
                m.yy = torch.zeros(p, dtype=torch.float64, device=self.ctx.device)
            m.sync(acc)
            mats.append(m.compute().cpu().numpy())
        size = max(len(mm) for mm in mats)
        cka = np.full((len(mats), size, size), np.nan)
        for i, mm in enumerate(mats):
            cka[i, : len(mm), : len(mm)] = mm
        scores = [localization_scores(mm) for mm in mats]
        blocks = list(self.ctx.blocks)
        return {
            "layers": list(self.layers),
            "block_index": np.array([blocks.index(lay.rsplit(".", 1)[0]) for lay in self.layers]),
            "grid": np.array([grids[lay] for lay in self.layers], dtype=np.int64),
            "cka": cka,
            "own_share": np.array([s[0] for s in scores]),
            "contrast": np.array([s[1] for s in scores]),
            "chance": np.array([1.0 / len(mm) for mm in mats]),
            "n_images": n_images,
        }

    @staticmethod
    def layer_matrix(r: dict, i: int) -> np.ndarray:
        """Layer i's [T, P] matrix without padding."""
        gh, gw = (int(v) for v in np.asarray(r["grid"])[i])
        return np.asarray(r["cka"])[i, : gh * gw, : gh * gw]

    @staticmethod
    def summary(r: dict) -> dict:
        return {
            "layers": as_list(r["layers"]),
            "own_share": [float(v) for v in np.asarray(r["own_share"])],
            "contrast": [float(v) for v in np.asarray(r["contrast"])],
            "chance": [float(v) for v in np.asarray(r["chance"])],
        }

    @staticmethod
    def scalars(r: dict) -> dict[str, float]:
        out = {}
        for lay, bi, share, con in zip(
            as_list(r["layers"]), np.asarray(r["block_index"]), np.asarray(r["own_share"]), np.asarray(r["contrast"])
        ):
            tag = layer_tag(lay, bi)
            out[f"localization/own_share/{tag}"] = float(share)
            out[f"localization/contrast/{tag}"] = float(con)
        return out

    @staticmethod
    def figures(r: dict, step: int | None = None) -> dict:
        at = f" (step {step})" if step is not None else ""
        layers = as_list(r["layers"])
        figs = {}
        # a result read without its matrices (the real-ViT report's, analysis/studies/real_vit/cached.py): scores only
        for i, (lay, bi) in enumerate(zip(layers, np.asarray(r["block_index"])) if "cka" in r else []):
            figs[f"localization/{layer_tag(lay, bi)}"] = token_patch_maps(
                Localization.layer_matrix(r, i),
                tuple(np.asarray(r["grid"])[i]),
                title=f"CKA token vs input patch, {lay}{at}",
            )
        figs["localization/score"] = score_plot(
            layers,
            np.asarray(r["own_share"]),
            np.asarray(r["contrast"]),
            np.asarray(r["chance"]),
            title=f"localization vs depth{at}",
        )
        return figs


# ---------------------------------------------------------------- figures


def token_patch_maps(cka: np.ndarray, grid: tuple[int, int], tokens: list[int] | None = None, title: str = ""):
    """Fig. 9 / 10 / D.1-D.3: for each chosen token, the [gh, gw] map of its CKA with every input patch (own position
    outlined in cyan)."""

    gh, gw = int(grid[0]), int(grid[1])
    tokens = example_tokens((gh, gw)) if tokens is None else tokens
    cols = min(3, len(tokens))
    rows = -(-len(tokens) // cols)
    fig, axes = subplots(rows, cols, figsize=(2.0 * cols + 1.2, 2.0 * rows + 0.8), squeeze=False, layout="constrained")
    m = np.asarray(cka, dtype=np.float64)
    finite = m[np.isfinite(m)]
    vmax = max(float(finite.max()), 1e-6) if finite.size else 1.0
    im = None
    for k, ax in enumerate(axes.flat):
        ax.set_xticks([])
        ax.set_yticks([])
        if k >= len(tokens):
            ax.axis("off")
            continue
        t = tokens[k]
        im = ax.imshow(m[t].reshape(gh, gw), vmin=0, vmax=vmax, cmap="magma")
        r, c = divmod(t, gw)
        ax.add_patch(Rectangle((c - 0.5, r - 0.5), 1, 1, fill=False, ec="cyan", lw=1.2))
        ax.set_title(f"token {t} ({r},{c})", fontsize=7)
    if im is not None:
        fig.colorbar(im, ax=axes.ravel().tolist(), fraction=0.03).set_label("CKA with the input patch", fontsize=7)
    grid_labels(fig, "input patch column", "input patch row")
    fig.suptitle(f"{title}\ncyan: the token's own patch", fontsize=8)
    return fig


def score_plot(
    layers: list[str],
    own_share: np.ndarray,
    contrast: np.ndarray,
    chance: np.ndarray | None = None,
    title: str = "localization vs depth",
):
    """Localization scores per layer: share of tokens most similar to their own patch, and the CKA contrast."""

    fig, ax = subplots(figsize=(5, 3.5))
    x = np.arange(len(layers))
    ax.plot(x, own_share, marker="o", ms=3, label="own-patch share")
    ax.plot(x, contrast, marker="s", ms=3, label="CKA own - others")
    if chance is not None:
        ax.plot(x, chance, color="grey", ls=":", lw=1, label="chance share")
    ax.set_xticks(x, [lay.rsplit(".", 1)[0] for lay in layers], rotation=90, fontsize=6)
    ax.set_xlabel("layer")
    ax.set_ylabel("share of tokens (fraction)\nor CKA difference", fontsize=8)
    ax.set_ylim(min(0.0, float(np.nanmin(contrast)) if np.isfinite(contrast).any() else 0.0) - 0.05, 1.05)
    ax.legend(fontsize=7)
    ax.set_title(title)
    fig.tight_layout()
    return fig
