"""Every threshold a verdict of the registers study (Darcet et al. 2024) depends on, in one place: each with what it
means, the date and the commit that first introduced it (``git log -S``), the claims that read it, and when each
claim's verdict was first reported (docs/registers.md, 94610ed: after every threshold here was fixed).

Changed in this commit: "outliers appear" is no longer gated on a ViT-L-sized model (:data:`REGIME_DEPTH` x
:data:`REGIME_WIDTH`, 26414ef), a gate no shipped study (6 x 96 on CPU, 8 x 192 on the GPU) could ever pass. The claim
is judged on the study's model and reported as outside the paper's regime when the model is smaller: the verdict says
what this model does, not whether Darcet et al. are right about large ones.
"""

from __future__ import annotations

from analysis.studies.claims import MIN_SEEDS, Fixed, Preregistration, Threshold

_PLUGIN = Fixed("2026-11-24", "988b115", "2026-11-24T21:30:06+00:00")
_REGIME = Fixed("2026-11-25", "26414ef", "2026-11-25T02:21:43+00:00")

MIN_SHARE = Threshold(
    0.1,
    "min_share",
    'a block "has outliers" in a model when at least this share of the analysis images has an outlier token',
    _PLUGIN,
    kind="rule",
)
MIN_RUNS_WITH_OUTLIERS = Threshold(
    2,
    "min_runs_with_outliers",
    "the register claims are judged when at least this many register-free seeds have outliers",
    _PLUGIN,
    feasible=lambda v, shape: shape.get("seeds", 1) >= v,
)
KNN_MARGIN = Threshold(
    0.01,
    "knn_margin",
    "registers cost nothing when the k-NN top-1 difference is within +- this margin (equivalence, two one-sided tests)",
    _PLUGIN,
    kind="rule",
)
# Darcet et al.'s regime (Sec. 2.1, Fig. 4): the outliers appear in ViT-L, H and g, not in ViT-S or ViT-B.
REGIME_DEPTH = Threshold(
    24, "regime_depth", "a model with fewer blocks is outside Darcet et al.'s regime", _REGIME, kind="regime"
)
REGIME_WIDTH = Threshold(
    1024, "regime_width", "a model narrower than this is outside Darcet et al.'s regime", _REGIME, kind="regime"
)

_FIRST = Fixed("2026-11-25", "94610ed", "2026-11-25T06:12:29+00:00", "docs/registers.md")

PREREGISTERED = Preregistration(
    "registers",
    [MIN_SEEDS, MIN_SHARE, MIN_RUNS_WITH_OUTLIERS, KNN_MARGIN, REGIME_DEPTH, REGIME_WIDTH],
    gates={
        "outliers_appear": ("min_seeds", "min_share", "regime_depth", "regime_width"),
        "registers_remove_outliers": ("min_runs_with_outliers", "min_share", "min_seeds"),
        "outliers_absorb_attention": ("min_runs_with_outliers", "min_share", "min_seeds"),
        "outliers_lose_position": ("min_runs_with_outliers", "min_share", "min_seeds"),
        "registers_cost_nothing": ("knn_margin", "min_seeds"),
    },
    first_reported={
        c: _FIRST
        for c in (
            "outliers_appear",
            "registers_remove_outliers",
            "outliers_absorb_attention",
            "outliers_lose_position",
            "registers_cost_nothing",
        )
    },
)
