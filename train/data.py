"""Data: a recipe's ``data`` section -> the split roles every part of vitlab uses (:func:`build_data`).

* ``val``         (``data.val_size`` > 0) a held-out validation split: ``val_size`` class-balanced images of the
                  train split chosen from the fixed seed :data:`VAL_SEED`, removed from it before anything else
                  uses it; the trainer evaluates it beside ``eval`` so checkpoints can be chosen without the test split;
* ``train``       the training split: what is left after ``val``, then ``data.train_size`` of it, then a
                  train-split intervention such as ``data_subset`` (a fraction of what ``train_size`` left), in
                  that order;
* ``eval``        the evaluation split (top-1 is measured here; probes are tested here);
* ``probe_train`` a seeded, class-balanced part of the train split less ``val``: few-shot probes draw their shots here;
* ``analysis``    a fixed, seeded, class-balanced part of the eval split, in a fixed order, that every
                  analysis (training-time or offline) uses.

The steps live in their own modules: :mod:`train.sources` (a source -> ``datasets.DatasetDict``),
:mod:`train.decode` (rows -> uint8 tensors, one path for in-memory and lazy splits), :mod:`train.splits`
(in-memory and lazy splits, batches, the sampler, seeded class-balanced subsets), :mod:`train.augment`
(crop / shift / flip). Images are held as uint8 tensors [N, C, H, W] at the recipe's size; augmentation and
normalisation run on whole batches on the training device (:func:`augment`, :meth:`DataBundle.normalize`).
A train split too big for memory (``data.in_memory``: auto / false) stays a memory-mapped ``datasets.Dataset``
(:class:`LazySplit`) decoded, and random-resized-cropped from (seed, epoch, index), in the DataLoader workers.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

import interventions
from train.augment import augment, batch_rrc, crop_rng, rrc_box
from train.decode import columns, decode_rows, image_channels, labels, to_tensors
from train.sources import FASHION_MNIST_DIR, DataError, check_splits, load_fashion_mnist, load_source
from train.splits import (
    EpochBatch,
    EpochBatchSampler,
    LazyBatches,
    LazySplit,
    Split,
    TensorBatches,
    balanced_indices,
    batch_collate,
    indices_hash,
    subset,
)

# what callers import from train.data (trainer, callbacks, analysis, bench, tests): the data layer's surface
__all__ = [
    "FASHION_MNIST_DIR",
    "MAX_IN_MEMORY_BYTES",
    "DataBundle",
    "DataError",
    "EpochBatch",
    "EpochBatchSampler",
    "LazyBatches",
    "LazySplit",
    "Split",
    "TensorBatches",
    "augment",
    "balanced_indices",
    "batch_collate",
    "batch_rrc",
    "build_data",
    "channel_stats",
    "crop_rng",
    "decode_rows",
    "indices_hash",
    "load_fashion_mnist",
    "load_source",
    "rrc_box",
    "to_tensors",
]

MAX_IN_MEMORY_BYTES = 16 * 2**30  # data.in_memory auto: a train split above this stays lazy; eval above it is an error
STATS_IMAGES = 10000  # mean / std come from the first this many train images less val (no crop, no augmentation)
# data.val_size's images come from this fixed seed, not the recipe's: every run of a study (every configuration and
# every recipe seed) then holds out the same images and trains on the same rest, so seed-to-seed differences are
# training noise rather than a different split, val top-1 is comparable across runs, and data_subset's nesting (it
# has its own seed) holds across recipe seeds. Arbitrary, and distinct from the recipe-seed offsets used below.
VAL_SEED = 7919


@dataclass
class DataBundle:
    train: Split | LazySplit  # LazySplit when data.in_memory resolves to false (see build_data)
    eval: Split
    probe_train: Split
    analysis: Split
    num_classes: int
    class_names: list
    mean: torch.Tensor  # [C], of the train split in [0, 1] units
    std: torch.Tensor
    meta: dict = field(default_factory=dict)
    val: Split | None = None  # data.val_size > 0: held out of train, in memory, evaluated like eval

    def normalize(self, x: torch.Tensor) -> torch.Tensor:
        """uint8 [B, C, H, W] -> float (x/255 - mean) / std on x's device."""
        m = self.mean.to(x.device).view(1, -1, 1, 1)
        s = self.std.to(x.device).view(1, -1, 1, 1)
        return (x.float() / 255.0 - m) / s


