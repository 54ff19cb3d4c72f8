"""Analyses from Python (a notebook): any supported model on any images, with any measures and options -- the same
suite the training-time callback and ``python -m analysis`` run. Notebooks and user code reach it as ``import vitlab``
(``vitlab.analyze``, ``vitlab.activations``: vitlab/__init__.py), a name a file of theirs cannot shadow.

    import timm, torch
    import vitlab

    model = timm.create_model("vit_tiny_patch16_224", img_size=32, patch_size=4, num_classes=10)
    res = vitlab.analyze(model, torch.rand(64, 3, 32, 32), measures=["cka", "attention_distance"],
                         options={"cka": {"repr": "cls"}})
    res["summary"]["attention_distance"]["mean_px"]      # key numbers per measure
    res["results"]["cka"]["matrix"]                       # the arrays
    res["figures"]["cka/self"].savefig("cka.png")         # matplotlib figures

``model`` is a model of any family vitlab reads (analysis/families/: a timm VisionTransformer, ResNet or MLP-Mixer, a
transformers ViT, DeiT, Dinov2, CLIP or SigLIP vision model, an open_clip visual tower), or a run folder
(``"runs/default"``, or ``"runs/default:600"`` for a checkpoint), whose own analysis and probe-train images are used
unless ``images`` are given; ``part`` picks the network of a self-supervised checkpoint (``"student"``, the default, or
e.g. ``"teacher"`` for DINO's EMA teacher: train/objectives). ``images`` is a tensor [N, C, H, W] (uint8 or float) or an
iterable of ``(images, labels)`` batches (a DataLoader); measures that read labels (probes, k-NN, clustering) need
``labels`` and, for probes and k-NN, ``probe_images`` / ``probe_labels`` to train on. ``normalize`` maps a batch to
model inputs (default: uint8 / 255, float unchanged). ``images`` may also be a folder of image files (one subfolder per
class gives labels) or ``"photos"`` (the bundled photo set, labelled by photo: analysis/sources/images.py); these are
resized, cropped and normalised by the model's own preprocessing (its family's), and ``probe_images`` may then be a
folder too.
Bad input raises ``ValueError`` with one sentence, in this API's words (``probe_images=``, ``options=``: the
vocabulary of analysis/engine/fixes.py), with the closest name for a mistyped measure, option or tap.

Raw activations, for an analysis of one's own without writing hooks (:func:`activations`, :func:`iter_activations`): the
taps' tensors (analysis/engine/taps.py: named by block and role, ``blocks.3.attn_probs``, ``blocks.3.out``,
``layer2.0.branch``; glob patterns such as ``blocks.*.attn_probs``) of a model on images, in float32 and eval mode,
streamed minibatch by minibatch to the CPU, into one tensor per tap or onto disk::

    acts = vitlab.activations(model, images, taps=["blocks.*.attn_probs", "blocks.5.out"], batch_size=128)
    acts["blocks.3.attn_probs"]                  # Tensor [N, heads, T, T]; acts["labels"]: [N] (-1 where unknown)
    acts = vitlab.activations("runs/default", taps="blocks.*.out", out="acts/")  # sharded .npy files, resumable
    for start, batch in acts.iter(batch_size=512): ...  # read back a minibatch at a time (memory maps)
"""

from __future__ import annotations

import fnmatch
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from analysis.engine.suite import float32_forward, problem, run_suite, suite_options
from analysis.engine.taps import TapError, Taps, arch_of, available_taps, block_kinds, block_names
from analysis.families.base import UnknownFamily
from analysis.results import activation_store as AS
from analysis.results import publish, storage
from analysis.results import runs as RF
from analysis.sources import models as MS
from train.coerce import did_you_mean
from train.splits import TensorBatches


@dataclass
class Data:
    """The data a suite needs (what train's data bundle provides for a run)."""

    analysis: TensorBatches
    probe_train: TensorBatches
    num_classes: int
    normalize_fn: object = None

    def normalize(self, x: torch.Tensor) -> torch.Tensor:
        if self.normalize_fn is not None:
            return self.normalize_fn(x)
        return x.float() / 255.0 if x.dtype == torch.uint8 else x.float()


