"""A paper's claims as plug-in pieces, and the generic machinery that runs, renders and records them.

A study plug-in (analysis/studies/<paper>/) declares each claim in one place: a function decorated with
:meth:`Claims.claim` that carries the claim's text (the paper's claim in the paper's direction, the quoted passage,
its source and figure, the rule in words, the paper's number where the text gives one) and computes it -- it reads the
numbers it needs through a :class:`Context` and returns a :class:`Result` whose
:class:`~analysis.studies.stats.Decision`
comes from the one statistical rule (analysis/studies/stats.py: a test and a 95% CI per part, Holm over a claim's parts
for "did not hold", preconditions for "not testable"). The order of the decorated functions is the order of the
report. Claim ids are unique within a paper (a second one is refused at import), every declared claim appears in the
report (:func:`run_claims` records a claim whose configurations the study lacks as not testable, saying which), and
looking up an id that does not exist fails with the ids that do.

Nothing here names a paper: adding a claim is one decorated function in its paper's module; adding a paper is one
folder in analysis/studies/ (or a ``vitlab.studies`` entry point).
"""

from __future__ import annotations

import difflib
import json
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from analysis.studies.stats import (
    ALPHA,
    HELD,
    INCONCLUSIVE,
    NOT_HELD,
    NOT_SIGNIFICANT,
    NOT_TESTABLE,
    OUTCOMES,
    Decision,
    Part,
    Precondition,
    across_claims,
    decide,
    min_seeds,
    one_sample_part,
    pooled_sd,
    two_sample_part,
)

__all__ = [
    "HELD",
    "INCONCLUSIVE",
    "NOT_HELD",
    "NOT_TESTABLE",
    "OUTCOMES",
    "Claim",
    "Claims",
    "Paper",
    "Result",
    "compare_part",
    "converged",
    "judge",
    "one_part",
    "record",
    "run_claims",
    "slope_part",
]

CONVERGED = 0.10  # a claim's statistic must have changed by less than this share between the last two checkpoints


# ------------------------------------------------------------------------------------------------ declaring claims


@dataclass(frozen=True)
class Claim:
    """One claim of a paper: ``claim`` in the paper's direction, ``passage`` quoted from ``source`` (``figure``), the
    ``rule`` in words, ``paper_value`` where the text gives a number, the configurations it ``needs``, and ``test``:
    the function that reads the study's numbers and decides (``test(ctx) -> Result``)."""

    id: str
    figure: str
    claim: str
    source: str
    passage: str
    rule: str
    paper_value: str | None = None
    needs: tuple[str, ...] = ()
    test: Callable | None = field(default=None, compare=False, repr=False)


class Claims:
    """A paper's claims in report order; ``@claims.claim(id=..., ...)`` declares one (its text beside its code)."""

    def __init__(self, paper: str):
        self.paper = paper
        self._items: dict[str, Claim] = {}

    def claim(
        self,
        id: str,
        *,
        figure: str,
        claim: str,
        source: str,
        passage: str,
        rule: str,
        paper_value: str | None = None,
        needs: Sequence[str] = (),
    ) -> Callable:
        def register(fn: Callable) -> Callable:
            if id in self._items:
                raise ValueError(f"{self.paper}: claim id {id!r} is declared twice; claim ids must be unique")
            self._items[id] = Claim(id, figure, claim, source, passage, rule, paper_value, tuple(needs), fn)
            return fn

        return register

    def __iter__(self) -> Iterator[Claim]:
        return iter(self._items.values())

    def __len__(self) -> int:
        return len(self._items)

    def ids(self) -> list[str]:
        return list(self._items)

    def __getitem__(self, id: str) -> Claim:
        if id not in self._items:
            near = difflib.get_close_matches(str(id), self._items, n=1)
            hint = f" (did you mean {near[0]!r}?)" if near else ""
            raise KeyError(f"{self.paper} has no claim {id!r}{hint}; its claims are {', '.join(self._items)}")
        return self._items[id]

    def check(self, ids: Sequence[str]) -> None:
        """Raise KeyError for any id of ``ids`` that is not a claim of this paper."""
        for i in ids:
            self[i]


@dataclass
class Paper:
    """A study plug-in: ``name`` (what a study file's ``paper:`` or ``study:`` says), ``title`` of its report, its
    ``claims``, ``sections`` (functions ``f(ctx)`` that write the paper's sections before the claims and may put what
    the claims need into ``ctx.shared``), ``applies(configs)`` (whether a study without a ``paper:`` key is this
    paper's, from its configuration names), ``defaults`` (study-file keys a study of this paper gets when it leaves
    them out, e.g. seeds) and its ``pilot`` check (:class:`Pilot`), if its studies mark runs ``go_no_go``."""

    name: str
    title: str
    claims: Claims
    sections: Sequence[Callable] = ()
    applies: Callable[[dict], bool] = lambda configs: False
    defaults: dict = field(default_factory=dict)
    source: str = ""  # the module that computes the numbers, named in the report
    pilot: Pilot | None = None  # the go/no-go check of a study's configurations marked go_no_go (None: it has none)


