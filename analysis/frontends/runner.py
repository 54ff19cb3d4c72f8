"""The cached runner: the training-time suite (analysis/engine/suite.py) on any checkpoint of a run.

A measure whose saved result carries the same cache key (checkpoint weights' sha256, analysis images, batch size and
its own options: :func:`analysis.results.storage.cache_key`) is not recomputed; results go to
``analysis/step_XXXXXXX/``, figures to ``figures/step_XXXXXXX/`` and scalars and images to the run's TensorBoard at the
checkpoint's step, each measure's as soon as it finishes (the suite's ``on_result``). A stop (KeyboardInterrupt: Ctrl-C,
or the SIGTERM python -m analysis turns into one) keeps what finished: :class:`AnalysisStopped` says how much, and the
same call again reuses it.
"""

from __future__ import annotations

import contextlib
import signal
import threading

import torch
from tqdm.auto import tqdm

from analysis.engine import suite as S
from analysis.engine.measure import MeasureError
from analysis.results import publish, storage
from analysis.results.folders import AnalysisError
from analysis.results.runs import (
    Run,
    check_writable,
    front_end,
    part_prefix,
    pruned,
    step_dir,
)
from analysis.sources.models import (
    fingerprint,
    load_data,
    load_model,
    weights_key,
)
from train.checkpoint import (
    META,
    STEP_RE,
    CheckpointError,
    check_weights_fit,
    list_checkpoints,
    verify_checkpoint,
)
from train.models import build_model
from train.objectives import uses_labels
from train.run_folder import events_dir


class _Writer:
    """The run's TensorBoard writer, opened on first use (nothing is created when everything is cached)."""

    def __init__(self, run: Run, enabled: bool):
        self.run, self.enabled, self.w = run, enabled, None

    def get(self):
        if self.enabled and self.w is None:
            from torch.utils.tensorboard import SummaryWriter  # deferred: importing tensorboard costs ~1 s

            self.w = SummaryWriter(str(events_dir(self.run.path)), flush_secs=10)
        return self.w

    def close(self):
        if self.w is not None:
            self.w.close()


class AnalysisStopped(KeyboardInterrupt):
    """A stop during :func:`analyze_run` (a KeyboardInterrupt still, for callers that stop on one): ``stats`` as
    analyze_run returns them so far (what was computed and kept, what was reused), ``total`` the results asked."""

    def __init__(self, stats: dict, total: int):
        super().__init__(f"stopped: {len(stats['computed']) + len(stats['reused'])} of {total} results kept")
        self.stats, self.total = stats, total


