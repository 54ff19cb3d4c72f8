"""Average attention maps per head (Walmer et al. 2023, "Teaching Matters", §4.1-4.2, Fig. 2, 3, 14, 17, 18).

Two measures on the attention probabilities ``A = blocks.i.attn_probs`` [B, H, T, T] of every block, with ``p`` prefix
tokens (CLS, registers) first and the N = gh * gw spatial tokens after them in row-major grid order (as timm lays out
patches). Everything is accumulated in float64 as sums over images (and queries), so 1 and N processes agree.

``cls_attention`` -- average CLS attention maps (Walmer Fig. 2 / 17), ViTs with a class token only.
    For image b, head h, the CLS query's row over the SPATIAL keys, prefix columns dropped and the row renormalised:

        c[b, h, k] = A[b, h, 0, p + k] / sum_{k'} A[b, h, 0, p + k'],   k = 0 .. N-1

    reshaped to the token grid. ``maps`` [L, H, gh, gw] is the mean of c over images. Walmer's code
    (vit_analysis, ``AvgAttentionOnToken(mode='cls')`` + ``token_plot``) averages the raw row A[b, h, 0, :] and drops
    the CLS entry only when drawing, WITHOUT renormalising; that version is kept as ``maps_raw`` (mean of
    A[b, h, 0, p + k]) together with ``prefix_mass`` (mean of the CLS row's mass on prefix tokens, 1 - sum(maps_raw)).
    The two differ by the per-image factor 1 / (1 - prefix mass). Entropies (nats, 0 log 0 = 0):
    ``entropy`` [L, H] = mean over images of H(c[b, h]) (how peaked one image's CLS attention is);
    ``map_entropy`` [L, H] = H(maps[l, h]) (how spread the AVERAGE map is; low for a head that looks at the same
    place in every image, e.g. the "sparse repeating patterns" of Walmer §4.1). Both are at most log N
    (``max_entropy``). An image whose CLS row has no spatial mass (only with hand-built attention) is left out.

``aligned_attention`` -- Aligned Aggregated Attention Maps, AAAM (Walmer §4.2, Fig. 3, 14, 18) and offset local heads.
    Every spatial query q at grid (r, c) keeps its row over the spatial keys, renormalised (prefix tokens dropped as
    queries and as keys, as Walmer's ``AvgAlignedAttentionOnToken``):

        a[b, h, q, k] = A[b, h, p + q, p + k] / sum_{k'} A[b, h, p + q, p + k']

    and places it on a (2gh-1) x (2gw-1) canvas centred on the query: key k at (r', c') goes to canvas cell
    (gh-1 + r'-r, gw-1 + c'-c), i.e. the cell of offset (dr, dc) = (r'-r, c'-c). Two normalisations of the canvas
    summed over queries and images:

    ``maps``       sum / (number of (query, image) pairs that can SEE that offset). An offset (dr, dc) exists for
                   (gh-|dr|) (gw-|dc|) of the queries (``coverage``), so edge offsets are seen by few. ``maps`` is
                   the mean attention a key at that offset gets, over the queries that have one: uniform attention
                   gives a flat map (1/N everywhere), with no pyramid from the canvas geometry. Peaks are found here.
    ``mass_maps``  sum / (number of (query, image) pairs), Walmer's normalisation (his code divides by the number of
                   queries; up to his constant batch-size factor): the mean over queries of the attention mass at
                   each offset. Each head's map sums to 1, so window masses are shares of the attention.

    Offset local heads (Walmer §4.2 / App. C.1: "heads that attend locally, but to a point or region offset from the
    current token"; Fig. 14 shows peaks one or two tokens from the centre), made precise as:

    ``peak_offset`` [L, H, 2]  (dr, dc) of the maximum of ``maps`` (ties within a relative 1e-6 of the max go to the
                               cell nearest the centre: Chebyshev, then Euclidean distance, then row-major order);
    ``peak_mass``   [L, H]     share of the attention mass in the (2w+1) x (2w+1) window of ``mass_maps`` around the
                               peak (w = ``window``, default 1: the 3x3 neighbourhood), clipped at the canvas border;
    ``local``       [L, H]     max(|dr|, |dc|) <= ``max_offset`` (default 2) and peak_mass >= ``min_mass`` (default
                               0.5): at least half of the attention, on average over queries, lands within one token
                               of a point at most two tokens away (uniform attention on a 7x7 grid puts <= 9/49 in
                               any 3x3 window, a strict local head ~1);
    ``offset_local`` [L, H]    local and peak_offset != (0, 0).

    The thresholds are arguments of :func:`offset_local_heads`, which also re-classifies a saved result. A query with no
    spatial mass (only with hand-built attention) is left out, from the sums and from the counts.
"""
from __future__ import annotations

