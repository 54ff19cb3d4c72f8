"""``./launch.sh study recipes/studies/NAME.yaml``: train every run a study needs, analyse them, write its report.

A study file names runs (a recipe plus overrides each), a root folder and a report path::

    study: raghu2021
    root: runs/study-raghu2021
    report: docs/reproduction.md     # and docs/reproduction.json beside it: the committed report (below)
    set: ["callbacks=[]"]            # overrides shared by every run
    seeds: [0, 1]                    # every run once per seed: vit_cls_s0, vit_cls_s1, ... (recipe key seed=S)
    options: {cka: {layers: paper}}  # measure options for every analysis of the study {measure: {option: value}}
    measures: [cka, erf]             # measured at every run's last checkpoint (a run may list its own)
    every_checkpoint: [attention_distance]   # measured at every checkpoint (default: the core four)
    runs:
      vit_cls: {recipe: ../default.yaml}
      noskip_b3: {recipe: ../default.yaml, set: ["interventions.no_skip={blocks: [3]}"], seeds: [0, 1, 2]}

With ``seeds`` (the study's, or a run's own, which replaces it) a run is one CONFIGURATION trained once per seed, in
folders NAME_sSEED; the claims compare configurations seed by seed and judge each effect against the seed-to-seed
difference of the same configuration (analysis/studies/claims.py). Without seeds a run is trained once, under its
name, with its recipe's seed.

Stages (``--stage``, default all): ``train`` (finished runs skipped, interrupted ones resumed, every run's
recipe validated before the first starts; ``--jobs N`` trains N runs at once with 1/N of the cores each, ``--only
CONFIG ...`` those configurations only), ``analyze`` (the offline suite on every checkpoint, cached; ``--only`` analyses
those configurations or runs only, so several processes can share the work: each writes only its own runs' caches),
and
``report`` (cross-run comparisons and the claims document, see analysis/studies/study_report.py).

``go_no_go: true`` on a run makes its configuration a pilot: its first seed trains to the second scheduled checkpoint
(``--stop-after``), where its training-time attention distance callback decides (analysis/studies/claims.py
``go_no_go``): on a go every seed trains to the end, on a no-go the configuration stops there and the report says why. A
study thereby spends its hours on a long regime only when that regime shows what it was chosen for.

Where the report goes: ``--report FILE`` when given; else the study file's ``report`` unless it lies in the
repository's committed ``docs/`` (then it is the study's *committed* report, rewritten only when ``--report`` names
it, e.g. ``--report docs/reproduction.md``); else ``ROOT/report.md`` beside the study's runs (figures in
``ROOT/figures/<study>/``). A rerun thereby never overwrites the committed documents by accident.

Every report written from the runs also writes the study's results bundle beside it (``<report folder>/bundles/
<report name>/``: the compact numbers the report read, no weights; analysis/studies/bundle.py). ``--stage report`` on a
checkout with no run of the study reads that bundle instead (beside the report, else beside the committed report:
``docs/bundles/<report name>/``), and ``--from-bundle [DIR]`` names one: the report is regenerated from it alone, and
says so in its first paragraph.
"""

from __future__ import annotations

import argparse
import sys
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar

import yaml

from train.errors import RunsStopped
from train.recipe import RecipeError, load_recipe
from train.sweep import launch_runs

# The analysis stack (torch, timm, matplotlib) is imported by the functions that use it, so --help, a bad argument
# and a study file that is missing or not YAML are answered at once.
if TYPE_CHECKING:
    from analysis.engine.suite import SuiteOptions

ROOT = Path(__file__).resolve().parents[2]  # the repository (this file is analysis/studies/study.py)
DOCS = ROOT / "docs"  # the committed documents: a study writes there only when --report names the file


@dataclass
class StudyRun:
    name: str
    recipe: Path
    overrides: list[str]
    run_dir: Path
    measures: list[str] | None = None  # measured at the last checkpoint (None: the study's list)
    config: str = ""  # the run's name in the study file (several seeds share it)
    seed: int | None = None  # None: the recipe's own seed (a study without seeds)
    go_no_go: bool = False  # its configuration trains on only after its first run passes the pilot check


