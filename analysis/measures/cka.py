"""``cka``: minibatch CKA between every pair of a model's layers (Raghu et al. 2021 Fig. 1, 2, 8, 12).

The estimator (unbiased HSIC_1 per minibatch, summed over minibatches, float64) is defined in
analysis/similarity.py, which other measures and the cross-model comparison share.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np

from analysis.measure import Measure, as_list, register
from analysis.similarity import MinibatchCKA, represent


@dataclass(frozen=True)
class CKAOptions:
    repr: Literal["flatten", "cls", "mean_spatial"] = "flatten"  # a layer's representation of one image
    unbiased: bool = True  # HSIC_1 (Song et al. 2012); false: the biased HSIC_0


def cka_layers(ctx) -> list[tuple[str, str]]:
    """(tap name, label) of the layers compared by CKA: after each sublayer of a ViT / Mixer block (Raghu Fig. 1
    marks attention and MLP layers), each residual block's output in a ResNet."""
    if ctx.arch in ("vit", "mixer"):
        sub = ("attn", "mlp") if ctx.arch == "vit" else ("token", "channel")
        return [(f"{b}.{k}", f"{b.split('.')[1]}.{s}") for b in ctx.blocks for k, s in zip(("attn_out", "out"), sub)]
    return [(f"{b}.out", b) for b in ctx.blocks]


@register
class CKAMeasure(Measure):
    """Raghu et al. 2021 Fig. 1 (and Fig. 8 for no-skip models): minibatch CKA (:class:`MinibatchCKA`, unbiased
    HSIC_1 by default) between every pair of the model's layers (:func:`cka_layers`) on the analysis images; a
    layer's representation of one image is option ``repr`` (all tokens flattened, the CLS token, or the mean
    of the spatial tokens). Result: ``matrix`` [L, L], ``labels``, ``repr``."""

    name = "cka"
    Options = CKAOptions

    def __init__(self, ctx, opts=None):
        super().__init__(ctx, opts)
        self.layers = cka_layers(ctx)
        self.acc = MinibatchCKA(unbiased=self.opts.unbiased)

    def taps(self):
        return {t for t, _ in self.layers}

    def update(self, j, cap, x, y):
        self.acc.update([represent(cap[t], self.opts.repr, self.ctx.prefix) for t, _ in self.layers])

    def finish(self):
        self.acc.sync(self.ctx.accelerator)
        return {"matrix": self.acc.compute().numpy(), "labels": [lab for _, lab in self.layers], "repr": self.opts.repr}

    @staticmethod
    def summary(r):
        m = np.asarray(r["matrix"])
        off = m[~np.eye(len(m), dtype=bool)]
        return {"mean_offdiag": float(off.mean()) if off.size else 1.0, "first_last": float(m[0, -1]),
                "adjacent_mean": float(np.mean([m[i, i + 1] for i in range(len(m) - 1)])) if len(m) > 1 else 1.0}

    @staticmethod
    def scalars(r):
        return {f"cka/{k}": v for k, v in CKAMeasure.summary(r).items()}

    @staticmethod
    def figures(r, step=None):
        from analysis.figures import cka_heatmap

        at = f" (step {step})" if step is not None else ""
        return {"cka/self": cka_heatmap(r["matrix"], as_list(r["labels"]), title=f"CKA{at}")}
