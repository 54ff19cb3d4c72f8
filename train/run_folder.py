"""The run folder's lifecycle, around the training loop (``train/trainer.py``) and apart from it.

- **Naming**: :func:`run_dir_for` (``run.root / run.name``, or the recipe and its overrides sorted by key).
- **One trainer per folder**: :class:`RunLock`, an ``fcntl.flock`` on ``<run>/.lock`` held by the main process for
  its whole life (the kernel releases it when the process dies, however it dies); :func:`claim` takes it on every
  process's behalf.
- **Signals**: :class:`StopSignals` turns SIGTERM / SIGINT into a request the loop reads at the end of a step.
- **Prepare / resume**: :func:`prepare_run` decides the folder and the checkpoint to resume from, before anything is
  written; :func:`finished_summary` answers a run resumed after its final checkpoint; :func:`check_processes`
  refuses another number of processes; :func:`commit` writes ``recipe.yaml`` once every check has passed.
- **TensorBoard's events**: :func:`open_tensorboard` (purge after the checkpoint resumed from, wait until a new
  events file sorts last, the hparams of a fresh run).
- **The end**: :func:`write_result` (``result.json``, atomically); :func:`full_disk_sentence` and
  :func:`quiet_full_disk_threads` for a disk that fills up during the run.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import itertools
import json
import os
import shutil
import signal
import socket
import threading
import time
from pathlib import Path

import yaml

from train.checkpoint import list_checkpoints, resolve_resume, verify_checkpoint
from train.collective import broadcast
from train.errors import RecipeError, RunExists, RunFolderError, RunLocked
from train.recipe import Recipe, dump, flatten, resume_conflicts, run_name

LOCK_NAME = ".lock"
FULL_DISK = (errno.ENOSPC, errno.EDQUOT, errno.EROFS)

# ---------------------------------------------------------------- naming


def override_key(o: str) -> str:
    """The key of a ``--set`` override ``KEY=VALUE`` (the whole text when it has no ``=``)."""
    return o.split("=", 1)[0].strip()


def run_dir_for(recipe: Recipe, overrides=()) -> Path:
    """The run folder: ``run.root / run.name``, or ``<recipe>-<overrides>`` with the overrides sorted by key
    (stable, so a key set twice keeps its order), so ``--set a=1 b=2`` and ``--set b=2 a=1`` are the same run.
    Runs named before the sort (overrides in the order typed) keep their folder: when the sorted name does not
    exist, a folder named by another order of the same overrides is used."""
    root = Path(recipe.run.root)
    if recipe.run.name:
        return root / recipe.run.name
    named = [o for o in overrides if not o.startswith("run.")]
    canonical = root / run_name(recipe, sorted(named, key=override_key))
    if canonical.exists() or len(named) < 2:
        return canonical
    orders = itertools.permutations(named) if len(named) <= 7 else [named]  # 7! = 5040 names; beyond, the typed order
    legacy = {root / run_name(recipe, list(p)) for p in orders} - {canonical}
    found = sorted(d for d in legacy if d.is_dir())
    if len(found) > 1:
        raise RunFolderError(
            f"{', '.join(map(str, found))} were all trained with these overrides in different orders: "
            f"pass --name with the one to use."
        )
    return found[0] if found else canonical


# ---------------------------------------------------------------- the lock


class RunLock:
    """``fcntl.flock`` on ``<run>/.lock``, held by the main process for the life of the trainer. flock locks
    belong to the open file, so the kernel drops them when the process dies (kill -9 included): a dead trainer
    never blocks the next one. The file holds the holder's pid and host for the refusal message; a holder that
    releases it without having trained (a refused resume, ``--check``) puts the earlier content back, so the file
    names the last trainer that used the folder."""

    def __init__(self, run_dir: Path):
        self.run_dir = Path(run_dir)
        self.fd: int | None = None
        self.committed = False  # set once the trainer starts writing the run folder
        self._before = b""

    def acquire(self) -> None:
        path = self.run_dir / LOCK_NAME
        try:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as e:
            raise RunFolderError(
                f"run folder {self.run_dir} is not writable ({e.strerror or e}): choose another run.root "
                "(--set run.root=DIR) or make the folder writable."
            ) from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            holder = ""
            with contextlib.suppress(OSError):
                holder = os.pread(fd, 200, 0).decode(errors="replace").strip()
            os.close(fd)
            if e.errno in (errno.EAGAIN, errno.EWOULDBLOCK, errno.EACCES):
                who = f" (pid {holder})" if holder else ""
                raise RunLocked(
                    f"run folder {self.run_dir} is in use by another trainer{who}: wait for it to finish or stop it "
                    "(SIGTERM checkpoints and stops it), or pass --name NEW for another run."
                ) from None
            raise RunFolderError(
                f"run folder {self.run_dir} cannot be locked ({e.strerror or e}): put run.root on a file "
                "system that supports flock."
            ) from None
        with contextlib.suppress(OSError):
            self._before = os.pread(fd, 200, 0)
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()} on {socket.gethostname()}\n".encode(), 0)
        self.fd = fd

    def release(self) -> None:
        if self.fd is not None:
            if not self.committed:
                with contextlib.suppress(OSError):
                    os.ftruncate(self.fd, 0)
                    os.pwrite(self.fd, self._before, 0)
            os.close(self.fd)  # closing the last descriptor releases the flock
            self.fd = None


def claim(acc, lock: RunLock, create: bool) -> bool:
    """Collective: the main process takes the run folder's lock (creating the folder when ``create``; when not,
    only an existing folder is locked). Returns whether it is held; every process raises the same error."""
    err, held = None, False
    if acc.is_main_process and lock.fd is None and (create or lock.run_dir.is_dir()):
        try:
            lock.acquire()
        except RunFolderError as e:
            err = e
    if acc.is_main_process:
        held = lock.fd is not None
    err, held = broadcast(acc, (err, held))
    if err is not None:
        raise err
    return held


# ---------------------------------------------------------------- signals


class StopSignals:
    """Turns SIGTERM / SIGINT into a request to stop at the end of the current step (no KeyboardInterrupt, no
    traceback); repeated signals change nothing (SIGKILL forces). Only the main thread can install handlers."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT)
    # set by the command line (train/cli.py, as the process entry point): after the run the process only exits, so
    # these signals stay ignored rather than fatal; a repeated Ctrl-C or a launcher's second SIGTERM must not kill it
    # mid-exit and turn a clean stop into exit 143 (and accelerate launch's ChildFailedError)
    ignore_after = False

    def __init__(self):
        self.signum: int | None = None
        self._old: dict = {}

    def _handler(self, signum, frame) -> None:
        if self.signum is None:
            self.signum = signum

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            for s in self.SIGNALS:
                self._old[s] = signal.signal(s, self._handler)
                early = getattr(self._old[s], "signum", None)  # caught before the run (train.cli.EarlySignals)
                if early is not None:
                    self._handler(early, None)
        return self

    def __exit__(self, *exc) -> None:
        for s, h in self._old.items():
            signal.signal(s, signal.SIG_IGN if self.ignore_after else h)
        self._old = {}


