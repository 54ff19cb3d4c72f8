"""``cka``: minibatch CKA between every pair of a model's layers (Raghu et al. 2021 Fig. 1, 2, 8, 12).

The estimator (unbiased HSIC_1 per minibatch, summed over minibatches, float64) is defined in
analysis/estimators/similarity.py, which other measures and the cross-model comparison share. Which layers take part is
option ``layers`` (:data:`LAYER_SETS`, :func:`cka_layers`); the cross-model comparison (analysis/reports/cross.py
``cross_cka``) uses the same option for both models.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np

from analysis.engine.figures import cka_heatmap
from analysis.engine.measure import Measure, as_list, register
from analysis.estimators.features import has_class_token
from analysis.estimators.similarity import MinibatchCKA, represent
from analysis.families import family_of

# Tap kinds (analysis/engine/taps.py) per layer set and architecture, in forward order within a block. A block that
# lacks a kind (conv3 in a BasicBlock) skips it.
LAYER_SETS: dict[str, dict[str, tuple[str, ...]]] = {
    # the output of every residual block
    "blocks": {"vit": ("out",), "mixer": ("out",), "resnet": ("out",)},
    # the residual stream after each sublayer: after attention (token mixing) and after the MLP; ResNet blocks
    "sublayers": {"vit": ("attn_out", "out"), "mixer": ("attn_out", "out"), "resnet": ("out",)},
    # Raghu §4: block outputs and intermediate layers, "such as normalization layers and the hidden activations
    # inside a ViT MLP": every layer's output inside a ViT block (norms, attention, residual sums, MLP hidden,
    # MLP); for ResNets every conv and norm layer inside each block and the block output
    "paper": {
        "vit": ("norm1", "attn_branch", "attn_out", "norm2", "mlp_hidden", "mlp_branch", "out"),
        "mixer": ("norm1", "attn_branch", "attn_out", "norm2", "mlp_hidden", "mlp_branch", "out"),
        "resnet": ("conv1", "bn1", "conv2", "bn2", "conv3", "bn3", "out"),
    },
    # every distinct tapped token/feature-map tensor; see :func:`cka_layers` for the duplicates left out
    "all": {
        "vit": ("in", "norm1", "heads", "attn_branch", "attn_out", "norm2", "mlp_hidden", "mlp_branch", "out"),
        "mixer": ("in", "norm1", "attn_branch", "attn_out", "norm2", "mlp_hidden", "mlp_branch", "out"),
        "resnet": ("in", "conv1", "bn1", "act1", "conv2", "bn2", "act2", "conv3", "bn3", "branch", "shortcut", "out"),
    },
}

# Figure labels: "{block index}.{name}" for ViT / Mixer blocks (the claims read the block index before the dot),
# "layer{s}.{j}" for a ResNet block output and "layer{s}.{j}.{kind}" inside it.
_SHORT = {
    "vit": {"attn_out": "attn", "out": "mlp"},
    "mixer": {
        "attn_out": "token",
        "out": "channel",
        "attn_branch": "token_branch",
        "mlp_branch": "channel_branch",
        "mlp_hidden": "channel_hidden",
    },
}


@dataclass(frozen=True)
class CKAOptions:
    repr: Literal["flatten", "cls", "mean_spatial"] = "flatten"  # a layer's representation of one image
    unbiased: bool = True  # HSIC_1 (Song et al. 2012); false: the biased HSIC_0
    layers: Literal["blocks", "sublayers", "paper", "all"] = (
        "sublayers"  # which layers (LAYER_SETS); paper: Raghu Fig. 1-2
    )


def layer_label(arch: str, block: str, kind: str) -> str:
    """A layer's label in figures and results (``3.attn``, ``3.norm1``, ``layer2.0``, ``layer2.0.conv1``)."""
    if arch == "resnet":
        return block if kind == "out" else f"{block}.{kind}"
    return f"{block.split('.')[1]}.{_SHORT[arch].get(kind, kind)}"


def cka_layers(ctx, layers: str = "sublayers") -> list[tuple[str, str]]:
    """(tap name, label) of the layers compared by CKA, in forward order, for layer set ``layers``
    (:data:`LAYER_SETS`). ``all`` leaves out tensors that repeat another one exactly: a block's ``in`` after the
    first block (the previous block's ``out``), an identity ``shortcut`` (the block's ``in``) and a ResNet
    ``branch`` without an SE module (the last ``bn`` output, drop_path being the identity in evaluation)."""
    if layers not in LAYER_SETS:
        raise ValueError(f"unknown CKA layer set '{layers}': choose {', '.join(LAYER_SETS)}.")
    kinds = LAYER_SETS[layers][ctx.arch]
    fam = ctx.family or family_of(ctx.model)
    out = []
    for i, b in enumerate(ctx.blocks):
        have = set(fam.kinds(ctx.model, b))
        for k in kinds:
            if k not in have:
                continue
            if layers == "all" and ((k == "in" and i > 0) or fam.duplicate(ctx.model, b, k)):
                continue
            out.append((f"{b}.{k}", layer_label(ctx.arch, b, k)))
    return out


def repr_problem(ctx, repr: str) -> str | None:
    """One sentence when option ``repr`` cannot be read from ``ctx``'s model (``cls`` without a class token)."""
    if repr == "cls" and not has_class_token(ctx.model, ctx.prefix):
        return (
            f"option repr=cls reads the class token, and this {ctx.arch} has none (a GAP ViT, with or without "
            "registers, a ResNet or a Mixer): use repr mean_spatial or flatten."
        )
    return None


