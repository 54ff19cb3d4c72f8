"""Whether a similarity claim's conclusion survives calibration against a permutation null, and a second measure.

Raw similarity scores between layers or models are far from 0 for representations that share nothing (biased HSIC at
small n, wide layers, pooled features): after calibrating each score against a permutation null, "global" convergence
between models largely disappears while local-neighbourhood agreement survives (Groger, Wen & Brbic 2026). A claim
that reads CKA (Raghu Fig. 1-2 uniformity, Fig. 8 partition, Fig. 12 data drift; Walmer Fig. 6's cross-objective CKA)
therefore also says, beside its verdict (which this does not change), whether its conclusion survives both:

- the claim names its **readings**: the quantity it reads off a similarity map (``stat``: a mean over cells, one cell,
  a gap between halves), on the per-seed maps of the side the paper calls more alike (``a``) minus the same of the
  other side (``b``; none for a level), and the cells of ``a``'s maps the conclusion rests on (``cells``);
- each reading is computed on the ``similarity`` measure's maps (analysis/measures/similarity.py) three ways: raw
  (``score``), calibrated as ``score - null mean`` (``excess``, in the estimator's units) and as ``(score - null
  mean) / null SD`` (``z``); beside them the family-wise adjusted p of the cells (max statistic over the map) and the
  share of the cells significant at the measure's ``alpha``;
- **survives** (fixed before any calibrated number was seen, 2026-11-28): a reading survives when its calibrated
  contrast (the ``excess`` of ``a`` minus that of ``b``, in the paper's direction: smaller is more alike for the
  Procrustes distances) is above 0 **and** at least :data:`SURVIVE_SHARE` of the cells it rests on (mean over ``a``'s
  seeds) are significant against the null at family-wise error ``alpha``; a conclusion survives when every reading
  does. A contrast that holds only in raw scores, or between maps whose cells are at chance, does not survive.
- **second measure**: the same readings and rule on the map of the measure's option ``second`` (e.g. mutual k-NN, a
  local-neighbourhood measure, beside CKA; the same images and permutations).

A claim records both as ``calibration`` and ``second_measure`` (docs/studies.md has the schema) and shows a table and
one sentence each; where the maps are absent (runs analysed before the study listed ``similarity``), ``survives`` is
null and the sentence says "not measured (add similarity to the study's measures)".
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from analysis.studies.claims import Fixed, Threshold

# fixed with the rule itself, before any study had computed a calibrated map
SURVIVE_SHARE = Threshold(
    0.5,
    "calibrated_share",
    "a similarity conclusion survives calibration (or a second measure) only when its calibrated contrast keeps the "
    "paper's direction and at least this share of the layer pairs it rests on is significant against the permutation "
    "null at family-wise error alpha (mean over seeds); reported beside the verdict, which it does not change",
    Fixed("2026-11-28", "c395dca", "2026-11-28T02:20:47+00:00"),
    kind="beside",
)
NOT_MEASURED = "not measured (add similarity to the study's measures)"
NO_SECOND = "not measured (set the similarity option second, e.g. mutual_knn)"
RULE = (
    f"Beside the verdict (not changing it): the conclusion survives calibration when the contrast it reads, computed "
    f"on score minus the permutation null's mean, keeps the paper's direction and at least {SURVIVE_SHARE:g} of the "
    "layer pairs it rests on are significant against the null (family-wise, max statistic over the map); the same on "
    "the similarity measure's second estimator for 'survives a second measure' (analysis/studies/calibration.py)."
)


@dataclass(frozen=True)
class Reading:
    """One quantity a claim reads off similarity maps: ``stat(map, result)`` of each per-seed result of ``a`` minus
    the mean of the same over ``b`` (None: ``a`` alone); ``cells(result)``: the boolean mask of ``a``'s cells the
    conclusion rests on. A list holding a None means a map was not measured."""

    name: str
    a: Sequence[dict | None]
    b: Sequence[dict | None] | None
    stat: Callable[[np.ndarray, dict], float]
    cells: Callable[[dict], np.ndarray]
    part: str | None = None  # the claim's part this reading stands beside (same quantity on the claim's own maps)


def off_diagonal(r: dict) -> np.ndarray:
    """Every cell but the diagonal (a model against itself)."""
    return ~np.eye(*np.shape(r["score"]), dtype=bool)


def mean_over(mask: Callable[[dict], np.ndarray]) -> Callable[[np.ndarray, dict], float]:
    """The stat: a map's mean over the cells of ``mask``."""
    return lambda m, r: float(np.mean(np.asarray(m, dtype=float)[mask(r)]))


