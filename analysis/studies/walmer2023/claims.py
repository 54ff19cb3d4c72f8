"""Walmer et al. 2023's claims, each declared once: its text, the code that reads its numbers, and its rule (a
``rule_*`` function beside it that decides from per-seed values, so the tests can feed it synthetic seeds). The order
here is the order of the report.

Every rule is a set of parts decided by the one statistical rule (analysis/studies/claims.py, stats.py): two
objectives are compared by Welch's t over seeds (a model trained with another objective is another recipe, whose seed
SD need not be the same); a statistic of one objective is a one-sample t; a number of two models (CKA or a map
distance between two objectives) is one value per seed pair (the two models of the same seed), read against the
cross-seed baseline (two seeds of one objective): a one-sample t against its mean (the attention maps), or Welch's t
of the baseline's pairs against the cross-objective values (the CLS CKA, whose claim is not testable without it).
A claim that features are semantic ("above chance") is tested against the strongest baseline the report shows (the
controls section: Gaussian features, a random-initialised network, the raw pixels).

Preconditions make a claim "not testable" when the models are not yet the kind the paper describes:

- **regime**: a compared self-supervised model reached at least :data:`REGIME` of its paper's k-NN share of
  supervised (Walmer Table 1: DINO 76.06 / 83.79 = 0.91, MAE 45.19 / 83.79 = 0.54 of supervised's k-NN top-1) before
  its attention or representations are compared -- not before its semantics: the k-NN level is what the semantic
  claims test, so they are gated on its plateau instead;
- **plateau** (the semantic claims): the k-NN top-1 changed by less than CONVERGED (10%) between each pair of
  consecutive checkpoints among the runs' last PLATEAU_CHECKPOINTS (3), where the study measured it there;
- **locality**: some head of the compared models attends below LOCALITY_PRECONDITION x uniform attention's distance
  (analysis/studies/locality.py) before a locality claim is judged;
- **converged**: the statistic changed by less than CONVERGED (10%) between the runs' last two checkpoints, where the
  study measured it at both (attention distance: the study's ``every_checkpoint``);
- two seeds of every compared objective.

DINO is read by its teacher when its checkpoints hold one (controls.py); the numbers of the teacher are then what
"dino" means below.
"""

from __future__ import annotations

import itertools

import numpy as np

from analysis.results import folders as RF0
from analysis.results import storage
from analysis.studies import calibration as CAL
from analysis.studies.claims import (
    CONVERGED,
    MARK,
    Claims,
    Result,
    compare_part,
    converged,
    judge,
    one_part,
    seeds,
    slope_part,
)
from analysis.studies.locality import LOCALITY_PRECONDITION, locality_precondition, uniform_of
from analysis.studies.stats import HELD, INCONCLUSIVE, NOT_HELD, NOT_TESTABLE, Decision, Precondition
from analysis.studies.walmer2023 import numbers as N
from analysis.studies.walmer2023 import reads as R
from analysis.studies.walmer2023.preregistered import (
    CEILING_MARGIN,
    MIN_PROFILE_BLOCKS,
    PLATEAU_CHECKPOINTS,
    PREREGISTERED,
    REGIME,
    STRONGEST_BASELINE,
)

CLAIMS = Claims("walmer2023", PREREGISTERED)  # every threshold a verdict reads: preregistered.py
SOURCE = "Walmer et al. 2023"
POSITIVE_CONTROL = (
    'A "not testable" or "did not hold" rests on a detector with a positive control '
    "(tests/interventions/test_positive_control.py), "
    "which also finds offset local heads in the first half of a real pretrained DINOv2-style ViT-S/14 and none in "
    "its last blocks (docs/real-vit.md)."
)
REGIME_TEXT = (
    f"Precondition (regime): every compared self-supervised model reached {REGIME:g} x its paper's k-NN share of "
    "supervised (Table 1: DINO 0.91, MAE 0.54)."
)
PLATEAU_TEXT = (
    f"Precondition (plateau): the k-NN top-1 of every compared objective (last block, CLS, mean over seeds) changed by "
    f"less than {100 * CONVERGED:.0f}% between each pair of consecutive checkpoints among the runs' last "
    f"{PLATEAU_CHECKPOINTS:g} -- whether training has settled, not the k-NN level the claim compares."
)


# ------------------------------------------------------------------------------------------------ preconditions


def regime_precondition(shares: dict) -> list[Precondition]:
    """``shares``: self-supervised objective -> its k-NN top-1 (last block, CLS, mean over seeds) as a share of the
    supervised model's (None when either is missing). One precondition per objective: the share is at least
    :data:`REGIME` x the paper's (:func:`numbers.paper_share`)."""
    out = []
    for o, share in shares.items():
        need = REGIME * N.paper_share(o)
        numbers = {"objective": o, "share": share, "paper_share": N.paper_share(o), "needed": need}
        if share is None:
            out.append(
                Precondition(
                    "regime",
                    False,
                    f"{o}'s k-NN share of supervised cannot be computed (the study needs a supervised model and a "
                    f"k-NN result on both), so whether {o} is yet the kind of model the paper describes is unknown",
                    numbers,
                )
            )
        elif share >= need:
            out.append(
                Precondition(
                    "regime",
                    True,
                    f"{o} reaches {share:.2f} of supervised's k-NN top-1 (Walmer Table 1: {N.paper_share(o):.2f}; the "
                    f"rule needs {need:.2f})",
                    numbers,
                )
            )
        else:
            out.append(
                Precondition(
                    "regime",
                    False,
                    f"{o} reaches {share:.2f} of supervised's k-NN top-1, against {N.paper_share(o):.2f} in Walmer's "
                    f"Table 1; the rule compares {o} only from {REGIME:g} x that = {need:.2f} on (below it {o} is not "
                    "yet the trained model the paper describes)",
                    numbers,
                )
            )
    return out


def knn_shares(ctx, objectives) -> dict:
    """{self-supervised objective among ``objectives``: its mean last-block CLS k-NN top-1 / supervised's, or None}."""

    def mean_top1(o):
        vals = [R.knn(ctx, r) for r in ctx.configs.get(o, [])]
        return float(np.mean([v["top1"] for v in vals])) if vals and all(vals) else None

    sup = mean_top1("supervised")
    out = {}
    for o in objectives:
        if o in N.SELF_SUPERVISED and o in ctx.configs:
            m = mean_top1(o)
            out[o] = m / sup if m is not None and sup else None
    return out


def regime(ctx, objectives) -> list[Precondition]:
    return regime_precondition(knn_shares(ctx, objectives))


