"""The training-time analysis callback (a recipe's ``callbacks:`` entry; found by train through the
``vitlab.callbacks`` entry points in pyproject.toml, so train/ never imports analysis/).

    callbacks:
      - analysis_suite                                    # the default four measures at every checkpoint
      - {name: analysis_suite, every: 1000, measures: [cka, knn], knn: {k: 10}, batch_size: 128}
      - {name: cka, every: 500, repr: cls}                # one measure, its options flat

``analysis_suite`` runs any measures (``python -m analysis --list`` names them) in one pass over the analysis split; a
key named after a measure holds that measure's options (analysis/measures/<name>.py, ``Options``). ``cka``,
``norm_ratio``, ``attention_distance`` and ``fewshot_probe`` run one measure each and take its options directly. Other
keys: ``every`` (cadence), ``batch_size`` (analysis minibatch, >= 4), ``figures`` (draw figures for TensorBoard and PNG,
default true), ``max_memory`` (e.g. ``8GiB``: a minibatch whose taps do not fit is forwarded in chunks; default half
the memory available on the device). Results go to TensorBoard and to ``runs/<name>/analysis/step_XXXXXXX/`` (npz
arrays, summary.json) and
``runs/<name>/figures/step_XXXXXXX/`` (PNG); offline analysis (``python -m analysis``) calls the same
:func:`analysis.engine.suite.run_suite` and reuses these results.

Figures are drawn off the training path: results and scalars are written at once, and one background thread
(shared by every analysis callback of the process, so figures are never drawn in two threads at once) draws the
figures (~0.6 s per checkpoint on the default model, 1 thread) and writes them to TensorBoard (flushed) and PNG
while training goes on; the trainer's ``on_close`` waits for them before TensorBoard closes, whatever ends the
run. A figure that fails to draw costs a warning, never the run.
"""

from __future__ import annotations

import sys
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from analysis.engine.suite import DEFAULT, make_context, model_problem, problem, run_suite, suite_options
from analysis.results import publish, storage
from train.callbacks import Callback
from train.errors import RecipeError
from train.models import build_model
from train.objectives import uses_labels

_DRAWER: ThreadPoolExecutor | None = None


def _drawer() -> ThreadPoolExecutor:
    """The process's one figure-drawing thread (module docstring), started on first use."""
    global _DRAWER
    if _DRAWER is None:
        _DRAWER = ThreadPoolExecutor(max_workers=1, thread_name_prefix="vitlab-figures")
    return _DRAWER


class AnalysisSuiteCallback(Callback):
    name = "analysis_suite"

    def __init__(
        self,
        every: int | None = None,
        measures=None,
        batch_size: int = 256,
        figures: bool = True,
        max_memory=None,
        **measure_options,
    ):
        super().__init__(every)
        # a wrong measure or option: MeasureError, the sentence of the code that found it, reaches the user as it is
        self.opts = suite_options(DEFAULT if measures is None else measures, batch_size, measure_options, max_memory)
        self.figures = figures
        self._fingerprint: str | None = None
        self._pending: list[Future] = []

    def check_recipe(self, recipe) -> None:
        """The measures' options against the recipe's model (a class token or not, ...): the model built without
        weights, on the meta device."""
        with torch.device("meta"):
            model = build_model(recipe, 10 if uses_labels(recipe) else 0)
        p = model_problem(make_context(model, None, self.opts.batch_size), self.opts)
        if p:
            raise RecipeError(f"callback '{self.name}': {p}")

    def validate(self, recipe, data) -> None:
        p = problem(data, self.opts)
        if p:
            raise RecipeError(f"callback '{self.name}': {p}")
        self.check_recipe(recipe)

    def _run(self, ctx) -> None:
        res = run_suite(ctx.model, ctx.data, self.opts, ctx.accelerator)
        if ctx.accelerator.is_main_process:
            # at a checkpoint the results are keyed by its weights, so offline analysis reuses them
            wid = storage.weights_id(ctx.checkpoint_dir) if ctx.checkpoint_dir is not None else None
            keys = None
            if wid:
                if self._fingerprint is None:  # the analysis images do not change during a run: hash them once
                    self._fingerprint = storage.data_fingerprint(ctx.data)
                keys = {
                    n: storage.cache_key(wid, self._fingerprint, self.opts.settings(n), n) for n in res if n != "meta"
                }
            publish.publish(
                res, storage.step_dir(ctx.run_dir, ctx.step), ctx.writer, ctx.step, figures=False, keys=keys
            )
            if self.figures:
                self._draw_later(res, ctx.writer, ctx.step, storage.step_dir(ctx.run_dir, ctx.step, "figures"))

    def _draw_later(self, res, writer, step, figure_dir) -> None:
        """Figures in the background (module docstring), one at a time in submission order."""
        self._collect(wait=False)
        self._pending.append(_drawer().submit(publish.publish_figures, res, figure_dir, writer, step))

    def _collect(self, wait: bool) -> None:
        keep = []
        for f in self._pending:
            if not wait and not f.done():
                keep.append(f)
                continue
            e = f.exception()
            if e is not None:
                print(
                    f"warning: callback '{self.name}' could not draw its figures ({type(e).__name__}: {e}); "
                    "the results and scalars are written.",
                    file=sys.stderr,
                    flush=True,
                )
        self._pending = keep

    def on_close(self, ctx) -> None:
        self._collect(wait=True)

    def on_checkpoint(self, ctx) -> None:
        self._run(ctx)

    def on_step_end(self, ctx) -> None:
        if not ctx.checkpoints_at(ctx.step):  # at a checkpoint step on_checkpoint runs it, with cache keys
            self._run(ctx)


class MeasureCallback(AnalysisSuiteCallback):
    """One measure (``measure``), its options given flat: ``{name: cka, repr: cls}``."""

    measure = ""

    def __init__(self, every: int | None = None, batch_size: int = 256, figures: bool = True, **options):
        super().__init__(every, [self.measure], batch_size, figures, **({self.measure: options} if options else {}))


class CKACallback(MeasureCallback):
    name = measure = "cka"


class NormRatioCallback(MeasureCallback):
    name = measure = "norm_ratio"


class AttentionDistanceCallback(MeasureCallback):
    name = measure = "attention_distance"


class FewShotProbeCallback(MeasureCallback):
    name = measure = "fewshot_probe"
