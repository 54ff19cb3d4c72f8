"""Atomic, verified checkpoints on top of ``accelerator.save_state``.

Layout: ``<run>/checkpoints/step_XXXXXXX/`` holding what ``save_state`` writes (``model.safetensors``,
``optimizer.bin``, ``random_states_<rank>.pkl``, ...) plus ``meta.json`` (step, epoch, recipe hash, the
sha256 of every file). A checkpoint is written into ``.staging-step_XXXXXXX`` and renamed into place once
complete, then older ones beyond ``keep_last`` are pruned, so a crash never leaves a folder that looks
complete. A write that fails (a full disk, a folder turned read-only) removes its staging folder and raises
CheckpointError on every process; the earlier checkpoints are untouched. On resume, folders without
``meta.json`` (interrupted writes) are skipped with a warning; a folder whose files do not match their recorded
checksums is an error (never silently loaded).
"""

from __future__ import annotations

import hashlib
import json
import re
import shutil
import warnings
from pathlib import Path

from train.errors import CheckpointError

STEP_RE = re.compile(r"^step_(\d{7,})$")
META = "meta.json"
# written into a checkpoint folder once the checkpoint's callbacks have finished (and TensorBoard is flushed): a
# checkpoint whose meta.json says ``marks_callbacks`` and that lacks it gets its callbacks again on --resume
CALLBACKS_DONE = "callbacks.done"


def step_dir_name(step: int) -> str:
    return f"step_{step:07d}"


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _write_error(e: Exception) -> str:
    """What a failed write says, in a few words: an OSError's strerror (and file), or the writer's own message
    (safetensors raises SafetensorError, torch.save RuntimeError, on a full disk)."""
    if isinstance(e, OSError):
        return f"{e.strerror or e}" + (f": {e.filename}" if e.filename else "")
    return " ".join(str(e).split())[:200] or type(e).__name__


def _failed_anywhere(accelerator, err: Exception | None) -> Exception | bool | None:
    """Collective: this process's error, or True when only another process failed, or None."""
    if accelerator.num_processes == 1:
        return err
    import torch  # deferred: the study launcher and `python -m train --check` list checkpoints without torch

    flag = torch.tensor([0.0 if err is None else 1.0], device=accelerator.device)
    anywhere = accelerator.reduce(flag, reduction="sum").item() > 0
    return err if err is not None else (True if anywhere else None)


def save_checkpoint(accelerator, ckpt_root: Path, step: int, meta: dict, keep_last: int) -> Path:
    """Collective: every process calls it. Returns the final folder; raises CheckpointError on every process when
    a write fails anywhere (the staging folder removed)."""
    ckpt_root = Path(ckpt_root)
    final = ckpt_root / step_dir_name(step)
    staging = ckpt_root / f".staging-{step_dir_name(step)}"
    err = None
    try:
        if accelerator.is_main_process:
            ckpt_root.mkdir(parents=True, exist_ok=True)
            if staging.exists():
                shutil.rmtree(staging)
    except OSError as e:
        err = e
    err = _failed_anywhere(accelerator, err)
    if err is None:
        try:
            accelerator.save_state(str(staging), safe_serialization=True)
        except Exception as e:  # safetensors (SafetensorError) and torch.save (RuntimeError) wrap ENOSPC
            err = e
        err = _failed_anywhere(accelerator, err)
    if err is None and accelerator.is_main_process:
        try:
            files = {p.name: sha256_file(p) for p in sorted(staging.iterdir()) if p.is_file() and p.name != META}
            tmp_meta = staging / (META + ".tmp")
            tmp_meta.write_text(json.dumps({**meta, "step": step, "files": files}, indent=1))
            tmp_meta.replace(staging / META)
            if final.exists():  # a checkpoint of the same step from an earlier, diverged attempt
                shutil.rmtree(final)
            staging.replace(final)
        except OSError as e:
            err = e
    if accelerator.num_processes > 1:
        err = _failed_anywhere(accelerator, err)
    if err is not None:
        done = list_checkpoints(ckpt_root, warn=False)
        why = _write_error(err) if isinstance(err, Exception) else "a write failed on another process"
        if not isinstance(err, OSError) and done and _disk_full(ckpt_root, done[-1]):
            why = f"No space left on device: {why}"  # torch.save says only e.g. "unexpected pos 35584 vs 35476"
        if accelerator.is_main_process:
            shutil.rmtree(staging, ignore_errors=True)
        accelerator.wait_for_everyone()
        keep = f"{done[-1].name} is intact and --resume continues from it" if done else "no earlier checkpoint exists"
        raise CheckpointError(
            f"cannot write checkpoint {final} ({why}); {keep}: free space in {ckpt_root} or make it writable."
        )
    if accelerator.is_main_process:
        prune(ckpt_root, keep_last)
    accelerator.wait_for_everyone()
    return final


def _disk_full(ckpt_root: Path, last: Path) -> bool:
    """Whether the file system of ``ckpt_root`` has less room than the last checkpoint takes (a failed write's staging
    folder still there): a writer that hides ENOSPC failed for want of space."""
    try:
        size = sum(f.stat().st_size for f in last.iterdir() if f.is_file())
        return shutil.disk_usage(ckpt_root).free < size
    except OSError:
        return False