def plateau_precondition(curves: dict) -> list[Precondition]:
    """``curves``: objective -> {step: mean k-NN top-1 over seeds} at the runs' last checkpoints. One precondition per
    objective: over its last :data:`PLATEAU_CHECKPOINTS` measured steps, every change between consecutive ones is below
    :data:`CONVERGED` of the later value; with fewer than two measured steps it passes and says it was not checked."""
    out = []
    for o, by in curves.items():
        steps = sorted(by)[-int(PLATEAU_CHECKPOINTS) :]
        vals = [by[s] for s in steps]
        numbers = {"objective": o, "steps": steps, "knn": vals, "limit": CONVERGED, "checkpoints": PLATEAU_CHECKPOINTS}
        if len(steps) < 2:
            out.append(
                Precondition(
                    "plateau", True, f"{o}: k-NN measured at {len(steps)} checkpoint(s), so not checked", numbers
                )
            )
            continue
        changes = [abs(b - a) / max(abs(b), 1e-12) for a, b in itertools.pairwise(vals)]
        path = " -> ".join(f"{v:.4f}" for v in vals)
        where = f"{o}'s k-NN top-1 over steps {', '.join(map(str, steps))}: {path}"
        if max(changes) < CONVERGED:
            few = ""
            if len(steps) < PLATEAU_CHECKPOINTS:
                few = f" (only {len(steps)} of the {PLATEAU_CHECKPOINTS:g} checkpoints measured)"
            out.append(
                Precondition(
                    "plateau",
                    True,
                    f"{where}, every step within {100 * max(changes):.1f}%{few}",
                    numbers,
                )
            )
        else:
            out.append(
                Precondition(
                    "plateau",
                    False,
                    f"{where}: still moving ({100 * max(changes):.0f}% in one step; the rule needs less than "
                    f"{100 * CONVERGED:.0f}% at every step), so the model has not settled into what its objective "
                    "teaches",
                    numbers,
                )
            )
    return out


def plateau(ctx, objectives) -> list[Precondition]:
    """:func:`plateau_precondition` from the runs' k-NN at their last checkpoints (where measured)."""
    curves = {}
    for o in objectives:
        runs = ctx.configs.get(o, [])
        if not runs:
            continue
        steps = sorted(set.intersection(*(set(getattr(r, "checkpoints", {}) or {}) for r in runs)))
        by = {}
        for s in steps[-int(PLATEAU_CHECKPOINTS) :]:
            vals = [R.knn_at(ctx, r, s) for r in runs]
            if all(v is not None for v in vals):
                by[s] = float(np.mean([v["top1"] for v in vals]))
        curves[o] = by
    return plateau_precondition(curves)


def locality(ctx, objectives) -> Precondition:
    runs = [r for o in objectives for r in ctx.configs.get(o, [])]
    ds = [R.distances(ctx, r, "pixels") for r in runs]
    ds = [d for d in ds if d is not None]
    if not ds:
        return Precondition("locality", False, "no attention distance was measured, so no head can be called local")
    return locality_precondition(float(min(d.min() for d in ds)), uniform_of(runs[0])[1], " and ".join(objectives))


def _converged(ctx, objectives, stat, name: str, scale: float = 0.0) -> list[Precondition]:
    """converged() per objective: ``stat(ctx, run, previous)`` at the last and the second-to-last checkpoint."""
    out = []
    for o in objectives:
        runs = ctx.configs.get(o, [])
        last = [stat(ctx, r, False) for r in runs]
        prev = [stat(ctx, r, True) for r in runs]
        if not runs or any(v is None for v in last):
            continue
        out.append(converged(f"{o}'s {name}", last, None if any(p is None for p in prev) else prev, scale))
    return out


def _later_distance(ctx, run, previous):
    d = R.distances(ctx, run, previous=previous)
    return None if d is None else N.halves(d)["later"]


def _missing(values: dict, what: str) -> Precondition | None:
    """A failed precondition when an objective has no values or a seed lacks one."""
    bad = [o for o, v in values.items() if not v or any(x is None for x in v)]
    if not bad:
        return None
    return Precondition(
        "measured",
        False,
        f"no {what} on every seed of {', '.join(bad)} (the model lacks what the measure needs, e.g. a CLS token, or "
        "the measure was not run at its last checkpoint)",
    )


def _not_testable(conds: list[Precondition], measured: dict | None = None) -> Result:
    text = "; ".join(c.sentence for c in conds if not c.passed)
    return Result(
        Decision(NOT_TESTABLE, f"{text[0].upper()}{text[1:]}.", (), (), tuple(conds)), measured=measured or {}
    )


def _per(ctx, objectives, fn) -> dict:
    """objective -> [fn(ctx, run) per seed] (None where the run lacks it)."""
    return {o: [fn(ctx, r) for r in ctx.configs.get(o, [])] for o in objectives}


def _figure(run, name: str, tag: str, caption: str) -> tuple:
    return (storage.step_dir(run.path, max(run.checkpoints), "figures", run.part) / name, tag, caption)


# ------------------------------------------------------------------------------------------------ Fig. 3, 14


@CLAIMS.claim(
    "offset_heads_every_objective",
    figure="Walmer Fig. 3, 14",
    claim="Every ViT learns offset local attention heads, whatever its objective",
    source=f"{SOURCE} §4.2",
    passage="We find instances of Offset Local Attention Heads in all the models examined, suggesting they are "
    "fundamentally necessary for ViTs.",
    rule="Preconditions: some head of the study's models attends below "
    f"{LOCALITY_PRECONDITION:g} x uniform attention's distance, some head is local (aligned_attention local: at least "
    "half of the attention within one token of a point at most two tokens away), at least two objectives with two "
    f"seeds each; {REGIME_TEXT[len('Precondition (regime): ') :]} A count, not a test: per objective, held if every "
    "seed's model has an offset local head, did not hold if none has, inconclusive if only some have; the claim "
    "holds when it holds for every objective and does not hold when it fails for one. " + POSITIVE_CONTROL,
    paper_value='location only (App. C.1: "Offset Local Attention Heads typically only occur in the first 3 to 6 '
    'layers" for supervised models)',
)
def offset_heads_every_objective(ctx) -> Result:
    objs = [o for o in N.OBJECTIVES if o in ctx.configs]
    aligned = _per(ctx, objs, lambda c, r: c.last(r, "aligned_attention"))
    aligned = {o: [a for a in v if a is not None] for o, v in aligned.items()}
    conds = [locality(ctx, objs), *regime(ctx, objs)]
    r = rule_offset_heads(
        {o: [{"local": a["local"], "offset_local": a["offset_local"]} for a in v] for o, v in aligned.items()}, conds
    )
    r.figures += [
        _figure(
            rs[0],
            "aligned_attention_mass_maps.png",
            f"aligned_attention_{o}",
            f"Aligned aggregated attention maps, {rs[0].label} (cf. Walmer Fig. 3)",
        )
        for o, rs in ((o, ctx.configs[o]) for o in objs)
    ]
    return r


