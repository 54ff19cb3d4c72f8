"""Model families: one adapter file each (see analysis/families/base.py for what an adapter answers).

:func:`family_of` finds a model's family: the adapters of ``FAMILIES`` in order, then those other packages publish
under the entry-point group ``vitlab.families`` (``name = "package.module:FamilyClass"``).
"""

from __future__ import annotations

import functools
from importlib import import_module
from importlib.metadata import entry_points

import torch.nn as nn

from analysis.families.base import Family, TapError

# module:class of every adapter shipped here, tried in this order (a Mixer before the ViT test of timm models)
FAMILIES = (
    "analysis.families.timm_mixer:TimmMixer",
    "analysis.families.timm_vit:TimmViT",
    "analysis.families.timm_resnet:TimmResNet",
    "analysis.families.openclip:OpenClipViT",
    "analysis.families.huggingface:HuggingFaceViT",
)

KNOWN = (
    "timm VisionTransformer, MlpMixer and ResNet models (timm.create_model), transformers ViT, DeiT, Dinov2, CLIP "
    "and SigLIP vision models, and open_clip visual towers"
)


def _load(spec: str) -> Family:
    mod, cls = spec.split(":")
    return getattr(import_module(mod), cls)()


@functools.cache
def families() -> tuple[Family, ...]:
    """Every adapter: those shipped here, then those of other packages (entry-point group ``vitlab.families``)."""
    found = [_load(s) for s in FAMILIES]
    found += [ep.load()() for ep in entry_points(group="vitlab.families")]
    return tuple(found)


def family_of(model: nn.Module) -> Family:
    """The family of ``model``; TapError (one sentence) for a model of no known family."""
    for fam in families():
        if fam.matches(model):
            return fam
    raise TapError(f"vitlab reads {KNOWN}, not a {type(model).__name__}.")


__all__ = ["Family", "TapError", "families", "family_of"]
