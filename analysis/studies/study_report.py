"""The analysis and report stages of ``./launch.sh study`` (analysis/studies/study.py), for any paper.

``analyze_study``: the study's ``every_checkpoint`` measures (default: the core four) on every checkpoint of every
run and the study's measures on each run's last checkpoint, all with the study's measure options (cached, see
analysis/frontends/runner.py). ``write_report``: the study's report -- the runs with their accuracy and wall time, then
the paper plug-in's sections and every one of its claims (analysis/studies/<paper>/: the quoted passage, the rule, the
paper's number and ours, each part's effect with its 95% CI and test, the preconditions and the verdict; see
analysis/studies/claims.py and stats.py), and the same as JSON beside it so two studies can be diffed. Figures the
report shows are copied next to it (docs/figures/<study>/), so the document reads on its own.

A study names its paper with ``paper:`` (or a ``study:`` name that is a paper's); without either, the paper whose
``applies`` accepts the study's configurations judges it; a study that is no paper's gets the runs table only.
"""

from __future__ import annotations

import json
import re
import shutil
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from analysis.engine.measure import registry
from analysis.frontends import runner as RN
from analysis.reports.run_report import write_run_report
from analysis.results import folders as RF0
from analysis.results import runs as RF
from analysis.studies import Paper, paper_for
from analysis.studies import bundle as B
from analysis.studies import claims as C
from analysis.studies import study_runs as R
from analysis.studies.stats import ALPHA, HELD, across_claims
from train.run_folder import override_key


def _pilot_of(study) -> C.Pilot | None:
    """The pilot check of the paper that judges ``study`` (None: it has none, and no configuration is a pilot)."""
    paper = paper_for(study, study.configs())
    return paper.pilot if paper is not None else None


def open_runs(study, names=None) -> tuple[dict, dict]:
    """The study's runs opened (those in ``names``, or all), and {run name: why it is absent} for the pilot runs not
    trained yet (other runs must have a checkpoint). Runs left out of ``names`` are not looked at: they may still be
    training."""
    runs, absent = {}, {}
    pilot = _pilot_of(study)
    for name, r in study.runs.items():
        if names is not None and name not in names:
            continue
        try:
            runs[name] = RF.open_run(r.run_dir)
        except RF0.AnalysisError as e:
            if pilot is not None and pilot.is_pilot(r.config):
                absent[name] = "not started (no run folder)" if not r.run_dir.is_dir() else "no complete checkpoint yet"
                continue
            raise RF0.AnalysisError(
                f"study run '{name}' is not trained yet ({e}); run the train stage first."
            ) from None
    # a configuration whose first run stopped at a no-go: its other seeds are not trained, by design
    for name in absent:
        first = study.configs()[study.runs[name].config][0].name
        if (
            first in runs
            and first != name
            and not R.progress(runs[first])[0]
            and pilot.check(runs[first])[0] == C.NO_GO
        ):
            absent[name] = f"not trained: its configuration stopped at the go/no-go check of {first}"
    return runs, absent


def _times(study) -> dict:
    f = study.root / "study_times.json"
    return json.loads(f.read_text()) if f.is_file() else {}


def _save_time(study, key: str, seconds: float) -> None:
    t = _times(study)
    t[key] = round(seconds, 1)
    study.root.mkdir(parents=True, exist_ok=True)
    (study.root / "study_times.json").write_text(json.dumps(t, indent=1))


