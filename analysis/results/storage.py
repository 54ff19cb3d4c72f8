"""Where analysis results live in a run folder, and their cache keys -- in one place. This module only stores and
reads back; :mod:`analysis.results.publish` sends results to TensorBoard and draws their figures.

    runs/<name>/analysis/step_XXXXXXX/<measure>.npz     a measure's result (analysis/engine/measure.py)
    runs/<name>/analysis/step_XXXXXXX/summary.json      key numbers of every measure and the model's block layout
    runs/<name>/analysis/step_XXXXXXX/cache.json        {measure: cache key} of the results in the folder
    runs/<name>/figures/step_XXXXXXX/<tag>.png          figures (TensorBoard image tag with / -> _)
    runs/<name>/analysis/against/<other>_step_Y/step_X/ cross-run results (cross_cka.npz, head_subsets.npz)
    runs/<name>/analysis/<part>/step_XXXXXXX/           the same for another network of the checkpoint than the one
    runs/<name>/figures/<part>/step_XXXXXXX/            trained as the backbone (``--part teacher``: DINO's EMA teacher)

A self-supervised checkpoint holds several networks (``Objective.parts`` in train/objectives: ``student``, the
backbone, and e.g. ``teacher``); results of the default part (``student``, also a supervised run's one network) live
where they always did, those of any other part in a folder named after it, with their TensorBoard tags and figure
titles labelled by it (``analysis/teacher/cka/mean_offdiag``, image ``teacher/cka/self``).

A result's cache key (:func:`cache_key`) is a hash of the checkpoint's weights (their recorded sha256), the analysis
images (:func:`data_fingerprint`), the measure's name and what the measure depends on
(:meth:`analysis.engine.suite.SuiteOptions.settings`: the batch size, the measure's own options and its definition's
``version``): changing one measure's options recomputes that measure only. A cached result is reused only if its file
reads back whole.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import threading
from pathlib import Path

import torch

from analysis.engine.measure import load_result, registry, save_result
from train.checkpoint import step_dir_name

DEFAULT_PART = "student"  # the network analysed unless told: the backbone a run trains (a supervised run's only one)
REPOSITORY = Path(__file__).resolve().parents[2]  # the checkout this module is in (analysis/results/storage.py)


def shown(path) -> str:
    """``path`` as messages and generated reports show it: relative to the repository (``runs/study-x/run_s0``; a
    path outside it as ``../``-relative), never the machine's absolute path, which says nothing on another machine."""
    p = Path(os.path.abspath(path))
    try:
        return p.relative_to(REPOSITORY).as_posix()
    except ValueError:
        return Path(os.path.relpath(p, REPOSITORY)).as_posix()


def _part_root(run_path: Path, kind: str, part: str | None) -> Path:
    root = Path(run_path) / kind
    return root if part in (None, DEFAULT_PART) else root / part


def step_dir(run_path: Path, step: int, kind: str = "analysis", part: str | None = None) -> Path:
    """``run/analysis/step_XXXXXXX`` (``kind="figures"`` for the figures); ``run/analysis/<part>/step_XXXXXXX`` for
    a part other than the default one."""
    return _part_root(run_path, kind, part) / step_dir_name(step)


def against_dir(
    run_path: Path, step: int, other_name: str, other_step: int, kind: str = "analysis", part: str | None = None
) -> Path:
    return (
        _part_root(run_path, kind, part) / "against" / f"{other_name}_{step_dir_name(other_step)}" / step_dir_name(step)
    )


def part_label(part: str | None) -> str | None:
    """The label of a part's results (tags, titles): None for the default part, whose results are unlabelled."""
    return None if part in (None, DEFAULT_PART) else part


def data_fingerprint(data) -> str:
    """sha256 of the analysis and probe-train images and labels and the normalisation: two runs analysed on the
    same images have the same fingerprint."""
    h = hashlib.sha256()
    for split in (data.analysis, data.probe_train):
        for t in (split.images, split.labels):
            h.update(str(tuple(t.shape)).encode())
            h.update(t.contiguous().cpu().numpy().tobytes())
    for t in (data.mean, data.std):
        h.update(torch.as_tensor(t).double().numpy().tobytes())
    return h.hexdigest()


def weights_id(checkpoint_dir: Path) -> str | None:
    """The recorded sha256 of a checkpoint's model.safetensors (from its meta.json), or None."""
    try:
        return json.loads((Path(checkpoint_dir) / "meta.json").read_text())["files"]["model.safetensors"]
    except (OSError, ValueError, KeyError, TypeError):
        return None


def cache_key(weights: str, data_fp: str, settings: dict, measure: str) -> str:
    """What a saved result depends on: the weights, the analysis images, the measure and its settings."""
    blob = json.dumps({"weights": weights, "data": data_fp, "settings": settings, "measure": measure}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:32]


def cached_keys(out_dir: Path) -> dict:
    try:
        keys = json.loads((Path(out_dir) / "cache.json").read_text())
        return keys if isinstance(keys, dict) else {}
    except (OSError, ValueError):
        return {}


def readable(path: Path) -> bool:
    """Whether a saved result reads back whole (a truncated or garbled file is recomputed, not reused)."""
    try:
        load_result(path)
        return True
    except Exception:  # any failure to read means "not usable"
        return False


