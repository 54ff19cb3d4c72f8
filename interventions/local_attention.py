"""``local_attention: {blocks: [i, ...], heads: [h, ...], offset: [dr, dc], radius: r, strength: s}`` (one mapping
or a list): the chosen heads of the chosen ViT blocks may attend, from each spatial query, only to the spatial keys
within ``radius`` tokens of (query + offset) on the patch grid. A POSITIVE CONTROL for the locality detectors
(attention distance, aligned attention / offset local heads, head subsets): heads known to be local or offset by
construction, which those analyses must report as such.

For head h and a spatial query at grid cell (r, c), the window's centre is (r + dr, c + dc) clamped onto the grid
(a query whose offset point lies off the grid looks at the nearest cell on it, so no row is empty), and the allowed
keys are the spatial tokens (r', c') with max(|r' - centre_r|, |c' - centre_c|) <= radius (a square window,
clipped at the grid border). Prefix tokens (CLS) are handled so that every forced head is purely spatial and the
classifier keeps its global token: a spatial query of a forced head may not attend to CLS, while the CLS query
attends everywhere as before. ``radius: 0, offset: [0, 0]`` is a head that attends only to its own token.

``strength`` null (the default) is a hard mask: -inf outside the window, so those keys get exactly zero
attention. A number is a soft bias: ``-strength`` is added to the attention logits outside the window, which
training can outgrow. Inside the window nothing is added: where a head looks within it is learned.

How it applies, without forking timm's Attention: timm's ``Attention.forward(x, attn_mask=...)`` adds a float
``attn_mask`` to the logits in both its fused (``scaled_dot_product_attention``) and its explicit path; a forward
pre-hook on each chosen block's ``attn`` passes the bias [1, H, T, T] (zero on the free heads) as that mask. The bias is
a non-persistent buffer of a submodule ``attn.local_bias``, so ``.to(device)`` moves it and the state dict's keys do not
change (checkpoints of a run load into the same recipe's model). analysis/engine/taps.py reads the attention
probabilities after the softmax of the explicit path, so it sees the biased attention.

Entries may name different blocks, heads, offsets and radii; two entries may not force the same head of the same
block. Works with ``no_skip`` blocks (their attention is called the same way).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch
    import torch.nn as nn


@dataclass
class Config:
    """Restrict these heads of these blocks to a window of ``radius`` tokens around (query + offset) on the grid."""

    blocks: list[int] = field(default_factory=lambda: [0])
    heads: list[int] = field(default_factory=lambda: [0])
    offset: list[int] = field(default_factory=lambda: [0, 0])  # (rows, columns) in tokens: [0, 1] = one token right
    radius: int = field(default=1, metadata={"lo": 0})  # Chebyshev radius of the window, in tokens
    strength: float | None = field(default=None, metadata={"lo": 0.0, "lo_open": True})  # null: hard mask


ENTRY = list[Config]  # one mapping or a list of them


def _key(i: int, name: str) -> str:
    return f"interventions.local_attention[{i}].{name}"


def check(entries: list[Config], recipe) -> str | None:
    m = recipe.model
    if m.arch != "vit":
        return "key 'interventions.local_attention' applies to ViTs only (model.arch: vit)."
    g = recipe.data.img_size // m.patch_size
    seen: set[tuple[int, int]] = set()
    for i, e in enumerate(entries):
        if not e.blocks or any(not 0 <= b < m.depth for b in e.blocks):
            return f"key '{_key(i, 'blocks')}' must list blocks in 0..{m.depth - 1}, got {e.blocks}."
        if not e.heads or any(not 0 <= h < m.num_heads for h in e.heads):
            return f"key '{_key(i, 'heads')}' must list heads in 0..{m.num_heads - 1}, got {e.heads}."
        if len(e.offset) != 2 or any(abs(o) > g - 1 for o in e.offset):
            return (
                f"key '{_key(i, 'offset')}' must be [rows, columns], each in -{g - 1}..{g - 1} on the {g}x{g} token "
                f"grid, got {e.offset}."
            )
        if e.radius >= g - 1:
            return (
                f"key '{_key(i, 'radius')}' is {e.radius}: a window of radius {g - 1} or more covers the whole {g}x{g} "
                "token "
                f"grid from every cell and restricts nothing; use 0..{g - 2}."
            )
        for b in e.blocks:
            for h in e.heads:
                if (b, h) in seen:
                    return (
                        f"key '{_key(i, 'heads')}' forces head {h} of block {b} a second time: name each head of a "
                        "block once."
                    )
                seen.add((b, h))
    return None


def window(grid: tuple[int, int], offset, radius: int) -> torch.Tensor:
    """[N, N] bool, N = gh * gw spatial tokens in row-major order: key k is in query q's window (module docstring)."""
    import torch  # here, not with the module: recipe validation reads Config without loading torch

    gh, gw = grid
    r = torch.arange(gh).repeat_interleave(gw)
    c = torch.arange(gw).repeat(gh)
    cr = (r + offset[0]).clamp(0, gh - 1)
    cc = (c + offset[1]).clamp(0, gw - 1)
    return ((r[None, :] - cr[:, None]).abs() <= radius) & ((c[None, :] - cc[:, None]).abs() <= radius)


