"""CKA against a plain reference (full Gram matrices, explicit centring matrix H)."""

import os
import tempfile

import pytest
import torch
import torch.multiprocessing as mp

from analysis.estimators.similarity import MinibatchCKA, center_unbiased, cka, represent


def ref_cka(x, y, unbiased=True):
    """Textbook formulas, no shortcuts: HSIC_1 (Song et al. 2012) or HSIC_0 with H = I - 11^T/n."""
    x, y = x.double().reshape(len(x), -1), y.double().reshape(len(y), -1)
    n = x.shape[0]
    K, L = x @ x.T, y @ y.T
    one = torch.ones(n, 1, dtype=torch.float64)

    def hsic(K, L):
        if not unbiased:
            H = torch.eye(n, dtype=torch.float64) - one @ one.T / n
            return torch.trace(K @ H @ L @ H) / (n - 1) ** 2
        Kt, Lt = K - torch.diag(torch.diag(K)), L - torch.diag(torch.diag(L))
        t1 = torch.trace(Kt @ Lt)
        t2 = (one.T @ Kt @ one) * (one.T @ Lt @ one) / ((n - 1) * (n - 2))
        t3 = 2.0 / (n - 2) * (one.T @ Kt @ Lt @ one)
        return ((t1 + t2 - t3) / (n * (n - 3))).squeeze()

    return float(hsic(K, L) / torch.sqrt(hsic(K, K) * hsic(L, L)))


@pytest.mark.parametrize("unbiased", [True, False])
def test_cka_matches_the_reference(unbiased):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(40, 30, generator=g)
    y = x @ torch.randn(30, 20, generator=g) + 0.5 * torch.randn(40, 20, generator=g)
    assert cka(x, y, unbiased) == pytest.approx(ref_cka(x, y, unbiased), abs=1e-12)


def test_one_minibatch_equals_cka_and_all_pairs_match_pairwise():
    g = torch.Generator().manual_seed(1)
    layers = [torch.randn(64, d, generator=g) for d in (8, 16, 32)]
    layers[1] = layers[0] @ torch.randn(8, 16, generator=g) + 0.1 * layers[1]
    m = MinibatchCKA()
    m.update(layers)
    M = m.compute()
    for i in range(3):
        for j in range(3):
            assert M[i, j].item() == pytest.approx(cka(layers[i], layers[j]), abs=1e-12)
            assert M[i, j].item() == pytest.approx(ref_cka(layers[i], layers[j]), abs=1e-10)
    assert torch.allclose(M, M.T, atol=1e-14)
    assert torch.allclose(torch.diagonal(M), torch.ones(3, dtype=torch.float64))


def test_minibatch_sums_hsic_over_minibatches():
    g = torch.Generator().manual_seed(2)
    xs = [torch.randn(96, 10, generator=g)]
    ys = [xs[0] + torch.randn(96, 10, generator=g), torch.randn(96, 5, generator=g)]
    m = MinibatchCKA()
    for b in range(3):
        m.update([x[b * 32 : (b + 1) * 32] for x in xs], [y[b * 32 : (b + 1) * 32] for y in ys])

    def hs(a, b):
        from analysis.estimators.similarity import center_unbiased, gram

        return float((center_unbiased(gram(a)) * center_unbiased(gram(b))).sum() / (32 * 29))

    for j, y in enumerate(ys):
        xy = sum(hs(xs[0][b * 32 : (b + 1) * 32], y[b * 32 : (b + 1) * 32]) for b in range(3))
        xx = sum(hs(xs[0][b * 32 : (b + 1) * 32], xs[0][b * 32 : (b + 1) * 32]) for b in range(3))
        yy = sum(hs(y[b * 32 : (b + 1) * 32], y[b * 32 : (b + 1) * 32]) for b in range(3))
        assert m.compute()[0, j].item() == pytest.approx(xy / (xx * yy) ** 0.5, abs=1e-12)