import math
import re

import numpy as np
import torch
from torch import Tensor

from analysis.measure import Context, Measure, as_list, register
from analysis.reduce import all_reduce_sum

_CHUNK_ELEMENTS = 1 << 22  # float64 elements of attention converted at a time (32 MiB)
PEAK_RTOL = 1e-6
MAX_OFFSET = 2
MIN_MASS = 0.5
WINDOW = 1


def _check(attn: Tensor, grid: tuple[int, int], num_prefix_tokens: int) -> None:
    if attn.ndim != 4 or attn.shape[-1] != attn.shape[-2]:
        raise ValueError(f"attn must be [B, H, T, T], got shape {tuple(attn.shape)}")
    expected = num_prefix_tokens + grid[0] * grid[1]
    if attn.shape[-1] != expected:
        raise ValueError(f"attn has T={attn.shape[-1]} tokens, expected {num_prefix_tokens} prefix + {grid[0]}x{grid[1]} = {expected}")


def _block_label(name: str, i: int) -> str:
    m = re.search(r"(\d+)$", str(name))
    return f"block{int(m.group(1)) if m else i:02d}"


def _renormalise(rows: Tensor) -> tuple[Tensor, Tensor]:
    """Rows [..., N] (float64) divided by their sums; rows with no mass become 0. Returns (rows, valid [...])."""
    mass = rows.sum(-1, keepdim=True)
    valid = mass > 0
    return torch.where(valid, rows / torch.where(valid, mass, torch.ones_like(mass)), torch.zeros_like(rows)), valid.squeeze(-1)


def entropy(p: Tensor) -> Tensor:
    """Shannon entropy (nats) over the last axis, 0 log 0 = 0."""
    p = p.double()
    return -torch.where(p > 0, p * p.clamp_min(1e-300).log(), torch.zeros_like(p)).sum(-1)


# ---------------------------------------------------------------------------------------------------------------
# 1. CLS attention maps
# ---------------------------------------------------------------------------------------------------------------

def cls_attention_sums(attn: Tensor, num_prefix_tokens: int) -> dict[str, Tensor]:
    """Per-head sums over the images of ``attn`` [B, H, T, T] (float64, on attn's device): ``rows`` [H, N] of the
    renormalised CLS row over spatial keys, ``raw`` [H, N] of the raw row, ``prefix`` [H] of the CLS row's prefix mass,
    ``entropy`` [H] of the per-image entropies, ``count`` [H] of images with spatial mass (``raw``/``prefix`` count
    every image: ``images``)."""
    p = num_prefix_tokens
    if p < 1:
        raise ValueError("CLS attention needs a class token (num_prefix_tokens >= 1)")
    raw = attn[:, :, 0, :].double()  # [B, H, T]
    rows, valid = _renormalise(raw[..., p:])
    return {"rows": rows.sum(0), "raw": raw[..., p:].sum(0), "prefix": raw[..., :p].sum((0, 2)),
            "entropy": torch.where(valid, entropy(rows), torch.zeros_like(valid, dtype=torch.float64)).sum(0),
            "count": valid.sum(0).double(), "images": torch.full((attn.shape[1],), float(attn.shape[0]), dtype=torch.float64, device=attn.device)}


def cls_attention_maps(attn: Tensor, grid: tuple[int, int], num_prefix_tokens: int = 1) -> dict[str, Tensor]:
    """The definition on one set of images (module docstring): ``maps`` [H, gh, gw], ``maps_raw`` [H, gh, gw],
    ``prefix_mass`` [H], ``entropy`` [H] (mean per-image entropy), ``map_entropy`` [H] (entropy of ``maps``)."""
    _check(attn, grid, num_prefix_tokens)
    s = cls_attention_sums(attn.detach(), num_prefix_tokens)
    return {k: v[0] for k, v in _cls_finish({k: v[None] for k, v in s.items()}, grid).items()}


