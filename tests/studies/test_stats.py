"""The studies' statistical decision rule (analysis/studies/stats.py): each test against scipy.stats or a hand-worked
answer, the bootstrap's coverage, and the rule's error rates and power on synthetic seeds."""

import json
import time

import numpy as np
import pytest
from scipy import stats as ss

from analysis.studies import claims as C
from analysis.studies import stats as S


def t4_cdf(t):
    """Student's t CDF with 4 df in closed form: 1/2 + 3/8 u (1 - u^2 / 12), u = t / sqrt(1 + t^2 / 4)."""
    u = t / np.sqrt(1 + t * t / 4)
    return 0.5 + 3 / 8 * u * (1 - t * t / (12 * (1 + t * t / 4)))


T975_4, T95_4 = 2.7764451052, 2.1318467813  # t quantiles with 4 df (any table)


def test_outcomes_are_shared_with_the_claims():
    assert (C.HELD, C.NOT_HELD, C.INCONCLUSIVE, C.NOT_TESTABLE, C.OUTCOMES) == (
        S.HELD,
        S.NOT_HELD,
        S.INCONCLUSIVE,
        S.NOT_TESTABLE,
        S.OUTCOMES,
    )
    assert S.OUTCOMES == ("held", "did not hold", "inconclusive", "not testable")


def test_one_sample_ci_by_hand():
    # 1..5: mean 3, sd sqrt(2.5), SE sqrt(2.5 / 5) = 0.70711, t = 4.24264 on 4 df
    p = S.one_sample_part("x", [1, 2, 3, 4, 5])
    se = np.sqrt(0.5)
    assert p.effect == pytest.approx(3) and p.se == pytest.approx(se) and p.df == 4 and p.n == (5,)
    assert p.ci == pytest.approx((3 - T975_4 * se, 3 + T975_4 * se), abs=1e-8)  # (1.036757, 4.963243)
    assert p.ci == pytest.approx((1.036757, 4.963243), abs=1e-6)
    assert p.p == pytest.approx(2 * (1 - t4_cdf(3 / se)), rel=1e-9) and p.outcome == S.FOR
    q = S.one_sample_part("x", [1, 2, 3, 4, 5], ref=3)  # exactly at the reference
    assert q.p == pytest.approx(1.0) and q.outcome == S.NOT_SIGNIFICANT and q.effect == 0
    r = S.one_sample_part("x", [1, 2, 3, 4, 5], sign=-1)  # the paper says below 0: the effect is against it
    assert (
        r.effect == pytest.approx(-3)
        and r.ci == pytest.approx((-4.963243, -1.036757), abs=1e-6)
        and r.outcome == S.AGAINST
    )
    assert r.p == pytest.approx(p.p)
    ref = ss.ttest_1samp([1, 2, 3, 4, 5], 0.0)
    assert p.p == pytest.approx(ref.pvalue) and p.ci == pytest.approx(tuple(ref.confidence_interval()))


@pytest.mark.parametrize("seed", range(5))
def test_welch_and_paired_match_scipy(seed):
    rng = np.random.default_rng(seed)
    a, b = rng.normal(1, 1, 3 + seed), rng.normal(0, 2.5, 4)
    p, r = S.two_sample_part("w", a, b), ss.ttest_ind(a, b, equal_var=False)
    assert p.p == pytest.approx(r.pvalue, rel=1e-9) and p.df == pytest.approx(r.df, rel=1e-9)
    assert p.ci == pytest.approx(tuple(r.confidence_interval()), rel=1e-9)
    assert p.effect == pytest.approx(a.mean() - b.mean()) and p.test == "Welch t"
    m = S.two_sample_part("w", a, b, sign=-1)  # the other direction: the same p, the mirrored CI
    assert m.p == pytest.approx(p.p) and m.ci == pytest.approx((-p.ci[1], -p.ci[0]))
    c = rng.normal(0.5, 1, 3 + seed)
    q, r = S.paired_part("d", a, c), ss.ttest_rel(a, c)
    assert q.p == pytest.approx(r.pvalue, rel=1e-9) and q.df == len(a) - 1
    assert q.ci == pytest.approx(tuple(r.confidence_interval()), rel=1e-9)


