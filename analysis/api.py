"""Analyses from Python (a notebook): any supported model on any images, with any measures and options -- the same
suite the training-time callback and ``python -m analysis`` run.

    import timm, torch
    from analysis.api import analyze

    model = timm.create_model("vit_tiny_patch16_224", img_size=32, patch_size=4, num_classes=10)
    res = analyze(model, torch.rand(64, 3, 32, 32), measures=["cka", "attention_distance"], options={"cka": {"repr": "cls"}})
    res["summary"]["attention_distance"]["mean_px"]      # key numbers per measure
    res["results"]["cka"]["matrix"]                       # the arrays
    res["figures"]["cka/self"].savefig("cka.png")         # matplotlib figures

``model`` is a timm VisionTransformer, ResNet or MLP-Mixer object, or a run folder (``"runs/default"``, or
``"runs/default:600"`` for a checkpoint), whose own analysis and probe-train images are used unless ``images`` are
given; ``part`` picks the network of a self-supervised checkpoint (``"student"``, the default, or e.g. ``"teacher"``
for DINO's EMA teacher: train/objectives). ``images`` is a tensor [N, C, H, W] (uint8 or float) or an iterable of ``(images, labels)`` batches (a
DataLoader); measures that read labels (probes, k-NN, clustering) need ``labels`` and, for probes and k-NN,
``probe_images`` / ``probe_labels`` to train on. ``normalize`` maps a batch to model inputs (default: uint8 /
255, float unchanged). ``images`` may also be a folder of image files (one subfolder per class gives labels) or
``"photos"`` (the bundled photo set, labelled by photo: analysis/images.py); these are resized, cropped and
normalised by the model's own timm preprocessing, and ``probe_images`` may then be a folder too.
Bad input raises ``ValueError`` with one sentence.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from analysis import offline as O
from analysis import storage
from analysis.measure import MeasureError
from analysis.suite import missing_labels, run_suite, suite_options
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
    if len(y) != len(x):
        raise ValueError(f"{len(x)} images but {len(y)} labels.")
    return TensorBatches(x, y.long())


def analyze(model, images=None, labels=None, *, measures=None, options: dict | None = None, probe_images=None, probe_labels=None,
            normalize=None, num_classes: int | None = None, batch_size: int = 256, figures: bool = True, part: str | None = None) -> dict:
    """Run ``measures`` (default: CKA, norm ratios, attention distances, few-shot probes; ``"all"`` for every one)
    with ``options`` ({measure: {option: value}}) on ``images``. Returns ``{"results": {measure: arrays},
    "summary": {measure: key numbers}, "figures": {tag: matplotlib Figure}}`` (figures only if ``figures``)."""
    try:
        opts = suite_options(measures, batch_size, options)
    except MeasureError as e:
        raise ValueError(str(e)) from None
    if isinstance(model, (str, Path)):
        run, step = O.parse_against(str(model))  # "runs/x" (last checkpoint) or "runs/x:STEP"; AnalysisError is a ValueError
        O.select_part(run, part)
        run_data = O.load_data(run)
        model = O.load_model(run, step, run_data)
        if images is None:
            data = run_data
        else:
            data = Data(_images(images, labels), _images(probe_images, probe_labels) if probe_images is not None else run_data.probe_train,
                        num_classes or run_data.num_classes, normalize or run_data.normalize)
    else:
        if part is not None:
            raise ValueError(f"part='{part}' picks a network of a run folder's checkpoint: pass the network object itself instead.")
        if images is None:
            raise ValueError("give images to analyse a model object (a tensor [N, C, H, W], a DataLoader, a folder or 'photos').")
        if isinstance(images, (str, Path)):
            data = _image_set(model, images, labels, probe_images)
            return _run(model, data, opts, figures, part)
        x = _images(images, labels)
        px = _images(probe_images, probe_labels) if probe_images is not None else TensorBatches(x.images[:0], x.labels[:0])
        known = torch.cat([x.labels, px.labels])
        k = num_classes or (int(known.max()) + 1 if len(known) and int(known.max()) >= 0 else getattr(model, "num_classes", 1))
        data = Data(x, px, int(k), normalize)
    return _run(model, data, opts, figures, part)


def _image_set(model, images, labels, probe_images):
    from analysis.images import ImageError, image_set

    if labels is not None:
        raise ValueError("labels= goes with a tensor of images; a folder's labels are its class subfolders.")
    if probe_images is not None and not isinstance(probe_images, (str, Path)):
        raise ValueError("with images from a folder, probe_images must be a folder too (the same class subfolders).")
    try:
        return image_set(images, model, probe_images)
    except ImageError as e:
        raise ValueError(str(e)) from None


def _run(model, data, opts, figures: bool, part) -> dict:
    missing = missing_labels(data, opts)
    if missing:
        raise ValueError(f"measures {', '.join(missing)} read class labels: pass labels= for the images and, for probes and k-NN, "
                         "probe_images= / probe_labels= to train on (a folder of images: one subfolder per class), or leave "
                         "those measures out.")
    res = run_suite(model, data, opts)
    out = {"results": {k: v for k, v in res.items() if k != "meta"}, "meta": res["meta"], "summary": storage.summary_of(res)}
    if figures:
        out["figures"] = storage.make_figures(res, part=part)
    return out
