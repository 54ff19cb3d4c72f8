"""The locality reads that several papers share: uniform attention's mean distance on a token grid (the yardstick
of every locality statement), when a head counts as local, and the precondition a locality claim needs before it is
judged (some head clearly below uniform). Raghu's pilot runs and positive control are in
analysis/studies/raghu2021/pilots.py."""

from __future__ import annotations

import numpy as np

from analysis.studies.claims import Fixed, Threshold
from analysis.studies.stats import Precondition

LOCAL_FRACTION = Threshold(
    0.5,
    "local_fraction",
    "a head is local when its mean attention distance is below this share of uniform attention's",
    Fixed("2026-11-23", "348f4ae", "2026-11-23T12:21:41+00:00"),
    kind="rule",
)


# A locality claim is judged only when some head attends below this share of uniform attention's distance: a model
# whose every head is near uniform (0.93-1.09 x in the default 4-epoch regime) is not yet the kind of model the paper
# describes, so "local heads are missing" there is "not testable", not "did not hold". It can pass in any ViT: uniform
# attention is 1 x, and a head attending to its 5 x 5 window is at 0.48 x on a 7 x 7 grid.
LOCALITY_PRECONDITION = Threshold(
    0.8,
    "locality",
    "a locality claim is judged only when some head attends below this share of uniform attention's distance",
    Fixed("2026-11-24", "b991488", "2026-11-24T20:39:05+00:00"),
    feasible=lambda v, shape: shape.get("arch", "vit") == "vit",
)


def uniform_distance(grid: int, patch: int) -> float:
    """Mean attention distance (patch centres, pixels) of a head attending uniformly over a grid x grid token grid."""
    rc = np.stack(np.meshgrid(np.arange(grid), np.arange(grid), indexing="ij"), -1).reshape(-1, 2)
    return float(patch * np.linalg.norm(rc[:, None] - rc[None], axis=-1).mean())


def uniform_of(run) -> tuple[int, float]:
    m = run.recipe.model
    grid = run.recipe.data.img_size // m.patch_size
    return grid, uniform_distance(grid, m.patch_size)


def locality_precondition(smallest: float, uniform: float, where: str) -> Precondition:
    """Some head of ``where`` attends below LOCALITY_PRECONDITION x uniform attention's distance (pixels)."""
    thr = LOCALITY_PRECONDITION * uniform
    numbers = {"smallest_px": smallest, "uniform_px": uniform, "threshold_px": thr}
    if smallest < thr:
        return Precondition(
            "locality",
            True,
            f"the most local head of {where} attends at {smallest:.2f} px = {smallest / uniform:.2f} x uniform, below "
            f"{LOCALITY_PRECONDITION:g} x",
            numbers,
        )
    return Precondition(
        "locality",
        False,
        f"no head of {where} has left uniform attention: the most local head attends at {smallest:.2f} px = "
        f"{smallest / uniform:.2f} x uniform attention's {uniform:.2f} px, and a locality claim is judged only when "
        f"some head is below {LOCALITY_PRECONDITION:g} x (with every head near uniform, nothing can be local)",
        numbers,
    )