def test_invariances():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(100, 20, generator=g, dtype=torch.float64)
    y = torch.randn(100, 20, generator=g, dtype=torch.float64) + x
    q, _ = torch.linalg.qr(torch.randn(20, 20, generator=g, dtype=torch.float64))
    base = cka(x, y)
    assert cka(x, x) == pytest.approx(1.0, abs=1e-12)
    assert cka(x @ q, y) == pytest.approx(base, abs=1e-10)  # orthogonal transform
    assert cka(3.7 * x, y) == pytest.approx(base, abs=1e-10)  # isotropic scaling
    a = torch.randn(20, 20, generator=g, dtype=torch.float64) * torch.linspace(
        0.05, 5, 20, dtype=torch.float64
    )  # a general invertible linear map
    assert abs(cka(x @ a, y) - base) > 1e-2


def test_unbiased_is_near_zero_on_independent_gaussians_where_biased_is_not():
    g = torch.Generator().manual_seed(4)
    x, y = torch.randn(512, 1000, generator=g), torch.randn(512, 1000, generator=g)
    u, b = cka(x, y, unbiased=True), cka(x, y, unbiased=False)
    assert abs(u) < 0.01
    assert b > 0.3  # the biased estimator is dominated by the high dimension (p > n)


def test_small_minibatch_is_a_clear_error():
    with pytest.raises(ValueError, match="at least 4"):
        MinibatchCKA().update([torch.randn(3, 5)])


def test_representations():
    t = torch.arange(2 * 3 * 4, dtype=torch.float32).view(2, 3, 4)
    assert represent(t, "flatten").shape == (2, 12)
    assert torch.equal(represent(t, "cls", 1), t[:, 0])
    assert torch.equal(represent(t, "mean_spatial", 1), t[:, 1:].mean(1))
    with pytest.raises(ValueError, match="class token"):
        represent(t, "cls", 0)
    fm = torch.randn(2, 4, 3, 3)  # ResNet feature map: positions are tokens
    assert torch.allclose(represent(fm, "mean_spatial"), fm.mean(dim=(2, 3)))


def _worker(rank, world, init, path, q):
    torch.distributed.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    g = torch.Generator().manual_seed(5)
    batches = [[torch.randn(16, 12, generator=g), torch.randn(16, 7, generator=g)] for _ in range(6)]
    m = MinibatchCKA()
    for j in range(rank, len(batches), world):  # the suite's sharding: minibatch j on process j % world
        m.update(batches[j])
    m.sync()
    if rank == 0:
        q.put(m.compute().tolist())  # plain numbers: a shared tensor needs this process alive until it is read
    torch.distributed.destroy_process_group()


def test_two_processes_agree_with_one():
    g = torch.Generator().manual_seed(5)
    batches = [[torch.randn(16, 12, generator=g), torch.randn(16, 7, generator=g)] for _ in range(6)]
    one = MinibatchCKA()
    for b in batches:
        one.update(b)
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    with tempfile.TemporaryDirectory() as d:
        init = f"file://{os.path.join(d, 'store')}"
        procs = [ctx.Process(target=_worker, args=(r, 2, init, d, q)) for r in range(2)]
        for p in procs:
            p.start()
        two = torch.tensor(q.get(timeout=120), dtype=torch.float64)
        for p in procs:
            p.join(timeout=60)
    assert torch.allclose(torch.diagonal(one.compute()), torch.ones(2, dtype=torch.float64))
    assert torch.allclose(two, one.compute(), atol=1e-6, rtol=0)


# ---------------------------------------------------------------- float32 Grams of centred features vs float64


def old_minibatch_cka(batches, unbiased=True):
    """The float64 algorithm MinibatchCKA used before: each layer copied to float64, K = X X^T uncentred, U(K) or
    HKH, all pairs from one product, HSIC summed over minibatches."""
    xy = None
    for reps in batches:
        n = reps[0].shape[0]
        ks = []
        for r in reps:
            x = r.reshape(n, -1).double()
            k = x @ x.T
            if unbiased:
                k.fill_diagonal_(0)
                means = k.sum(0) / (n - 2)
                means = means - means.sum() / (2 * (n - 1))
                k = k - means[:, None] - means[None, :]
                k.fill_diagonal_(0)
            else:
                h = torch.eye(n, dtype=torch.float64) - 1.0 / n
                k = h @ k @ h
            ks.append(k.reshape(-1))
        g = torch.stack(ks)
        s = g @ g.T / (n * (n - 3) if unbiased else (n - 1) ** 2)
        xy = s if xy is None else xy + s
    d = torch.diagonal(xy)
    return xy / torch.sqrt(d[:, None] * d[None, :])


