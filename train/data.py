"""Data: every source becomes a ``datasets.Dataset``, then uint8 image tensors in four split roles.

Sources: Fashion-MNIST from Debian's ``dataset-fashion-mnist`` (gzip IDX files), any Hugging Face hub data
set by name (``cifar10``), a local image folder, or parquet files. Roles:

* ``train``       the training split (after a ``data_subset`` intervention, if any);
* ``eval``        the evaluation split (top-1 is measured here; probes are tested here);
* ``probe_train`` a seeded, class-balanced part of the train split: few-shot probes draw their shots here;
* ``analysis``    a fixed, seeded, class-balanced part of the eval split, in a fixed order, that every
                  analysis (training-time or offline) uses.

Images are held as uint8 tensors [N, C, H, W] at the recipe's size; augmentation (random shift, flip) and
normalisation run on whole batches on the training device (:func:`augment`, :meth:`DataBundle.normalize`).
A train split too big for memory (``data.in_memory``: auto / false) stays a memory-mapped ``datasets.Dataset``
(:class:`LazySplit`) whose batches are decoded, and random-resized-cropped from (seed, epoch, index), in the
DataLoader workers, to the same uint8 batches.
"""
from __future__ import annotations

import functools
import gzip
import hashlib
import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

FASHION_MNIST_DIR = "/usr/share/datasets/fashion-mnist"
FASHION_MNIST_CLASSES = ["T-shirt/top", "Trouser", "Pullover", "Dress", "Coat", "Sandal", "Shirt", "Sneaker", "Bag", "Ankle boot"]
MAX_IN_MEMORY_BYTES = 16 * 2**30


class DataError(RuntimeError):
    """A data set cannot be found, reached or read; the message is one sentence for the user."""


# ---------------------------------------------------------------- sources -> datasets.DatasetDict


def _read_idx(path: Path) -> np.ndarray:
    with gzip.open(path, "rb") as f:
        raw = f.read()
    if len(raw) < 4 or raw[0] != 0 or raw[1] != 0 or raw[2] != 0x08:
        raise DataError(f"'{path}' is not a uint8 IDX file: reinstall the data with 'apt-get install --reinstall dataset-fashion-mnist'.")
    ndim = raw[3]
    shape = tuple(int.from_bytes(raw[4 + 4 * i: 8 + 4 * i], "big") for i in range(ndim))
    return np.frombuffer(raw, np.uint8, offset=4 + 4 * ndim).reshape(shape)


def load_fashion_mnist(folder: str | None = None):
    return _load_fashion_mnist(str(Path(folder or FASHION_MNIST_DIR)))


@functools.lru_cache(maxsize=2)
def _load_fashion_mnist(folder: str):
    """Fashion-MNIST (60k train / 10k test, 28x28 grey, 10 classes) as a DatasetDict with 'image', 'label'."""
    import datasets

    folder = Path(folder or FASHION_MNIST_DIR)
    files = {
        "train": ("train-images-idx3-ubyte.gz", "train-labels-idx1-ubyte.gz"),
        "test": ("t10k-images-idx3-ubyte.gz", "t10k-labels-idx1-ubyte.gz"),
    }
    missing = [n for pair in files.values() for n in pair if not (folder / n).is_file()]
    if missing:
        raise DataError(
            f"Fashion-MNIST is missing from {folder} ({missing[0]} not found): install it with "
            "'apt-get install -y dataset-fashion-mnist' (./launch.sh does this when run as root)."
        )
    feats = datasets.Features(
        {"image": datasets.Array2D((28, 28), "uint8"), "label": datasets.ClassLabel(names=FASHION_MNIST_CLASSES)}
    )
    out = {}
    for split, (img, lab) in files.items():
        x, y = _read_idx(folder / img), _read_idx(folder / lab)
        if x.shape[1:] != (28, 28) or len(x) != len(y):
            raise DataError(f"Fashion-MNIST files in {folder} have unexpected shapes {x.shape} / {y.shape}: reinstall them.")
        out[split] = datasets.Dataset.from_dict({"image": x, "label": y.astype(np.int64)}, features=feats)
    return datasets.DatasetDict(out)


