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
    "Fixed",
    "Paper",
    "Preregistration",
    "Result",
    "Threshold",
    "compare_part",
    "converged",
    "judge",
    "one_part",
    "record",
    "run_claims",
    "slope_part",
    "tally",
    "ungated",
]


# ------------------------------------------------------------------------------------------------ preregistration


@dataclass(frozen=True)
class Fixed:
    """When a threshold was fixed, or a claim's verdict first reported: the ``date`` (YYYY-MM-DD) and the git
    ``commit`` (short hash; :data:`THIS_COMMIT` for 2026-11-27), ``when`` the commit's ISO 8601 time (empty
    for :data:`THIS_COMMIT`: later than every committed report) and, for a report, the document it is in."""

    date: str
    commit: str
    when: str = ""
    report: str = ""

    def to_json(self) -> dict:
        return {"date": self.date, "commit": self.commit, **({"report": self.report} if self.report else {})}

    def after(self, other: Fixed) -> bool:
        """Whether this was fixed after ``other`` (ISO times in one zone compare as strings)."""
        return (self.when or "9999") > (other.when or "9999")

    def text(self) -> str:
        return f"{self.date}, {self.commit}"


THIS_COMMIT = "71696e3"  # the commit that fixed these (landed on main at 60a2aae); no time: after every report
TODAY = Fixed("2026-11-27", THIS_COMMIT)


class Threshold(float):
    """A number a verdict depends on (a precondition's limit, an equivalence margin, a go/no-go limit), declared once
    with ``name``, what it ``means``, when it was ``fixed`` (:class:`Fixed`: the commit that first introduced it) and
    its ``kind``: "gate" (a precondition: the claim is not testable when it fails), "rule" (a number inside the
    decision, e.g. a margin), "go" (a pilot's go/no-go), "regime" (marks a claim outside the paper's regime, judges
    nothing) or "beside" (a number of a reading reported beside the verdict, e.g. whether a similarity conclusion
    survives calibration: analysis/studies/calibration.py; judges nothing). ``feasible(value, shape)``: whether a
    gate of this value can pass at all for a study configuration's ``shape`` (``arch``, ``depth``, ``width``,
    ``steps``, ``checkpoint_every``, ``seeds``, ``every_checkpoint``), so that a test can show every gate is
    satisfiable in some shipped study (:meth:`can_pass`); ``previous``: (value, Fixed) where a threshold was
    changed. It is a float, so code reads it as the number it is."""

    def __new__(
        cls,
        value: float,
        name: str,
        means: str,
        fixed: Fixed,
        kind: str = "gate",
        feasible: Callable[[float, dict], bool] | None = None,
        previous: tuple[float, Fixed] | None = None,
    ):
        if kind not in ("gate", "rule", "go", "regime", "beside"):
            raise ValueError(f"threshold {name!r}: kind must be gate, rule, go, regime or beside, not {kind!r}")
        t = super().__new__(cls, value)
        t.name, t.means, t.fixed, t.kind, t.feasible, t.previous = name, means, fixed, kind, feasible, previous
        return t

    def __str__(self) -> str:
        return format(float(self), "g")

    __repr__ = __str__

    def can_pass(self, shape: dict) -> bool | None:
        """Whether this threshold can pass for a study configuration of ``shape`` (None: it declares no check)."""
        return None if self.feasible is None else bool(self.feasible(float(self), shape))

    def to_json(self) -> dict:
        out = {"value": _number(self), "means": self.means, "kind": self.kind, "fixed": self.fixed.to_json()}
        if self.previous is not None:
            out["previous"] = {"value": _number(self.previous[0]), "fixed": self.previous[1].to_json()}
        return out


def _number(v) -> float | int:
    """A threshold's value for JSON: a count as an int (2, not 2.0), a share as a float."""
    v = float(v)
    return int(v) if v.is_integer() and v >= 1 else v


