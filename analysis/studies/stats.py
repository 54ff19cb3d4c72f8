"""The one statistical decision rule of the studies: per-part tests with confidence intervals, and a claim's verdict.

A claim of a paper is tested in one or more *parts*; each part is one number in the paper's direction (an effect), a
two-sided test of "no effect" at :data:`ALPHA` = 0.05 and the matching 95% confidence interval (CI). :func:`decide`
turns a claim's parts and its preconditions into one of four outcomes (the constants :data:`HELD`, :data:`NOT_HELD`,
:data:`INCONCLUSIVE`, :data:`NOT_TESTABLE`, which analysis/studies/claims.py uses too):

``held``          every part is significant in the paper's direction (p < ALPHA, each part unadjusted: a conjunction
                  of tests each at level ALPHA is a test of the whole claim at level ALPHA, the intersection-union
                  principle, so no multiplicity correction is needed for "held");
``did not hold``  the preconditions passed and some part is significantly *reversed* after Holm's correction over the
                  claim's parts (:func:`holm`; Holm-adjusted p < ALPHA, effect against the paper);
``inconclusive``  neither;
``not testable``  a precondition failed (:class:`Precondition`: its sentence with its numbers); parts are still shown.
                  Also a claim with a :data:`DEGENERATE` part (below) and no part significantly reversed.

Parts (:class:`Part`; ``sign`` = +1 when the paper says a > b, -1 when it says a < b; the part's ``effect`` and ``ci``
are on that signed scale, so a positive effect is in the paper's direction):

* :func:`paired_part` -- seed i of configuration A paired with seed i of B (same seed, same analysis images):
  d_i = a_i - b_i, effect = sign x mean(d), SE = sd(d) / sqrt(n) (sd with n - 1), t on df = n - 1 (scipy's
  ``ttest_rel``).
* :func:`two_sample_part` -- A and B as independent samples of seeds. Default Welch: SE = sqrt(s_a^2/n_a + s_b^2/n_b),
  df by Welch-Satterthwaite, (s_a^2/n_a + s_b^2/n_b)^2 / ((s_a^2/n_a)^2/(n_a-1) + (s_b^2/n_b)^2/(n_b-1)) (scipy's
  ``ttest_ind(equal_var=False)``); for configurations whose seed SD differs, e.g. a ViT against a ResNet. With
  ``pooled=pooled_sd(family)``: SE = s_p sqrt(1/n_a + 1/n_b) on the family's df -- for configurations of one family
  (same architecture and recipe, only the factor under study changed), whose seed SD is assumed equal; every
  configuration of the family adds its n_g - 1 degrees of freedom at no extra training. When the two compared
  groups' seed SDs differ by more than :data:`POOLED_SD_RATIO` = 2 (larger / smaller), the equal-SD assumption
  visibly fails and the part falls back to Welch (test "Welch t (not pooled: ...)", ``details["pooled_refused"]``
  with both SDs and the ratio). Why: with configuration A's seed SD 3x the family's (4 configurations, 3 seeds, no
  effect), the pooled t alone says "held" 7.4% of the time (2x: 5.1%); the false held rate and the power (held at
  2 sigma, equal SDs) by the ratio R beyond which the part falls back (200,000 claims each):

  ============  ==================  ==================  ==================  =======================
  R             null, equal SDs     null, A's SD 2x     null, A's SD 3x     power, 2 sigma (falls)
  ============  ==================  ==================  ==================  =======================
  never         2.5%                5.1%                7.4%                57% (0%)
  4             2.3%                4.6%                6.0%                54% (12%)
  3             2.1%                4.1%                5.3%                51% (20%)
  2 (chosen)    1.9%                3.4%                4.1%                45% (40%)
  ============  ==================  ==================  ==================  =======================

  With 3 seeds a sample SD ratio is a weak detector (under equal SDs the ratio of two 3-seed SDs exceeds 2 in 40% of
  comparisons, when the fall-back costs power); R = 2 is the only one of these that keeps the false held rate under
  5% at a 3x SD ratio. With 2 configurations (family 2) the pooled t with equal n is robust: 3.7% false held at 3x.
* :func:`one_sample_part` -- one configuration's seed values against a reference: effect = sign x (mean - ref),
  SE = s / sqrt(n) (or s_p / sqrt(n) with ``pooled``), df = n - 1 (or the pooled df).
* :func:`pooled_sd` -- s_p = sqrt(sum_g sum_i (x_gi - mean_g)^2 / sum_g (n_g - 1)), df = sum_g (n_g - 1).
* :func:`bootstrap_part` / :func:`paired_bootstrap_part` -- for a statistic of one run (one model), a bootstrap over
  the analysis images: B resamples of the N images with replacement (seeded ``numpy.random.default_rng(seed)``), the
  statistic recomputed on each; the paired variant resamples the same images for both statistics and bootstraps their
  difference. When the images are not independent (crops of a few photos), ``groups`` names each image's independent
  unit and the bootstrap resamples whole groups, each with all its images (the cluster bootstrap, Davison & Hinkley
  1997 Sec. 3.8), the jackknife below leaving out one group at a time; the CI is then about the population the groups
  come from, and an image-level CI over clustered images is too narrow. CI: BCa (default; Efron & Tibshirani 1993
  ch. 14: bias correction z0 = Phi^-1(share of resampled statistics below the estimate, ties counted half),
  acceleration a = sum(d^3) / (6 (sum(d^2))^1.5) with d the jackknife deviations mean(theta_(.)) - theta_(i)), or the
  percentile interval (``method="percentile"``).
  p: the two-sided p-value obtained by inverting the same interval (the level at which the interval's end reaches 0),
  so p < ALPHA exactly when the CI excludes 0, up to the resolution of B resamples; p is at least 1 / B.
* :func:`equivalence_part` -- a claim of *no difference*: two one-sided tests (TOST) of any of the parts above
  against a margin +-m written down before the run. p_TOST = max(p of "effect <= -m", p of "effect >= m"); significant
  for (equivalent) when p_TOST < ALPHA, i.e. the 90% CI lies inside (-m, m); significant against (a difference beyond
  the margin, the "reversal" Holm sees) when 2 x min(p of "effect <= m", p of "effect >= -m") < ALPHA, i.e. the 95% CI
  lies outside [-m, m]. The stored ``ci`` is the 95% CI, ``details["ci_tost"]`` the 90% one.

t parts: CI = effect +- t_{1 - ALPHA/2, df} x SE; p = 2 P(T_df > |effect| / SE); p < ALPHA exactly when the CI
excludes 0. With SE = 0 (no seed-to-seed variation at all: every seed gives the same value) no test is possible: the
part's outcome is :data:`DEGENERATE`, its p undefined (NaN; null in JSON, never 0), its CI the point, its
``p_reversal`` 1; :func:`decide` lets it support neither held nor did not hold (see there).

Power and the minimum detectable effect (MDE) of each part (``Part.power_2sd``, ``Part.mde``; in its JSON; shown in
the sentence of a part that is not significant, so an inconclusive claim says what it could have detected):
``power_2sd`` is the probability that the part's test comes out significant in the paper's direction (what "held"
needs; the other side's rejections, below 0.1% here, are not counted) when the true effect is :data:`POWER_SDS` = 2
seed SDs, with the part's own n and df; ``mde`` the smallest true effect, in the part's units, with
:data:`POWER_TARGET` = 80% power (Brent's root of the power, times the part's SE). For the t parts the power is the
noncentral t's, P(T'_{df, ncp} > t_{1 - ALPHA/2, df}) (:func:`t_power`), with ncp = 2 sigma / SE: one-sample
2 sqrt(n), pooled two-sample 2 / sqrt(1/n_a + 1/n_b), paired 2 sqrt(n / 2) (the seed SD sigma = sd(d) / sqrt(2),
as when the two configurations' seeds are independent; correlated seeds make the pairing stronger, which the MDE,
from the part's own SE, shows). Welch's statistic is not noncentral t (its df is random), so Welch parts get its exact
power (:func:`welch_power`, quadrature over the two sample variances) at the observed SD ratio, with sigma the RMS of
the two seed SDs. 3 seeds per configuration: Welch 37%, pooled over 4 configurations 58% (df 8; 46% over 2), paired
29% -- the pooled t's own power, before the fall-back to Welch above. Bootstrap parts: MDE by the normal
approximation with the bootstrap SE, (z_{1 - ALPHA/2} + z_0.8) SE = 2.80 SE (:func:`normal_mde`); no power at 2 seed
SDs (a bootstrap over one run's images has no seeds). Degenerate parts: neither. Equivalence parts (their
``Part.equivalence``, in the JSON's ``details``, and the sentence when not significant): ``power_equivalence``, the
power of the TOST to show equivalence when the true difference is 0 (:func:`tost_power`, exact for one variance
estimate, Welch by quadrature; a bootstrap part by the normal approximation), ``margin_80``, the smallest margin the
design shows with 80% power, and for a t part ``seeds_needed``, the seeds per configuration the margin needs at the
observed seed SDs (a planning figure). The registers study's +-0.01 k-NN margin with 3 seeds: at the seed SDs of its
first runs power 3%, margin with 80% power +-0.038, 23 seeds needed; at those of its rerun (SDs ~5x smaller) 84%.

Across claims (:func:`across_claims`, the study JSON's ``across_claims``): each claim is judged at ALPHA on its own;
over a study's tested claims (held, did not hold, inconclusive; sanity checks left out) each claim's p
(:func:`claim_p`: the largest part p of a held claim, the smallest Holm-adjusted reversal p of one that did not hold,
the largest part p in the paper's direction of an inconclusive one) is adjusted by Holm (family-wise error rate) and
by Benjamini-Hochberg (false discovery rate); the report says how many held claims survive each.

Error rates and power (measured by :func:`simulate`: synthetic seeds, normal with the same SD sigma in every
configuration, 20,000 claims per cell, seed 0; 3 seeds per configuration, the studies' default; a 1-part claim, and a
2-part claim whose two parts are independent and have the same effect). Under the null (no effect), the rate of a
false "held" and of a false "did not hold" (the Monte-Carlo SE of a rate near 2.5% is 0.11 points):

==============================  ========================  ===============================
design (df)                     false held, 1 / 2 part    false did not hold, 1 / 2 part
==============================  ========================  ===============================
Welch 3 vs 3 (2 to 4)           1.7% / 0.03%              1.8% / 1.6%
pooled, 4 configurations (8)    2.0% / 0.03%              1.9% / 1.9%
paired, 3 pairs (2)             2.4% / 0.03%              2.5% / 2.5%
==============================  ========================  ===============================

Power, the rate of "held" when the paper is right by 2 or 3 seed SDs (mean A - mean B = 2 sigma or 3 sigma):

==============================================  ===================  ===================
design (df)                                     2 sigma, 1 / 2 part  3 sigma, 1 / 2 part
==============================================  ===================  ===================
Welch 3 vs 3 (2 to 4)                           37% / 14%            68% / 45%
pooled, 2 configurations (4)                    39% / 15%            70% / 48%
pooled, 4 configurations (8)                    46% / 21%            77% / 58%
pooled, 8 configurations (16)                   49% / 24%            78% / 61%
paired, 3 pairs, seeds independent (2)          29% / 8%             51% / 26%
==============================================  ===================  ===================

The pooled rows include the fall-back to Welch when the two compared seed SDs differ by more than 2x (40% of the
comparisons with 3 seeds each, under equal SDs); the pooled t alone has the exact power of the noncentral t,
P(T'_{df, delta / sqrt(2/3)} > t_{0.975, df}): 0.463, 0.576, 0.633 at 2 sigma and 0.783, 0.894, 0.931 at 3 sigma
(each pooled part's ``power_2sd``; tests/studies/test_stats.py checks them against simulated designs).
Welch is conservative with 3 seeds (its df falls towards 2 when one sample happens to vary less). For comparison, the
rule this replaces (an effect counts beyond 2x the largest seed-to-seed difference, analysis/studies/claims.py), in
the same simulation (200,000 claims): with 2 seeds a true null is held 3.5% and did not hold 3.5%, power 29% at
2 sigma and 49% at 3 sigma; with 3 seeds 0.25% each, power 9% and 24%. The paired design is the weakest with 3 seeds
(df 2): pair only when the seeds of the two configurations are correlated (the pairing then removes the shared part);
pooling the family's seed SD is the cheapest power, and more seeds per configuration keep it from falling back.

Everything is numpy + scipy (``scipy.special.stdtr`` / ``stdtrit`` for the t distribution, ``ndtr`` / ``ndtri`` for the
normal); nothing is read from files. ``python -m analysis.studies.stats`` prints the tables above.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import lru_cache

import numpy as np
from scipy.special import ndtr, ndtri, roots_genlaguerre, stdtr, stdtrit

HELD, NOT_HELD, INCONCLUSIVE, NOT_TESTABLE = "held", "did not hold", "inconclusive", "not testable"
OUTCOMES = (HELD, NOT_HELD, INCONCLUSIVE, NOT_TESTABLE)
FOR, AGAINST, NOT_SIGNIFICANT = "significant for", "significant against", "not significant"  # one part's outcome
DEGENERATE = "degenerate"  # one part's outcome: no seed-to-seed variation at all, so no test (p undefined)
ALPHA = 0.05  # two-sided test level of every part; the CIs are 1 - ALPHA = 95%
POWER_SDS = 2.0  # Part.power_2sd: the power when the paper is right by this many seed SDs
POWER_TARGET = 0.80  # Part.mde: the smallest true effect detected with this power
POOLED_SD_RATIO = 2.0  # a pooled test whose two groups' seed SDs differ by more than this factor falls back to Welch
N_BOOT = 2000  # bootstrap resamples by default
_CHUNK = 1 << 22  # bootstrap: at most this many resampled values in memory at once
_METHOD = {"bca": "BCa", "percentile": "percentile"}


# ------------------------------------------------------------------------------------------------ the distributions


class _T:
    """The sampling distribution of an estimate: est + SE x T_df (SE = 0: the point est)."""

    floor = 0.0  # the smallest p-value it can give

    def __init__(self, est: float, se: float, df: float):
        self.est, self.se, self.df = float(est), float(se), float(df)

    def level(self, c: float) -> float:
        """One-sided p-value of H0: theta <= c against theta > c."""
        if self.se == 0:
            return 0.5 if self.est == c else 0.0 if self.est > c else 1.0
        return float(stdtr(self.df, (c - self.est) / self.se))

    def interval(self, alpha: float) -> tuple[float, float]:
        """The two-sided 1 - alpha CI: est +- t_{1 - alpha/2, df} SE."""
        h = 0.0 if self.se == 0 else float(stdtrit(self.df, 1 - alpha / 2)) * self.se
        return self.est - h, self.est + h


class _Boot:
    """A bootstrap distribution ``boot`` of an estimate ``est`` (percentile or BCa with bias ``z0`` and acceleration
    ``a``)."""

    def __init__(self, est: float, boot: np.ndarray, method: str, z0: float = 0.0, a: float = 0.0):
        self.est, self.boot, self.method, self.z0, self.a = float(est), np.sort(boot), method, float(z0), float(a)
        self.floor = 1.0 / len(boot)  # the resolution of B resamples

    def _share_below(self, c: float) -> float:
        """Share of resampled statistics below c, ties counted half, kept within [0.5 / B, 1 - 0.5 / B]."""
        b = len(self.boot)
        q = (np.searchsorted(self.boot, c, "left") + np.searchsorted(self.boot, c, "right")) / (2 * b)
        return float(np.clip(q, 0.5 / b, 1 - 0.5 / b))

    def level(self, c: float) -> float:
        """One-sided p-value of H0: theta <= c: the level at which the interval's lower end reaches c."""
        q = self._share_below(c)
        if self.method == "percentile":
            return q
        w = float(ndtri(q)) - self.z0  # invert q = Phi(z0 + (z0 + z) / (1 - a (z0 + z))) for z
        den = 1 + self.a * w
        u = w / den if den > 0 else np.copysign(np.inf, w)
        return float(ndtr(u - self.z0))

    def interval(self, alpha: float) -> tuple[float, float]:
        z = ndtri(np.array([alpha / 2, 1 - alpha / 2]))
        if self.method == "percentile":
            lv = np.array([alpha / 2, 1 - alpha / 2])
        else:
            u = self.z0 + z
            den = 1 - self.a * u
            lv = np.where(den > 0, ndtr(self.z0 + u / np.where(den > 0, den, 1.0)), np.where(u > 0, 1.0, 0.0))
        lo, hi = np.quantile(self.boot, lv)
        return float(lo), float(hi)