def load_source(cfg):
    """The DatasetDict named by a recipe's ``data`` section; DataError with one sentence on failure."""
    import datasets

    if cfg.source == "fashion_mnist":
        return load_fashion_mnist(cfg.path)
    if cfg.source in ("imagefolder", "parquet"):
        path = Path(cfg.path)
        if not path.exists():
            raise DataError(f"data.path '{path}' does not exist: point it at a folder of {cfg.source} data.")
        try:
            if cfg.source == "imagefolder":
                return datasets.load_dataset("imagefolder", data_dir=str(path))
            files = {p.stem.split("-")[0]: str(p) for p in sorted(path.glob("*.parquet"))} if path.is_dir() else {"train": str(path)}
            if not files:
                raise DataError(f"no .parquet files in '{path}': name them <split>.parquet (e.g. train.parquet, test.parquet).")
            return datasets.load_dataset("parquet", data_files=files)
        except DataError:
            raise
        except Exception as e:  # noqa: BLE001 - any reader error becomes one sentence
            raise DataError(f"could not read {cfg.source} data at '{path}' ({type(e).__name__}: {str(e)[:200]}).") from None
    try:
        return datasets.load_dataset(cfg.name)
    except Exception as e:  # noqa: BLE001
        text = f"{type(e).__name__}: {e}"
        offline = os.environ.get("HF_DATASETS_OFFLINE") == "1" or os.environ.get("HF_HUB_OFFLINE") == "1"
        if offline or "ConnectionError" in text or "reach" in text or "offline" in text.lower() or "Connection" in text:
            raise DataError(
                f"could not reach the Hugging Face Hub for data set '{cfg.name}' (this machine looks offline): "
                "download it once where there is a network (it is then cached), or use data.source: "
                "imagefolder / parquet with a local copy, or fashion_mnist."
            ) from None
        raise DataError(f"could not load hub data set '{cfg.name}': {str(e).splitlines()[0][:300]}") from None


# ---------------------------------------------------------------- datasets.Dataset -> uint8 tensors


def _columns(ds, cfg) -> tuple[str, str]:
    import datasets

    feats = ds.features
    img = cfg.image_column or next((k for k, f in feats.items() if isinstance(f, datasets.Image)), None)
    img = img or next((k for k in ("image", "img", "pixel_values") if k in feats), None)
    lab = cfg.label_column or next((k for k, f in feats.items() if isinstance(f, datasets.ClassLabel)), None)
    lab = lab or next((k for k in ("label", "labels", "fine_label") if k in feats), None)
    if img not in feats:
        raise DataError(f"no image column in the data set (columns: {', '.join(feats)}): set data.image_column.")
    if lab not in feats:
        raise DataError(f"no label column in the data set (columns: {', '.join(feats)}): set data.label_column.")
    return img, lab


def to_tensors(ds, cfg, desc: str = "") -> tuple[torch.Tensor, torch.Tensor]:
    """Decode a split into (uint8 images [N, C, H, W] at cfg.img_size with cfg.in_chans, int64 labels [N])."""
    import datasets

    img_col, lab_col = _columns(ds, cfg)
    n, c, s = len(ds), cfg.in_chans, cfg.img_size
    if n * c * s * s > MAX_IN_MEMORY_BYTES:
        raise DataError(f"split '{desc}' would take {n * c * s * s / 2**30:.0f} GiB in memory: lower data.img_size or use a smaller split.")
    if ds._indices is not None:
        ds = ds.flatten_indices()
    labels = torch.as_tensor(_arrow_numpy(ds, lab_col).astype(np.int64))
    feat = ds.features[img_col]
    if isinstance(feat, (datasets.Array2D, datasets.Array3D)):
        x = torch.from_numpy(_arrow_numpy(ds, img_col).astype(np.uint8).reshape(n, *feat.shape))
        if x.ndim == 3:
            x = x[:, None]
        elif x.shape[-1] in (1, 3, 4) and x.shape[1] not in (1, 3, 4):
            x = x.permute(0, 3, 1, 2)
        return _fit(x, c, s), labels
    out = torch.empty((n, c, s, s), dtype=torch.uint8)
    for i, im in enumerate(ds[img_col] if n < 1000 else (ds[j][img_col] for j in range(n))):
        out[i] = _pil_chw(im, c, s)
    return out, labels


