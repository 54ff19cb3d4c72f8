"""timm ResNet (``timm.models.resnet``: BasicBlock or Bottleneck residual blocks in ``layer1`` ... ``layer4``).

Residual block ``layer{s}.{j}``::

    in           pre-hook on the block
    conv1 bn1 act1 conv2 bn2            BasicBlock: the layers inside the branch (outputs of those modules)
    conv1 bn1 act1 conv2 bn2 act2 conv3 bn3   Bottleneck: the same
    branch       residual branch, after se/drop_path (output of the branch's last module)
    shortcut     identity (the block input) or the downsample's output
    out          block output, act(shortcut + branch)

The block's final activation is ``out`` (BasicBlock ``act2``, Bottleneck ``act3``), so it has no tap of its own: an
``act{n}`` is tapped only when a ``conv{n+1}`` follows it. ``bn*`` outputs are cloned when captured, because the
next activation (ReLU(inplace=True)) or the shortcut addition overwrite them in place.
"""

from __future__ import annotations

import torch.nn as nn

from analysis.families.base import Family
from analysis.families.timm_vit import timm_preprocessing

RESNET_KINDS = ("in", "branch", "shortcut", "out")  # every residual block; the layers inside: RESNET_INNER_KINDS
RESNET_INNER_KINDS = ("conv1", "bn1", "act1", "conv2", "bn2", "act2", "conv3", "bn3")  # those the block has


def resnet_blocks(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """[("layer1.0", block), ...] in forward order."""
    out = []
    for s in range(1, 10):
        layer = getattr(model, f"layer{s}", None)
        if layer is None:
            break
        out += [(f"layer{s}.{j}", blk) for j, blk in enumerate(layer)]
    return out


def branch_end(blk: nn.Module) -> nn.Module:
    """The last module of a block's residual branch (drop_path, else se, else the last bn): its output is the branch
    as the block adds it to the shortcut."""
    return next(
        m
        for m in (
            getattr(blk, "drop_path", None),
            getattr(blk, "se", None),
            getattr(blk, "bn3", None),
            getattr(blk, "bn2", None),
        )
        if isinstance(m, nn.Module)
    )


def inner_kinds(blk: nn.Module) -> tuple[str, ...]:
    """The layers inside a block that have taps, in forward order: ``conv{n}``/``bn{n}`` where the block has them,
    ``act{n}`` only when ``conv{n+1}`` follows (the last activation is the block output ``out``)."""

    def has(name):
        return isinstance(getattr(blk, name, None), nn.Module)

    return tuple(k for k in RESNET_INNER_KINDS if has(k) and (not k.startswith("act") or has(f"conv{int(k[3:]) + 1}")))


class TimmResNet(Family):
    name = "timm ResNet"
    arch = "resnet"

    def matches(self, model):
        return bool(resnet_blocks(model))

    def blocks(self, model):
        return [n for n, _ in resnet_blocks(model)]

    def kinds(self, model, block):
        return RESNET_KINDS + inner_kinds(model.get_submodule(block))

    def hook(self, model, block, kinds, taps):
        blk = model.get_submodule(block)
        for kind in kinds:
            name = f"{block}.{kind}"
            if kind == "in":
                taps.input(blk, name)
            elif kind == "out":
                taps.output(blk, name)
            elif kind in RESNET_INNER_KINDS:  # bn outputs are overwritten in place by the next ReLU or the shortcut add
                taps.output(getattr(blk, kind), name, clone=kind.startswith("bn"))
            elif kind == "branch":  # the branch's last module; cloned because the block adds the shortcut in place
                taps.output(branch_end(blk), name, clone=True)
            elif kind == "shortcut" and blk.downsample is not None:
                taps.output(blk.downsample, name)
            elif kind == "shortcut":
                taps.input(blk, name)

    def duplicate(self, model, block, kind):
        """An identity ``shortcut`` repeats the block's ``in``; a ``branch`` without an SE module repeats the last
        ``bn`` (drop_path is the identity in evaluation)."""
        blk = model.get_submodule(block)
        if kind == "shortcut":
            return getattr(blk, "downsample", None) is None
        if kind == "branch":
            return getattr(blk, "se", None) is None
        return False

    def preprocessing(self, model):
        return timm_preprocessing(model, None)