def test_pooled_sd_and_the_pooled_t_match_scipy_equal_var():
    rng = np.random.default_rng(4)
    a, b = rng.normal(0, 1, 3), rng.normal(1, 1, 3)
    assert 1 / S.POOLED_SD_RATIO < a.std(ddof=1) / b.std(ddof=1) < S.POOLED_SD_RATIO  # no fall-back to Welch
    pool = S.pooled_sd([a, b])
    assert pool.df == 4 and pool.sd == pytest.approx(np.sqrt((a.var(ddof=1) + b.var(ddof=1)) / 2))
    p, r = S.two_sample_part("x", a, b, pooled=pool), ss.ttest_ind(a, b, equal_var=True)  # the family is just a, b
    assert p.p == pytest.approx(r.pvalue) and p.ci == pytest.approx(tuple(r.confidence_interval())) and p.df == 4
    # a family of four configurations (one with a single seed: no df) pools 2 + 2 + 3 + 0 df
    fam = {"a": a, "b": b, "c": [1.0, 2.0, 4.0, 5.0], "d": [7.0]}
    pool = S.pooled_sd(fam)
    ss_by_hand = ((a - a.mean()) ** 2).sum() + ((b - b.mean()) ** 2).sum() + (4 + 1 + 1 + 4)
    assert pool.df == 7 and pool.groups == 4 and pool.sd == pytest.approx(np.sqrt(ss_by_hand / 7))
    p = S.two_sample_part("x", a, b, pooled=pool)
    se = pool.sd * np.sqrt(2 / 3)
    assert p.df == 7 and p.se == pytest.approx(se)
    assert p.ci == pytest.approx(
        (a.mean() - b.mean() - ss.t.ppf(0.975, 7) * se, a.mean() - b.mean() + ss.t.ppf(0.975, 7) * se)
    )
    one = S.one_sample_part("o", [7.0], ref=5.0, pooled=pool)  # one seed, judged on the family's SD
    assert one.se == pytest.approx(pool.sd) and one.df == 7
    with pytest.raises(ValueError, match="no degree of freedom"):
        S.pooled_sd([[1.0], [2.0]])


def test_bad_input_says_what_to_do():
    with pytest.raises(ValueError, match="not finite"):
        S.two_sample_part("x", [1.0, np.nan, 2.0], [1.0, 2.0])
    with pytest.raises(ValueError, match="at least 2"):
        S.two_sample_part("x", [1.0], [1.0, 2.0])
    with pytest.raises(ValueError, match="as many seeds"):
        S.paired_part("x", [1.0, 2.0, 3.0], [1.0, 2.0])
    with pytest.raises(ValueError, match="sign"):
        S.one_sample_part("x", [1.0, 2.0], sign=2)
    with pytest.raises(ValueError, match="one number per resample"):
        S.bootstrap_part("x", np.ones((10, 2)))  # np.mean over axis 1 of [B, N, 2] leaves [B, 2]
    with pytest.raises(ValueError, match="same images"):
        S.paired_bootstrap_part("x", np.ones(10), np.ones(11))


def test_degenerate_parts_without_seed_variation():
    """Every seed equal: no test, never p = 0 -- the part is DEGENERATE (p undefined, null in JSON) and cannot make a
    claim held; the claim is not testable, or did not hold when another part is significantly against."""
    p = S.two_sample_part("x", [2.0, 2.0, 2.0], [1.0, 1.0, 1.0])
    assert p.outcome == S.DEGENERATE and np.isnan(p.p) and p.ci == (1.0, 1.0) and p.effect == 1.0
    assert p.p_reversal == 1.0 and p.power_2sd is None and p.mde is None
    assert "p undefined" in p.summary() and json.loads(json.dumps(p.to_json()))["p"] is None
    fam = S.pooled_sd([[2.0, 2.0, 2.0], [1.0, 1.0, 1.0]])
    assert S.two_sample_part("x", [2.0, 2.0, 2.0], [1.0, 1.0, 1.0], pooled=fam).outcome == S.DEGENERATE
    assert S.paired_part("x", [1.0, 2.0], [1.0, 2.0]).outcome == S.DEGENERATE  # d = 0, 0
    assert S.one_sample_part("x", [0.5, 0.5, 0.5], ref=0.2).outcome == S.DEGENERATE
    # a degenerate part beside one significant for: not held, not testable, saying which part and why
    good = S.one_sample_part("g", [1.0, 1.1, 0.9])
    d = S.decide([good, p])
    assert good.outcome == S.FOR and d.outcome == S.NOT_TESTABLE
    assert (
        d.why.startswith("No seed-to-seed variation in x (effect +1, the same on every seed)")
        and "Measured, not judged" in d.why
    )
    assert [c.name for c in d.preconditions if not c.passed] == ["seed variation"]
    # beside a part significantly against (Holm over 2 parts, the degenerate one never rejects): did not hold
    bad = S.one_sample_part("b", [-1.0, -1.1, -0.9])
    d = S.decide([bad, p])
    assert d.outcome == S.NOT_HELD and d.p_holm == pytest.approx((2 * bad.p, 1.0))
    # alone: not testable, never "held" by p = 0 nor "did not hold"
    assert S.decide([p]).outcome == S.NOT_TESTABLE
    assert S.decide([S.one_sample_part("x", [-3.0, -3.0, -3.0])]).outcome == S.NOT_TESTABLE
    # a precondition that fails is still the first reason
    assert S.decide([p], False).why.startswith("A precondition failed")


def test_holm_by_hand():
    # sorted 0.005, 0.01, 0.03, 0.04 -> x4, x3, x2, x1 = 0.02, 0.03, 0.06, 0.04 -> running max 0.02, 0.03, 0.06, 0.06
    assert S.holm([0.01, 0.04, 0.03, 0.005]) == pytest.approx([0.03, 0.06, 0.06, 0.02])
    assert S.holm([0.5, 0.9]) == pytest.approx([1.0, 1.0])  # capped at 1
    assert S.holm([0.02]) == pytest.approx([0.02])


