"""Hugging Face ``transformers`` vision transformers: ViT (``ViTModel``, ``ViTForImageClassification``), DeiT
(distilled: class and distillation tokens), Dinov2 (LayerScale; ``Dinov2WithRegistersModel``: class token and
registers), and the vision towers of CLIP (``CLIPVisionModel``: ``pre_layrnorm`` before the blocks) and SigLIP
(``SiglipVisionModel``: no class token), in the module layouts of transformers 4.x and 5.x.

``import transformers`` happens in this file only, and only in :func:`load`: a model is recognised by the module its
class comes from (``transformers.``), its ``config.model_type`` (:data:`MODEL_TYPES`: those checked against timm; a
look-alike such as BEiT, with ViT's module names but a relative position bias, is not read) and what its modules
are, never by a version number. The model is found as its "core": the outermost module with ``embeddings`` that hold
a patch convolution (``patch_embeddings.projection`` or ``patch_embedding``) and an encoder layer list (``layers``,
``encoder.layer`` or ``encoder.layers``). Block i is layer i of that list, named ``blocks.{i}`` whatever
transformers calls it (``layers.{i}``, ``encoder.layer.{i}``, ``vision_model.encoder.layers.{i}``,
``vit.layers.{i}``). A layer is read through the first of :data:`LAYOUTS` whose modules it has; its taps sit on::

    in           the layer's input (pre-hook: its first positional argument, else ``hidden_states=``)
    norm1        output of the first LayerNorm (layernorm_before / norm1 / layer_norm1)
    attn_branch  what the attention sublayer adds to the stream, after any LayerScale:
                   ViT, DeiT 5.x   1st call of the layer's ``dropout`` (one module serves both sublayers)
                   ViT, DeiT 4.x   output of attention.output.dropout (ViTSelfOutput: dense, dropout)
                   Dinov2          1st call of ``drop_path`` (after layer_scale1; one module serves both sublayers)
                   CLIP, SigLIP    output of self_attn (first element of its tuple)
    attn_out     input of the second LayerNorm (layernorm_after / norm2 / layer_norm2): z + attn_branch
    norm2        output of the second LayerNorm
    mlp_hidden   input of the MLP's output projection (fc2; output.dense in 4.x ViT; SwiGLU's down_proj /
                 weights_out): the hidden activations after the nonlinearity (timm's ``mlp.act`` output; a dropout
                 between them is the identity in eval mode)
    mlp_branch   what the MLP sublayer adds, after any LayerScale: 2nd call of ``dropout`` (ViT 5.x) or of
                 ``drop_path`` (Dinov2); output of ``output.dropout`` in 4.x ViT, whose ViTOutput adds the residual
                 inside the module (so its output is the stream, not the branch); output of ``mlp`` (CLIP, SigLIP)
    out          output of the layer (first element when a 4.x layer returns a tuple)
    attn_probs   softmax(q k^T * scale) recomputed from the outputs of the query and key projections, [B, H, T, T]
    heads        input of the attention's output projection (o_proj / out_proj / attention.output.dense):
                 [B, T, H * dh], head h in channels h*dh:(h+1)*dh, after any head mask
    proj_in      the same tensor (no norm sits between the heads and the projection in these models)

``attn_probs`` is RECOMPUTED, not read from the attention: the default attention implementation is SDPA (or flash
attention), which returns no weights, and switching to eager inside the tap would go through
``config._attn_implementation`` / ``set_attn_implementation``, whose name, place and effect changed between versions
(some 4.x releases pick the attention class, ``VIT_ATTENTION_CLASSES[...]``, when the model is built, so a later switch
does nothing; one config is shared by every layer; 5.x layers drop the weights the attention returns). The query and key
projections' outputs exist in every version and attention implementation, so the probabilities are the eager formula on
them (``matmul(q, k^T) * scale``, softmax in float32, cast back), equal to ``output_attentions=True`` under eager
attention (to 1e-6, tests/analysis/families/test_family_huggingface.py), while the model's own forward runs with its own
kernel untouched. Vision models have no attention mask or relative position bias; a model that adds one would need it
here. The cost: one extra [T, T] product per probed layer.

``needs_internals``: ``ablation`` (it rewrites timm's Block / Attention forward). Every other measure reads taps only.

The token grid is the input size over the patch size; the input size is the processor's crop (or resize) when the
model came from a folder with a ``preprocessor_config.json`` (``model.name_or_path``), else ``config.image_size``.
Dinov2 interpolates its position embedding to any input, so a hub Dinov2 (config 518, processor 224) analyses at 224.
:func:`load` takes a hub name or a ``save_pretrained`` folder (a CLIP / SigLIP full model gives its vision tower).
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn as nn

from analysis.families.base import Family, TapError, first_tensor


@dataclass(frozen=True)
class Layout:
    """Where the taps of one kind of encoder layer sit: dotted paths from the layer (``a|b``: the first that exists);
    ``attn_end`` / ``mlp_end``: (module, call) whose output of that call within one layer forward is the branch."""

    name: str
    norm1: str
    norm2: str
    q: str
    k: str
    proj: str
    fc2: str
    attn_end: tuple[str, int]
    mlp_end: tuple[str, int]


LAYOUTS = (
    Layout(  # ViT, DeiT in transformers 5.x
        "ViT",
        "layernorm_before",
        "layernorm_after",
        "attention.q_proj",
        "attention.k_proj",
        "attention.o_proj",
        "mlp.fc2",
        ("dropout", 0),
        ("dropout", 1),
    ),
    Layout(  # ViT, DeiT in transformers 4.x: ViTSelfAttention / ViTSelfOutput, ViTIntermediate / ViTOutput
        "ViT (4.x)",
        "layernorm_before",
        "layernorm_after",
        "attention.attention.query",
        "attention.attention.key",
        "attention.output.dense",
        "output.dense",
        ("attention.output.dropout", 0),
        ("output.dropout", 0),
    ),
    Layout(  # Dinov2 (with registers too) in transformers 5.x
        "Dinov2",
        "norm1",
        "norm2",
        "attention.q_proj",
        "attention.k_proj",
        "attention.o_proj",
        "mlp.fc2|mlp.down_proj|mlp.weights_out",
        ("drop_path", 0),
        ("drop_path", 1),
    ),
    Layout(  # Dinov2 in transformers 4.x
        "Dinov2 (4.x)",
        "norm1",
        "norm2",
        "attention.attention.query",
        "attention.attention.key",
        "attention.output.dense",
        "mlp.fc2|mlp.down_proj|mlp.weights_out",
        ("drop_path", 0),
        ("drop_path", 1),
    ),
    Layout(  # CLIP and SigLIP encoder layers (both versions)
        "CLIP/SigLIP",
        "layer_norm1",
        "layer_norm2",
        "self_attn.q_proj",
        "self_attn.k_proj",
        "self_attn.out_proj",
        "mlp.fc2",
        ("self_attn", 0),
        ("mlp", 0),
    ),
)

# the image processors' defaults by config.model_type (mean, std, interpolation, crop_pct, crop_mode), used when the
# model's folder has no preprocessor_config.json
_IMAGENET = ((0.485, 0.456, 0.406), (0.229, 0.224, 0.225))
_HALF = ((0.5, 0.5, 0.5), (0.5, 0.5, 0.5))
_CLIP = ((0.48145466, 0.4578275, 0.40821073), (0.26862954, 0.26130258, 0.27577711))
PROCESSOR_DEFAULTS = {
    "vit": (*_HALF, "bilinear", 1.0, "squash"),  # ViTImageProcessor: resize to 224 x 224
    "deit": (*_IMAGENET, "bicubic", 0.875, "center"),  # DeiTImageProcessor: 256, centre crop 224
    "dinov2": (*_IMAGENET, "bicubic", 0.875, "center"),  # BitImageProcessor: shortest edge 256, crop 224
    "dinov2_with_registers": (*_IMAGENET, "bicubic", 0.875, "center"),
    "clip_vision_model": (*_CLIP, "bicubic", 1.0, "center"),  # CLIPImageProcessor: shortest edge 224, crop 224
    "siglip_vision_model": (*_HALF, "bilinear", 1.0, "squash"),  # SiglipImageProcessor: resize to 224 x 224
}
MODEL_TYPES = frozenset(PROCESSOR_DEFAULTS)  # config.model_type of the models this family reads
_PIL = {0: "nearest", 1: "lanczos", 2: "bilinear", 3: "bicubic", 4: "box", 5: "hamming"}


def _get(root: nn.Module, paths: str) -> nn.Module | None:
    """The module at the first dotted path of ``a|b`` under ``root`` that exists, else None."""
    for path in paths.split("|"):
        mod = root
        for part in path.split("."):
            mod = getattr(mod, part, None)
            if not isinstance(mod, nn.Module):
                break
        else:
            return mod
    return None


def layout_of(layer: nn.Module) -> Layout | None:
    """The first layout all of whose modules ``layer`` has."""
    for lay in LAYOUTS:
        paths = (lay.norm1, lay.norm2, lay.q, lay.k, lay.proj, lay.fc2, lay.attn_end[0], lay.mlp_end[0])
        if all(_get(layer, p) is not None for p in paths):
            return lay
    return None


def _layers(core: nn.Module) -> nn.ModuleList | None:
    for path in ("layers", "encoder.layer", "encoder.layers"):
        mods = _get(core, path)
        if isinstance(mods, nn.ModuleList) and len(mods) and all(layout_of(m) is not None for m in mods):
            return mods
    return None


def _patch_conv(core: nn.Module) -> nn.Module | None:
    emb = getattr(core, "embeddings", None)
    conv = _get(emb, "patch_embeddings.projection|patch_embedding") if isinstance(emb, nn.Module) else None
    return conv if isinstance(conv, nn.Conv2d) else None


def core_of(model: nn.Module) -> tuple[nn.Module, nn.ModuleList] | None:
    """(the vision transformer inside ``model``, its encoder layers): the outermost module with patch embeddings and
    an encoder whose layers all have a known layout; None if there is none."""
    for mod in model.modules():
        if _patch_conv(mod) is not None:
            layers = _layers(mod)
            if layers is not None:
                return mod, layers
    return None


def _core(model: nn.Module) -> tuple[nn.Module, nn.ModuleList]:
    found = core_of(model)
    if found is None:
        raise TapError(
            f"{type(model).__name__} has no encoder layers of a layout vitlab reads (ViT, DeiT, Dinov2, CLIP, SigLIP)."
        )
    return found


def _config(model: nn.Module):
    cfg = getattr(model, "config", None)
    return getattr(cfg, "vision_config", None) or cfg


def _pair(v) -> tuple[int, int]:
    return (int(v[0]), int(v[1])) if isinstance(v, (tuple, list)) else (int(v), int(v))


@functools.lru_cache(maxsize=64)
def _processor_file(folder: str) -> dict:
    p = Path(folder) / "preprocessor_config.json"
    try:
        return json.loads(p.read_text()) if p.is_file() else {}
    except (OSError, ValueError):
        return {}


def processor_config(model: nn.Module) -> dict:
    """The ``preprocessor_config.json`` of the folder the model was loaded from (``model.name_or_path``), or {}."""
    folder = str(getattr(model, "name_or_path", "") or getattr(getattr(model, "config", None), "_name_or_path", ""))
    return _processor_file(folder) if folder and Path(folder).is_dir() else {}


def _side(v) -> int | None:
    """One side of a processor ``size`` / ``crop_size`` entry (an int or {height, width} / {shortest_edge})."""
    if isinstance(v, dict):
        v = v.get("height", v.get("shortest_edge"))
    return int(v) if isinstance(v, (int, float)) else None


class HuggingFaceViT(Family):
    """transformers ViT, DeiT, Dinov2 (with registers), CLIP and SigLIP vision models (module docstring)."""

    name = "transformers ViT"
    exact = True  # known by its class's library
    arch = "vit"
    needs_internals = frozenset({"ablation"})

    def matches(self, model: nn.Module) -> bool:
        # no import of transformers: its classes live in modules named transformers.*; only the model types whose
        # layers were checked against timm (a look-alike such as BEiT would give wrong taps); a CLIP / SigLIP full
        # model (text tower too) does not take images alone: load() gives its vision tower
        return (
            type(model).__module__.startswith("transformers.")
            and getattr(_config(model), "model_type", None) in MODEL_TYPES
            and not hasattr(model, "text_model")
            and core_of(model) is not None
        )

    def blocks(self, model):
        return [f"blocks.{i}" for i in range(len(_core(model)[1]))]

    def block(self, model, name):
        layers = _core(model)[1]
        head, _, idx = name.partition(".")
        if head != "blocks" or not idx.isdigit() or int(idx) >= len(layers):
            raise TapError(
                f"{type(model).__name__} has no block '{name}': its blocks are blocks.0 ... blocks.{len(layers) - 1}."
            )
        return layers[int(idx)]

    def hook(self, model, block, kinds, taps):
        layer = self.block(model, block)
        lay = layout_of(layer)
        p = f"{block}."
        for kind in kinds:
            name = p + kind
            if kind == "in":
                _input(taps, layer, name)
            elif kind == "out":
                taps.output(layer, name)
            elif kind in ("norm1", "norm2"):
                taps.output(_get(layer, getattr(lay, kind)), name)
            elif kind == "attn_out":
                _input(taps, _get(layer, lay.norm2), name)
            elif kind == "mlp_hidden":
                _input(taps, _get(layer, lay.fc2), name)
            elif kind in ("heads", "proj_in"):
                _input(taps, _get(layer, lay.proj), name)
            elif kind in ("attn_branch", "mlp_branch"):
                path, call = lay.attn_end if kind == "attn_branch" else lay.mlp_end
                _nth_output(taps, layer, _get(layer, path), call, name)
            elif kind == "attn_probs":
                _probs(taps, _get(layer, lay.q.rsplit(".", 1)[0]), _get(layer, lay.q), _get(layer, lay.k), name)

    # -- tokens
    def _embeddings(self, model):
        return _core(model)[0].embeddings

    def prefix(self, model):
        emb = self._embeddings(model)
        n = int(self.has_class_token(model)) + int(isinstance(getattr(emb, "distillation_token", None), nn.Parameter))
        return n + self.registers(model)

    def registers(self, model):
        reg = getattr(self._embeddings(model), "register_tokens", None)
        return int(reg.shape[1]) if isinstance(reg, nn.Parameter) else 0

    def has_class_token(self, model):
        emb = self._embeddings(model)
        return any(isinstance(getattr(emb, a, None), nn.Parameter) for a in ("cls_token", "class_embedding"))

    def patch_size(self, model):
        return int(_patch_conv(_core(model)[0]).kernel_size[0])

    def image_size(self, model):
        proc = processor_config(model)
        if proc:
            side = _side(proc.get("crop_size")) if proc.get("do_center_crop", False) else None
            side = side or _side(proc.get("size"))
            if side:
                return side
        return _pair(getattr(_config(model), "image_size", 224))[0]

    def grid(self, model):
        p = self.patch_size(model)
        if processor_config(model):  # the processor's square input
            size = self.image_size(model)
            return (size // p, size // p)
        h, w = _pair(getattr(_config(model), "image_size", 224))  # a ViT config may give (height, width)
        return (h // p, w // p)

    def preprocessing(self, model):
        cfg = _config(model)
        mean, std, interp, crop_pct, mode = PROCESSOR_DEFAULTS.get(
            getattr(cfg, "model_type", ""), (*_IMAGENET, "bicubic", 0.875, "center")
        )
        size = self.image_size(model)
        proc = processor_config(model)
        if proc:
            mean = tuple(float(v) for v in proc.get("image_mean", mean))
            std = tuple(float(v) for v in proc.get("image_std", std))
            interp = _PIL.get(proc.get("resample"), interp)
            resize = proc.get("size")
            if proc.get("do_center_crop", False):
                short = _side(resize)
                crop_pct, mode = (size / short if short else 1.0), "center"
            elif isinstance(resize, dict) and "height" in resize:
                crop_pct, mode = 1.0, "squash"
        return {
            "input_size": (3, size, size),
            "interpolation": interp,
            "mean": tuple(mean),
            "std": tuple(std),
            "crop_pct": float(crop_pct),
            "crop_mode": mode,
        }


def _first_input(args, kwargs):
    if args:
        return args[0]
    if isinstance(kwargs.get("hidden_states"), torch.Tensor):
        return kwargs["hidden_states"]
    return next(v for v in kwargs.values() if isinstance(v, torch.Tensor))


def _input(taps, module: nn.Module, name: str) -> None:
    """Capture ``module``'s input: its first positional argument, else ``hidden_states=``, else the first tensor."""

    def hook(mod, args, kwargs):
        taps.store(name, _first_input(args, kwargs))

    taps.handle(module.register_forward_pre_hook(hook, with_kwargs=True))