@dataclass
class Study:
    name: str
    path: Path
    root: Path
    report: Path | None  # where the report is written (module docstring: --report, the file's, or ROOT/report.md)
    runs: dict[str, StudyRun] = field(default_factory=dict)
    measures: list[str] | None = None  # measured at every run's last checkpoint (None: every registered measure)
    options: dict = field(default_factory=dict)  # {measure: {option: value}} for every analysis of the study
    every_checkpoint: list[str] | None = None  # measured at every checkpoint of every run (None: the core four)
    paper: str | None = None  # the paper plug-in that judges it (analysis/studies/<paper>/); None: found by name
    committed: Path | None = None  # the study file's report in docs/, not written unless --report names it
    bundle: dict | None = None  # the manifest of the results bundle read as the root (analysis/studies/bundle.py)
    reread: ClassVar[str] = "--stage report"  # the option that makes a report read its results bundle

    @property
    def rerun(self) -> str:
        """The command that rewrites the report and its results bundle from the runs."""
        from analysis.results.storage import shown

        return f"./launch.sh study {shown(self.path)} --stage report"

    def committed_note(self) -> str:
        """`` (the committed docs/... is left as it is: --report docs/... rewrites it)`` when the study file's report
        lies in docs/ and this run writes elsewhere, else ``''``."""
        if self.committed is None:
            return ""
        rel = self.committed.relative_to(ROOT) if self.committed.is_relative_to(ROOT) else self.committed
        return f" (the committed {rel} is left as it is: --report {rel} rewrites it)"

    def command(self) -> str:
        """The command that writes this report: ``./launch.sh study FILE``, with ``--report`` when it goes to docs/."""
        from analysis.results.storage import shown  # repository-relative, never the machine's absolute path

        cmd = f"./launch.sh study {shown(self.path)}"
        if self.report is not None and self.report.is_relative_to(DOCS):
            cmd += f" --report {self.report.relative_to(ROOT)}"
        return cmd

    def suite_options(self, measures=None) -> SuiteOptions:
        """The suite options of an analysis of this study: ``measures`` with the study's measure options."""
        from analysis.engine.suite import suite_options

        return suite_options(measures, options=self.options)

    def configs(self) -> dict[str, list[StudyRun]]:
        """Configuration name -> its runs, in seed order (seed i of two configurations is compared with each other)."""
        out: dict[str, list[StudyRun]] = {}
        for r in self.runs.values():
            out.setdefault(r.config, []).append(r)
        return out


KEYS = ("study", "paper", "root", "report", "set", "seeds", "options", "runs", "measures", "every_checkpoint")
RUN_KEYS = ("recipe", "set", "measures", "seeds", "go_no_go", "init")
INITS = ("shared", "own")


def load_study(path: str | Path, root: str | Path | None = None, report: str | Path | None = None) -> Study:
    """Read and check a study file (every run's recipe is loaded and validated); raise RecipeError. ``root`` and
    ``report`` replace the file's (relative paths against the current directory). The paper plug-in's ``defaults``
    fill the keys the file leaves out (e.g. its seeds)."""
    path = Path(path)
    if not path.is_file():
        raise RecipeError(
            f"study file '{path}' does not exist: pass a YAML file such as recipes/studies/raghu2021.yaml."
        )
    try:
        d = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as e:
        raise RecipeError(f"study file '{path}' is not valid YAML ({str(e).splitlines()[0]}).") from None
    if not isinstance(d, dict):
        raise RecipeError(f"study file '{path}' must be a mapping with keys {', '.join(KEYS)}.")
    unknown = set(d) - set(KEYS)
    if unknown:
        raise RecipeError(f"study file '{path}' has unknown key(s) {sorted(unknown)}: allowed are {', '.join(KEYS)}.")
    if not isinstance(d.get("runs"), dict) or not d["runs"]:
        raise RecipeError(
            f"study file '{path}' needs a 'runs:' mapping of name -> {{recipe: FILE, set: [KEY=VALUE, ...]}}."
        )
    paper = _paper(d, path)
    if paper is not None:
        from analysis.studies import papers

        d = {**papers()[paper].defaults, **d}
    shared = list(d.get("set") or [])
    if root is not None:
        root = Path(root).resolve()
    else:
        root = Path(d.get("root") or f"runs/study-{d.get('study', path.stem)}")
        root = root if root.is_absolute() else ROOT / root
    committed = (ROOT / d["report"]).resolve() if d.get("report") else None
    if report is not None:
        report = Path(report).resolve()
    elif committed is not None and not committed.is_relative_to(DOCS):
        report = committed
    else:
        report = root / "report.md"
    measures = _measures(d.get("measures"), path)
    options = _options(d.get("options"), path)
    seeds = _seeds(d.get("seeds"), f"study file '{path}'")
    study = Study(
        str(d.get("study", path.stem)),
        path,
        root,
        report,
        paper=paper,
        measures=measures,
        options=options,
        every_checkpoint=_measures(d.get("every_checkpoint"), path),
        committed=committed if committed is not None and committed != report else None,
    )
    for name, spec in d["runs"].items():
        _add_runs(study, name, spec, path, shared, seeds)
    return study