def train_is_lazy(cfg, ds) -> bool:
    """data.in_memory: 'true' / 'false' as said; 'auto': lazy when the decoded split would exceed
    MAX_IN_MEMORY_BYTES."""
    if cfg.in_memory != "auto":
        return cfg.in_memory == "false"
    return len(ds) * cfg.in_chans * cfg.img_size**2 > MAX_IN_MEMORY_BYTES


def _check_size(key: str, size, available: int, split: str, held_out: int = 0) -> None:
    """A size the recipe asks of a split must fit in it (less ``held_out`` data.val_size images): refused, not
    clamped."""
    if size is not None and size > available:
        less = f" once data.val_size ({held_out}) are held out" if held_out else ""
        raise DataError(
            f"data.{key} is {size} but the {split} split holds {available} images{less}: lower it"
            f"{' (or leave it out for the whole split)' if key in ('train_size', 'eval_size') else ''}."
        )


_SHRINK = {
    "train": "data.train_size (or set data.in_memory: false)",
    "eval": "data.eval_size, data.analysis_size",
    "val": "data.val_size",
}


def _in_memory(ds, rows, cfg, lab_col: str, what: str) -> Split:
    """These rows of ``ds`` decoded into memory; refused above MAX_IN_MEMORY_BYTES."""
    n, c, s = len(rows), cfg.in_chans, cfg.img_size
    if n * c * s * s > MAX_IN_MEMORY_BYTES:
        raise DataError(
            f"split '{what}' would take {n * c * s * s / 2**30:.0f} GiB in memory: lower {_SHRINK[what]} or "
            "data.img_size."
        )
    return Split(decode_rows(ds, rows, cfg), labels(ds, lab_col, rows))


def build_data(recipe, quiet: bool = False, colour_from_grey: bool = True) -> DataBundle:
    """Load the recipe's data set and cut it into the split roles (see the module docstring).

    The train split is decoded into memory, or (data.in_memory false, or auto and too big) kept as a
    :class:`LazySplit` decoded in the DataLoader workers; eval / probe_train / analysis are always in memory,
    and only the rows they use are decoded when eval_size is set. A size above its split's is refused, and, without
    ``colour_from_grey`` (training: a model of data.in_chans > 1 would learn from copies of one channel),
    data.in_chans > 1 on greyscale images. (Offline analysis of a model from elsewhere, trained on colour, shows it
    greyscale images copied to its 3 channels.)"""
    cfg = recipe.data
    dsd = load_source(cfg)
    check_splits(cfg, list(dsd))
    train_ds, eval_ds = dsd[cfg.train_split], dsd[cfg.eval_split]
    if not colour_from_grey and cfg.in_chans > 1 and image_channels(train_ds, cfg) == 1:
        raise DataError(
            f"data.in_chans is {cfg.in_chans} but the images of this data set are greyscale (1 channel): set "
            "data.in_chans to 1 (a model would only see copies of the one channel)."
        )
    _, lab_col = columns(train_ds, cfg)
    _, eval_lab_col = columns(eval_ds, cfg)
    if cfg.val_size >= len(train_ds):
        raise DataError(
            f"data.val_size is {cfg.val_size} but the train split holds {len(train_ds)} images: lower it so "
            "that some are left to train on."
        )
    _check_size("train_size", cfg.train_size, len(train_ds) - cfg.val_size, "train", cfg.val_size)
    _check_size("probe_train_size", cfg.probe_train_size, len(train_ds) - cfg.val_size, "train", cfg.val_size)
    _check_size("eval_size", cfg.eval_size, len(eval_ds), "eval")
    _check_size("analysis_size", cfg.analysis_size, len(eval_ds), "eval")
    lazy = train_is_lazy(cfg, train_ds)
    all_rows = np.arange(len(train_ds))
    if lazy:
        crop_seed = recipe.seed if cfg.augment.random_resized_crop else None
        train_full = LazySplit(train_ds, all_rows, labels(train_ds, lab_col), cfg, crop_seed)
    else:
        train_full = _in_memory(train_ds, all_rows, cfg, lab_col, "train")
    eval_labels = labels(eval_ds, eval_lab_col)
    feat = train_ds.features[lab_col]
    names = list(getattr(feat, "names", []) or [])
    num_classes = len(names) or int(max(train_full.labels.max(), eval_labels.max())) + 1
    names = names or [str(i) for i in range(num_classes)]

    meta = {"train_in_memory": not lazy, "val_size": cfg.val_size}
    # val first: every later step (train_size, data_subset, probe_train, the statistics) sees only the rest, `pool`
    val, pool = None, train_full
    if cfg.val_size:
        val_idx = balanced_indices(train_full.labels, cfg.val_size, VAL_SEED)
        pool = subset(train_full, np.setdiff1d(all_rows, val_idx))
        val = _in_memory(train_ds, val_idx, cfg, lab_col, "val") if lazy else subset(train_full, val_idx)
        meta["val_hash"] = indices_hash(val_idx)
    train = pool
    if cfg.train_size is not None and cfg.train_size < len(pool):
        train = subset(pool, balanced_indices(pool.labels, cfg.train_size, recipe.seed))
    try:
        idx, chosen_by = interventions.select_train(recipe.interventions, train.labels.numpy(), balanced_indices)
    except ValueError as e:
        raise DataError(str(e)) from None
    if idx is not None:
        meta[chosen_by] = {"size": len(idx), "hash": indices_hash(idx), "of": len(train)}
        train = subset(train, idx)

    eval_idx = None
    if cfg.eval_size is not None and cfg.eval_size < len(eval_labels):
        eval_idx = balanced_indices(eval_labels, cfg.eval_size, recipe.seed)
    analysis_idx = balanced_indices(eval_labels, cfg.analysis_size, recipe.seed + 2)
    if eval_idx is None:  # the whole eval split in memory
        eval_ = _in_memory(eval_ds, np.arange(len(eval_ds)), cfg, eval_lab_col, "eval")
        analysis = subset(eval_, analysis_idx)
    else:  # decode only the rows eval and analysis use (ImageNet's 50k validation images need not all be held)
        needed = np.union1d(eval_idx, analysis_idx)
        held = _in_memory(eval_ds, needed, cfg, eval_lab_col, "eval")
        eval_ = subset(held, np.searchsorted(needed, eval_idx))
        analysis = subset(held, np.searchsorted(needed, analysis_idx))
    probe = subset(pool, balanced_indices(pool.labels, cfg.probe_train_size, recipe.seed + 1))
    if isinstance(probe, LazySplit):
        probe = probe.in_memory()

    if isinstance(pool, LazySplit):
        first = LazySplit(train_ds, pool.rows[:STATS_IMAGES], pool.labels[:STATS_IMAGES], cfg)
        mean, std = channel_stats(_decode_in_workers(first, cfg.num_workers))
    else:
        mean, std = channel_stats(pool.images[:STATS_IMAGES])
    meta.update({"train_size": len(train), "eval_size": len(eval_), "analysis_hash": indices_hash(analysis_idx)})
    return DataBundle(train, eval_, probe, analysis, num_classes, names, mean, std, meta, val)