# ------------------------------------------------------------------------------------------------ one part


@dataclass(frozen=True)
class Part:
    """One part of a claim: ``effect`` in the paper's direction (``sign`` x the raw estimate), its 1 - ALPHA ``ci``, the
    two-sided ``p`` of "no effect" (for an equivalence part, the TOST p), the ``test`` with its ``df`` (None for a
    bootstrap) and SE, ``n`` per group (seeds, or images), and ``outcome`` (:data:`FOR` / :data:`AGAINST` /
    :data:`NOT_SIGNIFICANT` at ``alpha``, unadjusted; :data:`DEGENERATE` without seed variation, p NaN).
    ``p_reversal`` is the p-value Holm's correction sees (:func:`decide`): ``p`` for a difference, the p of "beyond
    the margin" for an equivalence part. :attr:`power_2sd` and :attr:`mde` (in :meth:`to_json`) say what the test could
    detect (see the module docstring)."""

    name: str
    effect: float
    ci: tuple[float, float]
    p: float
    outcome: str
    test: str
    n: tuple[int, ...]
    df: float | None = None
    se: float | None = None
    sign: int = 1
    alpha: float = ALPHA
    p_reversal: float | None = None
    margin: float | None = None
    details: dict = field(default_factory=dict)
    _dist: object = field(default=None, repr=False, compare=False)
    _power: object = field(default=None, repr=False, compare=False)  # (power_2sd, mde), or a function giving them
    _design: object = field(default=None, repr=False, compare=False)  # a t part's _Design (equivalence power)
    _equiv: object = field(default=None, repr=False, compare=False)  # equivalence power: dict, or function giving it

    def __post_init__(self):
        if self.p_reversal is None:
            object.__setattr__(self, "p_reversal", self.p)

    def _power_pair(self) -> tuple:
        """(power_2sd, mde), computed on first use (Welch's exact power costs milliseconds; :func:`simulate` builds
        parts by the ten thousand and never reads it)."""
        pw = self._power
        if callable(pw):
            pw = tuple(pw())
            object.__setattr__(self, "_power", pw)
        return pw or (None, None)

    @property
    def equivalence(self) -> dict:
        """An equivalence part's ``power_equivalence``, ``margin_80`` and (t parts) ``seeds_needed``
        (:func:`equivalence_part`), computed on first use (the seeds search takes a fraction of a second); {} for
        other parts. In the JSON they join ``details``."""
        eq = self._equiv
        if callable(eq):
            eq = eq()
            object.__setattr__(self, "_equiv", eq)
        return eq or {}

    @property
    def power_2sd(self) -> float | None:
        """The probability that this part's test comes out significant in the paper's direction when the true effect
        is :data:`POWER_SDS` = 2 seed SDs, with the part's own n and df (:func:`t_power`, :func:`welch_power`; see
        the module docstring); None for a bootstrap (no seeds), an equivalence or a degenerate part."""
        return self._power_pair()[0]

    @property
    def mde(self) -> float | None:
        """The minimum detectable effect: the smallest true effect, in the part's units, that its test detects with
        :data:`POWER_TARGET` = 80% power (t parts: :func:`t_power` / :func:`welch_power` solved by brentq, times
        the part's SE; bootstrap parts: :func:`normal_mde`); None for an equivalence or a degenerate part."""
        return self._power_pair()[1]

    def summary(self) -> str:
        """One line: name, effect, CI, p and the test; for a part that is not significant, also its power and MDE
        (:meth:`power_text`), what its non-significance is worth."""
        df = f", df {self.df:.3g}" if self.df is not None else ""
        m = f", margin +-{self.margin:.3g}" if self.margin is not None else ""
        p = f"p = {self.p:.2g}" if np.isfinite(self.p) else "p undefined"
        power = f"; {self.power_text()}" if self.outcome == NOT_SIGNIFICANT and self.power_text() else ""
        return (
            f"{self.name}: {self.effect:+.3g}, {100 * (1 - self.alpha):g}% CI [{self.ci[0]:+.3g}, {self.ci[1]:+.3g}], "
            f"{p} ({self.test}{df}{m}; {self.outcome}{power})"
        )

    def power_text(self) -> str:
        """E.g. "power at 2 SD 37%, MDE 0.8" (the MDE in the part's units); for an equivalence part, e.g. "power to
        show equivalence if the true difference is 0: 3%; margin shown with 80% power +-0.038; +-0.01 needs 23 seeds
        per configuration" (:func:`equivalence_part`); empty when nothing is known."""
        if self.margin is not None:
            return _equivalence_text(self.equivalence, self.margin)
        out = []
        if self.power_2sd is not None and np.isfinite(self.power_2sd):
            out.append(f"power at {POWER_SDS:g} SD {100 * self.power_2sd:.0f}%")
        if self.mde is not None and np.isfinite(self.mde):
            out.append(f"MDE {self.mde:.2g}")
        return ", ".join(out)

    def to_json(self) -> dict:
        """The part as plain JSON types (non-finite numbers as None)."""
        return _plain(
            {
                "name": self.name,
                "effect": self.effect,
                "ci": list(self.ci),
                "p": self.p,
                "outcome": self.outcome,
                "test": self.test,
                "n": list(self.n),
                "df": self.df,
                "se": self.se,
                "sign": self.sign,
                "alpha": self.alpha,
                "p_reversal": self.p_reversal,
                "margin": self.margin,
                "power_2sd": self.power_2sd,
                "mde": self.mde,
                "details": {**self.details, **self.equivalence},
            }
        )