def rule_offset_heads(runs: dict[str, list[dict]], conds: list[Precondition] = ()) -> Result:
    """``runs``: objective -> per seed {"local": [L, H] bool, "offset_local": [L, H] bool} (aligned_attention)."""
    local = {o: [int(np.asarray(r["local"], dtype=bool).sum()) for r in rs] for o, rs in runs.items()}
    counts = {o: [N.offset_heads(r["offset_local"]) for r in rs] for o, rs in runs.items()}
    heads = sum(int(np.asarray(r["local"]).size) for rs in runs.values() for r in rs)
    n_runs = sum(len(rs) for rs in runs.values())
    measured = {
        "local_heads": local,
        "offset_local_heads": {o: [c["count"] for c in cs] for o, cs in counts.items()},
        "where": {o: [c["where"][:4] for c in cs] for o, cs in counts.items()},
    }
    n_local = sum(map(sum, local.values()))
    conds = [
        *conds,
        Precondition(
            "objectives",
            len([o for o, rs in runs.items() if rs]) >= 2,
            f"{len([o for o, rs in runs.items() if rs])} objective(s) with an aligned_attention result "
            f"({', '.join(o for o, rs in runs.items() if rs) or 'none'}; the claim is about models taught differently)",
        ),
        Precondition(
            "local head",
            n_local > 0,
            f"{n_local} of {heads} heads in {n_runs} runs are local"
            if n_local
            else f"no model of the study has a local head (0 of {heads} heads in {n_runs} runs), so offset local "
            "heads cannot appear",
            {"heads": heads},
        ),
        seeds(runs),
    ]
    ours = f"{n_local} of {heads} heads local; " + "; ".join(
        f"{o} {sum(c['count'] > 0 for c in cs)} of {len(cs)} seeds with an offset local head"
        for o, cs in counts.items()
    )
    per, why = [], []
    for o, cs in counts.items():
        have = [c["count"] > 0 for c in cs]
        if not have:
            continue
        per.append(HELD if all(have) else NOT_HELD if not any(have) else INCONCLUSIVE)
        why.append(
            f"{o}: {sum(have)} of {len(have)} seeds have one ({', '.join(str(c['count']) for c in cs)} offset local "
            f"of {', '.join(str(n) for n in local[o])} local heads, by seed; {per[-1]})"
        )
    out = NOT_HELD if NOT_HELD in per else HELD if per and all(p == HELD for p in per) else INCONCLUSIVE
    counted = (
        Decision(out, "; ".join(why) + ".", (), ())
        if per
        else Decision(NOT_TESTABLE, "No model has an aligned_attention result to count.", (), ())
    )
    if not all(c.passed for c in conds):
        r = _not_testable(conds, measured)
        r.ours, r.ungated = ours, counted
        return r
    return Result(Decision(out, counted.why, (), (), tuple(conds)), ours=ours, measured=measured)


# ------------------------------------------------------------------------------------------------ Fig. 4


@CLAIMS.claim(
    "reconstruction_stays_local",
    figure="Walmer Fig. 4, 15",
    claim="Reconstruction (MAE) keeps attention local deep into the network: in the later layers its attention "
    "distance stays below the supervised and the contrastive (DINO) model's",
    source=f"{SOURCE} §4.3",
    passage="The behaviors diverge in the mid-to-late layers. For the models trained with explicit or contrastive "
    "supervision, the Attention Distance trends upward in the later layers. For the reconstruction-based methods, "
    "the Average Attention Distances stay lower.",
    rule="Mean attention distance (Walmer's unit square: the token grid embedded on a 1 x 1 square) over the heads "
    "and the later half of the blocks. One part per objective the study has besides mae (Welch over seeds): that "
    f"objective's minus mae's. Preconditions (locality): some head of the compared models below "
    f"{LOCALITY_PRECONDITION:g} x uniform attention's distance; the later-half distance changed by "
    f"less than {100 * CONVERGED:.0f}% "
    f"between the last two checkpoints. {REGIME_TEXT}",
    paper_value="not stated as a number (Fig. 4 right: MAE's per-layer mean below FS's and DINO's from about layer 7)",
    needs=("mae",),
)
def reconstruction_stays_local(ctx) -> Result:
    objs = ["mae", *[o for o in ("supervised", "dino") if o in ctx.configs]]
    conds = [
        locality(ctx, objs),
        *regime(ctx, objs),
        *_converged(ctx, objs, _later_distance, "later-half attention distance"),
    ]
    return rule_reconstruction_local(_per(ctx, objs, lambda c, r: R.distances(c, r)), conds)


def rule_reconstruction_local(distances: dict[str, list], conds: list[Precondition] = ()) -> Result:
    """``distances``: objective -> per seed attention distances [L, H] (unit square); mae and at least one other."""
    others = [o for o in ("supervised", "dino") if o in distances]
    miss = _missing({o: distances.get(o) for o in ("mae", *others)}, "attention distance")
    if not others or miss:
        return _not_testable(
            [*conds, miss or Precondition("objectives", False, "no supervised or dino model to compare mae with")]
        )
    later = {o: [N.halves(d)["later"] for d in distances[o]] for o in ("mae", *others)}
    parts = [compare_part(f"later-half attention distance, {o} - mae", later[o], later["mae"]) for o in others]
    d = judge(parts, [*conds, seeds(later)])
    ours = ", ".join(f"{o} {np.mean(v):.3f}" for o, v in later.items())
    return Result(d, ours=f"later-half distance {ours}; " + d.ours if d.parts else None, measured={"later": later})


@CLAIMS.claim(
    "attention_depth_profile",
    figure="Walmer Fig. 4 right",
    claim="Attention distance falls after the first layers in every model, and rises again in the later layers of "
    "the supervised and the contrastive (DINO) model",
    source=f"{SOURCE} §4.3",
    passage="Figure 4 (right) compares the combined Average Attention Distances at the per-layer level. In all "
    "models, we observe a greater number of global attention heads in the initial layers, followed by decreased "
    "distances around layers 3-6. […] For the models trained with explicit or contrastive supervision, the "
    "Attention Distance trends upward in the later layers.",
    rule="Per block the mean attention distance over heads (unit square). Parts (one-sample t over seeds): per "
    "objective, the first block's mean minus the mean of the blocks at Walmer's layers 3-6 of 12 (normalised depth "
    "(l + 1) / L in [0.25, 0.5]: blocks 1-2 of 6), above 0; for supervised and dino, the least-squares slope of the "
    f"per-block mean over the block index in the later half, above 0. Preconditions (locality): some head below "
    f"{LOCALITY_PRECONDITION:g} x uniform attention's distance; the later-half distance changed by "
    f"less than {100 * CONVERGED:.0f}% "
    f"between the last two checkpoints. {REGIME_TEXT}",
    paper_value="not stated as a number (Fig. 4 right: a dip around layers 3-6 of 12 in every model)",
)
def attention_depth_profile(ctx) -> Result:
    objs = [o for o in N.OBJECTIVES if o in ctx.configs]
    conds = [
        locality(ctx, objs),
        *regime(ctx, objs),
        *_converged(ctx, objs, _later_distance, "later-half attention distance"),
    ]
    return rule_depth_profile(_per(ctx, objs, lambda c, r: R.distances(c, r)), conds)


