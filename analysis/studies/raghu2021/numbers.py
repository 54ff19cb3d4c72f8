"""Raghu et al. 2021's numbers of one model, from the measures' saved results: plain numpy, nothing typed by hand."""

from __future__ import annotations

import numpy as np


def _block_of(label: str) -> int:
    """'3.attn' -> 3 (CKA layer labels of token models); ResNet labels 'layerS.J' have no block index."""
    return int(str(label).split(".")[0])


def uniformity(matrix) -> dict:
    """Raghu Fig. 1: ``mean_offdiag`` mean CKA over pairs of distinct layers; ``first_last`` CKA of the first and last
    layer."""
    m = np.asarray(matrix, dtype=float)
    off = m[~np.eye(len(m), dtype=bool)]
    return {"mean_offdiag": float(off.mean()), "first_last": float(m[0, -1])}


def after(labels, block: int) -> np.ndarray:
    """Raghu Fig. 8's sides: True for the layers of blocks >= ``block`` (ValueError when a side is empty)."""
    side = np.array([_block_of(lab) >= block for lab in labels])
    if side.all() or not side.any():
        raise ValueError(f"block {block} leaves no layer on one side of the partition")
    return side


def partition(matrix, labels, block: int) -> dict:
    """Raghu Fig. 8: layers of blocks < ``block`` are "before", the others "after"; ``across`` is the mean CKA between a
    layer before and one after, ``within`` the mean CKA of distinct layers on the same side."""
    m = np.asarray(matrix, dtype=float)
    side = after(labels, block)
    across = m[np.ix_(~side, side)].mean()
    same = (side[:, None] == side[None, :]) & ~np.eye(len(m), dtype=bool)
    return {"across": float(across), "within": float(m[same].mean())}


def skip_dominance(ratio, blocks=None) -> float:
    """Raghu Fig. 7: median norm ratio ||z|| / ||f(z)|| over sublayers, blocks (``blocks``: a mask or indices of the
    blocks to keep) and tokens of ``ratio`` [S, L, T]."""
    r = np.asarray(ratio, dtype=float)
    if blocks is not None:
        r = r[:, np.asarray(blocks)]
    return float(np.median(r))


def block_ratios(ratio) -> np.ndarray:
    """Raghu Fig. 7 right, per block: the median norm ratio over sublayers and tokens of ``ratio`` [S, L, T] -> [L]."""
    r = np.asarray(ratio, dtype=float)
    return np.median(r.transpose(1, 0, 2).reshape(r.shape[1], -1), axis=1)


def matched_blocks(depth: int, keep) -> list[int]:
    """For each of ``depth`` blocks, the block of another network (``keep``: its mask of comparable blocks, e.g. the
    ResNet's identity-shortcut blocks) nearest in normalised depth (b + 0.5) / L: how "throughout" compares a ViT block
    with the ResNet block at the same relative depth."""
    keep = np.asarray(keep, dtype=bool)
    idx = np.flatnonzero(keep)
    at = (idx + 0.5) / len(keep)
    return [int(idx[np.argmin(np.abs(at - (b + 0.5) / depth))]) for b in range(depth)]


def erf_midway(curve) -> float:
    """Raghu Fig. 6's "much more global midway": the share of the ERF's whole increase (first block to last) made by
    the steps into the middle third of the blocks (depth / 3 <= b < 2 depth / 3), minus the share an even growth would
    give them (their number over all steps). Positive: the growth is concentrated midway; a jump at block 0 -> 1 makes
    it negative."""
    v = np.asarray(curve, dtype=float).reshape(-1)
    total, n = float(v[-1] - v[0]), len(v)
    if n < 3 or total <= 0:
        return float("nan")
    steps = np.diff(v)  # steps[i]: from block i to block i + 1
    mid = [i for i in range(n - 1) if n / 3 <= i + 1 < 2 * n / 3]
    return float(steps[mid].sum() / total - len(mid) / (n - 1))


def head_mix(distance) -> dict:
    """Raghu Fig. 3: attention distances [L, H]. ``spread_lower`` / ``spread_upper``: the mean over blocks of (max - min
    over heads) in the lower / upper half of the blocks; ``mean_lower`` / ``mean_upper``: the mean distance in each
    half;
    ``min``: the smallest head distance anywhere."""
    d = np.asarray(distance, dtype=float)
    h = len(d) // 2
    lo, hi = d[:h], d[h:]
    return {
        "spread_lower": float((lo.max(1) - lo.min(1)).mean()),
        "spread_upper": float((hi.max(1) - hi.min(1)).mean()),
        "mean_lower": float(lo.mean()),
        "mean_upper": float(hi.mean()),
        "min": float(d.min()),
    }


