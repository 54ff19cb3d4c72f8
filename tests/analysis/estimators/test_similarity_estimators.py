"""The similarity estimators of analysis.similarity against references written here in numpy float64 from the
papers and the authors' code (Kornblith et al.'s notebook gram_rbf / center_gram / cka; platonic-rep metrics.py's
compute_nearest_neighbors / mutual_knn / cknna / hsic_unbiased; google/svcca's cca_core.get_cca_similarity and
pwcca.compute_pwcca), on fixed features, and against known cases: identical and rotated features give the maximum,
isotropic scaling changes nothing, independent features sit in the null."""

import functools

import numpy as np
import pytest
import scipy.linalg
import torch

from analysis.similarity import (
    cka,
    cknna,
    mutual_knn,
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


# ---------------------------------------------------------------- Kornblith et al. 2019, the authors' notebook


def nb_gram_rbf(x, threshold=1.0):
    """Demo.ipynb's gram_rbf: bandwidth^2 = threshold^2 * the median of all n^2 squared distances."""
    dot = x @ x.T
    sq = np.diag(dot)
    d = -2 * dot + sq[:, None] + sq[None, :]
    return np.exp(-d / (2 * threshold**2 * np.median(d)))


def nb_center_gram(g, unbiased=False):
    """Demo.ipynb's center_gram (Szekely and Rizzo's U-centring for the unbiased form)."""
    g = g.copy()
    if unbiased:
        n = g.shape[0]
        np.fill_diagonal(g, 0)
        means = np.sum(g, 0) / (n - 2)
        means -= np.sum(means) / (2 * (n - 1))
        g -= means[:, None]
        g -= means[None, :]
        np.fill_diagonal(g, 0)
    else:
        means = np.mean(g, 0)
        means -= np.mean(means) / 2
        g -= means[:, None]
        g -= means[None, :]
    return g


def nb_cka(gx, gy, debiased=False):
    gx, gy = nb_center_gram(gx, debiased), nb_center_gram(gy, debiased)
    return gx.ravel() @ gy.ravel() / (np.linalg.norm(gx) * np.linalg.norm(gy))


def notebook_data():
    """The notebook's tutorial data: np.random.seed(1337); X = randn(100, 10); Y = randn(100, 10) + X."""
    rs = np.random.RandomState(1337)
    x = rs.randn(100, 10)
    return x, rs.randn(100, 10) + x


def features(seed=0, n=60, p=12, q=9, noise=1.0):
    rs = np.random.RandomState(seed)
    x = rs.randn(n, p) + rs.randn(p)  # not centred
    y = x @ rs.randn(p, q) + noise * rs.randn(n, q)
    return x, y


def test_cka_and_rbf_cka_reproduce_the_notebook_printed_values():
    """The notebook prints linear CKA 0.55761, debiased 0.51346, RBF CKA (threshold 0.5) 0.65483 on its data."""
    x, y = notebook_data()
    assert cka(torch.from_numpy(x), torch.from_numpy(y), unbiased=False) == pytest.approx(0.55761, abs=5e-6)
    assert cka(torch.from_numpy(x), torch.from_numpy(y), unbiased=True) == pytest.approx(0.51346, abs=5e-6)
    assert rbf_cka(x, y, threshold=0.5) == pytest.approx(0.65483, abs=5e-6)


@pytest.mark.parametrize("threshold", [0.5, 1.0, 2.0])
@pytest.mark.parametrize("unbiased", [False, True])
def test_rbf_cka_matches_the_notebook(threshold, unbiased):
    x, y = features(1)
    ref = nb_cka(nb_gram_rbf(x, threshold), nb_gram_rbf(y, threshold), debiased=unbiased)
    assert rbf_cka(x, y, threshold, unbiased) == pytest.approx(ref, abs=1e-12)
    assert rbf_cka(torch.from_numpy(x).float(), torch.from_numpy(y).float(), threshold, unbiased) == pytest.approx(
        ref, abs=1e-5
    )


def test_rbf_median_counts_the_diagonal_and_averages_the_middle_pair():
    """An even count of entries: the median is the mean of the two middle ones, as np.median (n = 4: 16 entries)."""
    x = np.array([[0.0], [1.0], [3.0], [7.0]])
    y = np.array([[0.0], [2.0], [3.0], [9.0]])
    assert rbf_cka(x, y) == pytest.approx(nb_cka(nb_gram_rbf(x), nb_gram_rbf(y)), abs=1e-13)


# ---------------------------------------------------------------- Huh et al. 2024, platonic-rep metrics.py


def l2(x):
    return x / np.maximum(np.linalg.norm(x, axis=1, keepdims=True), 1e-12)


def pr_nearest_neighbors(f, k):
    """compute_nearest_neighbors: (F F^T) with the diagonal at -1e8, argsort descending, first k."""
    s = f @ f.T
    np.fill_diagonal(s, -1e8)
    return np.argsort(-s, axis=1, kind="stable")[:, :k]


def pr_mutual_knn(a, b, k):
    ka, kb = pr_nearest_neighbors(a, k), pr_nearest_neighbors(b, k)
    n = len(a)
    ma, mb = np.zeros((n, n)), np.zeros((n, n))
    ma[np.arange(n)[:, None], ka] = 1
    mb[np.arange(n)[:, None], kb] = 1
    return ((ma * mb).sum(1) / k).mean()


def pr_hsic_unbiased(k, l_):
    m = k.shape[0]
    kt, lt = k.copy(), l_.copy()
    np.fill_diagonal(kt, 0)
    np.fill_diagonal(lt, 0)
    v = np.sum(kt * lt.T) + np.sum(kt) * np.sum(lt) / ((m - 1) * (m - 2)) - 2 * np.sum(kt @ lt) / (m - 2)
    return v / (m * (m - 3))


def pr_cknna(a, b, k, eps=0.0):
    """AlignmentMetrics.cknna (unbiased=True, distance_agnostic=False); their denominator adds eps = 1e-6."""
    n = len(a)
    kk, ll = a @ a.T, b @ b.T

    def similarity(k_, l_):
        kh, lh = k_.copy(), l_.copy()
        np.fill_diagonal(kh, -np.inf)
        np.fill_diagonal(lh, -np.inf)
        mk, ml = np.zeros((n, n)), np.zeros((n, n))
        mk[np.arange(n)[:, None], np.argsort(-kh, axis=1)[:, :k]] = 1
        ml[np.arange(n)[:, None], np.argsort(-lh, axis=1)[:, :k]] = 1
        mask = mk * ml
        return pr_hsic_unbiased(mask * k_, mask * l_)

    return similarity(kk, ll) / (np.sqrt(similarity(kk, kk) * similarity(ll, ll)) + eps)


@pytest.mark.parametrize("k", [1, 5, 10])
def test_mutual_knn_matches_platonic_rep(k):
    x, y = features(2, n=80, noise=2.0)
    assert mutual_knn(x, y, k) == pytest.approx(pr_mutual_knn(l2(x), l2(y), k), abs=1e-15)


@pytest.mark.parametrize("k", [2, 5, 10])
def test_cknna_matches_platonic_rep(k):
    x, y = features(3, n=80, noise=2.0)
    assert cknna(x, y, k) == pytest.approx(pr_cknna(l2(x), l2(y), k), abs=1e-12)
    assert cknna(x, y, k) == pytest.approx(pr_cknna(l2(x), l2(y), k, eps=1e-6), rel=1e-3)  # their guard: < 0.1%


def test_nearest_neighbours_stream_over_row_blocks(monkeypatch):
    """Blocks of rows (memory block x n) give the same tables as one block."""
    from analysis.estimators import neighbours

    x, y = features(4, n=50)
    whole = mutual_knn(x, y, 7)
    monkeypatch.setattr(neighbours, "_ROW_BLOCK", 8)
    assert mutual_knn(x, y, 7) == whole
    assert torch.equal(neighbours.knn_table(x, 7), torch.from_numpy(pr_nearest_neighbors(l2(x), 7)))


# ---------------------------------------------------------------- Procrustes: Ding et al. 2021, Williams et al. 2021


def normalised(x):
    x = x - x.mean(0)
    return x / np.linalg.norm(x)


def ref_procrustes(x, y):
    """2 - 2 ||X^T Y||_* from an explicit SVD of X^T Y [p, q]."""
    return 2 - 2 * np.linalg.svd(normalised(x).T @ normalised(y), compute_uv=False).sum()


@pytest.mark.parametrize("shape", [(60, 12, 9), (20, 40, 30), (30, 5, 50)])  # wider than n on either side too
def test_procrustes_matches_the_definition_and_scipy(shape):
    n, p, q = shape
    x, y = features(5, n, p, q)
    ref = ref_procrustes(x, y)
    assert procrustes_distance(x, y) == pytest.approx(ref, abs=1e-11)
    assert procrustes_angle(x, y) == pytest.approx(np.arccos(1 - ref / 2), abs=1e-9)
    # the value of the orthogonal Procrustes problem itself, sides zero-padded to one width
    w = max(p, q)
    a, b = np.zeros((n, w)), np.zeros((n, w))
    a[:, :p], b[:, :q] = normalised(x), normalised(y)
    r, _ = scipy.linalg.orthogonal_procrustes(a, b)
    assert procrustes_distance(x, y) == pytest.approx(np.linalg.norm(a @ r - b) ** 2, abs=1e-11)


# ---------------------------------------------------------------- SVCCA and PWCCA: google/svcca cca_core, pwcca


def cc_get_cca_similarity(acts1, acts2, epsilon=0.0):
    """cca_core.get_cca_similarity (neurons x datapoints): covariances, rescaled; pinv; inverse square roots by
    eigh; SVD. Returns (u, s, invsqrt_xx) with s the canonical correlations."""
    numx = acts1.shape[0]
    cov = np.cov(acts1, acts2)
    sxx, sxy, syy = cov[:numx, :numx], cov[:numx, numx:], cov[numx:, numx:]
    xmax, ymax = np.max(np.abs(sxx)), np.max(np.abs(syy))
    sxx, syy, sxy = sxx / xmax, syy / ymax, sxy / np.sqrt(xmax * ymax)

    def sqrt_psd(a):
        w, v = np.linalg.eigh(a)
        return v @ np.diag(np.sqrt(w)) @ v.T

    ixx = sqrt_psd(np.linalg.pinv(sxx + epsilon * np.eye(numx)))
    iyy = sqrt_psd(np.linalg.pinv(syy + epsilon * np.eye(len(syy))))
    u, s, _ = np.linalg.svd(ixx @ sxy @ iyy)
    return u, np.abs(s), ixx


def svd_reduce(x, keep):
    """Raghu et al. 2017: centre, SVD, keep the fewest directions with `keep` of the variance (sum of s^2)."""
    xc = x - x.mean(0)
    u, s, _ = np.linalg.svd(xc, full_matrices=False)
    share = np.cumsum(s**2) / np.sum(s**2)
    k = int(np.searchsorted(share, keep - 1e-12) + 1)
    return (u[:, :k] * s[:k]).T  # the reduced activations, directions x datapoints (the tutorial's s * V)


@pytest.mark.parametrize("keep", [0.5, 0.9, 0.99, 1.0])
def test_svcca_matches_cca_core_on_svd_reduced_activations(keep):
    x, y = features(6, n=200, p=15, q=11, noise=1.5)
    _, rho, _ = cc_get_cca_similarity(svd_reduce(x, keep), svd_reduce(y, keep), epsilon=1e-10)
    assert svcca(x, y, keep) == pytest.approx(rho.mean(), abs=1e-8)


def ref_pwcca(x, y):
    """Morcos et al. 2018 Sec. 2.2 with cca_core's CCA: the canonical variates of the side with fewer neurons,
    h_i = (whitened direction)^T (centred activations), unit norm; alpha_i = sum_j |<h_i, x_j>|."""
    if x.shape[1] > y.shape[1]:
        x, y = y, x  # the weights are X's: swapping the sides leaves the correlations
    a1, a2 = (x - x.mean(0)).T, (y - y.mean(0)).T
    u, rho, ixx = cc_get_cca_similarity(a1, a2)
    h = (ixx @ u).T @ a1  # canonical variates, one per row
    h /= np.linalg.norm(h, axis=1, keepdims=True)
    alpha = np.abs(h @ a1.T).sum(1)[: len(rho)]
    return np.sum(alpha * rho) / np.sum(alpha)


@pytest.mark.parametrize("sides", [(10, 14), (14, 10), (12, 12)])
def test_pwcca_matches_the_paper(sides):
    x, y = features(7, n=300, p=sides[0], q=sides[1], noise=1.5)
    assert pwcca(x, y) == pytest.approx(ref_pwcca(x, y), abs=1e-8)


def test_pwcca_matches_the_authors_code_where_their_variates_are_the_papers():
    """google/svcca's compute_pwcca forms the variates as u^T acts without the whitening: the paper's variates
    when X's neurons are uncorrelated with equal variance (then the whitening is a multiple of I)."""
    rs = np.random.RandomState(8)
    xc = rs.randn(200, 6)
    q, _ = np.linalg.qr(xc - xc.mean(0))
    x = 3 * q  # centred, orthogonal columns of equal norm
    y = x @ rs.randn(6, 9) + rs.randn(200, 9)
    acts1, acts2 = x.T, y.T
    u, rho, _ = cc_get_cca_similarity(acts1, acts2)
    means = acts1.mean(1, keepdims=True)
    dirns = u.T @ (acts1 - means) + means  # compute_pwcca's X branch (x has the fewer neurons)
    p_, _ = np.linalg.qr(dirns.T)
    w = np.abs(p_.T @ acts1.T).sum(1)
    authors = np.sum(w / w.sum() * rho)
    assert pwcca(x, y) == pytest.approx(authors, abs=1e-8)


# ---------------------------------------------------------------- known cases


def rotation(p, seed):
    q, _ = np.linalg.qr(np.random.RandomState(seed).randn(p, p))
    return q


SIMILARITIES = {
    "rbf_cka": (rbf_cka, 1.0),
    "rbf_cka_unbiased": (functools.partial(rbf_cka, unbiased=True), 1.0),
    "mutual_knn": (mutual_knn, 1.0),
    "cknna": (cknna, 1.0),
    "procrustes_distance": (procrustes_distance, 0.0),
    "procrustes_angle": (procrustes_angle, 0.0),
    "svcca": (svcca, 1.0),
    "pwcca": (pwcca, 1.0),
}


@pytest.mark.parametrize("name", SIMILARITIES)
def test_identical_and_rotated_features_give_the_maximum(name):
    f, best = SIMILARITIES[name]
    rs = np.random.RandomState(9)
    x = rs.randn(120, 10)
    assert f(x, x) == pytest.approx(best, abs=1e-6)
    assert f(x, x @ rotation(10, 10)) == pytest.approx(best, abs=1e-6)
    # isotropic scaling: every one of them is invariant to it
    assert f(x, 7.5 * x @ rotation(10, 11)) == pytest.approx(best, abs=1e-6)
    y = x @ rs.randn(10, 8) + rs.randn(120, 8)
    assert f(x, 0.01 * y) == pytest.approx(f(x, y), abs=1e-10)


@pytest.mark.parametrize("name", [n for n in SIMILARITIES if n not in ("mutual_knn", "cknna")])
def test_translation_invariance_where_the_definition_centres(name):
    """Kernel CKA, Procrustes and CCA centre the features; mutual k-NN and CKNNA (cosine of raw features) do not."""
    f, _ = SIMILARITIES[name]
    x, y = features(12)
    assert f(x + 5.0, y - 3.0) == pytest.approx(f(x, y), abs=1e-9)


@pytest.mark.parametrize("name", SIMILARITIES)
def test_independent_features_sit_in_the_null(name):
    f, _ = SIMILARITIES[name]
    rs = np.random.RandomState(13)
    x, y = rs.randn(60, 6), rs.randn(60, 5)
    r = permutation_test(f, x, y, n_perm=99)
    assert abs(r.z) < 3 and r.p > 0.01, r
    x2 = x @ rs.randn(6, 5) + 0.3 * rs.randn(60, 5)  # and dependent ones do not
    r = permutation_test(f, x, x2, n_perm=99)
    assert r.p == 0.01 and abs(r.z) > 3, r


def test_large_n_paths_stream(monkeypatch):
    """Column chunks of the float64 Grams (forced tiny) change nothing."""
    from analysis.estimators import kernels

    x, y = features(14, n=80, p=30, q=25)  # n > p + q: PWCCA is defined (no tied correlations of 1)
    before = [f(x, y) for f, _ in SIMILARITIES.values()]
    monkeypatch.setattr(kernels, "_CHUNK_ELEMENTS", 80 * 7)
    after = [f(x, y) for f, _ in SIMILARITIES.values()]
    assert after == pytest.approx(before, abs=1e-12)


def test_errors_say_what_is_wrong():
    x = np.random.RandomState(0).randn(10, 3)
    with pytest.raises(ValueError, match="same examples"):
        rbf_cka(x, x[:9])
    with pytest.raises(ValueError, match="1 <= k < n"):
        mutual_knn(x, x, k=10)
    with pytest.raises(ValueError, match="k >= 2"):
        cknna(x, x, k=1)
    with pytest.raises(ValueError, match="constant representation"):
        svcca(x, np.ones((10, 3)))
    assert np.isnan(rbf_cka(x, np.ones((10, 3))))
