"""Average attention maps per head (Walmer et al. 2023, "Teaching Matters", §4.1-4.2, Fig. 2, 3, 14, 17, 18).

Two measures on the attention probabilities ``A = blocks.i.attn_probs`` [B, H, T, T] of every block, with ``p`` prefix
tokens (CLS, registers) first and the N = gh * gw spatial tokens after them in row-major grid order (as timm lays out
patches). Everything is accumulated in float64 as sums over images (and queries), so 1 and N processes agree.

Shared by the ``cls_attention`` and ``aligned_attention`` measures (analysis/measures/): input checks, the
per-block float64 sums reduced over processes (:class:`BlockSums`), entropy and the map-grid figure.
"""

from __future__ import annotations

import re

import numpy as np
import torch
from torch import Tensor

from analysis.engine.figures import grid_labels, subplots, wrap
from analysis.engine.measure import Context, Measure
from analysis.engine.reduce import all_reduce_tree

_CHUNK_ELEMENTS = 1 << 22  # float64 elements of attention converted at a time (32 MiB)


def check(attn: Tensor, grid: tuple[int, int], num_prefix_tokens: int) -> None:
    if attn.ndim != 4 or attn.shape[-1] != attn.shape[-2]:
        raise ValueError(f"attn must be [B, H, T, T], got shape {tuple(attn.shape)}")
    expected = num_prefix_tokens + grid[0] * grid[1]
    if attn.shape[-1] != expected:
        raise ValueError(
            f"attn has T={attn.shape[-1]} tokens, expected {num_prefix_tokens} prefix + {grid[0]}x{grid[1]} = "
            f"{expected}"
        )


def block_label(name: str, i: int) -> str:
    m = re.search(r"(\d+)$", str(name))
    return f"block{int(m.group(1)) if m else i:02d}"


def renormalise(rows: Tensor) -> tuple[Tensor, Tensor]:
    """Rows [..., N] (float64) divided by their sums; rows with no mass become 0. Returns (rows, valid [...])."""
    mass = rows.sum(-1, keepdim=True)
    valid = mass > 0
    return torch.where(
        valid, rows / torch.where(valid, mass, torch.ones_like(mass)), torch.zeros_like(rows)
    ), valid.squeeze(-1)


def entropy(p: Tensor) -> Tensor:
    """Shannon entropy (nats) over the last axis, 0 log 0 = 0."""
    p = p.double()
    return -torch.where(p > 0, p * p.clamp_min(1e-300).log(), torch.zeros_like(p)).sum(-1)


class BlockSums(Measure):
    """Shared state of the attention-map measures: per block a dict of float64 sums over images (from ``_sums``
    on each block's ``attn_probs``), added per minibatch and summed over processes in one packed all-reduce."""

    chunkable = True  # sums over images: a minibatch may come in chunks

    def __init__(self, ctx: Context, opts=None):
        super().__init__(ctx, opts)
        self.blocks = list(ctx.blocks)
        self.grid = tuple(int(g) for g in ctx.grid)
        self.prefix = int(ctx.prefix)
        self.sums: list[dict[str, Tensor]] | None = None

    def taps(self) -> set[str]:
        return {f"{b}.attn_probs" for b in self.blocks}

    def _sums(self, attn: Tensor) -> dict[str, Tensor]:
        raise NotImplementedError

    @torch.no_grad()
    def update(self, j: int, cap: dict[str, Tensor], x: Tensor, y: Tensor) -> None:
        new = []
        for b in self.blocks:
            a = cap[f"{b}.attn_probs"]
            check(a, self.grid, self.prefix)
            new.append(self._sums(a))
        if self.sums is None:
            self.sums = new
        else:
            for acc, s in zip(self.sums, new):
                for k in acc:
                    acc[k] += s[k]

    def _reduced(self) -> dict[str, Tensor]:
        """{key: [L, ...]} summed over minibatches and processes."""
        stacked = None if self.sums is None else {k: torch.stack([s[k] for s in self.sums]) for k in self.sums[0]}
        out = all_reduce_tree(stacked, self.ctx.accelerator)  # a process without minibatches adds zeros
        if out is None:
            raise RuntimeError(f"{self.name}: finish() before any update()")
        return {k: v.cpu() for k, v in out.items()}


