"""``train.objective: supervised`` (the default): cross-entropy on the classifier head's logits, with
``train.label_smoothing``; with CutMix / mixup on (``data.augment``), timm's ``Mixup`` makes soft targets and the
loss is timm's ``SoftTargetCrossEntropy`` (DeiT's recipe). The backbone is trained and checkpointed by itself."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch.nn.functional as F
from timm.loss import SoftTargetCrossEntropy

from train import augment
from train.objectives import Objective as _Base


@dataclass
class Config:
    """No options of its own: label smoothing is ``train.label_smoothing``, mixing is ``data.augment``."""


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
