"""Walmer et al. 2023's numbers of one model (or of two models' attention), from the measures' saved results: plain
numpy, nothing typed by hand.

"Later half" is the blocks ``L // 2 .. L - 1`` (Walmer's "mid-to-late layers"), "first half" the others.
"""

from __future__ import annotations

import numpy as np

OBJECTIVES = ("supervised", "dino", "mae")  # the study's configuration names: how each ViT is taught
SELF_SUPERVISED = ("dino", "mae")
# Walmer Table 1: best k-NN top-1 on ImageNet (CLS token, layer 12 for these), ViT-B/16; FS = fully supervised
TABLE1_KNN_TOP1 = {"supervised": 83.79, "dino": 76.06, "mae": 45.19, "random": 0.10}


def paper_share(objective: str) -> float:
    """The objective's k-NN top-1 as a share of the supervised model's in Walmer's Table 1 (DINO 0.91, MAE 0.54)."""
    return TABLE1_KNN_TOP1[objective] / TABLE1_KNN_TOP1["supervised"]


def halves(per_block) -> dict:
    """``per_block`` [L] or [L, H] (heads averaged): ``first`` / ``later`` the mean over blocks ``< L // 2`` / ``>= L //
    2`` (the first block counts as "first" when L = 1), ``first_block`` / ``last_block`` the first and last block's."""
    v = np.asarray(per_block, dtype=float)
    v = v.reshape(len(v), -1).mean(1)
    h = len(v) // 2
    return {
        "first": float(v[: max(h, 1)].mean()),
        "later": float(v[h:].mean()),
        "first_block": float(v[0]),
        "last_block": float(v[-1]),
    }


def head_mean(per_block_head) -> np.ndarray:
    """[L, H] -> [L]: the mean over heads of each block."""
    v = np.asarray(per_block_head, dtype=float)
    return v.reshape(len(v), -1).mean(1)


def dip_blocks(depth: int) -> np.ndarray:
    """The blocks of Walmer's "layers 3-6" of a 12-layer ViT at any depth: blocks l with normalised depth (l + 1) / L
    in [0.25, 0.5] (blocks 1-2 of 6; at least one block, never block 0)."""
    d = (np.arange(depth) + 1) / depth
    idx = np.nonzero((d >= 0.25) & (d <= 0.5))[0]
    idx = idx[idx > 0]
    if not len(idx) and depth > 1:
        idx = np.array([1])
    return idx


def depth_profile(distance) -> dict:
    """Walmer Fig. 4 right from attention distances [L, H]: ``dip`` the first block's mean over heads minus the mean
    of the dip blocks (:func:`dip_blocks`; positive: distances decrease after the first layers), ``later`` the
    per-block means of the later half (for its slope over the block index), ``later_blocks`` their indices."""
    m = head_mean(distance)
    h = len(m) // 2
    return {
        "dip": float(m[0] - m[dip_blocks(len(m))].mean()) if len(m) > 1 else float("nan"),
        "later": m[h:].tolist(),
        "later_blocks": list(range(h, len(m))),
    }


def offset_heads(offset_local) -> dict:
    """Walmer Fig. 3, 14: the number of offset local heads and where they are (``offset_local`` [L, H] bool)."""
    o = np.asarray(offset_local, dtype=bool)
    return {"count": int(o.sum()), "where": [f"block {b} head {h}" for b, h in zip(*np.nonzero(o))]}


def map_distance(maps_a, maps_b) -> np.ndarray:
    """Per block, the total-variation distance (0: the same map, 1: disjoint) between two models' average CLS
    attention maps (cls_attention ``maps`` [L, H, gh, gw]), each averaged over its heads first (heads are not matched
    across models): 0.5 x sum over positions of |a - b|. [L]."""
    a, b = np.asarray(maps_a, dtype=float), np.asarray(maps_b, dtype=float)
    if a.shape[0] != b.shape[0] or a.shape[2:] != b.shape[2:]:
        raise ValueError(f"the two models' CLS maps differ in blocks or grid: {a.shape} vs {b.shape}")
    pa = a.mean(1).reshape(len(a), -1)
    pb = b.mean(1).reshape(len(b), -1)
    pa, pb = pa / pa.sum(1, keepdims=True), pb / pb.sum(1, keepdims=True)
    return 0.5 * np.abs(pa - pb).sum(1)


def late_minus_early(per_block) -> float:
    """The later half's mean of a per-block curve minus the first half's (:func:`halves`)."""
    h = halves(per_block)
    return h["later"] - h["first"]


def binomial_se(p: float, n: int) -> float:
    """Binomial standard error of an accuracy ``p`` on ``n`` images (nan without images)."""
    return float(np.sqrt(p * (1 - p) / n)) if n else float("nan")
