r"""``python -m analysis RUN_DIR`` (also ``./launch.sh analyze RUN_DIR``): the analysis suite on a run's saved
checkpoints, cached, with figures, TensorBoard and report.md.

    python -m analysis runs/default                          every checkpoint, the core four measures
    python -m analysis runs/default --steps 600,1800 --measures all
    python -m analysis runs/default --measures knn,clustering --opt knn.k=10 --opt fewshot_probe.shots=5
    python -m analysis runs/vit --against runs/resnet        cross-model CKA (Raghu Fig. 2) at the last checkpoints
    python -m analysis runs/subset --against runs/full:1800  + per-layer CKA of same-index layers (Fig. 12)
    python -m analysis runs/vit --against runs/resnet --measures similarity --opt similarity.estimator=mutual_knn
                                                              + a similarity map calibrated by its permutation null
    python -m analysis --model timm:vit_tiny_patch16_224 --weights vit.safetensors --recipe recipes/my_data.yaml
    python -m analysis runs/dino --part teacher              DINO's EMA teacher (results in analysis/teacher/)
    python -m analysis runs/dino --part teacher --against runs/dino   teacher vs student, layer by layer
    python -m analysis --model timm:vit_small_patch16_224.dino --weights dino_vits16.safetensors \
        --set data.img_size=224 data.in_chans=3               a public DINO ViT-S/16 (a hub model.safetensors)
    python -m analysis --model timm:vit_small_patch14_dinov2 --weights FILE --images photos
                                                              a published ViT on the bundled photos (or --images DIR)

Before it computes, it says what each measure will cost on this model and these images (a forward and a backward
timed here: analysis/engine/cost.py); past 10 minutes it asks for --yes and names cheaper options. Long measures
(erf, ablation) show their own progress with an ETA. Ctrl-C or SIGTERM stops it: the results that finished are kept
(each is written as its measure finishes), one line says how many, exit 0; the same command again continues.

Exit codes: 0 done, or stopped; 2 bad input, or an estimate past 10 minutes without --yes (one sentence on stderr
naming the problem; nothing is written).
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import re
import shutil
import signal
import sys
import textwrap
import threading
import typing
import warnings
from pathlib import Path
from typing import TYPE_CHECKING

import yaml

from analysis.results.folders import AnalysisError, check_run_folder
from analysis.sources.spec import check_model_spec
from train.coerce import did_you_mean

# The analysis stack (torch, timm, matplotlib: 5-20 s of imports on a loaded machine) is imported by the functions that
# use it, after the arguments are parsed: --help, a bad option and a mistyped run folder are answered at once.
if TYPE_CHECKING:
    from analysis.engine import suite as S


def check_names(names: list[str] | None, opt: dict) -> None:
    """MeasureError (one sentence, with the closest name) for a mistyped measure in ``names`` or ``opt`` (``{measure:
    {option: value}}``) or a mistyped option; names of the form package.module:Class are left to the registry."""
    from analysis.engine.measure import MeasureError, registry, resolve

    known = registry()
    for n in [*(names or []), *opt]:
        if n != "all" and ":" not in n and n not in known:
            raise MeasureError(
                f"unknown measure '{n}'{did_you_mean(n, known)}: python -m analysis --list shows every measure "
                "(or give package.module:Class)."
            )
    for m, vals in opt.items():
        fields = [f.name for f in dataclasses.fields(registry()[resolve(m)].Options)]
        for k in vals:
            if k not in fields:
                raise MeasureError(
                    f"unknown option '{m}.{k}'{did_you_mean(k, fields, f'{m}.')}: the options of {m} are "
                    f"{', '.join(fields) or 'none'}."
                )


def measure_options(measures: str | None, batch_size: int, opt_items: list[str]) -> S.SuiteOptions:
    """SuiteOptions from ``--measures`` (comma-separated), the batch size and ``--opt`` items (MeasureError, one
    sentence naming the closest name, for an unknown measure or option). Shared by python -m analysis and compare."""
    from analysis.engine import suite as S
    from analysis.engine.measure import MeasureError

    names = [m.strip() for m in measures.split(",")] if measures is not None else None
    if names is not None and "" in names:
        raise MeasureError(
            f"--measures '{measures}' has an empty name: list names separated by single commas, e.g. cka,knn."
        )
    opt = S.parse_opt_args(opt_items)
    check_names(names, opt)
    return S.suite_options(names, batch_size, opt)


# ---------------------------------------------------------------- --list


def _type_text(tp) -> str:
    """An option's type as a user writes it: ``one of a, b``, ``true or false``, ``list of integers``, ..."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is typing.Union or (origin is not None and type(None) in args):
        inner = [a for a in args if a is not type(None)]
        return f"{_type_text(inner[0])} or null" if len(inner) == 1 else " or ".join(map(_type_text, inner))
    if origin is typing.Literal:
        return "one of " + ", ".join(map(str, args))
    if origin in (tuple, list):
        item = args[0] if args else str
        if typing.get_origin(item) is typing.Literal:
            return "a list of " + ", ".join(map(str, typing.get_args(item)))
        return f"a list of {_type_text(item).removeprefix('a ').removeprefix('an ')}s"
    return {bool: "true or false", int: "an integer", float: "a number", str: "a string"}.get(
        tp, getattr(tp, "__name__", str(tp))
    )


