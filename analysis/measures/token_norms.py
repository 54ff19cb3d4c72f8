"""``token_norms`` -- token norms and high-norm outlier tokens per block (Darcet et al., "Vision Transformers Need
Registers", ICLR 2024), ViTs only.

Darcet et al. find that large, long-trained ViTs (DINOv2, OpenCLIP, DeiT-III) turn a few low-information patch tokens
into "high-norm" tokens: the norms of the output tokens form a bimodal histogram (their Fig. 3), the outliers about
10x the norm of the rest (the paper cuts at norm 150 for DINOv2 ViT-g); these tokens sit in redundant background
patches, keep little information about their own patch (a linear probe of their position or pixels does worse on
them than on normal tokens, Fig. 5b), carry global information (Table 1), and draw the CLS query's attention (Fig. 2).
Extra learnable "register" tokens remove them.

Definitions. For block i, ``X = blocks.i.out`` [B, p + N, D] (p prefix tokens: the class token, then registers; N =
gh * gw spatial tokens in row-major grid order), the norm of token t of image b is ``n[b, t] = ||X[b, t]||_2``.

- Norm distribution: ``quantiles`` [L, Q] of n over every SPATIAL token of every image (``quantile_levels``: 0.01,
  0.25, 0.5, 0.75, 0.99, 1.0); ``hist`` [L, bins] with log-spaced ``hist_edges`` [L, bins + 1] (spatial tokens);
  ``prefix_norm`` [L, p]: the median over images of each prefix token's norm (CLS, then registers).
- Outlier rule: spatial token t of image b is a HIGH-NORM OUTLIER at block i when

      n[b, t] > k * median_{t' spatial} n[b, t'],     k = option ``k``, default 4.

  The rule is relative to the image's own spatial tokens, so it transfers across widths and depths (Darcet's
  absolute cut, 150, is specific to the scale of DINOv2 ViT-g). k = 4 sits between the two modes of Darcet's
  histogram: the outliers are ~10x the rest, so k = 4 still finds outliers that are 2.5x weaker than theirs, while
  the bulk of a normal token distribution stays well below it (max / median over the 7x7 grid of the default ViT
  trained on Fashion-MNIST, and over the 16x16 grid of DINOv2 ViT-S/14 on photos, is reported as
  ``max_over_median``: docs/studies.md, "Registers and high-norm tokens"). Prefix tokens (CLS, registers) are never
  outliers: they are not patches.
- Per block: ``share_images`` [L] (images with at least one outlier / images), ``count`` [L] (outliers per image,
  mean over all images), ``outlier_map`` [L, gh, gw] (share of images whose token at that grid position is an
  outlier), ``max_over_median`` [L] (mean over images of max_t n / median_t n over spatial tokens).
- Local information (Darcet Fig. 5b): a linear classifier of a spatial token's own grid position (N classes) from its
  block-i features, each token L2-normalised first (its direction: the norm alone would tell outliers apart). It is
  fit (scikit-learn's RidgeClassifier on standardised features, alpha 1) on the NORMAL tokens of half of the probed
  images and scored on the normal and on the outlier tokens of the other half, and the other way round (two folds by
  image parity, so no token is scored by a probe that saw its image). ``probe_acc_normal`` / ``probe_acc_outlier``
  [L] (top-1, NaN without outliers), ``probe_n_outlier`` [L] (outliers scored), ``probe_chance`` = 1 / N. The first
  ``probe_images`` images (option) are probed. Streamed (:class:`PositionProbe`): each fold's classifier is fit from
  float64 sums over every normal token of its images (:class:`analysis.estimators.probing.StreamingRidge`, the same
  classifier as scikit-learn's to rounding), and of each probed image a seeded sample of at most ``probe_scored``
  normal and ``probe_scored`` outlier tokens is kept (float16) to be scored, so the probe's memory does not grow
  with the tokens; the scores are means over those samples.
- Attention absorbed: block i's attention ``A = blocks.i.attn_probs`` [B, H, T, T] reads block i's INPUT, so its
  outlier keys are the outliers of ``blocks.i.in`` by the same rule (block i-1's output; for block 0 the
  embeddings). Over the images with at least one outlier key: ``attn_cls_on_outliers`` [L] (mass of the CLS query's
  row on the outlier keys, mean over heads then images; NaN without a class token), ``attn_patch_on_outliers`` [L]
  (the same for the spatial queries that are not outliers, averaged over them), ``attn_uniform_on_outliers`` [L]
  (n_outliers / T, what uniform attention would give), ``attn_images`` [L] (images counted). Over all images, the
  mass on the register tokens: ``attn_cls_on_registers`` / ``attn_patch_on_registers`` [L] (NaN without registers).

Also ``blocks``, ``grid``, ``k``, ``num_prefix_tokens``, ``num_registers``, ``has_class_token``, ``n_images``.
:func:`first_outlier_step` reads the step at which outliers appear from a run's per-checkpoint results.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
from matplotlib.ticker import NullFormatter
from torch import Tensor

from analysis.engine.figures import grid_labels, subplots
from analysis.engine.measure import Context, Measure, as_list, register
from analysis.engine.reduce import all_reduce_tree, collect, gather_objects
from analysis.estimators.attention_maps import block_label
from analysis.estimators.features import has_class_token
from analysis.estimators.probing import StreamingRidge

QUANTILES = (0.01, 0.25, 0.5, 0.75, 0.99, 1.0)
BINS = 60


@dataclass(frozen=True)
class TokenNormOptions:
    k: float = 4.0  # outlier: norm > k x the median norm of the image's spatial tokens
    probe_images: int = 512  # images whose tokens feed the position probe (0: no probe)
    probe_scored: int = 32  # of each probed image, at most this many normal and this many outlier tokens are scored
    attention: bool = True  # attention mass on outliers and registers (needs attn_probs)

    def check(self) -> str | None:
        if not self.k > 1:
            return f"k ({self.k}) must be above 1: an outlier is a token k times the median norm."
        if self.probe_images < 0:
            return f"probe_images ({self.probe_images}) must be 0 or more."
        if self.probe_scored < 1:
            return f"probe_scored ({self.probe_scored}) must be 1 or more."
        return None


def token_norms(x: Tensor) -> Tensor:
    """[B, T] float32 L2 norms of the tokens of ``x`` [B, T, D]."""
    return torch.linalg.vector_norm(x.float(), dim=-1)


def outlier_mask(norms: Tensor, prefix: int, k: float) -> Tensor:
    """[B, N] bool: spatial token t of image b has norm above k x the median norm of b's spatial tokens (the
    rule of the module docstring). ``norms`` [B, p + N]."""
    spatial = norms[:, prefix:]
    med = spatial.median(dim=1, keepdim=True).values  # lower median for even N, as torch defines it
    return spatial > k * med


def first_outlier_step(results_by_step: dict, min_share: float = 0.1) -> int | None:
    """The first checkpoint step at which some block has a high-norm outlier in at least ``min_share`` of the
    images (``share_images`` of the token_norms result), or None: "no outlier at this budget". ``results_by_step``
    is ``{step: token_norms result}`` (fresh or loaded from ``token_norms.npz``)."""
    for step in sorted(results_by_step):
        if float(np.max(np.asarray(results_by_step[step]["share_images"]))) >= min_share:
            return int(step)
    return None


def load_run_results(run_path) -> dict:
    """``{step: token_norms result}`` of a run folder's offline analysis (runs/<name>/analysis/step_*/)."""
    from pathlib import Path

    from analysis.engine.measure import load_result

    out = {}
    for d in sorted(Path(run_path, "analysis").glob("step_*")):
        f = d / "token_norms.npz"
        if f.is_file() and d.name[5:].isdigit():
            out[int(d.name[5:])] = load_result(f)
    return out


