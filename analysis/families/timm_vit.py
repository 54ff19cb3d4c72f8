"""timm VisionTransformer (``timm.models.vision_transformer``), with class token or GAP, registers and LayerScale.

Block i is ``model.blocks[i]`` (``blocks.{i}``); its taps sit on::

    in           pre-hook on the block
    norm1        output of norm1
    attn_branch  output of drop_path1 (after ls1)
    attn_out     input of norm2
    norm2        output of norm2
    mlp_hidden   output of mlp.act
    mlp_branch   output of drop_path2 (after ls2)
    out          output of the block
    attn_probs   input of attn.attn_drop; fused attention is switched off on the probed blocks inside the context
                 only
    heads        input of attn.norm (an Identity unless built with scale_norm), else of attn.proj; works with fused
                 attention
    proj_in      input of attn.proj: ``heads`` after attn.norm and after any training-time head mask
                 (interventions.head_mask, a pre-hook of attn.proj registered before this one)

For a no-skip block (interventions.no_skip) ``attn_out`` is the branch alone, as the block computes it.
"""

from __future__ import annotations

import torch.nn as nn

from analysis.families.base import Family


class TimmViT(Family):
    name = "timm ViT"
    arch = "vit"

    def matches(self, model: nn.Module) -> bool:
        return hasattr(model, "blocks") and hasattr(model, "patch_embed")

    def blocks(self, model):
        return [f"blocks.{i}" for i in range(len(model.blocks))]

    def hook(self, model, block, kinds, taps):
        blk = model.get_submodule(block)
        p = f"{block}."
        for kind in kinds:
            name = p + kind
            if kind == "in":
                taps.input(blk, name)
            elif kind == "out":
                taps.output(blk, name)
            elif kind in ("norm1", "norm2"):
                taps.output(getattr(blk, kind), name)
            elif kind in ("attn_branch", "mlp_branch", "mlp_hidden"):
                mod = {"attn_branch": "drop_path1", "mlp_branch": "drop_path2", "mlp_hidden": "mlp.act"}[kind]
                taps.output(blk.get_submodule(mod), name)
            elif kind == "attn_out":
                taps.input(blk.norm2, name)
            elif kind == "attn_probs":
                attn = blk.attn
                fused = attn.fused_attn
                attn.fused_attn = False
                taps.on_exit(lambda attn=attn, fused=fused: setattr(attn, "fused_attn", fused))
                taps.input(attn.attn_drop, name)
            elif kind == "heads":
                attn = blk.attn
                taps.input(attn.norm if isinstance(getattr(attn, "norm", None), nn.Module) else attn.proj, name)
            elif kind == "proj_in":
                taps.input(blk.attn.proj, name)

    def prefix(self, model):
        return int(model.num_prefix_tokens)

    def registers(self, model):
        return int(getattr(model, "num_reg_tokens", 0) or 0)

    def has_class_token(self, model):
        return bool(getattr(model, "has_class_token", self.prefix(model) > 0)) and self.prefix(model) > 0

    def grid(self, model):
        return tuple(int(g) for g in model.patch_embed.grid_size)

    def patch_size(self, model):
        return int(model.patch_embed.patch_size[0])

    def image_size(self, model):
        size = getattr(model.patch_embed, "img_size", None)
        return int(size[0]) if size is not None else None

    def preprocessing(self, model):
        return timm_preprocessing(model, self.image_size(model))


def timm_preprocessing(model: nn.Module, size: int | None) -> dict:
    """timm's data configuration of ``model`` (its pretrained_cfg) at input side ``size`` (default: timm's)."""
    from timm.data import resolve_data_config

    cfg = resolve_data_config({}, model=model)
    size = size or int(cfg["input_size"][-1])
    cfg["input_size"] = (3, int(size), int(size))
    return cfg