def _option_comments(options_cls) -> dict[str, str]:
    """The comment after each field of an Options dataclass in its source (its explanation), {field: comment}."""
    try:
        lines = inspect.getsource(options_cls).splitlines()
    except (OSError, TypeError):
        return {}
    out: dict[str, str] = {}
    field = None
    for line in lines[1:]:
        if re.match(r"\s+(def |@)", line):
            break
        m = re.match(r"\s{4}(\w+)\s*:", line)
        field = m.group(1) if m else field
        c = re.search(r"#\s*(.*)$", line)
        if field and c and not line.lstrip().startswith("#"):
            out[field] = f"{out[field]} {c.group(1)}" if field in out else c.group(1)
    return out


def _yaml(value) -> str:
    """A value as it is written after --opt (YAML: true, null, [a, b])."""
    return yaml.safe_dump(value, default_flow_style=True, width=1000).removesuffix("\n...\n").strip()


def describe(name: str, cls, width: int) -> str:
    """One measure for --list: its name, the first paragraph of its docstring whole, and every option with its default,
    the values it takes and its explanation."""
    from analysis.engine.measure import options_dict

    doc = inspect.cleandoc(cls.__doc__ or "").split("\n\n")[0].replace("``", "")
    text = " ".join(doc.split())  # never broken at a hyphen: "pixel-to-pixel" stays one word
    lines = [name, textwrap.fill(text, width, initial_indent="    ", subsequent_indent="    ", break_on_hyphens=False)]
    hints = typing.get_type_hints(cls.Options)
    comments = _option_comments(cls.Options)
    defaults = options_dict(cls.Options())
    if not defaults:
        lines.append("    options: none")
    for k, v in defaults.items():
        text = f"{_type_text(hints[k])}" + (f"; {comments[k]}" if k in comments else "")
        lines.append(
            textwrap.fill(
                f"--opt {name}.{k}={_yaml(v)}: {text}", width, initial_indent="    ", subsequent_indent="        "
            )
        )
    return "\n".join(lines)


def list_measures(extra: str | None) -> str:
    """Every registered measure (and the package.module:Class measures named in ``extra``, a --measures value) for
    --list, wrapped to the terminal's width."""
    from analysis.engine.measure import registry, resolve

    for n in (extra or "").split(","):
        if ":" in n:
            resolve(n.strip())
    width = max(60, min(120, shutil.get_terminal_size((100, 24)).columns))
    return "\n\n".join(describe(n, cls, width) for n, cls in sorted(registry().items()))


def options(args) -> S.SuiteOptions:
    """SuiteOptions from the command line (MeasureError, one sentence, for an unknown measure or option); without
    --batch-size the suite's default minibatch (a model from elsewhere then gets one sized to it:
    :func:`sized_minibatch`)."""
    from analysis.engine import suite as S

    opts = measure_options(args.measures, S.MAX_MINIBATCH if args.batch_size is None else args.batch_size, args.opt)
    return opts if args.max_memory is None else dataclasses.replace(opts, max_memory=S.parse_memory(args.max_memory))