def _pil_chw(im, c: int, s: int, box=None) -> torch.Tensor:
    """One image (PIL or array) -> uint8 [c, s, s]: converted to c channels, the crop ``box`` (left, top, right,
    bottom; None: the whole image) resized to s x s with PIL's bicubic filter (no resize when already s x s)."""
    from PIL import Image

    if not isinstance(im, Image.Image):
        im = Image.fromarray(np.asarray(im, dtype=np.uint8))
    im = im.convert({1: "L", 3: "RGB", 4: "RGBA"}.get(c, "RGB"))
    if box is not None:
        im = im.resize((s, s), Image.BICUBIC, box=box)
    elif im.size != (s, s):
        im = im.resize((s, s), Image.BICUBIC)
    a = torch.from_numpy(np.asarray(im, dtype=np.uint8).copy())
    return a[None] if a.ndim == 2 else a.permute(2, 0, 1)[:c]


# ---------------------------------------------------------------- lazy (memory-mapped) splits


RRC_SCALE, RRC_RATIO = (0.08, 1.0), (3 / 4, 4 / 3)


def rrc_box(w: int, h: int, rng: np.random.Generator) -> tuple[int, int, int, int]:
    """Inception-style random-resized-crop box (left, top, right, bottom) of a w x h image: area a uniform
    fraction of RRC_SCALE, aspect ratio log-uniform in RRC_RATIO, 10 tries, then the central crop at the nearest
    allowed ratio (torchvision's RandomResizedCrop.get_params, drawn from ``rng``)."""
    area = w * h
    lo, hi = np.log(RRC_RATIO[0]), np.log(RRC_RATIO[1])
    for _ in range(10):
        target = area * rng.uniform(*RRC_SCALE)
        ratio = float(np.exp(rng.uniform(lo, hi)))
        cw, ch = int(round(np.sqrt(target * ratio))), int(round(np.sqrt(target / ratio)))
        if 0 < cw <= w and 0 < ch <= h:
            x0, y0 = int(rng.integers(0, w - cw + 1)), int(rng.integers(0, h - ch + 1))
            return x0, y0, x0 + cw, y0 + ch
    r = w / h
    if r < RRC_RATIO[0]:
        cw, ch = w, int(round(w / RRC_RATIO[0]))
    elif r > RRC_RATIO[1]:
        cw, ch = int(round(h * RRC_RATIO[1])), h
    else:
        cw, ch = w, h
    x0, y0 = (w - cw) // 2, (h - ch) // 2
    return x0, y0, x0 + cw, y0 + ch


def crop_rng(seed: int, epoch: int, index: int) -> np.random.Generator:
    """The generator of one image's crop: a function of (seed, epoch, index in the train split) only, so any
    worker, batch order or resumed run draws the same crop for it."""
    return np.random.default_rng([int(seed), int(epoch), int(index)])


def _label_array(ds, lab_col: str) -> np.ndarray:
    if ds._indices is not None:
        return np.asarray(ds[lab_col], dtype=np.int64)
    return _arrow_numpy(ds, lab_col).astype(np.int64)


