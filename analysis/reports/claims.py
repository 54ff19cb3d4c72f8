"""The papers' claims as rules on numbers the project computed (docs/reproduction.md, docs/reproduction.json).

Each claim (:data:`CLAIMS`) states the paper's claim in the paper's direction, quotes the passage it tests (section or
figure), says the rule, and gives the paper's number where its text states one. A rule function (``rule_*``) takes the
measured values of every seed of every configuration it compares (seed i of one configuration is paired with seed i of
the other: same seed, same analysis images) and returns a :class:`Verdict` with one of four outcomes:

``held``          the effect in the paper's direction exceeds the noise floor by the stated factor;
``did not hold``  the effect in the opposite direction does;
``inconclusive``  the effect is within the noise floor;
``not testable``  a precondition failed (fewer than two seeds of a compared configuration, no local head at all, a
                  ResNet without identity shortcuts, a model without a CLS token), said with the precondition's numbers.

The noise floor of a quantity is the largest seed-to-seed difference of it within one compared configuration
(max - min over seeds, the largest over the configurations). An effect (the mean over paired seeds of the difference
the claim is about) counts when it exceeds :data:`NOISE_FACTOR` times that floor. A top-1 difference must also exceed
:data:`SE_FACTOR` binomial standard errors of the difference of the mean accuracies. A claim of several parts holds
when every part holds, did not hold when any part did not, is not testable when any part is not, and is inconclusive
otherwise.

The locality claims (head mix, head subsets, offset heads) need a model that can learn local heads at all: Raghu
Fig. 4 shows that with "not enough data" ViT "does not learn to attend locally" in earlier layers. The study report
reads them from its locality-capable configuration when that is trained (analysis/reports/study_report.py), and the
pilot check :func:`go_no_go` says early in training whether a run is heading there (:data:`GO_FRACTION`).

Everything here is plain numpy on arrays from the measures (analysis/measures/*.py); nothing is typed by hand.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from analysis.reports.stats import (
    HELD,
    INCONCLUSIVE,
    NOT_HELD,
    NOT_TESTABLE,
    OUTCOMES,
)  # the outcomes live in one place

NOISE_FACTOR = 2.0  # an effect counts when it exceeds 2x the largest seed-to-seed difference of the same configuration
SE_FACTOR = 2.0  # ... and, for top-1 differences, 2 binomial standard errors of the difference
LOCAL_FRACTION = 0.5  # a head is local when its mean attention distance is below half of uniform attention's
MIN_SEEDS = 2
# The pilot check (go_no_go): a run is "go" when, at its SECOND checkpoint, some head of its first GO_BLOCKS blocks
# attends at less than GO_FRACTION x uniform attention's distance. Why 0.7: a head is local (LOCAL_FRACTION) below
# 0.5 x uniform -- on the 7x7 grid that is a head spreading its attention evenly over the 5x5 window around its query
# (0.48 x; the positive control's forced 3x3-window head, recipes/positive_control.yaml, sits at 0.28 x) -- while in
# the default 4-epoch regime, which has no local head, every head lies between 0.93 and 1.09 x uniform. Early in
# training (the second checkpoint of vit_local is a third of its steps) a head on its way to local need not be local
# yet, but it must have left that band clearly: 0.7 is the midpoint of 0.5 and 0.93, rounded.
GO_FRACTION = 0.7
GO_BLOCKS = 2
GO, NO_GO, UNDECIDED = "go", "no-go", "undecided"


@dataclass(frozen=True)
class Claim:
    id: str
    figure: str
    claim: str  # the paper's claim, in the paper's direction
    source: str  # paper and section of the passage
    passage: str  # the exact sentences from the paper ("[…]" where the paper's layout puts a figure inside them)
    rule: str
    paper_value: str | None = None  # the paper's number where its text states one


@dataclass
class Verdict:
    outcome: str
    measured: dict = field(default_factory=dict)  # name -> value (per seed lists and means)
    noise_floor: dict = field(default_factory=dict)  # name -> the threshold the effect had to exceed
    why: str = ""  # one sentence with the deciding numbers
    ours: str | None = None  # our number next to the paper's

    def __post_init__(self):
        if self.outcome not in OUTCOMES:
            raise ValueError(f"unknown outcome {self.outcome!r}")


R_SEC6 = (
    "We observe a striking phase transition: in the first half of the network, the CLS token (token 0) "
    "representation is primarily propagated by the skip connection branch (high norm ratio), while the spatial "
    "token representations have a large contribution coming from the long branch (lower norm ratio). Strikingly, "
    "in the second half of the network, this is reversed."
)

CLAIMS: dict[str, Claim] = {
    c.id: c
    for c in [
        Claim(
            "uniformity",
            "Raghu Fig. 1, 2",
            "ViT layer representations are more uniform than a ResNet's: lower and higher layers are more similar",
            "Raghu et al. 2021 §4",
            "We observe clear differences between the internal representation structure between the two model "
            "architectures: (1) ViTs show a much more uniform similarity structure, with a clear grid like structure (2) "
            "lower and higher layers in ViT show much greater similarity than in the ResNet, where similarity is divided "
            "into different (lower/higher) stages.",
            "Precondition: the ResNet has identity shortcuts (the paper's ResNets do). Two parts, ViT minus ResNet per seed: "
            "mean off-diagonal self-CKA, and CKA of the first and the last layer; each must exceed the noise floor. "
            "The same numbers of a randomly initialised model of each architecture are shown beside the maps (the floor "
            "that the architecture alone gives).",
            "not stated as a number (Fig. 1: ViT maps near-uniform, ResNet maps in stages)",
        ),
        Claim(
            "noskip_partition",
            "Raghu Fig. 8",
            "Removing the skip connections of block i partitions the representations "
            "before and after block i, and costs accuracy (4% for middle blocks)",
            "Raghu et al. 2021 §6, Fig. 8 caption",
            "The results, in Figure 8, illustrate that removing the skip connections in a block partitions the layer "
            "representations on either side. (We note a performance drop of 4% when […] removing skip connections from "
            "middle blocks.)",
            "Per no-skip block i: the mean CKA between layers before block i and layers from block i on, normal ViT minus "
            "no-skip ViT, must exceed the noise floor; for blocks in the middle third of the network the top-1 drop must "
            "also exceed the noise floor and 2 binomial standard errors.",
            '4% top-1 drop for middle blocks (Fig. 8 caption: "For middle blocks without skip connections, we observe a '
            'performance drop of 4%.")',
        ),
        Claim(
            "skip_dominance",
            "Raghu Fig. 7 right",
            "Skip connections are much more influential in ViT than in a ResNet: much higher norm ratios ‖z‖ / ‖f(z)‖",
            "Raghu et al. 2021 §6",
            "The right pane, which has line plots of these norm ratios across ResNet50, the ViT CLS token and the ViT "
            "spatial tokens additionally demonstrates that skip connection is much more influential in ViT compared to "
            "ResNet: we observe much higher norm ratios for ViT throughout, along with the phase transition from CLS to "
            "spatial token propagation (shown for the MLP and self-attention layers.)",
            "Precondition: the ResNet has identity shortcuts. The median norm ratio of the ViT (all sublayers, blocks, "
            "tokens) minus the ResNet's (identity-shortcut blocks only: a projection shortcut is not a skip connection) "
            "must exceed the noise floor.",
            "not stated as a number (Fig. 7 right: ViT ratios above ResNet-50's in every block)",
        ),
        Claim(
            "cls_phase",
            "Raghu Fig. 7",
            "In the first half of the network the CLS token's norm ratio is higher than the "
            "spatial tokens' (it is carried by the skip path); in the second half this is reversed",
            "Raghu et al. 2021 §6",
            R_SEC6,
            "Precondition: a CLS token. For the attention and the MLP sublayer, gap = CLS ratio minus the mean spatial-token "
            "ratio, averaged over the blocks of each half: the first half's gap must be above +floor x factor and the "
            "second half's below -floor x factor (four parts).",
            "not stated as a number (Fig. 7 left: the reversal at about the middle block)",
        ),
        Claim(
            "head_mix",
            "Raghu Fig. 3; ViT App. D.6",
            "Lower layers mix local and global heads; higher layers attend globally",
            "Raghu et al. 2021 §5",
            "In agreement with Dosovitskiy et al. [14], we observe that even in the lowest layers of ViT, self-attention "
            "layers have a mix of local heads (small distances) and global heads (large distances). This is in contrast to "
            "CNNs, which are hardcoded to attend only locally in the lower layers. At higher layers, all self-attention "
            "heads are global.",
            "Read on the locality configuration (vit_local when the study has it trained, else vit_cls; see the pilot "
            "runs). Precondition: a local head exists (mean attention distance below half of uniform attention's on the "
            "same grid). Two parts per seed: the spread of head distances (max - min over heads, mean over blocks) in the "
            "lower half of the blocks minus the upper half's, and the mean distance of the upper half minus the lower "
            "half's; each must exceed the noise floor. "
            'A "not testable" or "did not hold" here rests on detectors with a positive control: heads forced local / offset by interventions.local_attention are found by attention distance, aligned attention and head subsets (tests/test_positive_control.py, recipes/positive_control.yaml); '
            "and the same detectors find local heads in the lower blocks of a real pretrained ViT-S/14 and none in its last "
            "blocks (docs/real-vit.md, tests/test_pretrained.py).",
            "not stated as a number (Fig. 3: lowest blocks span near-zero to near-image-size distances, highest blocks "
            "all large)",
        ),
        Claim(
            "head_subsets",
            "Raghu Fig. 5",
            "The first block's local heads are the most similar to the ResNet's lower "
            "layers; similarity falls as the heads get more global",
            "Raghu et al. 2021 §5",
            "The results, shown in Figure 5, which plot the mean distance for each subset against CKA similarity, clearly "
            "show a monotonic decrease in similarity as mean attention distance grows, demonstrating that access to more "
            "global information also leads to quantitatively different features than computed by the local receptive "
            "fields in the lower layers of the ResNet.",
            "Read on the locality configuration, each seed against the ResNet of the same seed. Precondition: a head of "
            "the first block is local (below half of uniform attention's distance). Per seed, the CKA of the most local "
            "window of heads (analysis/head_subsets.py: windows of half the heads, sorted by distance) minus that of the "
            "most global window, averaged over the ResNet's first two stages, must exceed the noise floor; the rank "
            'correlation of window distance and CKA (the paper\'s "monotonic") is shown beside it.',
            "not stated as a number (Fig. 5: CKA falls monotonically from the most local to the most global subset)",
        ),
        Claim(
            "cls_localization",
            "Raghu Fig. 9, 10",
            "CLS-token ViTs keep spatial location in higher layers better than GAP ViTs",
            "Raghu et al. 2021 §7",
            "The results, shown in Figure 10, demonstrate that global average pooling does indeed reduce localization in "
            "the higher layers.",
            "Last block's localization own_share (share of tokens most similar to their own input patch), CLS minus GAP, "
            "must exceed the noise floor.",
            "not stated as a number (Fig. 9, 10: heatmaps)",
        ),
        Claim(
            "gap_token_probes",
            "Raghu Fig. 11 left",
            "Single spatial tokens of GAP ViTs probe better in higher layers than those of CLS ViTs",
            "Raghu et al. 2021 §7",
            "The left pane shows average accuracy of classifiers trained on individual tokens, where we see that ResNet50 "
            "and ViT with GAP model tokens perform well at higher layers, while in the standard ViT trained with a CLS "
            "token the spatial tokens do poorly – likely because their representations remain spatially localized at "
            "higher layers, which makes global classification challenging.",
            "Last block's mean 10-shot accuracy of single spatial tokens, GAP minus CLS, must exceed the noise floor.",
            "not stated as a number (Fig. 11 left, App. Fig. D.4: per-token accuracies in plots only)",
        ),
        Claim(
            "erf",
            "Raghu Fig. 6, C.1, C.2",
            "ViT's lower-layer effective receptive fields are larger than a ResNet's, "
            "and ViT's become much more global midway through the network while the ResNet's grow gradually",
            "Raghu et al. 2021 §5",
            "We observe that lower layer effective receptive fields for ViT are indeed larger than in ResNets, and while "
            "ResNet effective receptive fields grow gradually, ViT receptive fields become much more global midway through "
            "the network.",
            "The ERF's mean distance (pixels) from the centre location's input window, after the residual connection "
            "(analysis/measures/erf.py: |gradient| of the centre location, averaged over channels and 32 images). Two "
            "parts: at the lowest block, ViT minus ResNet; at the middle of the network (the block at half the depth of "
            "each), ViT minus ResNet; each must exceed the noise floor.",
            "not stated as a number (Fig. 6: ERF maps)",
        ),
        Claim(
            "intermediate_probes",
            "Raghu Fig. 13 right",
            "ViT's intermediate layers are stronger 10-shot linear-probe features than the ResNet's",
            "Raghu et al. 2021 §8",
            "This conclusion is further supported by the results of the right pane of Figure 13, which shows linear probes "
            "on different ResNet and ViT models, all pretrained on JFT-300M. We again see the larger ViT models learn much "
            "stronger intermediate representations than the ResNets.",
            "10-shot closed-form probe accuracy of the spatial mean of each block's output (both models aggregated the "
            "same way), averaged over the middle half of each network's blocks (normalised depth (l + 1) / L in (0.25, "
            "0.75]); ViT minus ResNet must exceed the noise floor. The paper's ViTs are large and JFT-pretrained; this "
            "study's are 6-block ViTs trained 4 epochs on Fashion-MNIST.",
            "not stated as a number (Fig. 13 right: curves only)",
        ),
        Claim(
            "data_drift",
            "Raghu Fig. 12",
            "With less pretraining data lower layers stay similar to the full-data model "
            "while higher layers drift away",
            "Raghu et al. 2021 §8",
            "Even with 3% of the entire dataset, lower layer representations are very similar to the model trained on the "
            "whole dataset, but higher layers require larger amounts of pretraining data to learn the same representations "
            "as at large data scale, especially with the large model size.",
            "Same-index CKA to the full-data model of the same seed. Two parts: for the smallest subset, the lower half's "
            "mean minus the upper half's; and the upper half's mean of the largest subset minus the smallest subset's; "
            "each must exceed the noise floor. Each subset run is read at its chosen checkpoint (best held-out validation "
            "top-1 where the checkpoints record one, else the last).",
            "not stated as a number (Fig. 12: lower layers near 1 even at 3%)",
        ),
        Claim(
            "offset_heads",
            "Walmer Fig. 3, 14",
            "Every ViT learns offset local attention heads",
            "Walmer et al. 2023 §4.2",
            "We find instances of Offset Local Attention Heads in all the models examined, suggesting they are "
            "fundamentally necessary for ViTs.",
            "Read on every seed of the locality configuration (vit_local when the study has it trained, else the standard "
            "ViTs vit_cls and vit_gap). Precondition: one of those runs has a local head (aligned_attention local). Held "
            'if every run has an offset local head, did not hold if none has, inconclusive if only some seeds have. A "not testable" or "did not hold" here rests on detectors with a positive control: heads forced local / offset by interventions.local_attention are found by attention distance, aligned attention and head subsets (tests/test_positive_control.py, recipes/positive_control.yaml).',
            'location only (App. C.1: "Offset Local Attention Heads typically only occur in the first 3 to 6 layers" for '
            "supervised models)",
        ),
    ]
}


# ------------------------------------------------------------------------------------------------ numbers per model


def _block_of(label: str) -> int:
    """'3.attn' -> 3 (CKA layer labels of token models); ResNet labels 'layerS.J' have no block index."""
    return int(str(label).split(".")[0])


def uniformity(matrix) -> dict:
    """Raghu Fig. 1: ``mean_offdiag`` mean CKA over pairs of distinct layers; ``first_last`` CKA of the first and last layer."""
    m = np.asarray(matrix, dtype=float)
    off = m[~np.eye(len(m), dtype=bool)]
    return {"mean_offdiag": float(off.mean()), "first_last": float(m[0, -1])}


def partition(matrix, labels, block: int) -> dict:
    """Raghu Fig. 8: layers of blocks < ``block`` are "before", the others "after"; ``across`` is the mean CKA between a
    layer before and one after, ``within`` the mean CKA of distinct layers on the same side."""
    m = np.asarray(matrix, dtype=float)
    side = np.array([_block_of(lab) >= block for lab in labels])
    if side.all() or not side.any():
        raise ValueError(f"block {block} leaves no layer on one side of the partition")
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


def cls_phase(ratio, sublayer: int = 0, num_prefix_tokens: int = 1) -> dict:
    """Raghu Fig. 7 left: in sublayer ``sublayer`` of ``ratio`` [S, L, T], ``gap_first`` / ``gap_second``: the CLS token's
    norm ratio minus the spatial tokens' mean, averaged over the blocks of the first / second half (the paper: positive,
    then negative). Also the first and last block's values."""
    r = np.asarray(ratio, dtype=float)[sublayer]
    p, h = num_prefix_tokens, len(r) // 2
    gap = r[:, 0] - r[:, p:].mean(1)
    return {
        "gap_first": float(gap[:h].mean()),
        "gap_second": float(gap[h:].mean()),
        "cls_first": float(r[0, 0]),
        "cls_last": float(r[-1, 0]),
        "spatial_first": float(r[0, p:].mean()),
        "spatial_last": float(r[-1, p:].mean()),
    }


