"""A test-only self-supervised objective (no labels, a student and an EMA teacher), registered into
train.objectives.REGISTRY by :func:`register`, so the analysis of wrapped checkpoints and init_from are tested
without the real DINO / MAE modules. Its loss is the mean squared norm of the student's features."""

from __future__ import annotations

import copy
import types
from dataclasses import dataclass
from typing import ClassVar

import torch

from train import objectives
from train.objectives import Objective as _Base

NAME = "fake_ssl"


@dataclass
class Config:
    momentum: float = 0.5  # the teacher's EMA momentum


class Objective(_Base):
    name = NAME
    uses_labels = False
    parts: ClassVar[dict] = {"student": "backbone.", "teacher": "teacher_backbone."}

    def __init__(self, backbone, cfg, recipe, num_classes):
        super().__init__(backbone, cfg, recipe, num_classes)
        self.teacher_backbone = copy.deepcopy(backbone).requires_grad_(False)

    def forward(self, x, y, step):
        f = self.backbone(x).float()
        loss = f.pow(2).sum(-1).mean()
        return loss, {"feature_norm": loss.detach().sqrt()}

    @torch.no_grad()
    def after_step(self, step):
        m = self.cfg.momentum
        for t, s in zip(self.teacher_backbone.parameters(), self.backbone.parameters()):
            t.mul_(m).add_(s.detach(), alpha=1 - m)


MODULE = types.SimpleNamespace(Config=Config, Objective=Objective)


def register(monkeypatch) -> None:
    monkeypatch.setitem(objectives.REGISTRY, NAME, MODULE)