GO, NO_GO, UNDECIDED = "go", "no-go", "undecided"  # what a pilot check says


@dataclass(frozen=True)
class Pilot:
    """A paper's go/no-go check of a pilot run: ``step(recipe)``, the step whose checkpoint it reads (the study trains
    the first run of a configuration marked ``go_no_go`` that far first), ``check(run)``, (:data:`GO`,
    :data:`NO_GO` or :data:`UNDECIDED`, one sentence with the numbers), and ``is_pilot(config)``, whether a
    configuration is a pilot (its runs may be missing or unfinished when the study is analysed)."""

    step: Callable
    check: Callable
    is_pilot: Callable = lambda config: False


# ------------------------------------------------------------------------------------------------ results


@dataclass
class Result:
    """What a claim's test returns: the ``decision``, our number beside the paper's (``ours``; default: the parts'
    effects with their CIs), ``measured`` (further numbers for the JSON record), and the ``lines`` and ``figures`` the
    report shows under the claim."""

    decision: Decision
    ours: str | None = None
    measured: dict = field(default_factory=dict)
    lines: list[str] = field(default_factory=list)  # markdown shown after the verdict (tables of the numbers)
    figures: list[tuple] = field(default_factory=list)  # (path, name, caption) shown after them

    @property
    def outcome(self) -> str:
        return self.decision.outcome

    @property
    def why(self) -> str:
        return self.decision.why


def judge(parts: Sequence[Callable[[], Part]], preconditions: Sequence[Precondition] = ()) -> Decision:
    """:func:`~analysis.studies.stats.decide` on parts built lazily: a part that cannot be computed (too few seeds, a
    missing value) makes the claim not testable with that sentence, and the parts that could be computed are shown.
    Where a given precondition failed, that sentence is left out: the precondition is the reason (e.g. no outlier
    tokens, hence no values to test), and a report line asking for more seeds would mislead."""
    built, problems = [], []
    for make in parts:
        try:
            built.append(make())
        except ValueError as e:
            problems.append(str(e))
    conds = list(preconditions)
    if problems and all(c.passed for c in conds):  # a failed precondition already says why (no outliers: no values)
        conds.append(Precondition("data", False, "; ".join(problems)))
    if not built:
        failed = [c.sentence for c in conds if not c.passed] or ["no part could be computed"]
        text = "; ".join(failed)
        return Decision(NOT_TESTABLE, f"{text[0].upper()}{text[1:]}.", (), (), tuple(conds))
    return decide(built, conds)


def _family_sd(family: dict | None):
    """The pooled seed SD of a family of configurations (None when it gives no degree of freedom)."""
    if not family:
        return None
    groups = [v for v in family.values() if len(v) >= 1]
    if sum(len(g) - 1 for g in groups) < 1:
        return None
    return pooled_sd(groups)


def compare_part(name: str, a, b, *, sign: int = 1, family: dict | None = None) -> Callable[[], Part]:
    """A part comparing configuration a with b (per-seed values): the pooled t over ``family`` (the per-seed values of
    every configuration of the same architecture and recipe; a and b among them), else Welch's t."""
    return lambda: two_sample_part(name, a, b, sign=sign, pooled=_family_sd(family))


def one_part(name: str, values, ref: float = 0.0, *, sign: int = 1) -> Callable[[], Part]:
    """A part on one configuration's per-seed values against ``ref`` (one-sample t, df = seeds - 1)."""
    return lambda: one_sample_part(name, values, ref, sign=sign)


def slope_part(name: str, x, ys: Sequence[Sequence[float]], *, sign: int = 1) -> Callable[[], Part]:
    """A part on a trend: per seed, the least-squares slope of ``ys[seed]`` (one value per ``x``) on ``x``; the
    one-sample t of the slopes against 0. ``sign`` +1: the paper says the statistic rises with x."""

    def make() -> Part:
        xs = np.asarray(x, dtype=float)
        if len(xs) < 2 or np.ptp(xs) == 0:
            raise ValueError(f"part {name!r}: a slope needs two different x values, got {xs.tolist()}")
        slopes = [float(np.polyfit(xs, np.asarray(y, dtype=float), 1)[0]) for y in ys]
        return one_sample_part(name, slopes, 0.0, sign=sign)

    return make