def head_subsets(result) -> dict:
    """Raghu Fig. 5 from one :func:`analysis.head_subsets.head_subset_cka` result: ``local_minus_global`` the mean over
    ResNet layers of the most local window's CKA minus the most global window's; ``rank_corr`` the Spearman rank
    correlation of the windows' mean distance and their mean CKA over ResNet layers (-1: a monotonic decrease);
    ``min_head`` the smallest head distance of the block, in the result's unit."""
    sub = np.asarray(result["subset_cka"], dtype=float).mean(1)  # [S] mean over ResNet layers
    dist = np.asarray(result["subset_distance"], dtype=float)
    rank = np.nan
    if len(sub) > 1 and np.ptp(dist) > 0 and np.ptp(sub) > 0:
        rank = float(np.corrcoef(np.argsort(np.argsort(dist)), np.argsort(np.argsort(sub)))[0, 1])
    return {
        "local_minus_global": float(sub[0] - sub[-1]),
        "rank_corr": rank,
        "min_head": float(np.min(np.asarray(result["head_distance"], dtype=float))),
    }


def last_layer(values) -> float:
    """The last finite entry of a per-layer curve (e.g. localization own_share, token-probe mean)."""
    v = np.asarray(values, dtype=float).reshape(-1)
    v = v[np.isfinite(v)]
    return float(v[-1])


def drift(same_index) -> dict:
    """Raghu Fig. 12: same-index CKA to the full-data model [L]; ``lower`` / ``upper``: its mean over each half."""
    v = np.asarray(same_index, dtype=float)
    h = len(v) // 2
    return {"lower": float(v[:h].mean()), "upper": float(v[h:].mean())}


def offset_heads(offset_local) -> dict:
    """Walmer Fig. 3, 14: the number of offset local heads and where they are (``offset_local`` [L, H] bool)."""
    o = np.asarray(offset_local, dtype=bool)
    return {"count": int(o.sum()), "where": [f"block {b} head {h}" for b, h in zip(*np.nonzero(o))]}


def middle_mean(curve) -> float:
    """Mean of a per-block curve over the middle half of the network: blocks l with (l + 1) / L in (0.25, 0.75]."""
    v = np.asarray(curve, dtype=float).reshape(-1)
    depth = (np.arange(len(v)) + 1) / len(v)
    return float(np.nanmean(v[(depth > 0.25) & (depth <= 0.75)]))


def select_checkpoint(metas: dict) -> tuple[int, str]:
    """The checkpoint of a run to read, from each checkpoint's meta ({step: meta}): the best held-out validation top-1
    (``meta["val"]["top1"]``) when every checkpoint records one; otherwise the last, and a sentence saying why (the
    ``eval`` entry is the test split: choosing on it would select on test)."""
    steps = sorted(metas)
    vals = [metas[s].get("val", {}).get("top1") for s in steps]
    if steps and all(v is not None for v in vals):
        best = steps[int(np.argmax(vals))]
        return best, f"step {best}, best held-out validation top-1 {max(vals):.4f}"
    ev = ", ".join(f"{s}: {metas[s].get('eval', {}).get('top1', float('nan')):.4f}" for s in steps)
    return steps[-1], (
        f"last step {steps[-1]}: the checkpoints record no held-out validation top-1, and their eval top-1 "
        f"is on the test split ({ev}), so no checkpoint is chosen"
    )


def cls_phase(ratio, sublayer: int = 0, num_prefix_tokens: int = 1, skip: int = 1) -> dict:
    """Raghu Fig. 7 left on log norm ratios: in sublayer ``sublayer`` of ``ratio`` [S, L, T], per block the gap
    log(CLS ratio) - mean over spatial tokens of log(their ratio) (a log-ratio: a factor, not a difference, so blocks
    whose ratios differ by orders of magnitude weigh alike). The first ``skip`` blocks are left out: block 0's CLS
    input (cls_token + pos_embed[0]) is the same vector for every image, so its ratio says nothing about how an
    image's CLS representation propagates. ``gap_first`` / ``gap_second``: the mean gap over the kept blocks of the
    first / second half of the network (blocks < L / 2 and >= L / 2); ``blocks_first`` / ``blocks_second`` their
    counts; also the first kept and the last block's CLS and spatial ratios."""
    r = np.log(np.asarray(ratio, dtype=float)[sublayer])
    p, depth = num_prefix_tokens, len(r)
    gap = r[:, 0] - r[:, p:].mean(1)
    blocks = np.arange(depth)
    first = (blocks >= skip) & (blocks < depth / 2)
    second = blocks >= depth / 2
    return {
        "gap_first": float(gap[first].mean()) if first.any() else float("nan"),
        "gap_second": float(gap[second].mean()) if second.any() else float("nan"),
        "blocks_first": int(first.sum()),
        "blocks_second": int(second.sum()),
        "cls_first": float(np.exp(r[skip, 0])) if skip < depth else float("nan"),
        "cls_last": float(np.exp(r[-1, 0])),
        "spatial_first": float(np.exp(r[skip, p:]).mean()) if skip < depth else float("nan"),
        "spatial_last": float(np.exp(r[-1, p:]).mean()),
    }


def erf_concentration(curve) -> float:
    """Raghu Fig. 6's shape: the largest increase of a per-block ERF mean distance between two consecutive blocks, as
    a share of its whole increase from the first to the last block. Growing gradually (the ResNet) spreads the
    increase over many steps (a small share); becoming global midway (the ViT) puts most of it in one step."""
    v = np.asarray(curve, dtype=float).reshape(-1)
    total = float(v[-1] - v[0])
    if len(v) < 3 or total <= 0:
        return float("nan")
    return float(np.diff(v).max() / total)
