"""``train.objective: mae``: masked autoencoding (He et al. 2022, "Masked Autoencoders Are Scalable Vision Learners").

Per image, a random ``mask_ratio`` share of the patches is hidden; the encoder (the recipe's ViT, the backbone that
measures read later) sees only the visible patches; a light decoder sees the encoded visible patches plus a shared,
learned mask token at every hidden position, each with a position embedding, and predicts every patch's pixels; the
loss is the mean squared error over the hidden patches only (§3). For an image whose patches (flattened
``patch_size^2 * in_chans`` pixels, row-major over the grid like the patch embedding) are ``t_i`` and whose
prediction is ``p_i``, with ``M`` the set of hidden patches (the same size ``m`` in every image):

    target_i = (t_i - mean(t_i)) / sqrt(var(t_i) + 1e-6)      norm_pix_loss: true (per-patch normalised pixels)
    target_i = t_i                                             norm_pix_loss: false
    loss     = mean over images and i in M of  mean_j (p_ij - target_ij)^2

``var`` is the unbiased variance over the patch's pixels (torch.var, as the authors' code). The pixels ``t`` are
those of the training batch the trainer hands the objective: augmented and already normalised by the data's
per-channel mean / std (MAE's inputs are likewise normalised by the ImageNet mean / std before patchify). With
norm_pix_loss a constant patch (flat background) has target 0.

Following the authors' code (facebookresearch/mae, models_mae.py):

* ``random_masking``: per image, uniform noise over the N patches, argsort; the first ``N - m`` are kept (in noise
  order), the others hidden, and the argsort of that order restores the grid for the decoder. The noise comes from
  :func:`train.seeding.step_generator` (seed, step, process), so a resumed run draws the same masks and every
  process draws its own (micro-batches of one step continue the step's stream).
* The decoder: a linear embedding of the encoder's output to ``decoder_dim``, mask tokens (normal, std 0.02), fixed
  2-D sin-cos position embeddings (the CLS token's is zero, as theirs), ``decoder_depth`` timm ``Block``s of
  ``decoder_heads`` heads (LayerNorm eps 1e-6), a LayerNorm and a linear prediction of ``patch_size^2 * in_chans``
  pixels; Linear layers
  xavier-uniform with zero bias (their init). With a CLS model the CLS token goes through the decoder and its output
  is dropped (theirs); a GAP model has no CLS token.

Where we differ, and why:

* The number of hidden patches is ``m = round(mask_ratio * N)`` (the stated share, exactly); theirs keeps
  ``int(N * (1 - mask_ratio))``, which can hide one more patch than ``round`` when ``N * mask_ratio`` is not whole
  (the same at 49 and 196 patches with 0.75).
* The encoder is the recipe's timm ViT, so the same network is trained by every objective (Walmer et al. 2023's
  comparison): its learned position embedding (theirs: fixed sin-cos), timm's init, and whatever the recipe's
  interventions made of its blocks. It is run from its own parts (``patch_embed``, ``_pos_embed`` with the CLS token
  when ``model.head: cls``, ``norm_pre``, ``blocks``, the final LayerNorm) on the visible patches; the position
  embedding is added before the hidden patches are dropped, as theirs.
* The final LayerNorm: timm's GAP ViT has none per token (``norm`` is an identity) and normalises the pooled mean
  instead (``fc_norm``); MAE's encoder ends in a per-token LayerNorm, so a GAP encoder applies ``fc_norm`` to every
  visible token here. The pooled features the k-NN monitor and the measures read are ``fc_norm`` of the token
  mean, as for a supervised GAP model (and every backbone parameter gets a gradient, which multi-process
  training needs).
* ``norm_pix_loss`` is on by default: the paper's default setting (Table 1d, "pixel (w/ norm)"); the authors'
  script leaves the flag off unless ``--norm_pix_loss`` is passed, which their pre-training instructions do.
* The decoder's size is CPU-sized by default (64 wide, 2 blocks, 4 heads vs their 512 / 8 / 16).

Logged terms: ``mae_loss`` (the loss above) and ``mask_ratio_actual`` (the share of hidden patches in the batch).
The checkpoint holds the backbone under ``backbone.`` (part ``student``) and the decoder under ``decoder_*`` /
``mask_token``; the backbone's keys load into the recipe's ViT built with ``num_classes=0``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial
from typing import ClassVar

import torch
import torch.distributed as dist
import torch.nn as nn
from timm.layers import build_sincos2d_pos_embed
from timm.models.vision_transformer import Block
from torch import Tensor

from train.objectives import Objective as _Base
from train.objectives import step_generator


@dataclass
class Config:
    """MAE's options (He et al. 2022); the decoder is CPU-sized by default."""

    mask_ratio: float = field(default=0.75, metadata={"lo": 0.0, "hi": 1.0, "lo_open": True})  # share of patches hidden
    decoder_dim: int = field(default=64, metadata={"lo": 4})  # decoder width (a multiple of 4 and of decoder_heads)
    decoder_depth: int = field(default=2, metadata={"lo": 1})  # decoder Blocks
    decoder_heads: int = field(default=4, metadata={"lo": 1})
    decoder_mlp_ratio: float = field(default=4.0, metadata={"lo": 0.0, "hi": 64.0, "lo_open": True})
    norm_pix_loss: bool = True  # targets: per-patch normalised pixels (the paper's default) or the pixels themselves


def num_masked(mask_ratio: float, num_patches: int) -> int:
    """Hidden patches per image: ``round(mask_ratio * num_patches)`` (Python's round: a half goes to the even
    number)."""
    return int(round(mask_ratio * num_patches))


def check(cfg: Config, recipe) -> str | None:
    m, d = recipe.model, recipe.data
    if m.arch != "vit":
        return (
            f"train.objective 'mae' needs a ViT (model.arch: vit, not {m.arch}): its encoder runs on the visible "
            "patches only."
        )
    if recipe.interventions is not None and getattr(recipe.interventions, "local_attention", None):
        return (
            "interventions.local_attention fixes the token grid, but train.objective 'mae' feeds the encoder only the "
            "visible patches: remove the intervention or choose another objective."
        )
    n = (d.img_size // m.patch_size) ** 2
    k = num_masked(cfg.mask_ratio, n)
    if k < 1 or k > n - 1:
        what = "no patch" if k < 1 else "every patch"
        return (
            f"key 'objectives.mae.mask_ratio' ({cfg.mask_ratio}) hides {what} of the {n}-patch grid "
            f"(round(mask_ratio * {n}) = {k}): choose a ratio that leaves at least one patch hidden and one visible."
        )
    if cfg.decoder_dim % cfg.decoder_heads or cfg.decoder_dim % 4:
        return (
            f"key 'objectives.mae.decoder_dim' ({cfg.decoder_dim}) must be a multiple of 4 (the 2-D sin-cos position "
            f"embedding) and of 'objectives.mae.decoder_heads' ({cfg.decoder_heads})."
        )
    return None


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