def _add_runs(study: Study, name: str, spec, path: Path, shared: list[str], seeds: list[int] | None) -> None:
    """Check one entry of the study file's ``runs:`` and add its runs (one per seed) to ``study``."""
    if not isinstance(spec, dict) or "recipe" not in spec or set(spec) - set(RUN_KEYS):
        raise RecipeError(
            f"study run '{name}' must be a mapping {{recipe: FILE, set: [KEY=VALUE, ...], measures: [...], seeds: "
            "[...]}."
        )
    recipe = (path.parent / spec["recipe"]).resolve()
    overrides = shared + list(spec.get("set") or [])
    run_seeds = _seeds(spec["seeds"], f"study run '{name}'") if "seeds" in spec else seeds
    init = spec.get("init", "shared")
    if init not in INITS:
        raise RecipeError(
            f"study run '{name}': init must be shared (the same initial weights as every configuration's run of the "
            f"same seed) or own (weights of its own), not {init!r}."
        )
    gate = spec.get("go_no_go", False)
    if not isinstance(gate, bool):
        raise RecipeError(f"study run '{name}': go_no_go must be true or false, not {gate!r}.")
    if run_seeds is not None and any(o.split("=", 1)[0].strip() == "seed" for o in overrides):
        raise RecipeError(
            f"study run '{name}' sets 'seed=' in set: and the study gives seeds: give the seed in one place only."
        )
    for seed in run_seeds if run_seeds is not None else [None]:
        run_name = name if seed is None else f"{name}_s{seed}"
        if run_name in study.runs:
            raise RecipeError(
                f"study run '{run_name}' is named twice (a run name ending in _sN collides with a seeded run): "
                "rename it."
            )
        ov = overrides if seed is None else [*overrides, f"seed={seed}"]
        if init == "own":  # weights of its own, reproducible: from the configuration's name and the seed
            ov = [*ov, f"model.init_seed={(zlib.crc32(name.encode()) + (seed or 0)) % 2**32}"]
        try:
            rec = load_recipe(recipe, ov)
        except RecipeError as e:
            raise RecipeError(f"study run '{run_name}': {e}") from None
        if gate and (
            rec.model.arch != "vit"
            or not rec.train.checkpoint_every
            or "attention_distance" not in [c.name for c in rec.callbacks]
        ):
            raise RecipeError(
                f"study run '{name}': go_no_go needs a ViT with train.checkpoint_every set and the "
                'attention_distance callback (set: ["callbacks=[attention_distance]"]), which it '
                "measures at the second checkpoint."
            )
        study.runs[run_name] = StudyRun(
            run_name,
            recipe,
            ov,
            study.root / run_name,
            _measures(spec.get("measures"), path),
            config=name,
            seed=seed,
            go_no_go=gate,
        )


def _paper(d: dict, path: Path) -> str | None:
    """The paper named by the file's ``paper:`` key (checked), else its ``study:`` name when a paper has it."""
    from analysis.studies import paper as find_paper
    from analysis.studies import papers

    if "paper" in d:
        try:
            return find_paper(str(d["paper"])).name
        except KeyError as e:
            raise RecipeError(f"study file '{path}': paper: {e.args[0]}.") from None
    name = str(d.get("study", path.stem))
    return name if name in papers() else None


def _seeds(value, where: str) -> list[int] | None:
    """A seeds entry: None, or a non-empty list of distinct non-negative integers."""
    if value is None:
        return None
    if (
        not isinstance(value, list)
        or not value
        or len(set(value)) != len(value)
        or any(not isinstance(v, int) or isinstance(v, bool) or v < 0 for v in value)
    ):
        raise RecipeError(
            f"{where}: seeds must be a list of distinct non-negative integers such as [0, 1], not {value!r}."
        )
    return list(value)