def rule_depth_profile(distances: dict[str, list], conds: list[Precondition] = ()) -> Result:
    """``distances``: objective -> per seed attention distances [L, H]."""
    miss = _missing(distances, "attention distance")
    if not distances or miss:
        return _not_testable([*conds, miss or Precondition("objectives", False, "no objective measured")])
    if any(len(d) < MIN_PROFILE_BLOCKS for v in distances.values() for d in v):
        return _not_testable(
            [
                *conds,
                Precondition("blocks", False, f"a model with fewer than {MIN_PROFILE_BLOCKS:g} blocks has no profile"),
            ]
        )
    prof = {o: [N.depth_profile(d) for d in v] for o, v in distances.items()}
    parts = [one_part(f"{o}: first block - blocks of layers 3-6", [p["dip"] for p in ps]) for o, ps in prof.items()]
    for o in ("supervised", "dino"):
        if o in prof:
            ps = prof[o]
            parts.append(
                slope_part(f"{o}: later-half slope per block", ps[0]["later_blocks"], [p["later"] for p in ps])
            )
    return Result(judge(parts, [*conds, seeds(distances)]), measured={"profile": prof})


# ------------------------------------------------------------------------------------------------ Fig. 2


@CLAIMS.claim(
    "reconstruction_cls_covers_more",
    figure="Walmer Fig. 2, 17",
    claim="In the later layers reconstruction (MAE) CLS attention covers more of the image than contrastive (DINO) "
    "CLS attention, which concentrates on centred blobs",
    source=f"{SOURCE} §4.1",
    passage="For the contrastive self-supervised methods, DINO and MoCo, the attention maps tend to be centered blobs. "
    "These heads tend to focus on salient foreground objects, so these blobs simply reflect object-centered "
    "photography bias. For the reconstruction-based methods, MAE and BEiT, we see a more diverse group of "
    "attention maps. This is likely because these methods must reconstruct all image regions, and thus their "
    "attention in the final layers must be more diverse and cover more of the image.",
    rule="Entropy (nats) of the average CLS attention map over the spatial tokens (cls_attention map_entropy: the map "
    "Walmer draws, averaged over images), mean over the heads and the later half of the blocks: mae's minus dino's "
    "(Welch over seeds). Walmer shows the maps and states no number; covering more of the image is read as a higher "
    f"entropy of the average map. {REGIME_TEXT}",
    paper_value="not stated as a number (Fig. 2: maps only)",
    needs=("dino", "mae"),
)
def reconstruction_cls_covers_more(ctx) -> Result:
    vals = _per(ctx, ("mae", "dino"), lambda c, r: _cls_field(c, r, "map_entropy"))
    return rule_later_difference(
        vals,
        "mae",
        "dino",
        "later-half entropy of the average CLS map, mae - dino (nats)",
        regime(ctx, ("mae", "dino")),
    )


def _cls_field(ctx, run, key):
    a = ctx.last(run, "cls_attention")
    return None if a is None else np.asarray(a[key], dtype=float)


def rule_later_difference(values: dict[str, list], a: str, b: str, name: str, conds=()) -> Result:
    """Later-half mean of per seed [L, H] ``values``, objective ``a`` minus ``b`` (Welch)."""
    miss = _missing({o: values.get(o) for o in (a, b)}, "CLS attention map")
    if miss:
        return _not_testable([*conds, miss])
    later = {o: [N.halves(e)["later"] for e in values[o]] for o in (a, b)}
    d = judge([compare_part(name, later[a], later[b])], [*conds, seeds(later)])
    return Result(d, measured={"later": later})


@CLAIMS.claim(
    "supervised_cls_sparse",
    figure="Walmer Fig. 2, 11",
    claim="In the later layers the supervised model's CLS attention falls on a few sparse positions (Sparse Repeating "
    "Patterns), more concentrated on one image than the contrastive (DINO) model's object blobs",
    source=f"{SOURCE} §4.1",
    passage="Finally, for the explicitly supervised methods, FS and CLIP, the mid-to-final layers do not focus on "
    "salient object regions and instead focus on Sparse Repeating Patterns with seemingly no spatial meaning.",
    rule="Mean per-image entropy (nats) of the CLS attention over the spatial tokens (cls_attention entropy), mean "
    "over the heads and the later half of the blocks: dino's minus supervised's (Welch over seeds). Walmer states no "
    'number; "sparse" (Fig. 11: "a small group of spatial token positions [...] have strong and consistent '
    f'activations" on one image) is read as a lower per-image entropy. {REGIME_TEXT}',
    paper_value="not stated as a number (Fig. 2, 11: maps only)",
    needs=("supervised", "dino"),
)
def supervised_cls_sparse(ctx) -> Result:
    vals = _per(ctx, ("dino", "supervised"), lambda c, r: _cls_field(c, r, "entropy"))
    return rule_later_difference(
        vals,
        "dino",
        "supervised",
        "later-half per-image CLS attention entropy, dino - supervised (nats)",
        regime(ctx, ("dino",)),
    )


@CLAIMS.claim(
    "attention_diverges_late",
    figure="Walmer Fig. 2",
    claim="Objectives agree early and diverge late in attention: the average CLS attention maps of two ViTs taught "
    "differently differ more in the later layers than in the first ones, beyond what two seeds of one objective do",
    source=f"{SOURCE} Fig. 2 caption",
    passage="Clear differences in attention emerge in the mid-to-late layers under different supervision methods.",
    rule="Per block, the total-variation distance between two models' average CLS attention maps (cls_attention "
    "maps, averaged over heads: heads are not matched across models; 0 = the same map, 1 = disjoint); its later-half "
    "mean minus its first-half mean is one value per seed pair (the two objectives' models of the same seed). One "
    "part per pair of objectives (one-sample t over seeds) against the cross-seed baseline: the same number between "
    f"two seeds of one objective (mean over both objectives' seed pairs). {REGIME_TEXT}",
    paper_value="not stated as a number (Fig. 2: maps only)",
)
def attention_diverges_late(ctx) -> Result:
    objs = [o for o in N.OBJECTIVES if o in ctx.configs]
    maps = _per(ctx, objs, lambda c, r: _cls_field(c, r, "maps"))
    r = rule_attention_diverges(maps, regime(ctx, objs))
    r.figures += [
        _figure(
            ctx.configs[o][0],
            "cls_attention_maps.png",
            f"cls_attention_{o}",
            f"Average CLS attention maps, {ctx.configs[o][0].label} (cf. Walmer Fig. 2)",
        )
        for o in objs
    ]
    return r


