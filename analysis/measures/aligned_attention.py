"""``aligned_attention`` -- Aligned Aggregated Attention Maps, AAAM (Walmer et al. 2023 §4.2, App. C.1, Fig. 3, 14,
18) and offset local heads.

    Every spatial query q at grid (r, c) keeps its row over the spatial keys, renormalised (prefix tokens dropped as
    queries and as keys, as Walmer's ``AvgAlignedAttentionOnToken``):

        a[b, h, q, k] = A[b, h, p + q, p + k] / sum_{k'} A[b, h, p + q, p + k']

    and places it on a (2gh-1) x (2gw-1) canvas centred on the query: key k at (r', c') goes to canvas cell
    (gh-1 + r'-r, gw-1 + c'-c), i.e. the cell of offset (dr, dc) = (r'-r, c'-c) ("before averaging them, we first
    realigned them so the current spatial token is always in the center of the array", §4.2). Two normalisations of
    the canvas summed over queries and images:

    ``mass_maps``  THE ALIGNED AGGREGATED ATTENTION MAP of Walmer: sum / (number of (query, image) pairs), the mean over
                   queries of the attention at each offset (an offset a query does not have counts as 0 for it).
                   Each head's map sums to 1, so a cell is the share of the attention that goes to that offset.
                   Peaks are found here.
    ``maps``       The per-offset mean (not in Walmer): sum / (number of (query, image) pairs that can SEE that
                   offset). An offset (dr, dc) exists for only (gh-|dr|) (gw-|dc|) of the queries (``coverage``), so
                   an edge offset's value is the mean over the few queries that have one: uniform attention gives a
                   flat map (1/N everywhere, no pyramid from the canvas geometry), but a far offset that a handful of
                   edge queries look at can outweigh the offset every other query looks at. It is drawn for
                   comparison only.

    Offset local heads (Walmer §4.2 / App. C.1: "heads that attend locally, but to a point or region offset from the
    current token"; Fig. 14 shows peaks one or two tokens from the centre). Walmer finds them by eye on the maps;
    the rule below is ours (thresholds are the options):

    ``peak_mass``   [L, H]     the largest share of the attention in a (2w+1) x (2w+1) window of ``mass_maps``
                               (w = ``window``, default 1: a 3x3 neighbourhood, clipped at the canvas border) whose
                               centre is at most ``max_offset`` (default 2) tokens away (Chebyshev) from the query;
    ``peak_offset`` [L, H, 2]  (dr, dc): the map's maximum cell inside that window (Walmer: "a point or region offset
                               from the current token"; ties between windows, and between cells, within a relative 1e-6
                               go to the one nearest the query: Chebyshev, Euclidean, row-major). Not the window's
                               centre of mass: a head with 0.60 of its attention at (-2, +1) and 0.38 at (0, 0) has its
                               centre of mass rounded to (-1, +1), a cell it barely attends to;
    ``map_peak``    [L, H, 2]  the maximum cell of ``mass_maps`` itself, anywhere on the canvas;
    ``mass_centre`` [L, H, 2]  the centre of mass of ``mass_maps``, sum over cells of mass * (dr, dc), in tokens
                               (Walmer's code, ``average_att_offset``, reports it as "avg-att-offset" with the canvas
                               scaled to [-1, 1], i.e. divided by (g - 1));
    ``window_centre`` [L, H, 2] the centre of mass of that window, sum mass * (dr, dc) / peak_mass, in tokens: where
                               the region the head attends to sits;
    ``local``       [L, H]     peak_mass >= ``min_mass`` and max(|dr|, |dc|) of peak_offset <= ``max_offset``: at least
                               half of the attention, on average over queries, lands within one token of a point at
                               most two tokens away (uniform attention on a 7x7 grid puts 361/2401 = 0.15 in the central
                               3x3 window, a strict local head ~1);
    ``offset_local`` [L, H]    local, and the window's centre of mass at least half a token from the query in some
                               direction (it rounds to a cell other than (0, 0)): the region is offset from the current
                               token. A head spread evenly over the 3x3 around its own token, with a slight maximum on
                               a corner, is local but not offset (its peak cell is the corner; its region is centred
                               on the query); a head on its right neighbour is offset (region and peak at (0, +1)).

    Where the authors' code differs (github mwalmer-umd/vit_analysis, analysis/attention_metrics.py,
    ``AvgAlignedAttentionOnToken``): it divides the canvas sum by the number of (minibatch, query) pairs, not (image,
    query) pairs, so its maps are ours times the (constant) batch size; it counts a query whose row has no spatial mass
    (all attention on CLS) as a zero row, which we leave out of sums and counts (possible only with hand-built
    attention); it drops exactly one prefix token and needs a square grid. We follow the paper's definition with the
    per-pair normalisation (maps that sum to 1, comparable across batch sizes).

    The thresholds are arguments of :func:`offset_local_heads`, which also re-classifies a saved result.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from analysis.engine.measure import Context, as_list, register
from analysis.estimators.attention_maps import _CHUNK_ELEMENTS, BlockSums, block_label, check, map_grid, renormalise

PEAK_RTOL = 1e-6
MAX_OFFSET = 2
MIN_MASS = 0.5
WINDOW = 1


@dataclass(frozen=True)
class AlignedOptions:
    max_offset: int = MAX_OFFSET  # a local head's peak is at most this many tokens away (Chebyshev)
    min_mass: float = MIN_MASS  # ... and at least this share of the attention lands in the window around it
    window: int = WINDOW  # the window is (2 window + 1) tokens square


def canvas_index(grid: tuple[int, int]) -> Tensor:
    """[N, N] long: the flat canvas cell ((gh-1 + r'-r) * (2gw-1) + (gw-1 + c'-c)) of key k=(r', c') for query q=(r,
    c)."""
    gh, gw = grid
    r = torch.arange(gh).repeat_interleave(gw)
    c = torch.arange(gw).repeat(gh)
    dr = r[None, :] - r[:, None] + gh - 1
    dc = c[None, :] - c[:, None] + gw - 1
    return dr * (2 * gw - 1) + dc


def coverage(grid: tuple[int, int]) -> np.ndarray:
    """[2gh-1, 2gw-1] int: how many spatial queries have a key at each offset, (gh - |dr|) * (gw - |dc|)."""
    gh, gw = grid
    dr = gh - np.abs(np.arange(-(gh - 1), gh))
    dc = gw - np.abs(np.arange(-(gw - 1), gw))
    return (dr[:, None] * dc[None, :]).astype(np.int64)


def aligned_sums(
    attn: Tensor, grid: tuple[int, int], num_prefix_tokens: int, index: Tensor | None = None
) -> dict[str, Tensor]:
    """Per-head canvas sums over the images and spatial queries of ``attn`` [B, H, T, T] (float64, flat canvases of
    C = (2gh-1)(2gw-1) cells): ``sum`` [H, C] of the renormalised rows placed on the query-centred canvas, ``seen``
    [H, C] the number of valid (query, image) pairs that can see each offset, ``pairs`` [H] the number of valid pairs,
    ``images`` [H] the number of images."""
    p = num_prefix_tokens
    batch, heads, t, _ = attn.shape
    n = t - p
    gh, gw = grid
    cells = (2 * gh - 1) * (2 * gw - 1)
    idx = (canvas_index(grid) if index is None else index).to(attn.device)
    vis = torch.zeros(n, cells, dtype=torch.float64, device=attn.device)
    vis.scatter_(1, idx, 1.0)  # [N, C]: offsets query q can see
    total = torch.zeros(heads, n, n, dtype=torch.float64, device=attn.device)
    valid_q = torch.zeros(heads, n, dtype=torch.float64, device=attn.device)
    chunk = max(1, _CHUNK_ELEMENTS // max(1, heads * n * n))
    for part in attn[:, :, p:, p:].split(chunk, dim=0):
        rows, valid = renormalise(part.double())  # [b, H, N, N], [b, H, N]
        total += rows.sum(0)
        valid_q += valid.sum(0).double()
    s = torch.zeros(heads, cells, dtype=torch.float64, device=attn.device)
    s.index_add_(1, idx.reshape(-1), total.reshape(heads, n * n))
    images = torch.full((heads,), float(batch), dtype=torch.float64, device=attn.device)
    return {"sum": s, "seen": valid_q @ vis, "pairs": valid_q.sum(1), "images": images}


def _aligned_finish(s: dict[str, Tensor], grid: tuple[int, int]) -> tuple[Tensor, Tensor]:
    shape = (*s["sum"].shape[:-1], 2 * grid[0] - 1, 2 * grid[1] - 1)
    seen = s["seen"]
    maps = torch.where(seen > 0, s["sum"] / seen.clamp_min(1), torch.zeros_like(seen))
    mass = s["sum"] / s["pairs"][..., None]
    return maps.reshape(shape), mass.reshape(shape)


def aligned_attention_maps(attn: Tensor, grid: tuple[int, int], num_prefix_tokens: int) -> tuple[Tensor, Tensor]:
    """The definition on one set of images: ``(maps, mass_maps)``, each [H, 2gh-1, 2gw-1] float64 (module docstring):
    ``maps`` divides each canvas cell by the (query, image) pairs that see the offset, ``mass_maps`` by all pairs."""
    check(attn, grid, num_prefix_tokens)
    return _aligned_finish(aligned_sums(attn.detach(), grid, num_prefix_tokens), grid)


def find_peaks(maps: np.ndarray, rtol: float = PEAK_RTOL) -> np.ndarray:
    """[..., 2] int64 (dr, dc) of the maximum of each [..., 2gh-1, 2gw-1] canvas, relative to the centre. Cells within
    ``rtol`` of the maximum tie; ties go to the cell nearest the centre (Chebyshev, then Euclidean, then row-major)."""
    m = np.asarray(maps, dtype=np.float64)
    rows, cols = m.shape[-2:]
    dr = np.arange(rows) - (rows - 1) // 2
    dc = np.arange(cols) - (cols - 1) // 2
    cheb = np.maximum(np.abs(dr)[:, None], np.abs(dc)[None, :]).reshape(-1)
    eucl = (dr[:, None] ** 2 + dc[None, :] ** 2).reshape(-1)
    rank = np.lexsort((np.arange(rows * cols), eucl, cheb))  # cells, nearest to the centre first
    order = np.empty_like(rank)
    order[rank] = np.arange(rank.size)
    flat = m.reshape(-1, rows * cols)
    out = np.zeros((flat.shape[0], 2), dtype=np.int64)
    for i, v in enumerate(flat):
        top = v.max()
        tied = np.flatnonzero(v >= top - rtol * abs(top))
        best = tied[np.argmin(order[tied])]
        out[i] = (dr[best // cols], dc[best % cols])
    return out.reshape(*m.shape[:-2], 2)


def mass_centre(mass_maps: np.ndarray) -> np.ndarray:
    """[..., 2] float64: the centre of mass (dr, dc) in tokens of each [..., 2gh-1, 2gw-1] aligned map (rows with no
    mass give 0), ``sum mass * (dr, dc) / sum mass``; Walmer's ``average_att_offset`` up to his [-1, 1] scaling."""
    m = np.asarray(mass_maps, dtype=np.float64)
    rows, cols = m.shape[-2:]
    dr = np.arange(rows) - (rows - 1) // 2
    dc = np.arange(cols) - (cols - 1) // 2
    total = m.sum((-2, -1))
    safe = np.where(total > 0, total, 1.0)
    return np.stack([(m.sum(-1) * dr).sum(-1) / safe, (m.sum(-2) * dc).sum(-1) / safe], -1)