def head_bias(
    grid: tuple[int, int], num_prefix_tokens: int, offset, radius: int, strength: float | None
) -> torch.Tensor:
    """[T, T] float32 additive attention bias of one forced head, T = prefix + N: 0 where allowed, -inf (hard) or
    -strength elsewhere; prefix queries are unrestricted, spatial queries may not attend to prefix keys."""
    import torch

    p = num_prefix_tokens
    n = grid[0] * grid[1]
    allowed = torch.ones(p + n, p + n, dtype=torch.bool)
    allowed[p:, :p] = False
    allowed[p:, p:] = window(grid, offset, radius)
    out = torch.zeros(p + n, p + n)
    return out.masked_fill(~allowed, float("-inf") if strength is None else -float(strength))


@functools.cache
def bias_class() -> type:
    """The LocalAttentionBias class (an ``nn.Module``), built on first use: torch is not imported with this module
    (recipe validation imports every intervention to read its Config)."""
    import torch
    import torch.nn as nn

    class LocalAttentionBias(nn.Module):
        """Holds one block's bias [H, T, T] (a non-persistent buffer: no state-dict key) and passes it to timm's
        Attention as ``attn_mask`` through :meth:`hook`, a forward pre-hook with kwargs."""

        def __init__(self, bias: torch.Tensor):
            super().__init__()
            self.register_buffer("bias", bias, persistent=False)

        def hook(self, module, args, kwargs):
            x = args[0] if args else kwargs["x"]
            t = self.bias.shape[-1]
            if x.shape[1] != t:
                raise RuntimeError(
                    f"interventions.local_attention was built for {t} tokens; this forward has {x.shape[1]} "
                    "(another image size?): build the model for the image size it sees."
                )
            if kwargs.get("is_causal"):
                raise RuntimeError("interventions.local_attention cannot combine with is_causal attention.")
            device = x.device.type
            dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else x.dtype  # q's dtype
            bias = self.bias.to(dtype).unsqueeze(0)  # [1, H, T, T]
            mask = kwargs.get("attn_mask")
            if mask is not None:  # a caller's own mask: both apply
                if mask.dtype == torch.bool:
                    mask = torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(~mask, float("-inf"))
                bias = bias + mask.to(dtype)
            return args, {**kwargs, "attn_mask": bias}

        def extra_repr(self) -> str:
            forced = (self.bias != 0).flatten(1).any(1)
            return f"heads={forced.nonzero().flatten().tolist()}, tokens={self.bias.shape[-1]}"

    return LocalAttentionBias


def __getattr__(name: str):  # ``interventions.local_attention.LocalAttentionBias``, built on first use
    if name == "LocalAttentionBias":
        return bias_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def biases_by_block(
    entries: list[Config], num_heads: int, grid: tuple[int, int], num_prefix_tokens: int
) -> dict[int, torch.Tensor]:
    """{block: bias [H, T, T]} with every entry's heads filled in (zeros on the free heads)."""
    import torch

    t = num_prefix_tokens + grid[0] * grid[1]
    out: dict[int, torch.Tensor] = {}
    for e in entries:
        hb = head_bias(grid, num_prefix_tokens, e.offset, e.radius, e.strength)
        for b in e.blocks:
            bias = out.setdefault(b, torch.zeros(num_heads, t, t))
            for h in e.heads:
                bias[h] = hb
    return out


def apply_model(entries: list[Config], model: nn.Module) -> list:
    """One LocalAttentionBias per named block, kept as ``attn.local_bias`` and registered as a forward pre-hook (with
    kwargs) of ``attn``; returns the hook handles."""
    grid = tuple(int(g) for g in model.patch_embed.grid_size)
    handles = []
    for block, bias in biases_by_block(
        entries, model.blocks[0].attn.num_heads, grid, int(model.num_prefix_tokens)
    ).items():
        attn = model.blocks[block].attn
        attn.local_bias = bias_class()(bias)
        handles.append(attn.register_forward_pre_hook(attn.local_bias.hook, with_kwargs=True))
    return handles
