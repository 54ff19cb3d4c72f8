"""Figures of the analyses (matplotlib, Agg backend): each function returns a Figure for TensorBoard's
``add_figure`` and for PNG files.

Figures are made with :func:`subplots`, not ``pyplot``: a ``Figure`` with its own Agg canvas and no entry in pyplot's
global registry, so figures can be drawn in a background thread while the main thread trains (the training-time callback
renders them off the training path, analysis/frontends/callbacks.py) and nothing needs closing."""

from __future__ import annotations

import os
import re
import textwrap
import threading

import matplotlib

matplotlib.use("Agg")
import matplotlib.image
import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure


def subplots(nrows: int = 1, ncols: int = 1, figsize=None, layout=None, **kw):
    """``(fig, axes)`` as ``pyplot.subplots`` gives them, on a pyplot-free Figure with an Agg canvas (module
    docstring); ``layout="constrained"`` keeps labels, legends and colourbars inside the figure."""
    fig = Figure(figsize=figsize, layout=layout)
    FigureCanvasAgg(fig)
    return fig, fig.subplots(nrows, ncols, **kw)


BLOCK_AXIS = "block (0 = first)"  # one block numbering everywhere: from 0, as in TensorBoard tags, tables and reports
RATIO_LABEL = "norm ratio ||z|| / ||f(z)||\n(skip / branch, unitless, log scale)"
MAX_TICK_LABELS = 40  # layer names per axis that 6-pt labels fit on a 4-inch axis; more: every n-th, said