def _cls_finish(s: dict[str, Tensor], grid: tuple[int, int]) -> dict[str, Tensor]:
    """Sums with a leading block axis [L, H, ...] -> means."""
    count, images = s["count"], s["images"]
    maps = s["rows"] / count[..., None]
    lead = maps.shape[:-1]
    return {"maps": maps.reshape(*lead, *grid), "maps_raw": (s["raw"] / images[..., None]).reshape(*lead, *grid),
            "prefix_mass": s["prefix"] / images, "entropy": s["entropy"] / count, "map_entropy": entropy(maps)}


class _BlockSums(Measure):
    """Shared state of the attention-map measures: per block a dict of float64 sums over images (from ``_sums``
    on each block's ``attn_probs``), added per minibatch and summed over processes in one packed all-reduce."""

    def __init__(self, ctx: Context):
        super().__init__(ctx)
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
            _check(a, self.grid, self.prefix)
            new.append(self._sums(a))
        if self.sums is None:
            self.sums = new
        else:
            for acc, s in zip(self.sums, new):
                for k in acc:
                    acc[k] += s[k]

    def _reduced(self) -> dict[str, Tensor]:
        """{key: [L, ...]} summed over minibatches and processes."""
        if self.sums is None:
            raise RuntimeError(f"{self.name}: finish() before any update()")
        keys = list(self.sums[0])
        stacked = {k: torch.stack([s[k] for s in self.sums]) for k in keys}
        flat = all_reduce_sum(torch.cat([stacked[k].reshape(-1) for k in keys]), self.ctx.accelerator).cpu()
        out, off = {}, 0
        for k in keys:
            n = stacked[k].numel()
            out[k] = flat[off:off + n].reshape(stacked[k].shape)
            off += n
        return out


@register
class ClsAttention(_BlockSums):
    """Average CLS attention map of every head of every block (Walmer et al. 2023 §4.1, Fig. 2 and 17).

    ``maps`` [L, H, gh, gw]: mean over images of the CLS query's attention over the spatial keys, prefix (CLS,
    register) columns dropped and the row renormalised to sum to 1 (Walmer does not renormalise: his version is
    ``maps_raw``). Also ``maps_raw`` [L, H, gh, gw], ``prefix_mass`` [L, H], ``entropy`` [L, H] (mean per-image entropy
    of the renormalised row, nats), ``map_entropy`` [L, H] (entropy of the average map), ``max_entropy`` (log N),
    ``blocks`` [L], ``grid`` [2], ``n_images``. Only for ViTs with a class token. Exact definitions: module docstring.
    """

    name = "cls_attention"

    @classmethod
    def applies(cls, ctx: Context) -> bool:
        return ctx.arch == "vit" and ctx.prefix >= 1 and ctx.grid is not None and bool(getattr(ctx.model, "has_class_token", True))

    def _sums(self, attn: Tensor) -> dict[str, Tensor]:
        return cls_attention_sums(attn, self.prefix)

    def finish(self) -> dict:
        out = self._reduced()
        res = _cls_finish(out, self.grid)
        r = {k: v.numpy() for k, v in res.items()}
        r.update(max_entropy=float(math.log(self.grid[0] * self.grid[1])), blocks=list(self.blocks),
                 grid=np.array(self.grid), n_images=int(out["images"][0, 0].item()))
        return r

    @staticmethod
    def summary(r: dict) -> dict:
        blocks = as_list(r["blocks"])
        ent, ment = np.asarray(r["entropy"]), np.asarray(r["map_entropy"])
        return {"max_entropy": float(r["max_entropy"]), "n_images": int(r["n_images"]),
                "entropy_per_block": {_block_label(b, i): float(ent[i].mean()) for i, b in enumerate(blocks)},
                "map_entropy_per_block": {_block_label(b, i): float(ment[i].mean()) for i, b in enumerate(blocks)},
                "prefix_mass_per_block": {_block_label(b, i): float(np.asarray(r["prefix_mass"])[i].mean()) for i, b in enumerate(blocks)}}

    @staticmethod
    def scalars(r: dict) -> dict[str, float]:
        blocks = as_list(r["blocks"])
        ent, ment = np.asarray(r["entropy"]), np.asarray(r["map_entropy"])
        out = {}
        for i, b in enumerate(blocks):
            lab = _block_label(b, i)
            out[f"cls_attention/entropy/{lab}"] = float(ent[i].mean())
            out[f"cls_attention/map_entropy/{lab}"] = float(ment[i].mean())
        return out

    @staticmethod
    def figures(r: dict, step: int | None = None) -> dict:
        title = "average CLS attention (renormalised over spatial keys)" + (f", step {step}" if step is not None else "")
        return {"cls_attention/maps": map_grid(np.asarray(r["maps"]), as_list(r["blocks"]), title)}


