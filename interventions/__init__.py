"""Interventions: changes to a built model or to the train split that a recipe names.

* ``no_skip: {blocks: [i, ...], where: attn|mlp|both}`` (Raghu et al. 2021 §6, Fig. 8): the residual
  connection(s) of those ViT blocks are removed, x = f(norm(x)) instead of x + f(norm(x)). Built through
  timm's ``block_fn`` (which receives the block index), so state-dict keys are unchanged.
* ``head_mask: {block: i, heads: [h, ...]}`` (one mapping or a list): the chosen attention heads' outputs
  are zeroed before the output projection (an ablation); works with fused attention.
* ``data_subset: {fraction: f | count: n, seed: s}`` (Raghu §8, ViT paper §4.3): see
  :func:`train.data.balanced_indices` (class-balanced, seeded, nested); applied in :func:`train.data.build_data`.
* ``model.head: gap`` (Raghu §7): no class token, the token mean feeds the classifier; see train/models.py.
"""
from __future__ import annotations

import functools

import torch
import torch.nn as nn

from train.recipe import RecipeError


def validate_interventions(recipe) -> None:
    """Recipe-level checks that need the model's shape (block and head indices in range)."""
    iv, m = recipe.interventions, recipe.model
    if iv.no_skip is not None and iv.no_skip.blocks:
        if m.arch != "vit":
            raise RecipeError("key 'interventions.no_skip' applies to ViTs only (model.arch: vit).")
        for b in iv.no_skip.blocks:
            if not 0 <= b < m.depth:
                raise RecipeError(f"key 'interventions.no_skip.blocks' holds block {b}, out of range: blocks are 0..{m.depth - 1} for model.depth {m.depth}.")
    for i, hm in enumerate(iv.head_mask):
        if m.arch != "vit":
            raise RecipeError("key 'interventions.head_mask' applies to ViTs only (model.arch: vit).")
        if not 0 <= hm.block < m.depth:
            raise RecipeError(f"key 'interventions.head_mask[{i}].block' is {hm.block}, out of range: blocks are 0..{m.depth - 1}.")
        bad = [h for h in hm.heads if not 0 <= h < m.num_heads]
        if bad or not hm.heads:
            raise RecipeError(f"key 'interventions.head_mask[{i}].heads' must list heads in 0..{m.num_heads - 1}, got {hm.heads}.")
    ds = iv.data_subset
    if ds is not None and (ds.fraction is None) == (ds.count is None):
        raise RecipeError("key 'interventions.data_subset' needs exactly one of 'fraction' (0 < f <= 1) or 'count' (n >= 1).")


def describe(recipe) -> dict:
    """A flat summary of the active interventions for meta.json and TensorBoard hparams."""
    iv = recipe.interventions
    out = {"head": recipe.model.head}
    if iv.no_skip is not None and iv.no_skip.blocks:
        out["no_skip"] = {"blocks": list(iv.no_skip.blocks), "where": iv.no_skip.where}
    if iv.head_mask:
        out["head_mask"] = [{"block": h.block, "heads": list(h.heads)} for h in iv.head_mask]
    if iv.data_subset is not None:
        out["data_subset"] = {"fraction": iv.data_subset.fraction, "count": iv.data_subset.count, "seed": iv.data_subset.seed}
    return out


# ---------------------------------------------------------------- no skip connection at block i


@functools.cache
def _block_cls():
    """(timm Block, NoSkipBlock), built once on first use so that importing this package stays torch-light."""
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


def block_fn_for(interventions):
    """A timm ``block_fn`` that builds a NoSkipBlock at the recipe's no-skip indices and a Block elsewhere."""
    Block, NoSkipBlock = _block_cls()
    ns = getattr(interventions, "no_skip", None)
    if ns is None or not ns.blocks:
        return Block
    blocks, where = set(ns.blocks), ns.where

    def make_block(*args, depth: int = 0, **kwargs):
        if depth in blocks:
            return NoSkipBlock(*args, depth=depth, skip_attn=where == "mlp", skip_mlp=where == "attn", **kwargs)
        return Block(*args, depth=depth, **kwargs)

    return make_block


# ---------------------------------------------------------------- attention head masks


class HeadMask(nn.Module):
    """Zeroes chosen heads in the concatenated head outputs (input of ``attn.proj``): a forward pre-hook."""

    def __init__(self, num_heads: int, heads: list[int]):
        super().__init__()
        mask = torch.ones(num_heads)
        mask[list(heads)] = 0.0
        self.register_buffer("mask", mask, persistent=False)

    def __call__(self, module, args):
        (x,) = args
        b, n, c = x.shape
        h = self.mask.numel()
        return (x.view(b, n, h, c // h) * self.mask.to(x.dtype).view(1, 1, h, 1)).view(b, n, c)


def apply_head_masks(model: nn.Module, masks) -> list:
    handles = []
    for hm in masks:
        attn = model.blocks[hm.block].attn
        hook = HeadMask(attn.num_heads, hm.heads)
        attn.head_mask = hook  # registered as a submodule so .to(device) moves its buffer
        handles.append(attn.proj.register_forward_pre_hook(hook))
    return handles


def apply_model_interventions(model: nn.Module, recipe) -> None:
    """Interventions that change a built model in place (no_skip is applied at build time via block_fn)."""
    if recipe.interventions.head_mask:
        apply_head_masks(model, recipe.interventions.head_mask)