# ---------------------------------------------------------------- prepare / resume


def prepare_run(
    recipe: Recipe, overrides=(), resume: bool | str = False, run_dir: Path | None = None
) -> tuple[Path, Path | None, dict]:
    """Decide the run folder and the checkpoint to resume from, before anything is written.

    Raises RunExists (checkpoints there, no --resume), RunFolderError (--resume with nothing to resume),
    RecipeError (resume with a different recipe), CheckpointError (a corrupted checkpoint)."""
    run_dir = run_dir or run_dir_for(recipe, overrides)
    ckpt_root = run_dir / "checkpoints"
    if not resume:
        done = list_checkpoints(ckpt_root, warn=False)
        if done:
            raise RunExists(
                f"run folder {run_dir} already holds checkpoints (latest {done[-1].name}): pass --resume to continue "
                "it, or --name NEW to start another run."
            )
        return run_dir, None, {}
    start = resolve_resume(ckpt_root, resume if isinstance(resume, str) else None, run_dir)
    if start is None:
        what = "has no complete checkpoint" if run_dir.is_dir() else "does not exist"
        raise RunFolderError(
            f"--resume: nothing to resume, {run_dir} {what}: run without --resume to start it, or pass "
            "the recipe, overrides and --name of the run to continue."
        )
    meta = verify_checkpoint(start)
    saved = run_dir / "recipe.yaml"
    keys = resume_conflicts(recipe, meta, yaml.safe_load(saved.read_text()) if saved.is_file() else None)
    if keys is not None:
        diff = f" (keys that differ: {', '.join(keys[:6])})" if keys else ""
        raise RecipeError(
            f"cannot resume {start}: it was trained with a different recipe{diff}; resume with the same recipe and "
            "overrides (cadences, train.steps, train.lr, train.warmup_steps and train.grad_clip may change), or start "
            "a new run with --name."
        )
    return run_dir, start, meta


