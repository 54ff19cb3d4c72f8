"""Interventions: changes to a built model or to the train split that a recipe names under ``interventions:``.

One module per intervention, found by name: ``interventions/<name>.py`` is the recipe key
``interventions.<name>``. Adding an intervention is adding one file here; nothing else names it. A module holds

* ``Config``: a dataclass, its recipe options (typed and range-checked like every recipe key, see
  ``train/recipe.py``); ``ENTRY`` (optional): how the recipe key is typed, ``Optional[Config]`` (one mapping,
  None when absent; the default) or ``list[Config]`` (one mapping or a list of them, [] when absent);
* ``check(entry, recipe) -> str | None``: a check that needs the rest of the recipe (e.g. block indices against
  ``model.depth``); it returns the one-sentence error, or None;
* how it applies, any of: ``build_block(entry, depth, args, kwargs)`` (a timm ViT ``block_fn``: return the
  block for index ``depth``, or None to leave it to the others), ``apply_model(entry, model)`` (change a built
  model in place), ``select_train(entry, labels, balanced_indices)`` (indices of the train split to keep);
* ``describe(entry) -> dict`` (optional): what meta.json and the TensorBoard hparams record (default: the options).

Every module is imported to read the recipe schema, so it imports no torch or timm at the top: the functions that
build or apply import them, and a class that subclasses a torch or timm module is made on first use by a cached
factory (``no_skip.block_classes``, ``head_mask.head_mask_class``). A bad recipe is then refused in well under a
second, not after their seconds of imports (tests/test_light_imports.py).

This package is a leaf: it imports nothing from ``train`` or ``analysis`` (``train`` imports it). The GAP head
(Raghu §7) is not an intervention entry but a model option, ``model.head: gap`` (see ``train/models.py``).
"""

from __future__ import annotations

import dataclasses
import typing
from types import ModuleType

from vitlab.plugins import Registry

PLUGINS = Registry("intervention", __name__, module_plugin=lambda mod: hasattr(mod, "Config"))
REGISTRY: dict[str, ModuleType] = PLUGINS.items()  # every module of this package that defines Config


def entry_type(name: str):
    """The type of recipe key ``interventions.<name>``: the module's ``ENTRY``, else ``Config | None``."""
    mod = REGISTRY[name]
    return getattr(mod, "ENTRY", mod.Config | None)


def _is_list(name: str) -> bool:
    return typing.get_origin(entry_type(name)) is list


def _config_class():
    """The ``interventions`` section of a recipe: one field per registered intervention, absent by default."""
    fields = [
        (
            name,
            entry_type(name),
            dataclasses.field(default_factory=list) if _is_list(name) else dataclasses.field(default=None),
        )
        for name in REGISTRY
    ]
    cls = dataclasses.make_dataclass("InterventionsConfig", fields)
    cls.__module__ = __name__
    cls.__doc__ = "The recipe's ``interventions:`` section: " + ", ".join(REGISTRY) + " (each absent by default)."
    return cls


InterventionsConfig = _config_class()


def active(interventions) -> list[tuple[str, ModuleType, object]]:
    """(name, module, entry) of every intervention the section turns on; ``entry`` is the recipe's value (a
    ``Config``, or for a list-typed intervention the non-empty list of them): what every hook receives."""
    if interventions is None:
        return []
    return [
        (name, mod, getattr(interventions, name))
        for name, mod in REGISTRY.items()
        if getattr(interventions, name, None) not in (None, [])
    ]


def check(recipe) -> str | None:
    """The first error sentence of the active interventions' ``check`` hooks (None when all pass)."""
    for _, mod, entry in active(recipe.interventions):
        msg = mod.check(entry, recipe) if hasattr(mod, "check") else None
        if msg:
            return msg
    return None


def describe(recipe) -> dict:
    """A summary of the active interventions for meta.json and TensorBoard hparams."""
    out = {"head": recipe.model.head}
    for name, mod, entry in active(recipe.interventions):
        if hasattr(mod, "describe"):
            out[name] = mod.describe(entry)
        else:
            out[name] = [dataclasses.asdict(c) for c in entry] if _is_list(name) else dataclasses.asdict(entry)
    return out


def model_interventions(interventions) -> list[str]:
    """Names of the active interventions that change the model (``build_block`` or ``apply_model``)."""
    return [
        name for name, mod, _ in active(interventions) if hasattr(mod, "build_block") or hasattr(mod, "apply_model")
    ]


def block_fn_for(interventions, block_cls):
    """A timm ``block_fn``: each index's block from the first active ``build_block`` that returns one, else
    ``block_cls`` (timm's ``Block``)."""
    builders = [(mod, entry) for _, mod, entry in active(interventions) if hasattr(mod, "build_block")]
    if not builders:
        return block_cls

    def make_block(*args, depth: int = 0, **kwargs):
        for mod, entry in builders:
            block = mod.build_block(entry, depth, args, kwargs)
            if block is not None:
                return block
        return block_cls(*args, depth=depth, **kwargs)

    return make_block


def apply_model(model, interventions) -> None:
    """Apply every active ``apply_model`` hook to a built model, in place."""
    for _, mod, entry in active(interventions):
        if hasattr(mod, "apply_model"):
            mod.apply_model(entry, model)


def select_train(interventions, labels, balanced_indices):
    """(indices of the train split to keep, or None for all; the name of the intervention that chose them).
    ``balanced_indices(labels, n, seed)`` is the data layer's seeded, class-balanced, nested selection. A hook
    raises ValueError with one sentence when it cannot select (e.g. more images than the split holds)."""
    picks = [(name, mod, entry) for name, mod, entry in active(interventions) if hasattr(mod, "select_train")]
    if len(picks) > 1:
        raise ValueError(f"interventions {' and '.join(n for n, _, _ in picks)} each select the train split: keep one.")
    if not picks:
        return None, None
    name, mod, entry = picks[0]
    return mod.select_train(entry, labels, balanced_indices), name
