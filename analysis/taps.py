"""Taps: named intermediate tensors of a timm ViT, ResNet or MLP-Mixer, captured with forward hooks (no forks).

ViT block i (``blocks.{i}.``), with z the residual stream and f the sublayer branches::

    in           block input z_i                          (pre-hook on the block)
    norm1        norm1(z_i), the attention's input        (output of norm1)
    attn_branch  f_attn(norm1(z_i)), after ls1/drop_path1 (output of drop_path1)
    attn_out     residual stream after the attention sublayer, z_i + f_attn (input of norm2)
    norm2        norm2(attn_out), the MLP's input         (output of norm2)
    mlp_hidden   MLP hidden activations                   (output of mlp.act)
    mlp_branch   f_mlp(norm2(.)), after ls2/drop_path2    (output of drop_path2)
    out          block output                             (output of the block)
    attn_probs   attention probabilities [B, H, T, T]     (input of attn.attn_drop; fused attention is
                 switched off on the probed blocks inside the context only)
    heads        the heads' outputs before the output projection, (A_h V_h) of every head h concatenated,
                 [B, T, H * dh], channels h*dh:(h+1)*dh = head h (input of attn.norm, or of attn.proj when the
                 attention has no norm module; works with fused attention)
    proj_in      what attn.proj receives: ``heads`` after attn.norm (an Identity unless the model was built with
                 scale_norm) and after any training-time head mask (interventions.head_mask, a pre-hook of
                 attn.proj that runs before this one): where head ablations act (analysis/measures/ablation.py)

For a no-skip block (interventions.no_skip) ``attn_out`` is the branch alone, as the block computes it.

ResNet residual block (``layer{s}.{j}.``, timm BasicBlock or Bottleneck)::

    in           block input                              (pre-hook on the block)
    conv1 bn1 act1 conv2 bn2            BasicBlock: the layers inside the branch (outputs of those modules)
    conv1 bn1 act1 conv2 bn2 act2 conv3 bn3   Bottleneck: the same
    branch       residual branch, after se/drop_path      (output of the branch's last module)
    shortcut     identity (the block input) or the downsample's output
    out          block output, act(shortcut + branch)     (output of the block)

The block's final activation is ``out`` (BasicBlock ``act2``, Bottleneck ``act3``), so it has no tap of its own:
an ``act{n}`` is tapped only when a ``conv{n+1}`` follows it. ``bn*`` outputs are cloned when captured, because
the next activation (ReLU(inplace=True)) or the shortcut addition overwrite them in place.
:func:`block_kinds` lists the kinds of one block (they depend on the block type).

MLP-Mixer block i (``blocks.{i}.``, timm MixerBlock: z' = z + dp(T(mlp_tokens(T(norm1(z))))),
out = z' + dp(mlp_channels(norm2(z'))), T = transpose of tokens and channels) has the ViT tap names with
token mixing in the place of attention, so measures written for ViT blocks read the same positions::

    in           block input z_i                          (pre-hook on the block)
    norm1        norm1(z_i), the token-mixing MLP's input (output of norm1)
    attn_branch  token-mixing branch, after drop_path     (1st call of the block's drop_path)
    attn_out     stream after token mixing, z_i + branch  (input of norm2)
    norm2        norm2(attn_out), the channel MLP's input (output of norm2)
    mlp_hidden   channel-mixing MLP hidden activations    (output of mlp_channels.act)
    mlp_branch   channel-mixing branch, after drop_path   (2nd call of the block's drop_path)
    out          block output                             (output of the block)

MixerBlock applies ONE drop_path module to both branches, so its forward hook fires twice per forward; a
pre-hook on the block resets a per-block call counter so call 0 is the token branch and call 1 the channel
branch. There is no ``attn_probs`` and no prefix token (see :func:`num_prefix_tokens`); the token grid is
``model.stem.grid_size`` (:func:`grid_of`). :func:`arch_of` tells the three apart.

Usage::

    with Taps(model, ["blocks.0.out", "blocks.0.attn_probs"]) as cap:
        model(x)
    cap["blocks.0.out"]          # Tensor, detached

Every requested tap must fire during the context, or TapError is raised at exit; hooks are always removed.
This is the ONE map from tap names to timm modules: every measure, the receptive fields (``graph=True``: tensors
keep their autograd graph) and the head-subset comparison read their tensors through it.
"""