def map_grid(
    maps: np.ndarray,
    blocks: list[str],
    title: str,
    marked: np.ndarray | None = None,
    peaks: np.ndarray | None = None,
    midlines: bool = False,
    shared: bool = True,
    scale_label: str = "attention weight",
    cell: tuple[str, str] = ("key patch column", "key patch row"),
    uniform: float | None = None,
):
    """Grid of maps [L, H, h, w]: rows are blocks, columns heads (Walmer Fig. 2, 3, 17, 18). ``shared``: one colour
    scale from 0 to the largest value of any map, shown by a colourbar labelled ``scale_label``, so panels compare;
    otherwise each map divided by its own maximum, on one colourbar from 0 to 1 (the map's maximum). ``marked`` [L, H]
    heads get a red frame and their ``peaks`` offset as title; ``midlines`` draws the canvas centre lines (Walmer's red
    mid-lines). ``cell``: what x and y are inside one map, said with the rows (blocks, from 0) and columns (heads);
    ``uniform``: uniform attention's weight, marked on a shared colourbar."""
    m = np.asarray(maps, dtype=float)
    if not shared:
        top = np.nanmax(np.where(np.isfinite(m), m, np.nan), axis=(2, 3), keepdims=True) if np.isfinite(m).any() else 1
        m = m / np.where(np.isfinite(top) & (top > 0), top, 1.0)
    n_l, n_h = m.shape[:2]
    size = min(1.1, 14.0 / max(n_l, n_h))
    fig, axes = subplots(
        n_l,
        n_h,
        figsize=(1.5 + size * n_h, 1.3 + size * n_l),
        squeeze=False,
        layout="constrained",
    )
    top_all = float(np.nanmax(m)) if np.isfinite(m).any() else 1.0
    im = None
    for i in range(n_l):
        for h in range(n_h):
            ax = axes[i, h]
            top = top_all if shared else 1.0
            im = ax.imshow(m[i, h], cmap="viridis", interpolation="nearest", vmin=0.0, vmax=top if top > 0 else 1.0)
            ax.set_xticks([])
            ax.set_yticks([])
            if midlines:
                ax.axhline((m.shape[2] - 1) / 2, color="red", lw=0.4, alpha=0.6)
                ax.axvline((m.shape[3] - 1) / 2, color="red", lw=0.4, alpha=0.6)
            if marked is not None and marked[i, h]:
                for s in ax.spines.values():
                    s.set_edgecolor("red")
                    s.set_linewidth(2.0)
                if peaks is not None:
                    ax.set_title(f"({int(peaks[i, h, 0]):+d},{int(peaks[i, h, 1]):+d})", fontsize=6, color="red", pad=1)
            if h == 0:
                ax.set_ylabel(block_label(blocks[i], i), fontsize=6)
            if i == n_l - 1:
                ax.set_xlabel(f"head {h}", fontsize=6)
    if im is not None:
        cb = fig.colorbar(im, ax=axes.ravel().tolist(), shrink=min(1.0, 0.4 + 0.1 * n_l), aspect=30)
        cb.set_label(scale_label if shared else f"{scale_label}\n/ the map's maximum", fontsize=7)
        cb.ax.tick_params(labelsize=6)
        if shared and uniform is not None and 0 < uniform <= top_all:
            cb.ax.axhline(uniform, color="white", lw=1.2, ls=":")
            cb.ax.text(
                -0.3, uniform, "uniform", transform=cb.ax.get_yaxis_transform(), ha="right", va="center", fontsize=6
            )
    grid_labels(fig, f"columns: heads; in each map: {cell[0]}", f"rows: blocks (0 = first); in each map: {cell[1]}", 6)
    chars = max(30, int(fig.get_figwidth() * 72 / (8 * 0.55)))  # characters of 8-pt text across the figure
    fig.suptitle("\n".join(wrap(line, chars) for line in title.split("\n")), fontsize=8)
    return fig
