"""Every threshold a verdict of Raghu et al. 2021's study depends on, in one place: each with what it means, the date
and the commit that first introduced it (``git log -S``), the claims that read it, and when each claim's verdict was
first reported, so that a threshold fixed after the data were seen is said so in the claim's record and section.

A claim's first report is the first committed docs/reproduction.md that judged it under the statistical rule of
analysis/studies/stats.py (four outcomes from per-seed tests, introduced 2026-11-23 in 348f4ae): the two-seed study of
acd776f (2026-11-23), or the later report that first showed the claim.

Changed in this commit:

- ``min_blocks_per_half`` 4 -> 2: with block 0 left out, 4 kept blocks per half needs 10 blocks, so no shipped study
  (6 blocks on CPU, 8 on the GPU) could ever test Raghu Fig. 7's phase transition; 2 per half is the least that makes
  "the first half's mean gap" a mean over blocks, and passes at 5 blocks and up.
- the pilots' go/no-go (pilots.py) reads the claims' own locality threshold (:data:`LOCALITY_PRECONDITION`, 0.8 x
  uniform, in any block) instead of 0.7 x in blocks 0-1 (``go_fraction`` and ``go_blocks``, 2026-11-23, fddb611), and a
  pilot whose most local head still falls by :data:`CONVERGED` or more between its last two checkpoints trains on.

Added 2026-11-28, before any study had computed a calibrated map: :data:`SURVIVE_SHARE` (``calibrated_share``, 0.5,
kind "beside"), the share of the layer pairs a similarity conclusion rests on that must be significant against the
permutation null for it to "survive calibration" (and, on the second estimator, "survive a second measure";
analysis/studies/calibration.py). It is listed under no claim's gates: it reads beside the verdict and changes none.
"""

from __future__ import annotations

from analysis.studies.calibration import SURVIVE_SHARE
from analysis.studies.claims import CONVERGED, MIN_SEEDS, TODAY, Fixed, Preregistration, Threshold
from analysis.studies.locality import LOCAL_FRACTION, LOCALITY_PRECONDITION


def _halves(depth: int, skip: int = 1) -> tuple[int, int]:
    """Blocks kept in the first and the second half of a ``depth``-block ViT with the first ``skip`` left out (as
    numbers.cls_phase counts them)."""
    first = sum(1 for b in range(depth) if skip <= b < depth / 2)
    return first, sum(1 for b in range(depth) if b >= depth / 2)


MIN_BLOCKS_PER_HALF = Threshold(
    2,
    "min_blocks_per_half",
    "the CLS/spatial phase transition (Raghu Fig. 7) is judged on at least this many kept blocks (block 0 left out) in "
    "each half of the network",
    TODAY,
    feasible=lambda v, shape: min(_halves(int(shape["depth"]))) >= v,
    previous=(4, Fixed("2026-11-24", "b991488", "2026-11-24T20:39:05+00:00")),
)

# A pilot whose most local head (any block) falls by at least this share between its last two checkpoints is still
# learning locality: it trains on. The same limit as the claims' convergence precondition: what the claims would call
# "still moving" is not a regime to stop.
STILL_FALLING = Threshold(
    float(CONVERGED),
    "still_falling",
    "a pilot whose most local head's distance fell by at least this share between its last two checkpoints trains on",
    TODAY,
    kind="go",
    feasible=lambda v, shape: shape.get("steps", 0) >= 2 * shape.get("checkpoint_every", 0) > 0,
)

_REPORT = "docs/reproduction.md"
_TWO_SEEDS = Fixed("2026-11-23", "acd776f", "2026-11-23T18:30:33+00:00", _REPORT)
_LATER = Fixed("2026-11-27", "b0c670b", "2026-11-27T06:45:53+00:00", _REPORT)

PREREGISTERED = Preregistration(
    "raghu2021",
    [CONVERGED, MIN_SEEDS, LOCALITY_PRECONDITION, LOCAL_FRACTION, MIN_BLOCKS_PER_HALF, STILL_FALLING, SURVIVE_SHARE],
    gates={
        "uniformity": ("min_seeds",),
        "noskip_partition": ("min_seeds",),
        "skip_dominance": ("min_seeds", "converged"),
        "cls_phase": ("min_seeds", "min_blocks_per_half", "converged"),
        "head_mix": ("locality", "min_seeds", "converged"),
        "data_locality": ("locality", "min_seeds"),
        "head_subsets": ("locality", "min_seeds"),
        "cls_localization": ("min_seeds",),
        "gap_token_probes": ("min_seeds",),
        "erf": ("min_seeds",),
        "intermediate_probes": ("min_seeds",),
        "data_probes": (),
        "data_drift": ("min_seeds",),
        "offset_heads": ("min_seeds",),
        "skip_test_time": ("min_seeds",),
    },
    first_reported={
        **{
            c: _TWO_SEEDS
            for c in (
                "uniformity",
                "noskip_partition",
                "skip_dominance",
                "cls_phase",
                "head_mix",
                "head_subsets",
                "cls_localization",
                "gap_token_probes",
                "erf",
                "intermediate_probes",
                "data_drift",
                "offset_heads",
            )
        },
        **{c: _LATER for c in ("data_locality", "data_probes", "skip_test_time")},
    },
)