def rule_attention_diverges(maps: dict[str, list], conds=()) -> Result:
    """``maps``: objective -> per seed cls_attention maps [L, H, gh, gw]."""
    miss = _missing(maps, "CLS attention map")
    objs = list(maps)
    if miss or len(objs) < 2:
        return _not_testable([*conds, miss or Precondition("objectives", False, "fewer than two objectives")])
    if any(len(m) < 2 for v in maps.values() for m in v):
        return _not_testable([*conds, Precondition("blocks", False, "a model with one block has no early and late")])

    def cross_seed(o):
        return [N.late_minus_early(N.map_distance(a, b)) for a, b in itertools.combinations(maps[o], 2)]

    parts, measured = [], {}
    for a, b in itertools.combinations(objs, 2):
        k = min(len(maps[a]), len(maps[b]))
        vals = [N.late_minus_early(N.map_distance(maps[a][i], maps[b][i])) for i in range(k)]
        base = cross_seed(a) + cross_seed(b)
        ref = float(np.mean(base)) if base else 0.0
        measured[f"{a} vs {b}"] = {"late_minus_early": vals, "cross_seed": base}
        parts.append(one_part(f"{a} vs {b}: later - first half map distance, above cross-seed ({ref:+.3f})", vals, ref))
    return Result(judge(parts, [*conds, seeds(maps)]), measured=measured)


# ------------------------------------------------------------------------------------------------ Fig. 7, 9


def _semantic(ctx, objs) -> tuple[dict, dict]:
    return _per(ctx, objs, R.knn), _per(ctx, objs, R.purity)


def _controls(ctx, objs) -> list[str]:
    """The random-initialised network's and the raw pixels' k-NN and purity beside the objectives' (lines)."""
    c = ctx.shared.get("controls")
    if not c:
        return []
    lines = [
        "Controls (last block, CLS token; mean over seeds): the same read-outs of a random-initialised network of the "
        f"same architecture (k-NN {c['init_knn']:.4f}, purity {c['init_purity']:.4f}) and of the raw pixels (k-NN "
        f"{c['pixels_knn']:.4f}, purity {c['pixels_purity']:.4f}); Gaussian features (Walmer's chance) "
        f"{c['chance_knn']:.4f} and {c['chance_purity']:.4f}.",
        "",
    ]
    return lines


@CLAIMS.claim(
    "contrastive_beats_reconstruction",
    figure="Walmer Fig. 7, 9; Table 1",
    claim="Contrastive (DINO) CLS features at the last block are more semantic than reconstruction (MAE) ones: higher "
    "k-NN top-1 and cluster purity",
    source=f"{SOURCE} §5.2",
    passage="The contrastive methods, DINO and MoCo, achieve scores close to the explicitly supervised methods. The "
    "reconstruction-based methods, MAE and BEiT, have the lowest cluster purity",
    rule="CLS token at the last block. Two parts, dino minus mae (Welch over seeds): k-NN top-1 (k = 20, "
    "analysis/measures/knn.py) and k-means cluster purity (analysis/measures/clustering.py). "
    f"{PLATEAU_TEXT} A random-initialised network and the raw pixels are shown beside (controls).",
    paper_value=f"ImageNet k-NN top-1 (CLS, layer 12, Table 1): DINO {N.TABLE1_KNN_TOP1['dino']:.2f}, MAE "
    f"{N.TABLE1_KNN_TOP1['mae']:.2f}",
    needs=("dino", "mae"),
)
def contrastive_beats_reconstruction(ctx) -> Result:
    return _more_semantic(ctx, "dino", "mae")


def _more_semantic(ctx, better: str, worse: str) -> Result:
    knn, pur = _semantic(ctx, (better, worse))
    conds = plateau(ctx, (better, worse))
    r = rule_more_semantic(knn, {o: [p and p["value"] for p in v] for o, v in pur.items()}, better, worse, conds)
    r.lines += _controls(ctx, (better, worse))
    return r


def rule_more_semantic(knn: dict, purity: dict, better: str, worse: str, conds=()) -> Result:
    """``knn``: objective -> per seed {"top1", "n"} (last block, CLS); ``purity``: objective -> per seed cluster purity
    (last block, CLS). ``better`` minus ``worse`` in both (Welch)."""
    need = (better, worse)
    miss = _missing({o: knn.get(o) for o in need}, "k-NN result on a CLS token") or _missing(
        {o: purity.get(o) for o in need}, "clustering result on a CLS token"
    )
    if miss:
        return _not_testable([*conds, miss])
    top1 = {o: [k["top1"] for k in knn[o]] for o in need}
    d = judge(
        [
            compare_part(f"last-block k-NN top-1, {better} - {worse}", top1[better], top1[worse]),
            compare_part(f"last-block cluster purity, {better} - {worse}", purity[better], purity[worse]),
        ],
        [*conds, seeds(top1)],
    )
    se = {o: N.binomial_se(float(np.mean(top1[o])), knn[o][0]["n"]) for o in need}
    ours = (
        f"k-NN top-1 {better} {100 * np.mean(top1[better]):.2f} (binomial SE {100 * se[better]:.2f}), {worse} "
        f"{100 * np.mean(top1[worse]):.2f} ({100 * se[worse]:.2f}); cluster purity {better} "
        f"{np.mean(purity[better]):.3f}, {worse} {np.mean(purity[worse]):.3f}"
    )
    return Result(d, ours=ours, measured={"top1": top1, "purity": purity})


@CLAIMS.claim(
    "supervised_most_semantic",
    figure="Walmer Fig. 7, 9; Table 1",
    claim="The supervised model's CLS features at the last block are the most semantic: higher k-NN top-1 and cluster "
    "purity than the contrastive (DINO) model's",
    source=f"{SOURCE} §5.2, §6.1",
    passage="Unsurprisingly, FS achieves the best cluster purity, followed by CLIP. […] As can be seen from Figure 9 "
    "(left), FS performs the best as it has been trained to classify the same dataset.",
    rule="CLS token at the last block. Two parts, supervised minus dino (Welch over seeds): k-NN top-1 and cluster "
    "purity. As in Walmer, the supervised model was trained on the labels of the same dataset the k-NN and the "
    f"clustering score. {PLATEAU_TEXT} The k-NN share of supervised (an undertrained DINO makes supervised look "
    "best for free) is shown in the regime section, not used as a gate: it is the outcome this claim compares.",
    paper_value=f"ImageNet k-NN top-1 (CLS, layer 12, Table 1): FS {N.TABLE1_KNN_TOP1['supervised']:.2f}, DINO "
    f"{N.TABLE1_KNN_TOP1['dino']:.2f}",
    needs=("supervised", "dino"),
)
def supervised_most_semantic(ctx) -> Result:
    return _more_semantic(ctx, "supervised", "dino")