def finished_summary(run_dir: Path, recipe: Recipe, meta: dict, main: bool) -> dict | None:
    """The summary of a run whose checkpoint ``meta`` is final and covers ``train.steps`` (None otherwise: raising
    ``train.steps`` continues it). Writes ``result.json`` when the run died after its final checkpoint."""
    if not (meta.get("final") and int(meta["step"]) >= recipe.train.steps):
        return None
    ev = meta.get("eval", {})
    summary = {
        "run_dir": str(run_dir),
        "step": meta["step"],
        "top1": ev.get("top1"),
        "eval_loss": ev.get("loss"),
        "wall_s": float(meta.get("wall_s", 0.0)),
        "num_processes": meta.get("num_processes"),
    }
    if main and not (run_dir / "result.json").is_file():
        write_result(run_dir, summary)
    return {**summary, "already_finished": True}


def check_processes(start: Path | None, meta: dict, num_processes: int, allow_change: bool) -> None:
    """RunFolderError when the checkpoint resumed from was trained with another number of processes."""
    saved = meta.get("num_processes")
    if saved is not None and saved != num_processes and not allow_change:
        raise RunFolderError(
            f"cannot resume {start} with {num_processes} process(es): it was trained with {saved}, and the global "
            f"batch and data order depend on it; launch {saved} (e.g. VITLAB_NPROC={saved}), or pass "
            "--allow-process-change to continue with the new global batch."
        )


def commit(acc, lock: RunLock, held: bool, recipe: Recipe, overrides, resume, run_dir: Path, step: int) -> None:
    """Collective, after every check that can refuse the run: lock a new folder (created only now), mark the lock as
    used, drop the events of an earlier attempt that never checkpointed, and write ``recipe.yaml``."""
    if not held:
        claim(acc, lock, create=True)
        if not resume and list_checkpoints(run_dir / "checkpoints", warn=False):  # another trainer finished meanwhile
            prepare_run(recipe, overrides, resume, run_dir)
    lock.committed = True
    if acc.is_main_process:
        try:
            if step == 0:  # an earlier attempt that died before its first checkpoint: its curve is not this run's
                shutil.rmtree(run_dir / "tb", ignore_errors=True)
                for f in run_dir.glob("events.out.tfevents.*"):
                    f.unlink()
            (run_dir / "recipe.yaml").write_text(dump(recipe))
        except OSError as e:
            raise RunFolderError(
                f"run folder {run_dir} is not writable ({e.strerror or e}): free space or make it writable."
            ) from None
    acc.wait_for_everyone()


# ---------------------------------------------------------------- TensorBoard's events files


def events_dir(run_dir: Path) -> Path:
    """Where a run's TensorBoard events files are: the run folder itself, so that TensorBoard, which names a run by
    the folder of its events files, lists ``tensorboard --logdir runs`` as ``tiny``, not ``tiny/tb``. Runs trained
    before this layout keep theirs in ``<run>/tb`` (training resumed and analyses added there too)."""
    legacy = Path(run_dir) / "tb"
    return legacy if legacy.is_dir() else Path(run_dir)


def wait_past_event_files(tb_dir: Path, limit_s: float = 2.0) -> None:
    """Wait (at most ``limit_s``) until the clock's second is past the newest events file's in ``tb_dir``.

    TensorBoard reads a run's events files in name order, and a name is ``events.out.tfevents.<second it was
    created>.<host>.<pid>.<n>``. A resumed attempt's purge of the steps after its checkpoint applies only to files
    read before its own, so its file must sort after the earlier attempts': with the same second the pid decides,
    and the killed attempt's steps would then be read after the resumed ones."""
    fields = [p.name.split(".") for p in tb_dir.rglob("events.out.tfevents.*")]
    stamps = [int(f[3]) for f in fields if len(f) > 4 and f[3].isdigit()]
    deadline = time.monotonic() + limit_s
    while stamps and int(time.time()) <= max(stamps) and time.monotonic() < deadline:
        time.sleep(0.02)


def _hparam_values(d):
    """The recipe as TensorBoard's HParams tab shows it best: booleans as true / false (an int subclass, they would
    show as 1 / 0), lists and None in YAML's flow style (``[{name: cka, every: 600}]``, not JSON); nested keys kept."""
    if isinstance(d, dict) and d:
        return {k: _hparam_values(v) for k, v in d.items()}
    if isinstance(d, bool):
        return str(d).lower()
    if isinstance(d, (int, float, str)):
        return d
    return yaml.safe_dump(d, default_flow_style=True, sort_keys=False, width=10**6).removesuffix("\n...\n").strip()


