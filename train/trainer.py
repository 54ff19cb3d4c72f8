"""The Accelerate training loop: recipe -> data -> model -> steps -> eval, checkpoints, callbacks, TensorBoard.

Read it top to bottom: the entry point (:func:`train`), set-up (run folder, input pipeline, model and optimizer),
the loop state (:class:`Loop`), then the named steps of the loop (the update step, logging, evaluation,
checkpointing, stops) and the train loop itself (:func:`train_loop`). The run folder's lifecycle (naming, lock,
signals, resume, TensorBoard's events files, ``result.json``) is ``train/run_folder.py``.

Exact resume: the data order of epoch e comes from (seed, e) alone (:class:`train.data.EpochBatchSampler`),
torch's RNG is reseeded from (seed, step, rank) before every optimizer step (augmentation, dropout), and the
learning rate is a pure function of the step, so N steps + resume + N steps equals 2N steps bit for bit. The
logged curve is too: ``train/loss`` at step k is the mean over steps (k - log_every, k] whatever the stops in
between (a checkpoint keeps the sums of its unfinished window, :class:`LogWindow`), and TensorBoard events logged
after the checkpoint a run resumes from are purged. Only the timings (:data:`TIMING_TAGS`) differ.

SIGTERM / SIGINT stop the run cleanly at the end of the current step, on every process at the same step, with a
checkpoint of that step.
"""

from __future__ import annotations

import contextlib
import math
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import timm.optim
import torch
import torch.nn.functional as F
from accelerate import Accelerator
from accelerate.utils import ProjectConfiguration, set_seed
from torch.utils.data import DataLoader
from torchmetrics.classification import MulticlassAccuracy
from tqdm.auto import tqdm

from interventions import describe
from train import compiling, init_from, memory
from train.callbacks import CallbackList, TrainContext, build_callbacks
from train.checkpoint import callbacks_done, list_checkpoints, mark_callbacks_done, save_checkpoint
from train.cli import fewer_processes
from train.collective import any_process, broadcast, gather_floats
from train.data import DataBundle, EpochBatchSampler, augment, batch_collate, build_data
from train.errors import (  # noqa: F401  (RunExists, RunFolderError: re-exported for callers of train.trainer)
    CheckpointError,
    RecipeError,
    RunExists,
    RunFolderError,
    TrainingDiverged,
    TrainingStopped,
)
from train.knn import knn_monitor
from train.models import build_model
from train.objectives import Objective, build_objective, uses_labels
from train.recipe import Recipe, TrainConfig
from train.run_folder import (  # noqa: F401  (prepare_run, wait_past_event_files: re-exported)
    RunLock,
    StopSignals,
    check_processes,
    claim,
    commit,
    finished_summary,
    full_disk_sentence,
    open_tensorboard,
    prepare_run,
    quiet_full_disk_threads,
    run_dir_for,
    wait_past_event_files,
    write_result,
)
from train.seeding import reseed_step, step_seed  # noqa: F401  (step_seed: re-exported for callers of train.trainer)

# ---------------------------------------------------------------- the pieces the loop and its tests share

# The TensorBoard tags that measure wall-clock time (a tag, or a prefix ending in '/'): their values differ from run to
# run, and a stop (SIGTERM, Ctrl-C, --stop-after) adds points of its own at the stop step (``time/checkpoint_s`` of
# the checkpoint it writes, ``time/callbacks_s`` of that checkpoint's callbacks). Every other tag the trainer logs
# (``train/*`` but the throughput, ``eval/*``, ``val/*``) is a function of the steps it covers: a stopped and resumed
# run logs the same values at the same steps as an uninterrupted one. Callbacks are not the trainer's: one that runs
# at every checkpoint (no ``every``) also runs at a stop's checkpoint.
TIMING_TAGS: tuple[str, ...] = ("time/", "train/throughput_img_s")


def is_timing_tag(tag: str) -> bool:
    """Whether TensorBoard tag ``tag`` measures wall-clock time (:data:`TIMING_TAGS`)."""
    return any(tag.startswith(t) if t.endswith("/") else tag == t for t in TIMING_TAGS)


def lr_at(step: int, t: TrainConfig) -> float:
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