def _nth_output(taps, layer: nn.Module, module: nn.Module, call: int, name: str) -> None:
    """Capture the output of call ``call`` (0, 1, ...) of ``module`` within each forward of ``layer`` (one dropout or
    drop-path module may serve both sublayers of a layer)."""
    calls = [0]

    def reset(mod, args):
        calls[0] = 0

    def on_output(mod, args, out):
        if calls[0] == call:
            t = first_tensor(out)
            taps.store(name, t)
            if taps.graph:  # as Taps.output: pass on a clone so later in-place ops leave the capture intact
                t = t.clone()
                calls[0] += 1
                return (t, *out[1:]) if isinstance(out, tuple) else t
        calls[0] += 1
        return None

    taps.handle(layer.register_forward_pre_hook(reset))
    taps.handle(module.register_forward_hook(on_output))


def _heads(attn: nn.Module, q: nn.Module) -> tuple[int, float]:
    """(head width, scale) of an attention module, whatever its version calls them."""
    heads = getattr(attn, "num_attention_heads", None) or getattr(attn, "num_heads", None)
    dh = getattr(attn, "head_dim", None) or getattr(attn, "attention_head_size", None)
    if not dh:
        dh = q.out_features // int(heads)
    scale = getattr(attn, "scaling", None) or getattr(attn, "scale", None) or int(dh) ** -0.5
    return int(dh), float(scale)


