"""``head_mask: {block: i, heads: [h, ...]}`` (one mapping or a list): the chosen attention heads' outputs are
zeroed before the output projection (an ablation); works with fused attention.

Entries naming the same block mask the union of their heads, through one hook per block.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch.nn as nn


@dataclass
class Config:
    """Zero the outputs of these attention heads of one block (an ablation)."""

    block: int = field(default=0, metadata={"lo": 0})
    heads: list[int] = field(default_factory=list)


ENTRY = list[Config]  # one mapping or a list of them


def check(entries: list[Config], recipe) -> str | None:
    m = recipe.model
    for i, hm in enumerate(entries):
        if m.arch != "vit":
            return "key 'interventions.head_mask' applies to ViTs only (model.arch: vit)."
        if not 0 <= hm.block < m.depth:
            return f"key 'interventions.head_mask[{i}].block' is {hm.block}, out of range: blocks are 0..{m.depth - 1}."
        if not hm.heads or any(not 0 <= h < m.num_heads for h in hm.heads):
            return f"key 'interventions.head_mask[{i}].heads' must list heads in 0..{m.num_heads - 1}, got {hm.heads}."
    return None


@functools.cache
def head_mask_class() -> type:
    """The HeadMask class (an ``nn.Module``). torch is imported on first use, not with this module: recipe validation
    imports every intervention to read its Config, and a bad recipe is refused before torch loads."""
    import torch
    import torch.nn as nn

    class HeadMask(nn.Module):
        """Zeroes chosen heads in the concatenated head outputs (input of ``attn.proj``): a forward pre-hook."""

        def __init__(self, num_heads: int, heads):
            super().__init__()
            mask = torch.ones(num_heads)
            mask[sorted(heads)] = 0.0
            self.register_buffer("mask", mask, persistent=False)

        def __call__(self, module, args):
            (x,) = args
            b, n, c = x.shape
            h = self.mask.numel()
            return (x.view(b, n, h, c // h) * self.mask.to(x.dtype).view(1, 1, h, 1)).view(b, n, c)

    return HeadMask


def __getattr__(name: str):  # ``interventions.head_mask.HeadMask``, built on first use (see head_mask_class)
    if name == "HeadMask":
        return head_mask_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def heads_by_block(entries: list[Config]) -> dict[int, set[int]]:
    """{block: the union of the heads every entry naming it masks}."""
    out: dict[int, set[int]] = {}
    for hm in entries:
        out.setdefault(hm.block, set()).update(hm.heads)
    return out


def apply_model(entries: list[Config], model: nn.Module) -> list:
    """One HeadMask per block, kept as the block's ``attn.head_mask`` submodule (so ``.to(device)`` moves its
    buffer) and registered as a pre-hook of ``attn.proj``; returns the hook handles."""
    handles = []
    for block, heads in heads_by_block(entries).items():
        attn = model.blocks[block].attn
        attn.head_mask = head_mask_class()(attn.num_heads, heads)
        handles.append(attn.proj.register_forward_pre_hook(attn.head_mask))
    return handles
