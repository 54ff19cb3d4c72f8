"""Training objectives: how a model is taught (recipe key ``train.objective``; Walmer et al. 2023's axis).

One module per objective, found by name: ``train/objectives/<name>.py`` is ``train.objective: <name>``, and its
options are the recipe section ``objectives.<name>`` (a mapping, optional: the module's defaults apply). A module
holds

* ``Config``: a dataclass, the objective's recipe options (typed and range-checked like every recipe key);
* ``check(cfg, recipe) -> str | None`` (optional): a check that needs the rest of the recipe, one sentence or None;
* ``Objective``: a subclass of :class:`Objective` (train/objectives/_base.py), built as
  ``Objective(backbone, cfg, recipe, num_classes)``.

Every module of this package is imported to read the recipe schema, which must not cost torch's and timm's seconds
(a mistyped key is refused at once): a module keeps ``Config`` and ``check`` free of them and its training code
(``Objective`` and its helpers) in a module part that ``__getattr__ = deferred(__name__, part)`` (from
vitlab/plugins.py) imports when first asked for, e.g. ``dino.py`` and ``_dino.py``. ``Objective`` and
``step_generator`` of this package are likewise imported on first use.

The trainer's loop, checkpoints, exact resume, multi-process training and TensorBoard are the same for every
objective; an objective only says what one step's loss is (:meth:`Objective.loss`) and what happens after the
optimizer step (:meth:`Objective.after_step`, e.g. an EMA teacher). Everything an objective keeps between steps
(teacher weights, DINO's centre, a decoder) is a parameter or buffer of the objective module, so the checkpoint
holds it and resume restores it; randomness inside a step (masks, crops) comes from
:func:`train.seeding.step_generator`, a
function of (seed, step, process), so a resumed run draws the same masks.

Checkpoints. A supervised run trains (and saves) the backbone itself, as before objectives existed. Any other
objective is one module holding the backbone as its submodule ``backbone`` (and its own parts), so its
``model.safetensors`` keys carry prefixes; :attr:`Objective.parts` names each network a measure can read
(``{"student": "backbone.", "teacher": "teacher_backbone."}``) and the checkpoint's meta.json records it, so
analysis loads the backbone (or the teacher) by name.
"""

from __future__ import annotations

import dataclasses
from types import ModuleType
from typing import TYPE_CHECKING

from vitlab.plugins import Registry

if TYPE_CHECKING:
    import torch.nn as nn

    from train.objectives._base import Objective


def __getattr__(name: str):
    """``Objective`` (the base class, train/objectives/_base.py) and ``step_generator`` (re-exported from
    train.seeding: objectives draw their masks and crops with it), imported on first use: they import torch, and
    this package is imported to read the recipe schema."""
    if name == "Objective":
        from train.objectives._base import Objective

        return Objective
    if name == "step_generator":
        from train.seeding import step_generator

        return step_generator
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# a module defining Config (asking for its Objective would import the objective's training code: see the docstring)
PLUGINS = Registry("objective", __name__, module_plugin=lambda mod: hasattr(mod, "Config"))
REGISTRY: dict[str, ModuleType] = PLUGINS.items()


def _config_class():
    """The recipe's ``objectives:`` section: one optional mapping per objective (its defaults when absent)."""
    fields = [(name, mod.Config | None, dataclasses.field(default=None)) for name, mod in REGISTRY.items()]
    cls = dataclasses.make_dataclass("ObjectivesConfig", fields)
    cls.__module__ = __name__
    cls.__doc__ = "The recipe's ``objectives:`` section: options of " + ", ".join(REGISTRY) + " (each optional)."
    return cls


ObjectivesConfig = _config_class()


def config_for(recipe):
    """The chosen objective's options: its section, or its defaults."""
    name = recipe.train.objective
    cfg = getattr(recipe.objectives, name, None)
    return cfg if cfg is not None else REGISTRY[name].Config()


def check(recipe) -> str | None:
    """The first error sentence about the objective choice (None when all is well)."""
    name = recipe.train.objective
    if name not in REGISTRY:
        return f"key 'train.objective' is '{name}': choose one of {', '.join(REGISTRY)}."
    for other in REGISTRY:
        if other != name and getattr(recipe.objectives, other, None) is not None:
            return (
                f"key 'objectives.{other}' is set but train.objective is '{name}': remove the section or set "
                f"train.objective={other}."
            )
    mod = REGISTRY[name]
    a = recipe.data.augment
    # Objective is asked for only when the images are mixed: it is the training code, which imports torch
    if (a.mixup_alpha > 0 or a.cutmix_alpha > 0) and not mod.Objective.uses_labels:
        return (
            f"data.augment.mixup_alpha / cutmix_alpha mix labels, which train.objective '{name}' does not use: "
            "set both to 0."
        )
    hook = vars(mod).get("check")  # the module's own: hasattr would import a deferred training part for nothing
    return hook(config_for(recipe), recipe) if hook else None


def build_objective(recipe, backbone: nn.Module, num_classes: int) -> Objective:
    """The recipe's objective around ``backbone``."""
    return REGISTRY[recipe.train.objective].Objective(backbone, config_for(recipe), recipe, num_classes)


def uses_labels(recipe) -> bool:
    return REGISTRY[recipe.train.objective].Objective.uses_labels