def _images(images, labels) -> TensorBatches:
    """An in-memory split (labels -1 where unknown) from a tensor or an iterable of (images, labels) batches."""
    if isinstance(images, torch.Tensor):
        x = images
        y = torch.as_tensor(labels) if labels is not None else torch.full((len(x),), -1, dtype=torch.long)
    else:
        xs, ys = [], []
        for batch in images:
            if not (isinstance(batch, (list, tuple)) and len(batch) >= 2):
                raise ValueError("a DataLoader given as images must yield (images, labels) batches.")
            xs.append(torch.as_tensor(batch[0]))
            ys.append(torch.as_tensor(batch[1]))
        if not xs:
            raise ValueError("the images iterable yielded no batch.")
        x, y = torch.cat(xs), torch.cat(ys)
    if x.ndim != 4:
        raise ValueError(f"images must be [N, C, H, W], not of shape {tuple(x.shape)}.")
    if x.is_floating_point() and not torch.isfinite(x).all():
        bad = int((~torch.isfinite(x)).flatten(1).any(1).sum())
        raise ValueError(
            f"{bad} of the {len(x)} images hold NaN or infinite values, which make every number NaN: pass finite "
            "images."
        )
    if len(y) != len(x):
        raise ValueError(f"{len(x)} images but {len(y)} labels.")
    return TensorBatches(x, y.long())


def _check_fits(model, data) -> None:
    """ValueError (one sentence) unless ``model`` is of a known family (analysis/families/) and takes the images: one
    image through it, in evaluation mode (a wrong channel count or image size fails there, in torch's or timm's
    words)."""
    try:
        arch_of(model)
    except TapError as e:
        hint = " Pass one of those, or a run folder." if isinstance(e, UnknownFamily) else ""  # else: its own fix
        raise ValueError(f"{e}{hint}") from None
    x = data.analysis.images[:1]
    if len(x) == 0:
        raise ValueError(
            "no images to analyse: pass a tensor [N, C, H, W] with N >= 1 or a DataLoader that yields some."
        )
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            model(data.normalize(x.to(next(model.parameters()).device)))
    except (RuntimeError, AssertionError, ValueError) as e:
        raise ValueError(
            f"the model cannot take images of shape {tuple(x.shape[1:])} [C, H, W] ({' '.join(str(e).split())[:160]}): "
            "pass images with the channel count and size it was built for."
        ) from None
    finally:
        model.train(was_training)


def analyze(
    model: torch.nn.Module | str | Path,
    images: torch.Tensor | Iterable | str | Path | None = None,
    labels: torch.Tensor | Sequence[int] | None = None,
    *,
    measures: str | Sequence[str] | None = None,
    options: dict[str, dict[str, Any]] | None = None,
    probe_images: torch.Tensor | Iterable | str | Path | None = None,
    probe_labels: torch.Tensor | Sequence[int] | None = None,
    normalize: Callable[[torch.Tensor], torch.Tensor] | None = None,
    num_classes: int | None = None,
    batch_size: int = 256,
    figures: bool = True,
    part: str | None = None,
    max_memory: int | str | None = None,
) -> dict[str, Any]:
    """Run ``measures`` (default: CKA, norm ratios, attention distances, few-shot probes; ``"all"`` for every one)
    with ``options`` ({measure: {option: value}}) on ``images``. Returns ``{"results": {measure: arrays},
    "summary": {measure: key numbers}, "figures": {tag: matplotlib Figure}}`` (figures only if ``figures``).
    ``max_memory`` (bytes or ``"4GiB"``; default half the memory available): the taps of a minibatch that do not fit
    are forwarded in chunks (analysis.engine.suite.plan_chunks)."""
    opts = suite_options(measures, batch_size, options, max_memory)  # MeasureError, a ValueError: its own sentence
    model, data = _model_and_data(model, images, labels, probe_images, probe_labels, normalize, num_classes, part)
    _check_fits(model, data)
    p = problem(data, opts, "api_folder" if isinstance(images, (str, Path)) else "api")
    if p:  # what is missing, and the argument that gives it
        raise ValueError(p)
    res = run_suite(model, data, opts)
    if (
        len(res) == 1
    ):  # only "meta": no measure asked for applies to this model (e.g. cls_attention without a class token)
        raise ValueError(
            f"{' and '.join(opts.measures)} {'does' if len(opts.measures) == 1 else 'do'} not apply to this "
            f"{res['meta']['arch']}: choose others in measures= (vitlab.measures() lists them; docs/measures.md "
            "says what each one needs)."
        )
    out = {
        "results": {k: v for k, v in res.items() if k != "meta"},
        "meta": res["meta"],
        "summary": storage.summary_of(res),
    }
    if figures:
        out["figures"] = publish.make_figures(res, part=part)
    return out


