"""The base class of every objective's module (train/objectives/__init__.py describes the contract). Apart from the
package, so that reading the recipe schema (every objective's ``Config``) imports no torch."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import torch
import torch.nn as nn
from torch import Tensor


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