def test_tost_by_hand():
    d = [-0.2, -0.1, 0.0, 0.1, 0.2]  # mean 0, SE sqrt(0.025 / 5) = 0.0707107, df 4
    se = np.sqrt(0.025 / 5)
    e = S.equivalence_part(S.one_sample_part("d", d), margin=0.3)
    # TOST: t = (0 + 0.3) / SE = 4.2426 and (0 - 0.3) / SE = -4.2426: both one-sided p = 1 - F4(4.2426) = 0.00662
    assert e.p == pytest.approx(1 - t4_cdf(0.3 / se), rel=1e-9) and e.p == pytest.approx(0.006618, abs=1e-6)
    assert e.outcome == S.FOR and e.margin == 0.3 and e.test == "TOST, one-sample t"
    assert e.details["ci_tost"] == pytest.approx([-T95_4 * se, T95_4 * se])  # the 90% CI, inside +-0.3
    assert e.ci == pytest.approx((-T975_4 * se, T975_4 * se))
    # margin 0.1: t = 1.41421, p = 1 - F4(1.41421) = 0.1151 -> not shown equivalent, nor different beyond the margin
    e = S.equivalence_part(S.one_sample_part("d", d), margin=0.1)
    assert e.p == pytest.approx(1 - t4_cdf(0.1 / se), rel=1e-9) and e.outcome == S.NOT_SIGNIFICANT
    assert e.p_reversal == pytest.approx(1.0)  # 2 x min(P(T > (0 - 0.1)/SE), ...) > 1, capped
    # a difference of 1 against a margin of 0.3: beyond it, p_reversal = 2 (1 - F4((1 - 0.3) / SE))
    far = [0.8, 0.9, 1.0, 1.1, 1.2]
    e = S.equivalence_part(S.one_sample_part("d", far), margin=0.3)
    assert e.outcome == S.AGAINST and e.p_reversal == pytest.approx(2 * (1 - t4_cdf(0.7 / se)), rel=1e-9)
    assert e.p == pytest.approx(t4_cdf(0.7 / se), rel=1e-9)  # the larger one-sided p: of H0 effect >= 0.3
    assert S.decide([e]).outcome == S.NOT_HELD
    with pytest.raises(ValueError, match="positive"):
        S.equivalence_part(S.one_sample_part("d", d), margin=0)


def _part(name, p, effect, p_reversal=None):
    outcome = S.NOT_SIGNIFICANT if p >= 0.05 else S.FOR if effect > 0 else S.AGAINST
    return S.Part(name, effect, (effect - 1, effect + 1), p, outcome, "t", (3, 3), df=4.0, p_reversal=p_reversal)


def test_decide():
    held = S.decide([_part("a", 0.01, 1.0), _part("b", 0.04, 0.5)])
    assert held.outcome == S.HELD and "Every part" in held.why and "a: +1" in held.why
    # one part reversed at p = 0.03 among three: Holm adjusts it to 0.06 (rank 2 of 3, after 0.01) -> inconclusive
    parts = [_part("a", 0.01, 1.0), _part("b", 0.03, -0.5), _part("c", 0.5, 0.1)]
    d = S.decide(parts)
    assert d.outcome == S.INCONCLUSIVE and d.p_holm == pytest.approx((0.03, 0.06, 0.5))
    assert "1 of 3 part(s) significant" in d.why
    # alone it survives: did not hold
    assert S.decide([_part("b", 0.03, -0.5)]).outcome == S.NOT_HELD
    parts = [_part("a", 0.2, 1.0), _part("b", 0.001, -0.5)]
    d = S.decide(parts)
    assert d.outcome == S.NOT_HELD and "b (Holm-adjusted p = 0.002)" in d.why
    # a failed precondition: not testable with its numbers, whatever the parts say
    pre = S.Precondition(
        "local head",
        False,
        "no head is local: the smallest mean attention distance is 11.2 px, local means below 6.1 px",
        {"smallest_px": 11.2, "local_px": 6.1},
    )
    d = S.decide(parts, [S.Precondition("cls", True, "a CLS token"), pre])
    assert (
        d.outcome == S.NOT_TESTABLE
        and d.why.startswith("No head is local: the smallest")
        and "Measured, not judged" in d.why
    )
    assert S.decide(parts, False).outcome == S.NOT_TESTABLE and S.decide(parts, True).outcome == S.NOT_HELD
    assert S.min_seeds({"vit": [1, 2, 3], "resnet": [1]}).sentence.startswith("fewer than 2 seeds of resnet (1)")
    assert S.decide(held.parts, S.min_seeds({"vit": [1, 2, 3], "resnet": [1]})).outcome == S.NOT_TESTABLE
    assert S.decide(held.parts, S.min_seeds({"vit": [1, 2], "resnet": [1, 2]})).outcome == S.HELD
    with pytest.raises(ValueError, match="at least one part"):
        S.decide([])
    with pytest.raises(ValueError, match="share one alpha"):
        S.decide([_part("a", 0.01, 1.0), S.one_sample_part("b", [1.0, 2.0, 3.0], alpha=0.01)])