def prune(ckpt_root: Path, keep_last: int) -> None:
    complete = list_checkpoints(ckpt_root, warn=False)
    for p in complete[:-keep_last] if keep_last > 0 else []:
        shutil.rmtree(p, ignore_errors=True)


def list_checkpoints(ckpt_root: Path, warn: bool = True) -> list[Path]:
    """Complete checkpoints (a step folder with meta.json), oldest first; warns about incomplete ones."""
    ckpt_root = Path(ckpt_root)
    if not ckpt_root.is_dir():
        return []
    out = []
    for p in sorted(ckpt_root.iterdir()):
        m = STEP_RE.match(p.name)
        if p.is_dir() and m and (p / META).is_file():
            out.append(p)
        elif warn and p.is_dir() and (m or p.name.startswith(".staging-")):
            warnings.warn(
                f"skipping checkpoint folder {p}: its write was interrupted (no {META}); it can be deleted.",
                stacklevel=2,
            )
    return sorted(out, key=lambda p: int(STEP_RE.match(p.name).group(1)))


# The keys of meta.json that code reads without looking twice, and what each must be (step: required). Its checksums
# guard every other file of a checkpoint; meta.json itself (which holds them) is checked against these types instead.
_META_TYPES: dict[str, tuple[type, ...]] = {
    "step": (int,),
    "files": (dict,),
    "final": (bool,),
    "epoch": (int,),
    "wall_s": (int, float),
    "compile_s": (int, float),
    "num_processes": (int,),
    "eval": (dict, type(None)),
    "val": (dict, type(None)),
    "log_window": (dict, type(None)),
    "marks_callbacks": (bool,),
    "recipe_hash": (str,),
    "resume_hash": (str,),
}


def _meta_problem(meta) -> str | None:
    """What is wrong with a parsed meta.json (see :data:`_META_TYPES`), in a few words, or None."""
    if not isinstance(meta, dict):
        return f"it holds a JSON {type(meta).__name__}, not an object"
    if "step" not in meta:
        return "it has no 'step'"
    for key, types in _META_TYPES.items():
        v = meta.get(key)
        if key in meta and (not isinstance(v, types) or (isinstance(v, bool) and bool not in types)):
            return f"its '{key}' is {json.dumps(v)[:40]}, not {' or '.join(_JSON_NAMES[t] for t in types)}"
    if meta["step"] < 0:
        return f"its 'step' is {meta['step']}, below 0"
    return None


_JSON_NAMES = {int: "an integer", float: "a number", bool: "true or false", dict: "an object", str: "a string",
               type(None): "null"}  # fmt: skip


