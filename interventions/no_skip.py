"""``no_skip: {blocks: [i, ...], where: attn|mlp|both}`` (Raghu et al. 2021 §6, Fig. 8): the residual
connection(s) of those ViT blocks are removed, x = f(norm(x)) instead of x + f(norm(x)).

Built through timm's ``block_fn`` (which receives the block index), so state-dict keys are unchanged.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Literal


@dataclass
class Config:
    """Remove the residual connection(s) of these blocks: x = f(norm(x)) instead of x + f(norm(x))."""

    blocks: list[int] = field(default_factory=list)
    where: Literal["attn", "mlp", "both"] = "both"


def check(cfg: Config, recipe) -> str | None:
    m = recipe.model
    if cfg.blocks and m.arch != "vit":
        return "key 'interventions.no_skip' applies to ViTs only (model.arch: vit)."
    for b in cfg.blocks:
        if not 0 <= b < m.depth:
            return (
                f"key 'interventions.no_skip.blocks' holds block {b}, out of range: blocks are 0..{m.depth - 1} for "
                f"model.depth {m.depth}."
            )
    return None


@functools.cache
def block_classes():
    """(timm Block, NoSkipBlock). timm is imported on first use, not with this module: recipe validation imports
    every intervention and would otherwise pay for timm (about 1.4 s beyond torch)."""
    from timm.models.vision_transformer import Block

    class NoSkipBlock(Block):
        """timm Block without the residual connection around its attention and/or MLP sublayer."""

        def __init__(self, *args, skip_attn: bool = True, skip_mlp: bool = True, **kwargs):
            super().__init__(*args, **kwargs)
            self.skip_attn, self.skip_mlp = skip_attn, skip_mlp

        def forward(self, x, attn_mask=None, is_causal: bool = False):
            a = self.drop_path1(self.ls1(self.attn(self.norm1(x), attn_mask=attn_mask, is_causal=is_causal)))
            x = x + a if self.skip_attn else a
            f = self.drop_path2(self.ls2(self.mlp(self.norm2(x))))
            return x + f if self.skip_mlp else f

        def extra_repr(self) -> str:
            return f"skip_attn={self.skip_attn}, skip_mlp={self.skip_mlp}"

    return Block, NoSkipBlock


def build_block(cfg: Config, depth: int, args, kwargs):
    """A NoSkipBlock at the listed indices (None elsewhere: a plain block)."""
    if depth not in cfg.blocks:
        return None
    _, NoSkipBlock = block_classes()
    return NoSkipBlock(*args, depth=depth, skip_attn=cfg.where == "mlp", skip_mlp=cfg.where == "attn", **kwargs)
