"""Callbacks: code that runs inside training at its own cadence, built by name from a recipe.

A recipe lists them::

    callbacks:
      - analysis_suite            # every checkpoint (the default cadence)
      - {name: sample_images, every: 1000, n: 32}   # at steps that are multiples of 1000

``every: None`` (default) runs ``on_checkpoint`` at every checkpoint; ``every: N`` runs ``on_step_end`` at
steps that are multiples of N and ``on_checkpoint`` only at checkpoints whose step is a multiple of N.
``on_train_start`` and ``on_train_end`` always run, and ``on_close`` once however the run ends (finished, stopped,
diverged) before TensorBoard closes. Extra keys are passed to the callback's constructor.
The time spent in callbacks is excluded from ``train/throughput_img_s`` and logged as ``time/callbacks_s``.

Where a recipe's callback names come from, in this order:

1. classes decorated with :func:`register_callback` in modules already imported;
2. the ``vitlab.callbacks`` entry points of installed packages (``[project.entry-points."vitlab.callbacks"]`` in a
   pyproject.toml: ``name = "package.module:Class"``) -- vitlab's own analysis callbacks come this way, so this
   package never imports analysis/;
3. ``package.module:Class`` written in the recipe itself (``callbacks: [{name: my_pkg.callbacks:MyCallback}]``),
   for a callback in the user's own code (the module must be importable, e.g. on PYTHONPATH).

This module must stay free of torch imports at load time: recipe validation uses :func:`known_callbacks`.
"""

from __future__ import annotations

import inspect
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from train.errors import RecipeError
from vitlab.plugins import Registry

if TYPE_CHECKING:  # annotations only: this module imports no torch at load time
    import torch
    from accelerate import Accelerator
    from torch.utils.tensorboard import SummaryWriter

    from train.data import DataBundle
    from train.recipe import Recipe

ENTRY_POINT_GROUP = "vitlab.callbacks"
CALLBACKS = Registry("callback", group=ENTRY_POINT_GROUP)


def register_callback(name: str) -> Callable:
    """Class decorator: make a Callback subclass available to recipes under ``name``."""
    return CALLBACKS.register(name)


def known_callbacks() -> list[str]:
    return CALLBACKS.names()


def is_callback_name(name: str) -> bool:
    """Whether ``name`` can name a callback: a known name, or ``package.module:Class`` (imported when built)."""
    return CALLBACKS.could_name(name)


@dataclass
class TrainContext:
    """What a callback sees. ``model`` is the unwrapped model (no DDP wrapper); ``log`` writes scalars to the
    run's tracker (main process only); ``writer`` is the raw TensorBoard SummaryWriter on the main process
    and None elsewhere; ``checkpoint_dir`` is set during ``on_checkpoint``."""

    accelerator: Accelerator
    model: torch.nn.Module
    recipe: Recipe
    data: DataBundle
    run_dir: Path
    step: int = 0
    epoch: int = 0
    writer: SummaryWriter | None = None
    checkpoint_dir: Path | None = None
    log: Callable[[dict[str, float], int], None] = field(default=lambda values, step: None)

    def checkpoints_at(self, step: int) -> bool:
        """Whether the trainer writes a checkpoint at ``step`` (then ``on_checkpoint`` follows ``on_step_end``)."""
        t = self.recipe.train
        return step == t.steps or bool(t.checkpoint_every and step % t.checkpoint_every == 0)


class Callback:
    """Base class: override any of the four hooks. ``every`` is the cadence described in the module docstring."""

    def __init__(self, every: int | None = None, **options):
        self.every = every
        if options:
            raise RecipeError(
                f"callback {type(self).__name__} takes no options ({', '.join(sorted(options))}): remove them."
            )

    def check_recipe(self, recipe: Recipe) -> None:
        """Raise RecipeError (one sentence) if this callback cannot run on this recipe's model, before any data is
        read (``--check``, which ``./launch.sh`` runs before starting several processes)."""

    def validate(self, recipe: Recipe, data: DataBundle) -> None:
        """Raise RecipeError (one sentence) if this callback cannot run on this recipe's model and data; called
        before the run folder is written (the default: :meth:`check_recipe`)."""
        self.check_recipe(recipe)

    def on_train_start(self, ctx: TrainContext) -> None: ...

    def on_step_end(self, ctx: TrainContext) -> None: ...

    def on_checkpoint(self, ctx: TrainContext) -> None: ...

    def on_train_end(self, ctx: TrainContext) -> None: ...

    def on_close(self, ctx: TrainContext) -> None:
        """Once when training ends for any reason (finished, stopped by a signal or ``--stop-after``, diverged),
        before TensorBoard is closed: finish background work (e.g. figures still being drawn)."""