from __future__ import annotations

import torch
import torch.nn as nn
from timm.models.mlp_mixer import MixerBlock

VIT_KINDS = (
    "in",
    "attn_branch",
    "attn_out",
    "mlp_hidden",
    "mlp_branch",
    "out",
    "attn_probs",
    "heads",
    "proj_in",
    "norm1",
    "norm2",
)
RESNET_KINDS = ("in", "branch", "shortcut", "out")  # every residual block; the layers inside: RESNET_INNER_KINDS
RESNET_INNER_KINDS = (
    "conv1",
    "bn1",
    "act1",
    "conv2",
    "bn2",
    "act2",
    "conv3",
    "bn3",
)  # those the block has (block_kinds)
MIXER_KINDS = ("in", "attn_branch", "attn_out", "mlp_hidden", "mlp_branch", "out", "norm1", "norm2")


class TapError(RuntimeError):
    """A requested tap is unknown for this model or never fired."""


def is_vit(model: nn.Module) -> bool:
    """A timm VisionTransformer (not an MLP-Mixer, whose patch embedding is ``stem``)."""
    return hasattr(model, "blocks") and hasattr(model, "patch_embed")


def is_mixer(model: nn.Module) -> bool:
    """A timm MlpMixer made of MixerBlocks (timm's ResMLP/gMLP variants use other blocks and are not tapped)."""
    blocks = getattr(model, "blocks", None)
    return (
        hasattr(model, "stem")
        and isinstance(blocks, nn.Sequential)
        and len(blocks) > 0
        and all(isinstance(b, MixerBlock) for b in blocks)
    )


def arch_of(model: nn.Module) -> str:
    """``"vit"``, ``"mixer"`` or ``"resnet"``; TapError for any other model."""
    if is_vit(model):
        return "vit"
    if is_mixer(model):
        return "mixer"
    if resnet_blocks(model):
        return "resnet"
    raise TapError(f"taps understand timm VisionTransformer, MlpMixer and ResNet models, not {type(model).__name__}.")


def num_prefix_tokens(model: nn.Module) -> int:
    """Prefix (CLS/register) tokens before the spatial tokens: ``model.num_prefix_tokens`` for a ViT, else 0."""
    return int(model.num_prefix_tokens) if is_vit(model) else 0


