"""Model families: one adapter file each (see analysis/families/base.py for what an adapter answers).

:func:`family_of` finds a model's family among the adapters found by the plug-in registry (vitlab/plugins.py): every
``Family`` subclass defined in a module of this folder, and those other packages publish under the entry-point group
``vitlab.families`` (``name = "package.module:FamilyClass"``). Adapters that recognise their library by the model's
class (``Family.exact``: transformers, open_clip) are asked before the timm ones, which recognise a model by its
modules.
"""

from __future__ import annotations

import functools
import inspect

import torch.nn as nn

from analysis.families.base import Family, TapError, UnknownFamily
from vitlab.plugins import Registry

KNOWN = (
    "timm VisionTransformer, MlpMixer and ResNet models (timm.create_model), transformers ViT, DeiT, Dinov2, CLIP "
    "and SigLIP vision models, and open_clip visual towers"
)


def _adapters(mod) -> list[type[Family]]:
    """The Family subclasses a module of this folder defines (not those it imports)."""
    return [
        c
        for _, c in inspect.getmembers(mod, inspect.isclass)
        if issubclass(c, Family) and c is not Family and c.__module__ == mod.__name__
    ]


FAMILIES = Registry("model family", __name__, group="vitlab.families", module_plugin=lambda mod: bool(_adapters(mod)))


@functools.cache
def families() -> tuple[Family, ...]:
    """Every adapter, those that know their library by the model's class first."""
    found = []
    for obj in FAMILIES.items().values():
        found += [c() for c in (_adapters(obj) if inspect.ismodule(obj) else [obj])]
    return tuple(sorted(found, key=lambda f: (not f.exact, type(f).__module__, type(f).__name__)))


def family_of(model: nn.Module) -> Family:
    """The family of ``model``; TapError (one sentence) for a model of no known family."""
    for fam in families():
        if fam.matches(model):
            return fam
    raise UnknownFamily(f"vitlab reads {KNOWN}, not a {type(model).__name__}.")


__all__ = ["Family", "TapError", "UnknownFamily", "families", "family_of"]