class CallbackList:
    """Dispatches hooks with each callback's cadence; each dispatch returns the seconds spent (0.0 if none ran)."""

    def __init__(self, callbacks: list[Callback]):
        self.callbacks = callbacks
        self.closed = False

    def _run(self, hook: str, ctx: TrainContext, due: Callable[[Callback], bool]) -> float:
        t0, ran = time.perf_counter(), False
        for cb in self.callbacks:
            if due(cb):
                getattr(cb, hook)(ctx)
                ran = True
        return time.perf_counter() - t0 if ran else 0.0

    def check_recipe(self, recipe) -> None:
        for cb in self.callbacks:
            cb.check_recipe(recipe)

    def validate(self, recipe, data) -> None:
        for cb in self.callbacks:
            cb.validate(recipe, data)

    def on_train_start(self, ctx):
        return self._run("on_train_start", ctx, lambda cb: True)

    def on_step_end(self, ctx):
        return self._run("on_step_end", ctx, lambda cb: cb.every is not None and ctx.step % cb.every == 0)

    def on_checkpoint(self, ctx):
        return self._run("on_checkpoint", ctx, lambda cb: cb.every is None or ctx.step % cb.every == 0)

    def on_train_end(self, ctx):
        return self._run("on_train_end", ctx, lambda cb: True)

    def on_close(self, ctx):
        """Once: later calls (the trainer's safety net for an exception) do nothing."""
        if self.closed:
            return 0.0
        self.closed = True
        return self._run("on_close", ctx, lambda cb: True)


def build_callbacks(specs) -> CallbackList:
    """Instantiate the recipe's ``callbacks:`` entries (CallbackConfig objects). Options a callback's signature does
    not take are one RecipeError; a callback that refuses an option's value raises its own one-sentence error
    (a :class:`train.errors.UserError`), which reaches the user unchanged."""
    out = []
    for spec in specs:
        cls = CALLBACKS.get(spec.name, RecipeError)
        try:
            inspect.signature(cls).bind(every=spec.every, **spec.options)
        except TypeError as e:
            raise RecipeError(
                f"callback '{spec.name}' got options it does not take ({e}): see its docstring."
            ) from None
        out.append(cls(every=spec.every, **spec.options))
    return CallbackList(out)


@register_callback("sample_images")
class SampleImages(Callback):
    """Logs a grid of ``n`` augmented (and mixed) training images (``data/train_samples``) so augmentation can be
    checked
    by eye; at train start and then at its cadence (every checkpoint by default)."""

    def __init__(self, every: int | None = None, n: int = 32):
        super().__init__(every)
        self.n = n

    def _log(self, ctx):
        if ctx.writer is None:
            return
        # deferred: this module stays free of torch at load time (recipe validation imports it)
        import torch
        import torchvision.utils as vutils

        from train.augment import augment, make_mixer, mix_uint8

        aug = ctx.recipe.data.augment
        g = torch.Generator().manual_seed(ctx.recipe.seed + ctx.step)
        idx = torch.randperm(len(ctx.data.train), generator=g)[: self.n]
        train = ctx.data.train  # in memory, or lazy (decoded here, cropped as in the current epoch)
        x = augment(
            train.take(idx, getattr(ctx, "epoch", 0)),
            aug.shift,
            aug.hflip,
            aug.random_resized_crop and not train.lazy,
            aug.randaugment_ops,
            aug.randaugment_magnitude,
        )
        mixer = make_mixer(aug, ctx.data.num_classes)
        if mixer is not None:  # mixup / CutMix as training sees it
            x = mix_uint8(x, mixer)
        ctx.writer.add_image("data/train_samples", vutils.make_grid(x, nrow=8, pad_value=255), ctx.step)

    def on_step_end(self, ctx):
        if not ctx.checkpoints_at(ctx.step):  # at a checkpoint step, on_checkpoint logs it (once)
            self._log(ctx)

    on_train_start = _log
    on_checkpoint = _log