@dataclass
class Preregistration:
    """A paper's thresholds in one place: every :class:`Threshold` its verdicts read, ``gates`` (claim id -> the
    names of the thresholds its verdict depends on; every claim has an entry, () when none) and ``first_reported``
    (claim id -> :class:`Fixed` of the commit whose committed report first showed that claim's verdict), so that a
    threshold fixed after a claim's data were seen is said so in its record and its section."""

    paper: str
    thresholds: Sequence[Threshold]
    gates: dict[str, tuple[str, ...]]
    first_reported: dict[str, Fixed] = field(default_factory=dict)

    def __post_init__(self):
        self.by_name = {t.name: t for t in self.thresholds}
        if len(self.by_name) != len(self.thresholds):
            raise ValueError(f"{self.paper}: two preregistered thresholds share a name")
        for cid, names in self.gates.items():
            unknown = [n for n in names if n not in self.by_name]
            if unknown:
                raise ValueError(
                    f"{self.paper}: claim {cid!r} reads thresholds {unknown} that are not preregistered; add them to "
                    f"its preregistration ({', '.join(self.by_name)})"
                )

    def __getitem__(self, name: str) -> Threshold:
        return self.by_name[name]

    def of(self, claim_id: str) -> list[Threshold]:
        return [self.by_name[n] for n in self.gates.get(claim_id, ())]

    def late(self, claim_id: str) -> list[Threshold]:
        """The thresholds of ``claim_id`` fixed after its verdict was first reported."""
        first = self.first_reported.get(claim_id)
        return [t for t in self.of(claim_id) if first is not None and t.fixed.after(first)]

    def sentence(self, claim_id: str) -> str | None:
        """One sentence when a threshold of the claim was fixed after its data were first reported, else None."""
        late, first = self.late(claim_id), self.first_reported.get(claim_id)
        if not late:
            return None
        names = ", ".join(f"{t.name} = {t} (fixed {t.fixed.text()})" for t in late)
        return (
            f"Fixed after the data: {names} {'was' if len(late) == 1 else 'were'} set after this claim's verdict was "
            "first reported "
            f"({first.report or 'the committed report'}, {first.text()}): chosen with those numbers in view, "
            f"{'it does' if len(late) == 1 else 'they do'} not count as preregistered."
        )

    def to_json(self, claim_id: str) -> dict:
        ts = self.of(claim_id)
        last = max((t.fixed for t in ts), key=lambda f: f.when or "9999", default=None)
        first = self.first_reported.get(claim_id)
        return {
            "thresholds": {t.name: t.to_json() for t in ts},
            "fixed": last.to_json() if last else None,
            "first_reported": first.to_json() if first else None,
            "fixed_after_data": bool(self.late(claim_id)),
            "note": self.sentence(claim_id),
        }


