"""Training objectives: how a model is taught (recipe key ``train.objective``; Walmer et al. 2023's axis).

One module per objective, found by name: ``train/objectives/<name>.py`` is ``train.objective: <name>``, and its
options are the recipe section ``objectives.<name>`` (a mapping, optional: the module's defaults apply). A module
holds

* ``Config``: a dataclass, the objective's recipe options (typed and range-checked like every recipe key);
* ``check(cfg, recipe) -> str | None`` (optional): a check that needs the rest of the recipe, one sentence or None;
* ``Objective``: a subclass of :class:`Objective` below, built as ``Objective(backbone, cfg, recipe, num_classes)``.

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
from typing import ClassVar

import torch
import torch.nn as nn
from torch import Tensor

from interventions import Registry
from train.seeding import step_generator  # noqa: F401  (re-exported: objectives draw their masks and crops with it)


class Objective(nn.Module):
    """What one training step optimises. Subclasses set the class attributes and implement :meth:`forward`
    (or :meth:`loss` for an objective that trains the backbone itself)."""

    name: ClassVar[str] = ""
    uses_labels: ClassVar[bool] = False  # False: eval top-1 is k-NN on backbone features (no classifier head)
    wraps: ClassVar[bool] = True  # the module trained and checkpointed is this objective (backbone + its own parts)
    parts: ClassVar[dict[str, str]] = {"student": "backbone."}  # network name -> its key prefix in the checkpoint

    def __init__(self, backbone: nn.Module, cfg, recipe, num_classes: int):
        super().__init__()
        self.cfg, self.seed, self.total_steps = cfg, recipe.seed, recipe.train.steps
        if self.wraps:
            self.backbone = backbone
        else:
            self.__dict__["_backbone"] = backbone  # not a submodule: the backbone is trained and saved on its own

    @property
    def network(self) -> nn.Module:
        """The backbone a measure reads (the student for a self-distillation objective)."""
        return self.backbone if self.wraps else self.__dict__["_backbone"]

    def trained_module(self) -> nn.Module:
        """What the optimizer trains and the checkpoint saves (what ``accelerate.prepare`` wraps)."""
        return self if self.wraps else self.network

    def loss(self, net: nn.Module, x: Tensor, y: Tensor, step: int) -> tuple[Tensor, dict[str, Tensor]]:
        """One micro-batch's loss and named terms to log (detached scalars, logged as ``train/<name>``). ``net`` is
        :meth:`trained_module` as prepared (DDP-wrapped with several processes): call it, so gradients are synced.
        ``x`` is the normalised, augmented device batch, ``y`` its labels (unused by self-supervised objectives)."""
        return net(x, y, step)

    @torch.no_grad()
    def after_step(self, step: int) -> None:
        """After the optimizer step that made ``step`` steps (EMA updates and the like)."""

    def summary(self) -> dict:
        """What the run's result.json records about the objective at the end (e.g. DINO's collapse diagnosis:
        ``{"collapsed": "...sentence..." or None, ...}``); a non-empty ``warning`` is also printed."""
        return {}

    def no_weight_decay(self) -> set[str]:
        """timm's optimizer factory exempts these parameter names from weight decay (the backbone's, prefixed)."""
        inner = getattr(self.network, "no_weight_decay", lambda: set())()
        return {f"backbone.{n}" for n in inner}

    def describe(self) -> dict:
        """What meta.json and TensorBoard's hparams record about the objective."""
        return {
            "name": self.name,
            **(dataclasses.asdict(self.cfg) if dataclasses.is_dataclass(self.cfg) else {}),
            "parts": dict(self.parts) if self.wraps else {},
        }


PLUGINS = Registry(
    "objective", __name__, module_plugin=lambda mod: hasattr(mod, "Config") and hasattr(mod, "Objective")
)
REGISTRY: dict[str, ModuleType] = PLUGINS.items()  # every module defining Config and Objective


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
    if not mod.Objective.uses_labels:
        a = recipe.data.augment
        if a.mixup_alpha > 0 or a.cutmix_alpha > 0:
            return (
                f"data.augment.mixup_alpha / cutmix_alpha mix labels, which train.objective '{name}' does not use: "
                "set both to 0."
            )
    return mod.check(config_for(recipe), recipe) if hasattr(mod, "check") else None


def build_objective(recipe, backbone: nn.Module, num_classes: int) -> Objective:
    """The recipe's objective around ``backbone``."""
    return REGISTRY[recipe.train.objective].Objective(backbone, config_for(recipe), recipe, num_classes)


def uses_labels(recipe) -> bool:
    return REGISTRY[recipe.train.objective].Objective.uses_labels