def _from_dist(
    name: str,
    dist,
    test: str,
    n: tuple,
    sign: int,
    alpha: float,
    df=None,
    se=None,
    details=None,
    power=None,
    design=None,
) -> Part:
    """The two-sided test of "effect = 0" read from ``dist``: significant for when "effect <= 0" is rejected at
    alpha / 2, against when "effect >= 0" is (the side follows the test, as the CI does, not the estimate's sign).
    ``power``: (power_2sd, mde) of a t part, or a function giving them (computed on first use); without it, a part
    with an SE and no df (a bootstrap) gets the normal approximation's MDE (:func:`normal_mde`) and no power at 2
    seed SDs (it has no seeds)."""
    lv = dist.level(0.0)
    p = max(dist.floor, min(1.0, 2 * min(lv, 1 - lv)))
    outcome = NOT_SIGNIFICANT if p >= alpha or lv == 0.5 else FOR if lv < 0.5 else AGAINST
    if power is None and df is None and se is not None and se > 0:
        power = (None, normal_mde(se, alpha))
    return Part(
        name,
        dist.est,
        dist.interval(alpha),
        p,
        outcome,
        test,
        tuple(int(k) for k in n),
        df=df,
        se=se,
        sign=sign,
        alpha=alpha,
        details=details or {},
        _dist=dist,
        _power=power,
        _design=design,
    )


# ------------------------------------------------------------------------------------------------ power and MDE


def t_power(ncp: float, df: float, alpha: float = ALPHA) -> float:
    """The power of a part's two-sided t test at ``alpha`` to come out significant in the paper's direction (what
    "held" needs) when the true effect is ``ncp`` true SEs: P(T'_{df, ncp} > t_{1 - alpha/2, df}), T' the noncentral
    t (scipy.stats.nct; e.g. Cohen 1988, Statistical Power Analysis, ch. 2). The other side's rejections (against,
    P(T' < -t), below 0.1% at 2 seed SDs with 3 seeds) are not counted."""
    from scipy.stats import nct  # scipy.stats takes a second to import: only when a power is asked for

    return float(nct.sf(stdtrit(df, 1 - alpha / 2), df, ncp))


_NODES = 32  # Gauss-Laguerre nodes per sample variance in welch_power


_TOST_NODES = 128  # Gauss-Laguerre nodes per sample variance in tost_power (Welch)


@lru_cache(maxsize=64)
def _laguerre(k: float, nodes: int = _NODES) -> tuple[np.ndarray, np.ndarray]:
    """Nodes s^2 / sigma^2 = U / k (U ~ chi^2_k, U = 2x with x ~ Gamma(k/2): weight x^(k/2 - 1) e^-x) and weights."""
    x, w = roots_genlaguerre(nodes, k / 2 - 1)
    return 2 * x / k, w / w.sum()


def _welch(n_a: int, n_b: int, share_a: float, alpha: float) -> Callable[[float], float]:
    """Welch's power as a function of ncp for fixed groups: the critical values t_{1 - alpha/2, nu} SE / tau on the
    quadrature grid are computed once (the inverse t is the costly part)."""
    ks = (n_a - 1, n_b - 1)
    if min(ks) < 1:
        raise ValueError(f"Welch's test needs two seeds per group, got {n_a} and {n_b}")
    (ua, wa), (ub, wb) = _laguerre(ks[0]), _laguerre(ks[1])
    va, vb = share_a * ua[:, None], (1 - share_a) * ub[None, :]
    nu = (va + vb) ** 2 / (va**2 / ks[0] + vb**2 / ks[1])
    thr = stdtrit(nu, 1 - alpha / 2) * np.sqrt(va + vb)
    return lambda ncp: float(wa @ ndtr(ncp - thr) @ wb)


def welch_power(ncp: float, n_a: int, n_b: int, share_a: float = 0.5, alpha: float = ALPHA) -> float:
    """The exact power of Welch's test (significant in the paper's direction at two-sided ``alpha``) when the true
    effect is ``ncp`` true SEs, tau = sqrt(sigma_a^2/n_a + sigma_b^2/n_b), and ``share_a`` = (sigma_a^2/n_a) / tau^2.
    Welch's statistic is no noncentral t: its SE and df are random. With the mean difference X ~ N(ncp tau, tau^2)
    independent of the sample variances s_g^2 = sigma_g^2 U_g / k_g (U_g ~ chi^2 with k_g = n_g - 1 df), power =
    E[Phi(ncp - t_{1 - alpha/2, nu(U)} SE(U) / tau)], SE^2 / tau^2 = w U_a / k_a + (1 - w) U_b / k_b, nu the
    Welch-Satterthwaite df; the expectation over (U_a, U_b) by generalised Gauss-Laguerre quadrature (32 x 32 nodes).
    3 vs 3 seeds of equal SD at 2 seed SDs (ncp = 2 / sqrt(2/3)): 0.37, as :func:`simulate` finds."""
    return _welch(n_a, n_b, float(share_a), alpha)(ncp)


def _solve_mde(power: Callable[[float], float]) -> float:
    """The effect (in the units ``power`` takes) with :data:`POWER_TARGET` power, by Brent's method (brentq)."""
    from scipy.optimize import brentq

    hi = 4.0
    while power(hi) < POWER_TARGET:
        hi *= 2
        if hi > 1e4:
            return float("nan")
    return float(brentq(lambda m: power(m) - POWER_TARGET, 0.0, hi, xtol=1e-9))


