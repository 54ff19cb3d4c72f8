"""Data sources: each becomes a ``datasets.DatasetDict`` (split name -> ``datasets.Dataset``).

Fashion-MNIST from Debian's ``dataset-fashion-mnist`` (gzip IDX files), any Hugging Face hub data set by name
(``cifar10``), a local image folder, or parquet files. A source that cannot be found, reached or read raises
:class:`DataError` with one sentence for the user. :func:`check_source` applies the same rules cheaply, without
reading the images (``python -m train --check``, which ``./launch.sh`` runs before starting several processes).

The Hub offline: huggingface_hub retries a refused or unresolvable connection 5 times with backoff (1 + 2 + 4 + 8 + 8 s)
before datasets falls back to its cache, so a machine without network waited about 25 s for the error (or the cached
copy). Unless HF_HUB_OFFLINE is set, one short request (:func:`hub_reachable`) first asks whether the Hub answers at
all; when it does not, the data set is loaded in offline mode, from the cache at once or with one sentence saying what
to do. A machine with network pays one HEAD request and nothing else changes. The same probe (:func:`hub_state`,
:func:`hub_offline_mode`) guards timm's pretrained weights in analysis/sources/models.py.
"""

from __future__ import annotations

import contextlib
import functools
import gzip
import importlib
import os
from pathlib import Path

import numpy as np

from train.errors import DataError

FASHION_MNIST_DIR = "/usr/share/datasets/fashion-mnist"
FASHION_MNIST_CLASSES = [
    "T-shirt/top",
    "Trouser",
    "Pullover",
    "Dress",
    "Coat",
    "Sandal",
    "Shirt",
    "Sneaker",
    "Bag",
    "Ankle boot",
]


def _read_idx(path: Path) -> np.ndarray:
    with gzip.open(path, "rb") as f:
        raw = f.read()
    if len(raw) < 4 or raw[0] != 0 or raw[1] != 0 or raw[2] != 0x08:
        raise DataError(
            f"'{path}' is not a uint8 IDX file: reinstall the data with 'apt-get install --reinstall "
            "dataset-fashion-mnist'."
        )
    ndim = raw[3]
    shape = tuple(int.from_bytes(raw[4 + 4 * i : 8 + 4 * i], "big") for i in range(ndim))
    return np.frombuffer(raw, np.uint8, offset=4 + 4 * ndim).reshape(shape)


def _fashion_mnist_files(folder: Path) -> dict:
    """{split: (images file, labels file)} of the IDX files in ``folder``; DataError when one is missing."""
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
    return files


def load_fashion_mnist(folder: str | None = None):
    return _load_fashion_mnist(str(Path(folder or FASHION_MNIST_DIR)))


@functools.lru_cache(maxsize=2)
def _load_fashion_mnist(folder: str):
    """Fashion-MNIST (60k train / 10k test, 28x28 grey, 10 classes) as a DatasetDict with 'image', 'label'."""
    import datasets  # deferred: about 2 s to import, and only loading a source needs it

    folder = Path(folder or FASHION_MNIST_DIR)
    files = _fashion_mnist_files(folder)
    feats = datasets.Features(
        {"image": datasets.Array2D((28, 28), "uint8"), "label": datasets.ClassLabel(names=FASHION_MNIST_CLASSES)}
    )
    out = {}
    for split, (img, lab) in files.items():
        x, y = _read_idx(folder / img), _read_idx(folder / lab)
        if x.shape[1:] != (28, 28) or len(x) != len(y):
            raise DataError(
                f"Fashion-MNIST files in {folder} have unexpected shapes {x.shape} / {y.shape}: reinstall them."
            )
        out[split] = datasets.Dataset.from_dict({"image": x, "label": y.astype(np.int64)}, features=feats)
    return datasets.DatasetDict(out)


def _saved_path(cfg) -> Path:
    """data.path of ``source: disk``: a folder DatasetDict.save_to_disk wrote."""
    path = Path(cfg.path)
    if not (path / "dataset_dict.json").is_file():
        raise DataError(
            f"data.path '{path}' is not a data set saved with DatasetDict.save_to_disk (no dataset_dict.json): "
            "save one with datasets.load_dataset(NAME).save_to_disk(PATH) where there is a network."
        )
    return path


