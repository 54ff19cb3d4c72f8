"""Data sources: each becomes a ``datasets.DatasetDict`` (split name -> ``datasets.Dataset``).

Fashion-MNIST from Debian's ``dataset-fashion-mnist`` (gzip IDX files), any Hugging Face hub data set by name
(``cifar10``), a local image folder, or parquet files. A source that cannot be found, reached or read raises
:class:`DataError` with one sentence for the user.
"""
from __future__ import annotations

import functools
import gzip
import os
from pathlib import Path

import numpy as np

FASHION_MNIST_DIR = "/usr/share/datasets/fashion-mnist"
FASHION_MNIST_CLASSES = ["T-shirt/top", "Trouser", "Pullover", "Dress", "Coat", "Sandal", "Shirt", "Sneaker", "Bag", "Ankle boot"]


class DataError(RuntimeError):
    """A data set cannot be found, reached or read; the message is one sentence for the user."""


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
    import datasets  # deferred: about 2 s to import, and only loading a source needs it

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
    import datasets  # deferred: about 2 s to import, and only loading a source needs it

    if cfg.source == "fashion_mnist":
        return load_fashion_mnist(cfg.path)
    if cfg.source == "disk":  # a DatasetDict written by save_to_disk, the usual pattern on offline clusters
        path = Path(cfg.path)
        if not (path / "dataset_dict.json").is_file():
            raise DataError(f"data.path '{path}' is not a data set saved with DatasetDict.save_to_disk (no dataset_dict.json): "
                            "save one with datasets.load_dataset(NAME).save_to_disk(PATH) where there is a network.")
        try:
            return datasets.load_from_disk(str(path))
        except Exception as e:  # noqa: BLE001 - any reader error becomes one sentence
            raise DataError(f"could not read the saved data set at '{path}' ({type(e).__name__}: {str(e)[:200]}).") from None
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