def _has(rs, keys: Sequence[str]) -> bool:
    return bool(rs) and all(r is not None and all(k in r for k in keys) for r in rs)


def _contrast(rd: Reading, key: str) -> float:
    """mean over a's seeds of stat(a[key]) minus the same over b (0 without b)."""
    a = float(np.mean([rd.stat(np.asarray(r[key], dtype=float), r) for r in rd.a]))
    b = float(np.mean([rd.stat(np.asarray(r[key], dtype=float), r) for r in rd.b])) if rd.b else 0.0
    return a - b


def read(rd: Reading, prefix: str = "") -> dict | None:
    """One reading on the maps' ``prefix`` keys ("" the estimator's, "second_" the second estimator's): raw,
    ``null_mean``, ``calibrated`` (score - null mean) and ``z`` contrasts, the per-seed median FWER p over the cells,
    the share of the cells significant and whether it survives; None when a map or its null is missing."""
    keys = [f"{prefix}{k}" for k in ("score", "null_mean", "excess", "z", "p_fwer")]
    if not _has(rd.a, keys) or (rd.b is not None and not _has(rd.b, keys)):
        return None
    first = rd.a[0]
    lower = bool(int(first.get(f"{prefix}lower", 0)))
    alpha = float(first.get("alpha", 0.05))
    sign = -1.0 if lower else 1.0  # the paper's direction: more alike is larger, or smaller for a distance
    p = [np.asarray(r[f"{prefix}p_fwer"], dtype=float)[rd.cells(r)] for r in rd.a]
    share = float(np.mean([np.mean(np.nan_to_num(q, nan=1.0) <= alpha) for q in p]))
    raw, null, excess, z = (_contrast(rd, f"{prefix}{k}") for k in ("score", "null_mean", "excess", "z"))
    return {
        "name": rd.name,
        "estimator": str(first.get(f"{prefix}estimator", first.get("estimator", ""))),
        "raw": raw,
        "null_mean": null,
        "calibrated": excess,
        "z": z,
        "p_fwer": [float(np.median(q)) for q in p],
        "significant_share": share,
        "survives": bool(sign * excess > 0 and share >= SURVIVE_SHARE),
        "n_perm": int(first.get(f"{prefix}n_perm", 0)),
        "n_images": int(first.get(f"{prefix}n_images", 0)),
        "alpha": alpha,
        "lower": lower,
    }


def assess(readings: Sequence[Reading], prefix: str = "") -> dict:
    """Every reading on the maps' ``prefix`` keys: {``survives``: all readings survive (None when a map is missing),
    ``measure``, ``readings``, ``raw`` / ``calibrated`` / ``z`` / ``p_fwer`` of the first (headline) reading,
    ``sentence``}."""
    out = [read(rd, prefix) for rd in readings]
    what = "a second measure" if prefix else "calibration"
    if not out or any(o is None for o in out):
        missing = prefix and any(_has(rd.a, ["score"]) for rd in readings)  # the maps are there, without a second
        note = NO_SECOND if missing else NOT_MEASURED
        return {
            "survives": None,
            "measure": None,
            "readings": [],
            "raw": None,
            "calibrated": None,
            "z": None,
            "p_fwer": None,
            "sentence": f"Whether the conclusion survives {what}: {note}.",
        }
    survives = all(o["survives"] for o in out)
    head = out[0]
    failed = [o for o in out if not o["survives"]]
    how = (
        f"{head['estimator']} against its permutation null ({head['n_perm']} permutations, {head['n_images']} "
        f"images, family-wise alpha {head['alpha']:g})"
    )
    if survives:
        why = (
            f"every reading keeps the paper's direction after subtracting the null mean and at least "
            f"{SURVIVE_SHARE:g} of its layer pairs are beyond chance ({how})"
        )
    else:
        why = "; ".join(
            f"{o['name']}: calibrated contrast {o['calibrated']:+.3g} (raw {o['raw']:+.3g}), "
            f"{o['significant_share']:.0%} of its layer pairs significant"
            for o in failed
        )
        why += f" ({how})"
    return {
        "survives": survives,
        "measure": head["estimator"],
        "readings": out,
        "raw": head["raw"],
        "calibrated": head["calibrated"],
        "z": head["z"],
        "p_fwer": head["p_fwer"],
        "sentence": f"The conclusion {'survives' if survives else 'does not survive'} {what}: {why}.",
    }


