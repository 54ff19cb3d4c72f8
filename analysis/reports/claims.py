"""The numbers behind the papers' claims, computed from saved analysis results (docs/reproduction.md).

Each function takes arrays from the measures (analysis/*.py) and returns plain floats, so a claim's verdict is
always a rule on numbers the project computed, never a number typed by hand. The rules are stated in each
docstring and repeated in the study report.
"""
from __future__ import annotations

import numpy as np


def _block_of(label: str) -> int:
    """'3.attn' -> 3 (CKA layer labels of token models); ResNet labels 'layerS.J' have no block index."""
    return int(str(label).split(".")[0])


def uniformity(matrix) -> dict:
    """Raghu Fig. 1 / claim 1: how alike a model's layers are. ``mean_offdiag``: mean CKA over all pairs of
    distinct layers; ``first_last``: CKA of the first and last layer."""
    m = np.asarray(matrix, dtype=float)
    off = m[~np.eye(len(m), dtype=bool)]
    return {"mean_offdiag": float(off.mean()), "first_last": float(m[0, -1])}


def partition(matrix, labels, block: int) -> dict:
    """Raghu Fig. 8 / claim 2: the CKA map of a model without the skip connections of ``block``. Layers of blocks
    < ``block`` are "before", the others "after"; ``across`` is the mean CKA between a layer before and one after,
    ``within`` the mean CKA of distinct layers on the same side."""
    m = np.asarray(matrix, dtype=float)
    side = np.array([_block_of(lab) >= block for lab in labels])
    if side.all() or not side.any():
        raise ValueError(f"block {block} leaves no layer on one side of the partition")
    across = m[np.ix_(~side, side)].mean()
    same = (side[:, None] == side[None, :]) & ~np.eye(len(m), dtype=bool)
    return {"across": float(across), "within": float(m[same].mean())}


def skip_dominance(ratio) -> float:
    """Raghu Fig. 7 / claim 3: the median norm ratio ||z|| / ||f(z)|| over sublayers, blocks and tokens (> 1: the
    skip path carries more of the sum than the branch)."""
    return float(np.median(np.asarray(ratio, dtype=float)))


def cls_phase(ratio, sublayer: int = 0, num_prefix_tokens: int = 1) -> dict:
    """Raghu Fig. 7 right / claim 3: the CLS token's and the spatial tokens' norm ratio in the first and the last
    block of one sublayer (``ratio`` [S, L, T]). The phase transition: the CLS token's ratio starts below the
    spatial tokens' (its branch dominates: it is being written) and rises by the last block."""
    r = np.asarray(ratio, dtype=float)[sublayer]
    p = num_prefix_tokens
    return {"cls_first": float(r[0, 0]), "cls_last": float(r[-1, 0]), "spatial_first": float(r[0, p:].mean()),
            "spatial_last": float(r[-1, p:].mean())}


def head_mix(distance) -> dict:
    """Raghu Fig. 3 / claim 4: attention distances [L, H]. ``spread_lower`` / ``spread_upper``: the mean over
    blocks of (max - min over heads) in the lower / upper half of the blocks; ``mean_lower`` / ``mean_upper``:
    the mean distance in each half. Local and global heads mixed low and global heads high means a larger
    lower spread and a larger upper mean."""
    d = np.asarray(distance, dtype=float)
    h = len(d) // 2
    lo, hi = d[:h], d[h:]
    return {"spread_lower": float((lo.max(1) - lo.min(1)).mean()), "spread_upper": float((hi.max(1) - hi.min(1)).mean()),
            "mean_lower": float(lo.mean()), "mean_upper": float(hi.mean())}


def last_layer(values) -> float:
    """The last finite entry of a per-layer curve (e.g. localization own_share, token-probe mean)."""
    v = np.asarray(values, dtype=float).reshape(-1)
    v = v[np.isfinite(v)]
    return float(v[-1])


def drift(same_index) -> dict:
    """Raghu Fig. 12 / claim 6: CKA of same-index layers to the full-data model [L]; ``lower`` / ``upper``: its mean
    over the lower / upper half of the layers."""
    v = np.asarray(same_index, dtype=float)
    h = len(v) // 2
    return {"lower": float(v[:h].mean()), "upper": float(v[h:].mean())}


def offset_heads(offset_local) -> dict:
    """Walmer Fig. 3, 14 / claim 7: the number of offset local heads and where they are (``offset_local`` [L, H] bool)."""
    o = np.asarray(offset_local, dtype=bool)
    return {"count": int(o.sum()), "where": [f"block {b} head {h}" for b, h in zip(*np.nonzero(o))]}
