"""Splits: images and labels of one split role, the batches a DataLoader draws from them, and the seeded,
class-balanced, nested index selections that cut the roles.

A :class:`Split` holds uint8 images [N, C, H, W] in memory; a :class:`LazySplit` keeps a (memory-mapped)
``datasets.Dataset`` and decodes a batch at a time in the DataLoader workers (:mod:`train.decode`, the same
decoding), with per-image random-resized crops seeded by (seed, epoch, index). Both are drawn by
:class:`EpochBatchSampler` (order from (seed, epoch) alone: exact resume) a whole batch at a time.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np
import torch

from train.augment import crop_rng, rrc_box
from train.decode import decode_rows
from train.sources import DataError


def balanced_indices(labels, n: int, seed: int) -> np.ndarray:
    """``n`` indices spread as evenly as possible over classes, seeded, sorted ascending.

    For one seed the selection is nested: the indices chosen for n are a subset of those chosen for any
    larger n. Each class's members are permuted once by the seed and taken from the front; the per-class
    counts are filled one at a time in a seeded round-robin over classes (skipping exhausted classes), so
    they grow monotonically with n.
    """
    labels = np.asarray(labels)
    n = int(min(max(n, 0), len(labels)))
    rng = np.random.default_rng(seed)
    classes = np.unique(labels)
    members = [rng.permutation(np.flatnonzero(labels == c)) for c in classes]
    order = rng.permutation(len(classes))
    sizes = np.array([len(m) for m in members])
    take = np.zeros(len(classes), dtype=np.int64)
    # whole rounds at once, then the remainder one class at a time in the seeded order
    remaining = n
    while remaining > 0:
        open_ = [k for k in order if take[k] < sizes[k]]
        full_rounds = min(remaining // len(open_), int(min(sizes[k] - take[k] for k in open_)))
        if full_rounds > 0:
            take[open_] += full_rounds
            remaining -= full_rounds * len(open_)
            continue
        for k in open_:
            if remaining == 0:
                break
            take[k] += 1
            remaining -= 1
    idx = np.concatenate([m[:t] for m, t in zip(members, take)]) if len(classes) else np.zeros(0, np.int64)
    return np.sort(idx)


def indices_hash(idx) -> str:
    return hashlib.sha256(np.asarray(idx, dtype=np.int64).tobytes()).hexdigest()[:16]


@dataclass
class Split:
    images: torch.Tensor  # uint8 [N, C, H, W]
    labels: torch.Tensor  # int64 [N]

    def __len__(self) -> int:
        return len(self.labels)

    lazy = False

    def dataset(self) -> TensorBatches:
        return TensorBatches(self.images, self.labels)

    def take(self, idx, epoch: int = 0) -> torch.Tensor:
        return self.images[torch.as_tensor(np.asarray(idx), dtype=torch.int64)]


class TensorBatches(torch.utils.data.Dataset):
    """(images, labels) indexed a whole batch at a time (``__getitems__``), not image by image."""

    def __init__(self, images: torch.Tensor, labels: torch.Tensor):
        self.images, self.labels = images, labels

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i):
        return self.images[i], self.labels[i]

    def __getitems__(self, idx):
        idx = torch.as_tensor(idx, dtype=torch.int64)
        return self.images[idx], self.labels[idx]


def batch_collate(batch):
    """Collate for TensorBatches: its ``__getitems__`` already returns stacked tensors."""
    if isinstance(batch, tuple):
        return batch
    return torch.utils.data.default_collate(batch)


class EpochBatch(list):
    """A batch of split indices that knows its epoch (lazy splits seed their crops by (seed, epoch, index))."""

    def __init__(self, idx, epoch: int):
        super().__init__(idx)
        self.epoch = epoch

    def __reduce__(self):  # to DataLoader workers and back, epoch included
        return (EpochBatch, (list(self), self.epoch))


class EpochBatchSampler(torch.utils.data.Sampler):
    """Batches of a per-epoch permutation seeded by (seed, epoch), sharded over processes, last partial
    batch dropped; ``set_epoch(epoch, start_batch)`` resumes mid-epoch without touching any RNG.

    Process ``rank`` of ``world`` takes every world-th index of the permutation, so the union over
    processes of one epoch's batches never repeats an image.

    ``generator``: pass it to the DataLoader (``DataLoader(generator=sampler.generator)``). Creating a DataLoader
    iterator draws its workers' base seed from the loader's generator, by default torch's global one, which the
    step's augmentation and dropout draw from: an uninterrupted run creates an epoch's iterator mid-loop, a resumed
    one at start-up, so the global RNG would differ between them. ``set_epoch`` reseeds this generator from
    (seed, epoch, rank) instead.
    """

    def __init__(self, n: int, batch_size: int, seed: int, rank: int = 0, world: int = 1):
        self.n, self.batch_size, self.seed, self.rank, self.world = n, batch_size, seed, rank, world
        self.epoch, self.start_batch = 0, 0
        self.generator = torch.Generator()
        self.set_epoch(0)
        if self.batches_per_epoch() == 0:
            raise DataError(
                f"the train split ({n} images) is smaller than one batch ({batch_size} x {world} processes): lower "
                "train.batch_size."
            )

    def batches_per_epoch(self) -> int:
        return (self.n // self.world) // self.batch_size

    def set_epoch(self, epoch: int, start_batch: int = 0) -> None:
        self.epoch, self.start_batch = epoch, start_batch
        self.generator.manual_seed(((self.seed * 1_000_003 + epoch) * 4096 + self.rank) & 0x7FFFFFFFFFFFFFFF)

    def __len__(self) -> int:
        return self.batches_per_epoch() - self.start_batch

    def __iter__(self):
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + self.epoch)
        mine = torch.randperm(self.n, generator=g)[self.rank :: self.world]
        b = self.batch_size
        for i in range(self.start_batch, self.batches_per_epoch()):
            yield EpochBatch(mine[i * b : (i + 1) * b].tolist(), self.epoch)


class LazySplit:
    """A split that stays a (memory-mapped) ``datasets.Dataset``: ``rows`` are its rows in this split's order,
    ``labels`` [N] are in memory, images are decoded a batch at a time (:class:`LazyBatches`), in the DataLoader
    workers. ``crop_seed`` set: every image gets a random-resized crop from :func:`crop_rng` (seed, epoch, index)."""

    lazy = True

    def __init__(self, ds, rows, labels: torch.Tensor, cfg, crop_seed: int | None = None):
        self.ds, self.rows, self.labels, self.cfg, self.crop_seed = (
            ds,
            np.asarray(rows, dtype=np.int64),
            labels,
            cfg,
            crop_seed,
        )

    def __len__(self) -> int:
        return len(self.labels)

    def dataset(self) -> LazyBatches:
        return LazyBatches(self)

    def subset(self, idx) -> LazySplit:
        idx = np.asarray(idx, dtype=np.int64)
        return LazySplit(self.ds, self.rows[idx], self.labels[torch.as_tensor(idx)], self.cfg, self.crop_seed)

    def take(self, idx, epoch: int = 0) -> torch.Tensor:
        """uint8 images [len(idx), C, S, S] of these split indices (cropped as in ``epoch`` when cropping)."""
        idx = np.asarray(idx, dtype=np.int64)
        boxes = None
        if self.crop_seed is not None:

            def boxes(i, w, h):
                return rrc_box(w, h, crop_rng(self.crop_seed, epoch, idx[i]))

        return decode_rows(self.ds, self.rows[idx], self.cfg, boxes)

    def in_memory(self) -> Split:
        """Every image decoded (no crop): a :class:`Split`."""
        return Split(decode_rows(self.ds, self.rows, self.cfg), self.labels)


class LazyBatches(torch.utils.data.Dataset):
    """A :class:`LazySplit` indexed a whole batch at a time: ``__getitems__(idx)`` decodes those images (with
    the crops of ``idx.epoch``, an :class:`EpochBatch` attribute) and returns (uint8 [B, C, S, S], labels [B]),
    as :class:`TensorBatches` does."""

    def __init__(self, split: LazySplit):
        self.split = split

    def __len__(self) -> int:
        return len(self.split)

    def __getitem__(self, i):
        return self.split.take([i])[0], self.split.labels[i]

    def __getitems__(self, idx):
        epoch = getattr(idx, "epoch", 0)
        return self.split.take(list(idx), epoch), self.split.labels[torch.as_tensor(list(idx), dtype=torch.int64)]


def subset(split, idx):
    if isinstance(split, LazySplit):
        return split.subset(idx)
    idx = torch.as_tensor(np.asarray(idx), dtype=torch.int64)
    return Split(split.images[idx], split.labels[idx])