def _model_and_data(
    model, images, labels, probe_images=None, probe_labels=None, normalize=None, num_classes=None, part=None
):
    """(network, Data) from :func:`analyze`'s arguments: a run folder's checkpoint and its own images unless ``images``
    are given, or a network object and ``images``."""
    if isinstance(model, (str, Path)):
        run, step = RF.parse_against(
            str(model)
        )  # "runs/x" (last checkpoint) or "runs/x:STEP"; AnalysisError is a ValueError
        RF.select_part(run, part)
        run_data = MS.load_data(run)
        model = MS.load_model(run, step, run_data)
        if images is None:
            return model, run_data
        return model, Data(
            _images(images, labels),
            _images(probe_images, probe_labels) if probe_images is not None else run_data.probe_train,
            num_classes or run_data.num_classes,
            normalize or run_data.normalize,
        )
    if part is not None:
        raise ValueError(
            f"part='{part}' picks a network of a run folder's checkpoint: pass the network object itself instead."
        )
    if images is None:
        raise ValueError(
            "give images to analyse a model object (a tensor [N, C, H, W], a DataLoader, a folder or 'photos')."
        )
    if isinstance(images, (str, Path)):
        return model, _image_set(model, images, labels, probe_images)
    x = _images(images, labels)
    px = _images(probe_images, probe_labels) if probe_images is not None else TensorBatches(x.images[:0], x.labels[:0])
    known = torch.cat([x.labels, px.labels])
    k = num_classes or (
        int(known.max()) + 1 if len(known) and int(known.max()) >= 0 else getattr(model, "num_classes", 1)
    )
    return model, Data(x, px, int(k), normalize)


def _image_set(model, images, labels, probe_images):
    from analysis.sources.images import ImageError, image_set

    if labels is not None:
        raise ValueError("labels= goes with a tensor of images; a folder's labels are its class subfolders.")
    if probe_images is not None and not isinstance(probe_images, (str, Path)):
        raise ValueError("with images from a folder, probe_images must be a folder too (the same class subfolders).")
    try:
        return image_set(images, model, probe_images)
    except ImageError as e:
        raise ValueError(str(e)) from None


# ---------------------------------------------------------------------------------------------------- raw activations


def tap_names(model, taps) -> list[str]:
    """The tap names ``taps`` (a name, a glob pattern such as ``blocks.*.attn_probs``, or a list of them) stand for on
    ``model``, in forward order; ValueError (one sentence) for one that matches nothing."""
    if isinstance(model, (str, Path)):
        raise ValueError("tap_names needs the network object; activations() accepts a run folder.")
    try:
        known = available_taps(model)
    except TapError as e:
        raise ValueError(str(e)) from None
    patterns = [taps] if isinstance(taps, str) else list(taps or [])
    if not patterns:
        raise ValueError("no taps named: give tap names or patterns, e.g. 'blocks.*.out' or ['blocks.3.attn_probs'].")
    out: list[str] = []
    for pat in patterns:
        hits = [n for n in known if fnmatch.fnmatchcase(n, str(pat))]
        if not hits:
            blk = block_names(model)[0]
            raise ValueError(
                f"tap '{pat}' matches no tap of this {type(model).__name__}{did_you_mean(str(pat), known)}: taps are "
                f"<block>.<kind>, blocks "
                f"{blk} ... {block_names(model)[-1]}, kinds {', '.join(block_kinds(model, blk))} (analysis/families/)."
            )
        out += [n for n in hits if n not in out]
    return sorted(out, key=known.index)


