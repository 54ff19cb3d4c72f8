"""The Accelerate training loop: recipe -> data -> model -> steps -> eval, checkpoints, callbacks, TensorBoard.

Exact resume: the data order of epoch e comes from (seed, e) alone (:class:`train.data.EpochBatchSampler`),
torch's RNG is reseeded from (seed, step, rank) before every optimizer step (augmentation, dropout), and the
learning rate is a pure function of the step, so N steps + resume + N steps equals 2N steps bit for bit. The
logged curve is too: ``train/loss`` at step k is the mean over steps (k - log_every, k] whatever the stops in
between (a checkpoint keeps the sums of its unfinished window), and TensorBoard events logged after the
checkpoint a run resumes from are purged (a fresh start drops the events of an attempt that never checkpointed).

One trainer per run folder: the main process holds an ``fcntl.flock`` on ``<run>/.lock`` for its whole life
(the kernel releases it when the process dies, however it dies). SIGTERM / SIGINT stop the run cleanly at
the end of the current step, on every process at the same step, with a checkpoint of that step.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import itertools
import json
import math
import os
import shutil
import signal
import socket
import sys
import threading
import time
from pathlib import Path

import timm.optim
import torch
import torch.nn.functional as F
import yaml
from accelerate import Accelerator
from accelerate.utils import ProjectConfiguration, broadcast_object_list, set_seed
from torch.utils.tensorboard.summary import hparams
from torchmetrics.classification import MulticlassAccuracy
from tqdm.auto import tqdm

from interventions import describe
from train import init_from
from train.callbacks import TrainContext, build_callbacks
from train.checkpoint import CheckpointError, list_checkpoints, resolve_resume, save_checkpoint, verify_checkpoint
from train.data import EpochBatchSampler, augment, batch_collate, build_data
from train.knn import knn_monitor
from train.models import build_model
from train.objectives import build_objective, uses_labels
from train.recipe import Recipe, RecipeError, dump, flatten, resume_conflicts, run_name
from train.seeding import reseed_step, step_seed  # noqa: F401  (step_seed: re-exported for callers of train.trainer)


class TrainingDiverged(RuntimeError):
    """The loss or gradient became NaN/inf; training stopped without writing a checkpoint."""


class RunFolderError(RuntimeError):
    """The run folder cannot be used as asked (in use, not writable, nothing to resume, ...); one sentence."""


class RunExists(RunFolderError):
    """The run folder already holds checkpoints and --resume was not given."""


class RunLocked(RunFolderError):
    """Another live trainer holds the run folder's lock."""


class TrainingStopped(RuntimeError):
    """SIGTERM / SIGINT: the run stopped cleanly at ``step`` (checkpointed); the message is the one line to print."""

    def __init__(self, message: str, step: int):
        super().__init__(message)
        self.step = step


LOCK_NAME = ".lock"


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
        return self

    def __exit__(self, *exc) -> None:
        for s, h in self._old.items():
            signal.signal(s, signal.SIG_IGN if self.ignore_after else h)
        self._old = {}


def _broadcast(acc, value):
    """The main process's ``value`` on every process."""
    if acc.num_processes == 1:
        return value

    return broadcast_object_list([value])[0]


def _any(acc, flag: bool) -> bool:
    """True on every process when ``flag`` is true on any."""
    if acc.num_processes == 1:
        return flag
    t = torch.tensor([1.0 if flag else 0.0], device=acc.device)
    return bool(acc.reduce(t, reduction="sum").item() > 0)


def lr_at(step: int, t) -> float:
    """Learning rate of optimizer step ``step`` (0-based): linear warm-up from lr/warmup to lr over
    ``warmup_steps`` (at most ``steps``), then cosine or linear decay to ``min_lr`` at ``steps`` (or constant)."""
    warmup = min(t.warmup_steps, t.steps)
    if warmup and step < warmup:
        return t.lr * (step + 1) / warmup
    if t.schedule == "constant":
        return t.lr
    progress = min(1.0, (step - warmup) / max(1, t.steps - warmup))
    if t.schedule == "cosine":
        return t.min_lr + (t.lr - t.min_lr) * 0.5 * (1.0 + math.cos(math.pi * progress))
    return t.min_lr + (t.lr - t.min_lr) * (1.0 - progress)