def analyze_study(study, only=None) -> int:
    """The study's analyses of every run (of the configurations or runs named in ``only``, or all), cached in each
    run's folder.
    With ``only`` the other runs need not be trained yet (each run can be analysed as soon as its training ends), and
    the wall time is printed but not recorded as the study's analysis time, which a partial pass is not."""
    t0 = time.time()
    try:
        keep = {name for name, r in study.runs.items() if not only or r.config in only or name in only}
        runs, absent = open_runs(study, keep if only else None)
        pilot = _pilot_of(study)
        for name, why in absent.items():
            if name in keep:
                print(f"study {study.name}: pilot run {name}: {why}; left out of the analysis")
        for name, run in runs.items():
            if name not in keep:
                continue
            RN.analyze_run(run, None, study.suite_options(study.every_checkpoint))  # default: the core four
            done, state = R.progress(run)
            if not done and pilot is not None and pilot.is_pilot(study.runs[name].config):
                print(
                    f"study {study.name}: pilot run {name} is {state}: its checkpoints are analysed, the study's "
                    "measures wait for its last step"
                )
                continue
            measures = study.runs[name].measures or study.measures or sorted(registry())
            RN.analyze_run(run, ["last"], study.suite_options(measures))  # the study's list on the last
            write_run_report(run)
    except RF0.AnalysisError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if only:
        print(f"study {study.name}: analysed {', '.join(only)} in {time.time() - t0:.0f} s")
    else:
        _save_time(study, "analyze_s", time.time() - t0)
    return 0


# ------------------------------------------------------------------------------------------------ the document


class Doc:
    """Markdown lines plus the figures it shows, copied next to the document."""

    def __init__(self, study):
        self.lines: list[str] = []
        self.base = (study.report or study.root / "report.md").parent
        self.fig_dir = self.base / "figures" / study.name
        self.fig_dir.mkdir(parents=True, exist_ok=True)
        self.data: dict = {}  # machine-readable extras for the JSON twin (pilots, the locality configuration)

    def add(self, *lines: str) -> None:
        self.lines += list(lines)

    def figure(self, path: Path, name: str, caption: str) -> None:
        if path is None or not Path(path).is_file():
            self.add(f"*(figure {name} missing)*", "")
            return
        dst = self.fig_dir / f"{name}.png"
        shutil.copyfile(path, dst)
        self.add(f"![{caption}]({dst.relative_to(self.base).as_posix()})", "", f"*{caption}*", "")


@dataclass
class Context:
    """What a paper plug-in's sections and claims read: the ``study``, its opened ``runs`` (and the ``absent`` pilot
    runs), ``configs`` (configuration -> its opened runs in seed order), the document ``doc``, the study's suite
    options ``opts``, ``notes`` for the report's list of what the study does not yet do, and ``shared`` (what one
    section hands to the claims, e.g. which configuration the locality claims read)."""

    study: object
    runs: dict
    absent: dict
    configs: dict
    doc: Doc
    opts: object
    notes: list[str] = field(default_factory=list)
    shared: dict = field(default_factory=dict)

    def last(self, run, measure: str, step: int | None = None, optional: bool = False):
        """Run ``run``'s saved result of ``measure`` at its last checkpoint (or ``step``); when it was not measured,
        None if ``optional``, else :class:`~analysis.studies.claims.MissingResult` (the claim is not testable)."""
        res = R.last(run, measure, step)
        if res is None and not optional:
            at = "its last checkpoint" if step is None else f"step {step}"
            raise C.MissingResult(f"{measure} was not measured on {run.name} at {at} (add it to the study's measures)")
        return res

    def previous(self, run, measure: str):
        """The same at the run's second-to-last checkpoint (None when not measured there)."""
        return R.previous(run, measure)

    def top1(self, run, step: int | None = None) -> float:
        return R.top1(run, step)

    def eval_n(self, run) -> int:
        return R.eval_n(run)


def write_report(study) -> int:
    """Write the study's report and its JSON twin from its runs, then its results bundle beside the report
    (analysis/studies/bundle.py); or, when ``study.bundle`` is set (:func:`analysis.studies.bundle.open_bundle`),
    from that bundle alone, writing nothing into it."""
    try:
        return _write_report(study)
    finally:
        if study.bundle is not None:
            study.bundle["scratch"].cleanup()  # the bundle's copy the report read (bundle.open_bundle)