def test_json():
    rng = np.random.default_rng(0)
    parts = [
        S.two_sample_part("w", rng.normal(1, 1, 3), rng.normal(0, 1, 3)),
        S.bootstrap_part("b", rng.normal(0.2, 1, 64), n_boot=500),
    ]
    d = S.decide(parts, [S.min_seeds({"a": [1, 2, 3]})])
    doc = json.loads(json.dumps(d.to_json()))
    assert doc["outcome"] == d.outcome and doc["parts"][0]["ci"] == list(parts[0].ci) and doc["parts"][1]["df"] is None
    assert (
        doc["parts"][1]["details"] == {"n_boot": 500, "seed": 0, "method": "bca"} and doc["preconditions"][0]["passed"]
    )
    assert d.ours.startswith("w +")


# ------------------------------------------------------------------------------------------------ bootstrap


def test_bootstrap_matches_scipy_bootstrap():
    """The CIs agree with scipy.stats.bootstrap's (an independent implementation) within the Monte-Carlo error."""
    rng = np.random.default_rng(1)
    x = rng.exponential(1.0, 200)  # skewed: BCa and percentile differ
    for method, sm in (("bca", "BCa"), ("percentile", "percentile")):
        p = S.bootstrap_part("m", x, n_boot=20000, method=method)
        r = ss.bootstrap((x,), np.mean, n_resamples=20000, method=sm, rng=7).confidence_interval
        assert p.ci == pytest.approx((r.low, r.high), abs=0.01), method
        assert p.effect == pytest.approx(x.mean())
    y = x + rng.normal(0.1, 0.5, 200)  # the same images: a paired difference
    p = S.paired_bootstrap_part("d", y, x, n_boot=20000)
    r = ss.bootstrap(
        (y, x), lambda a, b, axis: a.mean(axis) - b.mean(axis), paired=True, n_resamples=20000, method="BCa", rng=7
    ).confidence_interval
    assert p.ci == pytest.approx((r.low, r.high), abs=0.01) and p.test == "paired bootstrap BCa"


def test_bootstrap_is_seeded_vectorised_and_fast():
    rng = np.random.default_rng(2)
    x = rng.normal(10, 3, 256)
    t0 = time.perf_counter()
    p = S.bootstrap_part("m", x, n_boot=2000, seed=5)
    elapsed = time.perf_counter() - t0
    assert elapsed < 0.5, elapsed  # 2,000 resamples of 256 images (about 10 ms on the reference machine)
    assert S.bootstrap_part("m", x, n_boot=2000, seed=5) == p and S.bootstrap_part("m", x, seed=6).ci != p.ci
    # a statistic of several columns: a ratio of means over the same resampled images
    xy = np.stack([x, x / 2 + rng.normal(0, 0.1, 256)], axis=1)
    r = S.bootstrap_part("ratio", xy, lambda s, axis: s[..., 1].mean(axis) / s[..., 0].mean(axis))
    assert r.effect == pytest.approx(xy[:, 1].mean() / xy[:, 0].mean()) and r.ci[0] < 0.5 < r.ci[1]
    # the paired bootstrap of a statistic with itself is exactly zero, with no variation: degenerate, p undefined
    z = S.paired_bootstrap_part("0", x, x)
    assert z.effect == 0 and z.ci == (0.0, 0.0) and z.outcome == S.DEGENERATE and np.isnan(z.p)


def test_bootstrap_p_agrees_with_its_ci():
    rng = np.random.default_rng(4)
    base = rng.standard_t(5, 80)
    for shift in np.linspace(-0.6, 0.6, 13):
        for method in ("bca", "percentile"):
            p = S.bootstrap_part("m", base - base.mean() + shift, method=method, n_boot=4000)
            excludes = p.ci[0] > 0 or p.ci[1] < 0
            if abs(p.p - 0.05) > 0.005:  # away from the boundary (B resamples resolve p to about 1 / B)
                assert (p.p < 0.05) == excludes, (shift, method, p.p, p.ci)


def test_bootstrap_coverage_and_null_rates():
    """Over repeated normal samples, the 95% CI covers the true mean about 95% of the time, and a part on a true
    null is significant either way about 2.5% of the time each."""
    rng = np.random.default_rng(0)
    reps, n = 400, 60
    hits, fors, againsts = 0, 0, 0
    for r in range(reps):
        p = S.bootstrap_part("m", rng.normal(0, 1, n), n_boot=1000, seed=r)
        hits += p.ci[0] <= 0 <= p.ci[1]
        fors += p.outcome == S.FOR
        againsts += p.outcome == S.AGAINST
    assert 0.91 <= hits / reps <= 0.98, hits / reps
    assert fors / reps <= 0.05 and againsts / reps <= 0.05, (fors, againsts)
    # TOST on a bootstrap part: the mean of 256 images 0.05 +- 0.06 (SE) is within a margin of 0.3
    e = S.equivalence_part(S.bootstrap_part("m", rng.normal(0.05, 1, 256)), margin=0.3)
    assert e.outcome == S.FOR and -0.3 < e.details["ci_tost"][0] < e.details["ci_tost"][1] < 0.3


# ------------------------------------------------------------------------------------------------ the rule simulated


@pytest.mark.parametrize("design", S.DESIGNS)
def test_rule_under_the_null(design):
    """No effect: a false held and a false did not hold each at most 5% (here about 2.5% or less), for one- and
    two-part claims; 3 seeds per configuration."""
    for parts in (1, 2):
        r = S.simulate(0.0, design, parts=parts, reps=3000, seed=11)
        assert r[S.HELD] <= 0.05 and r[S.NOT_HELD] <= 0.05, (design, parts, r)
        assert r[S.NOT_HELD] >= 0.005, (design, parts, r)  # ... and the rule can reject at all (Welch: about 1.6%)
        if parts == 1:
            assert r[S.HELD] >= 0.01, (design, r)


