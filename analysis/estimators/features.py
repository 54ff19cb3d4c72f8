"""Features shared by several measures: pooling a layer's tokens to one vector per image, a layer's spatial
tokens on their grid (ResNet feature maps patched as in Raghu et al. 2021 App. A, or plainly pooled), pooled block
outputs gathered over processes, and tag names.

ResNet "tokens". Raghu et al. 2021 §7 define a ResNet token as "all the convolutional channels at a particular
spatial location" (localization, Fig. 9). For the linear probes, App. A ("Additional details on linear probes")
adds two steps: "we perform an additional pooling step bringing the feature map to the same spatial size as in the
last stage [...] before pooling we split the feature map into patches and flattened each patch, so as to arrive at
the channel count close to the channel count in the final block. All results presented in the paper include this
additional patching step; however, we have found that it brings only a very minor improvement on top of simple
pooling." Their code is not published. Here (``resnet_tokens`` option of the measures that take ResNet tokens):

``"patch"``: :func:`patchify` splits the map [B, C, H, W] into non-overlapping p x p patches (row-major) and
flattens each patch to one vector of C * p * p values ordered (channel, row in patch, column in patch) -- the
``pixel_unshuffle`` order -- giving [B, C p^2, H // p, W // p] (rows / columns that do not fill a patch are dropped);
then it is average-pooled to at most ``max_side`` per side like ``"pool"``. The patch side p
(:func:`resnet_patch_side`) is the largest p with ``C p^2 <= C_final`` (the final block's channels, "close to the
channel count in the final block" without exceeding it) that divides H and W and keeps at least the pooled grid
(``H // p >= min(H, max_side)``), so both modes give the same token grid; or a fixed p (option ``resnet_patch``).
``"pool"``: the map is average-pooled (``adaptive_avg_pool2d``) to at most ``max_side`` per side, each position's C
channels one token (this project's earlier definition, and Raghu §7's for localization).

Where ours departs from App. A: the paper pools to the LAST STAGE's spatial size (7 x 7 for ResNet-50 at 224 px);
we pool to ``max_side`` (default 7, the grid of ViT-B/32 and of this project's default ViT), which differs from
the last stage when the input is not 224 px (the project's Fashion-MNIST ResNet ends at 4 x 4: set
``resnet_max_side: 4`` to follow the paper there). The rule for p is ours: the paper only says "close to".
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from analysis.engine.measure import Context
from analysis.engine.reduce import collect
from analysis.engine.taps import block_names
from analysis.families import TapError, family_of

DEFAULT_MAX_SIDE = 7  # ResNet maps larger than this per side are reduced to it for token-level measures
RESNET_TOKENS = ("patch", "pool")


def patchify(fmap: Tensor, patch: int) -> Tensor:
    """Split a feature map [B, C, H, W] into non-overlapping ``patch`` x ``patch`` patches and flatten each to one
    vector: [B, C * patch^2, H // patch, W // patch], entry ``c * patch^2 + i * patch + j`` of the patch at (r, s)
    being ``fmap[:, c, r * patch + i, s * patch + j]`` (Raghu et al. 2021 App. A patching step). Trailing rows and
    columns that do not fill a patch are dropped. ``patch = 1`` returns ``fmap`` itself."""
    if fmap.ndim != 4:
        raise ValueError(f"a feature map must be [B, C, H, W], got shape {tuple(fmap.shape)}")
    if patch < 1 or patch > min(fmap.shape[-2:]):
        raise ValueError(f"patch side {patch} does not fit a {fmap.shape[-2]}x{fmap.shape[-1]} feature map")
    if patch == 1:
        return fmap
    h, w = (fmap.shape[-2] // patch) * patch, (fmap.shape[-1] // patch) * patch
    return F.pixel_unshuffle(fmap[..., :h, :w], patch)


def resnet_patch_side(
    shape: tuple[int, ...],
    final_channels: int | None,
    mode: str = "patch",
    patch: int = 0,
    max_side: int = DEFAULT_MAX_SIDE,
) -> int:
    """The patch side for a ResNet map of ``shape`` [B, C, H, W] (module docstring): 1 for ``mode="pool"``,
    ``patch`` when > 0, else the largest p with ``C p^2 <= final_channels`` dividing H and W and with
    ``H // p >= min(H, max_side)`` and ``W // p >= min(W, max_side)``."""
    if mode not in RESNET_TOKENS:
        raise ValueError(f"unknown ResNet token mode {mode!r}: use one of {', '.join(RESNET_TOKENS)}")
    if mode == "pool":
        return 1
    if patch > 0:
        return int(patch)
    if final_channels is None:
        raise ValueError("the automatic patch side needs the final block's channel count")
    c, h, w = (int(v) for v in shape[-3:])
    best = 1
    for p in range(2, min(h, w) + 1):
        if c * p * p > final_channels:
            break
        if h % p == 0 and w % p == 0 and h // p >= min(h, max_side) and w // p >= min(w, max_side):
            best = p
    return best


def final_channels(model: torch.nn.Module) -> int | None:
    """The channel count of a ResNet's final block (timm ``num_features``; wrappers' ``.module`` unwrapped)."""
    while hasattr(model, "module") and not hasattr(model, "num_features"):
        model = model.module
    n = getattr(model, "num_features", None)
    return int(n) if n is not None else None


def pool_tokens(tokens: Tensor, how: str, num_prefix_tokens: int) -> Tensor:
    """Pool a block's tokens [B, T, D] to one vector [B, D] per image, the representation a per-layer probe reads.

    ``"cls"``: ``tokens[:, 0]`` (error if ``num_prefix_tokens == 0``: a GAP model has no CLS token);
    ``"mean"``: ``tokens.mean(1)`` over all T tokens; ``"mean_spatial"``: ``tokens[:, num_prefix_tokens:].mean(1)``
    (Raghu et al. 2021 probe CLS and the mean of the spatial tokens, Fig. 11/13); ``"token:<t>"``: ``tokens[:, t]``.
    """
    if tokens.ndim != 3:
        raise ValueError(f"tokens must be [B, T, D], got shape {tuple(tokens.shape)}")
    if not 0 <= num_prefix_tokens <= tokens.shape[1]:
        raise ValueError(f"num_prefix_tokens={num_prefix_tokens} out of range for T={tokens.shape[1]}")
    if how == "cls":
        if num_prefix_tokens == 0:
            raise ValueError("how='cls' needs a prefix (CLS) token, but num_prefix_tokens == 0")
        return tokens[:, 0]
    if how == "mean":
        return tokens.mean(1)
    if how == "mean_spatial":
        if num_prefix_tokens >= tokens.shape[1]:
            raise ValueError("how='mean_spatial' but there are no spatial tokens")
        return tokens[:, num_prefix_tokens:].mean(1)
    if how.startswith("token:"):
        t = int(how.split(":", 1)[1])
        if not -tokens.shape[1] <= t < tokens.shape[1]:
            raise ValueError(f"token index {t} out of range for T={tokens.shape[1]}")
        return tokens[:, t]
    raise ValueError(f"unknown pooling {how!r}: use 'cls', 'mean', 'mean_spatial' or 'token:<t>'")


def pool_features(t: Tensor, how: str, num_prefix_tokens: int, patch: int = 1) -> Tensor:
    """One vector per image: :func:`pool_tokens` for token tensors [B, T, D]; a ResNet feature map [B, C, H, W]
    is averaged over positions (only ``"mean"`` / ``"mean_spatial"``: it has no CLS token), after
    :func:`patchify` with side ``patch`` when > 1 (then [B, C patch^2]: the mean of the patch-flattened tokens);
    [B, D] unchanged."""
    if t.ndim == 4:
        if how not in ("mean", "mean_spatial"):
            raise ValueError(f"a feature map [B, C, H, W] has no {how!r} pooling; use 'mean_spatial'")
        return patchify(t, patch).mean(dim=(2, 3))
    if t.ndim == 2:
        return t
    return pool_tokens(t, how, num_prefix_tokens)


def spatial_tokens(
    t: torch.Tensor,
    num_prefix_tokens: int = 0,
    grid: tuple[int, int] | None = None,
    max_side: int = DEFAULT_MAX_SIDE,
    patch: int = 1,
) -> tuple[torch.Tensor, tuple[int, int]]:
    """A layer's spatial tokens [B, T, D] and their grid (gh, gw).

    ViT tokens [B, prefix + T, D]: the prefix tokens are dropped and ``grid`` (the patch grid) must be given.
    ResNet feature maps [B, C, H, W]: :func:`patchify` with side ``patch`` (1: none), then average-pooled to at most
    ``max_side`` per side when larger, then each position's vector is a token (row-major); see the module docstring."""
    if t.ndim == 4:
        t = patchify(t, patch)
        h, w = t.shape[-2:]
        if h > max_side or w > max_side:
            t = F.adaptive_avg_pool2d(t, (min(h, max_side), min(w, max_side)))
        return t.flatten(2).transpose(1, 2), (int(t.shape[-2]), int(t.shape[-1]))
    if t.ndim != 3:
        raise ValueError(f"tokens must be [B, T, D] or a feature map [B, C, H, W], got shape {tuple(t.shape)}")
    if grid is None:
        raise ValueError("ViT tokens need the patch grid (gh, gw)")
    t = t[:, num_prefix_tokens:]
    if t.shape[1] != grid[0] * grid[1]:
        raise ValueError(
            f"{t.shape[1]} spatial tokens after {num_prefix_tokens} prefix tokens, but the grid {grid} has "
            f"{grid[0] * grid[1]}"
        )
    return t, (int(grid[0]), int(grid[1]))


def layer_tag(layer: str, block_index: int) -> str:
    """``blockXX`` for a block output tap, ``blockXX_<kind>`` for another tap of the block."""
    kind = layer.rsplit(".", 1)[-1]
    return f"block{int(block_index):02d}" + ("" if kind == "out" else f"_{kind}")


def has_class_token(model, num_prefix_tokens: int) -> bool:
    """Whether token 0 is a class token, as the model's family says (a GAP ViT with registers has prefix tokens but
    no class token); for a model of no known family, whether there is any prefix token."""
    while hasattr(model, "module") and not hasattr(model, "has_class_token"):
        model = model.module
    try:
        return family_of(model).has_class_token(model) and num_prefix_tokens > 0
    except TapError:
        return bool(getattr(model, "has_class_token", num_prefix_tokens > 0)) and num_prefix_tokens > 0


def pools_for(ctx: Context) -> list[str]:
    """``["cls", "mean_spatial"]`` for token models with a class token, else ``["mean_spatial"]`` (registers are
    prefix tokens but not a class token: a GAP ViT with registers pools ``mean_spatial`` only)."""
    cls = ctx.arch != "resnet" and has_class_token(ctx.model, ctx.prefix)
    return ["cls", "mean_spatial"] if cls else ["mean_spatial"]


def blocks_of(ctx: Context) -> list[str]:
    """The block names in forward order (``ctx.blocks``, else :func:`analysis.engine.taps.block_names` of the model)."""
    return list(ctx.blocks) if ctx.blocks else block_names(ctx.model)


def block_tag(i: int) -> str:
    return f"block{i:02d}"


# Per-image features that measures keep until finish (probes, k-NN, clustering: N x D per layer and pool, the one
# part of an analysis's memory that grows with the number of images) are stored as float16: half of float32's
# memory, a relative rounding of at most 2^-11 (4.9e-4) per value, far below the differences the probes and
# neighbours read. A tensor with a value beyond float16's range (|x| > 65504) is kept as float32 instead.
STORED_DTYPE = torch.float16
_FLOAT16_MAX = 65504.0


def stored(t: Tensor) -> Tensor:
    """``t`` on the CPU as kept per image (:data:`STORED_DTYPE`; float32 where a value exceeds float16's range)."""
    t = t.detach()
    if t.is_floating_point() and t.numel() and float(t.abs().max()) <= _FLOAT16_MAX:
        return t.to("cpu", STORED_DTYPE)
    return t.float().cpu() if t.is_floating_point() else t.cpu()


def restored(feats: dict) -> dict:
    """Stored features (:func:`stored`) back to float32 for computing; other tensors unchanged."""
    return {k: (v.float() if v.is_floating_point() else v) for k, v in feats.items()}


class PooledFeatures:
    """Per-minibatch pooled ``<block>.out`` features for several pools, gathered in minibatch order with
    :func:`analysis.engine.reduce.collect` (the same on 1 and N processes). Keys are ``"<pool>|<block>"``; kept as
    float16 on the CPU (:func:`stored`: N x D per key), gathered as float32."""

    def __init__(self, blocks: list[str], pools: list[str], prefix: int) -> None:
        self.blocks, self.pools, self.prefix = blocks, pools, prefix
        self.parts: list = []

    def taps(self) -> set[str]:
        return {f"{b}.out" for b in self.blocks}

    def add(self, j: int, cap: dict, y: Tensor) -> None:
        feats = {
            f"{p}|{b}": stored(pool_features(cap[f"{b}.out"].detach(), p, self.prefix))
            for p in self.pools
            for b in self.blocks
        }
        self.parts.append((int(j), feats, y.detach().cpu().long()))

    def gather(self, accelerator=None) -> tuple[dict[str, Tensor], Tensor]:
        """({"<pool>|<block>": [N, D]}, labels [N]); raises if no minibatch was seen on any process."""
        try:
            feats, y = collect(self.parts, accelerator)
            return restored(feats), y
        except IndexError:  # collect of no parts at all
            raise ValueError("no minibatches were accumulated") from None


def num_classes(ctx: Context, *labels: Tensor) -> int:
    """The data's class count (or one more than the largest label seen)."""
    k = getattr(ctx.data, "num_classes", None)
    return int(k) if k else int(max(int(y.max()) for y in labels if y.numel())) + 1