def _write_report(study) -> int:
    t0 = time.time()
    out = study.report or (study.root / "report.md")
    from_bundle = study.bundle is not None
    try:
        with B.watching(study.root, guard=from_bundle) as watch:
            try:
                runs, absent = open_runs(study)
                text, records, notes, extra, paper = _report(study, runs, absent)
            except Exception as e:  # from a bundle: one sentence naming what it lacks
                if from_bundle:
                    raise B.failure(study, watch, e) from e
                raise
        if from_bundle and watch.refused:  # a plug-in caught the refused write of a cache: the bundle lacks it
            raise B.failure(study, watch, PermissionError(watch.refused[0]))
    except (RF0.AnalysisError, B.BundleError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if not from_bundle:  # a report from a bundle keeps the recorded time of the report it regenerates
        _save_time(study, "report_s", time.time() - t0)
    out.parent.mkdir(parents=True, exist_ok=True)
    text = text.replace("{REPORT_S}", f"{_times(study).get('report_s', float('nan')):.0f}")
    out.write_text(text)
    if records:
        C.write_json(out.with_suffix(".json"), study.name, paper.name, records, notes, extra)
    twin = f" and {out.with_suffix('.json')}" if records else ""
    print(f"study {study.name}: report written to {out}{twin}" + study.committed_note())
    if from_bundle:
        print(f"study {study.name}: the report was regenerated {B.provenance(study)}")
        return 0
    where, m = B.write(study, watch, out, out.parent / "figures" / study.name)
    print(
        f"study {study.name}: results bundle written to {where} ({len(m['files'])} files, {m['bytes'] / 1e6:.2f} MB; "
        f"`{study.command()} --stage report` regenerates the report from it where the runs are absent)"
    )
    return 0


# a str.format field: a name, an optional conversion and an optional format spec (e.g. {C.GO_FRACTION:g}, {x!r:>8})
_PLACEHOLDER = re.compile(
    r"\{[A-Za-z_][\w.]*(\[[^\]]*\])?(![rsa])?(:[<>=^]?[+\- ]?#?0?\d*[,_]?(\.\d+)?[bcdeEfFgGnosxX%]?)?\}"
)


def unformatted(text: str) -> list[str]:
    """Placeholders such as ``{C.GO_FRACTION:g}`` left in a generated document (a string that missed its f prefix)."""
    return sorted(set(m.group(0) for m in _PLACEHOLDER.finditer(text)))


def effective_overrides(overrides) -> str:
    """The overrides a run's recipe ends up with, for a reader: the study's own and then the configuration's are
    applied in order, so a key set twice (``data.val_size=5000 ... data.val_size=0``) shows its last value only."""
    last = {}
    for o in overrides:
        last[override_key(o)] = o
    return " ".join(last.values()) or "-"


def _runs_table(study, runs: dict, absent: dict, doc: Doc) -> None:
    train_wall = {n: R.train_wall(r) for n, r in runs.items()}
    doc.add(
        "## Runs",
        "",
        "| run | configuration | seed | recipe overrides | test top-1 (± binomial SE) | training wall (s) |",
        "| --- | --- | --- | --- | --- | --- |",
    )
    for n, sr in study.runs.items():
        seed, ov = "-" if sr.seed is None else sr.seed, effective_overrides(sr.overrides)
        if n not in runs:
            doc.add(f"| {n} | {sr.config} | {seed} | {ov} | {absent.get(n, 'not trained')} | - |")
            continue
        r, (done, state) = runs[n], R.progress(runs[n])
        p, k = R.top1(r), R.eval_n(r)
        se = float(np.sqrt(p * (1 - p) / k)) if k else float("nan")
        doc.add(
            f"| {n} | {sr.config} | {seed} | {ov} | {p:.4f} ± {se:.4f}"
            f"{'' if done else ' (' + state + ')'} | {train_wall[n]:.0f} |"
        )
    times = _times(study)
    doc.add(
        "",
        f"Wall time on this machine: training {np.nansum(list(train_wall.values())) / 60:.0f} min in all (each run's "
        "own wall time, other jobs included); the last invocation's analysis stage "
        f"{times.get('analyze_s', float('nan')) / 60:.1f} min (results cached by earlier invocations are not "
        "recomputed); comparisons and this report {REPORT_S} s. Measure options: "
        f"{json.dumps(study.options) if study.options else 'the defaults'}.",
        "",
    )


def across_lines(acc: dict) -> list[str]:
    """The report's paragraph and table on the correction across claims (``acc``: the JSON's ``across_claims``,
    :func:`~analysis.studies.stats.across_claims`)."""
    m, a = acc["tested"], acc["alpha"]
    if m == 0:
        return [
            "Across claims: no claim was tested (every one is not testable or a sanity check), so there is "
            "nothing to correct.",
            "",
        ]
    lines = [
        f"Across claims: each claim above is judged at alpha = {a:g} on its own. Over the {m} tested claim(s) "
        "(sanity checks and not-testable claims left out), each claim's p -- the largest part p of a held claim, the "
        "smallest Holm-adjusted reversal p of one that did not hold, the largest part p in the paper's direction of "
        f"an inconclusive one -- is corrected for the number of claims: {acc['held']} held on its own, "
        f"{acc['held_after_holm']} after Holm's correction (family-wise error rate {a:g}), {acc['held_after_bh']} "
        f"after Benjamini-Hochberg's (false discovery rate {a:g}).",
        "",
        "| claim | verdict | p | Holm p | BH q | held after Holm / BH |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for k, c in acc["claims"].items():
        after = (
            f"{'yes' if c['held_after_holm'] else 'no'} / {'yes' if c['held_after_bh'] else 'no'}"
            if c["verdict"] == HELD
            else "-"
        )
        lines.append(f"| {k} | {c['verdict']} | {c['p']:.2g} | {c['holm_p']:.2g} | {c['bh_q']:.2g} | {after} |")
    return [*lines, ""]


def _report(study, runs: dict, absent: dict | None = None) -> tuple[str, list, list, dict, Paper | None]:
    absent = absent or {}
    doc = Doc(study)
    configs = R.configs(study, runs)
    paper = paper_for(study, configs)
    ctx = Context(study, runs, absent, configs, doc, study.suite_options(None))
    doc.add(
        f"# {paper.title if paper else 'Study'}: {study.name}",
        "",
        f"Generated by `{study.command()}` {B.provenance(study)}; every number below is computed by the project "
        f"({paper.source + ' ' if paper else ''}on the results of analysis/measures/*.py), so rerunning the study "
        "regenerates this page" + (" and its JSON twin." if paper else "."),
        "",
    )
    _runs_table(study, runs, absent, doc)
    if paper is None:
        return "\n".join(doc.lines) + "\n", [], [], doc.data, None
    for section in paper.sections:
        section(ctx)
    results = C.run_claims(paper, ctx)
    for i, (claim, r) in enumerate(results, 1):
        doc.add(*C.section(i, claim, r), *r.lines)
        for fig in r.figures:
            doc.figure(*fig)
    table = ["## Claims at a glance", "", C.RULE_TEXT, "", *C.glance(results)]
    table += [
        "",
        *across_lines(across_claims({c.id: r.decision for c, r in results if not getattr(c, "sanity", False)})),
    ]
    if ctx.notes:
        table += ["", "What this study does not yet do:", ""] + [f"- {n}" for n in dict.fromkeys(ctx.notes)]
    at = doc.lines.index("## Runs")
    doc.lines[at:at] = [*table, ""]
    doc.data["alpha"] = ALPHA
    return "\n".join(doc.lines) + "\n", [C.record(c, r) for c, r in results], list(ctx.notes), doc.data, paper