def _load_saved(path: Path):
    import datasets  # deferred: about 2 s to import, and only loading a source needs it

    try:
        return datasets.load_from_disk(str(path))
    except Exception as e:  # any reader error becomes one sentence
        raise DataError(
            f"could not read the saved data set at '{path}' ({type(e).__name__}: {str(e)[:200]})."
        ) from None


def _local_path(cfg) -> Path:
    """data.path of ``source: imagefolder / parquet``: it must exist."""
    path = Path(cfg.path)
    if not path.exists():
        raise DataError(f"data.path '{path}' does not exist: point it at a folder of {cfg.source} data.")
    return path


def _parquet_files(path: Path) -> dict:
    """{split: file} of a parquet source: ``<split>[-...].parquet`` in a folder, or one file (the train split)."""
    files = (
        {p.stem.split("-")[0]: str(p) for p in sorted(path.glob("*.parquet"))}
        if path.is_dir()
        else {"train": str(path)}
    )
    if not files:
        raise DataError(f"no .parquet files in '{path}': name them <split>.parquet (e.g. train.parquet, test.parquet).")
    return files


# How long the Hub probe waits for an answer (HF_HUB_ETAG_TIMEOUT when set: the user's own limit for a metadata
# request).
HUB_PROBE_TIMEOUT_S = 3.0


def _offline_set() -> bool:
    """HF_HUB_OFFLINE (or HF_DATASETS_OFFLINE) set by the user, as the libraries read it."""
    import datasets  # deferred: about 2 s to import, and only loading a source needs it
    from huggingface_hub import constants

    return any(getattr(m, a, False) for m, a in _offline_flags(constants, datasets.config))


def _offline_flags(hub_constants, datasets_config) -> list:
    """(module, attribute) of the offline switches huggingface_hub and datasets read at each request."""
    return [
        (hub_constants, "HF_HUB_OFFLINE"),
        (datasets_config, "HF_HUB_OFFLINE"),
        (datasets_config, "HF_DATASETS_OFFLINE"),
    ]


def _transport_errors() -> tuple:
    """The exceptions of a request that got no answer, for the HTTP library huggingface_hub uses: httpx2 / httpx
    TransportError (refused, unresolved, timed out, TLS, proxy), or requests' errors, which are OSErrors."""
    errors = [OSError]
    for module in ("httpx2", "httpx"):
        with contextlib.suppress(ImportError):
            errors.append(importlib.import_module(module).TransportError)
    return tuple(errors)


def hub_reachable(endpoint: str | None = None, timeout: float | None = None) -> bool:
    """Whether anything answers HTTP at the Hub's endpoint (HF_ENDPOINT) within ``timeout`` s: one HEAD request through
    huggingface_hub's own HTTP client (its proxy and certificate settings), no retries. Any status code counts as an
    answer; only a transport error (refused, name not resolved, timed out, TLS) as none."""
    from huggingface_hub import constants, get_session

    if timeout is None:
        timeout = HUB_PROBE_TIMEOUT_S
        with contextlib.suppress(TypeError, ValueError):
            timeout = float(os.environ.get("HF_HUB_ETAG_TIMEOUT"))
    try:
        get_session().head(endpoint or constants.ENDPOINT, timeout=timeout)
    except _transport_errors():
        return False
    return True


def hub_state() -> str | None:
    """Whether to ask the Hub, before a download that would otherwise retry for a long time: ``"set"`` when the user
    set HF_HUB_OFFLINE (or HF_DATASETS_OFFLINE), ``"unreachable"`` when one short request (:func:`hub_reachable`) gets
    no answer, None when the Hub answers. With "unreachable", make the download inside :func:`hub_offline_mode`: it
    reads the local cache at once, or fails at once."""
    if _offline_set():
        return "set"
    return None if hub_reachable() else "unreachable"


@contextlib.contextmanager
def hub_offline_mode():
    """huggingface_hub's and datasets' offline mode for the calls inside (what HF_HUB_OFFLINE=1 sets at import), then
    as before: load_dataset (or timm's pretrained weights) read the cache at once instead of retrying a Hub that does
    not answer."""
    import datasets  # deferred: about 2 s to import, and only loading a source needs it
    from huggingface_hub import constants

    flags = [(m, a) for m, a in _offline_flags(constants, datasets.config) if hasattr(m, a)]
    saved = [getattr(m, a) for m, a in flags]
    for m, a in flags:
        setattr(m, a, True)
    try:
        yield
    finally:
        for (m, a), value in zip(flags, saved):
            setattr(m, a, value)