def layer_ticks(ax, labels: list[str], axis: str = "x", fontsize: float = 6) -> int:
    """Every layer's name on ``axis`` when at most :data:`MAX_TICK_LABELS`, else every n-th (returned: n)."""
    step = max(1, -(-len(labels) // MAX_TICK_LABELS))
    pos, names = range(0, len(labels), step), labels[::step]
    if axis == "x":
        ax.set_xticks(pos, names, rotation=90, fontsize=fontsize)
    else:
        ax.set_yticks(pos, names, fontsize=fontsize)
    return step


def every_nth(step: int) -> str:
    """`` (every n-th labelled)`` for an axis label when only every ``step``-th layer is named, else ``''``."""
    return "" if step == 1 else f" (every {step}{'nd' if step == 2 else 'rd' if step == 3 else 'th'} labelled)"


def cka_heatmap(
    m: np.ndarray,
    xlabels: list[str],
    ylabels: list[str] | None = None,
    title: str = "CKA",
    xname: str = "layer",
    yname: str = "layer",
):
    """Raghu Fig. 1/2/8: CKA between every pair of layers (origin bottom-left, as in the paper), a colourbar from 0 to
    1, every layer named on both axes (every n-th beyond :data:`MAX_TICK_LABELS`, said in the axis label)."""
    fig, ax = subplots(figsize=(5.2, 4.6), layout="constrained")
    im = ax.imshow(np.asarray(m), origin="lower", vmin=0, vmax=1, cmap="magma", aspect="auto")
    fig.colorbar(im, ax=ax, fraction=0.046).set_label("CKA")
    ylabels = ylabels if ylabels is not None else xlabels
    sx, sy = layer_ticks(ax, xlabels, "x"), layer_ticks(ax, ylabels, "y")
    ax.set_xlabel(xname + every_nth(sx))
    ax.set_ylabel(yname + every_nth(sy))
    ax.set_title(title, fontsize=9)
    return fig


def norm_ratio_heatmap(ratio: np.ndarray, blocks: list[str], title: str, max_tokens: int = 16, has_cls: bool = True):
    """Raghu Fig. 7 left / E.1: ||z|| / ||f(z)|| per token (rows; token 0 = CLS) and block (columns), log colour.
    Only the first ``max_tokens`` tokens are drawn; when there are more, the title and the token axis say which
    (``tokens 0-15 of 257``)."""
    n = np.asarray(ratio).shape[1]
    r = np.asarray(ratio)[:, :max_tokens].T  # [tokens, blocks]
    shown = f"tokens 0-{len(r) - 1} of {n}" if n > max_tokens else ""
    title = f"{title}, {shown}" if shown else title
    fig, ax = subplots(figsize=(5, 4))
    im = ax.imshow(np.log10(np.maximum(r, 1e-6)), origin="upper", aspect="auto", cmap="viridis")
    cb = fig.colorbar(im, ax=ax, fraction=0.046)
    cb.set_label("log10 norm ratio ||z|| / ||f(z)||")
    ax.set_xticks(range(len(blocks)), blocks, rotation=90, fontsize=6)
    ax.set_ylabel(f"{shown or 'token'} (0 = CLS)" if has_cls else shown or "token")
    ax.set_xlabel(BLOCK_AXIS)
    ax.set_title(title)
    fig.tight_layout()
    return fig


def _depth_axis(ax, labels: list[str], xlabel: str, ylabel: str, ylim=None) -> None:
    """Layer or block names on x in forward order (at most ~12 shown, rotated), axis labels and y limits."""
    step = max(1, len(labels) // 12)
    ax.set_xticks(range(0, len(labels), step), labels[::step], rotation=90, fontsize=6)
    if ylim is not None:
        ax.set_ylim(*ylim)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)


def finish_block_axes(
    fig, ax, blocks: list[str], ylabel: str, title: str, ylim=None, legend_size: int = 7, legend: bool = True
):
    """The common end of a per-block line figure: block names on x (at most ~12 shown), labels, legend (``legend``:
    on the axes; else the caller draws one for the figure), title."""
    _depth_axis(ax, blocks, BLOCK_AXIS, ylabel, ylim)
    if legend:
        ax.legend(fontsize=legend_size)
    ax.set_title(title)
    if fig.get_layout_engine() is None:
        fig.tight_layout()
    return fig


def ratio_one(ax) -> None:
    """The norm ratio 1 (skip path and branch equally large), dotted: above it the skip path dominates."""
    ax.axhline(1.0, color="k", ls=":", lw=1, label="ratio 1 (skip = branch)")


def norm_ratio_axes(ax, curves: dict[str, np.ndarray], legend_size: float = 7) -> None:
    """Norm-ratio curves on ``ax`` (log y, integer blocks from 0), the ratio-1 line, labels and legend."""
    for name, v in curves.items():
        ax.plot(range(len(v)), v, marker="o", ms=3, label=name)
    ratio_one(ax)
    ax.set_yscale("log")
    n = max((len(v) for v in curves.values()), default=0)
    ax.set_xticks(range(0, n, max(1, n // 12)))
    ax.set_xlabel(BLOCK_AXIS)
    ax.set_ylabel(RATIO_LABEL, fontsize=8)
    ax.legend(fontsize=legend_size)


def norm_ratio_lines(curves: dict[str, np.ndarray], title: str = "norm ratio ||z|| / ||f(z)||"):
    """Raghu Fig. 7 right: norm ratio per block, e.g. {'attn CLS': [...], 'attn spatial': [...], ...}."""
    fig, ax = subplots(figsize=(5, 3.5))
    norm_ratio_axes(ax, curves)
    ax.set_title(title)
    fig.tight_layout()
    return fig


def uniform_line(ax, uniform: float | None, unit: str = "px") -> None:
    """The mean attention distance of a head attending uniformly over the token grid, dotted (ViT Fig. 7 right and
    Raghu Fig. 3 show the range up to it: distances near it are global heads, far below it local ones); labelled
    with three significant digits (14.4 px, 0.521 on Walmer's unit square)."""
    if uniform is not None and np.isfinite(uniform):
        ax.axhline(
            uniform, color="k", ls=":", lw=1, label=f"uniform attention ({uniform:.3g}{' ' + unit if unit else ''})"
        )


def head_dots(ax, d: np.ndarray, s: float = 12, legend: bool = True):
    """One dot per head at each block, coloured by head: a legend of the heads up to 10 (tab10), else a colourbar
    (viridis, returned) since more colours than ten cannot be told apart by name."""
    n_heads = d.shape[1]
    x = np.arange(d.shape[0])
    if n_heads <= 10:
        for h in range(n_heads):
            ax.scatter(x, d[:, h], s=s, color=matplotlib.colormaps["tab10"](h), label=f"head {h}")
        return None
    hs = np.broadcast_to(np.arange(n_heads), d.shape)
    return ax.scatter(np.repeat(x, n_heads), d.reshape(-1), s=s, c=hs.reshape(-1), cmap="viridis")


def attention_distance_plot(
    dist: np.ndarray, title: str = "mean attention distance", unit: str = "pixels", uniform: float | None = None
):
    """Raghu Fig. 3 / ViT Fig. 7 right: one dot per head at each block (heads named in a legend, or a colourbar beyond
    ten heads), and ``uniform`` attention's distance on the same grid as a dotted reference line."""
    d = np.asarray(dist, dtype=float)  # [blocks, heads]
    fig, ax = subplots(figsize=(6, 3.8), layout="constrained")
    sc = head_dots(ax, d)
    uniform_line(ax, uniform, "px" if unit.startswith("pixels") else "")
    top = max([float(np.nanmax(d)) if np.isfinite(d).any() else 1.0, uniform or 0.0])
    ax.set_ylim(0, 1.08 * top)
    ax.set_xticks(range(d.shape[0]))
    ax.set_xlabel(BLOCK_AXIS)
    ax.set_ylabel(f"mean attention distance\n({unit})", fontsize=9)
    if sc is not None:
        fig.colorbar(sc, ax=ax, fraction=0.046).set_label("head")
    ax.legend(fontsize=6, loc="upper left", bbox_to_anchor=(1.02, 1.0), borderaxespad=0)
    ax.set_title(title, fontsize=9)
    return fig


def attention_distance_panels(
    panels: dict[str, tuple[np.ndarray, float]],
    threshold: float | None = None,
    title: str = "mean attention distance per head",
    unit: str = "pixels",
):
    """Raghu Fig. 3 / Fig. 4 (ViT Fig. 7 right) for several runs: one panel per run ``{title: (dist [blocks, heads],
    uniform)}``, x = block (from 0), y = each head's mean attention distance (one dot per head, coloured by head),
    dotted line = uniform attention's distance on the run's grid, dashed = ``threshold`` x uniform when given."""
    n = max(1, len(panels))
    cols = min(4, n)
    rows = (n + cols - 1) // cols
    fig, axes = subplots(rows, cols, figsize=(3.4 * cols, 2.9 * rows), squeeze=False)
    for ax in axes.flat[len(panels) :]:
        ax.axis("off")
    for i, (ax, (name, (dist, uniform))) in enumerate(zip(axes.flat, panels.items())):
        d = np.asarray(dist, dtype=float)
        head_dots(ax, d, s=10)
        uniform_line(ax, uniform, "")
        if threshold is not None and uniform is not None:
            ax.axhline(threshold * uniform, color="grey", ls="--", lw=1, label=f"{threshold:g} x uniform")
        ax.set_xticks(range(d.shape[0]))
        top = float(np.nanmax(d)) if np.isfinite(d).any() else 1.0
        ax.set_ylim(0, max(1.15 * (uniform or 0.0), 1.05 * top))
        ax.set_xlabel(BLOCK_AXIS)
        ax.set_ylabel(f"mean distance ({unit})", fontsize=8)
        ax.set_title(name, fontsize=8)
        if i == 0:
            ax.legend(fontsize=6, loc="best")
    fig.suptitle(textwrap.fill(title, int(16 * 3.4 * cols)), fontsize=9)
    fig.tight_layout()
    return fig


def layer_lines(panels: dict[str, tuple[list[str], dict[str, np.ndarray]]], ylabel: str, title: str, ylim=(0, 1.02)):
    """One panel per model ``{name: (layer labels, {curve: values per layer})}``: the curves against the layers in
    forward order (at most ~12 labels shown), e.g. a layer's CKA with the pixels and with its random initialisation."""
    n = max(1, len(panels))
    fig, axes = subplots(1, n, figsize=(4.4 * n, 3.4), squeeze=False)
    for ax, (name, (labels, curves)) in zip(axes[0], panels.items()):
        for curve, v in curves.items():
            ax.plot(range(len(v)), v, marker="o", ms=2, lw=1, label=curve)
        _depth_axis(ax, labels, "layer", ylabel, ylim)
        ax.set_title(name, fontsize=8)
        ax.legend(fontsize=6)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    return fig


def probe_plot(
    curves: dict[str, tuple[np.ndarray, np.ndarray]], title: str = "10-shot linear probe", chance: float | None = None
):
    """Raghu Fig. 11 right / 13: probe top-1 vs normalised depth; curves {name: (mean, std)}."""
    fig, ax = subplots(figsize=(5, 3.5))
    for name, (mean, std) in curves.items():
        x = np.linspace(0, 1, len(mean)) if len(mean) > 1 else np.array([1.0])
        ax.errorbar(x, mean, yerr=std, marker="o", ms=3, capsize=2, label=name)
    if chance is not None:
        ax.axhline(chance, color="grey", ls=":", lw=1, label="chance")
    ax.set_xlabel("normalised depth")
    ax.set_ylabel("top-1")
    ax.set_ylim(0, 1)
    ax.legend(fontsize=7)
    ax.set_title(title)
    fig.tight_layout()
    return fig


def depth_plot(panels: dict[str, tuple[np.ndarray, np.ndarray]], pools: list[str], title: str, ylim=None):
    """One panel per metric: value [P, L] vs normalised depth per pool (solid), the Gaussian baseline dashed in the
    same colour (Walmer Fig. 7 / Fig. 9 style). Used by k-NN and clustering."""
    fig, axes = subplots(1, len(panels), figsize=(4.2 * len(panels), 3.4), squeeze=False)
    for ax, (metric, (vals, base)) in zip(axes[0], panels.items()):
        for p, pool in enumerate(pools):
            n = vals.shape[1]
            x = np.linspace(0, 1, n) if n > 1 else np.array([1.0])
            (line,) = ax.plot(x, vals[p], marker="o", ms=3, label=pool)
            ax.plot(x, base[p], ls="--", lw=1, color=line.get_color(), label=f"{pool} (Gaussian)")
        ax.set_xlabel("normalised depth")
        ax.set_ylabel(metric)
        if ylim is not None:
            ax.set_ylim(*ylim)
        ax.legend(fontsize=6)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    return fig


def wrap(text: str, width: int) -> str:
    """``text`` in lines of at most ``width`` characters, never breaking "step 600" or "block 3" (a number stays with
    the word before it)."""
    glued = re.sub(r"\b(step|block|head|token|tokens|of) (\d)", "\\1\u00a0\\2", text)  # textwrap splits on ASCII
    return textwrap.fill(glued, width).replace("\u00a0", " ")  # whitespace only


def grid_labels(fig, x: str, y: str, fontsize: float = 7) -> None:
    """One x and one y label for a grid of small multiples (what the rows, the columns and each panel's axes are),
    wrapped to the figure's width and height."""
    w, h = fig.get_size_inches()
    fig.supxlabel(wrap(x, max(20, int(w * 72 / (fontsize * 0.6)))), fontsize=fontsize)
    fig.supylabel(wrap(y, max(20, int(h * 72 / (fontsize * 0.6)))), fontsize=fontsize)


def save(fig, path) -> None:
    fig.savefig(path, dpi=110)


def render(fig, dpi: int = 110) -> np.ndarray:
    """The figure drawn ONCE into an RGB uint8 array [H, W, 3] (for both the PNG file and TensorBoard)."""
    fig.set_dpi(dpi)
    canvas = fig.canvas if isinstance(fig.canvas, FigureCanvasAgg) else FigureCanvasAgg(fig)
    canvas.draw()
    return np.asarray(canvas.buffer_rgba())[..., :3].copy()


def write_png(rgb: np.ndarray, path) -> None:
    """An RGB array (from :func:`render`) as a PNG file, written atomically."""
    path = str(path)
    tmp = f"{path[:-4]}.{os.getpid()}-{threading.get_ident()}.tmp.png"  # unique: two analyses may draw one folder
    try:
        matplotlib.image.imsave(tmp, rgb)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