def window_mass(mass_maps: np.ndarray, window: int = WINDOW) -> np.ndarray:
    """[..., R, C]: the attention mass in the (2 window + 1)-square window of ``mass_maps`` around each cell (clipped
    at the canvas border), by summed-area tables."""
    m = np.asarray(mass_maps, dtype=np.float64)
    k, lead = 2 * window + 1, [(0, 0)] * (m.ndim - 2)
    c = np.pad(np.pad(m, lead + [(window, window)] * 2).cumsum(-1).cumsum(-2), lead + [(1, 0)] * 2)
    return c[..., k:, k:] - c[..., :-k, k:] - c[..., k:, :-k] + c[..., :-k, :-k]


def offset_local_heads(
    mass_maps: np.ndarray, max_offset: int = MAX_OFFSET, min_mass: float = MIN_MASS, window: int = WINDOW
) -> dict[str, np.ndarray]:
    """Classify heads from their aligned aggregated attention maps ``mass_maps`` [..., 2gh-1, 2gw-1] (Walmer's
    normalisation, module docstring), as the rule reads: "at least half of the attention, on average over queries,
    lands within one token of a point at most two tokens away". Over every point p with Chebyshev |p| <=
    ``max_offset``, the mass in the window of ``window`` cells around p (:func:`window_mass`); the best such window
    gives ``peak_mass`` [...] (its mass; ties between windows go to the centre nearest the query).
    ``local`` [...] = peak_mass >= ``min_mass`` and the peak at most ``max_offset`` away; ``peak_offset`` [..., 2] is
    the
    map's maximum cell inside that window (a head fixed on the token two to the right has it at (0, +2) even when the
    best window is centred one nearer; ties to the cell nearest the query); ``window_centre`` [..., 2] the window's
    centre of mass; ``offset_local`` = local and the window's centre of mass rounds to a cell other than (0, 0) (the
    region attended to is offset from the query; a head spread over the 3x3 around its query is not). Also
    ``map_peak`` [..., 2] (the maximum cell of the map itself, anywhere) and ``mass_centre`` [..., 2].
    (Taking the window around the map's maximum instead misses a head that spreads evenly over its neighbourhood
    with a slight corner maximum: the positive control in tests/interventions/test_positive_control.py has one.)"""
    mass_maps = np.asarray(mass_maps, dtype=np.float64)
    rows, cols = mass_maps.shape[-2:]
    dr = np.arange(rows) - (rows - 1) // 2
    dc = np.arange(cols) - (cols - 1) // 2
    near = np.maximum(np.abs(dr)[:, None], np.abs(dc)[None, :]) <= max_offset
    wm = window_mass(mass_maps, window)
    centres = find_peaks(np.where(near, wm, -np.inf)).reshape(-1, 2)
    flat = mass_maps.reshape(-1, rows, cols)
    pm, peaks, centre = np.zeros(len(flat)), np.zeros((len(flat), 2), dtype=np.int64), np.zeros((len(flat), 2))
    for i, (m, (r, c)) in enumerate(zip(flat, centres)):
        r0, r1 = max(0, (rows - 1) // 2 + r - window), (rows - 1) // 2 + r + window + 1
        c0, c1 = max(0, (cols - 1) // 2 + c - window), (cols - 1) // 2 + c + window + 1
        w = m[r0:r1, c0:c1]
        pm[i] = w.sum()
        if (
            pm[i] > 0
        ):  # the window's centre of mass (where the region sits) and its maximum cell (the point attended to)
            centre[i] = [(w.sum(1) * dr[r0:r1]).sum() / pm[i], (w.sum(0) * dc[c0:c1]).sum() / pm[i]]
            inside = np.full_like(m, -np.inf)
            inside[r0:r1, c0:c1] = w
            peaks[i] = find_peaks(inside)
    lead = mass_maps.shape[:-2]
    pm, peaks, centre = pm.reshape(lead), peaks.reshape(*lead, 2), centre.reshape(*lead, 2)
    local = (pm >= min_mass) & (np.abs(peaks).max(-1) <= max_offset)
    offset = np.abs(np.rint(centre)).max(-1) > 0
    return {
        "peak_offset": peaks,
        "peak_mass": pm,
        "window_centre": centre,
        "map_peak": find_peaks(mass_maps),
        "mass_centre": mass_centre(mass_maps),
        "local": local,
        "offset_local": local & offset,
    }


@register
class AlignedAttention(BlockSums):
    """Where each head attends relative to its query, and which heads are local around an offset.
    Aligned Aggregated Attention Maps and offset local heads (Walmer et al. 2023 §4.2, Fig. 3, 14, 18), any ViT.

    Result: ``mass_maps`` [L, H, 2gh-1, 2gw-1] (Walmer's aligned aggregated attention maps: canvas sums over spatial
    queries and images divided by all (query, image) pairs; each sums to 1), ``maps`` [L, H, 2gh-1, 2gw-1] (the
    per-offset mean: divided by the pairs that see each offset), ``coverage`` [2gh-1, 2gw-1], ``peak_offset`` [L, H, 2]
    (dr, dc) and ``peak_mass`` [L, H] (both from ``mass_maps``), ``mass_centre`` [L, H, 2], ``local`` and
    ``offset_local`` [L, H] bool, the thresholds ``max_offset``, ``min_mass``, ``window``, ``blocks``, ``grid``,
    ``n_images``. Exact definitions in the module docstring; thresholds are the options.
    """

    name = "aligned_attention"
    # 2: the local rule takes the best window centred within max_offset, not the one around the maximum;
    # 3: a head's peak is the map's maximum inside that window, not the window's rounded centre of mass
    version = 3
    Options = AlignedOptions

    def __init__(self, ctx: Context, opts=None):
        super().__init__(ctx, opts)
        self._index: dict = {}

    @classmethod
    def applies(cls, ctx: Context) -> bool:
        return ctx.arch == "vit" and ctx.grid is not None

    def _sums(self, attn: Tensor) -> dict[str, Tensor]:
        if attn.device not in self._index:
            self._index[attn.device] = canvas_index(self.grid).to(attn.device)
        return aligned_sums(attn, self.grid, self.prefix, self._index[attn.device])

    def finish(self) -> dict:
        out = self._reduced()
        maps, mass = _aligned_finish(out, self.grid)
        r = {"maps": maps.numpy(), "mass_maps": mass.numpy(), "coverage": coverage(self.grid)}
        r.update(offset_local_heads(r["mass_maps"], self.opts.max_offset, self.opts.min_mass, self.opts.window))
        r.update(
            max_offset=int(self.opts.max_offset),
            min_mass=float(self.opts.min_mass),
            window=int(self.opts.window),
            blocks=list(self.blocks),
            grid=np.array(self.grid),
            n_images=int(out["images"][0, 0].item()),
        )
        return r

    @staticmethod
    def summary(r: dict) -> dict:
        blocks = as_list(r["blocks"])
        ol, loc, peaks = np.asarray(r["offset_local"], bool), np.asarray(r["local"], bool), np.asarray(r["peak_offset"])
        pm = np.asarray(r["peak_mass"])
        heads = [
            f"{block_label(blocks[i], i)}.head{h:02d} ({int(peaks[i, h, 0]):+d},{int(peaks[i, h, 1]):+d})"
            for i, h in zip(*np.nonzero(ol))
        ]
        return {
            "offset_local_count": int(ol.sum()),
            "local_count": int(loc.sum()),
            "offset_local_heads": heads,
            "offset_local_per_block": {block_label(b, i): int(ol[i].sum()) for i, b in enumerate(blocks)},
            "peak_per_head": {
                f"{block_label(b, i)}.head{h:02d}": [
                    int(peaks[i, h, 0]),
                    int(peaks[i, h, 1]),
                    round(float(pm[i, h]), 4),
                ]
                for i, b in enumerate(blocks)
                for h in range(peaks.shape[1])
            },
            "thresholds": {
                "max_offset": int(r["max_offset"]),
                "min_mass": float(r["min_mass"]),
                "window": int(r["window"]),
            },
        }

    @staticmethod
    def scalars(r: dict) -> dict[str, float]:
        blocks = as_list(r["blocks"])
        ol = np.asarray(r["offset_local"], bool)
        out = {
            "aligned_attention/offset_local_count": float(ol.sum()),
            "aligned_attention/local_count": float(np.asarray(r["local"], bool).sum()),
        }
        for i, b in enumerate(blocks):
            out[f"aligned_attention/offset_local_count/{block_label(b, i)}"] = float(ol[i].sum())
        return out

    @staticmethod
    def figures(r: dict, step: int | None = None) -> dict:
        OFFSETS = ("key column offset dc (patches; 0 = the query's own column)", "key row offset dr (patches)")
        SCALE = ("share of the attention", "mean attention weight")
        blocks, suffix = as_list(r["blocks"]), (f", step {step}" if step is not None else "")
        mark = np.asarray(r["offset_local"], bool)
        peaks = np.asarray(r["peak_offset"])
        red = "red frame: offset local head; title: its peak (dr, dc) on the aligned aggregated map"

        def grid(key: str, title: str, scale: str):
            return map_grid(
                np.asarray(r[key]),
                blocks,
                f"{title}{suffix}\n{red}",
                marked=mark,
                peaks=peaks,
                midlines=True,
                shared=False,
                scale_label=scale,
                cell=OFFSETS,
            )

        title = "Aligned Aggregated Attention Maps (Walmer §4.2): share of the attention at each offset, mean over "
        title += "queries"
        figs = {"aligned_attention/mass_maps": grid("mass_maps", title, SCALE[0])}
        if "maps" not in r:  # a result read without them (the real-ViT report's, analysis/studies/real_vit/cached.py)
            return figs
        title = "per-offset mean over the queries that have each offset (not Walmer's map)"
        figs["aligned_attention/maps"] = grid("maps", title, SCALE[1])
        return figs