def _from_hub(name: str, load):
    """``load(name)`` (datasets.load_dataset or load_dataset_builder) with the Hub probed first (see the module
    docstring); DataError with one sentence when it fails."""
    from huggingface_hub import constants

    state = hub_state()
    offline = state == "set"
    try:
        with hub_offline_mode() if state == "unreachable" else contextlib.nullcontext():
            return load(name)
    except Exception as e:
        text = f"{type(e).__name__}: {e}"
        if isinstance(e, ConnectionError) or "Connection" in text or "offline" in text.lower():
            why = (
                "HF_HUB_OFFLINE (or HF_DATASETS_OFFLINE) is set"
                if offline
                else "could not reach the Hugging Face Hub (this machine seems offline)"
            )
            cache = (
                "load it once there and copy its cache to HF_HOME here"
                if offline
                else "fill the cache there (load it once), copy it to HF_HOME here and set HF_HUB_OFFLINE=1"
            )
            raise DataError(
                f"{why} and data set '{name}' is not in the local Hugging Face cache (HF_HOME {constants.HF_HOME}): "
                "where there "
                f"is a network, save it with datasets.load_dataset('{name}').save_to_disk(PATH), copy PATH here and "
                "use "
                f"data.source: disk with data.path: PATH, or {cache}."
            ) from None
        raise DataError(f"could not load hub data set '{name}': {str(e).splitlines()[0][:300]}") from None


def load_source(cfg):
    """The DatasetDict named by a recipe's ``data`` section; DataError with one sentence on failure."""
    import datasets  # deferred: about 2 s to import, and only loading a source needs it

    if cfg.source == "fashion_mnist":
        return load_fashion_mnist(cfg.path)
    if cfg.source == "disk":  # a DatasetDict written by save_to_disk, the usual pattern on offline clusters
        return _load_saved(_saved_path(cfg))
    if cfg.source in ("imagefolder", "parquet"):
        path = _local_path(cfg)
        files = _parquet_files(path) if cfg.source == "parquet" else None
        try:
            if cfg.source == "imagefolder":
                return datasets.load_dataset("imagefolder", data_dir=str(path))
            return datasets.load_dataset("parquet", data_files=files)
        except Exception as e:  # any reader error becomes one sentence
            raise DataError(
                f"could not read {cfg.source} data at '{path}' ({type(e).__name__}: {str(e)[:200]})."
            ) from None
    return _from_hub(cfg.name, datasets.load_dataset)


def check_splits(cfg, names) -> None:
    """data.train_split and data.eval_split must be splits of the data set (``names``: its split names)."""
    for role, name in (("train_split", cfg.train_split), ("eval_split", cfg.eval_split)):
        if name not in names:
            raise DataError(f"data.{role} '{name}' is not a split of this data set: choose one of {', '.join(names)}.")


def check_source(cfg) -> None:
    """:func:`load_source`'s rules without reading the images (a preflight: seconds, not the minutes a large data set
    takes to load): Fashion-MNIST's files exist; a saved data set opens (memory-mapped, nothing read); an image folder
    exists; parquet files are there; a hub data set resolves (from the cache when the Hub cannot be reached). Then the
    recipe's splits are checked where the split names are known without reading (not for an image folder)."""
    names = None
    if cfg.source == "fashion_mnist":
        names = list(_fashion_mnist_files(Path(cfg.path or FASHION_MNIST_DIR)))
    elif cfg.source == "disk":
        names = list(_load_saved(_saved_path(cfg)))
    elif cfg.source == "imagefolder":
        _local_path(cfg)
    elif cfg.source == "parquet":
        names = list(_parquet_files(_local_path(cfg)))
    else:
        import datasets  # deferred: about 2 s to import, and only loading a source needs it

        splits = _from_hub(cfg.name, datasets.load_dataset_builder).info.splits
        names = list(splits) if splits else None
    if names is not None:
        check_splits(cfg, names)
