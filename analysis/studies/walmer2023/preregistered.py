"""Every threshold a verdict of Walmer et al. 2023's study depends on, in one place: each with what it means, the date
and the commit that first introduced it (``git log -S``), the claims that read it, and when each claim's verdict was
first reported (the first committed docs/teaching-matters.md that showed it), so that a threshold fixed after the data
were seen is said so in the claim's record and section.

The regime gate (:data:`REGIME`: a self-supervised model at 0.8 x its paper's k-NN share of supervised) was added on
2026-11-24, the day after the two-seed report (00eb65c) had judged the claims without it; it is said so under every
claim it gates.

Changed in this commit: the semantic claims (k-NN top-1 and cluster purity of the CLS token: contrastive beats
reconstruction, supervised most semantic, MAE above chance, semantics earlier in DINO, purity rising with depth) are no
longer gated on the k-NN share, which is the outcome they test (an undertrained DINO was "not testable" exactly when
it lost). They are gated instead on the k-NN curve's plateau over the runs' last :data:`PLATEAU_CHECKPOINTS`
checkpoints (each step's change below :data:`CONVERGED`): whether training has settled, not where it settled.

Changed on 2026-11-28 (7a197ea), after both claims' verdicts were first reported, so each says so:

- MAE's CLS token "above chance" (:data:`STRONGEST_BASELINE`) is tested against the strongest baseline the report
  shows for each read-out -- Gaussian features, a random-initialised network or the raw pixels, whichever scores
  highest -- not against Gaussian features and the random-initialised network only: the raw pixels' k-NN (0.790)
  beat MAE's (0.725) in the three-seed report that called the claim held.
- the supervised model's CLS closer to DINO's than to MAE's (:data:`CEILING_MARGIN`) is read against the cross-seed
  ceiling (two seeds of supervised), which it only showed beside before.

Added 2026-11-28, before any study had computed a calibrated map: :data:`SURVIVE_SHARE` (``calibrated_share``, 0.5,
kind "beside"), the share of the layer pairs a similarity conclusion rests on that must be significant against the
permutation null for it to "survive calibration" (and, on the second estimator, "survive a second measure";
analysis/studies/calibration.py). It is listed under no claim's gates: it reads beside the verdict and changes none.
"""

from __future__ import annotations

from analysis.studies.calibration import SURVIVE_SHARE
from analysis.studies.claims import CONVERGED, MIN_SEEDS, TODAY, Fixed, Preregistration, Threshold, checkpoints_of
from analysis.studies.locality import LOCALITY_PRECONDITION
from analysis.studies.walmer2023.numbers import SELF_SUPERVISED, paper_share

_WALMER = Fixed("2026-11-24", "85d02f3", "2026-11-24T20:52:30+00:00")

REGIME = Threshold(
    0.8,
    "regime",
    "a compared self-supervised model reached this share of its paper's k-NN share of supervised (Walmer Table 1) "
    "before its attention or representations are compared",
    _WALMER,
    feasible=lambda v, shape: all(v * paper_share(o) < 1 for o in SELF_SUPERVISED),
)
PLATEAU_CHECKPOINTS = Threshold(
    3,
    "plateau_checkpoints",
    "a semantic claim is judged when the k-NN top-1 (mean over seeds) changed by less than the convergence limit "
    "between each pair of consecutive checkpoints among the runs' last this many",
    TODAY,
    feasible=lambda v, shape: checkpoints_of(shape) >= v and "knn" in shape.get("every_checkpoint", ()),
)
MIN_PROFILE_BLOCKS = Threshold(
    4,
    "min_profile_blocks",
    "the attention-distance depth profile (Walmer Fig. 4 right) needs at least this many blocks",
    _WALMER,
    feasible=lambda v, shape: shape["depth"] >= v,
)

# fixed on 2026-11-28 after the first report of claims 9 and 12 (docs/teaching-matters.md, 2026-11-27)
_CONTROLS = Fixed("2026-11-28", "7a197ea", "2026-11-28T02:22:48+00:00")  # landed on main at fe5a686
STRONGEST_BASELINE = Threshold(
    0.0,
    "strongest_baseline",
    "MAE's last-block CLS k-NN top-1 and cluster purity must exceed, by more than this margin, the strongest baseline "
    "the report shows for that read-out (Gaussian features, a random-initialised network, the raw pixels)",
    _CONTROLS,
    kind="rule",
)
CEILING_MARGIN = Threshold(
    0.0,
    "ceiling_margin",
    "the last-block CLS CKA between supervised and MAE must fall below the cross-seed ceiling (two seeds of "
    "supervised) by more than this margin",
    _CONTROLS,
    kind="rule",
)

_REPORT = "docs/teaching-matters.md"
_TWO_SEEDS = Fixed("2026-11-23", "00eb65c", "2026-11-23T20:37:15+00:00", _REPORT)
_THREE_SEEDS = Fixed("2026-11-25", "7a6b73d", "2026-11-25T03:36:45+00:00", _REPORT)

_SEMANTIC = ("min_seeds", "plateau_checkpoints", "converged")

PREREGISTERED = Preregistration(
    "walmer2023",
    [
        CONVERGED,
        MIN_SEEDS,
        LOCALITY_PRECONDITION,
        REGIME,
        PLATEAU_CHECKPOINTS,
        MIN_PROFILE_BLOCKS,
        STRONGEST_BASELINE,
        CEILING_MARGIN,
        SURVIVE_SHARE,
    ],
    gates={
        "offset_heads_every_objective": ("locality", "regime", "min_seeds"),
        "reconstruction_stays_local": ("locality", "regime", "converged", "min_seeds"),
        "attention_depth_profile": ("locality", "regime", "converged", "min_profile_blocks", "min_seeds"),
        "reconstruction_cls_covers_more": ("regime", "min_seeds"),
        "supervised_cls_sparse": ("regime", "min_seeds"),
        "attention_diverges_late": ("regime", "min_seeds"),
        "contrastive_beats_reconstruction": _SEMANTIC,
        "supervised_most_semantic": _SEMANTIC,
        "reconstruction_cls_above_chance": (*_SEMANTIC, "strongest_baseline"),
        "contrastive_semantic_earlier": _SEMANTIC,
        "purity_rises_with_depth": _SEMANTIC,
        "cls_similar_by_supervision": ("regime", "min_seeds", "ceiling_margin"),
        "residual_shift_supervised": ("regime", "min_seeds"),
    },
    first_reported={
        **{
            c: _TWO_SEEDS
            for c in (
                "offset_heads_every_objective",
                "reconstruction_stays_local",
                "reconstruction_cls_covers_more",
                "supervised_cls_sparse",
                "contrastive_beats_reconstruction",
                "supervised_most_semantic",
                "reconstruction_cls_above_chance",
                "contrastive_semantic_earlier",
                "cls_similar_by_supervision",
                "residual_shift_supervised",
            )
        },
        **{c: _THREE_SEEDS for c in ("attention_depth_profile", "attention_diverges_late", "purity_rises_with_depth")},
    },
)
