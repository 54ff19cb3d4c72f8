"""Decoding: rows of a ``datasets.Dataset`` -> uint8 image tensors [N, C, S, S] at the recipe's size.

One path for every split, in memory or lazy: :func:`decode_rows` takes any rows in any order, whole splits
(:func:`to_tensors`) and the DataLoader workers' batches of a lazy split alike. Array features (Array2D/3D, e.g.
Fashion-MNIST) are read straight from their Arrow buffers and resized on the batch (bilinear, antialiased);
image features are decoded by PIL one at a time, converted to ``in_chans`` channels and resized with PIL's
bicubic filter, optionally from a crop box (random-resized crop of a lazy split).
"""

from __future__ import annotations

import io

import numpy as np
import pyarrow as pa
import torch
import torch.nn.functional as F
from PIL import Image

from train.sources import DataError

GREY_MODES = frozenset({"1", "L", "LA", "I", "I;16", "F"})  # PIL modes of greyscale images (LA: with alpha)
FIT_CHUNK = 1024  # array features are resized this many images at a time (see _fit)
PIL_CHUNK = 1000  # image features are decoded this many rows at a time (never a whole split's PIL images at once)


def columns(ds, cfg) -> tuple[str, str]:
    """(image column, label column): the recipe's, else the first Image / ClassLabel feature, else usual names."""
    import datasets  # deferred: about 2 s to import; a data set object exists, so it is loaded already

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


def arrow_column(ds, col: str, rows=None) -> np.ndarray:
    """A column's values for ``rows`` (positions in ``ds``; None: all), straight from its Arrow buffers (nested
    Array2D/3D lists flattened, the data set's index mapping followed), without per-row Python."""
    table_rows = None if rows is None else np.asarray(rows, dtype=np.int64)
    if ds._indices is not None:
        mapping = ds._indices.column(0).to_numpy()
        table_rows = mapping if table_rows is None else mapping[table_rows]
    column = ds.data.table.column(col)
    arr = (column if table_rows is None else column.take(pa.array(table_rows))).combine_chunks()
    if isinstance(arr.type, pa.ExtensionType):
        arr = arr.storage
    while pa.types.is_list(arr.type) or pa.types.is_large_list(arr.type) or pa.types.is_fixed_size_list(arr.type):
        arr = arr.flatten()
    return arr.to_numpy(zero_copy_only=False)


def image_channels(ds, cfg, sample: int = 8) -> int | None:
    """The colour channels of a data set's images: an array feature's own (as :func:`decode_rows` reads its shape),
    else 1 when its first ``sample`` images are all greyscale (:data:`GREY_MODES`) and 3 when one is in colour;
    None for an empty data set."""
    import datasets  # deferred: see columns()

    img_col, _ = columns(ds, cfg)
    feat = ds.features[img_col]
    if isinstance(feat, (datasets.Array2D, datasets.Array3D)):
        shape = feat.shape
        if len(shape) == 2:
            return 1
        return shape[-1] if shape[-1] in (1, 3, 4) and shape[0] not in (1, 3, 4) else shape[0]
    rows = np.arange(min(sample, len(ds)))
    if not len(rows):
        return None
    images = _images(ds, img_col, feat, rows)
    grey = [im.mode in GREY_MODES if isinstance(im, Image.Image) else np.asarray(im).ndim == 2 for im in images]
    return 1 if all(grey) else 3


def labels(ds, col: str, rows=None) -> torch.Tensor:
    """int64 labels [N] of these rows (all by default)."""
    return torch.as_tensor(arrow_column(ds, col, rows).astype(np.int64))


def decode_rows(ds, rows, cfg, boxes_from=None) -> torch.Tensor:
    """uint8 [len(rows), C, S, S] for these rows of ``ds`` (any order) at cfg.img_size with cfg.in_chans.
    ``boxes_from(i, w, h)`` (optional) gives the crop box of the i-th row (left, top, right, bottom)."""
    import datasets  # deferred: see columns()

    img_col, _ = columns(ds, cfg)
    c, s = cfg.in_chans, cfg.img_size
    rows = np.asarray(rows, dtype=np.int64)
    feat = ds.features[img_col]
    if isinstance(feat, (datasets.Array2D, datasets.Array3D)):
        x = torch.from_numpy(arrow_column(ds, img_col, rows).astype(np.uint8).reshape(len(rows), *feat.shape))
        if x.ndim == 3:
            x = x[:, None]
        elif x.shape[-1] in (1, 3, 4) and x.shape[1] not in (1, 3, 4):
            x = x.permute(0, 3, 1, 2)
        x = _fit(x, c, s)
        if boxes_from is not None:  # array data (already at s x s) is cropped like an in-memory batch
            x = torch.stack([_pil_chw(_chw_pil(im), c, s, boxes_from(i, s, s)) for i, im in enumerate(x)])
        return x
    out = torch.empty((len(rows), c, s, s), dtype=torch.uint8)
    for start in range(0, len(rows), PIL_CHUNK):
        for i, im in enumerate(_images(ds, img_col, feat, rows[start : start + PIL_CHUNK]), start):
            box = None
            if boxes_from is not None:
                size = (
                    im.size if hasattr(im, "size") and not isinstance(im, np.ndarray) else np.asarray(im).shape[1::-1]
                )
                box = boxes_from(i, *size)
            _pil_chw(im, c, s, box, out[i])
    return out


