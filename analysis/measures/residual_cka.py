"""CKA between what the skip connection carries and what the residual branch computes (Walmer et al. 2023 App. D.4,
Fig. 23; cf. Raghu et al. 2021 §6).

Definition. For block i and sublayer s, z is the sublayer's skip input (the residual stream entering it) and f(z)
its branch output (after layer scale / drop path, before the add):

    ViT  attn: z = ``blocks.i.in``,       f(z) = ``blocks.i.attn_branch``,  z + f(z) = ``blocks.i.attn_out``
    ViT  mlp:  z = ``blocks.i.attn_out``, f(z) = ``blocks.i.mlp_branch``,   z + f(z) = ``blocks.i.out``
    ResNet block: z = ``layer{s}.{j}.shortcut`` (identity or downsample output), f(z) = ``layer{s}.{j}.branch``,
                  output = ``layer{s}.{j}.out`` (= act(f(z) + z), after the block's final ReLU)

(for a no-skip block, interventions.no_skip, the "output" is what the block computes: the branch alone). Each
image's representation is all tokens / positions flattened (:func:`analysis.cka.represent`, ``flatten``), and

    skip_branch[s, i] = CKA(z_i, f(z_i)),     skip_out[s, i] = CKA(z_i, z_i + f(z_i))

with linear minibatch CKA (:class:`analysis.estimators.similarity.MinibatchCKA`: unbiased HSIC by default, option
``unbiased``; the analysis minibatches are the CKA minibatches, HSIC sums over minibatches and processes). Walmer et
al.'s
Fig. 23 plots the skip features of every block against the branch output of every block; that matrix is
``skip_branch_matrix[s, i, j] = CKA(z_i, f(z_j))`` (rows: skip, columns: branch), whose diagonal is skip_branch.

Which definition: the textbook one (Kornblith et al. 2019, linear kernel; unbiased HSIC of Nguyen et al. 2021 summed
over random minibatches, :class:`analysis.engine.reduce.Minibatches`). Walmer et al.'s code (``cka/cka_main.py``,
``CKA.compare``, adapted from PyTorch-Model-Compare) rescales each minibatch's Gram to [0, 1] before its unbiased HSIC
(``K = K - K.min(); K = K / K.max()``, then a zero diagonal): an affine map of the Gram that the unbiased centring does
not undo (the shift K.min() is not of the form a 1^T + 1 a^T it removes, and the scale differs per minibatch and per
layer), so his numbers are not CKA of the features; on the real ViT-S/14 they differ from ours by up to 0.17. We follow
the paper's stated measure (CKA), not that rescaling.

Result: ``skip_branch`` [S, L], ``skip_out`` [S, L], ``skip_branch_matrix`` [S, L, L], ``sublayers`` (ViT
["attn", "mlp"], ResNet ["block"]), ``blocks`` (L names), ``repr`` ("flatten"), ``unbiased`` (0/1).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

import analysis.engine.figures as figs
from analysis.engine.figures import finish_block_axes, subplots
from analysis.engine.measure import Context, Measure, as_list, register
from analysis.estimators.similarity import MinibatchCKA, cka, represent

VIT_SUBLAYERS = {"attn": ("in", "attn_branch", "attn_out"), "mlp": ("attn_out", "mlp_branch", "out")}
RESNET_SUBLAYERS = {"block": ("shortcut", "branch", "out")}


def sublayer_taps(arch: str) -> dict[str, tuple[str, str, str]]:
    """{sublayer: (skip z, branch f(z), output) tap kinds}."""
    return VIT_SUBLAYERS if arch in ("vit", "mixer") else RESNET_SUBLAYERS


def residual_cka(skip: torch.Tensor, branch: torch.Tensor, unbiased: bool = True) -> float:
    """Linear CKA between skip features z and branch features f(z) of the same images, all in one minibatch:
    [n, T, D] tokens or [n, C, H, W] maps, flattened per image."""
    return cka(represent(skip, "flatten"), represent(branch, "flatten"), unbiased=unbiased)


@dataclass(frozen=True)
class ResidualCKAOptions:
    unbiased: bool = True  # HSIC_1 (false: HSIC_0)


@register
class ResidualCKA(Measure):
    """How much each branch changes the residual stream: CKA of the skip input with the branch and with their sum.
    Per block and sublayer, CKA(skip z, branch f(z)) and CKA(z, z + f(z)) (Walmer et al. 2023 App. D.4 / Fig. 23), as in
    the module docstring. One :class:`MinibatchCKA` per sublayer with xs = the L skips and ys = the L branches then the
    L outputs; its float64 HSIC sums are added over processes in :meth:`finish`."""

    name = "residual_cka"
    Options = ResidualCKAOptions

    def __init__(self, ctx: Context, opts=None):
        super().__init__(ctx, opts)
        self.unbiased = self.opts.unbiased
        self.subs = sublayer_taps(ctx.arch)
        self.blocks = list(ctx.blocks)
        self.acc = {s: MinibatchCKA(unbiased=self.unbiased) for s in self.subs}

    def taps(self) -> set[str]:
        return {f"{b}.{k}" for b in self.blocks for kinds in self.subs.values() for k in kinds}

    def update(self, j, cap, x, y) -> None:
        for s, (zk, fk, ok) in self.subs.items():
            rep = {k: [represent(cap[f"{b}.{k}"], "flatten") for b in self.blocks] for k in (zk, fk, ok)}
            self.acc[s].update(rep[zk], rep[fk] + rep[ok])

    def finish(self) -> dict:
        n = len(self.blocks)
        skip_branch, skip_out, matrix = [], [], []
        for s in self.subs:
            acc = self.acc[s]
            if acc.xy is None:  # no minibatch on this process: zeros keep the all-reduce in step
                kw = {"dtype": torch.float64, "device": self.ctx.device}
                acc.xy, acc.xx, acc.yy = torch.zeros(n, 2 * n, **kw), torch.zeros(n, **kw), torch.zeros(2 * n, **kw)
            acc.sync(self.ctx.accelerator)
            c = acc.compute().cpu()
            skip_branch.append(torch.diagonal(c[:, :n]))
            skip_out.append(torch.diagonal(c[:, n:]))
            matrix.append(c[:, :n])
        return {
            "skip_branch": torch.stack(skip_branch).numpy(),
            "skip_out": torch.stack(skip_out).numpy(),
            "skip_branch_matrix": torch.stack(matrix).numpy(),
            "sublayers": list(self.subs),
            "blocks": list(self.blocks),
            "repr": "flatten",
            "unbiased": int(self.unbiased),
        }

    @staticmethod
    def summary(r: dict) -> dict:
        out = {}
        for i, s in enumerate(as_list(r["sublayers"])):
            out[f"{s}_skip_branch"] = [float(v) for v in np.asarray(r["skip_branch"])[i]]
            out[f"{s}_skip_out"] = [float(v) for v in np.asarray(r["skip_out"])[i]]
        return out

    @staticmethod
    def scalars(r: dict) -> dict[str, float]:
        out = {}
        for i, s in enumerate(as_list(r["sublayers"])):
            for key in ("skip_branch", "skip_out"):
                out.update(
                    {f"residual_cka/{s}/{key}/block{b:02d}": float(v) for b, v in enumerate(np.asarray(r[key])[i])}
                )
        return out

    @staticmethod
    def figures(r: dict, step: int | None = None) -> dict:
        sfx = "" if step is None else f" (step {step})"
        blocks = as_list(r["blocks"])
        out = {"residual_cka/lines": residual_cka_lines(r, title="CKA(skip, branch) and CKA(skip, output)" + sfx)}
        for i, s in enumerate(as_list(r["sublayers"])):
            out[f"residual_cka/{s}/matrix"] = figs.cka_heatmap(
                np.asarray(r["skip_branch_matrix"])[i],
                blocks,
                blocks,
                title=f"{s}: CKA(skip z_i, branch f(z_j)){sfx}",
                xname="branch of block j",
                yname="skip of block i",
            )
        return out


def residual_cka_lines(r: dict, title: str = "residual CKA"):
    """CKA(z, f(z)) (solid) and CKA(z, z + f(z)) (dashed) per block, one colour per sublayer."""
    blocks = as_list(r["blocks"])
    fig, ax = subplots(figsize=(5, 3.5))
    for i, s in enumerate(as_list(r["sublayers"])):
        (line,) = ax.plot(
            range(len(blocks)), np.asarray(r["skip_branch"])[i], marker="o", ms=3, label=f"{s}: skip vs branch"
        )
        ax.plot(
            range(len(blocks)),
            np.asarray(r["skip_out"])[i],
            marker="s",
            ms=3,
            ls="--",
            color=line.get_color(),
            label=f"{s}: skip vs output",
        )
    return finish_block_axes(fig, ax, blocks, "linear CKA", title, ylim=(-0.05, 1.05))