STATS_CHUNK = 512  # channel_stats converts this many images at a time to float64


def channel_stats(images: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-channel mean and std (Bessel-corrected, floored at 1e-3) of uint8 images [N, C, H, W] scaled to [0, 1],
    as float32, computed in float64 over ``STATS_CHUNK`` images at a time (two passes: the sum, then the squared
    deviations from the mean). A float64 copy of all 10,000 statistics images at once would take 8 bytes a pixel,
    twice (ImageNet at 224: 12 GB a copy)."""
    n, c = images.shape[:2]
    count = images[:, 0].numel()
    total = torch.zeros(c, dtype=torch.float64)
    for i in range(0, n, STATS_CHUNK):
        total += images[i : i + STATS_CHUNK].double().sum(dim=(0, 2, 3))
    mean = total / count / 255.0
    dev = torch.zeros(c, dtype=torch.float64)
    for i in range(0, n, STATS_CHUNK):
        dev += (images[i : i + STATS_CHUNK].double() / 255.0 - mean.view(1, c, 1, 1)).square_().sum(dim=(0, 2, 3))
    std = (dev / max(count - 1, 1)).sqrt()
    return mean.float(), std.clamp_min(1e-3).float()


def _decode_in_workers(split: LazySplit, num_workers: int, batch: int = 256) -> torch.Tensor:
    """Every image of a (small) lazy split, decoded by ``num_workers`` DataLoader workers, in order."""
    batches = [EpochBatch(list(range(i, min(i + batch, len(split)))), 0) for i in range(0, len(split), batch)]
    loader = torch.utils.data.DataLoader(
        split.dataset(), batch_sampler=batches, num_workers=num_workers, collate_fn=batch_collate
    )
    return (
        torch.cat([x for x, _ in loader])
        if batches
        else torch.empty(0, split.cfg.in_chans, split.cfg.img_size, split.cfg.img_size, dtype=torch.uint8)
    )