def normal_mde(se: float, alpha: float = ALPHA) -> float:
    """A bootstrap part's minimum detectable effect by the normal approximation with the bootstrap SE:
    (z_{1 - alpha/2} + z_{POWER_TARGET}) SE (2.80 SE at 5% and 80%). A bootstrap over one run's images has no seed
    SD, so it gets no power at 2 seed SDs."""
    return float((ndtri(1 - alpha / 2) + ndtri(POWER_TARGET)) * se)


@lru_cache(maxsize=4096)
def _t_power(df: float, alpha: float, sd_per_se: float) -> tuple[float, float]:
    """(power at :data:`POWER_SDS` seed SDs, MDE in SEs) of a t part with noncentral t power: the effect of 2 seed SDs
    is 2 ``sd_per_se`` true SEs; the MDE is the ncp with 80% power (times the part's SE: :func:`_t_part`)."""
    return t_power(POWER_SDS * sd_per_se, df, alpha), _solve_mde(lambda m: t_power(m, df, alpha))


def _values(x, what: str, name: str, least: int = 1) -> np.ndarray:
    v = np.asarray(x, dtype=float).reshape(-1)
    if v.size < least:
        raise ValueError(
            f"part {name!r}: {what} has {v.size} value(s), the test needs at least {least}; "
            "run more seeds or mark the claim not testable with a Precondition"
        )
    bad = int((~np.isfinite(v)).sum())
    if bad:
        raise ValueError(
            f"part {name!r}: {bad} of {v.size} values of {what} are not finite; drop the failed seeds or "
            "mark the claim not testable with a Precondition"
        )
    return v


def _sign(sign) -> int:
    if sign not in (1, -1):
        raise ValueError(f"sign must be +1 (the paper says a > b) or -1 (a < b), not {sign!r}")
    return int(sign)


def _t_part(name, est, se, df, test, n, sign, alpha, details, sd_per_se, power=None, design=None) -> Part:
    """A t part; ``sd_per_se``: one seed SD in SEs (sqrt(n) for a one-sample mean, 1 / sqrt(1/n_a + 1/n_b) for a
    difference of means, sqrt(n / 2) for a paired difference of independent seeds), for the power at 2 seed SDs;
    ``power``: a function giving (power_2sd, mde), from the caller (Welch); both are computed on first use. SE = 0
    (every seed equal): a :data:`DEGENERATE` part."""
    sign = _sign(sign)
    if se == 0:
        return _degenerate(name, sign * est, test, n, sign, alpha, df, details)

    def t_power_mde() -> tuple[float, float]:
        pw, m = _t_power(float(df), alpha, float(sd_per_se))
        return pw, m * float(se)

    power = power or t_power_mde
    dist = _T(sign * est, se, df)
    return _from_dist(
        name, dist, test, n, sign, alpha, df=float(df), se=float(se), details=details, power=power, design=design
    )


def _degenerate(name, effect, test, n, sign, alpha, df, details, unit: str = "seed") -> Part:
    """A part whose seeds do not vary at all (SE = 0): no test is possible -- p undefined (NaN, null in JSON), the CI
    the point, p_reversal 1 (Holm counts it, it never rejects), outcome :data:`DEGENERATE`; :func:`decide` does not
    let it support held or did not hold. A bootstrap whose resamples all give the estimate (no image-to-image
    variation) is degenerate the same way (``df`` None)."""
    e = float(effect)
    return Part(
        name,
        e,
        (e, e),
        float("nan"),
        DEGENERATE,
        test,
        tuple(int(k) for k in n),
        df=None if df is None else float(df),
        se=0.0,
        sign=sign,
        alpha=alpha,
        p_reversal=1.0,
        details={**(details or {}), "degenerate": f"no {unit}-to-{unit} variation: every {unit} gives the same value"},
    )


@dataclass(frozen=True)
class Pooled:
    """The seed SD of a statistic pooled over a family's configurations (:func:`pooled_sd`)."""

    sd: float
    df: int
    groups: int


def pooled_sd(groups: Mapping[str, Sequence[float]] | Iterable[Sequence[float]]) -> Pooled:
    """The pooled within-configuration SD, s_p = sqrt(sum_g sum_i (x_gi - mean_g)^2 / sum_g (n_g - 1)), and its
    df = sum_g (n_g - 1), over ``groups`` (each configuration's per-seed values; a dict's values are used). A
    configuration with one seed adds nothing. Pass the configurations of one family (the compared ones among them)."""
    vals = list(groups.values()) if isinstance(groups, Mapping) else list(groups)
    arrs = [_values(g, f"configuration {i}", "pooled SD") for i, g in enumerate(vals)]
    df = sum(len(g) - 1 for g in arrs)
    if df < 1:
        raise ValueError(
            f"pooled SD: {len(arrs)} configuration(s) with {[len(g) for g in arrs]} seeds give no degree of "
            "freedom; a configuration needs two seeds"
        )
    ss = sum(float(((g - g.mean()) ** 2).sum()) for g in arrs)
    return Pooled(float(np.sqrt(ss / df)), int(df), len(arrs))


def paired_part(name: str, a, b, *, sign: int = 1, alpha: float = ALPHA) -> Part:
    """Seed i of ``a`` paired with seed i of ``b``: the one-sample t on d = a - b (df = n - 1; scipy's
    ``ttest_rel``)."""
    a, b = _values(a, "a", name, 2), _values(b, "b", name, 2)
    if len(a) != len(b):
        raise ValueError(
            f"part {name!r}: a paired test needs as many seeds of a as of b ({len(a)} vs {len(b)}); pass the "
            "seeds both configurations have"
        )
    d = a - b
    se = float(d.std(ddof=1) / np.sqrt(len(d)))
    return _t_part(
        name,
        float(d.mean()),
        se,
        len(d) - 1,
        "paired t",
        (len(d), len(d)),
        sign,
        alpha,
        {"a": a.tolist(), "b": b.tolist()},
        np.sqrt(len(d) / 2),  # a seed SD sigma = sd(d) / sqrt(2) when the two configurations' seeds are independent
        design=_Design("one", (float(d.var(ddof=1)),), (len(d),), len(d) - 1),
    )


def two_sample_part(name: str, a, b, *, sign: int = 1, pooled: Pooled | None = None, alpha: float = ALPHA) -> Part:
    """``a`` and ``b`` as independent seeds: Welch's t (scipy's ``ttest_ind(equal_var=False)``), or with ``pooled``
    (:func:`pooled_sd` of the family) the t with SE = s_p sqrt(1/n_a + 1/n_b) on the pooled df. A pooled test whose
    two groups' seed SDs differ by more than :data:`POOLED_SD_RATIO` (the family's equal-SD assumption visibly
    fails) falls back to Welch; its test name and ``details["pooled_refused"]`` say so (see the module docstring)."""
    least = 1 if pooled is not None else 2
    a, b = _values(a, "a", name, least), _values(b, "b", name, least)
    est = float(a.mean() - b.mean())
    details = {"a": a.tolist(), "b": b.tolist()}
    unit = 1 / np.sqrt(1 / len(a) + 1 / len(b))  # one seed SD in SEs of a difference of means
    test = "Welch t"
    if pooled is not None:
        ratio = _sd_ratio(a, b)
        if ratio <= POOLED_SD_RATIO:
            return _t_part(
                name,
                est,
                pooled.sd * np.sqrt(1 / len(a) + 1 / len(b)),
                pooled.df,
                f"pooled t ({pooled.groups} configurations)",
                (len(a), len(b)),
                sign,
                alpha,
                {**details, "pooled_sd": pooled.sd},
                unit,
                design=_Design("two", (pooled.sd**2,), (len(a), len(b)), pooled.df, pooled.groups),
            )
        details["pooled_refused"] = {
            "sd_a": float(a.std(ddof=1)),
            "sd_b": float(b.std(ddof=1)),
            "ratio": ratio,
            "limit": POOLED_SD_RATIO,
            "pooled_sd": pooled.sd,
        }
        test = f"Welch t (not pooled: seed SDs differ {ratio:.3g}x > {POOLED_SD_RATIO:g}x)"
    va, vb = a.var(ddof=1) / len(a), b.var(ddof=1) / len(b)
    se = float(np.sqrt(va + vb))
    df = (va + vb) ** 2 / (va**2 / (len(a) - 1) + vb**2 / (len(b) - 1)) if se > 0 else len(a) + len(b) - 2
    share = round(float(va / (va + vb)), 3) if se > 0 else 0.5

    def power() -> tuple[float, float]:
        pw, m = _welch_power_mde(len(a), len(b), share, alpha)
        return pw, m * se

    design = _Design("welch", (float(a.var(ddof=1)), float(b.var(ddof=1))), (len(a), len(b)), float(df))
    return _t_part(name, est, se, df, test, (len(a), len(b)), sign, alpha, details, unit, power, design)