class PositionProbe:
    """The two-fold position probe of the module docstring, streamed: for each fold (image parity) a ridge classifier
    fit from the moments of EVERY normal token of its images (:class:`analysis.estimators.probing.StreamingRidge`:
    D x D + D x N float64 per fold, whatever the number of images), scored on a bounded, seeded sample of the other
    fold's tokens: of each image at most ``scored`` normal and ``scored`` outlier tokens (float16 on the CPU, so the
    stored part is at most ``2 x scored x D x 2`` bytes per probed image and block)."""

    def __init__(self, dim: int, positions: int, scored: int):
        self.ridge = [StreamingRidge(dim, positions), StreamingRidge(dim, positions)]
        self.scored, self.positions = int(scored), int(positions)
        self.kept: list = []  # (image position, token positions [k], outlier flags [k], features [k, D] float16)

    def add(self, feats: Tensor, masks: Tensor, first: int) -> None:
        """``feats`` [B, N, D] of images at positions ``first..first+B-1`` (in the suite's minibatch order, the same
        on 1 and N processes), ``masks`` [B, N] bool (outliers)."""
        f = torch.nn.functional.normalize(feats.double(), dim=-1).cpu()
        m = masks.cpu()
        pos = torch.arange(self.positions).expand(f.shape[0], -1)
        for parity in (0, 1):
            sel = (torch.arange(first, first + f.shape[0]) % 2) == parity
            normal = ~m[sel]
            self.ridge[parity].add(f[sel][normal], pos[sel][normal])
        for i in range(f.shape[0]):
            order = torch.from_numpy(np.random.default_rng([0, first + i]).permutation(self.positions))
            mi = m[i][order]
            take = torch.cat([order[~mi][: self.scored], order[mi][: self.scored]])
            self.kept.append((first + i, take, m[i][take], f[i][take].to(torch.float16)))

    def state(self) -> dict:
        return {"ridge": [r.state() for r in self.ridge]}

    @staticmethod
    def result(state: dict, kept: list) -> tuple[float, float, int]:
        """(top-1 on normal tokens, top-1 on outlier tokens or NaN, outlier tokens scored) from the reduced sums and
        every process's scored sample."""
        fits = [StreamingRidge(1, 1).load(s).fit() for s in state["ridge"]]
        hits = {"normal": [0, 0], "outlier": [0, 0]}
        for img, take, out, f in kept:
            fitted = fits[1 - img % 2]  # the probe of the other fold: it never saw this image
            if fitted is None:
                continue
            pred = StreamingRidge.predict(fitted, f.double())
            for kind, sel in (("normal", ~out), ("outlier", out)):
                hits[kind][0] += int((pred[sel] == take[sel]).sum())
                hits[kind][1] += int(sel.sum())
        acc = {k: (h / t if t else math.nan) for k, (h, t) in hits.items()}
        return acc["normal"], acc["outlier"], hits["outlier"][1]