def sized_minibatch(run, model, opts) -> int:
    """The analysis minibatch of a model from elsewhere when --batch-size is not given, said in one line: the largest
    (up to the suite's default) whose taps for the measures that need a whole minibatch at once (minibatch CKA) fit
    the memory budget (--max-memory, else half the memory available) with room for a chunk of the other taps
    (:func:`analysis.engine.suite.plan_chunks`). A vitlab run keeps the default (its models are small; its cached
    results were made with it)."""
    from analysis.engine import suite as S
    from analysis.sources import models as MS

    data = MS.load_data(run)
    ctx = S.make_context(model, data, S.MAX_MINIBATCH)
    ms = S.make_measures(ctx, opts)
    per = S.tap_bytes(model, data.normalize(data.analysis.images[:1]), set().union(*(m.taps() for m in ms)))
    whole = sum(per[t] for m in ms if not m.chunkable for t in m.taps())
    budget = S.memory_budget(ctx, opts)
    room = budget - S.TEMPORARIES * 4 * sum(per.values())  # a chunk of 4 images of every tap beside them
    bs = S.choose_minibatch(int(S.TEMPORARIES * whole) or 1, max(int(room), 0), len(data.analysis), share=1.0)
    what = f"its minibatch-CKA taps {_size(bs * whole)}" if whole else "its taps forwarded in chunks"
    print(
        f"{run.label}: minibatch {bs} ({what}, within a memory budget of {_size(budget)}: --batch-size N / "
        "--max-memory SIZE to choose)",
        file=sys.stderr,
    )
    return bs


def _size(n: int) -> str:
    """Bytes as GiB to one decimal, or MiB below a tenth of a GiB."""
    return f"{n / 2**30:.1f} GiB" if n >= 2**30 / 10 else f"{n / 2**20:.0f} MiB"


def runnable(run, opts: S.SuiteOptions, asked: str | None) -> S.SuiteOptions:
    """``opts`` less what cannot run on the run's images. With ``--measures all`` what can run runs: each measure that
    reads labels the images lack or whose precondition fails (too few probe-train images for its shots, ...) is
    skipped with one line naming it and why. A measure named explicitly is refused instead, with one sentence
    (AnalysisError) naming what is missing and the flag that gives it, before anything is written."""
    from analysis.engine import fixes
    from analysis.engine import suite as S
    from analysis.results import runs as RF
    from analysis.sources import models as MS

    data, front = MS.load_data(run), RF.front_end(run)
    if (asked or "").strip() == "all":
        skipped = S.data_problems(data, opts)
        for line in fixes.skip_lines(skipped, front):
            print(line, file=sys.stderr)
        opts = dataclasses.replace(opts, measures=tuple(m for m in opts.measures if m not in skipped))
        if not opts.measures:
            raise AnalysisError("no measure can run on these images (each one's reason is above).")
    problem = S.problem(data, opts, front)
    if problem:
        raise AnalysisError(problem)
    return opts


class Parser(argparse.ArgumentParser):
    """argparse's parser, with the closest option named for an unknown one (``--mesures``: did you mean --measures?)."""

    def error(self, message: str):
        words = re.findall(r"(?<!\S)(--?[\w-]+)", message.partition(":")[2]) if "unrecognized" in message else []
        known = [o for a in self._actions for o in a.option_strings]
        hints = [f"{w}{did_you_mean(w.partition('=')[0], known)}" for w in words]
        if any("did you mean" in h for h in hints):
            message = f"unrecognized arguments: {' '.join(hints)}"
        super().error(message)


