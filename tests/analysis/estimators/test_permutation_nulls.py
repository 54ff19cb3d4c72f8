"""Permutation nulls of the similarity scores: each estimator's fast null (no pass over the features) equals
re-scoring the permuted data; p-values are uniform under a true null (Kolmogorov-Smirnov); the max-statistic
correction holds the family-wise error of a layer x layer map at 5%; minibatch CKA's null permutes within each
minibatch and reuses its Grams; with groups (crops of photos) as the unit, whole groups are permuted, the null is
uniform on clustered data where the row-level one rejects far too often, and one row per group is the row-level null
exactly."""

import functools
import itertools

import numpy as np
import pytest
import torch
from scipy import stats

from analysis.estimators.permutation import _permutations
from analysis.similarity import (
    MinibatchCKA,
    PermutedMinibatchCKA,
    cka,
    cknna,
    distinct_permutations,
    fwer_adjusted,
    group_permutations,
    mutual_knn,
    permutation_map,
    permutation_test,
    procrustes_angle,
    procrustes_distance,
    pwcca,
    rbf_cka,
    svcca,
)

# small matrices, one thread (conftest's fixture): on a loaded 2-core host torch's 2-thread parallel regions (the triu
# of linear CKA's Gram) took ~40 ms on a 20 x 3 input against 0.13 ms at one thread
pytestmark = pytest.mark.usefixtures("one_thread")


ESTIMATORS = {
    "cka": cka,
    "cka_biased": functools.partial(cka, unbiased=False),
    "rbf_cka": rbf_cka,
    "rbf_cka_unbiased_half": functools.partial(rbf_cka, threshold=0.5, unbiased=True),
    "mutual_knn": functools.partial(mutual_knn, k=5),
    "cknna": functools.partial(cknna, k=5),
    "procrustes_distance": procrustes_distance,
    "procrustes_angle": procrustes_angle,
    "svcca": functools.partial(svcca, keep=0.9),
    "pwcca": pwcca,
}


def pair(seed=0, n=40, p=6, q=5, noise=1.5):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, p, generator=g, dtype=torch.float64)
    return x, x @ torch.randn(p, q, generator=g, dtype=torch.float64) + noise * torch.randn(
        n, q, generator=g, dtype=torch.float64
    )


@pytest.mark.parametrize("name", ESTIMATORS)
def test_the_fast_null_is_the_score_of_the_permuted_data(name):
    """Each estimator's null, from its prepared sides, equals calling it on y's rows reordered by the same
    (seeded) permutations; its observed score is the estimator's."""
    f = ESTIMATORS[name]
    x, y = pair(1)
    r = permutation_test(f, x, y, n_perm=12, seed=3)
    perms = _permutations(len(x), 12, 3)
    assert r.score == pytest.approx(f(x, y), abs=1e-12)
    assert r.null == pytest.approx(np.array([f(x, y[p]) for p in perms]), abs=1e-9)
    slow = permutation_test(lambda a, b: f(a, b), x, y, n_perm=12, seed=3)  # the generic path: one call each
    assert slow.null == pytest.approx(r.null, abs=1e-9)


def test_the_summary_numbers():
    x, y = pair(2)
    r = permutation_test(cka, x, y, n_perm=50, seed=1)
    assert r.null_mean == pytest.approx(r.null.mean()) and r.null_sd == pytest.approx(r.null.std(ddof=1))
    assert r.z == pytest.approx((r.score - r.null_mean) / r.null_sd)
    assert r.excess == pytest.approx(r.score - r.null_mean)
    assert r.p == (1 + (r.null >= r.score).sum()) / 51
    assert np.array_equal(permutation_test(cka, x, y, n_perm=50, seed=1).null, r.null)  # seeded
    assert not np.array_equal(permutation_test(cka, x, y, n_perm=50, seed=2).null, r.null)
    d = permutation_test(procrustes_distance, x, y, n_perm=50)
    assert d.lower and d.z < 0 and d.p == (1 + (d.null <= d.score).sum()) / 51  # a distance: smaller is closer
    z = np.random.RandomState(0).randn(40, 5)  # numpy arrays, a generic score
    g = permutation_test(lambda a, b: float(np.corrcoef(a[:, 0], b[:, 0])[0, 1]), x.numpy(), z, n_perm=20)
    assert g.null.shape == (20,) and 0 < g.p <= 1