def _options(value, path) -> dict:
    """The options entry {measure: {option: value}}, checked against each measure's Options."""
    if value is None:
        return {}
    from analysis.engine.measure import MeasureError
    from analysis.engine.suite import suite_options

    try:
        suite_options(None, options=value)
    except MeasureError as e:
        raise RecipeError(f"study file '{path}': options: {e}") from None
    return dict(value)


def _measures(value, path) -> list[str] | None:
    """A measures entry: None, 'all', or a list of measure names (checked)."""
    if value is None:
        return None
    from analysis.engine.measure import MeasureError, registry, resolve_all

    if value == "all":
        return sorted(registry())
    if not isinstance(value, list):
        raise RecipeError(f"study file '{path}': measures must be 'all' or a list of measure names.")
    try:
        return list(resolve_all(value))
    except MeasureError as e:
        raise RecipeError(f"study file '{path}': {e}") from None


def train_stage(study: Study, only=None, dry_run: bool = False, jobs: int = 1, ungated: bool = False):
    """Train the study's runs (of the configurations in ``only``, or all); returns launch_runs' (failed, started,
    skipped). A configuration marked ``go_no_go`` first trains its first run to its check step (the second scheduled
    checkpoint), beside the other runs; it trains on (every seed, to the end) only when the pilot check there says go
    (or undecided: nothing measured), and stops there on a no-go, saying so with the numbers. ``ungated``: no check."""
    from analysis.results.runs import open_run
    from analysis.studies.claims import NO_GO

    selected = [r for r in study.runs.values() if not only or r.config in only]
    configs = study.configs()
    gated = {} if ungated else {r.config: r for r in selected if r.go_no_go and r is configs[r.config][0]}
    pilot = _pilot(study, configs) if gated else None
    first = [(r.recipe, r.overrides, r.run_dir, pilot.step(load_recipe(r.recipe, r.overrides))) for r in gated.values()]
    rest = [(r.recipe, r.overrides, r.run_dir) for r in selected if r.config not in gated]
    held = [(r.recipe, r.overrides, r.run_dir) for r in selected if r.config in gated and r is not gated[r.config]]
    if dry_run and held:  # listed too: they train after a go at their configuration's pilot check
        print(f"study {study.name}: {len(held)} run(s) train only after a go at their configuration's pilot check:")
        rest = rest + held
    failed, started, skipped = launch_runs(first + rest, dry_run, jobs)
    if dry_run or not gated:
        return failed, started, skipped
    on = []
    for config, r in gated.items():
        if r.run_dir.name in {name for name, _ in failed}:
            continue
        outcome, why = pilot.check(open_run(r.run_dir))
        if outcome == NO_GO:
            print(
                f"study {study.name}: {config}: no-go at the pilot check: {why}; its runs stop here (the report says "
                "so; "
                "--no-go-no-go trains them to the end anyway)",
                flush=True,
            )
            continue
        print(f"study {study.name}: {config}: {outcome} at the pilot check: {why}; training it to the end", flush=True)
        on += [(x.recipe, x.overrides, x.run_dir) for x in configs[config]]
    more = launch_runs(on, dry_run, jobs) if on else ([], 0, 0)
    return failed + more[0], started + more[1], skipped + more[2]