def _probs(taps, attn: nn.Module, q: nn.Module, k: nn.Module, name: str) -> None:
    """Attention probabilities from the query and key projections' outputs (module docstring), in whichever order the
    layer calls them (4.x ViT computes the key first); ``attn`` holds the head count and scale."""
    dh, scale = _heads(attn, q)
    seen: dict = {}

    def grab(which):
        def hook(mod, args, out):
            seen[which] = out
            if len(seen) == 2:
                qs, ks = seen.pop("q"), seen.pop("k")
                b, t = qs.shape[:2]
                qs = qs.view(b, t, -1, dh).transpose(1, 2)
                ks = ks.view(b, ks.shape[1], -1, dh).transpose(1, 2)
                w = torch.matmul(qs, ks.transpose(2, 3)) * scale
                taps.store(name, nn.functional.softmax(w, dim=-1, dtype=torch.float32).to(qs.dtype))

        return hook

    taps.handle(q.register_forward_hook(grab("q")))
    taps.handle(k.register_forward_hook(grab("k")))


# ------------------------------------------------------------------------------------------------------- the loader

INSTALL = "reading Hugging Face models needs the transformers package: run 'pip install transformers'."


def _transformers():
    try:
        import transformers
    except ImportError:
        raise ValueError(INSTALL) from None
    return transformers


