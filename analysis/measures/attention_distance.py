"""Mean attention distance per head (ViT paper App. D.6 / Fig. 7 right and Fig. 10; Raghu et al. 2021 §4, Fig. 3;
Walmer et al. 2023 §4.3, App. C.2, Fig. 4, 15).

Common part. For one image, head h and a spatial query q (prefix tokens such as CLS or registers are dropped as
queries), keep the attention row over the SPATIAL keys only (prefix columns dropped) and renormalise it:

    A'[q, k] = A[q, k] / sum_{k' spatial} A[q, k']
    d_h(q)   = sum_{k spatial} A'[q, k] * D[q, k]

The head's attention distance is the mean of ``d_h(q)`` over spatial queries and images. Tokens are on the patch
grid in row-major order (as timm lays out patches); token (r, c) covers pixels r*P .. r*P+P-1 (rows) and
c*P .. c*P+P-1 (columns), P = patch size. Three distance matrices D, one result key each:

``pixels``       PATCH-CENTRE distance in pixels: D[q, k] = P * ||(r_q - r_k, c_q - c_k)||_2, the distance between
                 the centres of the two patches. Raghu §4 ("we weight the pixel distances by the attention weights")
                 and the common re-implementations of the ViT figure; a head that attends only to its own token gets
                 exactly 0. Raghu's code is not public.
``unit_square``  Walmer §4.3 / App. C.2 ("we normalize the distances so the token grid is embedded on a 1 x 1
                 square"), exactly as the authors' code (github mwalmer-umd/vit_analysis,
                 analysis/attention_metrics.py, ``AttentionDistance.convert_to_xy``): token (r, c) sits at
                 (r / (gh - 1), c / (gw - 1)), so the centres of the corner tokens are the corners of the unit square;
                 D is the Euclidean distance between those points. It is the patch-centre distance divided by
                 (g - 1) * P per axis (for a square grid ``pixels / ((g - 1) * P)``). An axis with a single token
                 (g = 1) has position 0.
``pixel_level``  PIXEL-LEVEL distance of the ViT paper, App. D.6 / Fig. 10 caption: "Attention distance was computed
                 ... by averaging the distance between the query pixel and all other pixels, weighted by the attention
                 weight". Every pixel u of the query token's patch is a query pixel; every pixel v of the image is
                 weighted by the attention A'[q, k(v)] of the key token k(v) whose patch holds v, spread evenly over
                 that patch's P^2 pixels (so the weights of one query pixel sum to 1, and the result is in pixels);
                 the weighted mean distance is averaged over the P^2 query pixels:

                     D[q, k] = mean_{u in patch q, v in patch k} ||u - v||_2        (pixel centres, in pixels)

                 The query pixel itself (distance 0) adds nothing to the weighted sum; it is kept in the weights'
                 total (leaving it out would divide by 1 - A'[q, q] / P^2 instead). Unlike the patch-centre
                 distance, a purely local head (all attention on its own token) gets a non-zero distance, the mean
                 distance between two pixels of one patch (0.5214 P for large P; 0.8536 for P = 2). Since ||.|| is
                 convex, D_pixel_level >= D_pixels for every pair.

Where the authors' code differs from ours. Walmer's ``AttentionDistance`` drops exactly one prefix token and needs a
square grid (we drop all ``num_prefix_tokens`` and treat each axis of a non-square grid on its own), and a query
whose spatial keys get no mass at all (every bit of attention on CLS) counts as distance 0 in its mean; here such a
query (possible only with hand-built attention) has no defined distance and is left out of the mean. Walmer keeps
one value per image (mean over queries) and averages images when plotting: the same mean, as every image has the
same number of queries. We follow the papers' definitions above; ``unit_square`` is the one to compare with Walmer's
figures, ``pixel_level`` with the ViT paper's Fig. 7 / 10, ``pixels`` with Raghu's Fig. 3 - 4 (all in
:class:`AttentionDistanceMeasure`'s result).

Results are float64 (per-query key sums in the attention's precision: :func:`head_distance_sums`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import torch
import torch.distributed as dist
from torch import Tensor

from analysis.engine.figures import attention_distance_plot
from analysis.engine.measure import Measure, register
from analysis.engine.reduce import all_reduce_sum

UNITS = ("pixels", "unit_square", "pixel_level")  # the three distance matrices (module docstring), also the result keys
UNIT_LABELS = {
    "pixels": "pixels, patch centres (Raghu)",
    "unit_square": "unit square, patch centres (Walmer)",
    "pixel_level": "pixels, pixel to pixel (ViT App. D.6)",
}
_CHUNK_ELEMENTS = 1 << 22  # elements of attention per batched product (16 MiB of float32)
# How far a float32 (or half-type) map's mean distance may be from the float64 computation on the same map: its key
# sums are float32, at most ~1e-6 relative of a query's distance (head_distance_sums); also what two float32 paths
# (another memory layout, BLAS or host) may differ by.
FLOAT32_RTOL = 1e-6


def _check_unit(unit: str) -> None:
    if unit not in UNITS:
        raise ValueError(f"unit must be one of {UNITS}, got {unit!r}")


def token_positions(grid: tuple[int, int], patch_size: int, unit: str = "pixels") -> Tensor:
    """Positions [N, 2] (row, col) of the N = grid[0] * grid[1] spatial tokens in row-major order (float64).

    ``"pixels"``: ``(r * patch_size, c * patch_size)`` (patch centres, up to a common shift of ``patch_size / 2``);
    ``"unit_square"``: ``(r / (grid[0] - 1), c / (grid[1] - 1))`` as Walmer's code (0 on an axis with one token).
    """
    if unit not in ("pixels", "unit_square"):
        raise ValueError(f"token positions exist for 'pixels' and 'unit_square', got {unit!r}")
    rows, cols = grid
    r = torch.arange(rows, dtype=torch.float64).repeat_interleave(cols)
    c = torch.arange(cols, dtype=torch.float64).repeat(rows)
    pos = torch.stack([r, c], 1)
    if unit == "unit_square":
        return pos / torch.tensor([max(rows - 1, 1), max(cols - 1, 1)], dtype=torch.float64)
    return pos * patch_size


def pixel_level_offsets(grid: tuple[int, int], patch_size: int) -> Tensor:
    """[2gh-1, 2gw-1] float64: for two tokens ``(dr, dc)`` patches apart, the mean Euclidean distance between a pixel of
    one patch and a pixel of the other, ``mean_{u, v} ||u - v||`` over the ``P^4`` pixel pairs (pixel centres, pixels).

    Along one axis the pixel offset is ``d * P + e`` with ``e = i - i'`` in ``-(P-1) .. P-1``, taken by ``P - |e|`` of
    the ``P^2`` pixel pairs; the two axes are independent, so the mean is a weighted sum over ``(2P-1)^2`` terms."""
    p = int(patch_size)
    e = torch.arange(-(p - 1), p, dtype=torch.float64)
    w = (p - e.abs()) / p**2  # [2P-1], sums to 1
    out = []
    for g in grid:
        d = torch.arange(-(g - 1), g, dtype=torch.float64)
        out.append(d[:, None] * p + e[None, :])  # [2g-1, 2P-1] pixel offsets along this axis
    rows, cols = out
    dist = (rows[:, None, :, None].pow(2) + cols[None, :, None, :].pow(2)).sqrt()  # [2gh-1, 2gw-1, 2P-1, 2P-1]
    return torch.einsum("abij,i,j->ab", dist, w, w)


def grid_distances(grid: tuple[int, int], patch_size: int, unit: str = "pixels") -> Tensor:
    """Pairwise distances ``D`` [N, N] (float64) between spatial tokens for one of :data:`UNITS` (module docstring).

    ``"pixels"`` / ``"unit_square"``: ``||pos(q) - pos(k)||_2`` of :func:`token_positions`, computed by explicit
    differences, so the diagonal is exactly 0 and axis-aligned neighbours are exactly ``patch_size`` (pixels) apart.
    ``"pixel_level"``: the mean pixel-to-pixel distance between the two patches (:func:`pixel_level_offsets`).
    """
    _check_unit(unit)
    if unit == "pixel_level":
        gh, gw = grid
        r = torch.arange(gh).repeat_interleave(gw)
        c = torch.arange(gw).repeat(gh)
        return pixel_level_offsets(grid, patch_size)[r[None, :] - r[:, None] + gh - 1, c[None, :] - c[:, None] + gw - 1]
    pos = token_positions(grid, patch_size, unit)
    return (pos[:, None, :] - pos[None, :, :]).pow(2).sum(-1).sqrt()


def _check(attn: Tensor, grid: tuple[int, int], num_prefix_tokens: int) -> None:
    if attn.ndim != 4 or attn.shape[-1] != attn.shape[-2]:
        raise ValueError(f"attn must be [B, H, T, T], got shape {tuple(attn.shape)}")
    if num_prefix_tokens < 0:
        raise ValueError(f"num_prefix_tokens must be >= 0, got {num_prefix_tokens}")
    expected = num_prefix_tokens + grid[0] * grid[1]
    if attn.shape[-1] != expected:
        raise ValueError(
            f"attn has T={attn.shape[-1]} tokens, expected {num_prefix_tokens} prefix + {grid[0]}x{grid[1]} = "
            f"{expected}"
        )


def head_distance_sums(attn: Tensor, distances: Sequence[Tensor], num_prefix_tokens: int) -> tuple[Tensor, Tensor]:
    """Per-head sums of ``d_h(q)`` over images and spatial queries, one row per distance matrix, and per-head counts.

    ``distances`` are [N, N] matrices (e.g. pixels and unit square). Returns ``(sums [len(distances), H], counts [H])``
    in float64 on ``attn``'s device; ``sums / counts`` is the mean attention distance. Queries whose renormalising
    spatial mass is 0 are not counted.

    Precision: each query's sums over its keys (its spatial mass and its distance-weighted mass) are taken in the
    attention's own precision when it is float64 or float32 (float32 for half types), and everything after them
    in float64. A float32 attention map carries ~6e-8 relative rounding in each probability already (and the
    float32 forward pass that made it far more); the float32 key sums add at most ~1e-6 relative to a query's
    distance: 3e-7 on a uniform head over 49 keys, where every query rounds alike, ~1e-8 on a head's mean over
    softmax rows, where the roundings average out (both tested against float64). Converting the whole map to
    float64 first cost twice the time (the suite's largest copy at 2 threads). All of a query's key sums come from
    one batched product, query by query: the attention [b * H, N, N] (a view, no copy) times the distances with a
    row of ones appended [N, N, U + 1], the ones giving the mass.
    """
    p = num_prefix_tokens
    _batch, heads, t, _ = attn.shape
    n = t - p
    dt = torch.float64 if attn.dtype == torch.float64 else torch.float32
    dist = torch.stack([d.to(attn.device, dt) for d in distances])  # [U, N, N]
    dist = torch.cat([dist, torch.ones_like(dist[:1])]).permute(1, 2, 0)  # [q, k, U + 1]: the last column, mass
    sums = torch.zeros(len(distances), heads, dtype=torch.float64, device=attn.device)
    counts = torch.zeros(heads, dtype=torch.float64, device=attn.device)
    chunk = max(1, _CHUNK_ELEMENTS // max(1, heads * n * n))
    for part in attn[:, :, p:, p:].split(chunk, dim=0):
        a = part.to(dt).reshape(-1, n, n)  # [b * H, q, k] spatial queries x spatial keys (a view for float32)
        keyed = torch.bmm(a.transpose(0, 1), dist).double()  # [q, b * H, U + 1]
        weighted, mass = keyed[..., :-1], keyed[..., -1:]
        valid = mass > 0
        per_query = torch.where(valid, weighted / torch.where(valid, mass, 1.0), 0.0)  # [q, b * H, U]
        sums += per_query.reshape(n, -1, heads, len(distances)).sum((0, 1)).T
        counts += valid.reshape(n, -1, heads).sum((0, 1)).double()
    return sums, counts


def attention_distance(
    attn: Tensor, grid: tuple[int, int], patch_size: int, num_prefix_tokens: int, unit: str = "pixels"
) -> Tensor:
    """Mean attention distance per head [H] (float64) of one block's attention probabilities ``attn`` [B, H, T, T].

    ``mean_{b, q spatial} sum_{k spatial} A'[b, h, q, k] * D[q, k]`` with ``A'`` the row over spatial keys
    renormalised to sum to 1 (prefix rows and columns dropped) and ``D`` the distance matrix of ``unit``
    (:func:`grid_distances`): ``"pixels"`` patch centres in pixels (Raghu Fig. 3), ``"unit_square"`` patch centres
    at (r / (gh-1), c / (gw-1)) (Walmer §4.3 and his code), ``"pixel_level"`` pixel to pixel in pixels (ViT paper
    App. D.6 / Fig. 10). ``num_prefix_tokens=0`` for GAP models without CLS. A head with no countable query gives NaN.
    """
    _check(attn, grid, num_prefix_tokens)
    sums, counts = head_distance_sums(attn.detach(), [grid_distances(grid, patch_size, unit)], num_prefix_tokens)
    return sums[0] / counts


class AttentionDistance:
    """Accumulates mean attention distance per head for several blocks, with sum-reduced float64 state.

    In the style of a torchmetrics ``Metric`` with ``dist_reduce_fx="sum"``: for every block the state holds per-head
    SUMS of ``d_h(q)`` (over images and spatial queries) for each distance of :data:`UNITS` and per-head COUNTS of
    queries, so ``update`` over several batches equals :func:`attention_distance` on their concatenation, and summing
    the state over processes (:meth:`sync`) gives the same answer as one process seeing all the images.
    Definitions in the module docstring.

    State (CPU, float64): ``sums[unit][block]`` [H] for every unit of :data:`UNITS`, ``count[block]`` [H].
    """

    def __init__(self, grid: tuple[int, int], patch_size: int, num_prefix_tokens: int) -> None:
        self.grid = (int(grid[0]), int(grid[1]))
        self.patch_size = int(patch_size)
        self.num_prefix_tokens = int(num_prefix_tokens)
        self._distances = [grid_distances(self.grid, self.patch_size, u) for u in UNITS]
        self._device_distances: dict[torch.device, list[Tensor]] = {}
        self.reset()

    def reset(self) -> None:
        """Empty the state."""
        self.sums: dict[str, dict[int, Tensor]] = {u: {} for u in UNITS}
        self.count: dict[int, Tensor] = {}

    def _dists_on(self, device: torch.device) -> list[Tensor]:
        if device not in self._device_distances:
            self._device_distances[device] = [d.to(device) for d in self._distances]
        return self._device_distances[device]

    def _zeros(self, block: int, heads: int) -> None:
        for state in (*self.sums.values(), self.count):
            state[block] = torch.zeros(heads, dtype=torch.float64)

    def update(self, block: int, attn: Tensor) -> None:
        """Add block ``block``'s per-head distance sums and query counts for a batch ``attn`` [B, H, T, T]."""
        _check(attn, self.grid, self.num_prefix_tokens)
        heads = attn.shape[1]
        if block not in self.count:
            self._zeros(block, heads)
        elif self.count[block].numel() != heads:
            raise ValueError(f"block {block} had {self.count[block].numel()} heads, this batch has {heads}")
        sums, counts = head_distance_sums(attn.detach(), self._dists_on(attn.device), self.num_prefix_tokens)
        for u, s in zip(UNITS, sums):
            self.sums[u][block] += s.cpu()
        self.count[block] += counts.cpu()

    def compute(self, unit: str = "pixels") -> dict[int, Tensor]:
        """``{block: mean attention distance per head [H]}`` (float64) for one of :data:`UNITS`."""
        _check_unit(unit)
        return {b: self.sums[unit][b] / self.count[b] for b in sorted(self.count)}

    def _packed(self, b: int) -> Tensor:
        return torch.cat([*(self.sums[u][b] for u in UNITS), self.count[b]])

    def reduce_(self, fn: Callable[[Tensor], Tensor]) -> None:
        """Replace the state by ``fn`` of it, in place: the state of all blocks (ascending) is packed into one flat
        float64 tensor ``[sums of each unit in UNITS order | count]`` per block, ``fn(flat)`` must return the same
        shape (e.g. a sum over processes), and the result is unpacked back."""
        blocks = sorted(self.count)
        if not blocks:
            return
        flat = torch.cat([self._packed(b) for b in blocks])
        out = fn(flat)
        if out.shape != flat.shape:
            raise ValueError(f"reduce fn returned shape {tuple(out.shape)}, expected {tuple(flat.shape)}")
        out = out.detach().to("cpu", torch.float64)
        offset, parts = 0, len(UNITS) + 1
        for b in blocks:
            h = self.count[b].numel()
            *sums, self.count[b] = out[offset : offset + parts * h].clone().split(h)
            for u, s in zip(UNITS, sums):
                self.sums[u][b] = s
            offset += parts * h

    def sync(self, accelerator=None) -> None:
        """Sum the state over processes with ``torch.distributed.all_reduce`` (SUM) when a process group with more than
        one process is initialised (otherwise nothing). Blocks seen only by some processes are added as zeros elsewhere
        first. The packed state is summed by :func:`analysis.engine.reduce.all_reduce_sum`. Call it once, after the last
        ``update`` and before ``compute``: calling it twice sums twice."""

        if accelerator is not None and accelerator.num_processes == 1:
            return
        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
            return
        heads: list[dict[int, int] | None] = [None] * dist.get_world_size()
        dist.all_gather_object(heads, {b: c.numel() for b, c in self.count.items()})
        for rank_heads in heads:
            for b, h in (rank_heads or {}).items():
                if b not in self.count:
                    self._zeros(b, h)
                elif self.count[b].numel() != h:
                    raise ValueError(f"block {b}: {self.count[b].numel()} heads here, {h} on another process")
        self.reduce_(lambda flat: all_reduce_sum(flat, accelerator))


# ---------------------------------------------------------------- the suite's measure


@register
class AttentionDistanceMeasure(Measure):
    """How far each head attends: mean attention distance per head and block, in three definitions.
    Raghu et al. 2021 Fig. 3 / ViT paper Fig. 7 right, Fig. 10 / Walmer §4.3, Fig. 4; definitions in the module
    docstring. Result, each [L, H] float64: ``pixels`` (patch-centre distance in pixels, Raghu), ``unit_square`` (patch
    centres on Walmer's unit square, as his code), ``pixel_level`` (pixel-to-pixel distance in pixels, ViT paper App.
    D.6); ``blocks`` [L]; ``patch_size``."""

    name = "attention_distance"
    chunkable = True  # per-image sums / rows: a minibatch may come in chunks

    @classmethod
    def applies(cls, ctx):
        return ctx.arch == "vit"

    def __init__(self, ctx, opts=None):
        super().__init__(ctx, opts)
        self.acc = AttentionDistance(ctx.grid, ctx.patch_size, ctx.prefix)

    def taps(self):
        return {f"{b}.attn_probs" for b in self.ctx.blocks}

    def update(self, j, cap, x, y):
        for i, b in enumerate(self.ctx.blocks):
            self.acc.update(i, cap[f"{b}.attn_probs"])

    def finish(self):
        self.acc.sync(self.ctx.accelerator)
        n = len(self.ctx.blocks)
        out = {}
        for u in UNITS:
            d = self.acc.compute(u)
            out[u] = torch.stack([d[i] for i in range(n)]).numpy()
        return {
            **out,
            "blocks": list(self.ctx.blocks),
            "patch_size": int(self.ctx.patch_size),
            "grid": list(self.ctx.grid),
        }

    @staticmethod
    def uniform(r, unit: str = "pixels") -> float | None:
        """The mean distance, in ``unit``, of a head attending uniformly over the token grid (the figures' reference
        line); the grid of a result saved before it was recorded is read from its two units (square grids)."""
        if "grid" in r:
            grid = tuple(int(g) for g in np.asarray(r["grid"]).reshape(-1))
        else:
            px, sq = np.asarray(r["pixels"], dtype=float), np.asarray(r["unit_square"], dtype=float)
            ok = sq > 0
            if not ok.any():
                return None
            side = int(round(float(np.median(px[ok] / sq[ok])) / int(r["patch_size"]))) + 1  # pixels/unit = (g-1) P
            grid = (side, side)
        return float(grid_distances(grid, int(r["patch_size"]), unit).mean())

    @staticmethod
    def summary(r):

        px = np.asarray(r["pixels"])
        out = {
            "mean_px": [float(v) for v in px.mean(1)],
            "min_px": [float(v) for v in px.min(1)],
            "max_px": [float(v) for v in px.max(1)],
        }
        if "pixel_level" in r:  # results saved before the pixel-level distance existed lack it
            out["mean_px_pixel_level"] = [float(v) for v in np.asarray(r["pixel_level"]).mean(1)]
        out["mean_unit_square"] = [float(v) for v in np.asarray(r["unit_square"]).mean(1)]
        return out

    @staticmethod
    def scalars(r):

        px = np.asarray(
            r["pixels"]
        )  # per head in the figure and the npz; per block here (a chart per head buries the curves)
        return {
            f"attn_dist/{stat}/block{i:02d}": float(f(px[i]))
            for i in range(px.shape[0])
            for stat, f in (("mean", np.mean), ("min", np.min), ("max", np.max))
        }

    @staticmethod
    def figures(r, step=None):

        at = f" (step {step})" if step is not None else ""
        uniform = AttentionDistanceMeasure.uniform
        figs = {
            "attn_dist/heads": attention_distance_plot(
                r["pixels"],
                title=f"attention distance, patch centres{at}",
                unit=UNIT_LABELS["pixels"],
                uniform=uniform(r, "pixels"),
            )
        }
        if "pixel_level" in r:
            figs["attn_dist/heads_pixel_level"] = attention_distance_plot(
                r["pixel_level"],
                title=f"attention distance, pixel to pixel (ViT App. D.6){at}",
                unit=UNIT_LABELS["pixel_level"],
                uniform=uniform(r, "pixel_level"),
            )
        return figs