# ---------------------------------------------------------------------------------------------------------------
# 2. Aligned aggregated attention maps and offset local heads
# ---------------------------------------------------------------------------------------------------------------

def canvas_index(grid: tuple[int, int]) -> Tensor:
    """[N, N] long: the flat canvas cell ((gh-1 + r'-r) * (2gw-1) + (gw-1 + c'-c)) of key k=(r', c') for query q=(r, c)."""
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


def aligned_sums(attn: Tensor, grid: tuple[int, int], num_prefix_tokens: int, index: Tensor | None = None) -> dict[str, Tensor]:
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
        rows, valid = _renormalise(part.double())  # [b, H, N, N], [b, H, N]
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
    _check(attn, grid, num_prefix_tokens)
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


def offset_local_heads(maps: np.ndarray, mass_maps: np.ndarray, max_offset: int = MAX_OFFSET, min_mass: float = MIN_MASS,
                       window: int = WINDOW) -> dict[str, np.ndarray]:
    """Classify heads from their aligned maps [..., 2gh-1, 2gw-1] (module docstring): ``peak_offset`` [..., 2] (of
    ``maps``), ``peak_mass`` [...] (share of ``mass_maps`` within ``window`` cells of the peak), ``local`` [...] bool
    (Chebyshev |peak| <= ``max_offset`` and peak_mass >= ``min_mass``), ``offset_local`` [...] bool (local, peak != 0)."""
    maps, mass_maps = np.asarray(maps, dtype=np.float64), np.asarray(mass_maps, dtype=np.float64)
    peaks = find_peaks(maps)
    rows, cols = maps.shape[-2:]
    cr, cc = (rows - 1) // 2, (cols - 1) // 2
    flat_mass = mass_maps.reshape(-1, rows, cols)
    flat_peaks = peaks.reshape(-1, 2)
    pm = np.array([m[max(0, cr + r - window):cr + r + window + 1, max(0, cc + c - window):cc + c + window + 1].sum()
                   for m, (r, c) in zip(flat_mass, flat_peaks)]).reshape(maps.shape[:-2])
    cheb = np.abs(peaks).max(-1)
    local = (cheb <= max_offset) & (pm >= min_mass)
    return {"peak_offset": peaks, "peak_mass": pm, "local": local, "offset_local": local & (cheb > 0)}