def load(spec: str | Path) -> nn.Module:
    """A transformers vision model in eval mode from ``spec``: a ``save_pretrained`` folder or a hub name (which needs
    the network or the hub cache); a CLIP / SigLIP full model gives its vision tower. ValueError (one sentence) for
    a name that cannot be fetched, a folder that holds no such model, or no transformers installed."""
    tf = _transformers()
    path = Path(spec).expanduser()
    local = path.is_dir()
    if path.exists() and not local:
        raise ValueError(f"'{spec}' is a file: pass the folder save_pretrained wrote, or a Hugging Face hub name.")
    source = str(path) if local else str(spec)
    level = tf.logging.get_verbosity()
    tf.logging.set_verbosity_error()  # a vision tower read from a full CLIP lists every text weight it leaves out
    try:
        config = tf.AutoConfig.from_pretrained(source)
        cls = tf.AutoModel
        if getattr(config, "vision_config", None) is not None:  # CLIPConfig -> CLIPVisionModel, SiglipConfig -> ...
            cls = getattr(tf, type(config).__name__.replace("Config", "VisionModel"), None)
        model = cls.from_pretrained(source) if cls is not None else None
    except Exception as e:  # the hub's errors (OSError, connection and HTTP errors) differ between versions
        if local:
            first = " ".join(str(e).split())[:160]
            raise ValueError(f"'{spec}' is not a folder save_pretrained wrote ({first}).") from None
        raise ValueError(
            f"the Hugging Face model '{spec}' cannot be fetched from here (no network, or no such model): save it "
            "with save_pretrained(FOLDER) where there is a network and pass that folder."
        ) from None
    finally:
        tf.logging.set_verbosity(level)
    if model is None:
        raise ValueError(f"'{spec}' holds a {config.model_type} model, whose vision tower vitlab cannot pick.")
    if not HuggingFaceViT().matches(model):
        raise ValueError(
            f"'{spec}' is a {type(model).__name__}, not a vision transformer vitlab reads (ViT, DeiT, Dinov2, CLIP or "
            "SigLIP vision models)."
        )
    return model.eval()