def parser() -> argparse.ArgumentParser:
    intro, _, rest = __doc__.partition("\n\n")
    p = Parser(
        prog="python -m analysis",
        description=intro,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=rest,
    )
    p.add_argument("run", nargs="?", help="run folder (runs/<name>)")
    p.add_argument("--steps", help="comma-separated checkpoint steps, or 'last' (default: every checkpoint)")
    p.add_argument(
        "--measures",
        help="comma-separated measure names, or 'all' (default: cka,norm_ratio,attention_distance,fewshot_probe)",
    )
    p.add_argument(
        "--part",
        help="the network of a self-supervised checkpoint to analyse: student (default; the backbone) "
        "or another part its objective saves, e.g. teacher (DINO); results go to analysis/<part>/, labelled",
    )
    p.add_argument(
        "--against",
        action="append",
        default=[],
        metavar="OTHER_RUN[:STEP]",
        help="cross-run CKA against another run's checkpoint (default its last), and the similarity measure's "
        "calibrated cross-model map when --measures names it; repeatable",
    )
    p.add_argument(
        "--model",
        help="analyse a model not trained here: timm:<architecture>, hf:<hub name or save_pretrained folder> "
        "(transformers) or open_clip:<architecture>",
    )
    p.add_argument(
        "--weights",
        help="with --model timm: or open_clip: a weights file (.safetensors; 'pretrained' downloads timm's weights)",
    )
    p.add_argument(
        "--recipe",
        default=None,
        help="with --model: the recipe whose data section to use (default: the project's "
        "recipes/default.yaml; with --images only its run root is used)",
    )
    p.add_argument(
        "--set",
        dest="overrides",
        action="extend",
        nargs="+",
        default=[],
        metavar="KEY=VALUE",
        help="with --model: recipe overrides, e.g. data.img_size=224 data.in_chans=3",
    )
    p.add_argument(
        "--images",
        help="with --model: analyse these images instead of a recipe's: a folder (one subfolder per class "
        "for labels; a flat folder is unlabelled) or 'photos' (19 photos that ship with scikit-image and scikit-learn, "
        "as seeded crops), prepared by the model's own preprocessing",
    )
    p.add_argument(
        "--probe-images", help="with --images DIR: a folder with the same class subfolders to train probes and k-NN on"
    )
    p.add_argument(
        "--preprocessing",
        choices=("model", "recipe"),
        default="model",
        help="with --model and a recipe's data: normalise by the model's pretrained mean/std (model, default) or the "
        "data's own (recipe: as a run trained here, to compare the two with --against)",
    )
    p.add_argument("--out", help="with --model: the output folder (default runs/external-<architecture>)")
    p.add_argument(
        "--batch-size",
        type=int,
        default=None,
        help="analysis minibatch (also the CKA minibatch, >= 4; default 256, and for a --model one sized to the model "
        "and the memory available, printed)",
    )
    p.add_argument(
        "--max-memory",
        metavar="SIZE",
        help="memory the analysis may take beyond the model and the images, e.g. 4GiB (default: half of what is "
        "available): a minibatch whose taps do not fit is forwarded in chunks",
    )
    p.add_argument(
        "--opt",
        action="append",
        default=[],
        metavar="MEASURE.OPTION=VALUE",
        help="a measure's option, e.g. --opt knn.k=10 --opt cka.repr=cls (python -m analysis --list shows them); "
        "repeatable",
    )
    p.add_argument("--force", action="store_true", help="recompute even when cached results exist")
    p.add_argument("--no-tensorboard", action="store_true", help="write no TensorBoard events (files and report only)")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.add_argument(
        "--yes",
        action="store_true",
        help="go on when the estimated cost is past 10 minutes (without it such an analysis is refused, with the "
        "estimate and cheaper options)",
    )
    p.add_argument(
        "--list",
        action="store_true",
        help="list the measures (with --measures pkg.module:Class, yours too), their options and values, and exit",
    )
    return p


def check_target(args) -> None:
    """What can be said of the target without the analysis stack (torch): the arguments that name it, and a run
    folder that does not exist or is none (AnalysisError, one sentence)."""
    if args.model:
        check_model_spec(args.model, args.weights)
        return
    if args.images or args.probe_images:
        raise AnalysisError(
            "--images analyses a model from elsewhere: pass it with --model timm:<arch> --weights FILE."
        )
    if not args.run:
        raise AnalysisError(
            "no run given: pass a run folder (python -m analysis runs/default) or --model timm:<arch> --weights FILE."
        )
    check_run_folder(args.run)


def open_target(args):
    """The run to analyse (its arguments checked by :func:`check_target`): a run folder, or a model from elsewhere
    (--model) with its weights and images."""
    from analysis.results import runs as RF
    from analysis.sources import models as MS

    if args.model:
        recipe = args.recipe or str(Path(__file__).resolve().parents[2] / "recipes" / "default.yaml")
        return MS.external_run(
            args.model,
            args.weights,
            recipe,
            args.overrides,
            args.out,
            args.images,
            args.probe_images,
            args.preprocessing,
        )
    return RF.open_run(args.run)