@lru_cache(maxsize=4096)
def _welch_power_mde(n_a: int, n_b: int, share_a: float, alpha: float) -> tuple[float, float]:
    """A Welch part's (power at 2 seed SDs, MDE in SEs): :func:`welch_power` at the observed share of group a in the
    variance of the difference (rounded to 0.001 by the caller, so that simulations reuse it; the power moves by
    less than 0.001 over that step), a seed SD sigma being the RMS of the two, sqrt((s_a^2 + s_b^2) / 2) =
    SE sqrt((w n_a + (1 - w) n_b) / 2)."""
    pw = _welch(n_a, n_b, share_a, alpha)
    return pw(POWER_SDS * np.sqrt((share_a * n_a + (1 - share_a) * n_b) / 2)), _solve_mde(pw)


def _sd_ratio(a: np.ndarray, b: np.ndarray) -> float:
    """The larger seed SD of a and b over the smaller (1 when either has one seed, or both none of variation; inf when
    only one varies)."""
    if len(a) < 2 or len(b) < 2:
        return 1.0
    sa, sb = sorted((float(a.std(ddof=1)), float(b.std(ddof=1))))
    return 1.0 if sb == 0 else float("inf") if sa == 0 else sb / sa


def one_sample_part(
    name: str, values, ref: float = 0.0, *, sign: int = 1, pooled: Pooled | None = None, alpha: float = ALPHA
) -> Part:
    """One configuration's seed values against ``ref``: the one-sample t (scipy's ``ttest_1samp``; df = n - 1), or with
    ``pooled`` SE = s_p / sqrt(n) on the pooled df."""
    v = _values(values, "values", name, 1 if pooled is not None else 2)
    details = {"values": v.tolist(), "ref": float(ref)}
    if pooled is not None:
        return _t_part(
            name,
            float(v.mean() - ref),
            pooled.sd / np.sqrt(len(v)),
            pooled.df,
            f"pooled one-sample t ({pooled.groups} configurations)",
            (len(v),),
            sign,
            alpha,
            {**details, "pooled_sd": pooled.sd},
            np.sqrt(len(v)),
            design=_Design("one", (pooled.sd**2,), (len(v),), pooled.df, pooled.groups),
        )
    return _t_part(
        name,
        float(v.mean() - ref),
        float(v.std(ddof=1) / np.sqrt(len(v))),
        len(v) - 1,
        "one-sample t",
        (len(v),),
        sign,
        alpha,
        details,
        np.sqrt(len(v)),
        design=_Design("one", (float(v.var(ddof=1)),), (len(v),), len(v) - 1),
    )


# ------------------------------------------------------------------------------------------------ bootstrap


def _images(x, name: str) -> np.ndarray:
    v = np.asarray(x, dtype=float)
    if v.ndim == 0 or v.shape[0] < 2:
        raise ValueError(
            f"part {name!r}: the bootstrap needs per-image values with the images on axis 0 (at least 2), "
            f"got shape {v.shape}"
        )
    if not np.isfinite(v).all():
        raise ValueError(
            f"part {name!r}: {int((~np.isfinite(v)).sum())} per-image values are not finite; drop those "
            "images before bootstrapping"
        )
    return v


def _apply(statistic, sample: np.ndarray, name: str) -> np.ndarray:
    out = np.asarray(statistic(sample, axis=1), dtype=float)
    if out.shape != (sample.shape[0],):
        raise ValueError(
            f"part {name!r}: the statistic must reduce axis 1 to one number per resample, like "
            f"np.mean(x, axis=1); it gave shape {out.shape} for input {sample.shape}"
        )
    return out


def _groups(groups, n: int, name: str) -> np.ndarray:
    """The resampling units as a padded member matrix [G, m_max] (image indices of each group, -1 past its end), the
    groups in sorted label order; ``groups`` None: each image its own group."""
    if groups is None:
        return np.arange(n)[:, None]
    g = np.asarray(groups)
    if g.shape != (n,):
        raise ValueError(
            f"part {name!r}: groups must give one label per image ({n} images), got shape {g.shape}; pass e.g. the "
            "photo index of each view"
        )
    labels, inverse, sizes = np.unique(g, return_inverse=True, return_counts=True)
    if len(labels) < 2:
        raise ValueError(
            f"part {name!r}: all {n} images are in one group, and a bootstrap over groups needs at least 2; pass "
            "the independent unit of each image (each image its own when they are independent)"
        )
    order = np.argsort(inverse, kind="stable")  # images grouped, in their original order within each group
    members = np.full((len(labels), int(sizes.max())), -1)
    members[inverse[order], np.arange(n) - np.repeat(np.cumsum(sizes) - sizes, sizes)] = order
    return members