def resnet_blocks(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """[("layer1.0", block), ...] in forward order."""
    out = []
    for s in range(1, 10):
        layer = getattr(model, f"layer{s}", None)
        if layer is None:
            break
        out += [(f"layer{s}.{j}", blk) for j, blk in enumerate(layer)]
    return out


def resnet_branch_end(blk: nn.Module) -> nn.Module:
    """The last module of a ResNet block's residual branch (drop_path, else se, else the last bn): its output is the
    branch as the block adds it to the shortcut."""
    return next(
        m
        for m in (
            getattr(blk, "drop_path", None),
            getattr(blk, "se", None),
            getattr(blk, "bn3", None),
            getattr(blk, "bn2", None),
        )
        if isinstance(m, nn.Module)
    )


def block_names(model: nn.Module) -> list[str]:
    """The model's residual blocks in forward order: ``blocks.{i}`` (ViT, Mixer) or ``layer{s}.{j}`` (ResNet)."""
    if arch_of(model) in ("vit", "mixer"):
        return [f"blocks.{i}" for i in range(len(model.blocks))]
    return [n for n, _ in resnet_blocks(model)]


def resnet_inner_kinds(blk: nn.Module) -> tuple[str, ...]:
    """The layers inside a ResNet block that have taps, in forward order: ``conv{n}``/``bn{n}`` where the block
    has them, ``act{n}`` only when ``conv{n+1}`` follows (the last activation is the block output ``out``)."""

    def has(name):
        return isinstance(getattr(blk, name, None), nn.Module)

    return tuple(k for k in RESNET_INNER_KINDS if has(k) and (not k.startswith("act") or has(f"conv{int(k[3:]) + 1}")))


def block_kinds(model: nn.Module, block: str) -> tuple[str, ...]:
    """The tap kinds of one block (``blocks.3``, ``layer2.0``): the architecture's kinds, and for a ResNet block
    also the layers inside it (:func:`resnet_inner_kinds`)."""
    arch = arch_of(model)
    if arch == "vit":
        return VIT_KINDS
    if arch == "mixer":
        return MIXER_KINDS
    return RESNET_KINDS + resnet_inner_kinds(model.get_submodule(block))


def available_taps(model: nn.Module) -> list[str]:
    return [f"{b}.{k}" for b in block_names(model) for k in block_kinds(model, b)]


def grid_of(model: nn.Module) -> tuple[int, int]:
    """Token grid (rows, cols) of a ViT (``patch_embed.grid_size``) or Mixer (``stem.grid_size``)."""
    arch = arch_of(model)
    if arch == "resnet":
        raise TapError("a ResNet has no token grid: grid_of applies to ViTs and Mixers.")
    return tuple(model.patch_embed.grid_size if arch == "vit" else model.stem.grid_size)


class Taps:
    """Context manager capturing the named tensors (see the module docstring) of one or more forwards.

    With ``accumulate=False`` (default) each tap keeps the tensor of the latest forward; with
    ``accumulate=True`` it keeps a list of all of them. ``to`` moves captures (e.g. "cpu") as they arrive.
    With ``graph=True`` captures keep their autograd graph (for input gradients) and a module output that is
    captured is passed on as a clone, so a later in-place op (a ResNet's ``x += shortcut``) leaves it intact.
    """

    def __init__(
        self, model: nn.Module, names: list[str], accumulate: bool = False, to=None, dtype=None, graph: bool = False
    ):
        self.model, self.names, self.accumulate, self.to, self.dtype = model, list(names), accumulate, to, dtype
        self.graph = graph
        known = set(available_taps(model))
        bad = [n for n in self.names if n not in known]
        if bad:
            blk = bad[0].rsplit(".", 1)[0]
            if blk in block_names(model):
                raise TapError(
                    f"unknown tap '{bad[0]}' for {type(model).__name__}: the tap kinds of {blk} are "
                    f"{', '.join(block_kinds(model, blk))} (see analysis/taps.py)."
                )
            raise TapError(
                f"unknown tap '{bad[0]}' for {type(model).__name__}: taps look like {sorted(known)[:3]} ... "
                "(see analysis/taps.py)."
            )
        self.captures: dict = {}
        self._handles: list = []
        self._fused: list = []

    # -- storage
    def _store(self, name: str, t: torch.Tensor) -> None:
        if not self.graph:
            t = t.detach()
        if self.dtype is not None:
            t = t.to(self.dtype)
        if self.to is not None:
            t = t.to(self.to)
        if self.accumulate:
            self.captures.setdefault(name, []).append(t)
        else:
            self.captures[name] = t

    def _out(self, name, clone: bool = False):
        def hook(mod, args, out):
            if self.graph:
                self._store(name, out)
                return out.clone()
            self._store(name, out.clone() if clone else out)
            return None

        return hook

    def _in(self, name):
        return lambda mod, args: self._store(name, args[0])

    def __getitem__(self, name):
        return self.captures[name]

    # -- hooks
    def __enter__(self) -> Taps:
        want: dict[str, set] = {}
        for n in self.names:
            blk, kind = n.rsplit(".", 1)
            want.setdefault(blk, set()).add(kind)
        modules = dict(self.model.named_modules())
        mixer = arch_of(self.model) == "mixer"
        for blk_name, kinds in want.items():
            blk = modules[blk_name]
            p = f"{blk_name}."
            if mixer:
                self._hook_mixer_block(blk, p, kinds)
                continue
            for kind in kinds:
                self._hook_kind(blk, p + kind, kind)
        return self

    def _hook_kind(self, blk: nn.Module, name: str, kind: str) -> None:
        """The hook of one tap of a ViT or ResNet block (the module docstring says which module it sits on)."""
        reg = self._handles.append
        if kind == "in":
            reg(blk.register_forward_pre_hook(self._in(name)))
        elif kind == "out":
            reg(blk.register_forward_hook(self._out(name)))
        elif kind in ("norm1", "norm2"):
            reg(getattr(blk, kind).register_forward_hook(self._out(name)))
        elif kind in RESNET_INNER_KINDS:  # bn outputs are overwritten in place by the next ReLU or the shortcut add
            reg(getattr(blk, kind).register_forward_hook(self._out(name, clone=kind.startswith("bn"))))
        elif kind in ("attn_branch", "mlp_branch", "mlp_hidden"):
            mod = {"attn_branch": "drop_path1", "mlp_branch": "drop_path2", "mlp_hidden": "mlp.act"}[kind]
            reg(blk.get_submodule(mod).register_forward_hook(self._out(name)))
        elif kind == "attn_out":
            reg(blk.norm2.register_forward_pre_hook(self._in(name)))
        elif kind == "attn_probs":
            attn = blk.attn
            self._fused.append((attn, attn.fused_attn))
            attn.fused_attn = False
            reg(attn.attn_drop.register_forward_pre_hook(self._in(name)))
        elif kind == "heads":
            attn = blk.attn
            target = attn.norm if isinstance(getattr(attn, "norm", None), nn.Module) else attn.proj
            reg(target.register_forward_pre_hook(self._in(name)))
        elif kind == "proj_in":
            reg(blk.attn.proj.register_forward_pre_hook(self._in(name)))
        elif kind == "branch":  # the branch's last module; cloned because the block adds the shortcut in place
            reg(resnet_branch_end(blk).register_forward_hook(self._out(name, clone=True)))
        elif kind == "shortcut" and blk.downsample is not None:
            reg(blk.downsample.register_forward_hook(self._out(name)))
        elif kind == "shortcut":
            reg(blk.register_forward_pre_hook(self._in(name)))

    def _hook_mixer_block(self, blk: nn.Module, p: str, kinds: set) -> None:
        reg = self._handles.append
        if "in" in kinds:
            reg(blk.register_forward_pre_hook(self._in(p + "in")))
        if "out" in kinds:
            reg(blk.register_forward_hook(self._out(p + "out")))
        if "attn_out" in kinds:
            reg(blk.norm2.register_forward_pre_hook(self._in(p + "attn_out")))
        for k in ("norm1", "norm2"):
            if k in kinds:
                reg(getattr(blk, k).register_forward_hook(self._out(p + k)))
        if "mlp_hidden" in kinds:
            reg(blk.mlp_channels.act.register_forward_hook(self._out(p + "mlp_hidden")))
        branches = [(i, p + k) for i, k in enumerate(("attn_branch", "mlp_branch")) if k in kinds]
        if branches:  # one drop_path module serves both branches: count its calls within each block forward
            calls = [0]

            def reset(mod, args):
                calls[0] = 0

            def on_drop_path(mod, args, out):
                for i, name in branches:
                    if calls[0] == i:
                        self._store(name, out)
                calls[0] += 1

            reg(blk.register_forward_pre_hook(reset))
            reg(blk.drop_path.register_forward_hook(on_drop_path))

    def __exit__(self, exc_type, exc, tb) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
        for attn, fused in self._fused:
            attn.fused_attn = fused
        self._fused.clear()
        if exc_type is None:
            missing = [n for n in self.names if n not in self.captures]
            if missing:
                raise TapError(
                    f"tap '{missing[0]}' never fired during the forward pass: the model does not run that module "
                    "(a changed block class, torch.compile, or no forward inside the context)."
                )