def decode_rows(ds, rows, cfg, boxes_from=None) -> torch.Tensor:
    """uint8 [len(rows), C, S, S] for these rows of ``ds`` (any order), decoded exactly as :func:`to_tensors`
    decodes them. ``boxes_from(i, w, h)`` (optional) gives the crop box of the i-th row (image formats only)."""
    import datasets

    img_col, _ = _columns(ds, cfg)
    c, s = cfg.in_chans, cfg.img_size
    rows = np.asarray(rows, dtype=np.int64)
    feat = ds.features[img_col]
    if isinstance(feat, (datasets.Array2D, datasets.Array3D)):
        if ds._indices is not None:
            rows = ds._indices.column(0).to_numpy()[rows]
        import pyarrow as pa

        col = ds.data.table.column(img_col).take(pa.array(rows))
        arr = col.combine_chunks()
        if isinstance(arr.type, pa.ExtensionType):
            arr = arr.storage
        while pa.types.is_list(arr.type) or pa.types.is_large_list(arr.type) or pa.types.is_fixed_size_list(arr.type):
            arr = arr.flatten()
        x = torch.from_numpy(arr.to_numpy(zero_copy_only=False).astype(np.uint8).reshape(len(rows), *feat.shape))
        if x.ndim == 3:
            x = x[:, None]
        elif x.shape[-1] in (1, 3, 4) and x.shape[1] not in (1, 3, 4):
            x = x.permute(0, 3, 1, 2)
        x = _fit(x, c, s)
        if boxes_from is not None:  # array data (already at s x s) is cropped like an in-memory batch
            x = torch.stack([_pil_chw(_chw_pil(im), c, s, boxes_from(i, s, s)) for i, im in enumerate(x)])
        return x
    images = ds[rows.tolist()][img_col] if len(rows) else []
    out = torch.empty((len(rows), c, s, s), dtype=torch.uint8)
    for i, im in enumerate(images):
        box = None
        if boxes_from is not None:
            size = im.size if hasattr(im, "size") and not isinstance(im, np.ndarray) else np.asarray(im).shape[1::-1]
            box = boxes_from(i, *size)
        out[i] = _pil_chw(im, c, s, box)
    return out


def _chw_pil(x: torch.Tensor):
    from PIL import Image

    a = x.numpy()
    return Image.fromarray(a[0] if a.shape[0] == 1 else a.transpose(1, 2, 0))


class LazySplit:
    """A split that stays a (memory-mapped) ``datasets.Dataset``: ``rows`` are its rows in this split's order,
    ``labels`` [N] are in memory, images are decoded a batch at a time (:class:`LazyBatches`), in the DataLoader
    workers. ``crop_seed`` set: every image gets a random-resized crop from :func:`crop_rng` (seed, epoch, index)."""

    lazy = True

    def __init__(self, ds, rows, labels: torch.Tensor, cfg, crop_seed: int | None = None):
        self.ds, self.rows, self.labels, self.cfg, self.crop_seed = ds, np.asarray(rows, dtype=np.int64), labels, cfg, crop_seed

    def __len__(self) -> int:
        return len(self.labels)

    def dataset(self) -> "LazyBatches":
        return LazyBatches(self)

    def subset(self, idx) -> "LazySplit":
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

    def in_memory(self) -> "Split":
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


def _arrow_numpy(ds, col: str) -> np.ndarray:
    """A column straight from its Arrow buffers (nested Array2D/3D lists flattened), without per-row Python."""
    import pyarrow as pa

    arr = ds.data.column(col).combine_chunks()
    if isinstance(arr.type, pa.ExtensionType):
        arr = arr.storage
    while pa.types.is_list(arr.type) or pa.types.is_large_list(arr.type) or pa.types.is_fixed_size_list(arr.type):
        arr = arr.flatten()
    return arr.to_numpy(zero_copy_only=False)


def _fit(x: torch.Tensor, c: int, s: int) -> torch.Tensor:
    if x.shape[1] != c:
        if x.shape[1] == 1:
            x = x.expand(-1, c, -1, -1).contiguous()
        elif c == 1:
            x = (x[:, :3].float().mean(1, keepdim=True)).round().to(torch.uint8)
        else:
            raise DataError(f"images have {x.shape[1]} channels and data.in_chans is {c}: set data.in_chans to {x.shape[1]}.")
    if x.shape[-1] != s or x.shape[-2] != s:
        x = F.interpolate(x.float(), size=(s, s), mode="bilinear", antialias=True, align_corners=False)
        x = x.round().clamp(0, 255).to(torch.uint8)
    return x