@contextlib.contextmanager
def held_signals():
    """SIGINT and SIGTERM wait while a measure's result is written (its arrays, cache key, figures): a stop then
    comes right after, with that result whole. In the main thread only (elsewhere nothing changes)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    got: list[int] = []
    old = {s: signal.signal(s, lambda signum, frame: got.append(signum)) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for s, h in old.items():
            signal.signal(s, h)
        if got:
            signal.raise_signal(got[0])


def analyze_run(
    run: Run,
    steps=None,
    opts: S.SuiteOptions | None = None,
    force: bool = False,
    tensorboard: bool = True,
    progress: bool = True,
    before=None,
) -> dict:
    """Run the suite on ``steps`` (default: every checkpoint) of ``run``, reusing cached results.
    Returns {"computed": [(step, measure)], "reused": [(step, measure)], "steps": [...], "skipped": [...]}: steps whose
    checkpoint was deleted while this ran (pruned by a trainer still running) are skipped, not reported as damaged.
    ``before(data, todo)``, when given, is called once the checkpoints are checked and before anything is computed,
    with ``todo`` = {step: [measures not cached]} (python -m analysis estimates their cost there, and may refuse).
    Each result is written as its measure finishes; a KeyboardInterrupt becomes :class:`AnalysisStopped`, with what
    was kept."""
    opts = opts or S.SuiteOptions()
    kept = _kept_without_weights(run, steps, opts, force)
    if kept is not None:
        return kept
    check_writable(run)
    data, fp = load_data(run), fingerprint(run)
    if not steps and not run.external:  # every checkpoint: those complete now (a trainer still running adds and prunes)
        run.checkpoints = {
            int(STEP_RE.match(c.name).group(1)): c for c in list_checkpoints(run.path / "checkpoints", warn=False)
        } or run.checkpoints
    steps = sorted({run.step(s) for s in (steps or sorted(run.checkpoints))})
    problem = S.problem(data, opts, front_end(run))  # e.g. too few probe-train images for the shots: nothing written
    if problem:
        raise AnalysisError(f"run {run.path}: {problem}")
    stats: dict = {"computed": [], "reused": [], "steps": steps, "skipped": [], "not_applicable": [], "model": ""}
    all_gone = AnalysisError(
        f"the checkpoints of run {run.path} to analyse ({', '.join(map(str, steps))}) were deleted while being "
        "analysed (a trainer still running keeps only its last train.keep_last): analyse newer ones, e.g. --steps "
        "last."
    )
    wkeys = _checked_weights(run, steps, data, stats)
    if not wkeys:
        raise all_gone
    keys = {step: {n: storage.cache_key(wkeys[step], fp, opts.settings(n), n) for n in opts.measures} for step in wkeys}
    if before is not None:
        todo = {step: _todo(run, step, opts, keys[step], force) for step in wkeys}
        before(data, {step: t for step, t in todo.items() if t})
    writer = _Writer(run, tensorboard)
    bar = tqdm(total=len(wkeys) * len(opts.measures), desc=f"analyse {run.name}", disable=not progress, unit="measure")
    bars = (lambda **kw: tqdm(**kw, leave=False)) if progress else None  # the measures' own (Context.bar)
    try:
        for step in list(wkeys):
            _analyse_step(run, step, data, opts, keys[step], force, stats, writer, bar, bars)
    except KeyboardInterrupt:
        raise AnalysisStopped(stats, len(wkeys) * len(opts.measures)) from None
    finally:
        writer.close()
        bar.close()
    stats["steps"] = [s for s in steps if s not in stats["skipped"]]
    if not stats["steps"]:
        raise all_gone
    return stats


def _kept_without_weights(run: Run, steps, opts: S.SuiteOptions, force: bool) -> dict | None:
    """The stats of reading back the results of checkpoints that hold no weights any more (a study's results bundle,
    analysis/studies/bundle.py, keeps the numbers and meta.json only) and were analysed (a summary.json): read without
    the images (the fingerprint is the bundle's) or a model, nothing computed; the measures with no result kept there
    (those that do not apply to the model, or were never asked for) are listed as ``not_kept``. None when some
    checkpoint still holds its weights (the usual path, which checks them) or was never analysed."""
    if force or run.external:
        return None
    chosen = sorted({run.step(s) for s in (steps or sorted(run.checkpoints))})
    if any((run.checkpoints[s] / "model.safetensors").is_file() or not (run.checkpoints[s] / META).is_file()
           for s in chosen):  # fmt: skip
        return None  # weights there, or a checkpoint pruned while analysed
    if not all(storage.read_summary(step_dir(run, s)) for s in chosen):
        return None
    fp = fingerprint(run)
    stats: dict = {"computed": [], "reused": [], "steps": chosen, "skipped": [], "not_applicable": [], "model": ""}
    stats["not_kept"] = []
    for s in chosen:
        w = weights_key(run, s)
        todo = _todo(run, s, opts, {n: storage.cache_key(w, fp, opts.settings(n), n) for n in opts.measures}, False)
        stats["reused"] += [(s, n) for n in opts.measures if n not in todo]
        stats["not_kept"] += [(s, n) for n in todo]
    return stats


def _checked_weights(run: Run, steps: list[int], data, stats: dict) -> dict[int, str]:
    """{step: weights key} of the checkpoints to analyse. Every checkpoint is checked before any result is written
    (a corrupted one stops the run here, not midway); one that a trainer still running pruned since the run was
    opened is skipped (``stats["skipped"]``)."""
    wkeys, own = {}, None
    for step in steps:
        try:
            wkeys[step] = weights_key(run, step)
            if run.external:
                continue
            if own is None:  # the recipe's model without weights: do the checkpoints' tensors fit it (cached or not)?
                with torch.device("meta"):
                    own = build_model(run.recipe, data.num_classes if uses_labels(run.recipe) else 0).state_dict()
            try:
                verify_checkpoint(run.checkpoints[step])
                check_weights_fit(own, run.checkpoints[step], part_prefix(run, step))
            except CheckpointError as e:
                raise AnalysisError(str(e)) from None
        except AnalysisError:
            if not pruned(run, step):
                raise
            stats["skipped"].append(step)
            wkeys.pop(step, None)
    return wkeys


def _todo(run: Run, step: int, opts: S.SuiteOptions, keys: dict, force: bool) -> list[str]:
    """The measures of checkpoint ``step`` with no cached result under ``keys`` (all of them with ``force``)."""
    return [n for n in opts.measures if force or not storage.is_cached(step_dir(run, step), n, keys[n])]


def _analyse_step(
    run: Run, step: int, data, opts: S.SuiteOptions, keys: dict, force: bool, stats: dict, writer, bar, bars=None
):
    """The measures of one checkpoint that are not cached (all with ``force``): computed, and each published as it
    finishes; ``bar`` ticks once per measure and shows the stage under way; ``bars`` makes the measures' own."""
    todo = _todo(run, step, opts, keys, force)
    stats["reused"] += [(step, n) for n in opts.measures if n not in todo]
    bar.update(len(opts.measures) - len(todo))  # cached: done at once
    if not todo:
        return
    try:
        model = load_model(run, step, data)
    except AnalysisError:
        if not pruned(run, step):
            raise
        stats["skipped"].append(step)
        return

    def keep(name: str, result: dict, meta: dict) -> None:  # written at once: a stop after it keeps it
        with held_signals():
            stages(f"{name}: figures, TensorBoard")
            publish_step(run, step, {"meta": meta, name: result}, writer.get(), {name: keys[name]})
            stats["computed"].append((step, name))
            stages.done(name)

    try:
        res = S.run_suite(
            model,
            data,
            opts,
            measures=todo,
            on_stage=(stages := _Stages(bar, step, todo)),
            on_result=keep,
            progress=bars,
        )
    except MeasureError as e:  # an option the model cannot serve (cka.repr=cls without a class token)
        raise AnalysisError(f"run {run.path}: {e}") from None
    meta = res["meta"]
    stats["model"] = f"a {meta['arch']}" + (
        " without a class token" if meta["arch"] == "vit" and not meta["num_prefix_tokens"] else ""
    )
    stats["not_applicable"] += [n for n in todo if n not in res and n not in stats["not_applicable"]]
    if not stats["computed"] and not stats["reused"] and len(res) == 1:  # nothing asked applies: say so, write nothing
        raise AnalysisError(
            f"run {run.path}: {' and '.join(todo)} {'does' if len(todo) == 1 else 'do'} not apply to this model "
            f"({stats['model']}): see python -m analysis --list for what each measure needs."
        )
    bar.update(len(todo) - sum(1 for n in todo if n in res))  # measures that do not apply to this model


class _Stages:
    """The suite's ``on_stage`` for the offline progress bar: the stage under way as its postfix (``step 600: cka``),
    and one tick per measure as its result is kept (:meth:`done`)."""

    def __init__(self, bar, step: int, measures: list[str]):
        self.bar, self.step, self.measures = bar, step, set(measures)

    def __call__(self, stage: str) -> None:
        self.bar.set_postfix_str(f"step {self.step}: {stage}")

    def done(self, name: str) -> None:
        self.bar.update(1)


def publish_step(run: Run, step: int, res: dict, writer, keys: dict) -> None:
    """Arrays and cache keys to analysis/step_X/, PNGs to figures/step_X/, scalars and images to TensorBoard."""
    publish.publish(
        res,
        step_dir(run, step),
        writer,
        step,
        keys=keys,
        figure_dir=step_dir(run, step, "figures"),
        part=run.part,
        titled=not run.external,  # a model from elsewhere has no training step to name
    )