@CLAIMS.claim(
    "reconstruction_cls_above_chance",
    figure="Walmer Fig. 7, 9; Table 1",
    claim="Reconstruction (MAE) CLS features are semantic although the CLS token has no objective: k-NN top-1 and "
    "cluster purity at the last block above the strongest baseline shown (random features, a random-initialised "
    "network, the raw pixels)",
    source=f"{SOURCE} §5.2, §6.1",
    passage="The reconstruction-based methods, MAE and BEiT, have the lowest cluster purity, but they are still above "
    "random chance, which again indicates that they do learn to encode some image-level semantic information in "
    "their CLS tokens. […] It is also interesting to see how MAE and BEiT, for which the CLS tokens have no "
    "explicit objective, do better than chance, although MAE is considerably better than BEiT.",
    rule="CLS token at the last block of mae; one-sample t over seeds of per-seed differences. Two parts, k-NN top-1 "
    "and cluster purity, each minus the strongest of the baselines the report shows for that read-out (the highest "
    "mean over seeds, named in the part): random Gaussian features of the same shape (Walmer's chance, App. B.3), a "
    "random-initialised network of the same architecture and seed (what the architecture gives without learning), "
    "and the raw pixels of the seed's analysis images (what the input gives without any network). 'Learn to encode "
    f"some image-level semantic information' is read as beating all three (margin {STRONGEST_BASELINE:g}): features "
    f"that the raw pixels beat show no semantics the input lacks. {PLATEAU_TEXT}",
    paper_value=f"ImageNet k-NN top-1 (Table 1): MAE {N.TABLE1_KNN_TOP1['mae']:.2f}, random "
    f"{N.TABLE1_KNN_TOP1['random']:.2f}",
    needs=("mae",),
)
def reconstruction_cls_above_chance(ctx) -> Result:
    runs = ctx.configs["mae"]
    knn, pur = _each(ctx, runs, R.knn), _each(ctx, runs, R.purity)
    init = ctx.shared.get("random_init", {}).get("mae")
    pixels = ctx.shared.get("raw_pixels", {}).get("mae")
    return rule_above_chance(knn, pur, init, pixels, plateau(ctx, ("mae",)))


def _each(ctx, runs, fn) -> list:
    return [fn(ctx, r) for r in runs]


def baselines(knn: list, purity: list, init: list | None, pixels: list | None) -> dict:
    """Per read-out ("k-NN top-1", "cluster purity") {baseline name: per-seed values} of every baseline measured for
    every seed: Gaussian features (the measures' own), the random-initialised network's last block, the raw pixels."""
    out = {
        "k-NN top-1": {"Gaussian features": [k["baseline"] for k in knn]},
        "cluster purity": {"Gaussian features": [p["baseline"] for p in purity]},
    }
    if init is not None and len(init) == len(knn) and all(i is not None and i["knn"] is not None for i in init):
        out["k-NN top-1"]["random-init network"] = [float(i["knn"][-1]) for i in init]
        out["cluster purity"]["random-init network"] = [float(i["purity"][-1]) for i in init]
    if pixels is not None and len(pixels) == len(knn) and all(x is not None for x in pixels):
        out["k-NN top-1"]["raw pixels"] = [float(x["knn"]) for x in pixels]
        out["cluster purity"]["raw pixels"] = [float(x["purity"]) for x in pixels]
    return out


def strongest(shown: dict) -> tuple[str, list[float]]:
    """(name, per-seed values) of the baseline with the highest mean over seeds among ``shown`` {name: values}."""
    name = max(shown, key=lambda n: float(np.mean(shown[n])))
    return name, shown[name]


def rule_above_chance(knn: list, purity: list, init: list | None, pixels: list | None = None, conds=()) -> Result:
    """mae per seed: ``knn`` {"top1", "baseline"}, ``purity`` {"value", "baseline"} (Gaussian features' in
    "baseline"), ``init`` {"knn": [L], "purity": [L]} of a random-initialised network of the same seed, ``pixels``
    {"knn", "purity"} of the raw pixels of the seed's images (None: not computed). Each read-out is tested against the
    strongest baseline (:func:`strongest`); without every baseline measured, the strongest is unknown: not testable.
    ``measured`` carries every baseline, the one chosen, and the verdict of the rule first reported (Gaussian features
    and the random-initialised network only) beside this one's."""
    miss = _missing({"mae": knn}, "k-NN result on a CLS token") or _missing(
        {"mae": purity}, "clustering result on a CLS token"
    )
    if miss:
        return _not_testable([*conds, miss])
    shown = baselines(knn, purity, init, pixels)
    ours = {"k-NN top-1": [k["top1"] for k in knn], "cluster purity": [p["value"] for p in purity]}
    conds = [*conds, seeds({"mae": knn})]
    absent = [n for n in ("random-init network", "raw pixels") if n not in shown["k-NN top-1"]]
    if absent:
        conds.append(
            Precondition(
                "controls",
                False,
                f"no {' and no '.join(absent)} measured for every seed, so the strongest baseline cannot be chosen",
            )
        )
    chosen, parts = {}, []
    for what, vals in ours.items():
        name, base = strongest(shown[what])
        chosen[what] = {"baseline": name, "value": float(np.mean(base))}
        parts.append(
            one_part(
                f"last-block {what}, mae - {name} (the strongest baseline, {np.mean(base):.4f})",
                np.subtract(vals, base),
                float(STRONGEST_BASELINE),
            )
        )
    d = judge(parts, conds)
    first = judge(
        [
            one_part(f"{w}, mae - {n}", np.subtract(ours[w], shown[w][n]))
            for n in ("Gaussian features", "random-init network")
            for w in ours
            if n in shown[w]
        ],
        conds,
    )
    text = (
        f"k-NN top-1 MAE {100 * np.mean(ours['k-NN top-1']):.2f}, strongest baseline "
        f"{chosen['k-NN top-1']['baseline']} {100 * chosen['k-NN top-1']['value']:.2f}; cluster purity MAE "
        f"{np.mean(ours['cluster purity']):.3f}, strongest baseline {chosen['cluster purity']['baseline']} "
        f"{chosen['cluster purity']['value']:.3f}"
    )
    table = [
        "| read-out | mae | " + " | ".join(shown["k-NN top-1"]) + " |",
        "| --- |" + " --- |" * (1 + len(shown["k-NN top-1"])),
    ]
    for what, vals in ours.items():
        cells = [
            f"{np.mean(v):.4f}" + (" (strongest)" if n == chosen[what]["baseline"] else "")
            for n, v in shown[what].items()
        ]
        table.append(f"| {what} | {np.mean(vals):.4f} | " + " | ".join(cells) + " |")
    lines = [
        "Every baseline shown (last block, CLS token; mean over seeds):",
        "",
        *table,
        "",
        f"Under the rule first reported (Gaussian features and a random-initialised network, not the raw pixels): "
        f"{MARK[first.outcome]}.",
        "",
    ]
    return Result(
        d,
        ours=text,
        lines=lines,
        measured={
            "baselines": shown,
            "strongest": chosen,
            "verdict_first_rule": first.outcome,
        },
    )


