"""open_clip's image tower (``open_clip.transformer.VisionTransformer``: ``model.visual`` of a CLIP model).

Pass the tower, ``model.visual``: a whole CLIP model (two towers) is refused with a sentence that says so, and so is
an open_clip tower that wraps a timm model (its ``.trunk`` is a timm ViT, read by analysis/families/timm_vit.py).
:func:`load` builds a tower for the front ends from an open_clip architecture name and a weights file.

Block i is ``transformer.resblocks[i]`` (named ``blocks.{i}``): a ``ResidualAttentionBlock`` computes
``x = x + ls_1(attn(ln_1(x)))``, ``x = x + ls_2(mlp(ln_2(x)))`` with ``attn`` torch's ``nn.MultiheadAttention`` and
``mlp`` = c_fc, gelu, c_proj. Its taps sit on::

    in           pre-hook on the block
    norm1        output of ln_1
    attn_branch  output of ls_1 (an Identity without layer scale)
    attn_out     input of ln_2
    norm2        output of ln_2
    mlp_hidden   output of mlp.gelu
    mlp_branch   output of ls_2
    out          output of the block
    attn_probs   recomputed from the attention's input (see below)
    heads        recomputed: probs @ v, heads concatenated ([B, T, H * dh], channels h*dh:(h+1)*dh: head h)
    proj_in      the same tensor as ``heads``: nothing stands between the heads and out_proj in torch's attention

``nn.MultiheadAttention`` hands its out_proj's weights to ``F.multi_head_attention_forward`` (out_proj's hooks never
fire) and open_clip calls it with ``need_weights=False`` (a fused kernel may run, which forms no probabilities). So a
pre-hook on ``attn`` recomputes q, k, v from the attention's input with ``in_proj_weight`` / ``in_proj_bias``,
``softmax(q k^T / sqrt(dh))`` and ``probs @ v``, in the order torch's own ``need_weights=True`` path computes them:
the taps are right whatever kernel the forward runs, and the forward itself is untouched. This costs one extra
attention per probed block, only when one of these three kinds is asked for.

A ``CustomResidualAttentionBlock`` (built for qk_norm, scaled cosine attention, head scales, ...) uses open_clip's
own ``Attention``, whose modules show ``heads`` (the input of ``attn.ln_inner``, after any head scale) and
``proj_in`` (the input of ``attn.out_proj``); ``attn_probs`` is recomputed there too (with its qk-norm, or its scaled
cosine logits), since its fused path forms no probabilities and its eager path fails in open_clip 3.3 (torch.bmm
on [B, H, T, dh]); ``attn_branch`` is the output of ``ls_1``, after ``ln_attn``.

open_clip 3.x runs the blocks batch-first ([B, T, C], ``transformer.batch_first``); older towers (whose
``nn.MultiheadAttention`` keeps torch's default layout) and a ``Transformer`` built with ``batch_first=False`` run them
sequence-first ([T, B, C]): the taps are always delivered as [B, T, C] (a copy, in the sequence-first case).
The recomputed attention leaves out attention dropout (the analysis runs in eval mode, where there is none).

Tokens: open_clip always prepends the class token (``class_embedding``) whatever the pooling (``pool_type`` tok or
avg, or attentional pooling after the blocks), so the blocks see 1 prefix token and ``grid_size`` spatial tokens in
row-major order. Preprocessing: the tower's ``preprocess_cfg`` (or ``image_mean`` / ``image_std``, which
open_clip.create_model sets), else OpenAI CLIP's mean and std; bicubic resize of the shorter side and a centre crop
(crop_pct 1).

``import open_clip`` happens in :func:`load` only: :meth:`OpenClipViT.matches` reads the class's module name.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

from analysis.families.base import TRANSFORMER_KINDS, Family, TapError, first_tensor
from train.errors import UserError

OPENAI_MEAN = (0.48145466, 0.4578275, 0.40821073)
OPENAI_STD = (0.26862954, 0.26130258, 0.27577711)
CROP_MODES = {"shortest": "center", "squash": "squash", "longest": "border"}  # open_clip resize_mode -> timm crop_mode


def _module_name(obj) -> str:
    return type(obj).__module__ or ""


class OpenClipViT(Family):
    name = "open_clip ViT"
    exact = True  # known by its class's library
    arch = "vit"
    # ablation rewrites timm's Block / Attention forward (analysis/measures/ablation.py)
    needs_internals = frozenset({"ablation"})

    def matches(self, model: nn.Module) -> bool:
        if not _module_name(model).startswith("open_clip."):
            return False
        if isinstance(getattr(model, "visual", None), nn.Module):
            raise TapError(
                f"an open_clip {type(model).__name__} holds an image and a text tower: pass its image tower, "
                "model.visual."
            )
        if isinstance(getattr(model, "trunk", None), nn.Module):
            raise TapError(
                f"this open_clip {type(model).__name__} wraps a timm model: pass its trunk, model.visual.trunk."
            )
        return isinstance(getattr(getattr(model, "transformer", None), "resblocks", None), nn.ModuleList) and hasattr(
            model, "conv1"
        )

    # -- blocks
    def blocks(self, model):
        return [f"blocks.{i}" for i in range(len(model.transformer.resblocks))]

    def block(self, model, name):
        head, _, idx = name.partition(".")
        blocks = model.transformer.resblocks
        if head != "blocks" or not idx.isdigit() or int(idx) >= len(blocks):
            raise TapError(
                f"no block '{name}' in this open_clip tower: its blocks are blocks.0 ... blocks.{len(blocks) - 1}."
            )
        return blocks[int(idx)]

    def kinds(self, model, block):
        return TRANSFORMER_KINDS

    def hook(self, model, block, kinds, taps):
        blk = self.block(model, block)
        bf = batch_first(model)
        p = f"{block}."
        simple = {
            "in": (blk, "input"),
            "out": (blk, "output"),
            "norm1": (blk.ln_1, "output"),
            "attn_branch": (blk.ls_1, "output"),
            "attn_out": (blk.ln_2, "input"),
            "norm2": (blk.ln_2, "output"),
            "mlp_hidden": (blk.mlp.gelu, "output"),
            "mlp_branch": (blk.ls_2, "output"),
        }
        for kind in sorted(kinds & simple.keys()):
            mod, where = simple[kind]
            _tap(taps, mod, p + kind, where, bf)
        attn_kinds = kinds & {"attn_probs", "heads", "proj_in"}
        if not attn_kinds:
            return
        if isinstance(blk.attn, nn.MultiheadAttention):
            _hook_mha(blk.attn, {k: p + k for k in attn_kinds}, taps)
        else:
            _hook_custom(blk.attn, {k: p + k for k in attn_kinds}, taps)

    # -- tokens
    def prefix(self, model):
        return int(getattr(model, "class_embedding", None) is not None)

    def has_class_token(self, model):
        return self.prefix(model) > 0

    def grid(self, model):
        return tuple(int(g) for g in model.grid_size)

    def patch_size(self, model):
        ps = model.patch_size
        return int(ps[0] if isinstance(ps, (tuple, list)) else ps)

    def image_size(self, model):
        size = model.image_size
        return int(size[0] if isinstance(size, (tuple, list)) else size)

    def preprocessing(self, model):
        cfg = dict(getattr(model, "preprocess_cfg", None) or {})
        mean = cfg.get("mean") or getattr(model, "image_mean", None) or OPENAI_MEAN
        std = cfg.get("std") or getattr(model, "image_std", None) or OPENAI_STD
        size = self.image_size(model)
        return {
            "input_size": (3, size, size),
            "interpolation": cfg.get("interpolation") or "bicubic",
            "mean": tuple(float(m) for m in mean),
            "std": tuple(float(s) for s in std),
            "crop_pct": 1.0,
            "crop_mode": CROP_MODES.get(cfg.get("resize_mode") or "shortest", "center"),
        }


def batch_first(model: nn.Module) -> bool:
    """Whether the tower's blocks see [B, T, C] (open_clip 3.x) rather than [T, B, C]."""
    found = getattr(model.transformer, "batch_first", None)
    if found is None:  # an older open_clip: the MHA's own layout (torch's default, sequence-first)
        found = getattr(model.transformer.resblocks[0].attn, "batch_first", False)
    return bool(found)