def test_rule_power_matches_the_noncentral_t_and_the_docstring():
    reps = 3000
    r = S.simulate(2.0, "pooled", family=4, reps=reps, seed=12)[S.HELD]  # df 8, noncentrality 2 / sqrt(2/3)
    # the rule's pooled design, with its fall-back to Welch when the compared SDs differ by more than 2x (about 40%
    # of 3-vs-3 comparisons under equal SDs): 0.455 in the docstring's 20,000 claims, below the pooled t's own 0.576
    exact = ss.nct.sf(ss.t.ppf(0.975, 8), 8, 2 / np.sqrt(2 / 3))
    assert exact == pytest.approx(0.576, abs=5e-4)
    assert r == pytest.approx(0.455, abs=3 * np.sqrt(0.455 * 0.545 / reps)) and r < exact - 0.06
    print(f"power at 2 sd, pooled over 4 configurations: {r:.3f} (noncentral t of the pooled t alone {exact:.3f})")
    for design, fam, effect, doc in (
        ("welch", 2, 2.0, 0.37),
        ("welch", 2, 3.0, 0.68),
        ("pooled", 4, 3.0, 0.77),
    ):
        got = S.simulate(effect, design, family=fam, reps=1500, seed=13)[S.HELD]
        print(f"power at {effect:g} sd, {design}: {got:.3f} (docstring {doc:.2f})")
        assert got == pytest.approx(doc, abs=0.05), (design, effect, got)


# ------------------------------------------------------------------------------------------------ power and MDE


def _nct_power(ncp, df):
    return ss.nct.sf(ss.t.ppf(0.975, df), df, ncp)


def test_power_and_mde_of_t_parts_against_the_noncentral_t():
    """power_2sd: P(T'_{df, 2 seed SDs / SE} > t_{.975, df}); mde: the effect (the part's units) with 80% power."""
    v = [1.0, 2.0, 4.0, 5.0, 3.5]  # one-sample, n 5, df 4: 2 seed SDs = 2 sqrt(5) SEs
    p = S.one_sample_part("x", v)
    assert p.power_2sd == pytest.approx(_nct_power(2 * np.sqrt(5), 4), rel=1e-9)
    assert _nct_power(p.mde / p.se, 4) == pytest.approx(0.80, abs=1e-8)
    assert p.mde / p.se == pytest.approx(3.7611, abs=1e-4)  # df 4: well above the normal's 2.8016 SEs
    big = S.one_sample_part("x", np.random.default_rng(1).normal(0, 1, 4000))  # df 3999: the normal's by hand
    assert big.mde / big.se == pytest.approx(1.959964 + 0.841621, abs=2e-3)  # z_.975 + z_.80
    assert big.power_2sd == pytest.approx(1.0)  # 2 seed SDs = 126 SEs
    # the README's designs, 3 seeds each: pooled over 4 configurations (df 8) 58%, paired 29% (seeds independent)
    rng = np.random.default_rng(0)
    fam = [rng.normal(0, 1, 3) for _ in range(4)]
    fam[1] = fam[0] * 1.3 + 1  # SD ratio 1.3: stays pooled
    q = S.two_sample_part("x", fam[0], fam[1], pooled=S.pooled_sd(fam))
    assert q.test.startswith("pooled t") and q.power_2sd == pytest.approx(0.576, abs=5e-4)
    assert _nct_power(q.mde / q.se, 8) == pytest.approx(0.80, abs=1e-8)
    d = S.paired_part("d", [0.3, 1.2, 2.0], [1.0, 0.1, 0.5])
    assert d.power_2sd == pytest.approx(_nct_power(2 * np.sqrt(1.5), 2), rel=1e-9)
    assert d.power_2sd == pytest.approx(0.291, abs=5e-4)
    # JSON and the text of a part that is not significant
    doc = json.loads(json.dumps(p.to_json()))
    assert doc["power_2sd"] == pytest.approx(p.power_2sd) and doc["mde"] == pytest.approx(p.mde)
    ns = S.one_sample_part("n", [0.2, -0.5, 0.6])
    assert ns.outcome == S.NOT_SIGNIFICANT
    assert f"power at 2 SD {100 * ns.power_2sd:.0f}%, MDE {ns.mde:.2g})" in ns.summary()
    assert "power at 2 SD" in S.decide([ns]).why  # an inconclusive claim says what its parts could detect
    assert "power" not in p.summary()  # significant: the power is in the JSON, not the sentence