def read_summary(out_dir: Path) -> dict | None:
    """summary.json of a results folder, or None when it is missing or unreadable (garbled, or not a mapping)."""
    try:
        d = json.loads((Path(out_dir) / "summary.json").read_text())
    except (OSError, ValueError):
        return None
    return d if isinstance(d, dict) else None


def is_cached(out_dir: Path, name: str, key: str) -> bool:
    """A result of ``name`` with this key that reads back whole, its key numbers in a readable summary.json (an
    unreadable one is rewritten: the measure is recomputed, as for a garbled .npz)."""
    f = Path(out_dir) / f"{name}.npz"
    return (
        cached_keys(out_dir).get(name) == key and f.is_file() and readable(f) and name in (read_summary(out_dir) or {})
    )


def is_kept(out_dir: Path, name: str, key: str) -> bool:
    """Whether ``out_dir`` holds a readable ``<name>.npz`` saved under ``key`` in its cache.json: a result that is not
    a measure's (cross-run CKA, a study's report-time baselines), so without a summary.json entry."""
    f = Path(out_dir) / f"{name}.npz"
    return cached_keys(out_dir).get(name) == key and f.is_file() and readable(f)


def keep_result(out_dir: Path, name: str, key: str, res: dict) -> dict:
    """Save a result that is not a measure's (cross-run CKA, a study's report-time baselines, the real-ViT report's
    statistics) as ``<name>.npz`` (atomically, the folder made) under ``key`` in the folder's cache.json, beside the
    other entries (read-merge-write under the folder's lock); returns it as read back, so that the caller sees what a
    later cached read gives. :func:`is_kept` is its test."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    atomic_npz(res, out_dir / f"{name}.npz")
    with folder_lock(out_dir):
        atomic_text(out_dir / "cache.json", json.dumps({**cached_keys(out_dir), name: key}, indent=1))
    return load_result(out_dir / f"{name}.npz")


def summary_of(res: dict) -> dict:
    """Key numbers of a suite result (summary.json, reports): {"meta": ..., <measure>: summary}."""
    reg = registry()
    return {"meta": res.get("meta", {}), **{k: reg[k].summary(v) for k, v in res.items() if k in reg}}


def temp_name(path: Path, suffix: str = "") -> Path:
    """A temporary name beside ``path``, unique to this process and thread (two analyses of one run write the same
    folders), ending in ``suffix`` (np.savez appends .npz to a name without it)."""
    path = Path(path)
    return path.with_name(f".{path.name}.{os.getpid()}-{threading.get_ident()}.tmp{suffix}")


def atomic_npz(res: dict, path: Path) -> None:
    """``save_result(res)`` to ``path`` (``<name>.npz``) through a temporary name beside it: a reader sees the old
    file or the new one, never half of one."""
    tmp = temp_name(path.with_suffix(""), ".npz")
    try:
        save_result(res, tmp)
        tmp.replace(path)
    finally:
        tmp.unlink(missing_ok=True)


def atomic_text(path: Path, text: str) -> None:
    tmp = temp_name(path)
    try:
        tmp.write_text(text)
        tmp.replace(path)
    finally:
        tmp.unlink(missing_ok=True)


def json_cached(path: Path, key: str, compute):
    """A value a study's report stage computes once: read from the JSON file ``path`` under ``key``, else
    ``compute()``d, stored there (written atomically, the folder made) and returned. JSON-serialisable values only."""
    path = Path(path)
    cache = json.loads(path.read_text()) if path.is_file() else {}
    if key not in cache:
        cache[key] = compute()
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_text(path, json.dumps(cache, indent=1))
    return cache[key]


@contextlib.contextmanager
def folder_lock(folder: Path):
    """``fcntl.flock`` on the folder itself, for a read-merge-write of its summary.json / cache.json: two analyses
    writing one folder at once keep each other's entries."""
    fd = os.open(folder, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def write_results(res: dict, out_dir: Path, step: int | None = None, keys: dict | None = None) -> Path:
    """``<measure>.npz`` per measure, then summary.json and cache.json (merged with what is there: results of
    other measures already in the folder stay valid), each written atomically."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    reg = registry()
    for name, r in res.items():
        if name in reg:
            atomic_npz(r, out_dir / f"{name}.npz")
    with folder_lock(out_dir):
        old = read_summary(out_dir)
        if old is None:  # none yet, or unreadable: the key numbers of the other results in the folder, from their files
            others = {
                n: load_result(out_dir / f"{n}.npz")
                for n in reg
                if n not in res and (out_dir / f"{n}.npz").is_file() and readable(out_dir / f"{n}.npz")
            }
            old = {k: v for k, v in summary_of(others).items() if k != "meta"}
        atomic_text(out_dir / "summary.json", json.dumps({**old, "step": step, **summary_of(res)}, indent=1))
        cache = cached_keys(out_dir)
        for name in res:
            if name in reg:
                if keys and keys.get(name):
                    cache[name] = keys[name]
                else:
                    cache.pop(name, None)
        atomic_text(out_dir / "cache.json", json.dumps(cache, indent=1))
    return out_dir


def load_results(out_dir: Path, measures=None) -> dict:
    """A suite result read back from ``out_dir`` (the measures present there, or those named)."""
    out_dir = Path(out_dir)
    reg = registry()
    res = {"meta": (read_summary(out_dir) or {}).get("meta", {})}
    for name in measures or sorted(reg):
        f = out_dir / f"{name}.npz"
        if f.is_file():
            res[name] = load_result(f)
    return res