def parse_steps(run, text: str | None) -> list[str] | None:
    """--steps as a list (every step checked before any work), or None for every checkpoint."""
    steps = [s.strip() for s in text.split(",")] if text is not None else None
    if steps is not None and "" in steps:
        raise AnalysisError(
            f"--steps '{text}' has an empty step: list steps separated by single commas, e.g. 600,1800."
        )
    for s in steps or []:
        run.step(s)
    return steps


def analyse(args) -> tuple:
    """Every input checked, then the analysis and the --against comparisons: (run, stats); AnalysisError if bad.
    What needs no torch is checked first (:func:`check_target`), so a mistyped run folder is said at once."""
    check_target(args)
    from analysis.engine import suite as S
    from analysis.engine.measure import MeasureError
    from analysis.frontends import runner as RN
    from analysis.measures.similarity import cross_line
    from analysis.reports import cross as XC
    from analysis.results import runs as RF
    from analysis.sources import models as MS

    try:
        opts = options(args)
    except MeasureError as e:
        raise AnalysisError(str(e)) from None
    run = open_target(args)
    RF.select_part(run, args.part)
    steps = parse_steps(run, args.steps)
    others = [RF.parse_against(a) for a in args.against]
    for other, _ in others:
        XC.check_same_images(run, other)
    if run.external:  # check that the weights fit before anything is written; size the minibatch to the model
        model = MS.load_model(run, 0, MS.load_data(run))
        if args.batch_size is None:
            opts = dataclasses.replace(opts, batch_size=sized_minibatch(run, model, opts))
        del model
    opts = runnable(run, opts, args.measures)
    progress = not args.no_progress
    try:
        try:
            stats = RN.analyze_run(
                run,
                steps,
                opts,
                force=args.force,
                tensorboard=not args.no_tensorboard,
                progress=progress,
                before=lambda data, todo: check_cost(run, data, opts, todo, args.yes),
            )
        except RN.AnalysisStopped as e:
            return run, {**e.stats, "stopped": e.total}
        for other, ostep in others:
            a = XC.against(run, other, ostep, steps[-1:] if steps else None, opts, force=args.force, progress=progress)
            for step, res in a["results"].items():
                line = f"{run.label}@{step} vs {other.label}@{ostep}: mean CKA {res['matrix'].mean():.3f}"
                if "same_index" in res:
                    line += ", same-index layers " + " ".join(f"{v:.2f}" for v in res["same_index"])
                print(line)
            for step, res in a["similarity"].items():
                print(f"{run.label}@{step} vs {other.label}@{ostep}: {cross_line(res)}")
    except (MemoryError, RuntimeError) as e:
        if not S.out_of_memory(e):
            raise
        raise AnalysisError(
            f"not enough memory to analyse in minibatches of {opts.batch_size}: pass a smaller --batch-size, e.g. "
            f"--batch-size {max(4, opts.batch_size // 2)}."
        ) from None
    return run, stats


def check_cost(run, data, opts: S.SuiteOptions, todo: dict, yes: bool) -> None:
    """Say what the measures still to compute (``todo``: {step: [measures]}) will cost (analysis/engine/cost.py:
    their work times a forward and a backward of this model timed here), on stderr, when a measure has work of its own
    (erf, ablation) or the whole takes a minute or more; past
    :data:`analysis.engine.cost.CONFIRM_S` without ``yes``, refuse (AnalysisError, one sentence with the estimate,
    --yes and the cheaper options)."""
    if not todo:
        return
    from analysis.engine import cost as C
    from analysis.engine import suite as S
    from analysis.sources import models as MS

    first = min(todo)
    model = MS.load_model(run, first, data)
    ctx = S.make_context(model, data, opts.batch_size, None, opts.order_seed)
    problem = S.model_problem(ctx, opts, sorted({n for names in todo.values() for n in names}))
    if problem:  # the runner's sentence, before the estimate of an analysis that cannot run
        raise AnalysisError(f"run {run.path}: {problem}")
    est, timing = None, None
    for _, names in sorted(todo.items()):
        e = C.estimate(ctx, opts, names, timing)
        timing = e.timing
        if est is None:
            est = e
        else:
            est.add(e)
    del model, ctx
    steps = sorted(todo)
    what = (
        f"{'1 checkpoint' if len(steps) == 1 else f'{len(steps)} checkpoints'} of {run.label}, "
        f"{len(data.analysis)} images"
    )
    if est.total >= C.SAY_S or est.measures:  # the minutes of erf and ablation, or a long shared pass
        for line in C.lines(est, what):
            print(line, file=sys.stderr)
    if est.total > C.CONFIRM_S and not yes:
        costly = ", ".join(f"{n} ~{C.duration(s)}" for n, s in sorted(est.measures.items(), key=lambda kv: -kv[1]))
        cheaper = C.cheaper(est, opts)
        raise AnalysisError(
            f"this analysis would take about {C.duration(est.total)} here ({costly or 'the shared pass'}): pass --yes "
            "to go on, or make it cheaper"
            + (f" with {' or '.join(cheaper)}" if cheaper else "")
            + " or fewer --measures, --steps or images."
        )


