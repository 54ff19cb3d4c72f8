"""The training code of ``train.objective: supervised`` (train/objectives/supervised.py holds its options and
describes it): apart, so that reading the recipe schema imports no torch."""

from __future__ import annotations

from typing import ClassVar

import torch.nn.functional as F
from timm.loss import SoftTargetCrossEntropy

from train import augment
from train.objectives._base import Objective as _Base


class Objective(_Base):
    name = "supervised"
    uses_labels = True
    wraps = False
    parts: ClassVar[dict[str, str]] = {}

    def __init__(self, backbone, cfg, recipe, num_classes: int):
        super().__init__(backbone, cfg, recipe, num_classes)
        self.label_smoothing = recipe.train.label_smoothing
        self.mixer = augment.make_mixer(
            recipe.data.augment, num_classes, recipe.train.label_smoothing
        )  # None: hard labels
        self.soft_ce = SoftTargetCrossEntropy()

    def loss(self, net, x, y, step):
        if self.mixer is not None:
            x, y = self.mixer(x, y)  # y: soft targets [B, num_classes], smoothed by train.label_smoothing
            return self.soft_ce(net(x).float(), y), {}
        return F.cross_entropy(net(x).float(), y, label_smoothing=self.label_smoothing), {}