def _position_probe(feats: Tensor, masks: Tensor, scored: int = 1 << 30) -> tuple[float, float, int]:
    """The position probe of the module docstring on ``feats`` [B, N, D] held at once (``masks`` [B, N] bool
    outliers); every token scored unless ``scored`` bounds it per image and kind."""
    probe = PositionProbe(feats.shape[-1], feats.shape[1], scored)
    probe.add(feats, masks, 0)
    return probe.result(probe.state(), probe.kept)


@register
class TokenNorms(Measure):
    """Patch-token norms per block, and the high-norm outlier tokens that registers remove (Darcet et al. 2024).
    Definitions in the module docstring. ViTs only. Result: ``quantiles`` [L, Q], ``hist`` / ``hist_edges``,
    ``prefix_norm`` [L, p], ``share_images``, ``count``, ``outlier_map`` [L, gh, gw], ``max_over_median``,
    ``probe_acc_normal`` / ``probe_acc_outlier``, ``attn_cls_on_outliers`` / ``attn_patch_on_outliers`` /
    ``attn_cls_on_registers`` / ``attn_patch_on_registers``."""

    name = "token_norms"
    chunkable = True  # per-image sums / rows: a minibatch may come in chunks
    Options = TokenNormOptions
    version = 2  # 2: the position probe fits on every normal token (streamed sums) and scores a bounded sample

    @classmethod
    def applies(cls, ctx: Context) -> bool:
        return ctx.arch == "vit" and ctx.grid is not None

    def __init__(self, ctx, opts=None):
        super().__init__(ctx, opts)
        self.blocks = list(ctx.blocks)
        self.p = int(ctx.prefix)
        self.cls = has_class_token(ctx.model, self.p)
        self.regs = self.p - int(self.cls)
        self.parts: list = []
        self.sums: dict[str, dict[str, Tensor]] = {}
        self.probes: dict[str, PositionProbe] = {}
        self._at = (-1, 0)  # (minibatch, images of it seen): a minibatch may come in several chunks

    def taps(self):
        t = {f"{b}.out" for b in self.blocks}
        if self.opts.attention:
            t |= {f"{b}.in" for b in self.blocks} | {f"{b}.attn_probs" for b in self.blocks}
        return t

    def _attention_sums(self, attn: Tensor, keys_out: Tensor) -> dict[str, Tensor]:
        """float64 sums over the images of one minibatch (module docstring); ``keys_out`` [B, N] outlier keys."""
        a = attn.double().mean(1)  # [B, T, T], mean over heads
        p, has = self.p, keys_out.any(1)
        out_cols = torch.nn.functional.pad(keys_out, (p, 0)).to(a.dtype)  # [B, T]
        on_out = a @ out_cols[:, :, None]  # [B, T, 1]: each query's mass on the outlier keys
        q_normal = (~keys_out).to(a.dtype)  # spatial queries that are not outliers
        patch_on = (on_out[:, p:, 0] * q_normal).sum(1) / q_normal.sum(1).clamp_min(1)
        z = torch.zeros((), dtype=torch.float64, device=a.device)
        s = {
            "images_out": has.double().sum(),
            "patch_on_out": torch.where(has, patch_on, z).sum(),
            "uniform_on_out": torch.where(has, keys_out.double().sum(1) / a.shape[-1], z).sum(),
            "images": torch.tensor(float(a.shape[0]), dtype=torch.float64, device=a.device),
        }
        s["cls_on_out"] = torch.where(has, on_out[:, 0, 0], z).sum() if self.cls else z
        if self.regs:
            reg = slice(int(self.cls), p)
            s["cls_on_reg"] = a[:, 0, reg].sum() if self.cls else z
            s["patch_on_reg"] = a[:, p:, reg].sum(-1).mean(1).sum()
        return s

    def update(self, j, cap, x, y):
        part = {}
        seen = self._at[1] if self._at[0] == j else 0
        first = j * self.ctx.batch_size + seen  # the first image's position in minibatch order
        self._at = (j, seen + len(y))
        n_probe = min(len(y), max(0, self.opts.probe_images - first))
        for b in self.blocks:
            out = cap[f"{b}.out"]
            norms = token_norms(out)
            part[f"norm|{b}"] = norms.cpu()
            if n_probe:
                gh, gw = self.ctx.grid
                probe = self.probes.setdefault(b, PositionProbe(out.shape[-1], gh * gw, self.opts.probe_scored))
                mask = outlier_mask(norms[:n_probe].double(), self.p, self.opts.k)
                probe.add(out[:n_probe, self.p :], mask, first)
            if self.opts.attention:
                keys_out = outlier_mask(token_norms(cap[f"{b}.in"]), self.p, self.opts.k)
                s = self._attention_sums(cap[f"{b}.attn_probs"], keys_out)
                acc = self.sums.setdefault(b, {k: torch.zeros((), dtype=torch.float64) for k in s})
                for k, v in s.items():
                    acc[k] += v.cpu()
        self.parts.append((j, part, y))

    def finish(self) -> dict:
        # every process collects the norms (N x L x T float32: what grows with the images); the position probes'
        # sums are reduced and their scored samples gathered
        norms, _ = collect(self.parts, self.ctx.accelerator)
        sums = all_reduce_tree(self.sums or None, self.ctx.accelerator) or {}
        probing = self.opts.probe_images > 0
        if probing:
            states = all_reduce_tree({b: pr.state() for b, pr in self.probes.items()} or None, self.ctx.accelerator)
            kept = gather_objects([(b, pr.kept) for b, pr in self.probes.items()], self.ctx.accelerator)
            samples: dict = {}
            for b, k_ in kept:
                samples.setdefault(b, []).extend(k_)
        gh, gw = self.ctx.grid
        k, p, n_blocks = float(self.opts.k), self.p, len(self.blocks)
        nan = np.full(n_blocks, np.nan)
        r = {
            "quantiles": np.zeros((n_blocks, len(QUANTILES))),
            "hist": np.zeros((n_blocks, BINS)),
            "hist_edges": np.zeros((n_blocks, BINS + 1)),
            "prefix_norm": np.zeros((n_blocks, p)),
            "median_norm": np.zeros(n_blocks),
            "share_images": np.zeros(n_blocks),
            "count": np.zeros(n_blocks),
            "outlier_map": np.zeros((n_blocks, gh, gw)),
            "max_over_median": np.zeros(n_blocks),
            "probe_acc_normal": nan.copy(),
            "probe_acc_outlier": nan.copy(),
            "probe_n_outlier": np.zeros(n_blocks, dtype=np.int64),
        }
        for i, b in enumerate(self.blocks):
            n = norms[f"norm|{b}"].double()  # [B, T]
            sp = n[:, p:]
            mask = outlier_mask(n, p, k)
            r["quantiles"][i] = torch.quantile(sp.flatten(), torch.tensor(QUANTILES, dtype=torch.float64)).numpy()
            lo, hi = max(float(sp.min()), 1e-12), max(float(sp.max()), 1e-12)
            edges = np.geomspace(lo, hi * (1 + 1e-9) if hi > lo else lo * 2, BINS + 1)
            r["hist"][i] = np.histogram(sp.numpy().ravel(), bins=edges)[0]
            r["hist_edges"][i] = edges
            if p:
                r["prefix_norm"][i] = n[:, :p].median(0).values.numpy()
            med = sp.median(1).values
            r["median_norm"][i] = float(med.median())
            r["share_images"][i] = float(mask.any(1).double().mean())
            r["count"][i] = float(mask.double().sum(1).mean())
            r["outlier_map"][i] = mask.double().mean(0).reshape(gh, gw).numpy()
            r["max_over_median"][i] = float((sp.max(1).values / med.clamp_min(1e-12)).mean())
            if probing and states and b in states:
                acc_n, acc_o, n_o = PositionProbe.result(states[b], samples.get(b, []))
                r["probe_acc_normal"][i], r["probe_acc_outlier"][i], r["probe_n_outlier"][i] = acc_n, acc_o, n_o
        if self.opts.attention:
            for key, num, den in (
                ("attn_cls_on_outliers", "cls_on_out", "images_out"),
                ("attn_patch_on_outliers", "patch_on_out", "images_out"),
                ("attn_uniform_on_outliers", "uniform_on_out", "images_out"),
                ("attn_cls_on_registers", "cls_on_reg", "images"),
                ("attn_patch_on_registers", "patch_on_reg", "images"),
            ):
                vals = nan.copy()
                for i, b in enumerate(self.blocks):
                    s = sums.get(b, {})
                    if num in s and float(s[den]) > 0 and (self.cls or "cls" not in num):
                        vals[i] = float(s[num] / s[den])
                r[key] = vals
            r["attn_images"] = np.array([float(sums.get(b, {}).get("images_out", 0.0)) for b in self.blocks])
        n_images = int(norms[f"norm|{self.blocks[0]}"].shape[0]) if self.blocks else 0
        r.update(
            quantile_levels=np.array(QUANTILES),
            probe_chance=1.0 / (gh * gw),
            blocks=list(self.blocks),
            grid=np.array([gh, gw]),
            k=k,
            num_prefix_tokens=p,
            num_registers=self.regs,
            has_class_token=int(self.cls),
            n_images=n_images,
        )
        return r

    @staticmethod
    def summary(r: dict) -> dict:
        blocks = as_list(r["blocks"])
        lab = [block_label(b, i) for i, b in enumerate(blocks)]
        levels = [float(q) for q in np.asarray(r["quantile_levels"])]
        quant = np.asarray(r["quantiles"])

        def per_block(key):
            if key not in r:
                return None
            return {lab[i]: (None if not np.isfinite(v) else float(v)) for i, v in enumerate(np.asarray(r[key]))}

        out = {
            "k": float(r["k"]),
            "n_images": int(r["n_images"]),
            "quantiles_per_block": {
                lab[i]: {f"q{q:g}": float(v) for q, v in zip(levels, quant[i], strict=True)} for i in range(len(lab))
            },
            "max_share_images": float(np.max(np.asarray(r["share_images"]))) if len(lab) else 0.0,
        }
        for key in (
            "share_images",
            "count",
            "max_over_median",
            "probe_acc_normal",
            "probe_acc_outlier",
            "attn_cls_on_outliers",
            "attn_patch_on_outliers",
            "attn_uniform_on_outliers",
            "attn_cls_on_registers",
            "attn_patch_on_registers",
        ):
            v = per_block(key)
            if v is not None:
                out[f"{key}_per_block"] = v
        return out

    @staticmethod
    def scalars(r: dict) -> dict[str, float]:
        out = {}
        blocks = as_list(r["blocks"])
        levels = np.asarray(r["quantile_levels"])
        for i, b in enumerate(blocks):
            lab = block_label(b, i)
            for q, v in zip(levels, np.asarray(r["quantiles"])[i], strict=True):
                out[f"token_norms/q{float(q):g}/{lab}"] = float(v)
            for key in ("share_images", "count", "max_over_median", "attn_cls_on_outliers", "attn_cls_on_registers"):
                if key in r and np.isfinite(np.asarray(r[key])[i]):
                    out[f"token_norms/{key}/{lab}"] = float(np.asarray(r[key])[i])
        return out

    @staticmethod
    def figures(r: dict, step: int | None = None) -> dict:
        at = f", step {step}" if step is not None else ""
        blocks = as_list(r["blocks"])
        return {
            "token_norms/histogram": norm_histograms(r, blocks, at),
            "token_norms/outlier_map": outlier_maps(r, blocks, at),
        }


