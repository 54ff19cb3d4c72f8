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

from vitlab.plugins import deferred


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


# the training code (patchify, the decoder, Objective: torch, timm) is train/objectives/_mae.py, imported when first
# asked for: reading the recipe schema imports this module and no torch
__getattr__ = deferred(__name__, "train.objectives._mae")
