"""The training code of ``train.objective: mae`` (train/objectives/mae.py holds its options and describes it): apart,
so that reading the recipe schema imports no torch."""

from __future__ import annotations

from functools import partial
from typing import TYPE_CHECKING, ClassVar

import torch
import torch.distributed as dist
import torch.nn as nn
from timm.layers import build_sincos2d_pos_embed
from timm.models.vision_transformer import Block
from torch import Tensor

from train.objectives import step_generator
from train.objectives._base import Objective as _Base
from train.objectives.mae import num_masked

if TYPE_CHECKING:
    from train.objectives.mae import Config


def patchify(x: Tensor, p: int) -> Tensor:
    """[B, C, H, W] -> [B, (H/p)(W/p), p*p*C]: patches row-major over the grid (the patch embedding's token order),
    each flattened as (row, column, channel), as the authors' ``patchify``."""
    b, c, h, w = x.shape
    x = x.reshape(b, c, h // p, p, w // p, p)
    return torch.einsum("nchpwq->nhwpqc", x).reshape(b, (h // p) * (w // p), p * p * c)


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _init_mae(m: nn.Module) -> None:
    """The authors' init of the decoder: xavier-uniform Linear weights, zero biases, LayerNorm (1, 0)."""
    if isinstance(m, nn.Linear):
        nn.init.xavier_uniform_(m.weight)
        if m.bias is not None:
            nn.init.zeros_(m.bias)
    elif isinstance(m, nn.LayerNorm):
        nn.init.ones_(m.weight)
        nn.init.zeros_(m.bias)


class Objective(_Base):
    name = "mae"
    uses_labels = False
    parts: ClassVar[dict[str, str]] = {"student": "backbone."}

    def __init__(self, backbone, cfg: Config, recipe, num_classes: int):
        super().__init__(backbone, cfg, recipe, num_classes)
        self.patch_size = recipe.model.patch_size
        self.norm_pix_loss = cfg.norm_pix_loss
        grid = tuple(int(g) for g in backbone.patch_embed.grid_size)
        self.num_patches = grid[0] * grid[1]
        self.num_masked = num_masked(cfg.mask_ratio, self.num_patches)
        self.num_prefix = int(backbone.num_prefix_tokens)  # 1: the CLS token (head: cls); 0: GAP
        # the encoder's final per-token LayerNorm: `norm`, or for a GAP ViT (norm is an identity) `fc_norm`
        self._final_norm = "fc_norm" if isinstance(backbone.norm, nn.Identity) else "norm"
        dd = cfg.decoder_dim
        self.decoder_embed = nn.Linear(backbone.embed_dim, dd)
        self.mask_token = nn.Parameter(torch.zeros(1, 1, dd))
        # fixed 2-D sin-cos embedding of the grid (not saved: a function of the grid and width)
        self.register_buffer(
            "decoder_pos_embed", build_sincos2d_pos_embed(list(grid), dd).unsqueeze(0), persistent=False
        )
        norm = partial(nn.LayerNorm, eps=1e-6)  # the authors' LayerNorm
        self.decoder_blocks = nn.Sequential(
            *[
                Block(dd, cfg.decoder_heads, cfg.decoder_mlp_ratio, qkv_bias=True, norm_layer=norm)
                for _ in range(cfg.decoder_depth)
            ]
        )
        self.decoder_norm = norm(dd)
        self.decoder_pred = nn.Linear(dd, self.patch_size**2 * recipe.data.in_chans)
        for mod in (self.decoder_embed, self.decoder_blocks, self.decoder_norm, self.decoder_pred):
            mod.apply(_init_mae)
        nn.init.normal_(self.mask_token, std=0.02)
        self._gen: tuple[int, torch.Generator] | None = None  # (step, its generator): micro-batches continue the stream

    # ---------------------------------------------------------------- the parts of one step

    def generator(self, step: int, device) -> torch.Generator:
        """The masking generator of ``step`` on this process (one stream per step, continued across its
        micro-batches)."""
        if self._gen is None or self._gen[0] != step or self._gen[1].device.type != torch.device(device).type:
            self._gen = (step, step_generator(self.seed, step, _rank(), device))
        return self._gen[1]

    def random_masking(self, batch: int, step: int, device) -> tuple[Tensor, Tensor, Tensor]:
        """(ids_keep [B, N - m], mask [B, N] with 1 = hidden, ids_restore [B, N]) as the authors' random_masking."""
        n, keep = self.num_patches, self.num_patches - self.num_masked
        noise = torch.rand(batch, n, generator=self.generator(step, device), device=device)
        ids_shuffle = noise.argsort(dim=1)  # ascending: small noise is kept
        ids_restore = ids_shuffle.argsort(dim=1)
        mask = torch.ones(batch, n, device=device)
        mask[:, :keep] = 0
        return ids_shuffle[:, :keep], mask.gather(1, ids_restore), ids_restore

    def encode(self, x: Tensor, ids_keep: Tensor) -> Tensor:
        """The backbone on the visible patches ``ids_keep`` [B, K]: [B, prefix + K, D] (CLS token first if any)."""
        bb = self.backbone
        t = bb._pos_embed(bb.patch_embed(x))  # prefix tokens + position embedding, as timm's forward_features
        pre, patches = t[:, : self.num_prefix], t[:, self.num_prefix :]
        patches = patches.gather(1, ids_keep.unsqueeze(-1).expand(-1, -1, t.shape[-1]))
        t = torch.cat([pre, patches], dim=1)
        t = bb.norm_pre(bb.patch_drop(t))
        t = bb.blocks(t)
        return getattr(bb, self._final_norm)(t)

    def decode(self, latent: Tensor, ids_restore: Tensor) -> Tensor:
        """Predicted pixels of every patch [B, N, p*p*C] from the encoded visible patches (the authors'
        forward_decoder)."""
        z = self.decoder_embed(latent)
        b, p = z.shape[0], self.num_prefix
        tokens = torch.cat([z[:, p:], self.mask_token.expand(b, self.num_patches - (z.shape[1] - p), -1)], dim=1)
        tokens = tokens.gather(1, ids_restore.unsqueeze(-1).expand(-1, -1, z.shape[-1]))  # back to grid order
        tokens = tokens + self.decoder_pos_embed.to(tokens.dtype)
        z = torch.cat([z[:, :p], tokens], dim=1)  # the CLS token's position embedding is zero
        z = self.decoder_norm(self.decoder_blocks(z))
        return self.decoder_pred(z)[:, p:]

    def target(self, x: Tensor) -> Tensor:
        """The patches of ``x`` to reconstruct [B, N, p*p*C] (per-patch normalised when norm_pix_loss)."""
        t = patchify(x.float(), self.patch_size)
        if self.norm_pix_loss:
            t = (t - t.mean(dim=-1, keepdim=True)) / (t.var(dim=-1, keepdim=True) + 1e-6) ** 0.5
        return t

    def forward(self, x: Tensor, y: Tensor | None = None, step: int = 0) -> tuple[Tensor, dict[str, Tensor]]:
        ids_keep, mask, ids_restore = self.random_masking(x.shape[0], step, x.device)
        pred = self.decode(self.encode(x, ids_keep), ids_restore).float()
        per_patch = ((pred - self.target(x)) ** 2).mean(dim=-1)  # [B, N]
        loss = (per_patch * mask).sum() / mask.sum()  # mean over the hidden patches
        return loss, {"mae_loss": loss.detach(), "mask_ratio_actual": mask.mean()}
