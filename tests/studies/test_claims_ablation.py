"""The ablation rules beside Raghu Fig. 8 (analysis/studies/raghu2021/ablation.py) on synthetic ablation results whose
answers are known."""

import numpy as np
import pytest

from analysis.studies import claims as C
from analysis.studies.raghu2021.ablation import important_heads, rule_skip_test_time, skip_costs

L, H = 4, 3


def result(clean, skip_top1=None, head_drop=None, replace="mean", skip="remove", n=1000):
    """A result as the ablation measure writes it: every single head and every block's skip target."""
    targets, kinds, blocks, heads, top1 = [], [], [], [], []
    hd = np.zeros((L, H)) if head_drop is None else np.asarray(head_drop, dtype=float)
    for b in range(L):
        for h in range(H):
            targets.append(f"blocks.{b}.head{h}")
            kinds.append("head")
            blocks.append(b)
            heads.append(str(h))
            top1.append(clean - hd[b, h])
        targets.append(f"blocks.{b}.skip")
        kinds.append("skip")
        blocks.append(b)
        heads.append("")
        top1.append((skip_top1 or {}).get(b, clean))
    top1 = np.array(top1)
    return {
        "targets": targets,
        "kinds": kinds,
        "target_block": np.array(blocks),
        "heads": heads,
        "top1": top1,
        "top1_drop": clean - top1,
        "clean_top1": np.float64(clean),
        "blocks": [f"blocks.{b}" for b in range(L)],
        "num_heads": H,
        "replace": replace,
        "skip": skip,
        "n_images": n,
    }


def test_test_time_removal_costing_far_more_than_training_without_holds():
    base = [result(0.860, {1: 0.40, 2: 0.30}), result(0.866, {1: 0.42, 2: 0.31}), result(0.862, {1: 0.41, 2: 0.32})]
    noskip = {1: [result(0.851), result(0.855), result(0.853)], 2: [result(0.846), result(0.852), result(0.85)]}
    c = skip_costs(base, noskip)
    assert c[2]["test"] == pytest.approx([0.56, 0.556, 0.542]) and c[2]["train"] == pytest.approx([0.014, 0.014, 0.012])
    v = rule_skip_test_time(base, noskip)
    assert v.outcome == C.HELD, v.why
    part = next(p for p in v.decision.parts if p.name.startswith("block 2"))
    assert part.effect == pytest.approx(np.mean([0.846 - 0.30, 0.852 - 0.31, 0.85 - 0.32])) and part.test == "paired t"
    assert part.ci[0] > 0 and "test time 55.3, training 1.3 points" in v.ours
    # the training cost here is read on the analysis images, not the trainer's test top-1: labelled as such
    assert v.ours.endswith("(top-1 on the 1000 analysis images)") and "test split by the trainer" in v.lines[0]


def test_the_opposite_direction_and_noise_give_the_other_outcomes():
    # the test-time cost below the training cost: did not hold
    base = [result(0.86, {3: 0.85}), result(0.86, {3: 0.851}), result(0.86, {3: 0.852})]
    v = rule_skip_test_time(base, {3: [result(0.70), result(0.701), result(0.703)]})
    assert v.outcome == C.NOT_HELD, v.why
    # a difference within the seed-to-seed variation: inconclusive
    base = [result(0.86, {3: 0.80}), result(0.90, {3: 0.70}), result(0.88, {3: 0.86})]
    v = rule_skip_test_time(base, {3: [result(0.85), result(0.76), result(0.84)]})
    assert v.outcome == C.INCONCLUSIVE, v.why


def test_preconditions_are_not_testable_with_a_sentence():
    one = rule_skip_test_time([result(0.86, {1: 0.5})], {1: [result(0.85)]})
    assert one.outcome == C.NOT_TESTABLE and "ewer than 2 seeds" in one.why
    kept = rule_skip_test_time([result(0.86, skip="replace")] * 2, {1: [result(0.85)] * 2})
    assert kept.outcome == C.NOT_TESTABLE and "skip: remove" in kept.why
    other = rule_skip_test_time([result(0.86)] * 2, {1: [result(0.85, n=500)] * 2})
    assert other.outcome == C.NOT_TESTABLE and "different numbers of images" in other.why
    assert rule_skip_test_time([result(0.86)] * 2, {}).outcome == C.NOT_TESTABLE


def test_heads_above_the_seed_noise_floor_are_counted_per_block():
    drops0 = np.array([[0.02, 0.0, 0.005], [0.0, 0.0, 0.0], [0.3, 0.011, 0.009], [0.0, -0.05, 0.02]])
    drops1 = np.array([[0.03, 0.012, 0.0], [0.0, 0.0, 0.0], [0.2, 0.0, 0.0], [0.0, 0.0, 0.0]])
    out = important_heads([result(0.860, head_drop=drops0), result(0.861, head_drop=drops1)])
    # seed SD 0.000707; the 95% prediction half-width t(0.975, 1) x SD x sqrt(1.5) = 12.706 x 0.000707 x 1.2247
    assert out["seed_sd"] == pytest.approx(0.000707, abs=1e-6) and out["threshold"] == pytest.approx(0.011, abs=1e-4)
    assert out["counts"] == [[1, 0, 1, 1], [2, 0, 1, 0]] and out["mean"] == [1.5, 0.0, 1.0, 0.5] and out["heads"] == H
    assert "block 0 1.5 of 3" in out["why"]
    with pytest.raises(ValueError, match="at least two seeds"):
        important_heads([result(0.86)])
    with pytest.raises(ValueError, match="replace: mean"):
        important_heads([result(0.86, replace="zero")] * 2)