def _bt(t: torch.Tensor, bf: bool) -> torch.Tensor:
    """``t`` as [B, T, C]: itself when batch-first, else a contiguous copy of its transpose."""
    return t if bf else t.transpose(0, 1).clone(memory_format=torch.contiguous_format)


def _tap(taps, module: nn.Module, name: str, where: str, bf: bool) -> None:
    """Tap ``module``'s input or output as ``name``, transposed to [B, T, C] when the blocks run sequence-first."""
    if bf:
        (taps.input if where == "input" else taps.output)(module, name)
        return
    if where == "input":

        def pre(mod, args, kwargs):
            t = args[0] if args else next(v for v in kwargs.values() if isinstance(v, torch.Tensor))
            taps.store(name, _bt(t, False))

        taps.handle(module.register_forward_pre_hook(pre, with_kwargs=True))
    else:

        def post(mod, args, out):
            taps.store(name, _bt(first_tensor(out), False))  # a copy: a later in-place op cannot reach it

        taps.handle(module.register_forward_hook(post))


def mha_attention(attn: nn.MultiheadAttention, q_x, k_x=None, v_x=None, attn_mask=None):
    """(probabilities [B, H, T, S], heads [B, T, H * dh]) of torch's multi-head attention on batch-first inputs,
    computed as ``F.multi_head_attention_forward`` does with ``need_weights=True, average_attn_weights=False``
    (in-projection, q scaled by 1/sqrt(dh), q k^T (+ mask), softmax, probs @ v; dropout left out: eval)."""
    k_x = q_x if k_x is None else k_x
    v_x = k_x if v_x is None else v_x
    if attn.bias_k is not None or attn.add_zero_attn:
        raise TapError("attention taps of an nn.MultiheadAttention with bias_k/bias_v or add_zero_attn are not read.")
    if attn._qkv_same_embed_dim:
        w_q, w_k, w_v = attn.in_proj_weight.chunk(3)
    else:
        w_q, w_k, w_v = attn.q_proj_weight, attn.k_proj_weight, attn.v_proj_weight
    b_q, b_k, b_v = attn.in_proj_bias.chunk(3) if attn.in_proj_bias is not None else (None, None, None)
    B, T, S, H = q_x.shape[0], q_x.shape[1], k_x.shape[1], attn.num_heads
    q = F.linear(q_x, w_q, b_q).view(B, T, H, -1).transpose(1, 2)
    k = F.linear(k_x, w_k, b_k).view(B, S, H, -1).transpose(1, 2)
    v = F.linear(v_x, w_v, b_v).view(B, S, H, -1).transpose(1, 2)
    logits = (q * (q.shape[-1] ** -0.5)) @ k.transpose(-2, -1)
    if attn_mask is not None:
        if attn_mask.dtype == torch.bool:
            attn_mask = torch.zeros_like(attn_mask, dtype=logits.dtype).masked_fill_(attn_mask, float("-inf"))
        logits = logits + (attn_mask.view(B, -1, T, S) if attn_mask.ndim == 3 else attn_mask)  # [B*H, T, S] or [T, S]
    probs = logits.softmax(dim=-1)
    heads = (probs @ v).transpose(1, 2).reshape(B, T, -1)
    return probs, heads