# ---------------------------------------------------------------- seeded, class-balanced, nested subsets


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


# ---------------------------------------------------------------- the bundle every part of vitlab uses


@dataclass
class Split:
    images: torch.Tensor  # uint8 [N, C, H, W]
    labels: torch.Tensor  # int64 [N]

    def __len__(self) -> int:
        return len(self.labels)

    lazy = False

    def dataset(self) -> "TensorBatches":
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
    """

    def __init__(self, n: int, batch_size: int, seed: int, rank: int = 0, world: int = 1):
        self.n, self.batch_size, self.seed, self.rank, self.world = n, batch_size, seed, rank, world
        self.epoch, self.start_batch = 0, 0
        if self.batches_per_epoch() == 0:
            raise DataError(f"the train split ({n} images) is smaller than one batch ({batch_size} x {world} processes): lower train.batch_size.")

    def batches_per_epoch(self) -> int:
        return (self.n // self.world) // self.batch_size

    def set_epoch(self, epoch: int, start_batch: int = 0) -> None:
        self.epoch, self.start_batch = epoch, start_batch

    def __len__(self) -> int:
        return self.batches_per_epoch() - self.start_batch

    def __iter__(self):
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + self.epoch)
        mine = torch.randperm(self.n, generator=g)[self.rank:: self.world]
        b = self.batch_size
        for i in range(self.start_batch, self.batches_per_epoch()):
            yield EpochBatch(mine[i * b: (i + 1) * b].tolist(), self.epoch)


@dataclass
class DataBundle:
    train: "Split | LazySplit"  # LazySplit when data.in_memory resolves to false (see build_data)
    eval: Split
    probe_train: Split
    analysis: Split
    num_classes: int
    class_names: list
    mean: torch.Tensor  # [C], of the train split in [0, 1] units
    std: torch.Tensor
    meta: dict = field(default_factory=dict)

    def normalize(self, x: torch.Tensor) -> torch.Tensor:
        """uint8 [B, C, H, W] -> float (x/255 - mean) / std on x's device."""
        m = self.mean.to(x.device).view(1, -1, 1, 1)
        s = self.std.to(x.device).view(1, -1, 1, 1)
        return (x.float() / 255.0 - m) / s


def augment(x: torch.Tensor, shift: int, hflip: bool, rrc: bool = False) -> torch.Tensor:
    """Per-image random-resized crop (``rrc``, see :func:`batch_rrc`), random translation by up to +-shift pixels
    (zero padding) and random horizontal flip, in that order.

    Draws from torch's global RNG on x's device (the trainer reseeds it every step for exact resume).
    """
    if rrc:
        x = batch_rrc(x)
    b, c, h, w = x.shape
    if shift > 0:
        p = F.pad(x, (shift, shift, shift, shift))
        dy = torch.randint(0, 2 * shift + 1, (b,), device=x.device)
        dx = torch.randint(0, 2 * shift + 1, (b,), device=x.device)
        rows = (dy[:, None] + torch.arange(h, device=x.device))[:, None, :, None]
        cols = (dx[:, None] + torch.arange(w, device=x.device))[:, None, None, :]
        bi = torch.arange(b, device=x.device)[:, None, None, None]
        ci = torch.arange(c, device=x.device)[None, :, None, None]
        x = p[bi, ci, rows, cols]
    if hflip:
        flip = torch.rand(b, device=x.device) < 0.5
        x = torch.where(flip[:, None, None, None], x.flip(-1), x)
    return x


