"""``./launch.sh study recipes/studies/NAME.yaml``: train every run a study needs, analyse them, write its report.

A study file names runs (a recipe plus overrides each), a root folder and a report path::

    study: raghu2021
    root: runs/study-raghu2021
    report: docs/reproduction.md
    set: ["callbacks=[]"]            # overrides shared by every run
    runs:
      vit_cls: {recipe: ../default.yaml}
      noskip_b3: {recipe: ../default.yaml, set: ["interventions.no_skip={blocks: [3]}"]}

Stages (``--stage``, default all): ``train`` (finished runs skipped, interrupted ones resumed, every run's
recipe validated before the first starts), ``analyze`` (the offline suite on every checkpoint, cached), and
``report`` (cross-run comparisons and the claims document, see analysis/study_report.py).
"""
from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from analysis.measure import MeasureError, registry, resolve_all
from analysis.reports.study_report import analyze_study, write_report
from train.recipe import RecipeError, load_recipe
from train.sweep import launch_runs

ROOT = Path(__file__).resolve().parents[1]


@dataclass
class StudyRun:
    name: str
    recipe: Path
    overrides: list[str]
    run_dir: Path
    measures: list[str] | None = None  # measured at the last checkpoint (None: the study's list)


@dataclass
class Study:
    name: str
    path: Path
    root: Path
    report: Path | None
    runs: dict[str, StudyRun] = field(default_factory=dict)
    measures: list[str] | None = None  # measured at every run's last checkpoint (None: every registered measure)


def load_study(path: str | Path) -> Study:
    """Read and check a study file (every run's recipe is loaded and validated); raise RecipeError."""
    path = Path(path)
    if not path.is_file():
        raise RecipeError(f"study file '{path}' does not exist: pass a YAML file such as recipes/studies/raghu2021.yaml.")
    try:
        d = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as e:
        raise RecipeError(f"study file '{path}' is not valid YAML ({str(e).splitlines()[0]}).") from None
    unknown = set(d) - {"study", "root", "report", "set", "runs", "measures"}
    if unknown:
        raise RecipeError(f"study file '{path}' has unknown key(s) {sorted(unknown)}: allowed are study, root, report, set, runs, measures.")
    if not isinstance(d.get("runs"), dict) or not d["runs"]:
        raise RecipeError(f"study file '{path}' needs a 'runs:' mapping of name -> {{recipe: FILE, set: [KEY=VALUE, ...]}}.")
    shared = list(d.get("set") or [])
    root = Path(d.get("root") or f"runs/study-{d.get('study', path.stem)}")
    root = root if root.is_absolute() else ROOT / root
    report = d.get("report")
    study = Study(str(d.get("study", path.stem)), path, root, (ROOT / report) if report else None, measures=_measures(d.get("measures"), path))
    for name, spec in d["runs"].items():
        if not isinstance(spec, dict) or "recipe" not in spec or set(spec) - {"recipe", "set", "measures"}:
            raise RecipeError(f"study run '{name}' must be a mapping {{recipe: FILE, set: [KEY=VALUE, ...], measures: [...]}}.")
        recipe = (path.parent / spec["recipe"]).resolve()
        overrides = shared + list(spec.get("set") or [])
        try:
            load_recipe(recipe, overrides)
        except RecipeError as e:
            raise RecipeError(f"study run '{name}': {e}") from None
        study.runs[name] = StudyRun(name, recipe, overrides, root / name, _measures(spec.get("measures"), path))
    return study


def _measures(value, path) -> list[str] | None:
    """A measures entry: None, 'all', or a list of measure names (checked)."""
    if value is None:
        return None
    if value == "all":
        return sorted(registry())
    if not isinstance(value, list):
        raise RecipeError(f"study file '{path}': measures must be 'all' or a list of measure names.")
    try:
        return list(resolve_all(value))
    except MeasureError as e:
        raise RecipeError(f"study file '{path}': {e}") from None


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="./launch.sh study", description=__doc__.split("\n")[0])
    p.add_argument("study", help="study YAML, e.g. recipes/studies/raghu2021.yaml")
    p.add_argument("--stage", choices=("all", "train", "analyze", "report"), default="all")
    p.add_argument("--dry-run", action="store_true", help="list the runs and their state, start nothing")
    args = p.parse_args(argv)
    try:
        study = load_study(args.study)
    except RecipeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    rc = 0
    if args.stage in ("all", "train"):
        plan = [(r.recipe, r.overrides, r.run_dir) for r in study.runs.values()]
        failed, started, skipped = launch_runs(plan, args.dry_run)
        print(f"study {study.name}: {len(plan)} runs, {skipped} already finished, {started} started, {len(failed)} failed")
        if failed:
            return 1
    if args.dry_run:
        return 0
    if args.stage in ("all", "analyze"):
        rc = analyze_study(study) or rc
    if args.stage in ("all", "report"):
        rc = write_report(study) or rc
    return rc


if __name__ == "__main__":
    raise SystemExit(main())