def converged(name: str, last: Sequence[float], previous: Sequence[float], scale: float = 0.0) -> Precondition:
    """The claim's statistic changed by less than :data:`CONVERGED` of its size between each run's last two
    checkpoints (mean over seeds; ``scale``: a floor for the size, for statistics near 0, e.g. uniform attention's
    distance x 0.1). With no earlier checkpoint measured, the precondition passes and says it was not checked."""
    last = np.asarray(last, dtype=float)
    prev = np.asarray(previous, dtype=float) if previous is not None else np.array([])
    if prev.size == 0 or prev.size != last.size or not np.isfinite(prev).all():
        return Precondition("converged", True, f"{name}: no earlier checkpoint measured, so not checked")
    size = max(abs(float(last.mean())), float(scale), 1e-12)
    change = abs(float(last.mean() - prev.mean())) / size
    numbers = {"last": last.tolist(), "previous": prev.tolist(), "relative_change": change, "limit": CONVERGED}
    if change < CONVERGED:
        return Precondition(
            "converged", True, f"{name} changed by {100 * change:.1f}% between the last two checkpoints", numbers
        )
    return Precondition(
        "converged",
        False,
        f"{name} is still moving: it changed by {100 * change:.0f}% between the runs' last two checkpoints "
        f"({float(prev.mean()):.4g} -> {float(last.mean()):.4g}; the rule needs less than {100 * CONVERGED:.0f}%), "
        "so the model is not yet the trained model the paper describes",
        numbers,
    )


def seeds(configs: dict, least: int = 2) -> Precondition:
    """Every compared configuration has at least ``least`` seeds."""
    return min_seeds(configs, least)


class MissingResult(LookupError):
    """A claim reads a measure a run does not have (not in the study's measures, or the run is unfinished)."""


def _not_testable(name: str, sentence: str, numbers: dict | None = None) -> Decision:
    return Decision(
        NOT_TESTABLE,
        f"{sentence[0].upper()}{sentence[1:]}.",
        (),
        (),
        (Precondition(name, False, sentence, numbers or {}),),
    )


def run_claims(paper: Paper, ctx) -> list[tuple[Claim, Result]]:
    """Every claim of ``paper`` on the study ``ctx`` reads, in order: a claim whose ``needs`` the study lacks, or
    whose runs lack a measure it reads (:class:`MissingResult`), is recorded as not testable, saying what is missing.
    ``ctx`` is whatever the paper's claims read: a study's runs (study_report.Context), or one model's per-image
    statistics (analysis/studies/real_vit/); only ``needs`` reads its ``configs``."""
    out = []
    for c in paper.claims:
        missing = [n for n in c.needs if n not in getattr(ctx, "configs", {})]
        if missing:
            d = Decision(
                NOT_TESTABLE,
                f"This study has no runs of {', '.join(missing)}, which the claim compares.",
                (),
                (),
                (Precondition("configurations", False, f"no runs of {', '.join(missing)}", {"missing": missing}),),
            )
            out.append((c, Result(d)))
            continue
        try:
            out.append((c, c.test(ctx)))
        except MissingResult as e:
            out.append((c, Result(_not_testable("measured", str(e)))))
    return out


# ------------------------------------------------------------------------------------------------ the record


def ours_text(r: Result) -> str | None:
    """Our number beside the paper's: the claim's own text, else its parts' effects with their 95% CIs."""
    return r.ours or (r.decision.ours if r.decision.parts else None)


def record(claim: Claim, r: Result) -> dict:
    """One claim's entry of a study's JSON: the claim's text, the decision (parts with effect, CI, p, test; Holm p;
    preconditions with their numbers), our number and any further measured values."""
    return _plain(
        {
            "id": claim.id,
            "figure": claim.figure,
            "claim": claim.claim,
            "source": claim.source,
            "passage": claim.passage,
            "rule": claim.rule,
            "paper_value": claim.paper_value,
            "ours": ours_text(r),
            "verdict": r.outcome,
            "why": r.why,
            "decision": r.decision.to_json(),
            "measured": r.measured,
            "sanity": bool(getattr(claim, "sanity", False)),  # left out of the study's across_claims
        }
    )


def _plain(x):
    if isinstance(x, dict):
        return {str(k): _plain(v) for k, v in x.items()}
    if isinstance(x, (list, tuple, np.ndarray)):
        return [_plain(v) for v in x]
    if isinstance(x, (bool, np.bool_)):
        return bool(x)
    if isinstance(x, (int, np.integer)):
        return int(x)
    if isinstance(x, (float, np.floating)):
        return float(x) if np.isfinite(x) else None
    return x