# TensorBoard's Custom Scalars tab (http://localhost:6006/#custom_scalars): the training curves first, in this order
# (the Time Series tab sorts groups by name, so there analysis/ comes before train/)
TB_LAYOUT = {
    "training": {
        "loss (train, eval, val)": ["Multiline", ["^train/loss$", "^eval/loss$", "^val/loss$"]],
        "top-1 (eval, val)": ["Multiline", ["^eval/top1$", "^val/top1$"]],
        "learning rate": ["Multiline", ["^train/lr$"]],
        "gradient norm": ["Multiline", ["^train/grad_norm$"]],
        "throughput (images/s)": ["Multiline", ["^train/throughput_img_s$"]],
        "epoch": ["Multiline", ["^train/epoch$"]],
    },
    "time (s)": {"eval, checkpoint, callbacks": ["Multiline", ["^time/"]]},
    "analysis (key numbers)": {
        "CKA mean off-diagonal": ["Multiline", ["^analysis/(.*/)?cka/mean_offdiag$"]],
    },
}


def write_hparams(writer, recipe: Recipe, extra: dict) -> None:
    """HParams into the run's own events file (SummaryWriter.add_hparams would open a second folder), and the
    Custom Scalars layout (:data:`TB_LAYOUT`)."""
    from torch.utils.tensorboard.summary import hparams  # deferred: `python -m train --check` reads no torch

    hp = flatten(_hparam_values({**recipe.to_dict(), **extra}))
    writer.add_custom_scalars(TB_LAYOUT)
    exp, ssi, sei = hparams(hp, {"eval/top1": 0.0})
    for s in (exp, ssi, sei):
        writer.file_writer.add_summary(s)


def open_tensorboard(acc, run_dir: Path, step: int, recipe: Recipe, run_info: dict):
    """Start the run's TensorBoard tracker in the run folder (:func:`events_dir`); returns its SummaryWriter (None
    off the main process).

    Events are flushed every 10 s and at every checkpoint (so a kill loses nothing before it); on resume, the events
    logged after the checkpoint are purged; a fresh run records the flattened recipe as hparams."""
    main = acc.is_main_process
    tb_kwargs = {"flush_secs": 10, **({"purge_step": step + 1} if step else {})}
    if main and step:
        wait_past_event_files(events_dir(run_dir))
    # the tracker's folder is <project dir>/<name>: "." is the run folder itself, "tb" an older run's
    acc.init_trackers(events_dir(run_dir).relative_to(run_dir).as_posix(), init_kwargs={"tensorboard": tb_kwargs})
    writer = acc.get_tracker("tensorboard", unwrap=True) if main else None
    if main and step == 0:
        write_hparams(writer, recipe, {"run": {k: v for k, v in run_info.items() if k != "interventions"}})
    return writer


# ---------------------------------------------------------------- the end


def write_result(run_dir: Path, summary: dict) -> None:
    """``result.json`` (atomically: a temporary file renamed): what marks the run finished."""
    try:
        tmp = run_dir / "result.json.tmp"
        tmp.write_text(json.dumps(summary, indent=1))
        tmp.replace(run_dir / "result.json")
    except OSError as e:
        raise RunFolderError(
            f"cannot write {run_dir / 'result.json'} ({e.strerror or e}): free space or make the folder "
            "writable, then --resume writes it."
        ) from None


def full_disk_sentence(e: OSError, run_dir: Path) -> RunFolderError | None:
    """The one sentence for a full disk met anywhere in the run (TensorBoard's events, a callback's files), naming
    the checkpoint to resume from; None for any other OSError."""
    if e.errno not in FULL_DISK:
        return None
    done = list_checkpoints(run_dir / "checkpoints", warn=False)
    keep = f"--resume continues from {done[-1].name}" if done else "no checkpoint had been written yet"
    return RunFolderError(
        f"cannot write {e.filename or run_dir} ({e.strerror}): free space in {run_dir.parent}, then {keep}."
    )


@contextlib.contextmanager
def quiet_full_disk_threads():
    """A full disk in a background writer (TensorBoard's event-file thread) prints no traceback of its own: the writer
    raises the same error in the training thread at its next write, flush or close, where the trainer turns it into
    one sentence."""
    old = threading.excepthook

    def hook(args):
        if not (isinstance(args.exc_value, OSError) and args.exc_value.errno in FULL_DISK):
            old(args)

    threading.excepthook = hook
    try:
        yield
    finally:
        threading.excepthook = old
