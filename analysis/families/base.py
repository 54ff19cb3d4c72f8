"""What the analysis engine needs to know about a family of models, and nothing more.

A family adapter (one file in this folder) answers, for every model of its family:

- ``arch``: which measures apply -- ``"vit"`` (tokens with attention), ``"mixer"`` (tokens mixed by an MLP) or
  ``"resnet"`` (feature maps); the measures ask ``ctx.arch``, never a model's class;
- its residual blocks in forward order, always named ``blocks.{i}`` for token models (``layer{s}.{j}`` for ResNets),
  whatever the family calls them, so that a tap name (``blocks.3.attn_probs``) means the same tensor in every family;
- the tap kinds of each block and the hooks that capture them (:meth:`Family.hook`, through the
  :class:`~analysis.engine.taps.Taps` that calls it);
- the token grid, patch size and prefix tokens (class token, registers), and the preprocessing the model expects;
- the measures that need more of the model than its taps (``needs_internals``: those that rewrite a forward pass).

Tap kinds of a transformer block (z the residual stream, f the sublayer branches), the same in every family::

    in           block input z_i
    norm1        the attention's input, norm1(z_i)
    attn_branch  f_attn(norm1(z_i)), after any layer scale
    attn_out     the stream after the attention sublayer, z_i + f_attn
    norm2        the MLP's input
    mlp_hidden   the MLP's hidden activations (after its nonlinearity)
    mlp_branch   f_mlp(norm2(.)), after any layer scale
    out          block output
    attn_probs   attention probabilities [B, H, T, T]
    heads        the heads' outputs before the output projection, [B, T, H * dh] (channels h*dh:(h+1)*dh: head h)
    proj_in      what the output projection receives (``heads`` after any norm or head mask)

Adding a family is one file here that defines a :class:`Family` subclass (found by the plug-in registry; another
package publishes it under the entry-point group ``vitlab.families``), and its test.
"""

from __future__ import annotations

import torch.nn as nn

TRANSFORMER_KINDS = (
    "in",
    "attn_branch",
    "attn_out",
    "mlp_hidden",
    "mlp_branch",
    "out",
    "attn_probs",
    "heads",
    "proj_in",
    "norm1",
    "norm2",
)


class TapError(RuntimeError):
    """A requested tap is unknown for this model or never fired, or the model is of no known family."""


class UnknownFamily(TapError):
    """The model is of no family an adapter reads (the sentence lists those there are)."""


class Family:
    """One family of models. Subclasses set ``name`` and ``arch`` and implement :meth:`matches`, :meth:`blocks`
    and :meth:`hook`; the token properties default to a model without tokens."""

    name: str = ""  # how results and messages name the family, e.g. "timm ViT"
    arch: str = "vit"  # vit | mixer | resnet
    needs_internals: frozenset = frozenset()  # measures that rewrite the forward pass: they need timm's own modules
    exact: bool = False  # matches() knows the model by its class (its library), not by the modules it has

    def matches(self, model: nn.Module) -> bool:
        raise NotImplementedError

    def blocks(self, model: nn.Module) -> list[str]:
        """The residual blocks in forward order (``blocks.0`` ...)."""
        raise NotImplementedError

    def block(self, model: nn.Module, name: str) -> nn.Module:
        """The module of block ``name`` (one of :meth:`blocks`)."""
        return model.get_submodule(name)

    def kinds(self, model: nn.Module, block: str) -> tuple[str, ...]:
        """The tap kinds of one block."""
        return TRANSFORMER_KINDS

    def hook(self, model: nn.Module, block: str, kinds: set[str], taps) -> None:
        """Register the hooks that capture ``kinds`` of ``block`` through ``taps`` (:class:`Taps`: ``taps.output``,
        ``taps.input``, ``taps.store``, ``taps.handle``, ``taps.on_exit``); tap names are ``f"{block}.{kind}"``."""
        raise NotImplementedError

    def duplicate(self, model: nn.Module, block: str, kind: str) -> bool:
        """True if tap ``block.kind`` repeats another tap of the same block exactly (left out of CKA's ``all``)."""
        return False

    # -- tokens
    def prefix(self, model: nn.Module) -> int:
        """Tokens before the spatial ones (class token, registers, distillation token)."""
        return 0

    def registers(self, model: nn.Module) -> int:
        """Register tokens among the prefix tokens (Darcet et al. 2024)."""
        return 0

    def has_class_token(self, model: nn.Module) -> bool:
        return False

    def grid(self, model: nn.Module) -> tuple[int, int] | None:
        """The token grid (rows, cols), None for a model without tokens."""
        return None

    def patch_size(self, model: nn.Module) -> int | None:
        return None

    def image_size(self, model: nn.Module) -> int | None:
        """The input side the model was built for (None: any)."""
        return None

    def preprocessing(self, model: nn.Module) -> dict:
        """How images are prepared for the model: ``mean``, ``std`` (per channel, of [0, 1] pixels),
        ``input_size`` (C, H, W), ``interpolation`` and ``crop_pct`` (the eval resize/centre-crop of timm)."""
        size = self.image_size(model) or 224
        return {
            "input_size": (3, size, size),
            "interpolation": "bicubic",
            "mean": (0.485, 0.456, 0.406),
            "std": (0.229, 0.224, 0.225),
            "crop_pct": 0.875,
            "crop_mode": "center",
        }


def first_tensor(x):
    """The tensor of a module's output: the output itself, or the first element of a tuple (transformers' layers return
    ``(hidden_states, attentions?)`` in some versions and a tensor in others)."""
    return x[0] if isinstance(x, (tuple, list)) else x
