"""Effective receptive fields of every block (Raghu et al. 2021 §5 "Effective Receptive Fields", Fig. 6 and
App. C, Fig. C.1-C.4; after Luo et al. 2017).

Definition. For a block's feature map F (ViT: tokens [T, D]; ResNet: [D, h, w]) take the feature vector of the
CENTRE location c: the spatial token at grid position (gh // 2, gw // 2) for a ViT (prefix tokens such as CLS are
skipped: index ``prefix + (gh // 2) * gw + gw // 2``), position (h // 2, w // 2) of the block's own feature map
for a ResNet. For one image x (the normalised input, [C, H, W]) and feature channel d,

    g_d(x) = d F_c,d(x) / d x                                           [C, H, W]
    ERF(x) = (1 / D) sum_d sum_{C} |g_d(x)|                             [H, W]

i.e. the absolute gradient of each centre channel separately, summed over input channels and AVERAGED over the
D feature channels (the paper: "averaged across all channels in each map"; this is NOT the gradient of the
channel sum), then averaged over images (the first ``erf_images`` = 32 analysis images) and normalised to sum 1
per map. Channels are done k at a time by running k copies of the images, copy i seeded with channel i (see
:func:`erf_sums`); the model runs in eval mode, so images and copies in a batch are independent and the gradient
of a sum over them is per image.

Two variants per block (``variants``):

- ``residual`` (0): after the residual connection, the block output (ViT ``blocks.i.out``: after the MLP
  sublayer's skip, Fig. 6 / C.1; ResNet ``layer{s}.{j}.out``, after the final activation, Fig. C.2);
- ``branch`` (1): the residual branch alone, before the skip is added (Fig. C.4): ViT the MLP branch
  ``blocks.i.mlp_branch`` (f_mlp after ls2 / drop_path2); ResNet the residual branch ``layer{s}.{j}.branch``
  (without the shortcut, so first-in-stage blocks "shrink" as in the paper's Fig. C.4).

ViTs also get the ATTENTION sublayer, as the paper plots all sublayers (keys ``attn_*``): variant 0
``blocks.i.attn_out`` (z + f_attn(z), post-residual) and variant 1 ``blocks.i.attn_branch`` (f_attn alone,
pre-residual: C.4 shows these are far less tied to the centre patch). For a no-skip block (interventions.no_skip)
the "residual" tensors are what the block computes (the branch alone where the skip was removed).

Scores per map (all on the normalised map, so shares lie in [0, 1]):

- ``concentration``: the ERF mass inside the centre location's own input pixels: ViT its patch
  (rows ``[ci * ph, (ci + 1) * ph)``, cols likewise); ResNet the block of ``s x s`` pixels of the centre position,
  s = input size / feature-map size (one pixel in a stride-1 stage). Stored per block as ``window`` [L, 4]
  (row0, row1, col0, col1), end exclusive.
- ``radius_share``: the mass of pixels whose centre lies within Euclidean distance ``radius`` of the centre of
  that window (pixel (i, j) is at (i + 0.5, j + 0.5)). ``radius`` = option ``erf_radius`` if set, else the ViT
  patch size, else max(H, W) / 8 (the patch of an 8 x 8-token ViT at this resolution).
- ``mean_distance``: the ERF-weighted mean pixel distance from the window centre (scale-free spread, cf. the
  attention distance of Fig. 3).

Result (L blocks, H x W input): ``erf`` [L, 2, H, W], ``concentration``/``radius_share``/``mean_distance`` [L, 2],
ViT only ``attn_erf`` [L, 2, H, W] and ``attn_concentration``/``attn_radius_share``/``attn_mean_distance`` [L, 2];
``window`` [L, 4], ``radius``, ``images``, ``blocks``, ``variants``, ``arch``.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn as nn
from matplotlib.patches import Rectangle

from analysis.engine.figures import finish_block_axes, grid_labels, subplots
from analysis.engine.measure import Context, Measure, as_list, register
from analysis.engine.reduce import all_reduce_sum, shard
from analysis.engine.taps import Taps, block_names

VARIANTS = ("residual", "branch")
VIT_TAPS = {"residual": "out", "branch": "mlp_branch", "attn_residual": "attn_out", "attn_branch": "attn_branch"}
RESNET_TAPS = {"residual": "out", "branch": "branch"}
_FORWARD_IMAGES = 128  # images (copies x batch) per forward of the ERF pass


def unwrap(model: nn.Module) -> nn.Module:
    """The module under DDP / torch.compile wrappers."""
    while True:
        if isinstance(model, nn.parallel.DistributedDataParallel):
            model = model.module
        elif hasattr(model, "_orig_mod"):
            model = model._orig_mod
        else:
            return model


# ---------------------------------------------------------------- the definition


def centre_index(grid: tuple[int, int], prefix: int) -> int:
    """Token index of the spatial token at grid position (gh // 2, gw // 2), after ``prefix`` prefix tokens."""
    gh, gw = grid
    return prefix + (gh // 2) * gw + gw // 2


def centre_features(t: torch.Tensor, prefix: int = 0, grid: tuple[int, int] | None = None) -> torch.Tensor:
    """[B, D] features at the centre location: [B, T, D] tokens (centre spatial token of ``grid``) or
    [B, D, h, w] feature maps (position (h // 2, w // 2))."""
    if t.ndim == 4:
        return t[:, :, t.shape[2] // 2, t.shape[3] // 2]
    if grid is None:
        raise ValueError("centre_features of tokens needs the token grid")
    if t.shape[1] != prefix + grid[0] * grid[1]:
        raise ValueError(f"{t.shape[1]} tokens, expected {prefix} prefix + {grid[0]}x{grid[1]}")
    return t[:, centre_index(grid, prefix)]


def erf_sums(
    forward: Callable[[torch.Tensor], dict[str, torch.Tensor]],
    x: torch.Tensor,
    dims: dict[str, int],
    prefix: int = 0,
    grid: tuple[int, int] | None = None,
    max_images: int = _FORWARD_IMAGES,
) -> dict[str, torch.Tensor]:
    """The definition: {name: [H, W] float64 = sum_b (1/D) sum_d sum_c |d F_name[b, centre, d] / d x[b, c]|}.

    ``forward(x)`` returns the named feature tensors of ``x`` [B, C, H, W] with their graph; ``dims`` gives each
    name's channel count D. Images must not interact in ``forward`` (eval mode). Each channel needs its own
    gradient; they are had k at a time by running k copies of the batch (k * B <= ``max_images``), copy i seeded
    with channel ``start + i``: one forward per round of k channels, one backward per name and round. (This is
    the explicit per-channel loop, batched; on CPU much faster than ``is_grads_batched`` / vmap.)"""
    b = x.shape[0]
    k = max(1, min(max(dims.values()), max_images // b))
    out = {n: torch.zeros(x.shape[-2:], dtype=torch.float64, device=x.device) for n in dims}
    for start in range(0, max(dims.values()), k):
        xr = x.detach().repeat(k, *([1] * (x.ndim - 1))).requires_grad_(True)  # copy i = rows [i * b, (i + 1) * b)
        feats = forward(xr)
        active = [n for n in dims if dims[n] > start]
        for j, n in enumerate(active):
            f = centre_features(feats[n], prefix, grid).reshape(k, b, -1)
            if f.shape[-1] != dims[n]:
                raise ValueError(f"'{n}' has {f.shape[-1]} channels, expected {dims[n]}")
            kk = min(k, dims[n] - start)
            idx = torch.arange(kk, device=f.device)
            seed = f[idx, :, start + idx].sum()  # copy i: channel start + i, summed over images
            (g,) = torch.autograd.grad(seed, xr, retain_graph=j < len(active) - 1)
            out[n] += g.reshape(k, b, *x.shape[1:])[:kk].abs().sum(2).double().sum((0, 1))
        del feats, xr
    return {n: out[n] / dims[n] for n in dims}


@contextmanager
def _grad_mode(model: nn.Module):
    """Eval mode, parameters frozen (only input gradients are built), everything restored afterwards."""
    was_training = model.training
    flags = [(p, p.requires_grad) for p in model.parameters()]
    model.eval()
    for p, _ in flags:
        p.requires_grad_(False)
    try:
        with torch.enable_grad():
            yield
    finally:
        for p, f in flags:
            p.requires_grad_(f)
        model.train(was_training)


def feature_shapes(model: nn.Module, x: torch.Tensor, names: list[str]) -> dict[str, tuple]:
    """{name: per-image shape of the tapped tensor} from one no-grad forward of ``x[:1]``."""
    with torch.no_grad(), Taps(model, names) as cap:
        model(x[:1])
    return {n: tuple(cap[n].shape[1:]) for n in names}


def effective_receptive_fields(
    model: nn.Module,
    x: torch.Tensor,
    names: list[str],
    prefix: int = 0,
    grid: tuple[int, int] | None = None,
    max_images: int = _FORWARD_IMAGES,
) -> tuple[dict[str, torch.Tensor], dict[str, tuple]]:
    """ERF sums over the images of ``x`` [B, C, H, W] for each tap in ``names`` (see :func:`erf_sums`):
    ({name: [H, W] float64}, {name: per-image feature shape}). The model runs in eval mode with frozen parameters;
    its train flag and requires_grad flags are restored afterwards. Works inside torch.no_grad()."""
    with _grad_mode(model):
        shapes = feature_shapes(model, x, names)
        dims = {n: shapes[n][0] if len(shapes[n]) == 3 else shapes[n][-1] for n in names}
        with Taps(model, names, graph=True) as cap:

            def forward(xr):
                cap.captures.clear()
                model(xr)
                return dict(cap.captures)

            sums = erf_sums(forward, x, dims, prefix, grid, max_images)
    return sums, shapes


def centre_window(
    shape: tuple, image_hw: tuple[int, int], prefix: int = 0, grid: tuple[int, int] | None = None
) -> tuple[int, int, int, int]:
    """(row0, row1, col0, col1), end exclusive: the input pixels of the centre location of a feature map of
    ``shape`` ([T, D] tokens on ``grid`` or [D, h, w])."""
    hh, ww = image_hw
    if len(shape) == 3:
        h, w = shape[1], shape[2]
    else:
        h, w = grid
    sh, sw = hh // h, ww // w
    ci, cj = h // 2, w // 2
    return ci * sh, (ci + 1) * sh, cj * sw, (cj + 1) * sw


def window_share(erf: torch.Tensor, window: tuple[int, int, int, int]) -> float:
    """Share of the map's mass inside ``window`` (row0, row1, col0, col1)."""
    r0, r1, c0, c1 = window
    e = erf.double()
    return float(e[r0:r1, c0:c1].sum() / e.sum())


def _distances(hw: tuple[int, int], window: tuple[int, int, int, int]) -> torch.Tensor:
    r0, r1, c0, c1 = window
    ys = torch.arange(hw[0], dtype=torch.float64) + 0.5 - (r0 + r1) / 2
    xs = torch.arange(hw[1], dtype=torch.float64) + 0.5 - (c0 + c1) / 2
    return (ys[:, None] ** 2 + xs[None, :] ** 2).sqrt()


def radius_share(erf: torch.Tensor, window: tuple[int, int, int, int], radius: float) -> float:
    """Share of the mass of pixels whose centres lie within ``radius`` pixels of the window's centre."""
    e = erf.double().cpu()
    return float(e[_distances(tuple(e.shape), window) <= radius + 1e-9].sum() / e.sum())


def mean_distance(erf: torch.Tensor, window: tuple[int, int, int, int]) -> float:
    """ERF-weighted mean pixel distance from the window's centre."""
    e = erf.double().cpu()
    return float((e * _distances(tuple(e.shape), window)).sum() / e.sum())


# ---------------------------------------------------------------- the measure


def targets_of(ctx: Context) -> list[tuple[str, str, str]]:
    """(block, variant, tap name) in a fixed order (VIT_TAPS / RESNET_TAPS order within a block)."""
    blocks = list(ctx.blocks) or block_names(unwrap(ctx.model))
    taps = VIT_TAPS if ctx.arch == "vit" else RESNET_TAPS
    return [(b, v, f"{b}.{k}") for b in blocks for v, k in taps.items()]


@dataclass(frozen=True)
class ERFOptions:
    images: int = 32  # the first analysis images whose gradients are averaged
    batch: int = 8  # images per chunk (chunk k on process k mod world)
    forward_images: int = _FORWARD_IMAGES  # images (copies x chunk) per forward: lower it for big models
    radius: float | None = None  # radius of the radius_share statistic in pixels (default: see assemble)

    def check(self):
        if self.images < 1 or self.batch < 1 or self.forward_images < 1:
            return (
                f"images, batch and forward_images must be >= 1, not {self.images}, {self.batch}, "
                f"{self.forward_images}."
            )
        return None


@register
class EffectiveReceptiveField(Measure):
    """Which input pixels a block's centre token depends on: effective receptive fields, after and before the residual.
    Raghu et al. 2021 Fig. 6, C.1-C.4, as in the module docstring. All work is in :meth:`finish`: the first ``images``
    (32) analysis images in chunks of ``batch`` (8), chunk k on process k mod world, ERF sums and the image count summed
    over processes in ONE float64 all-reduce, so 1 and N processes agree. Option ``forward_images`` (128) bounds the
    images per forward (copies x chunk, see :func:`erf_sums`): lower it for big models."""

    name = "erf"
    Options = ERFOptions
    needs_grad = True

    @classmethod
    def applies(cls, ctx: Context) -> bool:
        return ctx.arch in ("vit", "resnet")

    def _targets(self) -> list[tuple[str, str, str]]:
        return targets_of(self.ctx)

    @classmethod
    def cost(cls, ctx: Context, opts, n_images: int) -> dict[str, float]:
        """As :func:`erf_sums` works: per chunk of b images, k = forward_images // b copies (at most the channels D),
        ceil(D / k) rounds of one forward of k b images and, per tapped tensor, one backward of them from that tensor
        down to the input: a tensor of block i (of L) costs (i + 1) / L of a whole backward. The channel counts come
        from one no-grad forward of one image."""
        model = unwrap(ctx.model)
        targets = targets_of(ctx)
        names = [t[2] for t in targets]
        shapes = feature_shapes(model, ctx.data.normalize(ctx.data.analysis.images[:1].to(ctx.device)), names)
        dims = [s[0] if len(s) == 3 else s[-1] for s in (shapes[n] for n in names)]
        blocks = list(dict.fromkeys(t[0] for t in targets))
        depth = [(blocks.index(t[0]) + 1) / len(blocks) for t in targets]
        n = min(opts.images, n_images)
        forwards = backwards = 0.0
        for start in range(0, n, opts.batch):
            b = min(opts.batch, n - start)
            k = max(1, min(max(dims), opts.forward_images // b))
            forwards += -(-max(dims) // k) * k * b
            backwards += sum(-(-d // k) * k * b * f for d, f in zip(dims, depth))
        return {"forwards": forwards, "backwards": backwards}

    def finish(self) -> dict:
        ctx = self.ctx
        model = unwrap(ctx.model)
        images = ctx.data.analysis.images
        n = min(self.opts.images, len(images))
        bs, per_forward = self.opts.batch, self.opts.forward_images
        grid = (
            tuple(ctx.grid)
            if ctx.grid is not None
            else (tuple(model.patch_embed.grid_size) if ctx.arch == "vit" else None)
        )
        targets = self._targets()
        names = [t[2] for t in targets]
        hw = tuple(images.shape[-2:])
        sums = torch.zeros(len(names), *hw, dtype=torch.float64, device=ctx.device)
        count = torch.zeros(1, dtype=torch.float64, device=ctx.device)
        shapes = None
        chunks = list(shard((n + bs - 1) // bs, ctx.accelerator))
        mine = sum(min(n, (k + 1) * bs) - k * bs for k in chunks)
        with ctx.bar(mine, f"erf: {mine} images x {len(names)} maps", "image") as bar:
            for k in chunks:
                x = ctx.data.normalize(images[k * bs : min(n, (k + 1) * bs)].to(ctx.device))
                s, shapes = effective_receptive_fields(model, x, names, ctx.prefix, grid, per_forward)
                sums += torch.stack([s[nm] for nm in names])
                count += x.shape[0]
                bar.update(x.shape[0])
        if shapes is None:  # a process without images still needs the feature-map shapes (for the windows)
            shapes = feature_shapes(model, ctx.data.normalize(images[:1].to(ctx.device)), names)
        flat = all_reduce_sum(torch.cat([sums.reshape(-1), count]), ctx.accelerator)
        sums, count = flat[:-1].reshape(sums.shape).cpu(), float(flat[-1])
        return assemble(sums, names, targets, shapes, hw, count, ctx, grid, self.opts.radius)

    @staticmethod
    def summary(r: dict) -> dict:
        out = {"images": int(np.asarray(r["images"])), "radius": float(np.asarray(r["radius"]))}
        for prefix in ("", "attn_") if "attn_erf" in r else ("",):
            for i, v in enumerate(as_list(r["variants"])):
                for key in ("concentration", "radius_share", "mean_distance"):
                    out[f"{prefix}{key}_{v}"] = [float(a) for a in np.asarray(r[prefix + key])[:, i]]
        return out

    @staticmethod
    def scalars(r: dict) -> dict[str, float]:
        out = {}
        for prefix in ("", "attn_") if "attn_erf" in r else ("",):
            for i, v in enumerate(as_list(r["variants"])):
                for key in ("concentration", "mean_distance"):
                    vals = np.asarray(r[prefix + key])[:, i]
                    out.update({f"erf/{key}/{prefix}{v}/block{b:02d}": float(a) for b, a in enumerate(vals)})
        return out

    @staticmethod
    def figures(r: dict, step: int | None = None) -> dict:
        sfx = "" if step is None else f" (step {step})"
        return {
            "erf/maps": erf_grid(r, title="effective receptive fields" + sfx),
            "erf/concentration": concentration_plot(r, title="ERF concentration" + sfx),
        }


def assemble(
    sums: torch.Tensor,
    names: list[str],
    targets: list,
    shapes: dict,
    hw: tuple,
    count: float,
    ctx: Context,
    grid,
    radius=None,
) -> dict:
    """The result dict from summed ERF maps (one row per name, in ``targets`` order)."""
    blocks = list(dict.fromkeys(t[0] for t in targets))
    vit = ctx.arch == "vit"
    if radius is None:
        radius = float(ctx.patch_size) if (vit and ctx.patch_size) else max(hw) / 8
    windows = {b: centre_window(shapes[f"{b}.out"], hw, ctx.prefix, grid) for b in blocks}
    maps = {(b, v): sums[i] / sums[i].sum().clamp_min(1e-300) for i, (b, v, _) in enumerate(targets)}

    def pack(variants):
        erf = torch.stack([torch.stack([maps[(b, v)] for v in variants]) for b in blocks])
        conc = [[window_share(maps[(b, v)], windows[b]) for v in variants] for b in blocks]
        rad = [[radius_share(maps[(b, v)], windows[b], radius) for v in variants] for b in blocks]
        dist = [[mean_distance(maps[(b, v)], windows[b]) for v in variants] for b in blocks]
        return erf.numpy(), np.array(conc), np.array(rad), np.array(dist)

    r: dict = {}
    r["erf"], r["concentration"], r["radius_share"], r["mean_distance"] = pack(VARIANTS)
    if vit:
        r["attn_erf"], r["attn_concentration"], r["attn_radius_share"], r["attn_mean_distance"] = pack(
            ("attn_residual", "attn_branch")
        )
    r.update(
        window=np.array([windows[b] for b in blocks], dtype=np.int64),
        radius=float(radius),
        images=int(count),
        blocks=blocks,
        variants=list(VARIANTS),
        arch=str(ctx.arch),
    )
    return r


# ---------------------------------------------------------------- figures


def erf_grid(r: dict, title: str = "effective receptive fields"):
    """Raghu Fig. 6 / C.1-C.4: one ERF map per block (columns) and variant (rows), each divided by its own maximum
    (one colourbar from 0 to 1), with the centre location's input window outlined."""
    blocks = as_list(r["blocks"])
    rows = [
        ("post-residual" + (" (block out)" if "attn_erf" in r else ""), np.asarray(r["erf"])[:, 0]),
        ("branch" + (" (MLP)" if "attn_erf" in r else ""), np.asarray(r["erf"])[:, 1]),
    ]
    if "attn_erf" in r:
        rows = [
            ("attn post-residual", np.asarray(r["attn_erf"])[:, 0]),
            rows[0],
            ("attn branch", np.asarray(r["attn_erf"])[:, 1]),
            rows[1],
        ]
    win = np.asarray(r["window"])
    nb = len(blocks)
    fig, axes = subplots(
        len(rows), nb, figsize=(1.3 * nb + 2.0, 1.35 * len(rows) + 1.0), squeeze=False, layout="constrained"
    )
    im = None
    for i, (label, maps) in enumerate(rows):
        for b in range(nb):
            ax = axes[i, b]
            m = np.asarray(maps[b], dtype=float)
            top = float(np.nanmax(m)) if np.isfinite(m).any() else 1.0
            im = ax.imshow(m / (top if top > 0 else 1.0), cmap="viridis", interpolation="nearest", vmin=0, vmax=1)
            r0, r1, c0, c1 = (int(v) for v in win[b])
            ax.add_patch(Rectangle((c0 - 0.5, r0 - 0.5), c1 - c0, r1 - r0, fill=False, ec="w", lw=0.6, ls=":"))
            ax.set_xticks([])
            ax.set_yticks([])
            if i == 0:
                ax.set_title(f"block {b}", fontsize=6)
            if b == 0:
                ax.set_ylabel(label, fontsize=6)
    if im is not None:
        fig.colorbar(im, ax=axes.ravel().tolist(), shrink=0.8, aspect=30).set_label(
            "gradient magnitude / the map's maximum", fontsize=7
        )
    grid_labels(fig, "columns: blocks (0 = first); in each map: input pixel column", "in each map: input pixel row", 6)
    fig.suptitle(f"{title}\ndotted: the centre location's own input window", fontsize=8)
    return fig


def concentration_plot(r: dict, title: str = "ERF concentration"):
    """Share of ERF mass in the centre location's own input window (solid) and within the radius (dashed),
    per block and variant."""
    fig, ax = subplots(figsize=(5, 3.5))
    sets = [("", "")] + ([("attn_", "attn ")] if "attn_erf" in r else [])
    for key, label in sets:
        conc, rad = np.asarray(r[key + "concentration"]), np.asarray(r[key + "radius_share"])
        for i, v in enumerate(as_list(r["variants"])):
            (line,) = ax.plot(range(conc.shape[0]), conc[:, i], marker="o", ms=3, label=f"{label}{v}: centre window")
            ax.plot(
                range(rad.shape[0]),
                rad[:, i],
                ls="--",
                color=line.get_color(),
                lw=1,
                label=f"{label}{v}: r <= {float(np.asarray(r['radius'])):g} px",
            )
    return finish_block_axes(fig, ax, as_list(r["blocks"]), "share of ERF mass", title, ylim=(0, 1.02), legend_size=6)


__all__ = [
    "EffectiveReceptiveField",
    "centre_features",
    "centre_index",
    "centre_window",
    "effective_receptive_fields",
    "erf_sums",
    "feature_shapes",
    "mean_distance",
    "radius_share",
    "window_share",
]