def batch_rrc(x: torch.Tensor) -> torch.Tensor:
    """Inception-style random-resized crop of every image of a uint8 batch [B, C, H, W] on its device: box area a
    uniform fraction of RRC_SCALE of the image, aspect ratio log-uniform in RRC_RATIO (first of 10 tries that fits,
    else the whole image), resampled bilinearly back to H x W. Torch's global RNG (reseeded every step)."""
    b, c, h, w = x.shape
    dev, tries = x.device, 10
    area = torch.empty(b, tries, device=dev).uniform_(*RRC_SCALE) * (h * w)
    ratio = torch.exp(torch.empty(b, tries, device=dev).uniform_(float(np.log(RRC_RATIO[0])), float(np.log(RRC_RATIO[1]))))
    cw, ch = torch.sqrt(area * ratio).round(), torch.sqrt(area / ratio).round()
    ok = (cw >= 1) & (cw <= w) & (ch >= 1) & (ch <= h)
    first = torch.where(ok.any(1), ok.float().argmax(1), torch.full((b,), -1, device=dev))
    pick = first.clamp_min(0)[:, None]
    cw = torch.where(first >= 0, cw.gather(1, pick)[:, 0], torch.full((b,), float(w), device=dev))
    ch = torch.where(first >= 0, ch.gather(1, pick)[:, 0], torch.full((b,), float(h), device=dev))
    x0 = torch.floor(torch.rand(b, device=dev) * (w - cw + 1))
    y0 = torch.floor(torch.rand(b, device=dev) * (h - ch + 1))
    theta = torch.zeros(b, 2, 3, device=dev)
    theta[:, 0, 0], theta[:, 0, 2] = cw / w, (2 * x0 + cw) / w - 1
    theta[:, 1, 1], theta[:, 1, 2] = ch / h, (2 * y0 + ch) / h - 1
    grid = F.affine_grid(theta, (b, c, h, w), align_corners=False)
    out = F.grid_sample(x.float(), grid, mode="bilinear", padding_mode="border", align_corners=False)
    return out.round().clamp(0, 255).to(torch.uint8)


def _subset(split, idx):
    if isinstance(split, LazySplit):
        return split.subset(idx)
    idx = torch.as_tensor(np.asarray(idx), dtype=torch.int64)
    return Split(split.images[idx], split.labels[idx])


STATS_IMAGES = 10000  # mean / std come from the first this many train images (no crop, no augmentation)


def train_is_lazy(cfg, ds) -> bool:
    """data.in_memory: 'true' / 'false' as said; 'auto': lazy when the decoded split would exceed MAX_IN_MEMORY_BYTES."""
    if cfg.in_memory != "auto":
        return cfg.in_memory == "false"
    return len(ds) * cfg.in_chans * cfg.img_size ** 2 > MAX_IN_MEMORY_BYTES


