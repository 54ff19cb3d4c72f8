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
255, float unchanged). Bad input raises ``ValueError`` with one sentence.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from analysis import offline as O
from analysis import storage
from analysis.measure import MeasureError
from analysis.suite import run_suite, suite_options
from analysis.taps import TapError, arch_of
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
        raise ValueError(f"{bad} of the {len(x)} images hold NaN or infinite values, which make every number NaN: pass finite images.")
    if len(y) != len(x):
        raise ValueError(f"{len(x)} images but {len(y)} labels.")
    return TensorBatches(x, y.long())


def _check_fits(model, data) -> None:
    """ValueError (one sentence) unless ``model`` is a model the taps understand and takes the images: one image
    through it, in evaluation mode (a wrong channel count or image size fails there, in torch's or timm's words)."""
    try:
        arch_of(model)
    except TapError as e:
        raise ValueError(f"{e} Pass a timm model (timm.create_model) or a run folder.") from None
    x = data.analysis.images[:1]
    if len(x) == 0:
        raise ValueError("no images to analyse: pass a tensor [N, C, H, W] with N >= 1 or a DataLoader that yields some.")
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            model(data.normalize(x.to(next(model.parameters()).device)))
    except (RuntimeError, AssertionError, ValueError) as e:
        raise ValueError(f"the model cannot take images of shape {tuple(x.shape[1:])} [C, H, W] ({' '.join(str(e).split())[:160]}): "
                         "pass images with the channel count and size it was built for.") from None
    finally:
        model.train(was_training)


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
            raise ValueError("give images to analyse a model object (a tensor [N, C, H, W] or a DataLoader).")
        x = _images(images, labels)
        px = _images(probe_images, probe_labels) if probe_images is not None else TensorBatches(x.images[:0], x.labels[:0])
        known = torch.cat([x.labels, px.labels])
        k = num_classes or (int(known.max()) + 1 if len(known) and int(known.max()) >= 0 else getattr(model, "num_classes", 1))
        data = Data(x, px, int(k), normalize)
    _check_fits(model, data)
    res = run_suite(model, data, opts)
    if len(res) == 1:  # only "meta": no measure asked for applies to this model (e.g. cls_attention without a class token)
        raise ValueError(f"{' and '.join(opts.measures)} {'does' if len(opts.measures) == 1 else 'do'} not apply to this "
                         f"{res['meta']['arch']}: see python -m analysis --list for what each measure needs.")
    out = {"results": {k: v for k, v in res.items() if k != "meta"}, "meta": res["meta"], "summary": storage.summary_of(res)}
    if figures:
        out["figures"] = storage.make_figures(res, part=part)
    return out