class StopSignals:
    """SIGTERM (a scheduler, ``kill``) stops an analysis as Ctrl-C does: the first of them raises KeyboardInterrupt
    (the results that finished are kept), the others are ignored while it stops (SIGKILL forces). Main thread only;
    the handlers before are restored on exit."""

    def __init__(self):
        self.signum: int | None = None
        self.old: dict = {}

    def __call__(self, signum, frame) -> None:
        if self.signum is None:
            self.signum = signum
            raise KeyboardInterrupt

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            self.old = {s: signal.signal(s, self) for s in (signal.SIGINT, signal.SIGTERM)}
        return self

    def __exit__(self, *exc) -> None:
        for s, h in self.old.items():
            signal.signal(s, h)


def say_stopped(run, stats: dict) -> None:
    """The run report of what was kept, and the one line of a stop."""
    from analysis.reports.run_report import write_run_report
    from analysis.results import runs as RF

    kept = len(stats["computed"]) + len(stats["reused"])
    where = RF.step_dir(run, stats["steps"][0]).parent if stats.get("steps") else run.path
    if stats["computed"] or stats["reused"]:
        write_run_report(run)
    print(f"stopped: {kept} of {stats['stopped']} results kept in {where}; run the same command again to continue.")


def say_done(run, stats: dict) -> None:
    """The closing lines: measures that did not apply, steps pruned meanwhile, counts and where the report is."""
    from analysis.reports.run_report import write_run_report
    from analysis.results import runs as RF

    if stats.get("stopped") is not None:
        say_stopped(run, stats)
        return

    if stats["not_applicable"]:
        print(
            f"{run.label}: {', '.join(stats['not_applicable'])}: not applicable to this model ({stats['model']}), "
            "nothing computed"
        )
    if stats["skipped"]:
        print(
            f"{run.label}: skipped step(s) {', '.join(map(str, stats['skipped']))}: deleted while being analysed (a "
            "trainer still running keeps only its last train.keep_last checkpoints)"
        )
    report = write_run_report(run)  # the report shows the default part; another part's results are in its own folder
    where = (
        f"results in {RF.step_dir(run, stats['steps'][-1]).parent}"
        if run.part != RF.DEFAULT_PART
        else f"report: {report}"
    )
    print(
        f"{run.label}: {len(stats['computed'])} results computed, {len(stats['reused'])} reused from cache "
        f"(steps {', '.join(map(str, stats['steps']))}); {where}"
    )


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    warnings.filterwarnings("ignore", message=".*pin_memory.*")
    with StopSignals():
        try:
            return _main(args)
        except KeyboardInterrupt:  # before any result was computed (imports, checks, the estimate)
            print("stopped: nothing computed yet; run the same command again to start.")
            return 0


def _main(args) -> int:
    try:
        if args.list:
            from analysis.engine.measure import MeasureError

            try:
                print(list_measures(args.measures))
            except MeasureError as e:
                raise AnalysisError(str(e)) from None
            return 0
        run, stats = analyse(args)
    except AnalysisError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except OSError as e:  # a write refused midway (a full disk, a sub-folder not writable): the results written stay
        print(
            f"error: cannot write {e.filename or 'the results'} ({e.strerror or e}): free space or make it writable, "
            "then run this again (what was written is reused).",
            file=sys.stderr,
        )
        return 2
    say_done(run, stats)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