@CLAIMS.claim(
    "contrastive_semantic_earlier",
    figure="Walmer Fig. 9 left, 7 left, 24",
    claim="Semantic information emerges earlier in the contrastive (DINO) model than in the supervised one: higher "
    "k-NN top-1 and cluster purity of the CLS token in the first half of the blocks",
    source=f"{SOURCE} §6.1",
    passage="DINO and MoCo follow a similar trend as Section 5.2 and better encode semantic information in the "
    "earlier layers.",
    rule="CLS token, mean over the first half of the blocks. Two parts, dino minus supervised (Welch over seeds): "
    f'k-NN top-1 and cluster purity. {PLATEAU_TEXT} Walmer adds (App. D.5) that the supervised models "catch up '
    'rapidly and overtake at the end": that is the last-block claim above.',
    paper_value="not stated as a number (Fig. 9 left: DINO's k-NN curve above FS's in the early layers)",
    needs=("supervised", "dino"),
)
def contrastive_semantic_earlier(ctx) -> Result:
    knn, pur = _semantic(ctx, ("dino", "supervised"))
    r = rule_semantic_earlier(
        {o: [k and k["curve"] for k in v] for o, v in knn.items()},
        {o: [p and p["curve"] for p in v] for o, v in pur.items()},
        plateau(ctx, ("dino", "supervised")),
    )
    init = ctx.shared.get("random_init", {})
    if init.get("supervised"):
        first = [N.halves(i["knn"])["first"] for i in init["supervised"] if i and i["knn"] is not None]
        if first:
            r.lines += [
                f"Control: a random-initialised network's first-half k-NN top-1 is {np.mean(first):.4f} (mean over "
                "seeds).",
                "",
            ]
    return r


def rule_semantic_earlier(knn: dict, purity: dict, conds=()) -> Result:
    """``knn``, ``purity``: objective -> per seed curve by block [L] (CLS token). First-half means, dino minus
    supervised (Welch)."""
    need = ("dino", "supervised")
    miss = _missing({o: knn.get(o) for o in need}, "k-NN result on a CLS token") or _missing(
        {o: purity.get(o) for o in need}, "clustering result on a CLS token"
    )
    if miss:
        return _not_testable([*conds, miss])
    fk = {o: [N.halves(c)["first"] for c in knn[o]] for o in need}
    fp = {o: [N.halves(c)["first"] for c in purity[o]] for o in need}
    d = judge(
        [
            compare_part("first-half k-NN top-1, dino - supervised", fk["dino"], fk["supervised"]),
            compare_part("first-half cluster purity, dino - supervised", fp["dino"], fp["supervised"]),
        ],
        [*conds, seeds(fk)],
    )
    return Result(d, measured={"first_half_knn": fk, "first_half_purity": fp})


@CLAIMS.claim(
    "purity_rises_with_depth",
    figure="Walmer Fig. 7 left",
    claim="Cluster purity of the CLS token improves with depth, whatever the objective",
    source=f"{SOURCE} §5.2",
    passage="For CLS token features, shown in Figure 7 (left), cluster purity improves with depth with the exception "
    "of the last layers of BEiT.",
    rule="Per objective, the least-squares slope of the CLS token's k-means cluster purity over the block index, per "
    "seed; one part per objective (one-sample t of the slopes, above 0). BEiT, the exception, is not in the study. "
    f"{PLATEAU_TEXT} The slope of a random-initialised network's purity is shown beside (control).",
    paper_value="not stated as a number (Fig. 7 left: curves only)",
)
def purity_rises_with_depth(ctx) -> Result:
    objs = [o for o in N.OBJECTIVES if o in ctx.configs]
    pur = {o: [p and p["curve"] for p in v] for o, v in _per(ctx, objs, R.purity).items()}
    r = rule_purity_rises(pur, plateau(ctx, objs))
    init = [i["purity"] for v in ctx.shared.get("random_init", {}).values() for i in v if i and i["purity"]]
    if init:
        slope = np.mean([np.polyfit(np.arange(len(c)), c, 1)[0] for c in init])
        r.lines += [f"Control: a random-initialised network's purity slope is {slope:+.4f} per block.", ""]
    return r


def rule_purity_rises(purity: dict, conds=()) -> Result:
    """``purity``: objective -> per seed CLS cluster purity by block [L]."""
    miss = _missing(purity, "clustering result on a CLS token")
    if not purity or miss:
        return _not_testable([*conds, miss or Precondition("objectives", False, "no objective measured")])
    parts = [
        slope_part(f"{o}: purity slope per block", list(range(len(cs[0]))), cs, sign=+1) for o, cs in purity.items()
    ]
    return Result(judge(parts, [*conds, seeds(purity)]))


# ------------------------------------------------------------------------------------------------ Fig. 6


CLS_CALIBRATION_TEXT = (
    "Calibration reading (the similarity measure's cross-model maps, the study's options: the CLS token of the "
    "blocks): the last-block cell, (supervised vs dino) minus (supervised vs mae), resting on the (supervised vs dino) "
    f"cell. {CAL.RULE}"
)


def _last_cell(r: dict) -> np.ndarray:
    mask = np.zeros(np.shape(r["score"]), dtype=bool)
    mask[-1, -1] = True
    return mask


def cls_readings(near: list, far: list) -> list:
    """Walmer Fig. 6 left on the similarity measure's cross-model maps (per seed pair): the last-block cell,
    (supervised vs dino) minus (supervised vs mae) (analysis/studies/calibration.py)."""
    name = "last-block CLS similarity, (supervised vs dino) - (supervised vs mae)"
    part = "last-block CLS CKA, (supervised vs dino) - (supervised vs mae)"
    return [CAL.Reading(name, near, far, CAL.mean_over(_last_cell), _last_cell, part)]