def _layers(kind, g, n=256, batches=2, p=600):
    """Four float32 layers of [batches * n, p] features: 'random' (a chain of noisy Gaussian layers plus one
    independent layer), 'lowrank_offset' (rank-5 signals riding on per-feature means 300x their size, as in a
    residual stream's large-mean channels), 'bf16' (random, stored as bfloat16)."""
    N = batches * n
    if kind in ("random", "bf16"):
        h = torch.randn(N, p, generator=g, dtype=torch.float64)
        layers = [h, h + 0.7 * torch.randn(N, p, generator=g, dtype=torch.float64)]
        layers += [
            layers[1] @ torch.randn(p, p, generator=g, dtype=torch.float64) / p**0.5,
            torch.randn(N, p, generator=g, dtype=torch.float64),
        ]
    else:
        z = torch.randn(N, 5, generator=g, dtype=torch.float64)
        layers = []
        for a in (1.0, 0.8, 0.5, 0.0):  # latents shared with the first layer's in share a
            zi = a * z + (1 - a * a) ** 0.5 * torch.randn(N, 5, generator=g, dtype=torch.float64)
            layers.append(
                zi @ torch.randn(5, p, generator=g, dtype=torch.float64)
                + 0.3 * torch.randn(N, p, generator=g, dtype=torch.float64)
            )
        layers = [x + 300 * torch.randn(p, generator=g, dtype=torch.float64) for x in layers]
    dt = torch.bfloat16 if kind == "bf16" else torch.float32
    layers = [x.to(dt) for x in layers]
    return [[x[b * n : (b + 1) * n] for x in layers] for b in range(batches)]


@pytest.mark.parametrize("kind", ["random", "lowrank_offset", "bf16"])
@pytest.mark.parametrize("unbiased", [True, False])
def test_float32_centred_grams_agree_with_float64(kind, unbiased):
    batches = _layers(kind, torch.Generator().manual_seed(6))
    ref = old_minibatch_cka(batches, unbiased)
    m = MinibatchCKA(unbiased)
    for b in batches:
        m.update(b)
    new = m.compute()
    assert new.dtype == torch.float64
    # |CKA| <= 1: 1e-8 absolute everywhere, and relative on entries >= 0.1 (near 0, as for independent layers
    # under HSIC_1, a relative error only measures the cancellation in the reference itself) within 2e-8: OpenBLAS's
    # float32 syrk rounds each Gram entry ~1.4x as much as torch's float32 mm (RMS, measured at n = 256, p = 600),
    # which put the biased 'random' case at 1.4e-8 relative (8.7e-9 absolute)
    d, big = (new - ref).abs(), ref.abs() >= 0.1
    assert d.max() < 1e-8 and (d[big] / ref.abs()[big]).max() < 2e-8
    assert ref.min() < 0.65 and ref[ref < 0.999].max() > 0.6  # not a degenerate case: related and less related layers
    if kind == "lowrank_offset":  # where centring matters: float32 Grams of the raw features are far off
        raw = torch.stack([(x.reshape(len(x), -1) @ x.reshape(len(x), -1).T).double() for x in batches[0]])
        u = torch.stack([center_unbiased(k) for k in raw]).reshape(4, -1)
        naive = (u @ u.T) / torch.sqrt(torch.diagonal(u @ u.T)[:, None] * torch.diagonal(u @ u.T)[None, :])
        one = old_minibatch_cka(batches[:1])
        assert (naive - one).abs().max() > 1e-5  # 1,000x the tolerance above