def _pilot(study: Study, configs: dict):
    """The go/no-go check of the paper that judges ``study`` (analysis/studies/<paper>/: its ``PAPER.pilot``);
    RecipeError (one sentence) when the study marks runs ``go_no_go`` and its paper has none."""
    from analysis.studies import paper_for

    paper = paper_for(study, configs)
    if paper is None or paper.pilot is None:
        raise RecipeError(
            f"study {study.name} marks runs go_no_go, but {'no paper judges it' if paper is None else paper.name} "
            "defines no pilot check (PAPER.pilot): remove go_no_go, or name a paper that has one."
        )
    return paper.pilot


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="./launch.sh study", description=__doc__.split("\n")[0])
    p.add_argument("study", help="study YAML, e.g. recipes/studies/raghu2021.yaml")
    p.add_argument("--stage", choices=("all", "train", "analyze", "report"), default="all")
    p.add_argument("--dry-run", action="store_true", help="list the runs and their state, start nothing")
    p.add_argument(
        "--jobs",
        type=int,
        default=1,
        help="runs trained at once, each with an equal share of the cores, output in ROOT/logs/ (default 1)",
    )
    p.add_argument(
        "--only",
        nargs="+",
        metavar="CONFIG",
        help="train or analyse only these configurations (names in the study file; with --stage analyze also runs, "
        "CONFIG_sSEED): separate processes can analyse separate ones at once",
    )
    p.add_argument(
        "--no-go-no-go",
        action="store_true",
        help="train configurations marked go_no_go to the end whatever their pilot check says",
    )
    p.add_argument(
        "--root",
        help="folder of the study's runs, instead of the study file's root (e.g. to rerun it "
        "without touching the runs the committed report was made from)",
    )
    p.add_argument(
        "--report",
        help="where to write the report (and its JSON twin); default: the study file's report unless it is in docs/ "
        "(the committed one, written only when named here), else ROOT/report.md",
    )
    p.add_argument(
        "--from-bundle",
        nargs="?",
        const="",
        metavar="DIR",
        help="regenerate the report from the study's results bundle alone (default: beside the report, else "
        "docs/bundles/<report name>/; --stage report reads it by itself when no run of the study is there)",
    )
    args = p.parse_args(argv)
    if args.from_bundle is not None and args.stage != "report":
        print("error: --from-bundle regenerates the report only: add --stage report.", file=sys.stderr)
        return 2
    if args.jobs < 1:
        print(f"error: --jobs must be at least 1, not {args.jobs}.", file=sys.stderr)
        return 2
    try:
        study = load_study(args.study, args.root, args.report)
    except RecipeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    rc = 0
    configs = study.configs()
    # a run (CONFIG_sSEED) may be named when only analysing: its analyses are its own, unlike a pilot's training
    known = set(configs) | (set(study.runs) if args.stage == "analyze" else set())
    unknown = sorted(set(args.only or []) - known)
    if unknown:
        runs = " (or, with --stage analyze, runs)" if args.stage != "analyze" else " or their runs"
        print(
            f"error: --only names {', '.join(unknown)}, which the study does not have: choose from "
            f"{', '.join(configs)}{runs}.",
            file=sys.stderr,
        )
        return 2
    if args.only and args.stage == "report":
        print(
            "error: --only trains or analyses some configurations, but a report reads them all: drop --only.",
            file=sys.stderr,
        )
        return 2
    if args.stage in ("all", "train"):
        try:
            failed, started, skipped = train_stage(study, args.only, args.dry_run, args.jobs, args.no_go_no_go)
        except RunsStopped as e:  # SIGTERM / Ctrl-C: the runs checkpointed and stopped; nothing is analysed
            print(f"study {study.name}: {e}", flush=True)
            return 0
        n = sum(1 for r in study.runs.values() if not args.only or r.config in args.only)
        verb = "to start" if args.dry_run else "started"
        started = n - skipped - len(failed) if args.dry_run else started
        print(
            f"study {study.name}: {n} runs, {skipped} already finished, {started} {verb}, {len(failed)} failed; "
            f"runs in {study.root}, report {study.report or study.root / 'report.md'}" + study.committed_note()
        )
        if failed:
            return 1
    if args.dry_run:
        return 0
    from analysis.studies.bundle import BundleError
    from analysis.studies.study_report import analyze_study, write_report

    if args.stage in ("all", "analyze"):
        rc = analyze_study(study, args.only) or rc
    if args.only and args.stage == "all":
        print(f"study {study.name}: no report: --only trained and analysed some configurations, and a report reads all")
    elif args.stage in ("all", "report"):
        if args.stage == "report":
            try:
                study = _bundle_study(study, args.from_bundle)
            except BundleError as e:
                print(f"error: {e}", file=sys.stderr)
                return 2
        rc = write_report(study) or rc
    return rc


def _bundle_study(study: Study, folder: str | None) -> Study:
    """The study to report: reading its results bundle (analysis/studies/bundle.py) when ``--from-bundle`` names one
    (``''``: the study's own) or when no run of the study is there and its bundle is; else ``study`` itself."""
    from analysis.studies import bundle as B

    if folder is None and (B.has_runs(study) or not (B.location(study, reading=True) / B.MANIFEST).is_file()):
        return study
    return B.open_bundle(study, Path(folder) if folder else B.location(study, reading=True))


if __name__ == "__main__":
    raise SystemExit(main())