def read_meta(path: Path) -> dict:
    """The checkpoint's meta.json; CheckpointError (one sentence naming the file) when it cannot be read or is not
    what vitlab writes (a JSON list, a step that is not an integer, ...)."""
    f = Path(path) / META
    try:
        meta = json.loads(f.read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(
            f"checkpoint {path} has an unreadable {META} ({type(e).__name__}): delete the folder to resume from an "
            "earlier checkpoint."
        ) from None
    why = _meta_problem(meta)
    if why:
        raise CheckpointError(
            f"{f} is malformed ({why}): it was edited or not written by vitlab; restore it, or delete the folder to "
            "resume from an earlier checkpoint."
        )
    return meta


def verify_checkpoint(path: Path) -> dict:
    """Check every file against the sha256 recorded at save time; return the meta dict."""
    path = Path(path)
    meta = read_meta(path)
    files = meta.get("files")
    if not isinstance(files, dict) or not files:
        raise CheckpointError(
            f"checkpoint {path} lists no files in its {META}: it was not written by vitlab; delete it or pass another."
        )
    for name, digest in files.items():
        f = path / name
        if not f.is_file():
            raise CheckpointError(
                f"checkpoint {path} is corrupted ({name} is missing): delete the folder to resume from an earlier "
                "checkpoint."
            )
        if sha256_file(f) != digest:
            raise CheckpointError(
                f"checkpoint {path} is corrupted ({name} does not match its recorded checksum): delete the folder to "
                "resume from an earlier checkpoint."
            )
    return meta


def mark_callbacks_done(path: Path) -> None:
    """Main process, after every process has finished the checkpoint's callbacks: record it (:data:`CALLBACKS_DONE`)."""
    (Path(path) / CALLBACKS_DONE).touch()


def callbacks_done(path: Path, meta: dict) -> bool:
    """Whether the callbacks of the checkpoint at ``path`` finished: its marker is there, or it was written before
    checkpoints recorded it (no ``marks_callbacks`` in its meta.json: nothing to tell, so nothing is run again)."""
    return not meta.get("marks_callbacks") or (Path(path) / CALLBACKS_DONE).is_file()


def resolve_resume(ckpt_root: Path, explicit: str | None, run_dir: Path | None = None) -> Path | None:
    """The checkpoint to resume: ``explicit`` (a checkpoint folder, or this run's own folder) if given, else the
    latest complete one, else None."""
    if explicit:
        p = Path(explicit)
        if not p.is_dir():
            p2 = Path(ckpt_root) / explicit
            if not p2.is_dir():
                raise CheckpointError(
                    f"--resume {explicit}: no such checkpoint folder; pass a path like "
                    f"{Path(ckpt_root) / 'step_0000500'}."
                )
            p = p2
        if not (p / META).is_file() and (p / "checkpoints").is_dir():  # a run folder, not a checkpoint
            if run_dir is not None and p.resolve() == Path(run_dir).resolve():
                return resolve_resume(ckpt_root, None)
            raise CheckpointError(
                f"--resume {explicit} is a run folder, not a checkpoint: pass --resume alone with that run's "
                f"recipe and overrides (or --name {p.name}), or one of its checkpoints, e.g. "
                f"{p / 'checkpoints' / 'step_0000500'}."
            )
        return p
    complete = list_checkpoints(ckpt_root)
    return complete[-1] if complete else None


def read_weights(path: Path, prefix: str = "") -> tuple[dict, Path]:
    """The tensors of ``model.safetensors`` in a checkpoint folder (or of a .safetensors file) and the file read.
    With ``prefix`` (a network's key prefix in an objective's checkpoint, e.g. ``teacher_backbone.``: see
    ``Objective.parts`` in train/objectives), only the tensors under it, the prefix stripped."""
    from safetensors.torch import load_file  # deferred: as torch above (safetensors.torch imports torch)

    path = Path(path)
    f = path / "model.safetensors" if path.is_dir() else path
    if not f.is_file():
        raise CheckpointError(f"no weights at {f}: pass a checkpoint folder (step_XXXXXXX) or a .safetensors file.")
    try:
        state = load_file(str(f))
    except Exception as e:  # a truncated or foreign file
        raise CheckpointError(
            f"weights file {f} cannot be read ({type(e).__name__}): it is corrupted or not a safetensors file."
        ) from None
    if prefix:
        state = {k[len(prefix) :]: v for k, v in state.items() if k.startswith(prefix)}
        if not state:
            raise _no_part(f, prefix)
    return state, f


def fit_report(own: dict, state: dict) -> str:
    """What keeps ``state`` from loading into a model whose state_dict is ``own``: counts and one example each."""
    missing = [k for k in own if k not in state]
    unexpected = [k for k in state if k not in own]
    shapes = [k for k in own if k in state and tuple(own[k].shape) != tuple(state[k].shape)]
    parts = [
        f"{len(v)} {what} (e.g. {v[0]}{detail(v[0])})"
        for v, what, detail in (
            (missing, "tensors missing", lambda k: ""),
            (unexpected, "unexpected tensors", lambda k: ""),
            (
                shapes,
                "of other shapes",
                lambda k: f": {tuple(state[k].shape)} in the file, {tuple(own[k].shape)} in the model",
            ),
        )
        if v
    ]
    return "; ".join(parts)


def _no_part(f: Path, prefix: str) -> CheckpointError:
    return CheckpointError(
        f"weights in {f} hold no tensors under '{prefix}': the checkpoint's meta.json names parts that "
        "its model.safetensors does not have, so it was not written by this objective."
    )


def _misfit(f: Path, why: str) -> CheckpointError:
    return CheckpointError(
        f"weights in {f} do not fit this model ({why or 'load_state_dict refused them'}): check that the "
        "recipe's model section matches the run that wrote them."
    )


def load_weights(model, path: Path, strict: bool = True, prefix: str = "") -> None:
    """Load ``model.safetensors`` of a checkpoint folder (or a .safetensors file) into ``model``; ``prefix``: the
    network under that key prefix (:func:`read_weights`)."""
    state, f = read_weights(path, prefix)
    try:
        model.load_state_dict(state, strict=strict)
    except RuntimeError:
        raise _misfit(f, fit_report(model.state_dict(), state)) from None


def check_weights_fit(own: dict, path: Path, prefix: str = "") -> None:
    """CheckpointError (as :func:`load_weights` would raise) unless the tensors of ``model.safetensors`` in a checkpoint
    folder fit a model whose state_dict is ``own`` (e.g. of a model built on the meta device): names and shapes, read
    from the file's header only, so every checkpoint can be checked before any is loaded. A file that cannot be read
    is left to :func:`read_weights` to report."""
    import torch
    from safetensors import safe_open

    f = Path(path) / "model.safetensors"
    try:
        with safe_open(str(f), "pt") as sf:
            state = {
                k[len(prefix) :]: torch.empty(sf.get_slice(k).get_shape(), device="meta")
                for k in sf.keys()  # noqa: SIM118 (a safetensors file handle is not iterable)
                if k.startswith(prefix)
            }
    except Exception:  # truncated or foreign: read_weights says so when it is loaded
        return
    if prefix and not state:
        raise _no_part(f, prefix)
    why = fit_report(own, state)
    if why:
        raise _misfit(f, why)
