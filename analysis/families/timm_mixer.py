"""timm MLP-Mixer (``timm.models.mlp_mixer.MlpMixer`` made of MixerBlocks; ResMLP and gMLP use other blocks).

Block i (``blocks.{i}``, z' = z + dp(T(mlp_tokens(T(norm1(z))))), out = z' + dp(mlp_channels(norm2(z'))), T the
transpose of tokens and channels) has the transformer tap names with token mixing in the place of attention, so
measures written for ViT blocks read the same positions::

    in           pre-hook on the block
    norm1        output of norm1 (the token-mixing MLP's input)
    attn_branch  token-mixing branch: 1st call of the block's drop_path
    attn_out     input of norm2
    norm2        output of norm2 (the channel MLP's input)
    mlp_hidden   output of mlp_channels.act
    mlp_branch   channel-mixing branch: 2nd call of the block's drop_path
    out          output of the block

A MixerBlock applies ONE drop_path module to both branches, so its forward hook fires twice per forward; a pre-hook on
the block resets a per-block call counter so call 0 is the token branch and call 1 the channel branch. There is no
``attn_probs`` and no prefix token; the token grid is ``model.stem.grid_size``."""

from __future__ import annotations

import torch.nn as nn

from analysis.families.base import Family
from analysis.families.timm_vit import timm_preprocessing

MIXER_KINDS = ("in", "attn_branch", "attn_out", "mlp_hidden", "mlp_branch", "out", "norm1", "norm2")


class TimmMixer(Family):
    name = "timm MLP-Mixer"
    arch = "mixer"

    def matches(self, model):
        from timm.models.mlp_mixer import MixerBlock

        blocks = getattr(model, "blocks", None)
        return (
            hasattr(model, "stem")
            and isinstance(blocks, nn.Sequential)
            and len(blocks) > 0
            and all(isinstance(b, MixerBlock) for b in blocks)
        )

    def blocks(self, model):
        return [f"blocks.{i}" for i in range(len(model.blocks))]

    def kinds(self, model, block):
        return MIXER_KINDS

    def hook(self, model, block, kinds, taps):
        blk = model.get_submodule(block)
        p = f"{block}."
        if "in" in kinds:
            taps.input(blk, p + "in")
        if "out" in kinds:
            taps.output(blk, p + "out")
        if "attn_out" in kinds:
            taps.input(blk.norm2, p + "attn_out")
        for k in ("norm1", "norm2"):
            if k in kinds:
                taps.output(getattr(blk, k), p + k)
        if "mlp_hidden" in kinds:
            taps.output(blk.mlp_channels.act, p + "mlp_hidden")
        branches = [(i, p + k) for i, k in enumerate(("attn_branch", "mlp_branch")) if k in kinds]
        if branches:  # one drop_path module serves both branches: count its calls within each block forward
            calls = [0]

            def reset(mod, args):
                calls[0] = 0

            def on_drop_path(mod, args, out):
                for i, name in branches:
                    if calls[0] == i:
                        taps.store(name, out)
                calls[0] += 1

            taps.handle(blk.register_forward_pre_hook(reset))
            taps.handle(blk.drop_path.register_forward_hook(on_drop_path))

    def grid(self, model):
        return tuple(int(g) for g in model.stem.grid_size)

    def patch_size(self, model):
        return int(model.stem.patch_size[0])

    def image_size(self, model):
        size = getattr(model.stem, "img_size", None)
        return int(size[0]) if size is not None else None

    def preprocessing(self, model):
        return timm_preprocessing(model, self.image_size(model))