def _panel_grid(n: int, size: float):
    cols = min(n, 4)
    rows = max(1, math.ceil(n / cols))
    fig, axes = subplots(rows, cols, figsize=(0.6 + size * cols, 0.8 + size * 0.8 * rows), squeeze=False)
    for ax in axes.ravel()[n:]:
        ax.set_visible(False)
    return fig, axes.ravel()


def norm_histograms(r: dict, blocks: list[str], at: str = ""):
    """One log-x histogram of the spatial tokens' output norms per block (Darcet et al. 2024 Fig. 3), with the
    outlier cut (k x the median of the per-image medians, dashed) and the prefix tokens' median norms (CLS red,
    registers orange)."""
    hist, edges = np.asarray(r["hist"]), np.asarray(r["hist_edges"])
    k, pre = float(r["k"]), np.asarray(r["prefix_norm"])
    cls = bool(int(r["has_class_token"]))
    fig, axes = _panel_grid(len(blocks), 2.6)
    for i, ax in enumerate(axes[: len(blocks)]):
        ax.stairs(hist[i], edges[i], fill=True, color="tab:blue", alpha=0.7)
        ax.set_xscale("log")
        ax.set_yscale("symlog", linthresh=1)
        ax.axvline(k * float(np.asarray(r["median_norm"])[i]), color="k", ls="--", lw=0.8)
        for t in range(pre.shape[1] if pre.ndim == 2 else 0):
            ax.axvline(pre[i, t], color="red" if cls and t == 0 else "orange", lw=0.8)
        ax.set_title(
            f"{block_label(blocks[i], i)}: {100 * float(np.asarray(r['share_images'])[i]):.0f}% of images", fontsize=7
        )
        ax.xaxis.set_minor_formatter(NullFormatter())  # log-axis minor labels overlap in small panels
        ax.tick_params(which="both", labelsize=6)
        ax.set_xlabel("token norm ||x||", fontsize=6)
        ax.set_ylabel("patch tokens", fontsize=6)
    fig.suptitle(
        f"output token norms of the patch tokens (Darcet et al. 2024 Fig. 3){at}\ndashed: outlier cut "
        f"{k:g} x median; red: CLS, orange: registers (median norms); title: images with an outlier",
        fontsize=7,
    )
    fig.tight_layout()
    return fig


def outlier_maps(r: dict, blocks: list[str], at: str = ""):
    """Per block the share of images whose token at each grid position is a high-norm outlier."""
    maps = np.asarray(r["outlier_map"])
    fig, axes = _panel_grid(len(blocks), 1.8)
    top = float(maps.max()) or 1.0  # no outlier anywhere: a 0-1 scale, all black
    for i, ax in enumerate(axes[: len(blocks)]):
        im = ax.imshow(maps[i], cmap="magma", vmin=0.0, vmax=top, interpolation="nearest")
        ax.set_xticks([])
        ax.set_yticks([])
        ax.set_title(f"{block_label(blocks[i], i)}: {float(np.asarray(r['count'])[i]):.2f}/image", fontsize=7)
    fig.colorbar(im, ax=list(axes[: len(blocks)]), fraction=0.03).set_label("share of images", fontsize=7)
    grid_labels(fig, "patch column", "patch row")
    fig.suptitle(
        f"where the high-norm outlier tokens are (norm > {float(r['k']):g} x the image's median){at}\n"
        "share of images whose patch token there is an outlier; title: outliers per image",
        fontsize=7,
    )
    return fig
