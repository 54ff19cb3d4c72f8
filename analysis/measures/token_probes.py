"""Per-token few-shot linear probes (Raghu et al. 2021 §7 "Localization and Linear Probe Classification", Fig. 11 left
and Fig. D.4).

Definition. For every layer (block output) and every SPATIAL token t of it (its grid position), a 10-shot linear
probe is trained on that single token's features alone and scored on the analysis images. A ResNet "token" follows
Raghu App. A ("before pooling we split the feature map into patches and flattened each patch [...] All results
presented in the paper include this additional patching step"): by default (option ``resnet_tokens: patch``) the
block's map [B, C, H, W] is cut into p x p patches, each flattened to C p^2 values, p the largest with C p^2 at most
the final block's channels (option ``resnet_patch`` fixes p), then average-pooled to at most ``resnet_max_side``
(default 7) per side; ``resnet_tokens: pool`` skips the patching (one token = the C channels at a pooled position,
this project's earlier definition). Exact rule and where it departs from the paper (the pooled size: App. A pools to
the last stage's size) in analysis/estimators/features.py.

    acc[l, t] = mean over seeds s of fewshot_probe(F_l,t[shots_s], y[shots_s], F_l,t[analysis], y[analysis])
    std[l, t] = sample std over seeds (0 for one seed)

with the probe of analysis.estimators.probing (closed-form ridge onto {-1, 1}^K targets, ViT paper §4.1, Raghu App. A;
option ``method``, default ``big_vision``: the features of the shots standardised, a constant bias feature 100
appended, as
big_vision's fewshot_lsr; ``centred``: the project's earlier centred fit -- exact formulas in
analysis/estimators/probing.py)
run through :func:`analysis.estimators.probing.probe_layers`, under exactly the conventions of the suite's per-layer
probes (analysis/estimators/probing.py :func:`probe_split`): the probe-train split is halved class-balanced with
``train.splits.balanced_indices(labels, n // 2, seed=12345)``; the shots (option ``shots`` per class, default 10) of
seed s are drawn from that first half by ``sample_shots(labels, shots, s)`` (option ``seeds``, default (0, 1, 2)),
and the ridge regulariser (option ``l2``) is, by default (null), picked on the second half from the method's grid,
as Raghu App. A tunes on held-out data (a number fixes it; 1024 is big_vision's). ``mean_over_tokens[l]`` is the
mean of ``acc[l]`` over the spatial tokens (Fig. 11 left: CLS excluded); a CLS model's class token (token 0) gets
the same probe, ``cls_acc[l]`` (a register model's registers are prefix tokens, not probed).
With option ``stride`` s > 1 only the grid positions whose row and column are multiples of s are probed.

Result (flat dict): ``layers`` [L] tap names, ``block_index`` [L], ``grid`` [L, 2] (gh, gw), ``token_index``
[L, Tmax] (row-major grid index of each probed token, -1 padding), ``acc`` / ``std`` [L, Tmax] (NaN padding: a
layer with fewer probed tokens, e.g. the last ResNet stage), ``mean_over_tokens`` [L], ``cls_acc`` / ``cls_std``
[L] (CLS models only), ``shots``, ``seeds``, ``stride``, ``chance`` (1 / classes), ``method``, ``token_dim`` [L]
(features per token: D, or C p^2 for patched ResNet maps). Features are kept as float32 on
the CPU; the probes themselves run in float64.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch

from analysis.engine.figures import grid_labels, subplots
from analysis.engine.measure import Context, Measure, as_list, labels_problem, register
from analysis.engine.reduce import collect
from analysis.estimators.features import (
    DEFAULT_MAX_SIDE,
    final_channels,
    has_class_token,
    layer_tag,
    resnet_patch_side,
    restored,
    spatial_tokens,
    stored,
)
from analysis.estimators.probing import (
    DEFAULT_METHOD,
    expand_rows,
    probe_layers,
    probe_rows_read,
    probe_split,
    probe_split_problem,
)


@dataclass(frozen=True)
class TokenProbeOptions:
    shots: int = 10  # examples per class
    seeds: tuple[int, ...] = (0, 1, 2)
    stride: int = 1  # probe the grid positions whose row and column are multiples of stride
    method: Literal["big_vision", "centred"] = DEFAULT_METHOD  # the probe's fit (analysis/estimators/probing.py)
    l2: float | None = None  # ridge l2; None: picked on the held-out half from the method's grid
    resnet_tokens: Literal["patch", "pool"] = "patch"  # Raghu App. A patching step, or plain pooling
    resnet_patch: int = 0  # patch side for resnet_tokens=patch; 0: automatic (analysis/estimators/features.py)
    resnet_max_side: int = DEFAULT_MAX_SIDE  # ResNet maps larger than this per side are average-pooled to it

    def check(self):
        if self.shots < 1 or self.stride < 1 or not self.seeds:
            return (
                "shots and stride must be >= 1 and seeds not empty, not "
                f"shots={self.shots}, stride={self.stride}, seeds={list(self.seeds)}."
            )
        if self.l2 is not None and self.l2 <= 0:
            return f"l2 must be a positive number (or null to pick it on held-out images), not {self.l2}."
        if self.resnet_patch < 0 or self.resnet_max_side < 1:
            return (
                f"resnet_patch must be >= 0 and resnet_max_side >= 1, not {self.resnet_patch} and "
                f"{self.resnet_max_side}."
            )
        return None


# ---------------------------------------------------------------- the definition, on tensors


def strided_positions(grid: tuple[int, int], stride: int = 1) -> torch.Tensor:
    """Row-major indices of the grid positions whose row and column are multiples of ``stride``."""
    if stride < 1:
        raise ValueError(f"token stride must be >= 1, got {stride}")
    gh, gw = grid
    return torch.tensor([r * gw + c for r in range(0, gh, stride) for c in range(0, gw, stride)], dtype=torch.long)


def token_probe_accuracies(
    train_x: torch.Tensor,
    train_y: torch.Tensor,
    test_x: torch.Tensor,
    test_y: torch.Tensor,
    shots: int = 10,
    seeds: Sequence[int] = (0, 1, 2),
    val_x: torch.Tensor | None = None,
    val_y: torch.Tensor | None = None,
    num_classes: int | None = None,
    method: str = DEFAULT_METHOD,
    l2: float | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """(acc [T], std [T]): a few-shot probe per token of ``train_x`` [n, T, D] on that token's features only, scored on
    ``test_x`` [m, T, D] (``l2`` fixed, or picked on ``val_x`` [v, T, D] when given), via
    :func:`analysis.estimators.probing.probe_layers` with ``method`` (shots drawn per seed from ``train_y``, the same
    images for every token)."""
    tokens = range(train_x.shape[1])
    tr = {str(t): train_x[:, t] for t in tokens}
    te = {str(t): test_x[:, t] for t in tokens}
    va = None if val_x is None else {str(t): val_x[:, t] for t in tokens}
    r = probe_layers(
        tr,
        train_y,
        te,
        test_y,
        shots=shots,
        seeds=tuple(seeds),
        val_feats=va,
        val_y=val_y,
        num_classes=num_classes,
        l2_grid=l2,
        method=method,
    )
    return np.array([r[str(t)][0] for t in tokens]), np.array([r[str(t)][1] for t in tokens])


# ---------------------------------------------------------------- the measure


@register
class TokenProbes(Measure):
    """Where the class evidence sits: a 10-shot linear probe of every single token of every block.
    Raghu et al. 2021 Fig. 11 left: mean over spatial tokens vs depth; Fig. D.4: accuracy of every token. ``acc[l, t]``
    = top-1 on the analysis images of a probe trained on token t of block l alone; exact definition and the shot /
    regulariser splits (the suite's) in the module docstring. Options: ``shots`` (10), ``seeds`` ((0, 1, 2)), ``stride``
    (1), ``method`` (``big_vision``), ``l2`` (null: held-out), ``resnet_tokens`` (``patch``, Raghu App. A),
    ``resnet_patch`` (0: auto), ``resnet_max_side`` (7)."""

    name = "token_probes"
    chunkable = True  # per-image sums / rows: a minibatch may come in chunks
    version = 2  # 2: per-image features kept as float16 (analysis.estimators.features.stored)
    uses_labels = "probe"
    Options = TokenProbeOptions

    @classmethod
    def problem(cls, data, opts):
        return labels_problem(data, probe=True) or probe_split_problem(data, opts.shots, cls.name)

    def __init__(self, ctx: Context, opts=None):
        super().__init__(ctx, opts)
        self.layers = [f"{b}.out" for b in ctx.blocks]
        self.shots, self.seeds, self.stride = self.opts.shots, tuple(self.opts.seeds), self.opts.stride
        self.max_side = self.opts.resnet_max_side
        self.final = final_channels(ctx.model) if ctx.arch == "resnet" else None
        self.cls = ctx.arch == "vit" and has_class_token(ctx.model, ctx.prefix)  # not a register model's token 0
        self.test_parts: list = []
        self.train_parts: list = []

    def taps(self) -> set[str]:
        return set(self.layers)

    def probe_taps(self) -> set[str]:
        return set(self.layers)

    def _features(self, cap: dict) -> dict:
        feats = {}
        for lay in self.layers:
            t = cap[lay]
            p = (
                resnet_patch_side(t.shape, self.final, self.opts.resnet_tokens, self.opts.resnet_patch, self.max_side)
                if t.ndim == 4
                else 1
            )
            tokens, grid = spatial_tokens(t, self.ctx.prefix, self.ctx.grid, self.max_side, p)
            feats[f"{lay}|grid"] = torch.tensor([grid], dtype=torch.long).expand(tokens.shape[0], 2)
            feats[lay] = stored(tokens[:, strided_positions(grid, self.stride).to(tokens.device)])
            if self.cls:
                feats[f"{lay}|cls"] = stored(t[:, 0])
        return feats

    @torch.no_grad()
    def update(self, j, cap, x, y) -> None:
        self.test_parts.append((j, self._features(cap), y.cpu()))

    @torch.no_grad()
    def update_probe(self, j, cap, x, y) -> None:
        self.train_parts.append((j, self._features(cap), y.cpu()))

    def probe_rows(self, labels):
        """The shots of every seed and, with l2 picked on it (null), the held-out half: all that finish reads."""
        return probe_rows_read(labels, self.shots, self.seeds, self.opts.l2)

    def finish(self) -> dict:
        acc = self.ctx.accelerator
        test_x, test_y = collect(self.test_parts, acc)
        pool_x, pool_y = collect(self.train_parts, acc)
        test_x, pool_x = restored(test_x), restored(pool_x)
        if self.probe_index is not None:  # only probe_rows were forwarded: full-size features, unread rows zero
            pool_x, pool_y = expand_rows(pool_x, pool_y, self.probe_index, self.ctx.data.probe_train.labels)
        k = int(self.ctx.data.num_classes)
        shot_idx, val_idx = probe_split(pool_y)
        tr_y, va_y = pool_y[shot_idx], pool_y[val_idx]
        accs, stds, cls_acc, cls_std, grids, index = [], [], [], [], [], []
        for lay in self.layers:
            x = pool_x[lay]
            a, s = token_probe_accuracies(
                x[shot_idx],
                tr_y,
                test_x[lay],
                test_y,
                self.shots,
                self.seeds,
                x[val_idx],
                va_y,
                num_classes=k,
                method=self.opts.method,
                l2=self.opts.l2,
            )
            accs.append(a)
            stds.append(s)
            grid = tuple(int(v) for v in test_x[f"{lay}|grid"][0].tolist())
            grids.append(grid)
            index.append(strided_positions(grid, self.stride).numpy())
            if self.cls:
                c = pool_x[f"{lay}|cls"]
                r = probe_layers(
                    {"cls": c[shot_idx]},
                    tr_y,
                    {"cls": test_x[f"{lay}|cls"]},
                    test_y,
                    shots=self.shots,
                    seeds=self.seeds,
                    val_feats={"cls": c[val_idx]},
                    val_y=va_y,
                    num_classes=k,
                    l2_grid=self.opts.l2,
                    method=self.opts.method,
                )["cls"]
                cls_acc.append(r[0])
                cls_std.append(r[1])
        size = max(len(a) for a in accs)

        def pad(vs, fill):
            return np.stack([np.concatenate([v, np.full(size - len(v), fill, dtype=np.asarray(v).dtype)]) for v in vs])

        blocks = list(self.ctx.blocks)
        out = {
            "layers": list(self.layers),
            "block_index": np.array([blocks.index(lay.rsplit(".", 1)[0]) for lay in self.layers]),
            "grid": np.array(grids, dtype=np.int64),
            "token_index": pad([i.astype(np.int64) for i in index], -1),
            "acc": pad(accs, np.nan),
            "std": pad(stds, np.nan),
            "mean_over_tokens": np.array([float(np.mean(a)) for a in accs]),
            "shots": self.shots,
            "seeds": np.array(self.seeds, dtype=np.int64),
            "stride": self.stride,
            "chance": 1.0 / k,
            "method": self.opts.method,
            "token_dim": np.array([int(test_x[lay].shape[-1]) for lay in self.layers]),
            "n_images": len(test_y),
        }
        if self.cls:
            out["cls_acc"], out["cls_std"] = np.array(cls_acc), np.array(cls_std)
        return out

    @staticmethod
    def summary(r: dict) -> dict:
        s = {
            "layers": as_list(r["layers"]),
            "mean_over_tokens": [float(v) for v in np.asarray(r["mean_over_tokens"])],
            "max_token": [float(np.nanmax(v)) for v in np.asarray(r["acc"])],
            "chance": float(r["chance"]),
        }
        if "cls_acc" in r:
            s["cls_acc"] = [float(v) for v in np.asarray(r["cls_acc"])]
        return s

    @staticmethod
    def scalars(r: dict) -> dict[str, float]:
        out = {}
        for i, (lay, bi) in enumerate(zip(as_list(r["layers"]), np.asarray(r["block_index"]))):
            tag = layer_tag(lay, bi)
            out[f"token_probes/mean/{tag}"] = float(np.asarray(r["mean_over_tokens"])[i])
            if "cls_acc" in r:
                out[f"token_probes/cls/{tag}"] = float(np.asarray(r["cls_acc"])[i])
        return out

    @staticmethod
    def figures(r: dict, step: int | None = None) -> dict:
        at = f" (step {step})" if step is not None else ""
        shots = int(r["shots"])
        layers = as_list(r["layers"])
        cls = np.asarray(r["cls_acc"]) if "cls_acc" in r else None
        return {
            "token_probes/heatmap": layer_token_heatmap(
                np.asarray(r["acc"]), layers, title=f"{shots}-shot probe per token{at}"
            ),
            "token_probes/maps": token_maps(
                np.asarray(r["acc"]),
                np.asarray(r["grid"]),
                np.asarray(r["token_index"]),
                layers,
                title=f"{shots}-shot probe per token position{at}",
            ),
            "token_probes/mean": mean_plot(
                np.asarray(r["mean_over_tokens"]),
                cls,
                float(r["chance"]),
                title=f"{shots}-shot probe on single tokens{at}",
            ),
        }


# ---------------------------------------------------------------- figures


def layer_token_heatmap(acc: np.ndarray, layers: list[str], title: str = ""):
    """Fig. D.4 as one matrix: probe top-1 per token (columns, probed tokens in row-major grid order) and layer
    (rows)."""

    fig, ax = subplots(figsize=(6, 0.35 * len(layers) + 1.5))
    im = ax.imshow(
        np.ma.masked_invalid(acc),
        aspect="auto",
        origin="lower",
        cmap="viridis",
        vmin=0,
        vmax=max(float(np.nanmax(acc)), 1e-6) if np.isfinite(acc).any() else 1,
    )
    fig.colorbar(im, ax=ax, fraction=0.046).set_label("top-1 (fraction)")
    ax.set_yticks(range(len(layers)), [lay.rsplit(".", 1)[0] for lay in layers], fontsize=6)
    ax.set_xlabel("token (spatial, row-major)")
    ax.set_ylabel("layer")
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    return fig


def token_maps(acc: np.ndarray, grids: np.ndarray, token_index: np.ndarray, layers: list[str], title: str = ""):
    """Fig. D.4: per layer, the probe top-1 of every token at its grid position (unprobed positions blank)."""

    n = len(layers)
    cols = min(4, n)
    rows = -(-n // cols)
    fig, axes = subplots(rows, cols, figsize=(2.0 * cols + 1.2, 2.0 * rows + 0.8), squeeze=False, layout="constrained")
    vmax = max(float(np.nanmax(acc)), 1e-6) if np.isfinite(acc).any() else 1.0
    im = None
    for i, ax in enumerate(axes.flat):
        ax.set_xticks([])
        ax.set_yticks([])
        if i >= n:
            ax.axis("off")
            continue
        gh, gw = (int(v) for v in grids[i])
        m = np.full(gh * gw, np.nan)
        ok = token_index[i] >= 0
        m[token_index[i][ok]] = acc[i][ok]
        im = ax.imshow(np.ma.masked_invalid(m.reshape(gh, gw)), vmin=0, vmax=vmax, cmap="viridis")
        ax.set_title(layers[i].rsplit(".", 1)[0], fontsize=7)
    if im is not None:
        fig.colorbar(im, ax=axes.ravel().tolist(), fraction=0.03).set_label("top-1 (fraction)", fontsize=7)
    grid_labels(fig, "patch column", "patch row")
    fig.suptitle(title, fontsize=8)
    return fig


def mean_plot(mean: np.ndarray, cls_acc: np.ndarray | None, chance: float, title: str = ""):
    """Fig. 11 left: single-token probe top-1 averaged over spatial tokens vs normalised depth (and the CLS token's)."""

    fig, ax = subplots(figsize=(5, 3.5))
    x = np.linspace(0, 1, len(mean)) if len(mean) > 1 else np.array([1.0])
    ax.plot(x, mean, marker="o", ms=3, label="mean over spatial tokens")
    if cls_acc is not None:
        ax.plot(x, cls_acc, marker="s", ms=3, label="CLS token")
    ax.axhline(chance, color="grey", ls=":", lw=1, label="chance")
    ax.set_xlabel("normalised depth")
    ax.set_ylabel("top-1")
    ax.set_ylim(0, 1)
    ax.legend(fontsize=7)
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    return fig