@register
class CKAMeasure(Measure):
    """How alike the model's layers represent the images: linear CKA between every pair of layers.
    Raghu et al. 2021 Fig. 1 (and Fig. 8 for no-skip models), on the analysis images.

    Formula (Raghu §3, eq. 1, with the minibatch estimator they cite: "we approximate the unbiased estimator of
    HSIC [Song et al.] using minibatches, as suggested in [Nguyen et al.]"): for minibatches b of n >= 4 images,
    X_b [n, p] and Y_b [n, q] two layers' representations, K_b = X_b X_b^T, L_b = Y_b Y_b^T,

        CKA(X, Y) = sum_b HSIC_1(K_b, L_b) / sqrt( sum_b HSIC_1(K_b, K_b) * sum_b HSIC_1(L_b, L_b) ),

        HSIC_1(K, L) = [ tr(K~ L~) + 1^T K~ 1 * 1^T L~ 1 / ((n-1)(n-2)) - 2/(n-2) * 1^T K~ L~ 1 ] / (n (n-3)),

    K~, L~ = K, L with zeroed diagonals (:class:`analysis.estimators.similarity.MinibatchCKA`; ``unbiased: false`` uses
    the biased HSIC_0 = tr(K H L H) / (n-1)^2 that Raghu's eq. 1 writes out). Raghu App. A: minibatches of 1,024, 10,240
    images, averaged over 20 draws (no effect found down to 128 per batch and 2,560 images); ours: the suite's analysis
    minibatch over the analysis split, one draw. A layer's representation of one image is option ``repr``: all tokens
    (or all positions x channels) flattened (default, as in Raghu), the CLS token, or the mean of the spatial tokens.

    Layers (option ``layers``, :data:`LAYER_SETS`, labels as in :func:`layer_label`):

    - ``blocks``: every block's output (ViT / Mixer ``{i}.mlp``, ResNet ``layer{s}.{j}``);
    - ``sublayers`` (default; the training-time suite): the residual stream after attention and after the MLP
      (``{i}.attn``, ``{i}.mlp``; Mixer ``{i}.token``, ``{i}.channel``), ResNet block outputs;
    - ``paper``: Raghu §4, "we take representations not only from outputs of ViT/ResNet blocks, but also from
      intermediate layers, such as normalization layers and the hidden activations inside a ViT MLP": every
      layer's output inside a ViT / Mixer block, in forward order norm1, attention (the branch, before the
      residual sum), the stream after attention, norm2, the MLP hidden activations, the MLP (branch) and the
      block output (7 per block: ``{i}.norm1``, ``{i}.attn_branch``, ``{i}.attn``, ``{i}.norm2``,
      ``{i}.mlp_hidden``, ``{i}.mlp_branch``, ``{i}.mlp``); per ResNet block the output of every conv and norm
      layer and the block output (5 per BasicBlock, 7 per Bottleneck). The paper names kinds of layer, not a
      list; these sets fit the counts it gives: Fig. B.1 "60 of the lowest R50 layers are similar to about 25
      of the lowest ViT-B/32 layers" with §4 "the lower half of ResNet layers are similar to around the lowest
      quarter of ViT layers" put ResNet-50 near 120 layers and ViT-B/32 near 100; here ResNet-50 has 16 x 7 =
      112 and ViT-B/32 12 x 7 = 84. (Their ResNets are BiT's pre-activation ResNets with GroupNorm, ours timm's
      post-activation ones with BatchNorm; the conv and norm outputs are the counterparts.)
    - ``all``: every distinct tapped tensor (:func:`cka_layers`): ``paper`` and also the first block's input,
      the heads' outputs before the attention's projection, the ResNet activations inside blocks and the
      projection shortcuts.

    The reproduction of Raghu Fig. 1-2 uses ``layers: paper`` (``--opt cka.layers=paper`` on the command line,
    ``cka: {layers: paper}`` in a recipe's analysis_suite callback); the other sets are views of the same maps.
    Result: ``matrix`` [L, L], ``labels``, ``taps``, ``repr``, ``layers``."""

    name = "cka"
    Options = CKAOptions

    @classmethod
    def model_problem(cls, ctx, opts):
        return repr_problem(ctx, opts.repr)

    def __init__(self, ctx, opts=None):
        super().__init__(ctx, opts)
        self.layers = cka_layers(ctx, self.opts.layers)
        self.acc = MinibatchCKA(unbiased=self.opts.unbiased)

    def taps(self):
        return {t for t, _ in self.layers}

    def update(self, j, cap, x, y):
        self.acc.update([represent(cap[t], self.opts.repr, self.ctx.prefix) for t, _ in self.layers])

    def finish(self):
        self.acc.sync(self.ctx.accelerator)
        return {
            "matrix": self.acc.compute().numpy(),
            "labels": [lab for _, lab in self.layers],
            "taps": [t for t, _ in self.layers],
            "repr": self.opts.repr,
            "layers": self.opts.layers,
        }

    @staticmethod
    def summary(r):
        m = np.asarray(r["matrix"])
        off = m[~np.eye(len(m), dtype=bool)]
        return {
            "mean_offdiag": float(off.mean()) if off.size else 1.0,
            "first_last": float(m[0, -1]),
            "adjacent_mean": float(np.mean([m[i, i + 1] for i in range(len(m) - 1)])) if len(m) > 1 else 1.0,
        }

    @staticmethod
    def scalars(r):
        return {f"cka/{k}": v for k, v in CKAMeasure.summary(r).items()}

    @staticmethod
    def figures(r, step=None):

        at = f" (step {step})" if step is not None else ""
        which = {"blocks": "block outputs", "sublayers": "sublayers", "paper": "Raghu's layers", "all": "all layers"}
        layers = f" between {which.get(str(r['layers']), str(r['layers']))}" if "layers" in r else ""
        return {"cka/self": cka_heatmap(r["matrix"], as_list(r["labels"]), title=f"CKA{layers}{at}")}