def _evaluate(stat: Callable, arrays: tuple[np.ndarray, ...], rows: np.ndarray, width: int) -> np.ndarray:
    """``stat`` on each row of ``rows`` (image indices, -1 = none: a row of k groups' members), rows of equal length
    stacked together, at most _CHUNK resampled values at once (``width``: values per image)."""
    valid = rows >= 0
    lengths = valid.sum(1)
    out = np.empty(len(rows))
    for length in np.unique(lengths):
        which = np.flatnonzero(lengths == length)
        step = max(1, _CHUNK // (width * int(length)))
        for s in range(0, len(which), step):
            w = which[s : s + step]
            idx = rows[w][valid[w]].reshape(len(w), int(length))
            out[w] = stat(*(x[idx] for x in arrays))
    return out


def _bootstrap(
    arrays: tuple[np.ndarray, ...], stat: Callable, n_boot: int, seed: int, method: str, members: np.ndarray
) -> _Boot:
    """``stat(*resampled arrays)`` -> one number per resample; the arrays share the image axis (0), and ``members``
    (:func:`_groups`) are the resampling units: each resample draws G of the G groups with replacement (``G`` draws
    of ``rng.integers(0, G)`` per resample, in chunks) and takes every image of each drawn group; the BCa
    acceleration comes from the jackknife that leaves out one group at a time."""
    if method not in ("bca", "percentile"):
        raise ValueError(f"bootstrap method must be 'bca' or 'percentile', not {method!r}")
    if n_boot < 100:
        raise ValueError(f"n_boot = {n_boot} is too few resamples for a 95% CI; use at least 1000 (default {N_BOOT})")
    n_groups = members.shape[0]
    est = float(stat(*(x[None] for x in arrays))[0])
    rng = np.random.default_rng(seed)
    width = max(int(np.prod(x.shape[1:])) for x in arrays)
    step = max(1, _CHUNK // (width * members.size))
    boot = np.empty(n_boot)
    for s in range(0, n_boot, step):
        drawn = rng.integers(0, n_groups, size=(min(step, n_boot - s), n_groups))
        boot[s : s + len(drawn)] = _evaluate(stat, arrays, members[drawn].reshape(len(drawn), -1), width)
    if method == "percentile":
        return _Boot(est, boot, method)
    below = (np.sum(boot < est) + 0.5 * np.sum(boot == est)) / n_boot
    z0 = float(ndtri(np.clip(below, 0.5 / n_boot, 1 - 0.5 / n_boot)))
    keep = np.arange(n_groups - 1)
    drop = keep[None, :] + (keep[None, :] >= np.arange(n_groups)[:, None])  # row g: every group but g
    jack = _evaluate(stat, arrays, members[drop].reshape(n_groups, -1), width)
    d = jack.mean() - jack
    den = 6 * float((d**2).sum()) ** 1.5
    a = float((d**3).sum()) / den if den > 0 else 0.0
    return _Boot(est, boot, method, z0, a)


def _boot_part(name, arrays, stat, groups, sign, n_boot, seed, method, alpha, test) -> Part:
    """The part of a (paired) bootstrap: over the images, or over ``groups`` of them (see :func:`bootstrap_part`)."""
    n = arrays[0].shape[0]
    members = _groups(groups, n, name)
    dist = _bootstrap(arrays, stat, n_boot, seed, method, members)
    details = {"n_boot": n_boot, "seed": seed, "method": method}
    if groups is not None:
        details.update(groups=members.shape[0], images=n)
        test = f"{test} over {members.shape[0]} groups"
    if float(np.ptp(dist.boot)) <= 1e-12 * max(1.0, abs(dist.est)):  # every resample gives the estimate (to rounding)
        unit = "group" if groups is not None else "image"
        return _degenerate(name, dist.est, test, (members.shape[0],), sign, alpha, None, details, unit)
    return _from_dist(
        name,
        dist,
        test,
        (members.shape[0],),
        sign,
        alpha,
        se=float(dist.boot.std(ddof=1)),
        details=details,
    )


def bootstrap_part(
    name: str,
    values,
    statistic: Callable = np.mean,
    *,
    groups=None,
    sign: int = 1,
    n_boot: int = N_BOOT,
    seed: int = 0,
    method: str = "bca",
    alpha: float = ALPHA,
) -> Part:
    """A statistic of one run's per-image ``values`` (images on axis 0, e.g. [N] or [N, K]) with a bootstrap CI over
    the images. ``statistic(x, axis=1)`` gets a stack of resamples [B, N, ...] and returns [B] (``np.mean``,
    ``np.median``, or e.g. ``lambda x, axis: x[..., 0].mean(axis) / x[..., 1].mean(axis)``). The effect is
    ``sign`` x the statistic on all images; BCa CI by default (see the module docstring), seeded by ``seed``.

    ``groups`` (one label per image, e.g. the photo each crop was cut from): the images are not independent, the
    groups are; the bootstrap then resamples whole groups (the cluster bootstrap, Davison & Hinkley 1997 Sec. 3.8,
    their first strategy: draw G of the G groups with replacement and keep every image of each drawn group, the right
    choice when the groups are few and the within-group values are not exchangeable across groups), and the BCa
    acceleration is the jackknife over groups (Efron & Tibshirani 1993 Sec. 14.3's formula with a group as the
    deleted unit: the empirical influence of a group, as Davison & Hinkley 1997 Sec. 3.8 and 5.3 take it for
    clustered data). With groups of unequal size a resample has as many images as its drawn groups hold. ``n`` is then
    the number of groups and ``details`` has ``groups`` and ``images``; ``groups=None`` is each image its own group
    (the same draws as ``groups=numpy.arange(N)``, bit for bit). The interval covers the population the groups were
    drawn from: a CI over 19 photos is about photos like these, whatever the number of crops per photo."""
    sign = _sign(sign)
    x = _images(values, name)
    return _boot_part(
        name,
        (x,),
        lambda s: sign * _apply(statistic, s, name),
        groups,
        sign,
        n_boot,
        seed,
        method,
        alpha,
        f"bootstrap {_METHOD[method]}",
    )


def paired_bootstrap_part(
    name: str,
    x,
    y,
    statistic: Callable = np.mean,
    statistic_y: Callable | None = None,
    *,
    groups=None,
    sign: int = 1,
    n_boot: int = N_BOOT,
    seed: int = 0,
    method: str = "bca",
    alpha: float = ALPHA,
) -> Part:
    """The difference statistic(x) - statistic_y(y) (``statistic_y`` defaults to ``statistic``) of two statistics
    computed on the SAME images (row i of ``x`` and of ``y`` is image i, e.g. two heads' per-image attention distance,
    or two models' on the same analysis images), with a bootstrap that resamples the same images for both; with
    ``groups``, the same whole groups for both (the cluster bootstrap of :func:`bootstrap_part`)."""
    sign = _sign(sign)
    x, y = _images(x, name), _images(y, name)
    if x.shape[0] != y.shape[0]:
        raise ValueError(
            f"part {name!r}: a paired bootstrap needs the same images in x and y ({x.shape[0]} vs {y.shape[0]} rows)"
        )
    sy = statistic_y or statistic
    return _boot_part(
        name,
        (x, y),
        lambda s, t: sign * (_apply(statistic, s, name) - _apply(sy, t, name)),
        groups,
        sign,
        n_boot,
        seed,
        method,
        alpha,
        f"paired bootstrap {_METHOD[method]}",
    )


# ------------------------------------------------------------------------------------------------ equivalence, Holm


def equivalence_part(part: Part, margin: float, name: str | None = None) -> Part:
    """A claim of no difference: TOST of ``part`` (any part above; its data and test) against +-``margin``, a margin
    written down before the run. Significant for when p_TOST < alpha (the 1 - 2 alpha CI inside the margin),
    significant against when the difference lies beyond the margin (the 1 - alpha CI outside it); see the module
    docstring."""
    if part._dist is None:
        raise ValueError(
            f"part {part.name!r} carries no sampling distribution (was it read back from JSON?); build it "
            "again with one of the part functions"
        )
    if part.margin is not None:
        raise ValueError(f"part {part.name!r} is already an equivalence part")
    if not (np.isfinite(margin) and margin > 0):
        raise ValueError(f"the equivalence margin must be a positive number, not {margin!r}")
    d, m, al = part._dist, float(margin), part.alpha
    p = max(d.floor, d.level(-m), 1 - d.level(m))  # H0 effect <= -m, H0 effect >= m
    p_rev = max(d.floor, min(1.0, 2 * min(d.level(m), 1 - d.level(-m))))  # H1 effect > m, H1 effect < -m
    outcome = FOR if p < al else AGAINST if p_rev < al else NOT_SIGNIFICANT
    return Part(
        name or part.name,
        part.effect,
        part.ci,
        p,
        outcome,
        f"TOST, {part.test}",
        part.n,
        df=part.df,
        se=part.se,
        sign=part.sign,
        alpha=al,
        p_reversal=p_rev,
        margin=m,
        details={
            **part.details,
            "ci_tost": list(d.interval(2 * al)),
            "p_difference": part.p,
        },
        _dist=d,
        _design=part._design,
        _equiv=lambda: _equivalence_power(part, m, al),
    )


# ------------------------------------------------------------------------------------------------ equivalence power


MAX_SEEDS = 1000  # _Design.seeds_needed searches up to this many seeds per configuration


@dataclass(frozen=True)
class _Design:
    """How a t part's SE and df follow from the seeds per configuration, for the power of an equivalence test built
    on it (:func:`equivalence_part`) and the seeds it needs. ``kind``: "one" (one mean: a one-sample or a paired part,
    variance ``var[0]`` of one seed or one seed pair's difference), "two" (a difference of two means with one pooled
    seed variance ``var[0]``), "welch" (a difference of two means, seed variances ``var[0]``, ``var[1]``); ``n``: the
    seeds per configuration of the part; ``df``: its df; ``groups``: the configurations a pooled SD spans (its df is
    groups x (n - 1) at n seeds each)."""

    kind: str
    var: tuple[float, ...]
    n: tuple[int, ...]
    df: float
    groups: int = 1

    def _at(self, n: tuple[int, ...] | None):
        """(tau, df or the two sample variances' dfs, Welch's share of group a): tau the true SE of the estimate."""
        n = self.n if n is None else n
        if self.kind == "welch":
            va, vb = self.var[0] / n[0], self.var[1] / n[-1]
            return np.sqrt(va + vb), (n[0] - 1, n[-1] - 1), va / (va + vb)
        df = self.df if n == self.n else self.groups * (n[0] - 1)
        tau = np.sqrt(self.var[0] / n[0]) if self.kind == "one" else np.sqrt(self.var[0] * (1 / n[0] + 1 / n[-1]))
        return tau, df, None

    def power(self, margin: float, alpha: float, n: tuple[int, ...] | None = None) -> float:
        """:func:`tost_power` at the true difference 0, with this design's seeds (or ``n`` per configuration)."""
        tau, df, share = self._at(n)
        return tost_power(margin / tau, df, share, alpha)

    def seeds_needed(self, margin: float, alpha: float) -> int | None:
        """The fewest seeds per configuration (the same in each) with :data:`POWER_TARGET` power to show equivalence
        within +-``margin`` when the true difference is 0 and the seed SDs are the observed ones (None: more than
        :data:`MAX_SEEDS`). A planning figure: the observed SDs stand in for the true ones."""
        k = len(self.n)
        for n in range(2, MAX_SEEDS + 1):
            if self.power(margin, alpha, (n,) * k) >= POWER_TARGET:
                return n
        return None


def tost_power(margin_tau: float, df, share_a: float | None = None, alpha: float = ALPHA) -> float:
    """The power of the two one-sided t tests at level ``alpha`` each (equivalent when the 1 - 2 alpha CI lies inside
    +-m) to show equivalence when the true difference is 0, for a margin of ``margin_tau`` true SEs tau. With the
    estimate D ~ N(0, tau^2) independent of its estimated SE S: power = E[max(0, 2 Phi(m / tau - t_{1 - alpha, nu}
    S / tau) - 1)] (Schuirmann 1987's TOST; its exact power as in Phillips 1990). One variance estimate (``df`` a
    number, ``share_a`` None): S^2 / tau^2 = U / df, U ~ chi^2_df, nu = df; the integral over U up to where the bracket
    reaches 0, by adaptive quadrature (exact to 1e-8). Welch (``df`` = (k_a, k_b), the two sample variances' dfs,
    ``share_a`` = (sigma_a^2 / n_a) / tau^2): S^2 / tau^2 = w U_a / k_a + (1 - w) U_b / k_b and nu the
    Welch-Satterthwaite df, as in :func:`welch_power`; the expectation by generalised Gauss-Laguerre quadrature on
    :data:`_TOST_NODES` nodes per variance (the bracket's kink at 0 limits it to about 0.002; tests/studies/
    test_stats.py checks it against simulation)."""
    if share_a is None:
        from scipy.integrate import quad
        from scipy.stats import chi2

        df, t = float(df), float(stdtrit(float(df), 1 - alpha))
        if margin_tau <= 0:
            return 0.0
        top = df * (margin_tau / t) ** 2  # U beyond which the CI cannot fit inside the margin
        val, _ = quad(lambda u: (2 * ndtr(margin_tau - t * np.sqrt(u / df)) - 1) * chi2.pdf(u, df), 0.0, top)
        return float(min(1.0, max(0.0, val)))
    ka, kb = df
    (ua, wa), (ub, wb) = _laguerre(float(ka), _TOST_NODES), _laguerre(float(kb), _TOST_NODES)
    va, vb = share_a * ua[:, None], (1 - share_a) * ub[None, :]
    nu = (va + vb) ** 2 / (va**2 / ka + vb**2 / kb)
    thr = stdtrit(nu, 1 - alpha) * np.sqrt(va + vb)
    return float(wa @ np.clip(2 * ndtr(margin_tau - thr) - 1, 0, None) @ wb)


def _equivalence_text(details: dict, margin: float) -> str:
    """The sentence fragment of :meth:`Part.power_text` for an equivalence part (from its details)."""
    pw = details.get("power_equivalence")
    if pw is None:
        return ""
    out = [
        f"power to show equivalence if the true difference is 0: {100 * pw:.0f}%",
        f"margin shown with {100 * POWER_TARGET:.0f}% power +-{details['margin_80']:.2g}",
    ]
    if "seeds_needed" in details:
        n = details["seeds_needed"]
        more = f"{n} seeds" if n is not None else f"more than {MAX_SEEDS} seeds"
        out.append(f"+-{margin:.3g} needs {more} per configuration at the observed seed SDs")
    return "; ".join(out)


def _equivalence_power(part: Part, margin: float, alpha: float) -> dict:
    """What an equivalence part could show (in its details, JSON and sentence): ``power_equivalence``, the power to
    show equivalence within +-margin if the true difference is 0; ``margin_80``, the smallest margin this design shows
    with :data:`POWER_TARGET` power; for a t part ``seeds_needed``, the seeds per configuration that the margin needs
    at the observed seed SDs (None: more than :data:`MAX_SEEDS`). A bootstrap part: the normal approximation with
    its bootstrap SE, power = 2 Phi(m / SE - z_{1 - alpha}) - 1. A degenerate part (SE 0): nothing."""
    from scipy.optimize import brentq

    se = part.se
    if se is None or not se > 0:
        return {}
    if part._design is None:  # a bootstrap: no seeds
        z = float(ndtri(1 - alpha))
        return {
            "power_equivalence": float(max(0.0, 2 * ndtr(margin / se - z) - 1)),
            "margin_80": float((z + ndtri((1 + POWER_TARGET) / 2)) * se),
        }
    d: _Design = part._design
    tau = float(d._at(None)[0])
    hi = 4.0
    while d.power(hi * tau, alpha) < POWER_TARGET and hi < 1e4:
        hi *= 2
    m80 = float(brentq(lambda m: d.power(m * tau, alpha) - POWER_TARGET, 0.0, hi, xtol=1e-9)) * tau
    return {
        "power_equivalence": d.power(margin, alpha),
        "margin_80": m80,
        "seeds_needed": d.seeds_needed(margin, alpha),
    }


def magnitude(part: Part, paper: float, unit: str = "", scale: float = 1.0) -> dict:
    """The paper's number tested against ours (Science standard: magnitudes beside directions): is ``paper`` (in the
    part's units and the paper's direction, e.g. a top-1 drop of 0.04) inside the part's 95% CI, and the two-sided p of
    "the true effect is the paper's" from the part's own sampling distribution (its t, or its bootstrap's BCa interval
    inverted at the paper's value). ``unit`` and ``scale`` write the sentence (``scale`` 100, ``unit`` " points":
    fractions as percentage points). A part without a distribution (degenerate, or read back from JSON): no p."""
    lo, hi = part.ci
    inside = bool(lo <= paper <= hi)
    p = None
    if part._dist is not None:
        lv = part._dist.level(float(paper))
        p = float(max(part._dist.floor, min(1.0, 2 * min(lv, 1 - lv))))

    def f(v):
        return f"{scale * v:+.3g}{unit}"

    where = "inside" if inside else "outside"
    tail = f" (p = {p:.2g} that the true effect is the paper's)" if p is not None else ""
    verdict = "our data are consistent with it" if inside else "our data exclude it at the 95% level"
    return {
        "part": part.name,
        "paper": float(paper),
        "ours": float(part.effect),
        "ci": [float(lo), float(hi)],
        "inside_ci": inside,
        "p": p,
        "sentence": f"{part.name}: the paper's {f(paper)} lies {where} our 95% CI [{f(lo)}, {f(hi)}] around "
        f"{f(part.effect)}{tail}: {verdict}.",
    }


def holm(pvalues: Sequence[float]) -> np.ndarray:
    """Holm's step-down adjusted p-values: with p sorted ascending p_(1) <= ... <= p_(m),
    adj_(i) = min(1, max_{j <= i} (m - j + 1) p_(j)), returned in the input order. Reject H_i when adj_i < alpha."""
    p = np.asarray(pvalues, dtype=float).reshape(-1)
    if not np.all((p >= 0) & (p <= 1)):
        raise ValueError(f"p-values must lie in [0, 1], got {p.tolist()}")
    m = len(p)
    order = np.argsort(p, kind="stable")
    adj = np.minimum(1.0, np.maximum.accumulate((m - np.arange(m)) * p[order]))
    out = np.empty(m)
    out[order] = adj
    return out


# ------------------------------------------------------------------------------------------------ the verdict


@dataclass(frozen=True)
class Precondition:
    """A condition a claim needs to be testable at all (e.g. "a local head exists", "two seeds per configuration"):
    ``sentence`` says it with its ``numbers`` (shown when it fails, e.g. "no head is local: the smallest mean attention
    distance is 11.2 px, local means below 6.1 px")."""

    name: str
    passed: bool
    sentence: str
    numbers: dict = field(default_factory=dict)

    def to_json(self) -> dict:
        return _plain(
            {"name": self.name, "passed": bool(self.passed), "sentence": self.sentence, "numbers": self.numbers}
        )


def min_seeds(configs: Mapping[str, Sequence], least: int = 2) -> Precondition:
    """Every compared configuration has at least ``least`` seeds."""
    few = {k: len(v) for k, v in configs.items() if len(v) < least}
    counts = {k: len(v) for k, v in configs.items()}
    if few:
        return Precondition(
            "seeds",
            False,
            f"fewer than {least} seeds of "
            + ", ".join(f"{k} ({n})" for k, n in few.items())
            + ": without them there is no seed-to-seed variation to judge the effect against",
            counts,
        )
    return Precondition("seeds", True, f"at least {least} seeds of every compared configuration", counts)


@dataclass(frozen=True)
class Decision:
    """A claim's verdict: ``outcome`` (one of :data:`OUTCOMES`), ``why`` (one paragraph with the deciding numbers),
    the ``parts``, their Holm-adjusted reversal p-values ``p_holm`` and the ``preconditions``."""

    outcome: str
    why: str
    parts: tuple[Part, ...]
    p_holm: tuple[float, ...]
    preconditions: tuple[Precondition, ...] = ()
    alpha: float = ALPHA

    @property
    def ours(self) -> str:
        """The parts' effects and CIs, short: for a report's "ours" column."""
        return "; ".join(f"{p.name} {p.effect:+.3g} [{p.ci[0]:+.3g}, {p.ci[1]:+.3g}]" for p in self.parts)

    def to_json(self) -> dict:
        return _plain(
            {
                "outcome": self.outcome,
                "why": self.why,
                "alpha": self.alpha,
                "parts": [p.to_json() for p in self.parts],
                "p_holm": list(self.p_holm),
                "preconditions": [c.to_json() for c in self.preconditions],
            }
        )


def decide(parts: Sequence[Part], preconditions: bool | Precondition | Iterable[Precondition] = True) -> Decision:
    """The claim's outcome from its ``parts`` (see the module docstring): not testable when a precondition failed
    (``preconditions``: Precondition objects, or a bool when the caller checked them itself), held when every part is
    significant for, did not hold when some part is significant against after Holm over the claim's parts, else
    inconclusive; at the parts' alpha (all parts of a claim share one). A :data:`DEGENERATE` part (no seed variation)
    supports neither held nor did not hold: the claim is not held; it did not hold only when another part is
    significantly against after Holm (the degenerate part counted in Holm's m, never rejected), and is otherwise not
    testable, with a failed "seed variation" precondition naming the part."""
    parts = tuple(parts)
    if not parts:
        raise ValueError("decide needs at least one part")
    alphas = {p.alpha for p in parts}
    if len(alphas) > 1:
        raise ValueError(f"the parts of one claim must share one alpha, got {sorted(alphas)}")
    alpha = alphas.pop()
    if isinstance(preconditions, Precondition):
        preconditions = (preconditions,)
    if isinstance(preconditions, bool):
        conds = () if preconditions else (Precondition("preconditions", False, "a precondition failed"),)
    else:
        conds = tuple(preconditions)
    adj = holm([p.p_reversal for p in parts])
    measured = "; ".join(p.summary() for p in parts)
    failed = [c for c in conds if not c.passed]
    if failed:
        text = "; ".join(c.sentence for c in failed)
        return Decision(
            NOT_TESTABLE,
            f"{text[0].upper()}{text[1:]}. Measured, not judged: {measured}.",
            parts,
            tuple(adj),
            conds,
            alpha,
        )
    if all(p.p < alpha and p.outcome == FOR for p in parts):
        lead = f"Every part is significant in the paper's direction at alpha {alpha:g}"
        return Decision(HELD, f"{lead}: {measured}.", parts, tuple(adj), conds, alpha)
    against = [(p, q) for p, q in zip(parts, adj) if q < alpha and p.outcome == AGAINST]
    flat = [p for p in parts if p.outcome == DEGENERATE]
    if flat and not against:  # a part without seed variation has no test: the claim cannot be judged
        values = ", ".join(f"{p.name} (effect {p.effect:+.3g}, the same on every seed)" for p in flat)
        cond = Precondition(
            "seed variation",
            False,
            f"no seed-to-seed variation in {values}, so no p-value or interval can be computed for "
            f"{'it' if len(flat) == 1 else 'them'}; check that the seeds differ, or measure a statistic that varies",
            {p.name: p.effect for p in flat},
        )
        return Decision(
            NOT_TESTABLE,
            f"{cond.sentence[0].upper()}{cond.sentence[1:]}. Measured, not judged: {measured}.",
            parts,
            tuple(adj),
            (*conds, cond),
            alpha,
        )
    if against:
        names = ", ".join(f"{p.name} (Holm-adjusted p = {q:.2g})" for p, q in against)
        return Decision(
            NOT_HELD,
            f"Significantly against the paper after Holm's correction over {len(parts)} part(s) at "
            f"alpha {alpha:g}: {names}. {measured}.",
            parts,
            tuple(adj),
            conds,
            alpha,
        )
    n_for = sum(p.outcome == FOR for p in parts)
    return Decision(
        INCONCLUSIVE,
        f"{n_for} of {len(parts)} part(s) significant in the paper's direction, none "
        f"significantly against after Holm at alpha {alpha:g}: {measured}.",
        parts,
        tuple(adj),
        conds,
        alpha,
    )


# ------------------------------------------------------------------------------------------------ across claims


def _get(x, key: str):
    return x[key] if isinstance(x, Mapping) else getattr(x, key)


def claim_p(decision) -> float | None:
    """The p-value a tested claim's verdict rests on (``decision``: a :class:`Decision` or its JSON, e.g. a study
    record's ``"decision"``); None for a claim that is not testable or has no parts.

    ``held``          max over parts of p: "held" is the intersection-union test (every part significant for), and
                      its p-value is the largest of the parts' (Berger 1982, Technometrics 24: the IUT at level
                      alpha rejects exactly when every part's p < alpha);
    ``did not hold``  min over the parts significantly against of their Holm-adjusted p (``p_holm``): the claim's
                      "did not hold" needs one such part, and its p is the smallest alpha at which one remains;
    ``inconclusive``  the held test's p that failed: max over parts of the part's p in the paper's direction -- its
                      p when significant for, or not significant with effect >= 0, or an equivalence part (TOST p);
                      1 when the part points against the paper (its two-sided p for "for" would exceed 1) or is
                      degenerate. It is at least alpha, so it never becomes "held" after a correction.
    """
    outcome, parts = _get(decision, "outcome"), list(_get(decision, "parts"))
    if outcome not in (HELD, NOT_HELD, INCONCLUSIVE) or not parts:
        return None
    ps = [_get(p, "p") for p in parts]
    if outcome == HELD:
        return float(max(ps))
    if outcome == NOT_HELD:
        adj = list(_get(decision, "p_holm"))
        return float(min(q for p, q in zip(parts, adj) if _get(p, "outcome") == AGAINST))

    def p_for(part) -> float:
        o, p = _get(part, "outcome"), _get(part, "p")
        if p is None or not np.isfinite(p) or o in (AGAINST, DEGENERATE):
            return 1.0
        if o == FOR or _get(part, "margin") is not None or _get(part, "effect") >= 0:
            return float(p)
        return 1.0

    return float(max(p_for(p) for p in parts))


def across_claims(decisions: Mapping[str, object], alpha: float = ALPHA) -> dict:
    """Holm's and Benjamini-Hochberg's corrections across a study's tested claims: ``decisions`` {claim id: Decision
    or its JSON} for the claims to count (leave sanity checks out); a claim not testable (:func:`claim_p` None) is
    left out. Each claim's p (:func:`claim_p`) is adjusted over the m tested claims by Holm's step-down
    (:func:`holm`; family-wise error rate alpha) and by Benjamini & Hochberg's step-up (1995, JRSS B 57;
    ``scipy.stats.false_discovery_control``, q_(i) = min_{j >= i} min(1, m p_(j) / j); false discovery rate alpha).
    A claim stays held after a correction when it was held and its adjusted p (q) < alpha. Returns the JSON of the
    study's ``across_claims``: {"method", "alpha", "claims": {id: {"verdict", "p", "holm_p", "bh_q",
    "held_after_holm", "held_after_bh"}}, "tested", "held", "held_after_holm", "held_after_bh"}."""
    from scipy.stats import false_discovery_control

    ps = {k: claim_p(d) for k, d in decisions.items()}
    ps = {k: v for k, v in ps.items() if v is not None and np.isfinite(v)}
    ids = list(ps)
    p = np.array([ps[k] for k in ids], dtype=float)
    h = holm(p) if len(p) else np.array([])
    q = false_discovery_control(p, method="bh") if len(p) else np.array([])
    claims = {}
    for i, k in enumerate(ids):
        held = _get(decisions[k], "outcome") == HELD
        claims[k] = {
            "verdict": _get(decisions[k], "outcome"),
            "p": float(p[i]),
            "holm_p": float(h[i]),
            "bh_q": float(q[i]),
            "held_after_holm": bool(held and h[i] < alpha),
            "held_after_bh": bool(held and q[i] < alpha),
        }
    return {
        "method": "claim p: max part p (held), min Holm-adjusted reversal p (did not hold), max part p in the "
        "paper's direction (inconclusive); Holm (family-wise) and Benjamini-Hochberg (false discovery rate) "
        "across the tested claims, sanity checks left out",
        "alpha": alpha,
        "claims": claims,
        "tested": len(ids),
        "held": sum(c["verdict"] == HELD for c in claims.values()),
        "held_after_holm": sum(c["held_after_holm"] for c in claims.values()),
        "held_after_bh": sum(c["held_after_bh"] for c in claims.values()),
    }


def _plain(x):
    if isinstance(x, Mapping):
        return {str(k): _plain(v) for k, v in x.items()}
    if isinstance(x, (list, tuple, np.ndarray)):
        return [_plain(v) for v in x]
    if isinstance(x, (bool, np.bool_)):
        return bool(x)
    if isinstance(x, (int, np.integer)):
        return int(x)
    if isinstance(x, (float, np.floating)):
        return float(x) if np.isfinite(x) else None
    return x


# ------------------------------------------------------------------------------------------------ the simulation

DESIGNS = ("welch", "pooled", "paired")


def simulate(
    effect_sd: float,
    design: str = "pooled",
    *,
    seeds: int = 3,
    family: int = 4,
    parts: int = 1,
    reps: int = 20000,
    seed: int = 0,
    sd_ratio: float = 1.0,
) -> dict:
    """The rule on synthetic seeds: ``reps`` claims of ``parts`` independent parts, each comparing configuration A
    (mean ``effect_sd``, SD ``sd_ratio``; default 1) with B (mean 0, SD 1; the family's other configurations too),
    ``seeds`` seeds each, through the part function of ``design``
    ('welch': :func:`two_sample_part`; 'pooled': the same with :func:`pooled_sd` over ``family`` configurations, A and B
    among them; 'paired': :func:`paired_part`, seeds independent) and :func:`decide`. Returns the share of each
    outcome."""
    if design not in DESIGNS:
        raise ValueError(f"design must be one of {DESIGNS}, not {design!r}")
    if design == "pooled" and family < 2:
        raise ValueError(
            f"a pooled design compares two configurations of the family: family must be at least 2, not {family}"
        )
    rng = np.random.default_rng(seed)
    k = family if design == "pooled" else 2
    data = rng.standard_normal((reps, parts, k, seeds))
    data[:, :, 0] *= sd_ratio
    data[:, :, 0] += effect_sd
    counts = dict.fromkeys(OUTCOMES, 0)
    for r in range(reps):
        ps = []
        for j in range(parts):
            a, b = data[r, j, 0], data[r, j, 1]
            if design == "welch":
                ps.append(two_sample_part("p", a, b))
            elif design == "pooled":
                ps.append(two_sample_part("p", a, b, pooled=pooled_sd(data[r, j])))
            else:
                ps.append(paired_part("p", a, b))
        counts[decide(ps).outcome] += 1
    return {o: c / reps for o, c in counts.items()}


def _tables(reps: int = 20000) -> None:
    print("null (effect 0): false held / false did not hold, 1-part and 2-part claims")
    for design, fam in (("welch", 2), ("pooled", 4), ("paired", 2)):
        r = [simulate(0.0, design, family=fam, parts=k, reps=reps) for k in (1, 2)]
        print(
            f"  {design:7s} family {fam}: held {r[0][HELD]:.4f} / {r[1][HELD]:.4f}, "
            f"did not hold {r[0][NOT_HELD]:.4f} / {r[1][NOT_HELD]:.4f}"
        )
    print("power (held), 1-part / 2-part claims")
    for design, fam in (("welch", 2), ("pooled", 2), ("pooled", 4), ("pooled", 8), ("paired", 2)):
        row = [f"{simulate(e, design, family=fam, parts=k, reps=reps)[HELD]:.3f}" for e in (2.0, 3.0) for k in (1, 2)]
        print(f"  {design:7s} family {fam}: 2 sd {row[0]} / {row[1]}, 3 sd {row[2]} / {row[3]}")


if __name__ == "__main__":
    _tables()