def write_json(path: Path, study: str, paper: str, records: list[dict], notes: list[str], extra: dict | None = None):
    """The study's JSON twin of its report: the rule's level, the claims' records, ``across_claims`` (Holm and
    Benjamini-Hochberg over the tested claims that are not sanity checks:
    :func:`~analysis.studies.stats.across_claims`), the notes and ``extra``."""
    doc = {
        "study": study,
        "paper": paper,
        "alpha": ALPHA,
        "converged_limit": CONVERGED,
        "outcomes": list(OUTCOMES),
        "claims": records,
        "across_claims": _plain(across_claims({r["id"]: r["decision"] for r in records if not r.get("sanity")})),
        "notes": notes,
        **_plain(extra or {}),
    }
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(doc, indent=1, ensure_ascii=False) + "\n")
    tmp.replace(path)


def read_json(path: Path) -> dict:
    """A study's JSON read back: {"claims": {id: record}, ...} so two studies diff claim by claim."""
    d = json.loads(Path(path).read_text())
    return {**d, "claims": {c["id"]: c for c in d["claims"]}}


# ------------------------------------------------------------------------------------------------ markdown

MARK = {
    HELD: "**held**",
    NOT_HELD: "**did not hold**",
    INCONCLUSIVE: "**inconclusive**",
    NOT_TESTABLE: "**not testable**",
}


def _cell(s) -> str:
    return str(s).replace("|", "\\|")


def _state(c: Precondition) -> str:
    if not c.passed:
        return "**failed**"
    return "not checked" if c.sentence.endswith("so not checked") else "passed"


def section(n: int, claim: Claim, r: Result) -> list[str]:
    """A claim's section of the report: the passage, the rule, the paper's number and ours, a table of its parts and
    its preconditions, and the verdict with its reasons."""
    d = r.decision
    lines = [
        f"## {n}. {claim.claim} ({claim.figure})",
        "",
        f'> "{claim.passage}" — {claim.source}',
        "",
        f"Rule: {claim.rule}",
        "",
        f"Paper: {claim.paper_value or 'no number in the text'}. Ours: {ours_text(r) or 'see the measured values'}.",
        "",
    ]
    if d.parts:
        lines += [
            "| part (positive = the paper's direction) | effect | 95% CI | p | test | Holm p (reversal) | outcome |",
            "| --- | --- | --- | --- | --- | --- | --- |",
        ]
        for p, q in zip(d.parts, d.p_holm):
            test = p.test + (f", df {p.df:.3g}" if p.df is not None else "")
            pv = f"{p.p:.2g}" if np.isfinite(p.p) else "-"  # a degenerate part has no p
            out = p.outcome + (f" ({p.power_text()})" if p.outcome == NOT_SIGNIFICANT and p.power_text() else "")
            lines.append(
                f"| {_cell(p.name)} | {p.effect:+.4g} | [{p.ci[0]:+.4g}, {p.ci[1]:+.4g}] | {pv} | {_cell(test)} | "
                f"{q:.2g} | {out} |"
            )
        lines.append("")
    if d.preconditions:
        lines += ["Preconditions:", ""]
        lines += [f"- {_state(c)}: {c.sentence}" for c in d.preconditions]
        lines.append("")
    lines += [f"Verdict: {MARK[d.outcome]}. {d.why}", ""]
    return lines


def glance(results: list[tuple[Claim, Result]]) -> list[str]:
    """The claims-at-a-glance table."""
    lines = [
        "| # | claim (the paper's direction) | figure | paper | ours: effect [95% CI] | verdict |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for i, (c, r) in enumerate(results, 1):
        cells = (str(i), c.claim, c.figure, c.paper_value or "-", ours_text(r) or "-", MARK[r.outcome])
        lines.append("| " + " | ".join(_cell(x) for x in cells) + " |")
    return lines


RULE_TEXT = (
    "How a claim is decided: every claim is split into parts, each one number in the paper's direction (positive "
    "means the paper is right) with a two-sided test at alpha = 0.05 and its 95% confidence interval over seeds "
    "(Welch's t between architectures; a t on the seed SD pooled over the configurations of one family within it; a "
    "one-sample t on one configuration). **held**: every part significant in the paper's direction; **did not "
    "hold**: some part significantly reversed after Holm's correction over the claim's parts, with every "
    "precondition passed; **inconclusive**: neither; **not testable**: a precondition failed (too few seeds, the "
    "statistic still moving between the last two checkpoints, or a model that is not yet the kind the paper "
    "describes), said with its numbers. analysis/studies/stats.py documents the tests, their simulated error rates "
    "(false held and false did-not-hold at most 2.6% each with three seeds) and their power."
)