def iter_activations(
    model,
    images=None,
    labels=None,
    *,
    taps="*.out",
    batch_size: int = 256,
    normalize=None,
    part: str | None = None,
    dtype: torch.dtype | None = None,
) -> Iterator[tuple[int, dict[str, torch.Tensor]]]:
    """``(start, {tap: Tensor [b, ...]})`` for each minibatch of ``images`` in order (``start``: the index of its first
    image; key ``labels`` [b] too), the taps' tensors on the CPU (in ``dtype`` if given, e.g. torch.float16). The
    model runs in eval mode and float32 (its train flag restored afterwards); arguments as :func:`activations`, checked
    here, before the first minibatch."""
    net, data, names = _prepare(model, images, labels, taps, batch_size, normalize, part)
    return _stream(net, data, names, batch_size, dtype)


def _prepare(model, images, labels, taps, batch_size, normalize, part):
    if not isinstance(batch_size, int) or isinstance(batch_size, bool) or batch_size < 1:
        raise ValueError(f"batch_size must be a positive integer, not {batch_size!r}.")
    net, data = _model_and_data(model, images, labels, normalize=normalize, part=part)
    return net, data, tap_names(net, taps)


def _stream(
    net, data, names: list[str], batch_size: int, dtype, first: int = 0
) -> Iterator[tuple[int, dict[str, torch.Tensor]]]:
    """The minibatches from image ``first`` on (a multiple of ``batch_size``)."""
    split = data.analysis
    device = next(net.parameters()).device
    was_training = net.training
    net.eval()
    try:
        with float32_forward(net), torch.no_grad():
            for start in range(first, len(split), batch_size):
                x = data.normalize(split.images[start : start + batch_size].to(device))
                with Taps(net, names, to="cpu", dtype=dtype) as cap:
                    net(x)
                yield start, {**cap.captures, "labels": split.labels[start : start + batch_size].cpu()}
    finally:
        net.train(was_training)


def activations(
    model,
    images=None,
    labels=None,
    *,
    taps="*.out",
    batch_size: int = 256,
    normalize=None,
    part: str | None = None,
    dtype: torch.dtype | None = None,
    out: str | Path | None = None,
    shard_images: int | None = None,
):
    """The taps' tensors of ``model`` on ``images``: ``{tap: [N, ...], "labels": [N]}`` (labels -1 where unknown).

    ``model``: a model of any family (as in :func:`analyze`) or a run folder (``"runs/default"``,
    ``"runs/default:600"``; its own analysis images unless ``images`` are given; ``part`` as in :func:`analyze`).
    ``images``: a tensor [N, C, H, W] (uint8 or float) or an iterable of (images, labels) batches. ``taps``: tap names
    or glob patterns (:func:`tap_names`; default every block's output). The forward runs ``batch_size`` images at a time
    and each minibatch's tensors go straight to their place (``dtype``: e.g. torch.float16; float32 by default).

    With ``out=None``: a dict of CPU tensors. With ``out`` a folder: onto disk in shards (analysis/results/
    activation_store.py: ``shard_XXXXX/<tap>.npy`` and ``labels.npy``, ``shard_images`` images each, by default the most
    whole minibatches within 256 MiB), each written whole and then listed in ``index.json`` with the sha256 of the
    model's weights and of the images, so activations larger than memory work and an interrupted extraction (Ctrl-C, a
    kill) continues where it stopped when called again with the same arguments; a folder made by another model, other
    images, taps, dtype, batch_size or shard_images is refused (ValueError, one sentence) and left as it is, as is a
    non-empty folder without an index. bfloat16 is refused (numpy files cannot hold it). Returns
    :class:`~analysis.results.activation_store.Activations`, a lazy reader: ``acts[tap]`` (a memory map, or the shards
    concatenated in memory), ``acts.iter(batch_size=...)`` (streams shard by shard)."""
    if out is None:
        if shard_images is not None:
            raise ValueError("shard_images= sets the shards of a folder: give out= too, or leave it out.")
        bufs: dict = {}
        net, data, names = _prepare(model, images, labels, taps, batch_size, normalize, part)
        for start, part_ in _stream(net, data, names, batch_size, dtype):
            for k, t in part_.items():
                if k not in bufs:  # the first minibatch gives each tap's per-image shape and dtype
                    bufs[k] = torch.empty((len(data.analysis), *t.shape[1:]), dtype=t.dtype)
                bufs[k][start : start + len(t)] = t
        return bufs
    return _to_disk(model, images, labels, taps, batch_size, normalize, part, dtype, Path(out), shard_images)