def _images(ds, col: str, feat, rows: np.ndarray) -> list:
    """PIL images of these rows. Stored bytes are opened but not decoded (so that :func:`_pil_chw` can decode a
    JPEG at a reduced scale), unless the image needs what ``datasets`` does on decoding (an EXIF orientation to
    apply, a feature mode to convert to): those, and images stored as paths, are decoded by ``datasets``."""
    import PIL.Image

    if feat.mode is not None:
        return ds[rows.tolist()][col]
    table_rows = rows if ds._indices is None else ds._indices.column(0).to_numpy()[rows]
    stored = ds.data.table.column(col).take(pa.array(table_rows)).combine_chunks()
    out = []
    for i, b in enumerate(stored.field("bytes").to_pylist()):
        im = PIL.Image.open(io.BytesIO(b)) if b is not None else None
        if im is None or im.getexif().get(PIL.Image.ExifTags.Base.Orientation) is not None:
            im = ds[int(rows[i])][col]
        out.append(im)
    return out


def to_tensors(ds, cfg) -> tuple[torch.Tensor, torch.Tensor]:
    """A whole split: (uint8 images [N, C, S, S], int64 labels [N]), through :func:`decode_rows`."""
    _, lab_col = columns(ds, cfg)
    return decode_rows(ds, np.arange(len(ds)), cfg), labels(ds, lab_col)


def _fit(x: torch.Tensor, c: int, s: int) -> torch.Tensor:
    """A uint8 batch converted to ``c`` channels (grey <-> colour) and resized to s x s (bilinear, antialiased),
    ``FIT_CHUNK`` images at a time into the uint8 result: the float intermediates of a whole split at once (28 -> 224
    on Fashion-MNIST's 60,000: 12 GB a copy, three copies) would take several times the result's memory. A grey
    batch is resized before it is copied to ``c`` channels (the copies are equal: one resize, not ``c``)."""
    n, have = x.shape[:2]
    if have != c and have != 1 and c != 1:
        raise DataError(f"images have {have} channels and data.in_chans is {c}: set data.in_chans to {have}.")
    resize = x.shape[-1] != s or x.shape[-2] != s
    if have == c and not resize:
        return x
    out = torch.empty((n, c, s, s), dtype=torch.uint8)
    for i in range(0, n, FIT_CHUNK):
        part = x[i : i + FIT_CHUNK]
        if have != c and c == 1:
            part = part[:, :3].float().mean(1, keepdim=True).round()
        if resize:
            part = F.interpolate(part.float(), size=(s, s), mode="bilinear", antialias=True, align_corners=False)
            part = part.round_().clamp_(0, 255)
        out[i : i + FIT_CHUNK] = part  # a grey part broadcasts over c channels; float -> uint8 exact (integral)
    return out


def _pil_chw(im, c: int, s: int, box=None, out: torch.Tensor | None = None) -> torch.Tensor:
    """One image (PIL or array) -> uint8 [c, s, s]: converted to c channels, the crop ``box`` (left, top, right,
    bottom; None: the whole image) resized to s x s with PIL's bicubic filter (no resize when already s x s).
    Written into ``out`` when given (one copy from PIL's buffer).

    A JPEG not yet decoded whose crop is at least twice s on both sides is decoded at 1/2, 1/4 or 1/8 scale
    (``draft``: libjpeg's DCT scaling, the crop still at least s on both sides), the box scaled to match."""
    if not isinstance(im, Image.Image):
        im = Image.fromarray(np.asarray(im, dtype=np.uint8))
    mode = {1: "L", 3: "RGB", 4: "RGBA"}.get(c, "RGB")
    if box is not None and getattr(im, "format", None) == "JPEG" and im.tile:  # tiles left: not decoded yet
        w, h = im.size
        scale = min(box[2] - box[0], box[3] - box[1]) / s
        if scale >= 2:
            r = min(8, 1 << (int(scale).bit_length() - 1))  # 2, 4 or 8, crop / r >= s
            im.draft(mode if mode in ("L", "RGB") else None, (-(-w // r), -(-h // r)))
            fx, fy = im.size[0] / w, im.size[1] / h
            box = (box[0] * fx, box[1] * fy, box[2] * fx, box[3] * fy)
    if im.mode != mode:
        im = im.convert(mode)
    if box is not None:
        im = im.resize((s, s), Image.BICUBIC, box=box)
    elif im.size != (s, s):
        im = im.resize((s, s), Image.BICUBIC)
    a = np.asarray(im, dtype=np.uint8)  # read-only, over PIL's bytes
    a = a[None] if a.ndim == 2 else a.transpose(2, 0, 1)[:c]
    if out is None:
        return torch.from_numpy(np.array(a))  # a writable copy
    out.numpy()[:] = a  # one copy, HWC -> CHW (numpy's strided copy: faster than torch's on uint8)
    return out


def _chw_pil(x: torch.Tensor) -> Image.Image:
    a = x.numpy()
    return Image.fromarray(a[0] if a.shape[0] == 1 else a.transpose(1, 2, 0))
