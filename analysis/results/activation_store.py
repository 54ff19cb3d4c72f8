"""Activations on disk: the sharded, resumable folder :func:`analysis.frontends.api.activations` writes with ``out=``,
and its reader (:class:`Activations`, :func:`open_activations`), which streams it shard by shard.

    DIR/index.json                 what the folder holds and which shards are done (rewritten atomically per shard)
    DIR/shard_00000/<tap>.npy      rows [start, stop) of each tap, uncompressed .npy (memory-mappable)
    DIR/shard_00000/labels.npy     their labels (int64, -1 where unknown)
    DIR/shard_00001/...

``index.json``: ``format`` (1), ``n_images``, ``batch_size``, ``shard_images`` (images per shard, a multiple of the
batch size), ``dtype`` (what the taps were asked in), ``taps`` ({tap: {file, shape (per image), dtype}}, in the order
the forward reaches them), ``taps_requested`` (the names or patterns given), ``model_hash`` (:func:`model_hash`),
``images_hash`` (:func:`images_hash`) and ``shards`` ([{dir, start, stop}], in order, contiguous from 0). A shard is
written into a hidden temporary folder and renamed into place, then listed in the index: a shard counts as done only
once it is listed, so a folder interrupted anywhere (Ctrl-C, a kill, a full disk) holds whole shards only and an
extraction with the same arguments continues after the last one. The index is first written when the first minibatch
gives the taps' shapes (no shard listed yet), so a folder with a shard in place always has one; until then the folder
holds only hidden leftovers and counts as empty. The writer holds ``DIR/.lock`` (flock) while it writes.

A folder written before the format had shards (``index.json`` with ``arrays``: one ``<tap>.npy`` per tap at the top)
reads back as one shard; it cannot be continued (it records no hashes).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
from collections.abc import Iterator, Mapping
from pathlib import Path

import numpy as np
import torch

FORMAT = 1
INDEX = "index.json"
LOCK = ".lock"
SHARD_BYTES = 256 * 2**20  # the default shard holds at most this many bytes (or one minibatch, if that is larger)


# ------------------------------------------------------------------------------------------------------------ hashes


def _hash_tensor(h, t: torch.Tensor) -> None:
    """Feed a tensor's shape, dtype and raw bytes (any dtype, bfloat16 too; C order) to ``h``, 64 MiB at a time (no
    copy of a large CPU tensor)."""
    h.update(f"{tuple(t.shape)}:{t.dtype};".encode())
    raw = t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()
    for i in range(0, len(raw), 2**26):
        h.update(raw[i : i + 2**26])


def model_hash(net: torch.nn.Module) -> str:
    """sha256 over the network's modules (names and classes: an intervention that swaps a block's class without
    changing a weight changes it) and its state_dict (names, shapes, dtypes, bytes, in name order): one pass over the
    weights."""
    h = hashlib.sha256()
    for name, m in net.named_modules():
        h.update(f"{name}:{type(m).__module__}.{type(m).__qualname__};".encode())
    for name, t in sorted(net.state_dict().items()):
        h.update(f"{name};".encode())
        _hash_tensor(h, t)
    return h.hexdigest()


def images_hash(images: torch.Tensor, labels: torch.Tensor, normalized: torch.Tensor, stats=()) -> str:
    """sha256 over the images (shape, dtype, bytes), their labels and the normalisation: ``normalized`` (the model
    inputs the first images become, which any normalisation function changes) and ``stats`` (its mean and std, where
    known)."""
    h = hashlib.sha256()
    for t in (images, labels, normalized, *[torch.as_tensor(s) for s in stats if s is not None]):
        _hash_tensor(h, t)
    return h.hexdigest()


# ------------------------------------------------------------------------------------------------------------ writing


def read_index(folder: Path) -> dict | None:
    """The folder's index, or None where it has none; ValueError (one sentence) for one that does not read."""
    path = Path(folder) / INDEX
    if not path.is_file():
        return None
    try:
        index = json.loads(path.read_text())
        if not isinstance(index, dict):
            raise ValueError
    except (OSError, ValueError):
        raise ValueError(
            f"{path} is not a readable activations index: delete the folder {folder} or choose another."
        ) from None
    return index


def _leftover(name: str) -> bool:
    """A name only an interrupted writer leaves behind: the lock, a shard's temporary folder, the index's tmp file."""
    return name == LOCK or (name.startswith(".") and ".tmp" in name)


def is_fresh(folder: Path) -> bool:
    """The folder is missing, or holds nothing but an interrupted writer's leftovers (no index, no shard)."""
    folder = Path(folder)
    return not folder.exists() or (folder.is_dir() and all(_leftover(p.name) for p in folder.iterdir()))