def test_centred_gram_uses_float32_syrk_without_a_float64_copy(monkeypatch):
    """Without torch's MKL (ARM, macOS) on CPU, float32 features of >= 256 columns go through scipy's ssyrk (one
    triangle, float32), one chunk at a time, with one thread; small or float64 inputs through dsyrk."""
    import scipy.linalg.blas as B

    from analysis.estimators import similarity as C

    seen = []

    def spy(name):
        real = getattr(B, name)

        def f(alpha, a, *args, **kw):
            seen.append((name, a.dtype.name, a.shape))
            return real(alpha, a, *args, **kw)

        return f

    monkeypatch.setattr(B, "ssyrk", spy("ssyrk"))
    monkeypatch.setattr(B, "dsyrk", spy("dsyrk"))
    monkeypatch.setattr(C, "_CHUNK_ELEMENTS", 64 * 100)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        x = torch.randn(64, 300) + 3
        k = C._centred_gram(x)
        assert seen == [("ssyrk", "float32", (100, 64))] * 3  # 3 chunks, each [cols, n] column-major
        xc = x.double() - x.double().mean(0)
        assert (k - xc @ xc.T).abs().max() < 1e-5 * (xc @ xc.T).abs().max()
        seen.clear()
        C._centred_gram(torch.randn(64, 300, dtype=torch.float64))
        C._centred_gram(torch.randn(64, 50))
        assert {(name, d) for name, d, _ in seen} == {("dsyrk", "float64")}
        seen.clear()
        torch.set_num_threads(2)  # torch's own pool (whole products), no second BLAS pool beside it
        C._centred_gram(torch.randn(64, 300))
        assert seen == []
    finally:
        torch.set_num_threads(threads)


def test_openblas_syrk_forms_exactly_the_upper_triangle():
    """scipy's ?syrk through its public interface, on small integers (every product and sum exact): the upper
    triangle of A A^T in the column-major view, the rest untouched."""
    from analysis.estimators import similarity as C

    for dt in (torch.float32, torch.float64):
        a = torch.arange(15, dtype=dt).reshape(3, 5) - 7
        c = torch.zeros(3, 3, dtype=dt)
        C._openblas_syrk(dt, a, c)
        assert torch.equal(c.T.triu(), (a @ a.T).triu()) and not c.T.tril(-1).any()


def test_blocked_gram_multiplies_only_the_upper_block_triangle(monkeypatch):
    """The path for devices without syrk (CUDA): 4 block rows x rows r.. per chunk, float32, and the same Gram."""
    from analysis.estimators import similarity as C

    seen = []
    real_mm = torch.mm

    def spy(a, b, *args, **kw):
        seen.append((a.dtype, tuple(a.shape)))
        return real_mm(a, b, *args, **kw)

    class OnCuda:  # only the device is read from it: the blocked form is the CUDA one
        def __init__(self, t):
            self.t, self.shape, self.device = t, t.shape, torch.device("cuda")

        def __getitem__(self, i):
            return self.t[i]

    x = torch.randn(64, 300) + 3
    ref = C._centred_gram(x)
    monkeypatch.setattr(torch, "mm", spy)
    monkeypatch.setattr(C, "_CHUNK_ELEMENTS", 64 * 100)
    buf = torch.empty(64 * 100)
    monkeypatch.setattr(torch, "zeros", lambda *a, device=None, **kw: torch.empty(*a, **kw).zero_())
    m = x.mean(0)  # the exact mean as the shift: no double centring needed to compare with the centred Gram
    k = C._upper_gram_blocked(OnCuda(x), buf, 100, m)
    assert seen == [(torch.float32, (16, 100))] * 12  # 3 chunks x 4 block rows (the upper block triangle)
    seen.clear()
    C._upper_gram_blocked(x, buf, 100, m)  # CPU: one product per chunk
    assert seen == [(torch.float32, (64, 100))] * 3
    k = k.triu() + k.triu(1).T
    assert (k - ref).abs().max() < 1e-5 * ref.abs().max()


@pytest.mark.parametrize("n", [5, 64, 70, 255, 256])
def test_centred_gram_from_its_upper_triangle_is_the_whole_symmetric_gram(n):
    """Only the upper triangle is formed and the rest mirrored: the result equals the float64 centred X X^T
    everywhere (any n, a shorter last chunk included) and is exactly symmetric."""
    from analysis.estimators import similarity as C

    g = torch.Generator().manual_seed(n)
    x = torch.randn(n, 700, generator=g) + 3
    xc = x.double() - x.double().mean(0)
    k = C._centred_gram(x)
    assert torch.equal(k, k.T)
    assert (k - xc @ xc.T).abs().max() < 1e-5 * (xc @ xc.T).abs().max()  # float32 products