def _to_disk(model, images, labels, taps, batch_size, normalize, part, dtype, dest: Path, shard_images):
    """:func:`activations` with ``out=``: check the folder, hash, then write the shards not yet done."""
    index = AS.read_index(dest) if dest.is_dir() else None
    if index is None and not AS.is_fresh(dest):
        raise ValueError(
            f"the activations folder {dest} already exists and is not empty (and holds no {AS.INDEX}): choose a new "
            "or empty folder."
        )
    if dtype == torch.bfloat16:
        raise ValueError("numpy files cannot hold bfloat16: give dtype=torch.float16 or torch.float32 with out=.")
    net, data, names = _prepare(model, images, labels, taps, batch_size, normalize, part)
    if shard_images is not None and (
        not isinstance(shard_images, int)
        or isinstance(shard_images, bool)
        or shard_images < 1
        or shard_images % batch_size
    ):
        raise ValueError(
            f"shard_images must be a positive multiple of batch_size ({batch_size}), not {shard_images!r}, so that "
            "a continued extraction runs the same minibatches."
        )
    split = data.analysis
    want = {
        "format": AS.FORMAT,
        "n_images": len(split),
        "batch_size": batch_size,
        "shard_images": shard_images,
        "dtype": str(dtype or torch.float32).removeprefix("torch."),
        "taps": {n: None for n in names},
        "taps_requested": [taps] if isinstance(taps, str) else list(taps),
        "model_hash": AS.model_hash(net),
        "images_hash": AS.images_hash(
            split.images,
            split.labels,
            data.normalize(split.images[:2]).float(),
            (getattr(data, "mean", None), getattr(data, "std", None)),
        ),
        "shards": [],
    }
    dest.mkdir(parents=True, exist_ok=True)
    with AS.writer_lock(dest):
        index = AS.read_index(dest)  # as it is now that this process holds the folder
        diffs = AS.differences(index, want) if index is not None else []
        if diffs:
            raise ValueError(
                f"the activations in {dest} were made {_and(diffs)}: pass the arguments they were made with to "
                "continue, or choose a new folder (or delete this one)."
            )
        AS.clear_leftovers(dest, index)
        first = index["shards"][-1]["stop"] if index and index["shards"] else 0
        shard = None
        try:
            for start, rows in _stream(net, data, names, batch_size, dtype, first=first):
                rows = {k: t.numpy() for k, t in rows.items()}
                if index is None:  # the first minibatch gives each tap's per-image shape and dtype
                    index = {**want, "taps": {k: _tap_entry(k, r) for k, r in rows.items() if k != "labels"}}
                    per_image = sum(r[0].nbytes for r in rows.values())
                    index["shard_images"] = shard_images or AS.default_shard_images(per_image, batch_size)
                    AS.write_index(dest, index)  # before any shard is in place: a folder with shards has an index
                if shard is None:
                    number, size = len(index["shards"]), index["shard_images"]
                    shard = AS.ShardWriter(dest, number, start, min(start + size, len(split)), index)
                shard.put(start, rows)
                if start + len(rows["labels"]) >= shard.stop:
                    index["shards"].append(shard.commit())
                    AS.write_index(dest, index)
                    shard = None
        finally:
            if shard is not None:
                shard.discard()
    return AS.Activations(dest)


def _tap_entry(name: str, rows: np.ndarray) -> dict:
    return {"file": f"{name.replace('/', '_')}.npy", "shape": list(rows.shape[1:]), "dtype": str(rows.dtype)}


def _and(parts: list[str]) -> str:
    return parts[0] if len(parts) == 1 else ", ".join(parts[:-1]) + " and " + parts[-1]