def differences(index: dict, want: dict) -> list[str]:
    """What differs between a folder's index and the extraction asked for now, in words (empty: it may continue)."""
    if "model_hash" not in index:
        return ["by an older vitlab, which recorded no hash of their model and images"]
    out = []
    if index.get("model_hash") != want["model_hash"]:
        out.append(
            f"by a different model (weights sha256 {str(index.get('model_hash'))[:12]}... there, "
            f"{want['model_hash'][:12]}... now)"
        )
    if index.get("images_hash") != want["images_hash"]:
        n = f"{index.get('n_images')} images there, {want['n_images']} now"
        out.append(
            f"on different images or labels ({n})"
            if index.get("n_images") != want["n_images"]
            else f"on different images, labels or normalisation (sha256 {str(index.get('images_hash'))[:12]}... "
            f"there, {want['images_hash'][:12]}... now)"
        )
    if sorted(index.get("taps", {})) != sorted(want["taps"]):
        out.append(f"of other taps ({', '.join(index.get('taps', {}))} there; {', '.join(want['taps'])} now)")
    if index.get("dtype") != want["dtype"]:
        out.append(f"in {index.get('dtype')}, not {want['dtype']}")
    if index.get("batch_size") != want["batch_size"]:
        out.append(f"with batch_size={index.get('batch_size')}, not {want['batch_size']}")
    if want.get("shard_images") is not None and index.get("shard_images") != want["shard_images"]:
        out.append(f"with shard_images={index.get('shard_images')}, not {want['shard_images']}")
    return out