@CLAIMS.claim(
    "cls_similar_by_supervision",
    figure="Walmer Fig. 6 left, 19",
    claim="At the last block the supervised model's CLS representation is closer to the contrastive (DINO) model's "
    "than to the reconstruction (MAE) model's",
    source=f"{SOURCE} §5.1",
    passage="Figure 6 (left) shows that the CLS token representations are usually similar for similar supervision "
    "strategies (explicit, contrastive, reconstruction). […] There is also an increased level of similarity "
    "between the explicitly supervised methods, FS and CLIP, and the contrastive methods.",
    rule="Linear CKA of the last block's CLS token between two models of the same seed, read against the cross-seed "
    "ceiling: the same CKA between two seeds of supervised (every pair, both read on the earlier seed's analysis "
    'images), what a different initialisation and data order alone leave. "Similar for similar supervision '
    'strategies" is read in two parts: per seed pair, CKA(supervised, dino) minus CKA(supervised, mae) above 0 '
    '(one-sample t: "an increased level of similarity between the explicitly supervised methods [...] and the '
    'contrastive methods"); and the ceiling minus CKA(supervised, mae) above the margin '
    f"{CEILING_MARGIN:g} (Welch's t; the ceiling's pairs share runs, so their spread is if anything understated): "
    "the model taught by reconstruction is further from supervised than another seed of supervised is. Without a "
    f"ceiling (one seed, or seeds with different data settings) the claim is not testable. {REGIME_TEXT} "
    f"{CLS_CALIBRATION_TEXT}",
    paper_value="not stated as a number (Fig. 6 left: a heatmap)",
    needs=("supervised", "dino", "mae"),
)
def cls_similar_by_supervision(ctx) -> Result:
    sup = ctx.configs["supervised"]
    conds = regime(ctx, ("dino", "mae"))
    if not all(R.has_cls(r) for o in ("supervised", "dino", "mae") for r in ctx.configs[o]):
        return _not_testable([*conds, Precondition("cls token", False, "some model has no CLS token")])
    pairs = {}
    for o in ("dino", "mae"):
        pairs[o] = [R.cls_cka(a, b, ctx.study) for a, b in zip(sup, ctx.configs[o])]
    try:  # two seeds of supervised, read on the earlier seed's images (the seeds draw different analysis images)
        ceiling, why_not = R.cls_ceiling(sup, ctx.study), None
    except RF0.AnalysisError as e:
        ceiling, why_not = [], str(e)
    ctx.shared.setdefault("cls_cka", {}).update({("supervised", o): v for o, v in pairs.items()})
    r = rule_cls_groups(pairs["dino"], pairs["mae"], ceiling, conds, why_not)
    r.figures.append(
        (
            ctx.study.root / "walmer" / "cka_last.png",
            "cka_last",
            "Last-block CKA between the objectives' models, mean over seeds: the CLS token (Walmer Fig. 6 left) and "
            "all tokens (Walmer's right panel uses the spatial tokens); on the diagonal, the cross-seed ceiling (two "
            "seeds of one objective, mean over seed pairs) the off-diagonal cells are read against",
        )
    )
    # calibration and a second measure (beside the verdict; analysis/studies/calibration.py)
    maps = {o: [CAL.cross_map(ctx, a, b) for a, b in zip(sup, ctx.configs[o])] for o in ("dino", "mae")}
    CAL.attach(r, cls_readings(maps["dino"], maps["mae"]))
    return r


def rule_cls_groups(
    near: list[float], far: list[float], ceiling: list[float] = (), conds=(), why_no_ceiling: str | None = None
) -> Result:
    """Per seed: ``near`` = CKA(supervised, dino), ``far`` = CKA(supervised, mae) of the last block's CLS token;
    ``ceiling``: the same between seeds of supervised (one value per seed pair; empty: not measured, with
    ``why_no_ceiling``). Parts: near - far (one-sample t) and ceiling - far (Welch) against :data:`CEILING_MARGIN`."""
    k = min(len(near), len(far))
    if k == 0:
        return _not_testable([*conds, Precondition("measured", False, "no cross-model CLS CKA")])
    parts = [one_part("last-block CLS CKA, (supervised vs dino) - (supervised vs mae)", np.subtract(near[:k], far[:k]))]
    conds = [*conds, seeds({"seed pairs": near[:k]})]
    if len(ceiling):
        parts.append(
            compare_part(
                "last-block CLS CKA, cross-seed ceiling (supervised vs supervised) - (supervised vs mae)"
                + (f", above {CEILING_MARGIN:g}" if CEILING_MARGIN else ""),
                np.asarray(ceiling, dtype=float) - float(CEILING_MARGIN),
                far[:k],
            )
        )
    else:
        conds.append(
            Precondition(
                "ceiling",
                False,
                "no cross-seed ceiling (two seeds of supervised) to read the cross-objective CKA against"
                + (f": {why_no_ceiling}" if why_no_ceiling else ""),
            )
        )
    d = judge(parts, conds)
    ours = f"CKA supervised vs dino {np.mean(near):.3f}, supervised vs mae {np.mean(far):.3f}" + (
        f"; cross-seed ceiling (supervised) {np.mean(ceiling):.3f}" if len(ceiling) else "; no cross-seed ceiling"
    )
    return Result(d, ours=ours, measured={"near": list(near), "far": list(far), "ceiling": list(ceiling)})


# ------------------------------------------------------------------------------------------------ Fig. 23


@CLAIMS.claim(
    "residual_shift_supervised",
    figure="Walmer Fig. 23",
    claim="In the supervised model the attention sublayer's skip path stops resembling its branch in the later "
    "layers; in the contrastive (DINO) model it keeps resembling it",
    source=f"{SOURCE} App. D.4",
    passage="For CLIP and FS we can see a similar trend, initially the skip connection carries similar information as "
    "the normal path but after a certain point the information it carries becomes very different (dark regions). "
    "[…] For MoCo and DINO, this shift in behavior does not happen and as the depth increases the skip "
    "connections and normal pathways still have similar representations.",
    rule="CKA between the attention sublayer's skip input z and its branch f(z) in the same block "
    "(analysis/measures/residual_cka.py skip_branch, the diagonal of Walmer's Fig. 23). Two parts: supervised's "
    "first-half mean minus its later-half mean (one-sample t over seeds), and the later-half mean of dino minus "
    f"supervised (Welch). {REGIME_TEXT}",
    paper_value="not stated as a number (Fig. 23: heatmaps)",
    needs=("supervised", "dino"),
)
def residual_shift_supervised(ctx) -> Result:
    skip = _per(ctx, ("supervised", "dino"), R.attn_skip)
    r = rule_residual_shift(skip, regime(ctx, ("dino",)))
    r.figures.append(
        (
            ctx.study.root / "walmer" / "residual.png",
            "residual",
            "CKA between what the attention sublayer's skip connection carries (z) and what its branch computes "
            "(f(z)) in the same block, by objective; thin lines: seeds (the diagonal of Walmer Fig. 23)",
        )
    )
    return r


def rule_residual_shift(skip: dict, conds=()) -> Result:
    """``skip``: objective -> per seed residual_cka skip_branch of the attention sublayer [L]."""
    miss = _missing({o: skip.get(o) for o in ("supervised", "dino")}, "residual CKA")
    if miss:
        return _not_testable([*conds, miss])
    if len(skip["supervised"][0]) < 2:
        return _not_testable(
            [*conds, Precondition("blocks", False, "a model with one block has no first and later half")]
        )
    hs, hd = [N.halves(s) for s in skip["supervised"]], [N.halves(s) for s in skip["dino"]]
    d = judge(
        [
            one_part("supervised: first-half - later-half skip/branch CKA", [h["first"] - h["later"] for h in hs]),
            compare_part(
                "later-half skip/branch CKA, dino - supervised", [h["later"] for h in hd], [h["later"] for h in hs]
            ),
        ],
        [*conds, seeds(skip)],
    )
    return Result(d)
