"""The ablation rules beside Raghu Fig. 8 (analysis/reports/claims_ablation.py) on synthetic ablation results whose
answers are known."""

import numpy as np
import pytest

from analysis.reports import claims as C
from analysis.reports.claims_ablation import important_heads, rule_skip_test_time, skip_costs

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
    base = [result(0.860, {1: 0.40, 2: 0.30}), result(0.866, {1: 0.42, 2: 0.31})]
    noskip = {1: [result(0.851), result(0.855)], 2: [result(0.846), result(0.852)]}
    c = skip_costs(base, noskip)
    assert c[2]["test"] == pytest.approx([0.56, 0.556]) and c[2]["train"] == pytest.approx([0.014, 0.014])
    v = rule_skip_test_time(base, noskip)
    assert v.outcome == C.HELD, v.why
    name = "block 2: test-time minus training-time top-1 cost"
    assert v.measured[name]["effect"] == pytest.approx(np.mean([0.56 - 0.014, 0.556 - 0.014]))
    assert v.noise_floor[name]["seed_spread"] == pytest.approx(0.004)  # the test-time costs' spread, the larger
    assert "test time 55.8, training 1.4 points" in v.ours


def test_the_opposite_direction_and_noise_give_the_other_outcomes():
    # the test-time cost below the training cost: did not hold
    base = [result(0.86, {3: 0.85}), result(0.86, {3: 0.851})]
    v = rule_skip_test_time(base, {3: [result(0.70), result(0.701)]})
    assert v.outcome == C.NOT_HELD, v.why
    # a difference within the seed spread: inconclusive
    base = [result(0.86, {3: 0.80}), result(0.90, {3: 0.70})]
    v = rule_skip_test_time(base, {3: [result(0.85), result(0.84)]})
    assert v.outcome == C.INCONCLUSIVE, v.why
    # the binomial standard error on few images is part of the threshold: 100 images cannot resolve 4 points
    base = [result(0.86, {3: 0.80}, n=100), result(0.86, {3: 0.80}, n=100)]
    v = rule_skip_test_time(base, {3: [result(0.84, n=100), result(0.84, n=100)]})
    assert (
        v.outcome == C.INCONCLUSIVE
        and v.noise_floor["block 3: test-time minus training-time top-1 cost"]["binomial_se"] > 0.02
    )


def test_preconditions_are_not_testable_with_a_sentence():
    one = rule_skip_test_time([result(0.86, {1: 0.5})], {1: [result(0.85)]})
    assert one.outcome == C.NOT_TESTABLE and "ewer than two seeds" in one.why
    kept = rule_skip_test_time([result(0.86, skip="replace")] * 2, {1: [result(0.85)] * 2})
    assert kept.outcome == C.NOT_TESTABLE and "skip: remove" in kept.why
    other = rule_skip_test_time([result(0.86)] * 2, {1: [result(0.85, n=500)] * 2})
    assert other.outcome == C.NOT_TESTABLE and "different numbers of images" in other.why
    assert rule_skip_test_time([result(0.86)] * 2, {}).outcome == C.NOT_TESTABLE


def test_heads_above_the_seed_noise_floor_are_counted_per_block():
    drops0 = np.array([[0.02, 0.0, 0.005], [0.0, 0.0, 0.0], [0.3, 0.011, 0.009], [0.0, -0.05, 0.02]])
    drops1 = np.array([[0.03, 0.012, 0.0], [0.0, 0.0, 0.0], [0.2, 0.0, 0.0], [0.0, 0.0, 0.0]])
    out = important_heads([result(0.860, head_drop=drops0), result(0.865, head_drop=drops1)])
    assert out["seed_spread"] == pytest.approx(0.005) and out["threshold"] == pytest.approx(0.01)
    assert out["counts"] == [[1, 0, 2, 1], [2, 0, 1, 0]] and out["mean"] == [1.5, 0.0, 1.5, 0.5] and out["heads"] == H
    assert "block 0 1.5 of 3" in out["why"]
    with pytest.raises(ValueError, match="at least two seeds"):
        important_heads([result(0.86)])
    with pytest.raises(ValueError, match="replace: mean"):
        important_heads([result(0.86, replace="zero")] * 2)