def uniform_distance(grid: int, patch: int) -> float:
    """Mean attention distance (patch centres, pixels) of a head attending uniformly over a grid x grid token grid."""
    rc = np.stack(np.meshgrid(np.arange(grid), np.arange(grid), indexing="ij"), -1).reshape(-1, 2)
    return float(patch * np.linalg.norm(rc[:, None] - rc[None], axis=-1).mean())


def head_mix(distance) -> dict:
    """Raghu Fig. 3: attention distances [L, H]. ``spread_lower`` / ``spread_upper``: the mean over blocks of (max - min
    over heads) in the lower / upper half of the blocks; ``mean_lower`` / ``mean_upper``: the mean distance in each half;
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


def go_no_go(by_step: dict, uniform: float, at_step: int | None = None) -> tuple[str, str]:
    """The pilot check of a run: ``by_step`` {step: attention distances [L, H] in pixels, or None where not measured} at
    every checkpoint the run has; ``uniform`` uniform attention's distance on its grid; ``at_step`` the run's second
    scheduled checkpoint (2 x train.checkpoint_every; None: the second step of ``by_step``, which a checkpoint written
    by a clean stop in between would shift). :data:`GO` when some head of the first :data:`GO_BLOCKS` blocks is below
    :data:`GO_FRACTION` x ``uniform`` there, :data:`NO_GO` when none is, :data:`UNDECIDED` when that checkpoint or its
    measurement does not exist yet; and one sentence with the numbers."""
    steps = sorted(by_step)
    thr = GO_FRACTION * uniform
    if at_step is None:
        if len(steps) < 2:
            return UNDECIDED, (
                f"only {len(steps)} checkpoint(s) so far ({', '.join(map(str, steps)) or 'none'}); the "
                "check reads the second"
            )
        at_step = steps[1]
    elif at_step not in by_step:
        return UNDECIDED, (
            f"the check reads the second scheduled checkpoint (step {at_step}), which the run has not "
            f"reached yet (checkpoints: {', '.join(map(str, steps)) or 'none'})"
        )
    s = at_step
    d = by_step[s]
    if d is None or not np.isfinite(np.asarray(d, dtype=float)[:GO_BLOCKS]).any():
        return (
            UNDECIDED,
            f"no attention distance measured at the second checkpoint (step {s}) yet: run the analyze stage",
        )
    early = np.asarray(d, dtype=float)[:GO_BLOCKS]
    b, h = np.unravel_index(np.nanargmin(early), early.shape)
    m = float(early[b, h])
    where = (
        f"at the second checkpoint (step {s}) the most local head of blocks 0-{len(early) - 1} (block {b}, head {h}) "
        f"attends at {m:.2f} px = {m / uniform:.2f} x uniform attention's {uniform:.2f} px"
    )
    if m < thr:
        return GO, f"{where}, below the {GO_FRACTION:g} x threshold ({thr:.2f} px)"
    return NO_GO, f"{where}, not below the {GO_FRACTION:g} x threshold ({thr:.2f} px)"


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


def binomial_se(p: float, n: int) -> float:
    """Standard error of an accuracy p measured on n images."""
    return float(np.sqrt(p * (1 - p) / n)) if n else float("nan")


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


# ------------------------------------------------------------------------------------------------ decisions


def spread(values) -> float:
    """Seed-to-seed difference of one configuration: max - min over its seeds."""
    v = np.asarray(values, dtype=float)
    return float(v.max() - v.min())


def decide(effect: float, threshold: float) -> str:
    """held when ``effect`` (in the paper's direction) exceeds ``threshold``, did not hold when -effect does."""
    if not np.isfinite(effect):
        return INCONCLUSIVE
    return HELD if effect > threshold else NOT_HELD if effect < -threshold else INCONCLUSIVE


def combine(parts: list[str]) -> str:
    if NOT_TESTABLE in parts:
        return NOT_TESTABLE
    if parts and all(p == HELD for p in parts):
        return HELD
    return NOT_HELD if NOT_HELD in parts else INCONCLUSIVE


def _seeds_problem(configs: dict) -> str | None:
    """A sentence when a compared configuration has fewer than two seeds, else None."""
    few = {k: len(v) for k, v in configs.items() if len(v) < MIN_SEEDS}
    if few:
        return (
            "fewer than two seeds of "
            + ", ".join(f"{k} ({n})" for k, n in few.items())
            + ": without a second seed there is no noise floor to judge the effect against"
        )
    return None


def _paired(a: list, b: list) -> int:
    return min(len(a), len(b))


def _part(name: str, a: list[float], b: list[float], verdict: Verdict) -> str:
    """One part: effect = mean over paired seeds of (a - b), floor = largest spread of a and b over seeds."""
    k = _paired(a, b)
    diffs = [x - y for x, y in zip(a[:k], b[:k])]
    effect = float(np.mean(diffs))
    floor = max(spread(a), spread(b))
    thr = NOISE_FACTOR * floor
    verdict.measured[name] = {"a": [float(x) for x in a], "b": [float(y) for y in b], "effect": effect}
    verdict.noise_floor[name] = {"seed_spread": floor, "threshold": thr}
    out = decide(effect, thr)
    verdict.why += f"{name}: effect {effect:+.3f} vs threshold {thr:.3f} ({out}); "
    return out


def _one(name: str, values: list[float], verdict: Verdict, sign: float = 1.0) -> str:
    """One part on a single configuration: effect = mean of sign * value, floor = the values' spread over seeds."""
    effect = float(np.mean([sign * v for v in values]))
    floor = spread(values)
    thr = NOISE_FACTOR * floor
    verdict.measured[name] = {"values": [float(v) for v in values], "effect": effect}
    verdict.noise_floor[name] = {"seed_spread": floor, "threshold": thr}
    out = decide(effect, thr)
    verdict.why += f"{name}: effect {effect:+.3f} vs threshold {thr:.3f} ({out}); "
    return out


def _finish(v: Verdict, parts: list[str], problem: str | None = None) -> Verdict:
    """The combined outcome; with a failed precondition ``problem`` not testable, the measured effects still shown."""
    v.outcome = NOT_TESTABLE if problem else combine(parts)
    if v.ours is None:
        v.ours = (
            "; ".join(f"{k} {m['effect']:+.3g}" for k, m in v.measured.items() if isinstance(m, dict) and "effect" in m)
            or None
        )
    v.why = v.why.rstrip("; ") + "."
    if problem:
        effects = re.sub(
            r" vs threshold [0-9.]+ \([a-z ]+\)|(, )?with [0-9.]+ SE: threshold [0-9.]+ \([a-z ]+\)", "", v.why
        )
        v.why = problem[0].upper() + problem[1:] + ". Measured, with no floor to judge it: " + effects
    return v


def _untestable(why: str, ours: str | None = None, **measured) -> Verdict:
    return Verdict(NOT_TESTABLE, measured=measured, why=why[0].upper() + why[1:] + ".", ours=ours)


# ------------------------------------------------------------------------------------------------ rules


def rule_uniformity(vit: list, resnet: list, identity_blocks: int, resnet_blocks: int) -> Verdict:
    """``vit`` / ``resnet``: each seed's self-CKA matrix."""
    if identity_blocks == 0:
        return _untestable(
            f"the ResNet has no identity shortcut (0 of its {resnet_blocks} blocks): every shortcut is a "
            "projection, unlike the paper's ResNets",
            identity_blocks=identity_blocks,
        )
    p = _seeds_problem({"vit": vit, "resnet": resnet})
    uv, ur = [uniformity(m) for m in vit], [uniformity(m) for m in resnet]
    v = Verdict(INCONCLUSIVE)
    parts = [_part(k, [u[k] for u in uv], [u[k] for u in ur], v) for k in ("mean_offdiag", "first_last")]
    return _finish(v, parts, p)


def rule_noskip(base: list[dict], noskip: dict[int, list[dict]], depth: int) -> Verdict:
    """``base`` and ``noskip[block]``: per seed {"matrix", "labels", "top1", "n"} (n: eval images)."""
    p = _seeds_problem({"vit_cls": base, **{f"noskip_b{b}": r for b, r in noskip.items()}})
    v, parts, ours = Verdict(INCONCLUSIVE), [], []
    for b, runs in sorted(noskip.items()):
        k = _paired(base, runs)
        normal = [partition(r["matrix"], r["labels"], b)["across"] for r in base]
        cut = [partition(r["matrix"], r["labels"], b)["across"] for r in runs]
        parts.append(_part(f"block {b} CKA across (normal - no skip)", normal, cut, v))
        if depth / 3 <= b < 2 * depth / 3:  # the middle third: the paper's 4% is for middle blocks
            ta, tb = [r["top1"] for r in base], [r["top1"] for r in runs]
            name = f"block {b} top-1 drop"
            _part(name, ta, tb, v)
            se = float(
                np.sqrt(
                    sum(
                        binomial_se(x["top1"], x["n"]) ** 2 + binomial_se(y["top1"], y["n"]) ** 2
                        for x, y in zip(base[:k], runs[:k])
                    )
                )
                / k
            )
            thr = max(v.noise_floor[name]["threshold"], SE_FACTOR * se)
            v.noise_floor[name].update(binomial_se=se, threshold=thr)
            eff = v.measured[name]["effect"]
            parts.append(decide(eff, thr))
            v.why += f"{name} with {SE_FACTOR:g} SE: threshold {thr:.4f} ({parts[-1]}); "
            ours.append(f"block {b}: {100 * eff:.2f} ± {100 * se:.2f} points")
    v.ours = "; ".join(ours) or None
    return _finish(v, parts, p)


def rule_skip_dominance(vit_ratios: list, resnet_ratios: list, identity_mask) -> Verdict:
    """``vit_ratios`` / ``resnet_ratios``: per seed norm_ratio ``ratio`` [S, L, T]; ``identity_mask`` [L] of the ResNet's
    blocks with an identity shortcut."""
    mask = np.asarray(identity_mask, dtype=bool)
    if not mask.any():
        return _untestable(
            f"the ResNet has no identity shortcut (0 of its {len(mask)} blocks): its skip path is a 1x1 "
            "projection everywhere, so there is no skip connection to compare",
            identity_blocks=0,
        )
    p = _seeds_problem({"vit": vit_ratios, "resnet": resnet_ratios})
    v = Verdict(INCONCLUSIVE, measured={"identity_blocks": int(mask.sum()), "resnet_blocks": len(mask)})
    part = _part(
        "median norm ratio (ViT - ResNet identity blocks)",
        [skip_dominance(r) for r in vit_ratios],
        [skip_dominance(r, mask) for r in resnet_ratios],
        v,
    )
    return _finish(v, [part], p)


def rule_cls_phase(ratios: list, sublayers, num_prefix_tokens: int) -> Verdict:
    """``ratios``: per seed norm_ratio ``ratio`` [S, L, T] of a CLS ViT; ``sublayers``: names of S."""
    if num_prefix_tokens < 1:
        return _untestable("the model has no CLS token (num_prefix_tokens 0)")
    p = _seeds_problem({"vit_cls": ratios})
    v, parts = Verdict(INCONCLUSIVE), []
    for s, name in enumerate(sublayers):
        ph = [cls_phase(r, s, num_prefix_tokens) for r in ratios]
        parts.append(_one(f"{name}: first-half CLS - spatial", [x["gap_first"] for x in ph], v, +1))
        parts.append(_one(f"{name}: second-half spatial - CLS", [x["gap_second"] for x in ph], v, -1))
        v.measured[f"{name}: first/last block CLS, spatial"] = [
            [x["cls_first"], x["cls_last"], x["spatial_first"], x["spatial_last"]] for x in ph
        ]
    return _finish(v, parts, p)


def rule_head_mix(distances: list, uniform: float, config: str = "vit_cls") -> Verdict:
    """``distances``: per seed attention distances [L, H] (pixels, patch centres) of configuration ``config``;
    ``uniform``: uniform attention's."""
    hm = [head_mix(d) for d in distances]
    local = LOCAL_FRACTION * uniform
    if not distances or min(h["min"] for h in hm) >= local:
        m = min((h["min"] for h in hm), default=float("nan"))
        return _untestable(
            f"no head is local: the smallest mean attention distance is {m:.2f} px, uniform attention's "
            f"{uniform:.2f} px, local means below {local:.2f} px",
            smallest=m,
            uniform=uniform,
        )
    p = _seeds_problem({config: distances})
    v = Verdict(INCONCLUSIVE, measured={"uniform_px": uniform, "smallest_px": min(h["min"] for h in hm)})
    parts = [
        _one("head spread, lower - upper half (px)", [h["spread_lower"] - h["spread_upper"] for h in hm], v),
        _one("mean distance, upper - lower half (px)", [h["mean_upper"] - h["mean_lower"] for h in hm], v),
    ]
    return _finish(v, parts, p)


def rule_head_subsets(results: list, uniform: float, config: str = "vit_cls") -> Verdict:
    """``results``: per seed the head-subset result of configuration ``config``'s first block against the ResNet of the
    same seed (analysis/head_subsets.py, patch-centre pixels); ``uniform``: uniform attention's distance."""
    hs = [head_subsets(r) for r in results]
    local = LOCAL_FRACTION * uniform
    smallest = min((h["min_head"] for h in hs), default=float("nan"))
    measured = {"uniform_px": uniform, "smallest_block0_px": smallest, "rank_corr": [h["rank_corr"] for h in hs]}
    if not results or not smallest < local:
        return _untestable(
            f"no head of the first block is local: its smallest mean attention distance is {smallest:.2f} px, "
            f"uniform attention's {uniform:.2f} px, local means below {local:.2f} px; windows of near-uniform "
            "heads have no local-to-global order to test",
            **measured,
        )
    v = Verdict(INCONCLUSIVE, measured=measured)
    part = _one("CKA to ResNet lower layers, most local - most global window", [h["local_minus_global"] for h in hs], v)
    return _finish(v, [part], _seeds_problem({config: results}))


def rule_difference(name: str, a: list[float], b: list[float], configs: tuple[str, str]) -> Verdict:
    """A claim that a quantity is larger in configuration a than in b (per seed values)."""
    v = Verdict(INCONCLUSIVE)
    return _finish(v, [_part(name, a, b, v)], _seeds_problem({configs[0]: a, configs[1]: b}))


def middle_mean(curve) -> float:
    """Mean of a per-block curve over the middle half of the network: blocks l with (l + 1) / L in (0.25, 0.75]."""
    v = np.asarray(curve, dtype=float).reshape(-1)
    depth = (np.arange(len(v)) + 1) / len(v)
    return float(np.nanmean(v[(depth > 0.25) & (depth <= 0.75)]))


def rule_erf(vit: list, resnet: list) -> Verdict:
    """``vit`` / ``resnet``: per seed the post-residual ERF mean distance of each block [L] (pixels)."""
    p = _seeds_problem({"vit": vit, "resnet": resnet})
    v = Verdict(INCONCLUSIVE)

    def mid(c):
        return float(np.asarray(c, dtype=float)[(len(c) - 1) // 2])

    parts = [
        _part(
            "lowest block ERF mean distance, ViT - ResNet (px)",
            [float(c[0]) for c in vit],
            [float(c[0]) for c in resnet],
            v,
        ),
        _part("middle block ERF mean distance, ViT - ResNet (px)", [mid(c) for c in vit], [mid(c) for c in resnet], v),
    ]
    return _finish(v, parts, p)


def rule_data_drift(curves: dict[float, list]) -> Verdict:
    """``curves``: subset fraction -> per seed same-index CKA to the full-data model of the same seed [L]."""
    if len(curves) < 2:
        return _untestable(f"{len(curves)} subset size(s): the rule needs two")
    p = _seeds_problem({f"subset {f:g}": c for f, c in curves.items()})
    small, large = min(curves), max(curves)
    ds, dl = [drift(c) for c in curves[small]], [drift(c) for c in curves[large]]
    v = Verdict(INCONCLUSIVE)
    parts = [
        _one(f"subset {small:g}: lower - upper half", [d["lower"] - d["upper"] for d in ds], v),
        _part(
            f"upper half: subset {large:g} - subset {small:g}", [d["upper"] for d in dl], [d["upper"] for d in ds], v
        ),
    ]
    return _finish(v, parts, p)


def rule_offset_heads(runs: dict[str, dict]) -> Verdict:
    """``runs``: ViT run name -> {"local": [L, H] bool, "offset_local": [L, H] bool}."""
    n_local = {k: int(np.asarray(r["local"], dtype=bool).sum()) for k, r in runs.items()}
    heads = sum(int(np.asarray(r["local"]).size) for r in runs.values())
    counts = {k: offset_heads(r["offset_local"]) for k, r in runs.items()}
    measured = {
        "local_heads": n_local,
        "offset_local_heads": {k: c["count"] for k, c in counts.items()},
        "where": {k: c["where"][:4] for k, c in counts.items()},
    }
    if not runs or sum(n_local.values()) == 0:
        return _untestable(
            f"no ViT of the study has a local head (0 of {heads} heads in {len(runs)} runs), so offset "
            "local heads cannot appear",
            ours=f"0 of {heads} heads local" if heads else None,
            **measured,
        )
    if len(runs) < MIN_SEEDS:
        return _untestable(f"one ViT run ({next(iter(runs))}): the rule needs two seeds", **measured)
    have = [c["count"] > 0 for c in counts.values()]
    out = HELD if all(have) else NOT_HELD if not any(have) else INCONCLUSIVE
    return Verdict(
        out,
        measured=measured,
        noise_floor={"runs with one": f"{sum(have)} of {len(have)}"},
        why=f"{sum(have)} of {len(have)} ViT runs have an offset local head.",
    )


# ------------------------------------------------------------------------------------------------ the JSON record


def record(claim: Claim, verdict: Verdict) -> dict:
    """One claim's entry of docs/reproduction.json."""
    return {
        "id": claim.id,
        "figure": claim.figure,
        "claim": claim.claim,
        "source": claim.source,
        "passage": claim.passage,
        "rule": claim.rule,
        "paper_value": claim.paper_value,
        "ours": verdict.ours,
        "measured": _plain(verdict.measured),
        "noise_floor": _plain(verdict.noise_floor),
        "verdict": verdict.outcome,
        "why": verdict.why,
    }


def _plain(x):
    if isinstance(x, dict):
        return {str(k): _plain(v) for k, v in x.items()}
    if isinstance(x, (list, tuple, np.ndarray)):
        return [_plain(v) for v in x]
    if isinstance(x, (np.integer, bool, np.bool_)):
        return int(x) if not isinstance(x, (bool, np.bool_)) else bool(x)
    if isinstance(x, (float, np.floating)):
        return float(x) if np.isfinite(x) else None
    return x


def write_json(path: Path, study: str, records: list[dict], notes: list[str], extra: dict | None = None) -> None:
    """docs/reproduction.json: the claims' records, the notes, and ``extra`` (e.g. ``pilots``: each pilot run's
    go/no-go; ``locality_configuration``: which configuration the locality claims read and why)."""
    doc = {
        "study": study,
        "noise_factor": NOISE_FACTOR,
        "se_factor": SE_FACTOR,
        "go_fraction": GO_FRACTION,
        "local_fraction": LOCAL_FRACTION,
        "outcomes": list(OUTCOMES),
        "claims": records,
        "notes": notes,
        **_plain(extra or {}),
    }
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(doc, indent=1, ensure_ascii=False) + "\n")
    tmp.replace(path)


def read_json(path: Path) -> dict:
    """docs/reproduction.json read back: {"claims": {id: record}, ...} so two studies diff claim by claim."""
    d = json.loads(Path(path).read_text())
    return {**d, "claims": {c["id"]: c for c in d["claims"]}}
