"""How much of each residual sublayer's output comes through the skip connection (Raghu et al. 2021 §6,
Fig. 7 and E.1; cosine: Fig. E.2).

For block i and sublayer s in {attn, mlp}, with z the residual-stream input to the sublayer (the skip path)
and f(z) its branch output (after layer scale / drop path), per token t:

    norm ratio   r_t = ||z_t||_2 / ||f(z)_t||_2,   averaged over images (the mean of per-image ratios);
    cosine       c_t = <z_t, f(z)_t> / (||z_t|| ||f(z)_t||), averaged over images.

Token 0 is CLS in CLS ViTs. For a ResNet block, z is the shortcut (identity or downsample output), f(z) the
residual branch, and the "tokens" are the spatial positions of the feature map (channels are the vector).
"""

from __future__ import annotations

import numpy as np
import torch

from analysis.engine.figures import norm_ratio_heatmap, norm_ratio_lines
from analysis.engine.measure import Measure, as_list, register
from analysis.engine.reduce import all_reduce_tree

EPS = 1e-12


def _tokens(t: torch.Tensor) -> torch.Tensor:
    """[B, T, D] stays; [B, C, H, W] -> [B, H*W, C]."""
    return t.flatten(2).transpose(1, 2) if t.ndim == 4 else t


def _ratio_cosine(skip: torch.Tensor, branch: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per image and token ([B, T], float64): ||z_t|| / ||f_t|| and <z_t, f_t> / (||z_t|| ||f_t||).

    Norms and dot products are taken in float32 (float64 when both inputs are float64): each is a sum over one
    token's D channels, ~1e-7 relative in float32, and the float64 results carry the sums over images. Copying
    every tapped tensor to float64 first cost about twice as much."""
    z, f = _tokens(skip), _tokens(branch)
    if not (z.dtype == f.dtype == torch.float64):
        z, f = z.float(), f.float()
    nz, nf = torch.linalg.vector_norm(z, dim=-1).double(), torch.linalg.vector_norm(f, dim=-1).double()
    dot = torch.linalg.vecdot(z, f, dim=-1).double()
    return nz / nf.clamp_min(EPS), dot / (nz * nf).clamp_min(EPS)


def norm_ratio(skip: torch.Tensor, branch: torch.Tensor) -> torch.Tensor:
    """[T]: mean over images of ||skip_t|| / ||branch_t|| (see the module docstring)."""
    return _ratio_cosine(skip, branch)[0].mean(0)


def cosine(skip: torch.Tensor, branch: torch.Tensor) -> torch.Tensor:
    """[T]: mean over images of the cosine similarity of skip_t and branch_t."""
    return _ratio_cosine(skip, branch)[1].mean(0)


class NormRatio:
    """Accumulates per-token sums of the norm ratio and cosine over images, per (block, sublayer)."""

    def __init__(self):
        self.ratio: dict[tuple[str, str], torch.Tensor] = {}
        self.cos: dict[tuple[str, str], torch.Tensor] = {}
        self.count: dict[tuple[str, str], torch.Tensor] = {}

    @torch.no_grad()
    def update(self, block: str, sublayer: str, skip: torch.Tensor, branch: torch.Tensor) -> None:
        ratio, cos = _ratio_cosine(skip, branch)
        r, c = ratio.sum(0).cpu(), cos.sum(0).cpu()
        key = (block, sublayer)
        if key not in self.ratio:
            self.ratio[key], self.cos[key], self.count[key] = (
                r,
                c,
                torch.tensor(float(ratio.shape[0]), dtype=torch.float64),
            )
        else:
            self.ratio[key] += r
            self.cos[key] += c
            self.count[key] += ratio.shape[0]

    def sync(self, accelerator=None) -> None:
        """Sum the accumulators over processes in one all-reduce (a no-op with one process; a process that saw no
        minibatch adds zeros)."""
        state = {f"{b}|{s}": [self.ratio[(b, s)], self.cos[(b, s)], self.count[(b, s)]] for b, s in self.ratio} or None
        state = all_reduce_tree(state, accelerator)
        for key, (r, c, n) in (state or {}).items():
            b, s = key.split("|")
            self.ratio[(b, s)], self.cos[(b, s)], self.count[(b, s)] = r, c, n

    def compute(self) -> dict[tuple[str, str], tuple[torch.Tensor, torch.Tensor]]:
        """{(block, sublayer): (ratio [T], cosine [T])}."""
        return {k: (self.ratio[k] / self.count[k], self.cos[k] / self.count[k]) for k in self.ratio}


# ---------------------------------------------------------------- the suite's measure


@register
class NormRatioMeasure(Measure):
    """How much the skip path dominates: norm of the skip path over the branch's, per token, block and sublayer.
    Raghu et al. 2021 Fig. 7 (left: per token and block; right: CLS vs spatial tokens) and E.2 (cosine).
    ViT: sublayers attn (z = block input, f = attention branch) and mlp (z = stream after attention, f = MLP
    branch); Mixer: token and channel mixing likewise; ResNet: one "block" sublayer (shortcut vs branch),
    positions averaged since stages differ in size. Result: ``ratio`` and ``cosine`` [S, L, T] (ResNet
    [1, L, 1]), ``sublayers``, ``blocks``, ``num_prefix_tokens``."""

    name = "norm_ratio"
    chunkable = True  # per-image sums / rows: a minibatch may come in chunks

    def __init__(self, ctx, opts=None):
        super().__init__(ctx, opts)
        self.acc = NormRatio()
        self.tokens = ctx.arch in ("vit", "mixer")
        self.pairs = (
            {"attn": ("in", "attn_branch"), "mlp": ("attn_out", "mlp_branch")}
            if self.tokens
            else {"block": ("shortcut", "branch")}
        )

    def taps(self):
        return {f"{b}.{k}" for b in self.ctx.blocks for pair in self.pairs.values() for k in pair}

    def update(self, j, cap, x, y):
        for b in self.ctx.blocks:
            for sub, (z, f) in self.pairs.items():
                self.acc.update(b, sub, cap[f"{b}.{z}"], cap[f"{b}.{f}"])

    def finish(self):
        self.acc.sync(self.ctx.accelerator)
        res = self.acc.compute()
        per = (lambda v: v.numpy()) if self.tokens else (lambda v: v.mean(0, keepdim=True).numpy())
        subs, blocks = list(self.pairs), list(self.ctx.blocks)
        return {
            "ratio": np.stack([np.stack([per(res[(b, s)][0]) for b in blocks]) for s in subs]),
            "cosine": np.stack([np.stack([per(res[(b, s)][1]) for b in blocks]) for s in subs]),
            "sublayers": subs,
            "blocks": blocks,
            "num_prefix_tokens": int(self.ctx.prefix),
        }

    @staticmethod
    def curves(r) -> dict:
        """{"<sublayer>/cls": [L], "<sublayer>/spatial": [L]}: the CLS token's ratio and the spatial tokens' mean."""
        ratio, p = np.asarray(r["ratio"]), int(r["num_prefix_tokens"])
        out = {}
        for si, sub in enumerate(as_list(r["sublayers"])):
            if p:
                out[f"{sub}/cls"] = ratio[si, :, 0]
            out[f"{sub}/spatial"] = ratio[si, :, p:].mean(-1)
        return out

    @staticmethod
    def summary(r):
        return {k: [float(v) for v in c] for k, c in NormRatioMeasure.curves(r).items()}

    @staticmethod
    def scalars(r):
        return {
            f"norm_ratio/{k}/block{i:02d}": float(v)
            for k, c in NormRatioMeasure.curves(r).items()
            for i, v in enumerate(c)
        }

    @staticmethod
    def figures(r, step=None):
        at = f" (step {step})" if step is not None else ""
        p, blocks = int(r["num_prefix_tokens"]), [b.split(".", 1)[-1] for b in as_list(r["blocks"])]
        figs = {
            f"norm_ratio/{sub}": norm_ratio_heatmap(
                np.asarray(r["ratio"])[si], blocks, title=f"norm ratio, {sub}{at}", has_cls=p > 0
            )
            for si, sub in enumerate(as_list(r["sublayers"]))
        }
        curves = {k.replace("/", " ").replace("cls", "CLS"): v for k, v in NormRatioMeasure.curves(r).items()}
        figs["norm_ratio/lines"] = norm_ratio_lines(curves, title=f"norm ratio ||z||/||f(z)||{at}")
        return figs