def test_power_matches_simulated_3_vs_3_designs():
    """20,000 simulated designs per case, true effect 2 seed SDs: the rejection rate (significant in the paper's
    direction) is within 1.5 points of power_2sd (Monte-Carlo SE about 0.35 points)."""
    rng = np.random.default_rng(5)
    n, reps = 3, 20000
    a, b = rng.normal(2.0, 1, (reps, n)), rng.normal(0.0, 1, (reps, n))
    crit = ss.t.ppf(0.975, 4)  # pooled over the two configurations: df 4
    sp = np.sqrt((a.var(1, ddof=1) + b.var(1, ddof=1)) / 2)
    pooled_rate = np.mean((a.mean(1) - b.mean(1)) / (sp * np.sqrt(2 / n)) > crit)
    part = S.two_sample_part("x", [0.0, 1.0, 2.0], [-1.0, 0.0, 1.0], pooled=S.pooled_sd([[0.0, 1.0, 2.0], [-1, 0, 1]]))
    assert part.power_2sd == pytest.approx(pooled_rate, abs=0.015) and part.power_2sd == pytest.approx(0.463, abs=1e-3)
    w = ss.ttest_ind(a, b, axis=1, equal_var=False)
    welch_rate = np.mean((w.pvalue < 0.05) & (w.statistic > 0))
    part = S.two_sample_part("x", [0.0, 1.0, 2.0], [-1.0, 0.0, 1.0])  # equal SDs: Welch df 4
    assert part.power_2sd == pytest.approx(welch_rate, abs=0.015), (part.power_2sd, welch_rate)
    assert part.power_2sd == pytest.approx(0.37, abs=0.005)  # the docstring's (and simulate's) Welch 3 vs 3
    assert part.power_2sd < _nct_power(2 / np.sqrt(2 / 3), 4) - 0.08  # Welch's own df is random: below nct's 0.463
    # paired, seeds independent: the t on d = a - b
    t = ss.ttest_rel(a, b, axis=1)
    paired_rate = np.mean((t.pvalue < 0.05) & (t.statistic > 0))
    assert S.paired_part("d", [0.3, 1.2, 2.0], [1.0, 0.1, 0.5]).power_2sd == pytest.approx(paired_rate, abs=0.015)


def test_welch_power_at_unequal_sds_and_the_mde_simulated():
    """welch_power at SDs 3 and 1, 3 vs 5 seeds, and at a part's MDE, against simulated Welch tests (20,000 each)."""
    rng = np.random.default_rng(6)
    reps, na, nb, sa, sb = 20000, 3, 5, 3.0, 1.0
    tau = np.sqrt(sa**2 / na + sb**2 / nb)
    for ncp in (1.5, 3.0):
        a, b = rng.normal(ncp * tau, sa, (reps, na)), rng.normal(0, sb, (reps, nb))
        w = ss.ttest_ind(a, b, axis=1, equal_var=False)
        rate = np.mean((w.pvalue < 0.05) & (w.statistic > 0))
        assert S.welch_power(ncp, na, nb, sa**2 / na / tau**2) == pytest.approx(rate, abs=0.015), (ncp, rate)
    # a part's MDE: a true effect of that size in those SDs is detected 80% of the time
    x, y = [10.0, 13.0, 16.0], [0.0, 1.0, 2.0, 0.5, 1.5]  # SDs 3 and 0.79
    p = S.two_sample_part("x", x, y)
    a, b = rng.normal(p.mde, np.std(x, ddof=1), (reps, 3)), rng.normal(0, np.std(y, ddof=1), (reps, 5))
    w = ss.ttest_ind(a, b, axis=1, equal_var=False)
    assert np.mean((w.pvalue < 0.05) & (w.statistic > 0)) == pytest.approx(0.80, abs=0.015)
    # the one-sample MDE, simulated: 80%
    v = [0.2, -0.5, 0.6, 0.1]
    q = S.one_sample_part("v", v)
    sim = rng.normal(q.mde, np.std(v, ddof=1), (reps, 4))
    t = ss.ttest_1samp(sim, 0.0, axis=1)
    assert np.mean((t.pvalue < 0.05) & (t.statistic > 0)) == pytest.approx(0.80, abs=0.015)


def test_bootstrap_mde_is_the_normal_approximation():
    rng = np.random.default_rng(7)
    p = S.bootstrap_part("m", rng.normal(0, 1, 100), n_boot=1000)
    assert p.mde == pytest.approx((1.959964 + 0.841621) * p.se, rel=1e-5)  # (z_.975 + z_.80) SE by hand
    assert p.power_2sd is None  # no seeds: no seed SD to state a power at
    assert S.equivalence_part(p, 0.5).mde is None  # TOST: the difference's power does not apply


# ------------------------------------------------------------------------------------------------ pooled SD check


def test_pooled_test_falls_back_to_welch_when_the_sds_differ():
    a, b = [0.0, 3.0, 6.0], [1.0, 1.5, 2.0]  # SDs 3 and 0.5: 6x
    fam = S.pooled_sd([a, b, [0.0, 1.0, 2.0]])
    p = S.two_sample_part("x", a, b, pooled=fam)
    r = ss.ttest_ind(a, b, equal_var=False)
    assert p.p == pytest.approx(r.pvalue, rel=1e-9) and p.df == pytest.approx(r.df, rel=1e-9)
    assert p.test == "Welch t (not pooled: seed SDs differ 6x > 2x)"
    assert p.details["pooled_refused"] == pytest.approx(
        {"sd_a": 3.0, "sd_b": 0.5, "ratio": 6.0, "limit": S.POOLED_SD_RATIO, "pooled_sd": fam.sd}
    )
    q = S.two_sample_part("x", [0.0, 1.0, 2.0], [1.0, 2.8, 4.6], pooled=fam)  # ratio 1.8: pooled
    assert q.test == "pooled t (3 configurations)" and "pooled_refused" not in q.details and q.df == 6