def null_p_values(score, reps, n_perm, n=20, seed=0):
    rs = np.random.RandomState(seed)
    return np.array(
        [permutation_test(score, rs.randn(n, 3), rs.randn(n, 4), n_perm=n_perm, seed=i).p for i in range(reps)]
    )


@pytest.mark.parametrize("score", [cka, procrustes_distance], ids=["cka", "procrustes"])
def test_p_values_are_uniform_under_a_true_null(score):
    """200 independent pairs x 99 permutations: p on {1/100, ..., 1}, uniform (KS against U(0, 1); the grid's
    discreteness adds at most 0.01 to the statistic)."""
    p = null_p_values(score, reps=200, n_perm=99)
    assert stats.kstest(p, "uniform").pvalue > 0.01, np.sort(p)
    assert abs((p <= 0.05).mean() - 0.05) < 3 * np.sqrt(0.05 * 0.95 / 200)


def family_wise_errors(reps, n_perm, layers=4, n=20, seed=0):
    """Fractions of replicates, with every layer of X independent of every layer of Y, in which some cell is
    significant at 5%: FWER-adjusted and unadjusted."""
    rs = np.random.RandomState(seed)
    adjusted = unadjusted = 0
    for i in range(reps):
        base_x, base_y = rs.randn(n, 3), rs.randn(n, 3)  # layers of one model share their examples' structure
        xs = [base_x + 0.7 * rs.randn(n, 3) for _ in range(layers)]
        ys = [base_y + 0.7 * rs.randn(n, 3) for _ in range(layers)]
        m = permutation_map(rbf_cka, xs, ys, n_perm=n_perm, seed=i)  # any score; this one's sides are fast
        adjusted += (m.p_fwer <= 0.05).any()
        unadjusted += (m.p <= 0.05).any()
    return adjusted / reps, unadjusted / reps


def test_the_max_statistic_holds_the_family_wise_error_of_a_map():
    reps = 200
    fwer, uncorrected = family_wise_errors(reps, n_perm=99)
    assert fwer <= 0.05 + 3 * np.sqrt(0.05 * 0.95 / reps), fwer
    assert uncorrected > 0.15, uncorrected  # the 16 cells uncorrected would not: the correction does work


@pytest.mark.slow
def test_family_wise_error_larger_simulation():
    reps = 1000
    fwer, _ = family_wise_errors(reps, n_perm=199, seed=1)
    assert abs(fwer - 0.05) <= 3 * np.sqrt(0.05 * 0.95 / reps), fwer


def test_map_cells_equal_single_tests_and_fwer_is_above_p():
    x, y = pair(4)
    z = torch.randn(40, 7, generator=torch.Generator().manual_seed(9), dtype=torch.float64)
    m = permutation_map(rbf_cka, [x, z], [y, z, x], n_perm=30, seed=5)
    for i, a in enumerate([x, z]):
        for j, b in enumerate([y, z, x]):
            r = permutation_test(rbf_cka, a, b, n_perm=30, seed=5)  # the same permutations
            assert m.score[i, j] == pytest.approx(r.score) and m.p[i, j] == pytest.approx(r.p)
            assert m.null[:, i, j] == pytest.approx(r.null)
    assert (m.p_fwer >= m.p).all() and m.p_fwer[0, 0] == pytest.approx(1 / 31)
    own = permutation_map(cka, [x, y, z], n_perm=10)  # a model against itself
    assert own.score.shape == (3, 3) and np.allclose(np.diag(own.score), 1)