def lines(calibration: dict, second: dict) -> list[str]:
    """The report's table of every reading, raw and calibrated, for both measures, and the two sentences."""
    rows = [(m, o) for m in (calibration, second) for o in m["readings"]]
    out = []
    if rows:
        out += [
            "Raw and calibrated similarity (calibrated: score minus the permutation null's mean, and z = that over the "
            "null's SD; FWER p: the median over the cells the reading rests on of the family-wise adjusted p, per "
            "seed):",
            "",
            "| reading | estimator | raw | null mean | calibrated | z | FWER p | pairs significant | survives |",
            "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
        ]
        for _, o in rows:
            p = ", ".join(f"{v:.2g}" for v in o["p_fwer"])
            out.append(
                f"| {o['name']} | {o['estimator']} | {o['raw']:+.4g} | {o['null_mean']:+.4g} | {o['calibrated']:+.4g} "
                f"| {o['z']:+.3g} | {p} | {o['significant_share']:.0%} | {'yes' if o['survives'] else 'no'} |"
            )
        out.append("")
    return [*out, calibration["sentence"], "", second["sentence"], ""]


def representation_differs(result, readings: Sequence[Reading]) -> list[dict]:
    """The readings whose raw contrast on the similarity measure's maps points against the effect of the claim part
    they stand beside (``Reading.part``), both in the paper's direction: the similarity maps read another
    representation than the claim's own (e.g. block outputs' mean spatial token on 1,000 images against the paper's
    layer set on all the analysis images), so such a reading and the verdict differ before any calibration, and
    "survives calibration" speaks of the similarity maps' conclusion, not of the verdict's."""
    parts = {p.name: p for p in result.decision.parts}
    out = []
    for rd, o in zip(readings, (result.calibration or {}).get("readings") or []):
        part = parts.get(rd.part) if rd.part else None
        if part is None:
            continue
        raw = (-1.0 if o["lower"] else 1.0) * o["raw"]
        if np.isfinite(raw) and np.isfinite(part.effect) and raw * part.effect < 0:
            out.append({"reading": o["name"], "raw": raw, "part": part.name, "effect": float(part.effect)})
    return out


def attach(result, readings: Sequence[Reading]):
    """Set ``result.calibration`` and ``result.second_measure`` from ``readings`` and add their table and sentences
    to its lines (and a sentence where a reading's raw contrast points against the part it stands beside:
    :func:`representation_differs`); the verdict is left as it is. Returns ``result``."""
    result.calibration = assess(readings)
    result.second_measure = assess(readings, "second_")
    result.lines += lines(result.calibration, result.second_measure)
    differs = representation_differs(result, readings)
    if differs:
        result.calibration["representation_differs"] = differs
        pairs = "; ".join(
            f"{d['reading']} {d['raw']:+.3g} raw, against {d['part']} {d['effect']:+.3g}" for d in differs
        )
        result.lines += [
            "The similarity maps read another representation than the verdict's own maps, and their raw contrast "
            f"already points the other way ({pairs}; both in the paper's direction): the two differ before any "
            "calibration, so whether the conclusion survives calibration is said of the similarity maps' reading, "
            "not of the verdict's.",
            "",
        ]
    return result


# ------------------------------------------------------------------------------------------------ reading the maps


def listed(ctx) -> bool:
    """Whether the study lists the ``similarity`` measure (then the report computes a missing map)."""
    return "similarity" in (getattr(ctx.study, "measures", None) or [])


def self_map(ctx, run) -> dict | None:
    """``run``'s similarity map against itself at its last checkpoint: computed (cached) with the study's options when
    the study lists the measure (a run with a measures list of its own may lack it), else whatever was saved."""
    if listed(ctx):
        from analysis.frontends.runner import analyze_run
        from analysis.results.folders import AnalysisError

        try:
            analyze_run(run, ["last"], ctx.study.suite_options(["similarity"]), progress=False)
        except AnalysisError as e:  # e.g. a run that cannot be written to: the claim says the map is missing
            print(f"similarity of {run.name} not computed: {e}")
    return ctx.last(run, "similarity", optional=True)


def cross_map(ctx, run, other, step: int | None = None, on_other_images: bool = False) -> dict | None:
    """The similarity map of ``run`` (rows; at ``step``, default its last) against ``other``'s last checkpoint
    (analysis/reports/cross.py ``against``, cached); None when the study does not list the measure."""
    if not listed(ctx):
        return None
    from analysis.reports import cross as XC

    step = max(run.checkpoints) if step is None else step
    opts = ctx.study.suite_options(["similarity"])
    res = XC.against(
        run, other, max(other.checkpoints), [step], opts=opts, progress=False, on_other_images=on_other_images
    )
    return res["similarity"].get(step)