def _hook_mha(attn: nn.MultiheadAttention, names: dict, taps) -> None:
    """A pre-hook on torch's attention that recomputes the kinds of ``names`` ({kind: tap name}) from its inputs."""

    def pre(mod, args, kwargs):
        qkv = [args[i] if len(args) > i else kwargs.get(("query", "key", "value")[i]) for i in range(3)]
        if not mod.batch_first:
            qkv = [t.transpose(0, 1) if t is not None else None for t in qkv]
        probs, heads = mha_attention(mod, *qkv, attn_mask=kwargs.get("attn_mask"))
        for kind, name in names.items():
            taps.store(name, probs if kind == "attn_probs" else heads)

    taps.handle(attn.register_forward_pre_hook(pre, with_kwargs=True))


def custom_attention_probs(attn: nn.Module, x: torch.Tensor, attn_mask=None) -> torch.Tensor:
    """Attention probabilities [B, H, T, T] of open_clip's own ``Attention`` on [B, T, C], as its eager path forms
    them (scaled cosine attention with its clamped logit scale, else qk-norm and q k^T / sqrt(dh))."""
    B, T, _ = x.shape
    q, k, _v = F.linear(x, attn.in_proj_weight, attn.in_proj_bias).chunk(3, dim=-1)
    q, k = (t.reshape(B, T, attn.num_heads, -1).transpose(1, 2) for t in (q, k))
    if attn.logit_scale is not None:
        logits = F.normalize(q, dim=-1) @ F.normalize(k, dim=-1).transpose(-1, -2)
        logits = logits * torch.clamp(attn.logit_scale, max=attn.logit_scale_max).exp()
    else:
        logits = (attn.ln_q(q) * attn.scale) @ attn.ln_k(k).transpose(-1, -2)
    if attn_mask is not None:
        if attn_mask.dtype == torch.bool:
            attn_mask = torch.zeros_like(attn_mask, dtype=logits.dtype).masked_fill_(attn_mask, float("-inf"))
        logits = logits + (attn_mask.view(B, -1, T, T) if attn_mask.ndim == 3 else attn_mask)
    return logits.softmax(dim=-1)


def _hook_custom(attn: nn.Module, names: dict, taps) -> None:
    """open_clip's own Attention (custom blocks): the probabilities recomputed from its input (its eager path does not
    run in open_clip 3.3: torch.bmm on 4-d tensors), the heads and out_proj's input from its modules."""
    if "attn_probs" in names:

        def pre(mod, args, kwargs):
            x = args[0] if args else kwargs["x"]
            taps.store(names["attn_probs"], custom_attention_probs(mod, x, kwargs.get("attn_mask")))

        taps.handle(attn.register_forward_pre_hook(pre, with_kwargs=True))
    if "heads" in names:
        taps.input(attn.ln_inner, names["heads"])
    if "proj_in" in names:
        taps.input(attn.out_proj, names["proj_in"])