@register
class AlignedAttention(_BlockSums):
    """Aligned Aggregated Attention Maps and offset local heads (Walmer et al. 2023 §4.2, Fig. 3, 14, 18), any ViT.

    Result: ``maps`` [L, H, 2gh-1, 2gw-1] (canvas sums over spatial queries and images divided by the (query, image)
    pairs that see each offset), ``mass_maps`` [L, H, 2gh-1, 2gw-1] (divided by all pairs, Walmer's normalisation;
    sums to 1), ``coverage`` [2gh-1, 2gw-1], ``peak_offset`` [L, H, 2] (dr, dc), ``peak_mass`` [L, H], ``local`` and
    ``offset_local`` [L, H] bool, the thresholds ``max_offset``, ``min_mass``, ``window``, ``blocks``, ``grid``,
    ``n_images``. Exact definitions in the module docstring; thresholds are the class attributes below.
    """

    name = "aligned_attention"
    max_offset: int = MAX_OFFSET
    min_mass: float = MIN_MASS
    window: int = WINDOW

    def __init__(self, ctx: Context):
        super().__init__(ctx)
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
        r.update(offset_local_heads(r["maps"], r["mass_maps"], self.max_offset, self.min_mass, self.window))
        r.update(max_offset=int(self.max_offset), min_mass=float(self.min_mass), window=int(self.window), blocks=list(self.blocks),
                 grid=np.array(self.grid), n_images=int(out["images"][0, 0].item()))
        return r

    @staticmethod
    def summary(r: dict) -> dict:
        blocks = as_list(r["blocks"])
        ol, loc, peaks = np.asarray(r["offset_local"], bool), np.asarray(r["local"], bool), np.asarray(r["peak_offset"])
        heads = [f"{_block_label(blocks[i], i)}.head{h:02d} ({int(peaks[i, h, 0]):+d},{int(peaks[i, h, 1]):+d})"
                 for i, h in zip(*np.nonzero(ol))]
        return {"offset_local_count": int(ol.sum()), "local_count": int(loc.sum()), "offset_local_heads": heads,
                "offset_local_per_block": {_block_label(b, i): int(ol[i].sum()) for i, b in enumerate(blocks)},
                "thresholds": {"max_offset": int(r["max_offset"]), "min_mass": float(r["min_mass"]), "window": int(r["window"])}}

    @staticmethod
    def scalars(r: dict) -> dict[str, float]:
        blocks = as_list(r["blocks"])
        ol = np.asarray(r["offset_local"], bool)
        out = {"aligned_attention/offset_local_count": float(ol.sum()),
               "aligned_attention/local_count": float(np.asarray(r["local"], bool).sum())}
        for i, b in enumerate(blocks):
            out[f"aligned_attention/offset_local_count/{_block_label(b, i)}"] = float(ol[i].sum())
        return out

    @staticmethod
    def figures(r: dict, step: int | None = None) -> dict:
        blocks, suffix = as_list(r["blocks"]), (f", step {step}" if step is not None else "")
        mark = np.asarray(r["offset_local"], bool)
        peaks = np.asarray(r["peak_offset"])
        return {"aligned_attention/maps": map_grid(np.asarray(r["maps"]), blocks, "aligned attention (per-offset mean), red: offset local" + suffix,
                                                   marked=mark, peaks=peaks, midlines=True),
                "aligned_attention/mass_maps": map_grid(np.asarray(r["mass_maps"]), blocks,
                                                        "aligned attention (Walmer: mass share), red: offset local" + suffix,
                                                        marked=mark, peaks=peaks, midlines=True)}


# ---------------------------------------------------------------------------------------------------------------
# figures
# ---------------------------------------------------------------------------------------------------------------

def map_grid(maps: np.ndarray, blocks: list[str], title: str, marked: np.ndarray | None = None, peaks: np.ndarray | None = None,
             midlines: bool = False):
    """Grid of maps [L, H, h, w]: rows are blocks, columns heads, each map on its own colour scale from 0 to its maximum
    (Walmer Fig. 2, 3, 17, 18). ``marked`` [L, H] heads get a red frame and their ``peaks`` offset as title; ``midlines`` draws the canvas
    centre lines (Walmer's red mid-lines)."""
    from analysis.figures import plt  # pyplot with the Agg backend set

    m = np.asarray(maps)
    n_l, n_h = m.shape[:2]
    size = min(1.1, 14.0 / max(n_l, n_h))
    fig, axes = plt.subplots(n_l, n_h, figsize=(0.6 + size * n_h, 0.6 + size * n_l), squeeze=False)
    for i in range(n_l):
        for h in range(n_h):
            ax = axes[i, h]
            top = float(np.nanmax(m[i, h])) if np.isfinite(m[i, h]).any() else 1.0
            ax.imshow(m[i, h], cmap="viridis", interpolation="nearest", vmin=0.0, vmax=top if top > 0 else 1.0)
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
                ax.set_ylabel(_block_label(blocks[i], i), fontsize=6)
            if i == n_l - 1:
                ax.set_xlabel(f"head {h}", fontsize=6)
    fig.suptitle(title, fontsize=8)
    fig.tight_layout()
    return fig