def test_constant_cells_are_left_out_of_the_family():
    x, y = pair(5)
    const = torch.ones(40, 3, dtype=torch.float64)
    m = permutation_map(cka, [x, const], [y], n_perm=20)
    assert np.isnan(m.score[1, 0]) and np.isnan(m.p[1, 0]) and np.isnan(m.p_fwer[1, 0])
    assert m.p_fwer[0, 0] == pytest.approx(1 / 21)
    assert np.isnan(fwer_adjusted(np.array([np.nan]), np.full((5, 1), np.nan)))[0]


def test_minibatch_cka_null_permutes_within_each_minibatch():
    """CKA itself is MinibatchCKA's; one minibatch's null is permutation_map's (same permutations); over two
    minibatches, null map j is MinibatchCKA of the data with y reordered by permutation j within each one."""
    g = torch.Generator().manual_seed(6)
    batches = []
    for n in (24, 16):
        x = torch.randn(n, 10, generator=g, dtype=torch.float64)
        batches.append(([x, torch.randn(n, 4, generator=g, dtype=torch.float64)], [x[:, :5] + torch.randn(n, 5)]))
    one = PermutedMinibatchCKA(n_perm=8, seed=2)
    one.update(*batches[0])
    ref = permutation_map(cka, *batches[0], n_perm=8, seed=2)
    assert one.result().null == pytest.approx(ref.null, abs=1e-12)
    both, plain = PermutedMinibatchCKA(n_perm=8, seed=2), MinibatchCKA()
    for xs, ys in batches:
        both.update(xs, ys)
        plain.update(xs, ys)
    assert torch.allclose(both.compute(), plain.compute(), atol=1e-14)
    gen = torch.Generator().manual_seed(2)
    perms = [torch.rand(8, n, generator=gen).argsort(1) for n in (24, 16)]
    for j in (0, 5):
        again = MinibatchCKA()
        for (xs, ys), p in zip(batches, perms):
            again.update(xs, [y[p[j]] for y in ys])
        assert torch.allclose(both.null()[j], again.compute(), atol=1e-12)
    res = both.result()
    assert res.score.shape == (2, 1) and res.p[0, 0] == pytest.approx(1 / 9) and 0 < res.p_fwer[1, 0] <= 1
    own = PermutedMinibatchCKA(n_perm=4)
    own.update(batches[0][0])
    assert torch.allclose(torch.diagonal(own.compute()), torch.ones(2, dtype=torch.float64))


def test_errors_say_what_is_wrong():
    x, y = pair(7)
    with pytest.raises(ValueError, match="n_perm >= 2"):
        permutation_test(cka, x, y, n_perm=1)
    with pytest.raises(ValueError, match="by keyword"):
        permutation_test(functools.partial(rbf_cka, x), x, y)
    with pytest.raises(ValueError, match="same examples"):
        permutation_test(cka, x, y[:-1])
    with pytest.raises(ValueError, match="same examples"):
        permutation_map(cka, [x], [y[:-1]])


# ------------------------------------------------------------------------------------------- groups as the unit


def test_group_permutations_move_whole_groups_row_for_row():
    """Hand-worked: groups a (rows 0, 2, 4), b (1, 3, 5), c (6, 7) and d (8, 9): a and b are exchanged (or not) as
    wholes, the k-th row of one going to the k-th row of the other; c and d likewise; nothing else moves."""
    groups = np.array(["a", "b", "a", "b", "a", "b", "c", "c", "d", "d"])
    perms = group_permutations(groups, 200, seed=0).numpy()
    swap_ab = perms[:, 0] == 1
    assert np.array_equal(perms[swap_ab][:, :6], np.tile([1, 0, 3, 2, 5, 4], (swap_ab.sum(), 1)))
    assert np.array_equal(perms[~swap_ab][:, :6], np.tile(np.arange(6), ((~swap_ab).sum(), 1)))
    swap_cd = perms[:, 6] == 8
    assert np.array_equal(perms[swap_cd][:, 6:], np.tile([8, 9, 6, 7], (swap_cd.sum(), 1)))
    assert np.array_equal(perms[~swap_cd][:, 6:], np.tile([6, 7, 8, 9], ((~swap_cd).sum(), 1)))
    assert 60 < swap_ab.sum() < 140 and 60 < swap_cd.sum() < 140  # each swap half the time (binomial 200, 1/2)
    assert distinct_permutations(groups) == 2 * 2