def _cpu_threads(acc: Accelerator) -> None:
    """``accelerate launch`` sets OMP_NUM_THREADS=1 on CPU unless told otherwise, which halves the speed of a
    2-core machine. On CPU, give each local process an equal share of the cores this process may use, unless
    VITLAB_THREADS says how many. On a GPU the host threads are left as torch set them unless VITLAB_THREADS says how
    many: ``study``/``sweep --jobs N`` sets it to each run's share of the cores, and without it N processes on one
    GPU machine each started a pool of every core (16 runs x 16 threads on a 16-core H200 host: every run trained
    at 3.4 steps/s, the speed of a 2-core CPU)."""
    want = os.environ.get("VITLAB_THREADS")
    if acc.device.type != "cpu":
        if want and int(want) != torch.get_num_threads():
            torch.set_num_threads(int(want))
        return
    if want is None and os.environ.get("OMP_NUM_THREADS") not in (None, "1"):
        return  # the user chose a thread count
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    local = int(os.environ.get("LOCAL_WORLD_SIZE", acc.num_processes if acc.num_processes > 1 else 1))
    n = int(want) if want else max(1, cores // max(1, local))
    if n != torch.get_num_threads():
        torch.set_num_threads(n)


def make_accelerator(recipe: Recipe, run_dir: Path | None = None, log: bool = True) -> Accelerator:
    """The run's Accelerator (TensorBoard under ``run_dir`` when ``log``), with the CPU thread share set."""
    kwargs = {}
    if run_dir is not None and log:
        kwargs = {
            "log_with": "tensorboard",
            "project_config": ProjectConfiguration(project_dir=str(run_dir), logging_dir=str(run_dir)),
        }
    acc = Accelerator(mixed_precision=recipe.train.mixed_precision, step_scheduler_with_optimizer=False, **kwargs)
    if recipe.train.mixed_precision == "fp16" and acc.device.type == "cpu":  # accelerate would train in float32
        raise RecipeError(
            "key 'train.mixed_precision' is fp16, which needs a GPU (on a CPU the run would silently train in "
            "float32): use bf16 or no on a CPU."
        )
    _cpu_threads(acc)
    fewer = fewer_processes(acc.num_processes)
    if fewer and acc.is_main_process:
        print(f"warning: {fewer}", file=sys.stderr, flush=True)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if acc.num_processes != world:
        raise RuntimeError(
            f"accelerate sees {acc.num_processes} process(es) but WORLD_SIZE is {world}: on CPU launch with "
            "ACCELERATE_USE_CPU=true accelerate launch --multi_gpu --num_processes N (see docs/training.md)."
        )
    return acc


def eval_loader(split, batch_size: int, num_workers: int = 0) -> DataLoader:
    return DataLoader(
        split.dataset(), batch_size=batch_size, shuffle=False, num_workers=num_workers, collate_fn=batch_collate
    )


@torch.no_grad()
def evaluate(accelerator: Accelerator, model: torch.nn.Module, loader, data: DataBundle, num_classes: int) -> dict:
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


# ---------------------------------------------------------------- entry point


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
    closing: list = []  # the callbacks' on_close, for an exit the loop did not plan (an exception from anywhere)
    with StopSignals() as stop, quiet_full_disk_threads():
        try:
            loop = _set_up(recipe, overrides, resume, progress, allow_process_change, run_dir, lock)
            if isinstance(loop, dict):
                return loop  # resumed after its final checkpoint: nothing to train
            loop.stop, loop.stop_after, loop.t_start = stop, stop_after, t_start
            closing.append(lambda: loop.callbacks.on_close(loop.ctx))
            return train_loop(loop)
        except OSError as e:  # a full disk (TensorBoard's events, a callback's files): the checkpoints written stay
            err = full_disk_sentence(e, run_dir)
            if err is None:
                raise
            raise err from None
        finally:
            _close_callbacks(closing)
            lock.release()


def _close_callbacks(closing: list) -> None:
    for close in closing:  # a no-op when the run already closed its callbacks
        try:
            close()
        except Exception as e:  # never hide the exception that ended the run
            print(f"warning: a callback failed while closing ({type(e).__name__}: {e}).", file=sys.stderr, flush=True)


# ---------------------------------------------------------------- set-up: run folder, input pipeline, model


def _set_up(recipe: Recipe, overrides, resume, progress, allow_process_change, run_dir, lock) -> Loop | dict:
    """Every check that can refuse the run, then the run folder, data, model, optimizer and TensorBoard: the
    :class:`Loop` at its first step (or the summary of a run that had already finished)."""
    callbacks = build_callbacks(recipe.callbacks)  # option errors before anything is written
    compiling.check(recipe)  # train.compile without a C++ compiler for inductor: one sentence, nothing written
    acc = make_accelerator(recipe, run_dir)
    memory.check(recipe, acc)  # a model or batch that cannot fit: one sentence, before anything is allocated
    held = claim(acc, lock, create=False)  # an existing folder is locked before its checkpoints are read
    run_dir, start_ckpt, start_meta = prepare_run(recipe, overrides, resume, run_dir)
    # a checkpoint whose callbacks never finished (a kill -9 while they ran) gets them first; every process agrees
    # on what the main process finds in the run folder
    redo = start_ckpt is not None and broadcast(acc, not callbacks_done(start_ckpt, start_meta))
    done = None if redo else finished_summary(run_dir, recipe, start_meta, acc.is_main_process)
    if done is not None:
        return done
    check_processes(start_ckpt, start_meta, acc.num_processes, allow_process_change)

    set_seed(recipe.seed)
    data = build_data(recipe, colour_from_grey=False)  # a model of 3 channels is not trained on grey images
    callbacks.validate(recipe, data)
    labelled = uses_labels(recipe)
    # an objective without labels trains a backbone without classifier head: its output is the pooled features
    objective = build_objective(recipe, build_model(recipe, data.num_classes if labelled else 0), data.num_classes)
    # fine-tuning / linear evaluation: a fresh start loads train.init_from (not a resume), a frozen backbone stays
    # frozen
    init_record = init_from.apply(recipe, objective, start_meta if start_ckpt is not None else None)
    loop = _input_pipeline_and_model(recipe, acc, data, objective, labelled)
    loop.run_dir, loop.callbacks = run_dir, callbacks
    loop.redo_callbacks = start_ckpt if redo else None
    loop.step = _load_start(acc, start_ckpt, start_meta)
    commit(acc, lock, held, recipe, overrides, resume, run_dir, loop.step)

    loop.run_info = {
        "recipe_hash": recipe.hash(),
        "resume_hash": recipe.resume_hash(),
        "interventions": describe(recipe),
        "data": data.meta,
        "num_processes": acc.num_processes,
        "global_batch": loop.global_batch,
        "num_classes": data.num_classes,
        "torch_threads": torch.get_num_threads(),
        "objective": objective.describe(),
        **({"init_from": init_record} if init_record else {}),
    }
    writer = open_tensorboard(acc, run_dir, loop.step, recipe, loop.run_info)
    loop.resume_from(start_meta, resumed=start_ckpt is not None)
    # what callbacks measure: the backbone (the student of a self-distillation)
    loop.ctx = TrainContext(acc, objective.network, recipe, data, run_dir, step=loop.step, writer=writer, log=loop.log)
    if progress and acc.is_main_process:
        loop.bar = tqdm(total=recipe.train.steps, initial=loop.step, desc=run_dir.name, dynamic_ncols=True)
    return loop


def _input_pipeline_and_model(
    recipe: Recipe, acc: Accelerator, data: DataBundle, objective: Objective, labelled: bool
) -> Loop:
    """The train loader (batches in the sampler's (seed, epoch) order), the evaluation loaders, the optimizer, all
    prepared by Accelerate (in this order: the order decides nothing but is kept as it always was)."""
    t, workers = recipe.train, recipe.data.num_workers
    model = objective.trained_module()  # the backbone (supervised) or the objective holding it and its own parts
    opt = timm.optim.create_optimizer_v2(model, opt="adamw", lr=t.lr, weight_decay=t.weight_decay, betas=tuple(t.betas))
    sampler = EpochBatchSampler(len(data.train), t.batch_size, recipe.seed, acc.process_index, acc.num_processes)
    # a lazy train split decodes (and random-resized-crops, seeded by (seed, epoch, index)) in the workers; the
    # sampler's EpochBatch carries the epoch there, so order and crops are functions of (seed, epoch) alone
    train_loader = DataLoader(
        data.train.dataset(),
        batch_sampler=sampler,
        num_workers=workers,
        collate_fn=batch_collate,
        generator=sampler.generator,
        pin_memory=acc.device.type == "cuda",
        persistent_workers=False,
        prefetch_factor=4 if data.train.lazy and workers > 0 else None,
    )
    ev_loader = eval_loader(data.eval, t.eval_batch_size, workers)
    # the k-NN monitor's memory bank (objectives without labels): the probe-train split, unaugmented
    bank_loader = None if labelled else acc.prepare(eval_loader(data.probe_train, t.eval_batch_size, workers))
    model, opt, ev_loader = acc.prepare(model, opt, ev_loader)
    # train.compile: a torch.compile wrapper of the prepared module, called by the update step alone. The module
    # itself stays as it was: objective.network (what callbacks and analysis taps hook, by timm's module names),
    # evaluation (no recompiles for eval mode and its batch sizes) and accelerate's save_state / load_state (checkpoint
    # keys without '_orig_mod.') all use it; the wrapper shares its parameters, so the optimizer trains them.
    step_model = compiling.compile_module(model) if t.compile else model
    # data.val_size > 0: the held-out validation split, evaluated at every evaluation exactly as the eval split
    val_loader = acc.prepare(eval_loader(data.val, t.eval_batch_size, workers)) if data.val is not None else None
    return Loop(
        recipe=recipe,
        acc=acc,
        data=data,
        objective=objective,
        model=model,
        step_model=step_model,
        opt=opt,
        sampler=sampler,
        train_loader=train_loader,
        eval_loader=ev_loader,
        val_loader=val_loader,
        bank_loader=bank_loader,
        labelled=labelled,
    )


def _load_start(acc: Accelerator, start_ckpt: Path | None, start_meta: dict) -> int:
    """Load the checkpoint resumed from (model, optimizer, RNG states); its step, or 0 for a fresh start."""
    if start_ckpt is None:
        return 0
    try:
        acc.load_state(str(start_ckpt))
    except Exception as e:
        raise CheckpointError(
            f"checkpoint {start_ckpt} cannot be loaded into this model ({type(e).__name__}: {str(e)[:160]})."
        ) from None
    return int(start_meta["step"])


# ---------------------------------------------------------------- the loop state


@dataclass
class LogWindow:
    """The sums over the steps since the last logged value (each process's own); a checkpoint keeps them, so a
    resumed run logs the same means as an uninterrupted one."""

    loss: torch.Tensor | float = 0.0
    n: int = 0
    time: float = 0.0
    images: int = 0
    terms: dict = field(default_factory=dict)  # the objective's loss terms

    @classmethod
    def from_meta(cls, saved: dict | None, acc: Accelerator) -> LogWindow:
        """The unfinished window a checkpoint's meta.json recorded (per process), or an empty one."""
        if not saved or len(saved["loss"]) != acc.num_processes:
            return cls()
        mine = acc.process_index

        def tensor(v):
            return torch.tensor(v, dtype=torch.float32, device=acc.device)

        terms = {k: tensor(v[mine]) for k, v in saved.get("terms", {}).items()}
        return cls(tensor(saved["loss"][mine]), saved["n"], saved["time"], saved["images"], terms)

    def to_meta(self, acc: Accelerator) -> dict | None:
        """Collective: every process's sums, for meta.json (None when the window is empty)."""
        if not self.n:
            return None
        terms = {k: gather_floats(acc, v) for k, v in sorted(self.terms.items())}
        return {"loss": gather_floats(acc, self.loss), "n": self.n, "time": self.time, "images": self.images,
                "terms": terms}  # fmt: skip


@dataclass
class Loop:
    """Everything the training loop reads and changes: what set-up built (first group), the position and what was
    measured so far (second group). The named steps below take it and nothing else."""

    recipe: Recipe
    acc: Accelerator
    data: DataBundle
    objective: Objective
    model: torch.nn.Module  # prepared: the trained module, DDP-wrapped with several processes
    opt: torch.optim.Optimizer
    sampler: EpochBatchSampler
    train_loader: DataLoader
    eval_loader: DataLoader
    val_loader: DataLoader | None
    bank_loader: DataLoader | None  # the k-NN monitor's memory bank (objectives without labels)
    labelled: bool
    step_model: torch.nn.Module | None = None  # what the update step calls: ``model``, or its torch.compile wrapper
    run_dir: Path = Path()
    callbacks: CallbackList = field(default_factory=lambda: CallbackList([]))
    ctx: TrainContext | None = None
    run_info: dict = field(default_factory=dict)  # what every checkpoint's meta.json records of the run
    bar: tqdm | None = None
    shown: dict = field(default_factory=dict)  # the bar's last logged loss, lr and throughput
    stop: StopSignals | None = None
    stop_after: int | None = None
    t_start: float = 0.0
    wall_before: float = 0.0  # seconds trained before the checkpoint resumed from
    compile_before: float = 0.0  # seconds torch.compile took in the run's segments before the checkpoint resumed from
    compile_s: float | None = None  # seconds it took in this segment so far (None: nothing compiled yet)
    compile_start: float | None = None  # torch.compile's process-wide seconds before this segment's first step
    redo_callbacks: Path | None = None  # the checkpoint resumed from, when its callbacks did not finish

    step: int = 0
    last_saved: int = -1
    last_eval: dict = field(default_factory=dict)
    last_val: dict = field(default_factory=dict)
    window: LogWindow = field(default_factory=LogWindow)

    def __post_init__(self):
        if self.step_model is None:
            self.step_model = self.model

    @property
    def global_batch(self) -> int:
        t = self.recipe.train
        return t.batch_size * t.grad_accum * self.acc.num_processes

    def epoch_of(self, step: int) -> float:
        """Epochs trained after ``step`` steps (fractional: what ``train/epoch`` logs)."""
        return step * self.recipe.train.grad_accum / self.sampler.batches_per_epoch()

    def epoch_index(self, step: int) -> int:
        """The epoch that step ``step`` ends in (what meta.json and the callbacks' context record)."""
        return (step * self.recipe.train.grad_accum) // self.sampler.batches_per_epoch()

    def resume_from(self, meta: dict, resumed: bool) -> None:
        """The position and measurements recorded by the checkpoint resumed from (``meta``; {} for a fresh run)."""
        self.wall_before = float(meta.get("wall_s", 0.0))
        self.compile_before = float(meta.get("compile_s", 0.0))
        self.last_eval = meta.get("eval") or {}
        self.last_val = meta.get("val") or {}
        self.window = LogWindow.from_meta(meta.get("log_window"), self.acc)
        self.last_saved = self.step if resumed else -1

    def log(self, values: dict, at: int) -> None:
        """Scalars to TensorBoard (main process; the tracker ignores the others)."""
        self.acc.log({k: float(v) for k, v in values.items()}, step=at)

    def wall_s(self) -> float:
        return self.wall_before + time.perf_counter() - self.t_start

    @property
    def compiled(self) -> bool:
        return self.step_model is not self.model

    def compile_total(self) -> dict:
        """``{"compile_s": seconds}`` over every segment of the run that compiled (meta.json, result.json), or {}."""
        if self.compile_s is None and not self.compile_before:
            return {}
        return {"compile_s": self.compile_before + (self.compile_s or 0.0)}


# ---------------------------------------------------------------- input pipeline of the loop


class EpochBatches:
    """The train batches from the sampler position of ``loop.step``; an accumulation window that crosses the end of
    the epoch continues in the next one and sets ``crossed`` (the loop then recomputes the position from the step)."""

    def __init__(self, loop: Loop):
        self.loop = loop
        self.epoch, offset = divmod(loop.step * loop.recipe.train.grad_accum, loop.sampler.batches_per_epoch())
        loop.sampler.set_epoch(self.epoch, offset)
        self.it = iter(loop.train_loader)
        self.crossed = False

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        try:
            return next(self.it)
        except StopIteration:  # epoch boundary inside an accumulation window
            self.epoch += 1
            self.loop.sampler.set_epoch(self.epoch, 0)
            self.it = iter(self.loop.train_loader)
            self.crossed = True
            return next(self.it)


# ---------------------------------------------------------------- update step


def update_step(loop: Loop, batches: EpochBatches) -> tuple[float, torch.Tensor]:
    """One optimizer step over ``grad_accum`` micro-batches; returns (learning rate, gradient norm)."""
    recipe, acc, t = loop.recipe, loop.acc, loop.recipe.train
    aug, G = recipe.data.augment, t.grad_accum
    batch_rrc = aug.random_resized_crop and not loop.data.train.lazy  # lazy splits were cropped in the workers
    t0 = time.perf_counter()
    reseed_step(recipe.seed, loop.step, acc.process_index)
    lr = lr_at(loop.step, t)
    for g in loop.opt.param_groups:
        g["lr"] = lr
    loss_acc = 0.0
    for k in range(G):
        x, y = batches.next()
        x = x.to(acc.device, non_blocking=True)
        y = y.to(acc.device, non_blocking=True)
        x = loop.data.normalize(
            augment(x, aug.shift, aug.hflip, batch_rrc, aug.randaugment_ops, aug.randaugment_magnitude)
        )
        with contextlib.nullcontext() if k == G - 1 else acc.no_sync(loop.model):
            loss, terms = loop.objective.loss(loop.step_model, x, y, loop.step)
            acc.backward(loss / G)
        loss_acc += loss.detach()
        for name, v in terms.items():
            loop.window.terms[name] = loop.window.terms.get(name, 0.0) + v.detach().float() / G
    grad_norm = acc.clip_grad_norm_(loop.model.parameters(), t.grad_clip if t.grad_clip > 0 else float("inf"))
    if t.mixed_precision != "fp16" and not torch.isfinite(grad_norm):
        diverged(loop, loop.step + 1, f"the loss/gradient became {float(grad_norm)}")
    loop.opt.step()
    loop.opt.zero_grad(set_to_none=True)
    loop.step += 1
    loop.objective.after_step(loop.step)
    w = loop.window
    w.loss += loss_acc / G
    w.n, w.time, w.images = w.n + 1, w.time + time.perf_counter() - t0, w.images + loop.global_batch
    if loop.bar is not None:
        loop.bar.update(1)
    return lr, grad_norm


# ---------------------------------------------------------------- logging


def note_compile(loop: Loop, step_s: float) -> None:
    """train.compile, after an update step that took ``step_s``: the seconds torch.compile spent in this segment
    (dynamo's own account, backward and recompiles included; the first step's wall time where torch keeps none),
    logged as ``time/compile_s`` whenever they grow, with one line on the main process after the first step."""
    first, now = loop.compile_s is None, compiling.seconds()
    if now is None or loop.compile_start is None:
        if not first:
            return
        spent = step_s
    else:
        spent = now - loop.compile_start
        if not first and spent <= loop.compile_s:
            return
    loop.compile_s = spent
    loop.log({"time/compile_s": spent}, loop.step)
    if first and loop.acc.is_main_process:
        line = (
            f"torch.compile ({compiling.backend()}): {spent:.1f} s compiling the first step (the step took "
            f"{step_s:.1f} s)"
        )
        (tqdm.write if loop.bar is not None else print)(line, file=sys.stderr)


def log_train(loop: Loop, lr: float, grad_norm: torch.Tensor) -> None:
    """At the end of a window (a multiple of ``log_every``, and the last step): the window's mean loss (a value
    logged at step k covers (k - log_every, k]), learning rate, throughput, gradient norm and objective terms."""
    t, acc, w, step = loop.recipe.train, loop.acc, loop.window, loop.step
    if step % t.log_every and step != t.steps:
        return
    mean_loss = acc.reduce(w.loss / w.n, reduction="mean")
    if not torch.isfinite(mean_loss):
        diverged(loop, step, f"the mean loss became {float(mean_loss)}")
    ips = w.images / max(w.time, 1e-9)
    terms = {f"train/{name}": acc.reduce(v / w.n, reduction="mean") for name, v in sorted(w.terms.items())}
    loop.log(
        {
            "train/loss": mean_loss,
            "train/lr": lr,
            "train/throughput_img_s": ips,
            "train/grad_norm": grad_norm,
            "train/epoch": loop.epoch_of(step),
            **terms,
        },
        step,
    )
    if loop.bar is not None:
        loop.shown = {"loss": f"{float(mean_loss):.3f}", "lr": f"{lr:.2e}", "img_s": f"{ips:.0f}"}
        show(loop)
    loop.window = LogWindow()


def show(loop: Loop, now: str | None = None) -> None:
    """The progress bar's postfix: the last logged loss, lr and throughput, the last evaluation's top-1 (nothing
    before the first evaluation, not nan), and ``now=`` what the run is doing between steps (evaluating, writing a
    checkpoint, callbacks), so a bar at 100% during the final evaluation and analyses says why it waits."""
    if loop.bar is None:
        return
    shown = dict(loop.shown)
    if "top1" in loop.last_eval:
        shown["knn_top1" if not loop.labelled else "top1"] = f"{loop.last_eval['top1']:.4f}"
    if now:
        shown["now"] = now
    loop.bar.set_postfix(shown, refresh=True)


# ---------------------------------------------------------------- evaluation


def run_eval(loop: Loop) -> None:
    """Top-1 and loss of the eval split (and of the val split, when there is one); k-NN top-1 of the backbone's
    features for objectives without labels (DINO's monitor)."""
    acc, data, t0 = loop.acc, loop.data, time.perf_counter()
    show(loop, "evaluating")
    if loop.labelled:
        loop.last_eval = evaluate(acc, loop.model, loop.eval_loader, data, data.num_classes)
        logged = {"eval/top1": loop.last_eval["top1"], "eval/loss": loop.last_eval["loss"]}
        if loop.val_loader is not None:
            loop.last_val = evaluate(acc, loop.model, loop.val_loader, data, data.num_classes)
            logged.update({"val/top1": loop.last_val["top1"], "val/loss": loop.last_val["loss"]})
    else:
        backbone, bank = loop.objective.network, loop.bank_loader
        loop.last_eval = knn_monitor(acc, backbone, bank, loop.eval_loader, data.normalize, data.num_classes)
        logged = {"eval/knn_top1": loop.last_eval["top1"]}
        if loop.val_loader is not None:  # the held-out images as k-NN queries: what checkpoint selection may read
            loop.last_val = knn_monitor(acc, backbone, bank, loop.val_loader, data.normalize, data.num_classes)
            logged["val/knn_top1"] = loop.last_val["top1"]
    loop.log({**logged, "time/eval_s": time.perf_counter() - t0}, loop.step)  # both splits' time
    show(loop)  # the new top-1: the bar ends on the number the run reports


# ---------------------------------------------------------------- checkpointing


def checkpoint(loop: Loop, final: bool, cb_dt: float = 0.0) -> None:
    """Collective: save the step (weights, optimizer, RNG, meta.json with the unfinished log window), flush what was
    logged up to it, then run the checkpoint callbacks (:func:`checkpoint_callbacks`; ``cb_dt``: seconds the step's
    own callbacks took, logged with theirs)."""
    t0, step = time.perf_counter(), loop.step
    show(loop, "checkpoint")
    meta = {
        **loop.run_info,
        "epoch": loop.epoch_index(step),
        "final": final,
        "eval": loop.last_eval,
        "time": time.time(),
        "wall_s": loop.wall_s(),
        "log_window": loop.window.to_meta(loop.acc),
        **loop.compile_total(),
        **({"val": loop.last_val} if loop.val_loader is not None else {}),  # what checkpoint selection reads
        "marks_callbacks": True,  # checkpoint_callbacks() marks the folder once its callbacks have finished
    }
    path = save_checkpoint(loop.acc, loop.run_dir / "checkpoints", step, meta, loop.recipe.train.keep_last)
    loop.last_saved = step
    loop.log({"time/checkpoint_s": time.perf_counter() - t0}, step)
    if loop.ctx.writer is not None:  # the step's curve survives a kill -9 during the callbacks (resume keeps it)
        loop.ctx.writer.flush()
    checkpoint_callbacks(loop, path, cb_dt)


def checkpoint_callbacks(loop: Loop, path: Path, cb_dt: float = 0.0) -> None:
    """Collective: the ``on_checkpoint`` callbacks of the checkpoint at ``path`` (of step ``loop.step``), their time
    (plus ``cb_dt``) logged as ``time/callbacks_s``, TensorBoard flushed, then the folder marked (checkpoint.
    CALLBACKS_DONE) once every process has finished: a resume from a checkpoint without the mark runs them again."""
    ctx = loop.ctx
    ctx.step, ctx.epoch, ctx.checkpoint_dir = loop.step, loop.epoch_index(loop.step), path
    show(loop, "checkpoint callbacks")
    cb_dt += loop.callbacks.on_checkpoint(ctx)
    show(loop)
    if cb_dt:
        loop.log({"time/callbacks_s": cb_dt}, loop.step)
    if ctx.writer is not None:
        ctx.writer.flush()
    loop.acc.wait_for_everyone()
    if loop.acc.is_main_process:
        mark_callbacks_done(path)


def after_step(loop: Loop) -> None:
    """The cadences after an update step: step callbacks, evaluation, checkpoint (and its callbacks, with the flushes
    that make what was logged up to a checkpoint survive a kill -9), then the stops."""
    t, step = loop.recipe.train, loop.step
    ctx = loop.ctx
    ctx.step, ctx.epoch, ctx.checkpoint_dir = step, loop.epoch_index(step), None
    cb_dt = loop.callbacks.on_step_end(ctx)
    final = step == t.steps
    if final or (t.eval_every and step % t.eval_every == 0):
        run_eval(loop)
    if final or (t.checkpoint_every and step % t.checkpoint_every == 0):
        checkpoint(loop, final, cb_dt)  # logs cb_dt with its callbacks' time, flushes TensorBoard
    elif cb_dt:
        loop.log({"time/callbacks_s": cb_dt}, step)
    if not final:
        stop_if_asked(loop)
        stop_if_reached(loop)


# ---------------------------------------------------------------- stops


def close(loop: Loop) -> None:
    loop.callbacks.on_close(loop.ctx)  # background work (figures) lands before TensorBoard closes
    if loop.bar is not None:
        loop.bar.close()
    loop.acc.end_training()  # closes (and flushes) TensorBoard


def diverged(loop: Loop, at: int, what: str) -> None:
    """Stop without writing a checkpoint; name the last good one. Every rank sees the same value (grad norm /
    reduced loss), so every rank stops here together."""
    done = list_checkpoints(loop.run_dir / "checkpoints", warn=False)
    keep = f"the last good checkpoint is {done[-1]}" if done else "no checkpoint had been written yet"
    close(loop)
    raise TrainingDiverged(
        f"training diverged at step {at}: {what} ({keep}); start a new run (--name NEW) with a lower "
        "train.lr, more train.warmup_steps or a train.grad_clip."
    )


def _stop_here(loop: Loop, final: bool, message: str) -> None:
    """Checkpoint this step (unless it is saved already or nothing was trained), close, raise TrainingStopped."""
    if loop.last_saved != loop.step and loop.step > 0:
        checkpoint(loop, final)
    close(loop)
    raise TrainingStopped(message, loop.step)


def stop_if_asked(loop: Loop) -> None:
    """Collective: on SIGTERM / SIGINT to any process, every process checkpoints this step and stops. With several
    processes the agreement (an all-reduce and a host sync) is made every ``log_every`` steps and at the last
    step, not every step, so the training loop's hot path does not wait on it."""
    t, step = loop.recipe.train, loop.step
    if loop.acc.num_processes > 1 and step % t.log_every and step != t.steps:
        return
    if not any_process(loop.acc, loop.stop.signum is not None):
        return
    if step == 0:
        _stop_here(loop, False, "stopped before the first step; nothing was trained (run the same command to start).")
    _stop_here(loop, step == t.steps, f"stopped at step {step}; --resume continues")


def stop_if_reached(loop: Loop) -> None:
    """``stop_after``: every process reaches the same step, so every process stops there together."""
    step = loop.step
    if loop.stop_after is None or step < loop.stop_after or step >= loop.recipe.train.steps:
        return
    _stop_here(
        loop, False, f"stopped after step {step} as asked (stop after step {loop.stop_after}); --resume continues"
    )


# ---------------------------------------------------------------- train loop


def train_loop(loop: Loop) -> dict:
    """From ``loop.step`` to ``train.steps``: update step, logging, the cadences (callbacks, evaluation,
    checkpoint, stops); then the end of the run."""
    steps = loop.recipe.train.steps
    cb_dt = loop.callbacks.on_train_start(loop.ctx)
    if loop.redo_callbacks is not None:  # the checkpoint resumed from: its callbacks had not finished
        checkpoint_callbacks(loop, loop.redo_callbacks, cb_dt)
    elif cb_dt:
        loop.log({"time/callbacks_s": cb_dt}, loop.step)
    loop.model.train()
    stop_if_asked(loop)
    stop_if_reached(loop)
    loop.compile_start = compiling.seconds() if loop.compiled else None
    while loop.step < steps:
        batches = EpochBatches(loop)
        while loop.step < steps and not batches.crossed:
            t0 = time.perf_counter()
            lr, grad_norm = update_step(loop, batches)
            if loop.compiled:
                note_compile(loop, time.perf_counter() - t0)
            log_train(loop, lr, grad_norm)
            after_step(loop)
    return finish(loop)


def finish(loop: Loop) -> dict:
    """The end callbacks, the summary, ``result.json`` (written last: it marks the run finished)."""
    acc, ctx = loop.acc, loop.ctx
    ctx.step = loop.step
    show(loop, "end callbacks")
    dt = loop.callbacks.on_train_end(ctx)
    show(loop)
    if dt:
        loop.log({"time/callbacks_s": dt}, loop.step)
    if loop.bar is not None:
        loop.bar.close()
    summary = {
        "run_dir": str(loop.run_dir),
        "step": loop.step,
        "top1": loop.last_eval.get("top1"),
        "eval_loss": loop.last_eval.get("loss"),
        "wall_s": loop.wall_s(),
        "num_processes": acc.num_processes,
        **loop.compile_total(),
    }
    own = loop.objective.summary()
    if own:
        summary["objective"] = {"name": loop.objective.name, **own}
        if acc.is_main_process and own.get("warning"):
            print(f"warning: {own['warning']}", file=sys.stderr, flush=True)
    loop.callbacks.on_close(ctx)  # before result.json marks the run finished: its last figures are on disk first
    if acc.is_main_process:
        write_result(loop.run_dir, summary)
    acc.wait_for_everyone()
    acc.end_training()
    return summary