def checkpoints_of(shape: dict) -> int:
    """How many checkpoints a study configuration of ``shape`` writes (its steps over checkpoint_every)."""
    return int(shape["steps"] // shape["checkpoint_every"]) if shape.get("checkpoint_every") else 1


CONVERGED = Threshold(
    0.10,
    "converged",
    "a claim's statistic must have changed by less than this share between the runs' last two checkpoints",
    Fixed("2026-11-24", "b991488", "2026-11-24T20:39:05+00:00"),
    feasible=lambda v, shape: checkpoints_of(shape) >= 2,  # two checkpoints to compare (else: passes, not checked)
)
MIN_SEEDS = Threshold(
    2,
    "min_seeds",
    "every compared configuration has at least this many seeds (a seed-to-seed spread to judge effects against)",
    Fixed("2026-11-23", "348f4ae", "2026-11-23T12:21:41+00:00"),
    feasible=lambda v, shape: shape.get("seeds", 1) >= v,
)


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
    sanity: bool = False  # a sanity check of the study, not a claim of the paper: shown outside the tally
    prereg: Preregistration | None = field(default=None, compare=False, repr=False)


class Claims:
    """A paper's claims in report order; ``@claims.claim(id=..., ...)`` declares one (its text beside its code).
    ``preregistered``: the paper's :class:`Preregistration`; with it, every claim must have an entry there."""

    def __init__(self, paper: str, preregistered: Preregistration | None = None):
        self.paper = paper
        self.preregistered = preregistered
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
        sanity: bool = False,
    ) -> Callable:
        def register(fn: Callable) -> Callable:
            if id in self._items:
                raise ValueError(f"{self.paper}: claim id {id!r} is declared twice; claim ids must be unique")
            pre = self.preregistered
            if pre is not None and id not in pre.gates:
                raise ValueError(
                    f"{self.paper}: claim {id!r} has no entry in the paper's preregistration: list the thresholds its "
                    "verdict reads there (() when it reads none)"
                )
            self._items[id] = Claim(
                id, figure, claim, source, passage, rule, paper_value, tuple(needs), fn, sanity, pre
            )
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

    def __post_init__(self):
        pre = self.claims.preregistered
        if pre is not None:
            stray = [cid for cid in pre.gates if cid not in self.claims.ids()]
            if stray:
                raise ValueError(f"{self.name}: the preregistration names claims that do not exist: {stray}")

    @property
    def preregistered(self) -> Preregistration | None:
        """The paper's thresholds in one place (None for a paper that declares none)."""
        return self.claims.preregistered


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
    effects with their CIs), ``measured`` (further numbers for the JSON record), the ``lines`` and ``figures`` the
    report shows under the claim, and for a claim that reads representational similarity ``calibration`` and
    ``second_measure``: whether its conclusion survives calibration against a permutation null and a second measure
    (analysis/studies/calibration.py; beside the verdict, which they do not change)."""

    decision: Decision
    ours: str | None = None
    measured: dict = field(default_factory=dict)
    lines: list[str] = field(default_factory=list)  # markdown shown after the verdict (tables of the numbers)
    figures: list[tuple] = field(default_factory=list)  # (path, name, caption) shown after them
    ungated: Decision | None = None  # the decision with the preconditions off, for rules without parts (a count)
    outside_regime: str | None = None  # a sentence when the study's model is outside the regime the paper describes
    # the paper's numbers tested against ours (analysis/studies/stats.py magnitude): beside the verdict, not in it
    magnitudes: list[dict] = field(default_factory=list)
    calibration: dict | None = None  # a similarity claim's reading against the permutation null (calibration.py)
    second_measure: dict | None = None  # the same reading with a second similarity estimator (calibration.py)

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


def ungated(r: Result) -> Decision:
    """What the claim's parts say with the preconditions off: the same decision (:func:`decide`) on the parts that
    could be computed, with no precondition; a rule without parts (a count) gives its own (``Result.ungated``)."""
    if r.ungated is not None:
        return r.ungated
    d = r.decision
    if not any(not c.passed for c in d.preconditions):
        return d
    if not d.parts:
        return Decision(NOT_TESTABLE, "No part could be computed, with or without the preconditions.", (), ())
    return decide(d.parts, ())


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


def seeds(configs: dict, least: int = MIN_SEEDS) -> Precondition:
    """Every compared configuration has at least ``least`` seeds (:data:`MIN_SEEDS`)."""
    return min_seeds(configs, int(least))


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
    preconditions with their numbers), our number and any further measured values; ``sanity`` (a sanity check, outside
    the tally), ``preregistered`` (the thresholds its verdict reads, each with the date and commit it was fixed at, and
    ``fixed_after_data`` with a sentence where one was fixed after the claim's verdict was first reported),
    ``verdict_ungated`` (what the parts say with the preconditions off, :func:`ungated`), ``outside_regime``,
    ``magnitudes`` (the paper's numbers tested against ours, :func:`~analysis.studies.stats.magnitude`), and
    ``calibration`` / ``second_measure`` (a similarity claim's conclusion against the permutation null and with a second
    estimator, :mod:`analysis.studies.calibration`; null for a claim that reads no similarity)."""
    u = ungated(r)
    pre = claim.prereg.to_json(claim.id) if claim.prereg is not None else None
    return _plain(
        {
            "id": claim.id,
            "sanity": claim.sanity,
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
            "verdict_ungated": u.outcome,
            "why_ungated": u.why,
            "preregistered": pre,
            "outside_regime": r.outside_regime,
            "magnitudes": r.magnitudes,
            "measured": r.measured,
            "calibration": r.calibration,
            "second_measure": r.second_measure,
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
    lines += _preregistered_lines(claim)
    if r.magnitudes:
        lines += ["The paper's number against ours:", ""] + [f"- {m['sentence']}" for m in r.magnitudes] + [""]
    if r.outside_regime:
        lines += [f"Outside the paper's regime: {r.outside_regime}", ""]
    if claim.sanity:
        lines += ["A sanity check of the study, not a claim of the paper: it is left out of the tally.", ""]
    lines += [f"Verdict: {MARK[d.outcome]}. {d.why}", ""]
    if d.preconditions:
        u = ungated(r)
        why = u.why
        if u.parts:  # the parts' numbers are in the table and the verdict above: the reason alone
            measured = "; ".join(p.summary() for p in u.parts)
            why = why.replace(f": {measured}.", ".").replace(f". {measured}.", ".")
        lines += [
            "Verdict with the preconditions off: "
            + (f"{MARK[u.outcome]} (every precondition passed)." if u is d else f"{MARK[u.outcome]}. {why}"),
            "",
        ]
    return lines


def _preregistered_lines(claim: Claim) -> list[str]:
    """The thresholds the claim's verdict reads, each with when it was fixed, and the sentence when one was fixed after
    the claim's data were first reported."""
    pre = claim.prereg
    if pre is None or not pre.of(claim.id):
        return []
    ts = "; ".join(f"{t.name} = {t} (fixed {t.fixed.text()})" for t in pre.of(claim.id))
    late = pre.sentence(claim.id)
    return [f"Preregistered thresholds: {ts}." + (f" **{late}**" if late else ""), ""]


def tally(results: list[tuple[Claim, Result]]) -> dict[str, int]:
    """{outcome: how many claims} over the paper's claims, sanity checks left out."""
    counts = dict.fromkeys(OUTCOMES, 0)
    for c, r in results:
        if not c.sanity:
            counts[r.outcome] += 1
    return counts


def glance(results: list[tuple[Claim, Result]]) -> list[str]:
    """The claims-at-a-glance table (each verdict with the one its parts give with the preconditions off, where that
    differs), the tally over the paper's claims, and the sanity checks in a table of their own, outside the tally."""
    head = [
        "| # | claim (the paper's direction) | figure | paper | ours: effect [95% CI] | verdict |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    lines, sanity = list(head), []
    for i, (c, r) in enumerate(results, 1):
        u = ungated(r).outcome
        verdict = MARK[r.outcome] + (f" (preconditions off: {u})" if u != r.outcome else "")
        verdict += " (outside the paper's regime)" if r.outside_regime else ""
        cells = (str(i), c.claim, c.figure, c.paper_value or "-", ours_text(r) or "-", verdict)
        (sanity if c.sanity else lines).append("| " + " | ".join(_cell(x) for x in cells) + " |")
    counts = tally(results)
    n = sum(counts.values())
    outside = sum(1 for c, r in results if r.outside_regime and not c.sanity)
    lines += [
        "",
        f"Tally over the paper's {n} claim(s) (sanity checks left out): "
        + ", ".join(f"{k} {v}" for k, v in counts.items())
        + (f"; {outside} of them judged outside the paper's regime" if outside else "")
        + ".",
    ]
    if sanity:
        lines += ["", "Sanity checks of the study (not claims of the paper; outside the tally):", "", *head, *sanity]
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