def test_unequal_groups_are_permuted_within_their_size_class():
    groups = np.repeat([0, 1, 2, 3, 4], [3, 3, 3, 2, 1])  # three of 3, one of 2, one of 1
    perms = group_permutations(groups, 300, seed=1).numpy()
    assert np.array_equal(perms[:, 9:], np.tile([9, 10, 11], (300, 1)))  # alone in their size class: in place
    firsts = perms[:, [0, 3, 6]]
    assert set(map(tuple, firsts)) == {tuple(3 * np.array(q)) for q in itertools.permutations(range(3))}  # all 3!
    assert np.array_equal(perms[:, [1, 2]], perms[:, [0]] + [1, 2])  # a group's rows stay together, in order
    assert distinct_permutations(groups) == 6
    with pytest.raises(ValueError, match="two groups of the same size"):
        group_permutations([0, 0, 1], 10, seed=0)


def test_one_row_per_group_is_exactly_the_row_level_null():
    """Singleton groups draw the very permutations of the row-level null (any labels, in any order): the same
    null, z and p to the last digit, for a test and for a map (the Gram path and the generic one)."""
    x, y = pair(4)
    labels = np.random.default_rng(0).permutation(len(x)) * 7  # one label per row, not in row order
    assert torch.equal(group_permutations(labels, 30, seed=5), _permutations(len(x), 30, 5))
    for f in (cka, functools.partial(mutual_knn, k=5)):
        a, b = permutation_test(f, x, y, n_perm=30, seed=5), permutation_test(f, x, y, n_perm=30, seed=5, groups=labels)
        assert np.array_equal(a.null, b.null) and a.p == b.p and a.z == b.z
        xs, ys = [x, x[:, :3]], [y, y[:, :2]]
        ma, mb = permutation_map(f, xs, ys, n_perm=30, seed=5), permutation_map(f, xs, ys, 30, 5, groups=labels)
        assert np.array_equal(ma.null, mb.null) and np.array_equal(ma.p_fwer, mb.p_fwer)


def clustered_null_pair(rs, photos=8, views=4, dim=3, spread=2.0):
    """X and Y of ``photos`` x ``views`` crops, rows interleaved (view k of every photo, then view k + 1), each
    representation a photo effect plus crop noise, X's and Y's photo effects independent: nothing about the photos is
    shared (the photo-level null is true), but crops of one photo are alike in both."""
    g = np.tile(np.arange(photos), views)
    x = spread * rs.randn(photos, dim)[g] + rs.randn(len(g), dim)
    y = spread * rs.randn(photos, dim + 1)[g] + rs.randn(len(g), dim + 1)
    return x, y, g


def test_the_photo_level_null_is_uniform_on_clustered_data_and_the_view_level_one_is_not():
    """200 replicates of clustered data under the photo-level null, 99 permutations each: photo-level p uniform (KS
    against U(0, 1), the grid's discreteness adds at most 0.01) and rejecting at 5% within 3 binomial SEs of 5%;
    the view-level p on the same data rejects far more often (crops of a photo stay paired in the observed data)."""
    rs = np.random.RandomState(11)
    photo, view = [], []
    for i in range(200):
        x, y, g = clustered_null_pair(rs)
        photo.append(permutation_test(cka, x, y, n_perm=99, seed=i, groups=g).p)
        view.append(permutation_test(cka, x, y, n_perm=99, seed=i).p)
    photo, view = np.array(photo), np.array(view)
    assert stats.kstest(photo, "uniform").pvalue > 0.01, np.sort(photo)
    assert abs((photo <= 0.05).mean() - 0.05) < 3 * np.sqrt(0.05 * 0.95 / 200), (photo <= 0.05).mean()
    assert (view <= 0.05).mean() > 0.05 + 3 * np.sqrt(0.05 * 0.95 / 200), (view <= 0.05).mean()