def default_shard_images(per_image_bytes: int, batch_size: int) -> int:
    """The most whole minibatches whose rows fit :data:`SHARD_BYTES` (at least one)."""
    return max(1, SHARD_BYTES // max(1, per_image_bytes * batch_size)) * batch_size


@contextlib.contextmanager
def writer_lock(folder: Path):
    """Hold ``folder/.lock`` (an exclusive flock) while writing; ValueError (one sentence) where another process holds
    it. The lock file is removed afterwards."""
    path = Path(folder) / LOCK
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            if os.fstat(fd).st_ino != os.stat(path).st_ino:  # removed by the writer before us: not ours to hold
                raise BlockingIOError
        except (BlockingIOError, FileNotFoundError):
            raise ValueError(
                f"another process is writing the activations in {folder}: wait for it to finish, or choose another "
                "folder."
            ) from None
        try:
            yield
        finally:
            with contextlib.suppress(OSError):
                os.unlink(path)
    finally:
        os.close(fd)


def clear_leftovers(folder: Path, index: dict | None) -> None:
    """Remove what an interrupted writer left (temporary folders and files, shard folders no index lists), under the
    lock."""
    listed = {s["dir"] for s in (index or {}).get("shards", [])}
    for p in Path(folder).iterdir():
        stale_shard = p.name.startswith("shard_") and p.name not in listed
        if (p.name != LOCK and _leftover(p.name)) or stale_shard:
            shutil.rmtree(p) if p.is_dir() else p.unlink()


def write_index(folder: Path, index: dict) -> None:
    path = Path(folder) / INDEX
    tmp = path.with_name(f".{INDEX}.{os.getpid()}.tmp")
    try:
        tmp.write_text(json.dumps(index, indent=1))
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


class ShardWriter:
    """One shard being written: its memory-mapped .npy files in a hidden temporary folder, filled minibatch by
    minibatch; :meth:`commit` renames it into place (the index is the caller's)."""

    def __init__(self, folder: Path, number: int, start: int, stop: int, index: dict):
        self.folder, self.start, self.stop = Path(folder), start, stop
        self.name = f"shard_{number:05d}"
        self.tmp = self.folder / f".{self.name}.{os.getpid()}.tmp"
        shutil.rmtree(self.tmp, ignore_errors=True)
        self.tmp.mkdir()
        n = stop - start
        self.arrays = {
            k: np.lib.format.open_memmap(self.tmp / t["file"], mode="w+", dtype=t["dtype"], shape=(n, *t["shape"]))
            for k, t in index["taps"].items()
        }
        self.arrays["labels"] = np.lib.format.open_memmap(self.tmp / "labels.npy", mode="w+", dtype="int64", shape=(n,))

    def put(self, start: int, rows: dict) -> None:
        i = start - self.start
        for k, a in self.arrays.items():
            a[i : i + len(rows[k])] = rows[k]

    def commit(self) -> dict:
        for a in self.arrays.values():
            a.flush()
        self.arrays.clear()
        dst = self.folder / self.name
        if dst.exists():  # an earlier writer's shard that never reached the index
            shutil.rmtree(dst)
        os.replace(self.tmp, dst)
        return {"dir": self.name, "start": self.start, "stop": self.stop}

    def discard(self) -> None:
        self.arrays.clear()
        shutil.rmtree(self.tmp, ignore_errors=True)


# ------------------------------------------------------------------------------------------------------------ reading


class Activations(Mapping):
    """A folder of activations (finished or partial), read lazily: a mapping ``{tap: array, "labels": array}`` over the
    images done so far, and a stream.

    - ``acts.iter(batch_size=None, taps=None)`` yields ``(start, {tap: array [b, ...], "labels": [b]})`` in image order:
      a shard at a time (``batch_size=None``) or ``batch_size`` rows at a time, as read-only memory maps of one shard's
      files (a minibatch that straddles two shards is copied); memory stays at a minibatch's worth.
    - ``acts[tap]`` is the whole tap over the images done: the memory map itself when the folder has one shard,
      otherwise the shards' rows copied into one array in memory (``done`` x the per-image size: mind large taps, and
      use :meth:`iter` instead).
    - ``acts.taps`` (in the order the forward reaches them), ``acts.n_images`` (asked for), ``acts.done`` (written so
      far), ``acts.complete``, ``acts.index`` (index.json), ``acts.path``; ``len(acts)`` and ``list(acts)`` are the
      keys (the taps, then ``labels``), as for the dict :func:`analysis.frontends.api.activations` returns without
      ``out=``.
    """

    def __init__(self, path: str | Path):
        self.path = Path(path)
        index = read_index(self.path)
        if index is None:
            raise ValueError(
                f"{self.path} holds no activations (no {INDEX}): give the folder activations(..., out=) wrote."
            )
        if "arrays" in index and "format" not in index:  # the single-folder layout before shards
            arrays = index["arrays"]
            index = {
                **index,
                "taps": {k: {**v, "shape": v["shape"][1:]} for k, v in arrays.items() if k != "labels"},
                "shards": [{"dir": ".", "start": 0, "stop": index["n_images"]}],
            }
        elif index.get("format") != FORMAT:
            raise ValueError(
                f"{self.path / INDEX} is of format {index.get('format')!r}, which this vitlab does not read (it reads "
                f"format {FORMAT}): update vitlab or extract them again."
            )
        self.index = index
        self.shards = list(index.get("shards", []))
        self.taps = list(index["taps"])
        self.n_images = int(index["n_images"])
        self.done = self.shards[-1]["stop"] if self.shards else 0

    @property
    def complete(self) -> bool:
        return self.done == self.n_images

    def __repr__(self) -> str:
        return f"Activations('{self.path}': {len(self.taps)} taps, {self.done} of {self.n_images} images)"

    def __iter__(self) -> Iterator[str]:
        return iter([*self.taps, "labels"])

    def __len__(self) -> int:
        return len(self.taps) + 1

    def __contains__(self, key) -> bool:  # without reading the tap
        return key == "labels" or key in self.index["taps"]

    def _file(self, key: str) -> str:
        if key == "labels":
            return "labels.npy"
        if key not in self.index["taps"]:
            raise KeyError(key)
        return self.index["taps"][key].get("file", f"{key}.npy")

    def _shape(self, key: str) -> tuple:
        return () if key == "labels" else tuple(self.index["taps"][key]["shape"])

    def _dtype(self, key: str) -> np.dtype:
        return np.dtype("int64" if key == "labels" else self.index["taps"][key]["dtype"])

    def _load(self, shard: dict, key: str) -> np.ndarray:
        return np.load(self.path / shard["dir"] / self._file(key), mmap_mode="r")

    def __getitem__(self, key: str) -> np.ndarray:
        self._file(key)  # KeyError for an unknown key
        if len(self.shards) == 1:
            return self._load(self.shards[0], key)
        out = np.empty((self.done, *self._shape(key)), dtype=self._dtype(key))
        for s in self.shards:
            out[s["start"] : s["stop"]] = self._load(s, key)
        return out

    def iter(self, batch_size: int | None = None, taps=None) -> Iterator[tuple[int, dict[str, np.ndarray]]]:
        """``(start, {key: rows})`` over the images done, in order (see the class docstring); ``taps`` picks keys
        (default all, labels included)."""
        keys = list(self) if taps is None else [*([taps] if isinstance(taps, str) else taps)]
        for k in keys:
            self._file(k)
        if batch_size is not None and (
            not isinstance(batch_size, int) or isinstance(batch_size, bool) or batch_size < 1
        ):
            raise ValueError(f"batch_size must be a positive integer or None, not {batch_size!r}.")
        pending: dict[str, list] = {k: [] for k in keys}
        have, first = 0, 0  # rows waiting in pending, and the image index of the first of them
        for s in self.shards:
            maps = {k: self._load(s, k) for k in keys}
            if batch_size is None:
                yield s["start"], maps
                continue
            i, n = 0, s["stop"] - s["start"]
            while i < n:
                take = min(batch_size - have, n - i)
                for k in keys:
                    pending[k].append(maps[k][i : i + take])
                have, i = have + take, i + take
                if have == batch_size:
                    yield first, {k: v[0] if len(v) == 1 else np.concatenate(v) for k, v in pending.items()}
                    pending, first, have = {k: [] for k in keys}, first + have, 0
        if have:
            yield first, {k: v[0] if len(v) == 1 else np.concatenate(v) for k, v in pending.items()}


def open_activations(path: str | Path) -> Activations:
    """The activations folder ``path`` (as :func:`analysis.frontends.api.activations` wrote it with ``out=``, finished
    or interrupted), read lazily: :class:`Activations`."""
    return Activations(path)