def test_the_simulation_that_motivates_the_pooled_sd_ratio():
    """The module docstring's numbers: with configuration A's seed SD 3x the family's (4 configurations, 3 seeds, no
    effect), the pooled t alone says "held" about 7.4% of the time; the fall-back to Welch brings it under 5%."""
    rng = np.random.default_rng(8)
    reps, n = 20000, 3
    x = rng.normal(0, 1, (reps, 4, n))
    x[:, 0] *= 3
    sp = np.sqrt(x.var(2, ddof=1).mean(1))
    t = (x[:, 0].mean(1) - x[:, 1].mean(1)) / (sp * np.sqrt(2 / n))
    alone = np.mean(t > ss.t.ppf(0.975, 8))
    assert 0.065 < alone < 0.085, alone
    rule = S.simulate(0.0, "pooled", family=4, reps=4000, seed=9, sd_ratio=3.0)[S.HELD]
    assert rule < 0.055, rule


# ------------------------------------------------------------------------------------------------ across claims


def test_claim_p_and_the_corrections_across_claims_by_hand():
    held2 = S.decide([_part("a", 0.01, 1.0), _part("b", 0.03, 0.5)])  # IUT: p = max = 0.03
    held1 = S.decide([_part("a", 0.001, 1.0)])
    against = S.decide([_part("a", 0.2, 1.0), _part("b", 0.01, -0.5)])  # Holm over 2: 0.02
    inconc = S.decide([_part("a", 0.01, 1.0), _part("b", 0.2, 0.3), _part("c", 0.04, -0.3)])  # c against: its p 1
    inconc2 = S.decide([_part("a", 0.01, 1.0), _part("b", 0.2, 0.3)])
    nt = S.decide([_part("a", 0.01, 1.0)], False)
    assert (held2.outcome, held1.outcome, against.outcome, inconc.outcome, nt.outcome) == (
        S.HELD,
        S.HELD,
        S.NOT_HELD,
        S.INCONCLUSIVE,
        S.NOT_TESTABLE,
    )
    assert S.claim_p(held2) == 0.03 and S.claim_p(held1) == 0.001 and S.claim_p(against) == pytest.approx(0.02)
    assert S.claim_p(inconc) == 1.0 and S.claim_p(inconc2) == 0.2 and S.claim_p(nt) is None
    assert S.claim_p(json.loads(json.dumps(against.to_json()))) == pytest.approx(0.02)  # from a study's JSON
    acc = S.across_claims({"h2": held2, "h1": held1, "x": against, "i": inconc2, "nt": nt})
    # m = 4 tested; sorted 0.001, 0.02, 0.03, 0.2. Holm: x4, x3, x2, x1 -> 0.004, 0.06, 0.06, 0.2 (running max)
    # BH: min over j >= i of 4 p_(j) / j -> 0.2, 0.04, 0.04, 0.004
    c = acc["claims"]
    assert set(c) == {"h2", "h1", "x", "i"} and acc["tested"] == 4
    assert [c[k]["holm_p"] for k in ("h1", "x", "h2", "i")] == pytest.approx([0.004, 0.06, 0.06, 0.2])
    assert [c[k]["bh_q"] for k in ("h1", "x", "h2", "i")] == pytest.approx([0.004, 0.04, 0.04, 0.2])
    assert c["h1"]["held_after_holm"] and not c["h2"]["held_after_holm"] and c["h2"]["held_after_bh"]
    assert not c["x"]["held_after_bh"] and c["x"]["verdict"] == S.NOT_HELD
    assert (acc["held"], acc["held_after_holm"], acc["held_after_bh"]) == (2, 1, 2) and acc["alpha"] == 0.05
    ps = [0.001, 0.02, 0.03, 0.2]
    assert [c[k]["bh_q"] for k in ("h1", "x", "h2", "i")] == pytest.approx(ss.false_discovery_control(ps))
    empty = S.across_claims({"nt": nt})
    assert empty["tested"] == 0 and empty["claims"] == {} and empty["held_after_bh"] == 0


def test_tost_power_against_direct_integration_and_simulation():
    """The equivalence part's power (true difference 0) against scipy's quad of the defining integral (one variance
    estimate) and against simulated TOST decisions of the parts themselves (Welch and one-sample)."""
    from scipy import integrate, stats

    df, m = 4, 2.2
    t = stats.t.ppf(0.95, df)
    direct = integrate.quad(
        lambda u: max(0.0, 2 * stats.norm.cdf(m - t * np.sqrt(u / df)) - 1) * stats.chi2.pdf(u, df),
        0,
        df * (m / t) ** 2,
    )[0]
    assert S.tost_power(m, df) == pytest.approx(direct, abs=1e-7)
    assert S.tost_power(0.0, df) == 0.0 and S.tost_power(50.0, df) == pytest.approx(1.0, abs=1e-6)
    rng = np.random.default_rng(11)
    reps = 3000
    for make, margin, want in (
        (lambda: S.two_sample_part("d", rng.normal(0, 1, 3), rng.normal(0, 2, 3)), 3.0, ("welch", (1.0, 4.0), (3, 3))),
        (lambda: S.one_sample_part("d", rng.normal(0, 1, 5)), 1.0, ("one", (1.0,), (5,))),
    ):
        hits = sum(S.equivalence_part(make(), margin).outcome == S.FOR for _ in range(reps))
        kind, var, n = want
        power = S._Design(kind, var, n, n[0] - 1).power(margin, S.ALPHA)
        assert abs(hits / reps - power) < 4 * np.sqrt(power * (1 - power) / reps) + 0.003, (kind, hits / reps, power)