def build_data(recipe, quiet: bool = False) -> DataBundle:
    """Load the recipe's data set and cut it into the four split roles (see the module docstring).

    The train split is decoded into memory, or (data.in_memory false, or auto and too big) kept as a
    :class:`LazySplit` decoded in the DataLoader workers; eval / probe_train / analysis are always in memory,
    and only the rows they use are decoded when eval_size is set."""
    cfg = recipe.data
    dsd = load_source(cfg)
    for role, name in (("train_split", cfg.train_split), ("eval_split", cfg.eval_split)):
        if name not in dsd:
            raise DataError(f"data.{role} '{name}' is not a split of this data set: choose one of {', '.join(dsd)}.")
    train_ds, eval_ds = dsd[cfg.train_split], dsd[cfg.eval_split]
    _, lab_col = _columns(train_ds, cfg)
    _, eval_lab_col = _columns(eval_ds, cfg)
    lazy = train_is_lazy(cfg, train_ds)
    if lazy:
        labels = torch.as_tensor(_label_array(train_ds, lab_col))
        crop_seed = recipe.seed if cfg.augment.random_resized_crop else None
        train_full = LazySplit(train_ds, np.arange(len(train_ds)), labels, cfg, crop_seed)
    else:
        train_full = Split(*to_tensors(train_ds, cfg, "train"))
    eval_labels = torch.as_tensor(_label_array(eval_ds, eval_lab_col))
    feat = train_ds.features[lab_col]
    names = list(getattr(feat, "names", []) or [])
    num_classes = len(names) or int(max(train_full.labels.max(), eval_labels.max())) + 1
    names = names or [str(i) for i in range(num_classes)]

    meta = {"train_in_memory": not lazy}
    train = train_full
    if cfg.train_size is not None and cfg.train_size < len(train_full):
        train = _subset(train_full, balanced_indices(train_full.labels, cfg.train_size, recipe.seed))
    sub = recipe.interventions.data_subset
    if sub is not None:
        n = sub.count if sub.count is not None else int(round(sub.fraction * len(train)))
        if n > len(train):
            raise DataError(f"interventions.data_subset.count {n} exceeds the train split's {len(train)} images: lower it.")
        idx = balanced_indices(train.labels, n, sub.seed)
        meta["data_subset"] = {"size": int(len(idx)), "hash": indices_hash(idx), "of": len(train)}
        train = _subset(train, idx)

    eval_idx = None
    if cfg.eval_size is not None and cfg.eval_size < len(eval_labels):
        eval_idx = balanced_indices(eval_labels, cfg.eval_size, recipe.seed)
    analysis_idx = balanced_indices(eval_labels, cfg.analysis_size, recipe.seed + 2)
    if eval_idx is None:  # the whole eval split in memory, as before
        eval_full = Split(*to_tensors(eval_ds, cfg, "eval"))
        eval_, analysis = eval_full, _subset(eval_full, analysis_idx)
    else:  # decode only the rows eval and analysis use (ImageNet's 50k validation images need not all be held)
        needed = np.union1d(eval_idx, analysis_idx)
        n, c, s = len(needed), cfg.in_chans, cfg.img_size
        if n * c * s * s > MAX_IN_MEMORY_BYTES:
            raise DataError(f"split 'eval' would take {n * c * s * s / 2**30:.0f} GiB in memory: lower data.eval_size, data.analysis_size or data.img_size.")
        held = Split(decode_rows(eval_ds, needed, cfg), eval_labels[torch.as_tensor(needed)])
        eval_ = _subset(held, np.searchsorted(needed, eval_idx))
        analysis = _subset(held, np.searchsorted(needed, analysis_idx))
    probe = _subset(train_full, balanced_indices(train_full.labels, cfg.probe_train_size, recipe.seed + 1))
    if isinstance(probe, LazySplit):
        probe = Split(decode_rows(probe.ds, probe.rows, cfg), probe.labels)

    if isinstance(train_full, LazySplit):
        first = LazySplit(train_ds, np.arange(min(STATS_IMAGES, len(train_full))), train_full.labels[:STATS_IMAGES], cfg)
        stats = _decode_in_workers(first, cfg.num_workers).double() / 255.0
    else:
        stats = train_full.images[:STATS_IMAGES].double() / 255.0
    mean = stats.mean(dim=(0, 2, 3)).float()
    std = stats.std(dim=(0, 2, 3)).clamp_min(1e-3).float()
    meta.update({"train_size": len(train), "eval_size": len(eval_), "analysis_hash": indices_hash(analysis_idx)})
    return DataBundle(train, eval_, probe, analysis, num_classes, names, mean, std, meta)


def _decode_in_workers(split: LazySplit, num_workers: int, batch: int = 256) -> torch.Tensor:
    """Every image of a (small) lazy split, decoded by ``num_workers`` DataLoader workers, in order."""
    batches = [EpochBatch(list(range(i, min(i + batch, len(split)))), 0) for i in range(0, len(split), batch)]
    loader = torch.utils.data.DataLoader(split.dataset(), batch_sampler=batches, num_workers=num_workers, collate_fn=batch_collate)
    return torch.cat([x for x, _ in loader]) if batches else torch.empty(0, split.cfg.in_chans, split.cfg.img_size, split.cfg.img_size, dtype=torch.uint8)