def test_blas_threads_follow_torch_and_are_restored():
    """scipy's BLAS runs torch's thread count inside the Gram and its own count again after."""
    from threadpoolctl import threadpool_info

    from analysis.estimators.similarity import _BlasThreads

    before = [i["num_threads"] for i in threadpool_info() if i["user_api"] == "blas"]
    t = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        with _BlasThreads():
            assert {i["num_threads"] for i in threadpool_info() if i["user_api"] == "blas"} == {1}
    finally:
        torch.set_num_threads(t)
    assert [i["num_threads"] for i in threadpool_info() if i["user_api"] == "blas"] == before


@pytest.mark.parametrize("unbiased", [True, False])
def test_both_centrings_ignore_a_shift_of_the_features(unbiased):
    """U(K) and HKH are unchanged by X -> X - 1 m^T for any m (K gains -a1^T - 1a^T + c11^T), diagonal included."""
    from analysis.estimators.similarity import center_biased, gram

    g = torch.Generator().manual_seed(7)
    x = torch.randn(12, 9, generator=g, dtype=torch.float64)
    m = 5 * torch.randn(9, generator=g, dtype=torch.float64)
    c = center_unbiased if unbiased else center_biased
    assert torch.allclose(c(gram(x - m)), c(gram(x)), rtol=0, atol=1e-12)
    assert not torch.allclose(gram(x - m), gram(x), rtol=0, atol=1e-3)


def test_centred_gram_is_mean_centred_whatever_the_first_rows_shift():
    """The shift comes from the first rows only; the double centring in float64 must still give the Gram of the
    mean-centred features when those rows are far from the mean (a sorted minibatch), and CKA must not move."""
    from analysis.estimators import similarity as C

    g = torch.Generator().manual_seed(3)
    x = torch.randn(64, 900, generator=g) + 5
    x[:16] += 40  # the first 16 rows (the shift's) sit far from the column means
    xc = x.double() - x.double().mean(0)
    ref = xc @ xc.T
    k = C._centred_gram(x)
    assert torch.equal(k, k.T)
    assert (k - ref).abs().max() < 1e-5 * ref.abs().max()
    y = torch.randn(64, 900, generator=g) + x
    assert abs(C.cka(x, y) - C.cka(x.double(), y.double())) < 1e-6


@pytest.mark.parametrize("unbiased", [True, False])
def test_a_representation_constant_up_to_rounding_has_no_cka_on_any_host(unbiased):
    """Rows computed from one input differ by a few float32 roundings depending on where a BLAS kernel puts them
    (host, threads, processes); CKA of that noise was NaN on one host and ~1 on another. Below CONSTANT_SPREAD of
    its size a representation is constant: HSIC exactly 0, CKA NaN, in every path; a small real spread is kept."""
    from analysis.estimators.similarity import CONSTANT_SPREAD, hsic_gram

    g = torch.Generator().manual_seed(3)
    y = torch.randn(32, 300, generator=g)
    row = torch.randn(300, generator=g) * 5
    for rel in (0.0, 6e-8, 1e-6):  # exact copies, one ulp, a few roundings compounded
        const = row + rel * 5 * torch.randn(32, 300, generator=g)
        assert not hsic_gram(const, unbiased)[0].any()
        assert torch.isnan(torch.tensor(cka(const, y, unbiased)))
        m = MinibatchCKA(unbiased)
        m.update([const, y])
        out = m.compute()
        assert torch.isnan(out[0]).all() and out[1, 1] == pytest.approx(1.0)
    small = row + 100 * CONSTANT_SPREAD * 5 * torch.randn(32, 300, generator=g)  # 1e-3 of its size: real
    assert hsic_gram(small, unbiased)[0].abs().sum() > 0
    centred = small.double() - small.double().mean(0)  # the textbook formula loses the spread to the mean otherwise
    assert cka(small, y, unbiased) == pytest.approx(ref_cka(centred, y.double(), unbiased), abs=1e-6)
