"""Images per second that ONE DataLoader worker delivers on the lazy ImageNet input path, against timm's and
torchvision's pipelines on the same JPEGs.

    .venv/bin/python bench/input_speed.py [--images 300] [--size 224] [--repeats 3] [--smoke]

Writes ``--images`` synthetic ImageNet-sized JPEGs (500 x 375, quality 90, smooth colour fields with noise, made
with PIL; ImageNet's mean image is about 400 x 350) into a temporary folder, then times, per image, in one
process with one thread (a worker), variants in an order rotated by one at every repeat:

- ``lazy``:  vitlab's lazy path: a ``datasets.Dataset`` holding the JPEG bytes (as ImageNet's parquet files do),
             :class:`train.splits.LazySplit` with its random-resized crop (seed, epoch, index) at ``--size``,
             decoded by :func:`train.decode.decode_rows` into uint8 [B, 3, S, S]: what a worker does (the
             trainer flips the batch on the device, off the workers, so no flip is timed here; the other two
             flip in the worker);
- ``timm``:  ``timm.data.create_transform(S, is_training=True, use_prefetcher=True)`` (random-resized crop,
             bicubic, flip, uint8 output as timm's loader with its GPU prefetcher; no colour jitter or
             auto-augment, which the lazy path does not do either) on ``PIL.Image.open(file).convert("RGB")``;
- ``tv``:    ``torchvision.io.decode_jpeg`` of the file's bytes, then torchvision v2 RandomResizedCrop
             (bilinear, antialiased) and RandomHorizontalFlip on the uint8 tensor.

Each figure is images per second of this process's CPU time, the best repeat (wall time on a shared machine is
inflated by other jobs). The last line starts with ``RATIO``; the workers a GPU needs follow from it: images per
second the GPU consumes / images per second per worker.
"""

from __future__ import annotations

import os

if __name__ == "__main__":
    for _k in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        os.environ.setdefault(_k, "1")

import argparse
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

W, H = 500, 375


def write_jpegs(folder: Path, n: int, seed: int = 0, size: tuple[int, int] = (W, H)) -> list[Path]:
    """n JPEGs of ``size``: a smooth random colour field (upsampled 8 x 6 noise) plus pixel noise, quality 90."""
    rng = np.random.default_rng(seed)
    paths = []
    for i in range(n):
        base = Image.fromarray(rng.integers(0, 256, (6, 8, 3), dtype=np.uint8)).resize(size, Image.BICUBIC)
        a = np.asarray(base, dtype=np.int16) + rng.integers(-20, 21, (size[1], size[0], 3))
        p = folder / f"{i:05d}.jpg"
        Image.fromarray(a.clip(0, 255).astype(np.uint8)).save(p, quality=90)
        paths.append(p)
    return paths


def lazy_variant(paths: list[Path], size: int, batch: int):
    import datasets

    from train.splits import LazySplit

    ds = datasets.Dataset.from_dict(
        {"image": [{"bytes": p.read_bytes(), "path": None} for p in paths], "label": [0] * len(paths)},
        features=datasets.Features({"image": datasets.Image(), "label": datasets.ClassLabel(num_classes=1)}),
    )
    cfg = SimpleNamespace(in_chans=3, img_size=size, image_column="image", label_column="label")
    split = LazySplit(ds, np.arange(len(paths)), torch.zeros(len(paths), dtype=torch.int64), cfg, crop_seed=0)
    epoch = [0]

    def run():
        epoch[0] += 1  # new crops every run
        for j in range(0, len(paths), batch):
            split.take(np.arange(j, min(j + batch, len(paths))), epoch[0])

    return run


def timm_variant(paths: list[Path], size: int):
    from timm.data import create_transform

    tf = create_transform(size, is_training=True, use_prefetcher=True, interpolation="bicubic", color_jitter=None)

    def run():
        for p in paths:
            with Image.open(p) as im:
                tf(im.convert("RGB"))

    return run


def tv_variant(paths: list[Path], size: int):
    from torchvision.io import decode_jpeg
    from torchvision.transforms import v2

    tf = v2.Compose([v2.RandomResizedCrop(size, antialias=True), v2.RandomHorizontalFlip()])

    def run():
        for p in paths:
            tf(decode_jpeg(torch.frombuffer(bytearray(p.read_bytes()), dtype=torch.uint8)))

    return run


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--images", type=int, default=300)
    p.add_argument("--size", type=int, default=224)
    p.add_argument("--batch", type=int, default=64, help="the lazy path's batch (one __getitems__ call)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--smoke", action="store_true", help="20 images, one repeat (seconds)")
    a = p.parse_args()
    if a.smoke:
        a.images, a.repeats = 20, 1
    if a.images < 1 or a.size < 8:
        p.error(f"--images {a.images} --size {a.size}: use at least 1 image and a size of at least 8.")
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        paths = write_jpegs(Path(tmp), a.images)
        variants = {"lazy": lazy_variant(paths, a.size, a.batch), "timm": timm_variant(paths, a.size)}
        try:
            variants["tv"] = tv_variant(paths, a.size)
        except ImportError as e:
            print(f"# torchvision not installed ({e}): no tv figure")
        best = {k: float("inf") for k in variants}
        names = list(variants)
        for k in names:  # warm-up (imports, first-call costs)
            variants[k]()
        for rep in range(a.repeats):
            for k in names[rep % len(names) :] + names[: rep % len(names)]:
                t0, w0 = time.process_time(), time.perf_counter()
                variants[k]()
                cpu = time.process_time() - t0
                best[k] = min(best[k], cpu)
                wall = time.perf_counter() - w0
                print(
                    f"  repeat {rep} {k:5s} {a.images / cpu:7.1f} img/s CPU ({a.images / wall:7.1f} wall)", flush=True
                )
    rate = {k: a.images / v for k, v in best.items()}
    print(f"# {a.images} JPEGs {W}x{H} -> {a.size}, one thread, load average {os.getloadavg()[0]:.2f}")
    for k, v in rate.items():
        print(f"{k:5s} {v:7.1f} images/s per worker")
    print(
        f"RATIO input size={a.size}: lazy={rate['lazy']:.0f}/s timm={rate['timm']:.0f}/s "
        f"lazy/timm={rate['lazy'] / rate['timm']:.2f}"
        + (f" tv={rate['tv']:.0f}/s lazy/tv={rate['lazy'] / rate['tv']:.2f}" if "tv" in rate else "")
        + f" workers_for_3000/s={3000 / rate['lazy']:.0f}"
    )


if __name__ == "__main__":
    main()