def test_equivalence_part_states_its_power_margin_and_the_seeds_it_needs():
    """The registers study's first k-NN seeds (3 vs 3) at +-0.01: power 3%, the margin shown with 80% power about 0.038,
    23 seeds needed; the seeds needed are the fewest with 80% power (one fewer has less); the numbers reach the JSON and
    the sentence of a non-significant part; a bootstrap part gets the normal approximation and no seeds."""
    a, b = [0.865234375, 0.865625, 0.855859375], [0.880078125, 0.863671875, 0.85078125]
    e = S.equivalence_part(S.two_sample_part("k-NN", a, b), 0.01)
    d = e.equivalence
    assert d["power_equivalence"] == pytest.approx(0.026, abs=0.005)
    assert d["margin_80"] == pytest.approx(0.038, abs=0.001)
    n = d["seeds_needed"]
    assert n == 23
    des = e._design
    assert des.power(0.01, S.ALPHA, (n, n)) >= 0.8 > des.power(0.01, S.ALPHA, (n - 1, n - 1))
    assert des.power(d["margin_80"], S.ALPHA) == pytest.approx(0.8, abs=1e-6)
    assert "23 seeds per configuration" in e.summary() and "power to show equivalence" in e.summary()
    assert e.to_json()["details"]["seeds_needed"] == 23
    boot = S.equivalence_part(S.bootstrap_part("m", np.random.default_rng(0).normal(0, 1, 256)), 0.05)
    se = boot.se
    assert "seeds_needed" not in boot.equivalence
    assert boot.equivalence["power_equivalence"] == pytest.approx(
        max(0.0, 2 * stats_norm_cdf(0.05 / se - 1.6448536) - 1), abs=1e-6
    )


def stats_norm_cdf(x):
    from scipy.stats import norm

    return float(norm.cdf(x))


def test_a_bootstrap_without_image_to_image_variation_is_degenerate_not_p_1_or_p_floor():
    """Every image the same value: no resample differs from the estimate, so the bootstrap tests nothing; the part is
    degenerate (p undefined, not the 1 of a zero effect nor the 1 / B of a non-zero one) and the claim not testable,
    for one sample, a paired difference and grouped images alike."""
    for part in (
        S.bootstrap_part("zero", np.zeros(40)),
        S.bootstrap_part("const", np.full(40, 0.3), sign=-1),
        S.paired_bootstrap_part("paired", np.full(40, 0.3), np.full(40, 0.3)),
        S.bootstrap_part("grouped", np.full(40, 0.1), groups=np.repeat(np.arange(8), 5)),
    ):
        assert part.outcome == S.DEGENERATE and np.isnan(part.p) and part.p_reversal == 1.0, part.summary()
        assert part.to_json()["p"] is None
        assert S.decide([part]).outcome == S.NOT_TESTABLE
    assert S.bootstrap_part("const", np.full(40, 0.3), sign=-1).effect == pytest.approx(-0.3)
    # one image that differs is enough to test again
    v = np.full(40, 0.3)
    v[0] = 0.31
    assert S.bootstrap_part("almost", v).outcome != S.DEGENERATE


def test_magnitude_says_whether_the_papers_number_is_inside_our_interval():
    """Raghu Fig. 8's 4-point drop against a drop of 0.54 points [-0.49, +1.58] (the committed reproduction's block 3,
    re-made with seeds whose pooled t gives that interval): outside, with the t's p at the paper's value; a paper value
    inside the CI is said to be consistent; the p is the two-sided t p of effect = paper (scipy's one-sample t on the
    shifted data)."""
    from scipy import stats as ss

    a, b = np.array([0.861, 0.868, 0.871]), np.array([0.858, 0.864, 0.862])
    part = S.two_sample_part("block 3 top-1 drop", a, b)
    m = S.magnitude(part, 0.04, " points", 100)
    assert not m["inside_ci"] and "outside our 95% CI" in m["sentence"] and "+4 points" in m["sentence"]
    want = ss.ttest_ind(a - 0.04, b, equal_var=False).pvalue
    assert m["p"] == pytest.approx(want, rel=1e-6)
    near = S.magnitude(part, part.effect + 0.1 * (part.ci[1] - part.effect), " points", 100)
    assert near["inside_ci"] and near["p"] > 0.05 and "consistent" in near["sentence"]
    one = S.one_sample_part("x", [1.0, 2.0, 3.0, 4.0])
    assert S.magnitude(one, 2.0)["p"] == pytest.approx(ss.ttest_1samp([1.0, 2.0, 3.0, 4.0], 2.0).pvalue, rel=1e-6)
