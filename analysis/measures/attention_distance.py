"""Mean attention distance per head (ViT paper App. D.6 / Fig. 7 right; Raghu et al. 2021 Fig. 3; Walmer et al. 2023 §4.3).

Definition. For one image, head h, and a spatial query q (prefix tokens such as CLS or registers are dropped as
queries), keep the attention row over the SPATIAL keys only (prefix columns dropped) and renormalise it:

    A'[q, k] = A[q, k] / sum_{k' spatial} A[q, k']
    d_h(q)   = sum_{k spatial} A'[q, k] * || pos(q) - pos(k) ||_2

``pos`` is the (row, col) of a token on the patch grid (row-major token order, as timm lays out patches) in pixels,
``(row * patch_size, col * patch_size)``; for ``unit="unit_square"`` rows are divided by ``grid[0] * patch_size`` and
columns by ``grid[1] * patch_size`` so the image side is 1 (for a square grid: pixel distance / (side * patch_size)).
The head's attention distance is the mean of ``d_h(q)`` over spatial queries and images. A query whose spatial keys
get no mass at all (possible only with hand-built attention) has no defined distance and is left out of the mean.

Everything is computed in float64 and returned as float64.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from analysis.measure import Measure, register
from analysis.reduce import all_reduce_sum

UNITS = ("pixels", "unit_square")
_CHUNK_ELEMENTS = 1 << 22  # float64 elements of attention converted at a time (32 MiB)


def token_positions(grid: tuple[int, int], patch_size: int, unit: str = "pixels") -> Tensor:
    """Positions [N, 2] (row, col) of the N = grid[0] * grid[1] spatial tokens in row-major order (float64).

    ``"pixels"``: ``(r * patch_size, c * patch_size)``; ``"unit_square"``: ``(r / grid[0], c / grid[1])``, i.e. the
    pixel position divided by the image height / width.
    """
    if unit not in UNITS:
        raise ValueError(f"unit must be one of {UNITS}, got {unit!r}")
    rows, cols = grid
    r = torch.arange(rows, dtype=torch.float64).repeat_interleave(cols)
    c = torch.arange(cols, dtype=torch.float64).repeat(rows)
    pos = torch.stack([r, c], 1) * patch_size
    if unit == "unit_square":
        pos = pos / torch.tensor([rows * patch_size, cols * patch_size], dtype=torch.float64)
    return pos


def grid_distances(grid: tuple[int, int], patch_size: int, unit: str = "pixels") -> Tensor:
    """Pairwise Euclidean distances [N, N] (float64) between spatial token centres, ``||pos(q) - pos(k)||_2``.

    Positions are those of :func:`token_positions` (pixels by default). Computed by explicit differences, so the
    diagonal is exactly 0 and axis-aligned neighbours are exactly ``patch_size`` apart.
    """
    pos = token_positions(grid, patch_size, unit)
    return (pos[:, None, :] - pos[None, :, :]).pow(2).sum(-1).sqrt()


def _check(attn: Tensor, grid: tuple[int, int], num_prefix_tokens: int) -> None:
    if attn.ndim != 4 or attn.shape[-1] != attn.shape[-2]:
        raise ValueError(f"attn must be [B, H, T, T], got shape {tuple(attn.shape)}")
    if num_prefix_tokens < 0:
        raise ValueError(f"num_prefix_tokens must be >= 0, got {num_prefix_tokens}")
    expected = num_prefix_tokens + grid[0] * grid[1]
    if attn.shape[-1] != expected:
        raise ValueError(f"attn has T={attn.shape[-1]} tokens, expected {num_prefix_tokens} prefix + {grid[0]}x{grid[1]} = {expected}")


def head_distance_sums(attn: Tensor, distances: Sequence[Tensor], num_prefix_tokens: int) -> tuple[Tensor, Tensor]:
    """Per-head sums of ``d_h(q)`` over images and spatial queries, one row per distance matrix, and per-head counts.

    ``distances`` are [N, N] matrices (e.g. pixels and unit square). Returns ``(sums [len(distances), H], counts [H])``
    in float64 on ``attn``'s device; ``sums / counts`` is the mean attention distance. Queries whose renormalising
    spatial mass is 0 are not counted.
    """
    p = num_prefix_tokens
    batch, heads, t, _ = attn.shape
    n = t - p
    dist = torch.stack([d.to(attn.device, torch.float64) for d in distances])  # [U, N, N]
    sums = torch.zeros(len(distances), heads, dtype=torch.float64, device=attn.device)
    counts = torch.zeros(heads, dtype=torch.float64, device=attn.device)
    chunk = max(1, _CHUNK_ELEMENTS // max(1, heads * n * n))
    for part in attn[:, :, p:, p:].split(chunk, dim=0):
        a = part.double()  # [b, H, N, N] spatial queries x spatial keys
        mass = a.sum(-1)  # [b, H, N]
        weighted = torch.einsum("bhqk,uqk->ubhq", a, dist)
        valid = mass > 0
        per_query = torch.where(valid, weighted / torch.where(valid, mass, torch.ones_like(mass)), torch.zeros_like(weighted))
        sums += per_query.sum((1, 3))
        counts += valid.sum((0, 2)).double()
    return sums, counts


def attention_distance(attn: Tensor, grid: tuple[int, int], patch_size: int, num_prefix_tokens: int, unit: str = "pixels") -> Tensor:
    """Mean attention distance per head [H] (float64) of one block's attention probabilities ``attn`` [B, H, T, T].

    ViT paper App. D.6 / Fig. 7 (right), Raghu et al. 2021 Fig. 3, Walmer et al. 2023 §4.3:
    ``mean_{b, q spatial} sum_{k spatial} A'[b, h, q, k] * ||pos(q) - pos(k)||`` with ``A'`` the row over spatial keys
    renormalised to sum to 1 (prefix rows and columns dropped). ``unit="pixels"``: positions ``(r, c) * patch_size``;
    ``unit="unit_square"``: rows / (grid[0] * patch_size), cols / (grid[1] * patch_size). ``num_prefix_tokens=0``
    for GAP models without CLS. A head with no countable query gives NaN.
    """
    _check(attn, grid, num_prefix_tokens)
    sums, counts = head_distance_sums(attn.detach(), [grid_distances(grid, patch_size, unit)], num_prefix_tokens)
    return sums[0] / counts


class AttentionDistance:
    """Accumulates mean attention distance per head for several blocks, with sum-reduced float64 state.

    In the style of a torchmetrics ``Metric`` with ``dist_reduce_fx="sum"``: for every block the state holds per-head
    SUMS of ``d_h(q)`` (over images and spatial queries; in pixels and in unit-square units) and per-head COUNTS of
    queries, so ``update`` over several batches equals :func:`attention_distance` on their concatenation, and summing
    the state over processes (:meth:`sync`) gives the same answer as one process seeing all the images.
    Definition as in :func:`attention_distance` (ViT paper App. D.6 / Fig. 7 right; Raghu et al. 2021 Fig. 3).

    State (CPU, float64): ``sum_pixels[block]`` [H], ``sum_unit_square[block]`` [H], ``count[block]`` [H].
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
        self.sum_pixels: dict[int, Tensor] = {}
        self.sum_unit_square: dict[int, Tensor] = {}
        self.count: dict[int, Tensor] = {}

    def _dists_on(self, device: torch.device) -> list[Tensor]:
        if device not in self._device_distances:
            self._device_distances[device] = [d.to(device) for d in self._distances]
        return self._device_distances[device]

    def _zeros(self, block: int, heads: int) -> None:
        for state in (self.sum_pixels, self.sum_unit_square, self.count):
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
        self.sum_pixels[block] += sums[0].cpu()
        self.sum_unit_square[block] += sums[1].cpu()
        self.count[block] += counts.cpu()

    def compute(self) -> dict[int, Tensor]:
        """``{block: mean attention distance per head [H]}`` in pixels (float64)."""
        return {b: self.sum_pixels[b] / self.count[b] for b in sorted(self.count)}

    def compute_unit_square(self) -> dict[int, Tensor]:
        """``{block: mean attention distance per head [H]}`` with the image side as unit (float64)."""
        return {b: self.sum_unit_square[b] / self.count[b] for b in sorted(self.count)}

    def reduce_(self, fn: Callable[[Tensor], Tensor]) -> None:
        """Replace the state by ``fn`` of it, in place: the state of all blocks (ascending) is packed into one flat
        float64 tensor ``[sum_pixels | sum_unit_square | count]`` per block, ``fn(flat)`` must return the same shape
        (e.g. a sum over processes), and the result is unpacked back."""
        blocks = sorted(self.count)
        if not blocks:
            return
        flat = torch.cat([torch.cat([self.sum_pixels[b], self.sum_unit_square[b], self.count[b]]) for b in blocks])
        out = fn(flat)
        if out.shape != flat.shape:
            raise ValueError(f"reduce fn returned shape {tuple(out.shape)}, expected {tuple(flat.shape)}")
        out = out.detach().to("cpu", torch.float64)
        offset = 0
        for b in blocks:
            h = self.count[b].numel()
            self.sum_pixels[b], self.sum_unit_square[b], self.count[b] = out[offset:offset + 3 * h].clone().split(h)
            offset += 3 * h

    def sync(self, accelerator=None) -> None:
        """Sum the state over processes with ``torch.distributed.all_reduce`` (SUM) when a process group with more
        than one process is initialised (otherwise nothing). Blocks seen only by some processes are added as zeros
        elsewhere first. The packed state is summed by :func:`analysis.reduce.all_reduce_sum`. Call it once, after the last ``update`` and before
        ``compute``: calling it twice sums twice."""
        import torch.distributed as dist

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
    """Raghu et al. 2021 Fig. 3 / ViT paper Fig. 7 right / Walmer §4.3: mean attention distance per head and
    block (definition in this module's docstring). Result: ``pixels`` and ``unit_square`` [L, H], ``blocks``."""

    name = "attention_distance"

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
        px, unit = self.acc.compute(), self.acc.compute_unit_square()
        n = len(self.ctx.blocks)
        return {"pixels": torch.stack([px[i] for i in range(n)]).numpy(), "unit_square": torch.stack([unit[i] for i in range(n)]).numpy(),
                "blocks": list(self.ctx.blocks)}

    @staticmethod
    def summary(r):
        import numpy as np

        px = np.asarray(r["pixels"])
        return {"mean_px": [float(v) for v in px.mean(1)], "min_px": [float(v) for v in px.min(1)], "max_px": [float(v) for v in px.max(1)]}

    @staticmethod
    def scalars(r):
        import numpy as np

        px = np.asarray(r["pixels"])
        return {f"attn_dist/block{i:02d}/head{h:02d}": float(px[i, h]) for i in range(px.shape[0]) for h in range(px.shape[1])}

    @staticmethod
    def figures(r, step=None):
        from analysis.figures import attention_distance_plot

        at = f" (step {step})" if step is not None else ""
        return {"attn_dist/heads": attention_distance_plot(r["pixels"], title=f"attention distance{at}")}
