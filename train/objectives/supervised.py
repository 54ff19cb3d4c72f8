"""``train.objective: supervised`` (the default): cross-entropy on the classifier head's logits, with
``train.label_smoothing``; with CutMix / mixup on (``data.augment``), timm's ``Mixup`` makes soft targets and the
loss is timm's ``SoftTargetCrossEntropy`` (DeiT's recipe). The backbone is trained and checkpointed by itself."""

from __future__ import annotations

from dataclasses import dataclass

from vitlab.plugins import deferred


@dataclass
class Config:
    """No options of its own: label smoothing is ``train.label_smoothing``, mixing is ``data.augment``."""


# Objective (torch, timm) is train/objectives/_supervised.py, imported when first asked for: reading the recipe
# schema imports this module and no torch
__getattr__ = deferred(__name__, "train.objectives._supervised")