# ---------------------------------------------------------------------------------------------------------- loader


class OpenClipError(UserError, ValueError):
    """An open_clip tower cannot be built or loaded as asked; the message is one sentence for the user."""


def _open_clip():
    try:
        import open_clip
    except ImportError:
        raise OpenClipError(
            "reading open_clip models needs the open_clip package: pip install open_clip_torch."
        ) from None
    return open_clip


def _state_dict(path: Path) -> dict:
    """The tensors of a .safetensors file or of a torch file (a state dict, or a checkpoint holding ``state_dict``)."""
    try:
        if path.suffix == ".safetensors":
            from safetensors.torch import load_file

            sd = load_file(str(path))
        else:
            sd = torch.load(str(path), map_location="cpu", weights_only=True)
    except Exception as e:  # any unreadable file (safetensors, pickle, zip, EOF errors) is one sentence
        raise OpenClipError(
            f"cannot read weights file '{path}' ({' '.join(str(e).split())[:120]}): pass a .safetensors file or a "
            "torch state dict (.bin, .pt)."
        ) from None
    if isinstance(sd, dict) and isinstance(sd.get("state_dict"), dict):
        sd = sd["state_dict"]
    if not isinstance(sd, dict) or not all(isinstance(v, torch.Tensor) for v in sd.values()):
        raise OpenClipError(f"weights file '{path}' holds no state dict of tensors.")
    if sd and all(k.startswith("module.") for k in sd):  # saved from DistributedDataParallel
        sd = {k[len("module.") :]: v for k, v in sd.items()}
    if any(k.startswith("visual.") for k in sd):  # the whole CLIP model: keep the image tower
        sd = {k[len("visual.") :]: v for k, v in sd.items() if k.startswith("visual.")}
    return sd


def _fit(visual: nn.Module, sd: dict, arch: str, path: Path) -> None:
    own = visual.state_dict()
    missing = [k for k in own if k not in sd]
    extra = [k for k in sd if k not in own]
    shapes = [k for k in own if k in sd and tuple(sd[k].shape) != tuple(own[k].shape)]
    if missing or extra or shapes:
        what = (
            f"{len(missing)} tensors missing (e.g. {missing[0]})"
            if missing
            else f"{len(extra)} unexpected tensors (e.g. {extra[0]})"
            if extra
            else f"{shapes[0]} of shape {tuple(sd[shapes[0]].shape)}, not {tuple(own[shapes[0]].shape)}"
        )
        raise OpenClipError(
            f"the weights in '{path}' do not fit open_clip's {arch} image tower ({what}): pass the weights of a "
            f"{arch} CLIP model or of its visual tower."
        )
    visual.load_state_dict(sd, strict=True)


def load(arch: str, weights: str | Path | None = None) -> nn.Module:
    """open_clip's ``arch`` image tower (``open_clip.create_model(arch, pretrained=None).visual``), with the weights of
    ``weights`` (a .safetensors file or a torch state dict of the whole CLIP model or of its visual tower; None: random
    initialisation), in eval mode. A tower that wraps a timm model (``visual.trunk``: SigLIP's, ...) gives that timm
    model, weights loaded (read by the timm families, with timm's preprocessing of it; the tower's projection head is
    left out). OpenClipError (a ValueError, one sentence) for an unknown architecture, a tower vitlab does not read
    (open_clip's ModifiedResNet), or weights that do not fit."""
    from train.coerce import did_you_mean

    open_clip = _open_clip()
    known = open_clip.list_models()
    if arch not in known:
        raise OpenClipError(
            f"open_clip has no model '{arch}'{did_you_mean(arch, known)}: open_clip.list_models() lists them."
        )
    visual = open_clip.create_model(arch, pretrained=None).visual
    trunk = getattr(visual, "trunk", None)  # a tower that wraps a timm model (SigLIP, ...): vitlab reads that model
    net = trunk if isinstance(trunk, nn.Module) else visual
    # open_clip's own ModifiedResNet is refused, though timm's ResNet family would hook its blocks: its preprocessing
    # (CLIP's mean and std) and attention pool are open_clip's, which no adapter reads yet
    if not (_readable(net) if net is trunk else OpenClipViT().matches(visual)):
        raise OpenClipError(
            f"open_clip's {arch} image tower is a {type(net).__name__}, which vitlab does not read: it reads "
            "open_clip's ViT towers (ViT-B-32, ViT-L-14, ...) and the timm models that some towers wrap."
        )
    if weights is not None:
        path = Path(weights).expanduser()
        if not path.is_file():
            raise OpenClipError(f"weights file '{weights}' does not exist.")
        _fit(visual, _state_dict(path), arch, path)
    return net.eval()


def _readable(net: nn.Module) -> bool:
    from analysis.families import family_of

    try:
        family_of(net)
    except TapError:
        return False
    return True