def _cpu_threads(acc) -> None:
    """``accelerate launch`` sets OMP_NUM_THREADS=1 on CPU unless told otherwise, which halves the speed of a
    2-core machine. On CPU, give each local process an equal share of the cores this process may use, unless
    VITLAB_THREADS says how many."""
    if acc.device.type != "cpu":
        return
    want = os.environ.get("VITLAB_THREADS")
    if want is None and os.environ.get("OMP_NUM_THREADS") not in (None, "1"):
        return  # the user chose a thread count
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    local = int(os.environ.get("LOCAL_WORLD_SIZE", acc.num_processes if acc.num_processes > 1 else 1))
    n = int(want) if want else max(1, cores // max(1, local))
    if n != torch.get_num_threads():
        torch.set_num_threads(n)


def make_accelerator(recipe: Recipe, run_dir: Path | None = None, log: bool = True):

    kwargs = {}
    if run_dir is not None and log:
        kwargs = {
            "log_with": "tensorboard",
            "project_config": ProjectConfiguration(project_dir=str(run_dir), logging_dir=str(run_dir)),
        }
    acc = Accelerator(mixed_precision=recipe.train.mixed_precision, step_scheduler_with_optimizer=False, **kwargs)
    _cpu_threads(acc)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if acc.num_processes != world:
        raise RuntimeError(
            f"accelerate sees {acc.num_processes} process(es) but WORLD_SIZE is {world}: on CPU launch with "
            "ACCELERATE_USE_CPU=true accelerate launch --multi_gpu --num_processes N (see README)."
        )
    return acc


def eval_loader(split, batch_size: int, num_workers: int = 0):

    return torch.utils.data.DataLoader(
        split.dataset(), batch_size=batch_size, shuffle=False, num_workers=num_workers, collate_fn=batch_collate
    )


@torch.no_grad()
def evaluate(accelerator, model, loader, data, num_classes: int) -> dict:
    """Top-1 and loss over the whole eval split, exact under any number of processes
    (``gather_for_metrics`` drops the padding that evens out the last batch)."""

    was_training = model.training
    model.eval()
    metric = MulticlassAccuracy(num_classes=num_classes, average="micro", sync_on_compute=False).to(accelerator.device)
    loss_sum, n = 0.0, 0
    for x, y in loader:
        logits = model(data.normalize(x)).float()
        logits, y = accelerator.gather_for_metrics((logits, y))
        metric.update(logits, y)
        loss_sum += F.cross_entropy(logits, y, reduction="sum").item()
        n += len(y)
    model.train(was_training)
    return {"top1": float(metric.compute()), "loss": loss_sum / max(n, 1), "n": n}


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


def _write_hparams(writer, recipe: Recipe, extra: dict) -> None:
    """HParams into the run's own events file (SummaryWriter.add_hparams would open a second folder), and the
    Custom Scalars layout (:data:`TB_LAYOUT`)."""

    hp = flatten(_hparam_values({**recipe.to_dict(), **extra}))
    exp, ssi, sei = hparams(hp, {"eval/top1": 0.0})
    for s in (exp, ssi, sei):
        writer.file_writer.add_summary(s)
    writer.add_custom_scalars(TB_LAYOUT)


def _override_key(o: str) -> str:
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
    canonical = root / run_name(recipe, sorted(named, key=_override_key))
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


def prepare_run(
    recipe: Recipe, overrides=(), resume: bool | str = False, run_dir: Path | None = None
) -> tuple[Path, Path | None, dict]:
    """Decide the run folder and the checkpoint to resume from, before anything is written.

    Raises RunExists (checkpoints there, no --resume), RunFolderError (--resume with nothing to resume),
    RecipeError (resume with a different recipe), CheckpointError (a corrupted checkpoint)."""
    run_dir = run_dir or run_dir_for(recipe, overrides)
    ckpt_root = run_dir / "checkpoints"
    start, meta = None, {}
    if not resume:
        if list_checkpoints(ckpt_root, warn=False):
            last = list_checkpoints(ckpt_root, warn=False)[-1].name
            raise RunExists(
                f"run folder {run_dir} already holds checkpoints (latest {last}): pass --resume to continue it, or --name NEW to start another run."
            )
    else:
        start = resolve_resume(ckpt_root, resume if isinstance(resume, str) else None, run_dir)
        if start is None:
            what = "has no complete checkpoint" if run_dir.is_dir() else "does not exist"
            raise RunFolderError(
                f"--resume: nothing to resume, {run_dir} {what}: run without --resume to start it, or pass "
                "the recipe, overrides and --name of the run to continue."
            )
        if start is not None:
            meta = verify_checkpoint(start)
            saved = run_dir / "recipe.yaml"
            keys = resume_conflicts(recipe, meta, yaml.safe_load(saved.read_text()) if saved.is_file() else None)
            if keys is not None:
                diff = f" (keys that differ: {', '.join(keys[:6])})" if keys else ""
                raise RecipeError(
                    f"cannot resume {start}: it was trained with a different recipe{diff}; resume with the same recipe and overrides "
                    "(cadences, train.steps, train.lr, train.warmup_steps and train.grad_clip may change), or start a new run with --name."
                )
    return run_dir, start, meta


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


def train(
    recipe: Recipe,
    overrides=(),
    resume: bool | str = False,
    progress: bool = True,
    allow_process_change: bool = False,
    stop_after: int | None = None,
) -> dict:
    """Train ``recipe``; return a summary dict (final step, eval top-1, wall time, run folder).

    Raises TrainingStopped after a clean stop on SIGTERM / SIGINT (the current step checkpointed), and after step
    ``stop_after`` when given (checkpointed there; the schedule is the recipe's, so ``--resume`` continues exactly as if
    the run had not stopped: the study's go/no-go check trains a pilot to its second checkpoint this way)."""
    t_start = time.perf_counter()
    run_dir = run_dir_for(recipe, overrides)
    lock = RunLock(run_dir)
    closing: list = []  # _train's callbacks' on_close, for an exit it did not plan (an exception from anywhere)
    with StopSignals() as stop, _quiet_full_disk_threads():
        try:
            return _train(
                recipe,
                overrides,
                resume,
                progress,
                allow_process_change,
                run_dir,
                lock,
                stop,
                t_start,
                stop_after,
                closing,
            )
        except OSError as e:  # a full disk (TensorBoard's events, a callback's files): the checkpoints written stay
            if e.errno not in FULL_DISK:
                raise
            done = list_checkpoints(run_dir / "checkpoints", warn=False)
            keep = f"--resume continues from {done[-1].name}" if done else "no checkpoint had been written yet"
            raise RunFolderError(
                f"cannot write {e.filename or run_dir} ({e.strerror}): free space in {run_dir.parent}, then {keep}."
            ) from None
        finally:
            for close in closing:  # a no-op when the run already closed its callbacks
                try:
                    close()
                except Exception as e:  # never hide the exception that ended the run
                    print(
                        f"warning: a callback failed while closing ({type(e).__name__}: {e}).",
                        file=sys.stderr,
                        flush=True,
                    )
            lock.release()


FULL_DISK = (errno.ENOSPC, errno.EDQUOT, errno.EROFS)


@contextlib.contextmanager
def _quiet_full_disk_threads():
    """A full disk in a background writer (TensorBoard's event-file thread) prints no traceback of its own: the writer
    raises the same error in the training thread at its next write, flush or close, where :func:`train` turns it into
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


def _locked(acc, lock: RunLock, create: bool) -> bool:
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
    err, held = _broadcast(acc, (err, held))
    if err is not None:
        raise err
    return held


def _write_result(run_dir: Path, summary: dict) -> None:
    try:
        tmp = run_dir / "result.json.tmp"
        tmp.write_text(json.dumps(summary, indent=1))
        tmp.replace(run_dir / "result.json")
    except OSError as e:
        raise RunFolderError(
            f"cannot write {run_dir / 'result.json'} ({e.strerror or e}): free space or make the folder "
            "writable, then --resume writes it."
        ) from None


def _train(
    recipe,
    overrides,
    resume,
    progress,
    allow_process_change,
    run_dir,
    lock,
    stop,
    t_start,
    stop_after=None,
    closing: list | None = None,
) -> dict:

    callbacks = build_callbacks(recipe.callbacks)  # option errors before anything is written
    acc = make_accelerator(recipe, run_dir)
    main = acc.is_main_process
    # an existing folder is locked before its checkpoints are read (so a second trainer hears "in use")
    held = _locked(acc, lock, create=False)
    run_dir, start_ckpt, start_meta = prepare_run(recipe, overrides, resume, run_dir)
    wall_before = float(start_meta.get("wall_s", 0.0))
    if start_meta.get("final") and int(start_meta["step"]) >= recipe.train.steps:  # train.steps raised: the run goes on
        ev = start_meta.get("eval", {})
        summary = {
            "run_dir": str(run_dir),
            "step": start_meta["step"],
            "top1": ev.get("top1"),
            "eval_loss": ev.get("loss"),
            "wall_s": wall_before,
            "num_processes": start_meta.get("num_processes"),
        }
        if main and not (run_dir / "result.json").is_file():  # the run died after its final checkpoint
            _write_result(run_dir, summary)
        return {**summary, "already_finished": True}
    saved_procs = start_meta.get("num_processes")
    if saved_procs is not None and saved_procs != acc.num_processes and not allow_process_change:
        raise RunFolderError(
            f"cannot resume {start_ckpt} with {acc.num_processes} process(es): it was trained with {saved_procs}, and the "
            f"global batch and data order depend on it; launch {saved_procs} (e.g. VITLAB_NPROC={saved_procs}), or pass "
            "--allow-process-change to continue with the new global batch."
        )
    t = recipe.train

    set_seed(recipe.seed)
    data = build_data(recipe)
    callbacks.validate(recipe, data)
    labelled = uses_labels(recipe)
    # an objective without labels trains a backbone without classifier head: its output is the pooled features
    backbone = build_model(recipe, data.num_classes if labelled else 0)
    objective = build_objective(recipe, backbone, data.num_classes)
    # fine-tuning / linear evaluation: a fresh start loads train.init_from (not a resume), the frozen backbone stays
    # frozen
    init_record = init_from.apply(recipe, objective, start_meta if start_ckpt is not None else None)
    model = objective.trained_module()  # the backbone (supervised) or the objective holding it and its own parts

    opt = timm.optim.create_optimizer_v2(model, opt="adamw", lr=t.lr, weight_decay=t.weight_decay, betas=tuple(t.betas))
    sampler = EpochBatchSampler(len(data.train), t.batch_size, recipe.seed, acc.process_index, acc.num_processes)
    # a lazy train split decodes (and random-resized-crops, seeded by (seed, epoch, index)) in the workers; the
    # sampler's EpochBatch carries the epoch there, so order and crops are functions of (seed, epoch) alone
    train_loader = torch.utils.data.DataLoader(
        data.train.dataset(),
        batch_sampler=sampler,
        num_workers=recipe.data.num_workers,
        collate_fn=batch_collate,
        generator=sampler.generator,
        pin_memory=acc.device.type == "cuda",
        persistent_workers=False,
        prefetch_factor=4 if data.train.lazy and recipe.data.num_workers > 0 else None,
    )
    ev_loader = eval_loader(data.eval, t.eval_batch_size, recipe.data.num_workers)
    # the k-NN monitor's memory bank (objectives without labels): the probe-train split, unaugmented
    bank_loader = (
        None if labelled else acc.prepare(eval_loader(data.probe_train, t.eval_batch_size, recipe.data.num_workers))
    )
    model, opt, ev_loader = acc.prepare(model, opt, ev_loader)
    # data.val_size > 0: the held-out validation split, evaluated at every evaluation exactly as the eval split
    val_loader = (
        acc.prepare(eval_loader(data.val, t.eval_batch_size, recipe.data.num_workers)) if data.val is not None else None
    )

    step = 0
    if start_ckpt is not None:
        try:
            acc.load_state(str(start_ckpt))
        except Exception as e:
            raise CheckpointError(
                f"checkpoint {start_ckpt} cannot be loaded into this model ({type(e).__name__}: {str(e)[:160]})."
            ) from None
        step = int(start_meta["step"])

    if not held:  # a new folder: created and locked only now, after every check that can refuse the run
        _locked(acc, lock, create=True)
        if not resume and list_checkpoints(run_dir / "checkpoints", warn=False):  # another trainer finished in between
            prepare_run(recipe, overrides, resume, run_dir)
    lock.committed = True  # every check passed: this trainer uses the folder from here on
    if main:
        try:
            if step == 0 and (run_dir / "tb").exists():
                # an earlier attempt that died before its first checkpoint: its curve is not this run's
                shutil.rmtree(run_dir / "tb")
            (run_dir / "recipe.yaml").write_text(dump(recipe))
        except OSError as e:
            raise RunFolderError(
                f"run folder {run_dir} is not writable ({e.strerror or e}): free space or make it writable."
            ) from None
    acc.wait_for_everyone()
    # flush every 10 s and at every checkpoint (so a kill loses nothing before it); on resume, drop events logged
    # after the checkpoint
    tb_kwargs = {"flush_secs": 10, **({"purge_step": step + 1} if step else {})}
    if main and step:
        wait_past_event_files(run_dir / "tb")
    acc.init_trackers("tb", init_kwargs={"tensorboard": tb_kwargs})
    writer = acc.get_tracker("tensorboard", unwrap=True) if main else None
    global_batch = t.batch_size * t.grad_accum * acc.num_processes
    run_info = {
        "recipe_hash": recipe.hash(),
        "resume_hash": recipe.resume_hash(),
        "interventions": describe(recipe),
        "data": data.meta,
        "num_processes": acc.num_processes,
        "global_batch": global_batch,
        "num_classes": data.num_classes,
        "torch_threads": torch.get_num_threads(),
        "objective": objective.describe(),
        **({"init_from": init_record} if init_record else {}),
    }
    if main and step == 0:
        _write_hparams(writer, recipe, {"run": {k: v for k, v in run_info.items() if k != "interventions"}})

    def log(values: dict, at: int) -> None:
        acc.log({k: float(v) for k, v in values.items()}, step=at)

    unwrapped = objective.network  # what callbacks measure: the backbone (the student of a self-distillation)
    ctx = TrainContext(acc, unwrapped, recipe, data, run_dir, step=step, writer=writer, log=log)
    if closing is not None:
        closing.append(lambda: callbacks.on_close(ctx))
    cb_time = callbacks.on_train_start(ctx)
    if cb_time:
        log({"time/callbacks_s": cb_time}, step)

    G, bpe = t.grad_accum, sampler.batches_per_epoch()
    aug = recipe.data.augment
    batch_rrc = aug.random_resized_crop and not data.train.lazy  # lazy splits were cropped per image in the workers
    last_eval: dict = start_meta.get("eval") or {}
    last_val: dict = start_meta.get("val") or {}
    interval = {"loss": 0.0, "n": 0, "time": 0.0, "images": 0, "terms": {}}
    window = start_meta.get("log_window")
    if window and len(window["loss"]) == acc.num_processes:  # the unfinished log window of the checkpoint
        mine = acc.process_index
        interval = {
            "loss": torch.tensor(window["loss"][mine], dtype=torch.float32, device=acc.device),
            "n": window["n"],
            "time": window["time"],
            "images": window["images"],
            "terms": {
                k: torch.tensor(v[mine], dtype=torch.float32, device=acc.device)
                for k, v in window.get("terms", {}).items()
            },
        }
    last_saved = step if start_ckpt is not None else -1
    bar = None
    if progress and main:
        bar = tqdm(total=t.steps, initial=step, desc=run_dir.name, dynamic_ncols=True)

    def checkpoint(final: bool) -> float:
        """Save, then run the checkpoint callbacks; returns the seconds spent in callbacks."""
        nonlocal last_saved
        t0 = time.perf_counter()
        window = None
        if interval["n"]:  # each process's loss sum of the unfinished log window, so a resume logs the same mean
            mine = torch.as_tensor(interval["loss"], dtype=torch.float32, device=acc.device).reshape(1)
            sums = acc.gather(mine) if acc.num_processes > 1 else mine
            window = {
                "loss": [float(v) for v in sums.cpu()],
                "n": interval["n"],
                "time": interval["time"],
                "images": interval["images"],
                "terms": {},
            }
            for k, v in sorted(interval["terms"].items()):  # the objective's terms, likewise per process
                v = torch.as_tensor(v, dtype=torch.float32, device=acc.device).reshape(1)
                window["terms"][k] = [float(u) for u in (acc.gather(v) if acc.num_processes > 1 else v).cpu()]
        meta = {
            **run_info,
            "epoch": (step * G) // bpe,
            "final": final,
            "eval": last_eval,
            "time": time.time(),
            "wall_s": wall_before + time.perf_counter() - t_start,
            "log_window": window,
            **({"val": last_val} if val_loader is not None else {}),
        }  # what checkpoint selection reads (not eval: test)
        path = save_checkpoint(acc, run_dir / "checkpoints", step, meta, t.keep_last)
        last_saved = step
        log({"time/checkpoint_s": time.perf_counter() - t0}, step)
        ctx.step, ctx.checkpoint_dir = step, path
        return callbacks.on_checkpoint(ctx)

    def run_eval() -> None:
        nonlocal last_eval, last_val
        t0 = time.perf_counter()
        if labelled:
            last_eval = evaluate(acc, model, ev_loader, data, data.num_classes)
            logged = {"eval/top1": last_eval["top1"], "eval/loss": last_eval["loss"]}
            if val_loader is not None:
                last_val = evaluate(acc, model, val_loader, data, data.num_classes)
                logged.update({"val/top1": last_val["top1"], "val/loss": last_val["loss"]})
        else:  # no classifier: k-NN top-1 of the backbone's features (DINO's monitor)
            last_eval = knn_monitor(acc, unwrapped, bank_loader, ev_loader, data.normalize, data.num_classes)
            logged = {"eval/knn_top1": last_eval["top1"]}
            if val_loader is not None:  # the held-out images as k-NN queries: what checkpoint selection may read
                last_val = knn_monitor(acc, unwrapped, bank_loader, val_loader, data.normalize, data.num_classes)
                logged["val/knn_top1"] = last_val["top1"]
        log({**logged, "time/eval_s": time.perf_counter() - t0}, step)  # both splits' time

    def close() -> None:
        callbacks.on_close(ctx)  # background work (figures) lands before TensorBoard closes
        if bar is not None:
            bar.close()
        acc.end_training()  # closes (and flushes) TensorBoard

    def diverged(at: int, what: str) -> None:
        """Stop without writing a checkpoint; name the last good one. Every rank sees the same value (grad
        norm / reduced loss), so every rank stops here together."""
        done = list_checkpoints(run_dir / "checkpoints", warn=False)
        keep = f"the last good checkpoint is {done[-1]}" if done else "no checkpoint had been written yet"
        close()
        raise TrainingDiverged(
            f"training diverged at step {at}: {what} ({keep}); start a new run (--name NEW) with a lower "
            "train.lr, more train.warmup_steps or a train.grad_clip."
        )

    def stop_if_asked() -> None:
        """Collective: on SIGTERM / SIGINT to any process, every process checkpoints this step and stops. With several
        processes the agreement (an all-reduce and a host sync) is made every ``log_every`` steps and at the last
        step, not every step, so the training loop's hot path does not wait on it."""
        if acc.num_processes > 1 and step % t.log_every and step != t.steps:
            return
        if not _any(acc, stop.signum is not None):
            return
        if last_saved != step and step > 0:
            cb_dt = checkpoint(step == t.steps)
            if cb_dt:
                log({"time/callbacks_s": cb_dt}, step)
        close()
        if step == 0:
            raise TrainingStopped(
                "stopped before the first step; nothing was trained (run the same command to start).", step
            )
        raise TrainingStopped(f"stopped at step {step}; --resume continues", step)

    def stop_if_reached() -> None:
        """``stop_after``: every process reaches the same step, so every process stops there together."""
        if stop_after is None or step < stop_after or step >= t.steps:
            return
        if last_saved != step and step > 0:
            cb_dt = checkpoint(False)
            if cb_dt:
                log({"time/callbacks_s": cb_dt}, step)
        close()
        raise TrainingStopped(
            f"stopped after step {step} as asked (stop after step {stop_after}); --resume continues", step
        )

    model.train()
    stop_if_asked()
    stop_if_reached()
    while step < t.steps:
        micro = step * G
        epoch, offset = divmod(micro, bpe)
        sampler.set_epoch(epoch, offset)
        it = iter(train_loader)
        while step < t.steps:
            t0 = time.perf_counter()
            reseed_step(recipe.seed, step, acc.process_index)
            lr = lr_at(step, t)
            for g in opt.param_groups:
                g["lr"] = lr
            loss_acc = 0.0
            exhausted = False
            for k in range(G):
                try:
                    x, y = next(it)
                except StopIteration:  # epoch boundary inside an accumulation window
                    epoch += 1
                    sampler.set_epoch(epoch, 0)
                    it = iter(train_loader)
                    x, y = next(it)
                    exhausted = True
                x = x.to(acc.device, non_blocking=True)
                y = y.to(acc.device, non_blocking=True)
                x = data.normalize(
                    augment(x, aug.shift, aug.hflip, batch_rrc, aug.randaugment_ops, aug.randaugment_magnitude)
                )
                sync = contextlib.nullcontext() if k == G - 1 else acc.no_sync(model)
                with sync:
                    loss, terms = objective.loss(model, x, y, step)
                    acc.backward(loss / G)
                loss_acc += loss.detach()
                for name, v in terms.items():
                    interval["terms"][name] = interval["terms"].get(name, 0.0) + v.detach().float() / G
            max_norm = t.grad_clip if t.grad_clip > 0 else float("inf")
            grad_norm = acc.clip_grad_norm_(model.parameters(), max_norm)
            if recipe.train.mixed_precision != "fp16" and not torch.isfinite(grad_norm):
                diverged(step + 1, f"the loss/gradient became {float(grad_norm)}")
            opt.step()
            opt.zero_grad(set_to_none=True)
            step += 1
            objective.after_step(step)
            interval["loss"] += loss_acc / G
            interval["n"] += 1
            interval["time"] += time.perf_counter() - t0
            interval["images"] += global_batch
            if bar is not None:
                bar.update(1)

            # windows end at multiples of log_every (and at the last step): a logged value covers (k - log_every, k]
            if step % t.log_every == 0 or step == t.steps:
                mean_loss = acc.reduce(interval["loss"] / interval["n"], reduction="mean")
                if not torch.isfinite(mean_loss):
                    diverged(step, f"the mean loss became {float(mean_loss)}")
                ips = interval["images"] / max(interval["time"], 1e-9)
                terms = {
                    f"train/{name}": acc.reduce(v / interval["n"], reduction="mean")
                    for name, v in sorted(interval["terms"].items())
                }
                log(
                    {
                        "train/loss": mean_loss,
                        "train/lr": lr,
                        "train/throughput_img_s": ips,
                        "train/grad_norm": grad_norm,
                        "train/epoch": step * G / bpe,
                        **terms,
                    },
                    step,
                )
                if bar is not None:
                    shown = {"loss": f"{float(mean_loss):.3f}", "lr": f"{lr:.2e}", "img_s": f"{ips:.0f}"}
                    if "top1" in last_eval:  # nothing before the first evaluation (not nan)
                        shown["top1"] = f"{last_eval['top1']:.4f}"
                    bar.set_postfix(shown)
                interval = {"loss": 0.0, "n": 0, "time": 0.0, "images": 0, "terms": {}}
            ctx.step, ctx.epoch, ctx.checkpoint_dir = step, step * G // bpe, None
            cb_dt = callbacks.on_step_end(ctx)
            final = step == t.steps
            if final or (t.eval_every and step % t.eval_every == 0):
                run_eval()
            saved = final or (t.checkpoint_every and step % t.checkpoint_every == 0)
            if saved:
                cb_dt += checkpoint(final)
            if cb_dt:
                log({"time/callbacks_s": cb_dt}, step)
            if saved and writer is not None:
                writer.flush()  # what was logged up to a checkpoint survives a kill -9 after it
            if not final:
                stop_if_asked()
                stop_if_reached()
            if exhausted:
                break  # restart the outer loop so the sampler position is recomputed from the step

    ctx.step = step
    dt = callbacks.on_train_end(ctx)
    if dt:
        log({"time/callbacks_s": dt}, step)
    if bar is not None:
        bar.close()
    summary = {
        "run_dir": str(run_dir),
        "step": step,
        "top1": last_eval.get("top1"),
        "eval_loss": last_eval.get("loss"),
        "wall_s": wall_before + time.perf_counter() - t_start,
        "num_processes": acc.num_processes,
    }
    own = objective.summary()
    if own:
        summary["objective"] = {"name": objective.name, **own}
        if main and own.get("warning"):
            print(f"warning: {own['warning']}", file=sys.stderr, flush=True)
    callbacks.on_close(ctx)  # before result.json marks the run finished: its last figures are on disk first
    if main:
        _write_result(run_dir, summary)
    acc.wait_for_everyone()
    acc.end_training()
    return summary
