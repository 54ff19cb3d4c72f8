"""Centered kernel alignment (CKA) between layer representations (Raghu et al. 2021 Fig. 1, 2, 8, 12).

Definitions (Kornblith et al. 2019; minibatch form of Nguyen et al. 2021). For a minibatch of n >= 4 examples,
X [n, p] and Y [n, q] are two layers' representations, K = X X^T and L = Y Y^T their linear Gram matrices,
and K~, L~ the Grams with zeroed diagonals. The unbiased HSIC estimator (Song et al. 2012) is

    HSIC_1(K, L) = 1 / (n (n - 3)) * [ tr(K~ L~) + (1^T K~ 1)(1^T L~ 1) / ((n - 1)(n - 2)) - 2/(n - 2) 1^T K~ L~ 1 ].

It equals <U(K), U(L)>_F / (n (n - 3)) with U the "unbiased centring" of a Gram (zero the diagonal, subtract
row/column means with the n - 2 / 2(n - 1) corrections, zero the diagonal again), which lets every layer pair
come from one matrix product of the flattened U's. Over minibatches b,

    CKA(X, Y) = sum_b HSIC_1(K_b, L_b) / sqrt( sum_b HSIC_1(K_b, K_b) * sum_b HSIC_1(L_b, L_b) ).

The biased form (``unbiased=False``) uses HSIC_0 = tr(K H L H) / (n - 1)^2 with H = I - 11^T/n. Both are
unchanged when each layer's features are mean-centred over the minibatch first, so Grams are computed from
centred features, as float32 products summed in float64 (:func:`_centred_gram`; ~1e-9 from the all-float64
result); every other sum is float64. A layer's representation of one image is, by choice, all tokens flattened
(default), the CLS token, or the mean of the spatial tokens (:func:`represent`).
"""

from __future__ import annotations

import torch

from analysis.engine.reduce import all_reduce_tree


def represent(t: torch.Tensor, how: str = "flatten", num_prefix_tokens: int = 1) -> torch.Tensor:
    """[B, T, D] tokens (or [B, C, H, W] feature maps) -> [B, p]: 'flatten' (all tokens), 'cls' (token 0),
    'mean_spatial' (mean over spatial tokens / positions)."""
    if t.ndim == 4:  # ResNet feature map: positions are the tokens
        t = t.flatten(2).transpose(1, 2)
        num_prefix_tokens = 0
    if how == "flatten":
        return t.reshape(t.shape[0], -1)
    if how == "cls":
        if num_prefix_tokens == 0:
            raise ValueError(
                "representation 'cls' needs a class token; this model has none (GAP ViT or ResNet): "
                "use 'mean_spatial' or 'flatten'."
            )
        return t[:, 0]
    if how == "mean_spatial":
        return t[:, num_prefix_tokens:].mean(1)
    raise ValueError(f"unknown representation '{how}': choose flatten, cls or mean_spatial.")


def gram(x: torch.Tensor) -> torch.Tensor:
    """K = X X^T in float64 (the plain definition; CKA itself uses :func:`_centred_gram`)."""
    x = x.reshape(x.shape[0], -1).to(torch.float64)
    return x @ x.T


# Elements per chunk in _centred_gram (16 MiB of float32; p is cut into equal chunks of at most this many n x cols
# elements), so a chunk is centred into a buffer that is still in cache when it is multiplied; centring all of X
# into a buffer first costs 1.4x (memory traffic). With a syrk on the Intel host, alone, minibatches of 256, as
# multiples of the raw syrk at 1 / 2 threads: 4 MiB 1.29 / 1.46x, 8 MiB 1.24 / 1.33x, 16 MiB 1.25 / 1.29x, 32 MiB
# 1.27 / 1.28x at a ViT-S/16 width; 1.18 / 1.25x (8 MiB) against 1.18 / 1.21x (16 MiB) at ViT-B/16. (With OpenBLAS
# beside a training run, 8 MiB had beaten 4 MiB: 1.21x against 1.31x at ViT-S/16.)
_CHUNK_ELEMENTS = 1 << 22
# Rows whose mean is the shift subtracted before the float32 products (:func:`_centred_gram`): about 1/16 of the
# centred energy added on average (rows in random order), for a read of 16 rows instead of a pass over X.
_SHIFT_ROWS = 16
# Below this many features per example the whole Gram is cheap (about 0.3 ms at n = 256, p = 96 in float64, one
# thread), so it stays float64 there, exact as before; float32 products (~1e-9 relative on CKA) only where they pay.
_FLOAT32_MIN_FEATURES = 256
# K is symmetric, so only one triangle needs forming: on CPU at one thread a symmetric rank-k update (BLAS ?syrk,
# scipy's OpenBLAS through scipy's public interface) forms the upper triangle alone, n^2 p / 2 multiply-adds, about
# half the time of X X^T. With more threads a second thread pool (OpenBLAS's beside torch's spinning OpenMP workers)
# oversubscribed the cores (at 2 threads on a loaded 2-core host, 4-20x slower than one thread), so there, and on
# CUDA (torch exposes no syrk), torch's own products form it. (An MKL syrk reached inside torch's library through
# ctypes was removed: a private symbol, worth under 10% of a ViT-S/16 analysis: docs/scaling.md.) On
# CUDA only the upper block triangle is multiplied: rows cut into this many blocks, block row r times rows r.. (the
# diagonal block and those right of it), (B + 1) / 2B of the full product's flops: 0.625 at 4. On CPU each chunk is
# one whole product: every block product is a parallel region ending in a barrier, and on the loaded 2-core host
# the blocked form took 5-15x the time of one X X^T at 2 threads (a descheduled thread stalls each barrier).
# Below the minimum row count the product is too small for blocking to pay.
_GRAM_ROW_BLOCKS = 4
_GRAM_BLOCKED_MIN_ROWS = 64


class _BlasThreads:
    """scipy's BLAS (OpenBLAS) runs as many threads as torch does here (its pool is sized separately from torch's):
    set on entry only when it differs, restored on exit. The threadpoolctl controller is made once (it scans the
    loaded libraries)."""

    _controller = None

    def __enter__(self):
        import scipy.linalg.blas  # noqa: F401  (loaded before the controller scans for BLAS libraries)
        from threadpoolctl import ThreadpoolController

        if _BlasThreads._controller is None:
            _BlasThreads._controller = ThreadpoolController()
        blas = _BlasThreads._controller.select(user_api="blas")
        want = torch.get_num_threads()
        self._limit = None if all(i["num_threads"] == want for i in blas.info()) else blas.limit(limits=want)
        return self

    def __exit__(self, *exc):
        if self._limit is not None:
            self._limit.restore_original_limits()


@torch.no_grad()  # out= buffers; nothing here differentiates CKA
def _centred_gram(x: torch.Tensor, exact: bool = True) -> torch.Tensor:
    """K_c = (X - 1 m^T)(X - 1 m^T)^T, float64 [n, n], with m the column means of this minibatch's X [n, p].

    Centring does not change CKA: K_c = K - a 1^T - 1 a^T + c 11^T (a = X m, c = m^T m), and both centrings kill
    every such term exactly: for the unbiased U (:func:`center_unbiased`), on i != j, a_i + a_j and c give row sums
    of the zero-diagonal Gram r_i = (n - 2) a_i + sum(a) and (n - 1) c, which U's corrections cancel to 0, and the
    diagonal is zeroed; for the biased H K H, H 1 = 0. (Any m would do; the mean makes the entries small.)

    Why centre: a float32 Gram of raw features with large means loses the small centred part to rounding, while
    with m near the mean, X - m is exact where X and m are close (Sterbenz) and small elsewhere, so float32 products
    keep ~1e-7 relative precision on what CKA sees. The shift is the mean of the first ``_SHIFT_ROWS`` rows (a
    read of 16 rows instead of a pass over X), subtracted from each chunk as it is copied into a small float32
    buffer (one fused pass: copying, taking the chunk's mean and subtracting it in place made three, and at a
    minibatch of 256 a pass over X costs ~15% of the Gram itself); the Gram of X - 1 s^T is then double-centred in
    float64, H K_s H = K_c exactly (the rows' residual mean is read from K_s's row sums), so the result is the
    mean-centred Gram (``exact=False`` skips that step for callers that centre the Gram themselves: U and H K H
    remove the shift's terms exactly, as above). The chunks are multiplied in float32 and added to a float64 sum,
    so no float64 (or full float32) copy of X is ever made and float32 rounding accumulates over at most one chunk.
    Only the upper triangle of each chunk's product is formed (BLAS syrk on CPU with one torch thread,
    ``_GRAM_ROW_BLOCKS`` otherwise) and mirrored at the end. float64 inputs, and inputs with fewer than
    ``_FLOAT32_MIN_FEATURES`` features, are computed in float64.
    """
    n = x.shape[0]
    x = x.reshape(n, -1)
    p = x.shape[1]
    dt = torch.float64 if x.dtype == torch.float64 or p < _FLOAT32_MIN_FEATURES else torch.float32
    chunks = -(-p * n // _CHUNK_ELEMENTS)
    cols = -(-p // chunks)  # equal chunks
    buf = torch.empty(n * cols, dtype=dt, device=x.device)
    shift = x[:_SHIFT_ROWS].to(dt).mean(0)  # near the column means: the Gram of X - shift keeps float32 precision
    cpu_syrk = torch.get_num_threads() == 1  # comment at _GRAM_ROW_BLOCKS
    upper = _upper_gram_syrk if x.device.type == "cpu" and cpu_syrk else _upper_gram_blocked
    k = upper(x, buf, cols, shift)
    k = k.triu() + k.triu(1).T  # the upper triangle (all computed) mirrored: K exactly symmetric
    if not exact:
        return k
    r = k.mean(1)  # (X - 1 s^T) d with d the residual column mean; H K H = K - r 1^T - 1 r^T + mean(r) 11^T
    return k - ((r[:, None] + r[None, :]) - r.mean())  # the correction is symmetric term by term: K stays so


def _centred_chunk(x: torch.Tensor, buf: torch.Tensor, c: int, cols: int, shift: torch.Tensor) -> torch.Tensor:
    """Columns c:c + cols of ``x`` [n, p] minus ``shift``'s, in ``buf`` (contiguous [n, w]), in one pass over the
    chunk (float64 buffers copy first, so that the subtraction is float64 as well)."""
    xc = x[:, c : c + cols]
    b = buf[: xc.numel()].view(x.shape[0], xc.shape[1])  # contiguous, also for a shorter last chunk
    if b.dtype == torch.float64 and xc.dtype != torch.float64:
        return b.copy_(xc).sub_(shift[c : c + cols])
    return torch.sub(xc, shift[c : c + cols], out=b)


def _upper_gram_syrk(x: torch.Tensor, buf: torch.Tensor, cols: int, shift: torch.Tensor) -> torch.Tensor:
    """The upper triangle of the centred Gram by scipy's BLAS ?syrk (one thread), chunk by chunk (the lower triangle
    is left 0). Each syrk writes the row-major lower triangle of ``g`` (:func:`_openblas_syrk`), added contiguously
    to the float64 sum, whose transpose is the upper triangle."""
    n, p = x.shape
    k = torch.zeros(n, n, dtype=torch.float64)
    g = torch.zeros(n, n, dtype=buf.dtype)
    with _BlasThreads():
        for c in range(0, p, cols):
            _openblas_syrk(buf.dtype, _centred_chunk(x, buf, c, cols, shift), g)
            k += g
    return k.T  # K[i, j] for i <= j


def _openblas_syrk(dtype: torch.dtype, a: torch.Tensor, c: torch.Tensor) -> None:
    """C <- A A^T for a contiguous row-major ``a`` [n, k] by scipy's BLAS ?syrk (scipy's public interface): that
    memory is the column-major [k, n] matrix B (no copy), and trans=1 forms B^T B = A A^T's upper triangle into the
    column-major view of ``c`` [n, n], i.e. the lower triangle of row-major ``c`` (its strict upper part untouched:
    zero it once)."""
    from scipy.linalg.blas import dsyrk, ssyrk

    cn = c.numpy().T  # column-major [n, n]
    out = (ssyrk if dtype == torch.float32 else dsyrk)(1.0, a.numpy().T, beta=0.0, c=cn, trans=1, overwrite_c=1)
    if out is not cn:  # scipy writes in place into a Fortran-ordered c of the right type; if not, copy back
        cn[...] = out


def _upper_gram_blocked(x: torch.Tensor, buf: torch.Tensor, cols: int, shift: torch.Tensor) -> torch.Tensor:
    """The upper block triangle of the centred Gram by torch.mm (any device), chunk by chunk."""
    n, p = x.shape
    blocked = n >= _GRAM_BLOCKED_MIN_ROWS and x.device.type != "cpu"
    rows = -(-n // _GRAM_ROW_BLOCKS) if blocked else n  # CPU, several threads: one product per chunk (see above)
    k = torch.zeros(n, n, dtype=torch.float64, device=x.device)
    g = torch.zeros(n, n, dtype=buf.dtype, device=x.device)
    for c in range(0, p, cols):
        b = _centred_chunk(x, buf, c, cols, shift)
        for r in range(0, n, rows):  # block row r: its diagonal block and everything right of it
            torch.mm(b[r : r + rows], b[r:].T, out=g[r : r + rows, r:])
        k += g
    return k


def center_unbiased(k: torch.Tensor) -> torch.Tensor:
    """U(K): <U(K), U(L)>_F = n (n - 3) HSIC_1(K, L) (Song et al. 2012; as in Kornblith et al.'s reference code)."""
    n = k.shape[0]
    if n < 4:
        raise ValueError(f"unbiased CKA needs at least 4 examples per minibatch, got {n}: use a larger analysis batch.")
    k = k.clone()
    k.fill_diagonal_(0)
    means = k.sum(0) / (n - 2)
    means = means - means.sum() / (2 * (n - 1))
    k = k - means[:, None] - means[None, :]
    k.fill_diagonal_(0)
    return k


def center_biased(k: torch.Tensor) -> torch.Tensor:
    """H K H with H = I - 11^T/n: <HKH, HLH>_F = (n - 1)^2 HSIC_0(K, L)."""
    k = k - k.mean(0, keepdim=True)
    return k - k.mean(1, keepdim=True)


def _hsic_scale(n: int, unbiased: bool) -> float:
    return 1.0 / (n * (n - 3)) if unbiased else 1.0 / (n - 1) ** 2


# A representation whose examples differ by less than this fraction of their size (root-mean-square deviation from
# the minibatch mean over root-mean-square norm) is constant at float32 resolution: rows computed from identical
# inputs differ by a few roundings (~1e-7 each, compounded through the layers) depending on where a BLAS kernel puts
# them, which depends on the host, the thread count and the batch's split over processes. Its HSIC is taken as
# exactly 0 (so its CKA is NaN, "no representation to compare") instead of the CKA of that rounding noise, which on
# one host was NaN and on another any number in [-1, 1].
CONSTANT_SPREAD = 1e-5


def _constant(k: torch.Tensor, x: torch.Tensor) -> bool:
    """Whether the examples x [n, p] are one vector up to float32 rounding (:data:`CONSTANT_SPREAD`), read from
    their shift-centred Gram ``k`` (:func:`_centred_gram`, any shift): tr(H K H) / n is the mean squared deviation
    from the mean, compared with the mean squared norm of the first ``_SHIFT_ROWS`` rows (a constant representation's
    rows all have that norm)."""
    n = k.shape[0]
    spread = float(k.diagonal().sum() - k.sum() / n) / n
    size = float(x[:_SHIFT_ROWS].double().square().sum(1).mean())
    return spread <= CONSTANT_SPREAD**2 * size


def _hsic_ready(x: torch.Tensor, unbiased: bool) -> torch.Tensor:
    """The centred Gram U(K) or H K H of x [n, ...] (flattened per example), float64, exactly 0 for a constant x."""
    x = x.reshape(x.shape[0], -1)
    k = _centred_gram(x, exact=False)
    g = (center_unbiased if unbiased else center_biased)(k)
    return g.zero_() if _constant(k, x) else g


def hsic_gram(x: torch.Tensor, unbiased: bool = True) -> tuple[torch.Tensor, float]:
    """(G, s) for one minibatch x [n, ...] (flattened per example): G the centred linear Gram U(K) (unbiased) or
    H K H (biased), float64 [n, n], and s the scale with which Frobenius products give HSIC:
    HSIC(K, L) = s * <G_x, G_y>. CKA over minibatches is sum s<G_x, G_y> / sqrt(sum s<G_x, G_x> * sum s<G_y, G_y>).
    G is exactly 0 for a representation that is constant over the minibatch up to float32 rounding
    (:data:`CONSTANT_SPREAD`): a layer constant in every minibatch has CKA NaN, on every host and process count."""
    return _hsic_ready(x, unbiased), _hsic_scale(x.shape[0], unbiased)


def cka(x: torch.Tensor, y: torch.Tensor, unbiased: bool = True) -> float:
    """Linear CKA of one pair of full matrices x [n, p], y [n, q] (one minibatch holding every example); NaN when
    either is constant over the examples (:data:`CONSTANT_SPREAD`)."""
    if x.shape[0] != y.shape[0]:
        raise ValueError(f"cka needs the same examples in both: {x.shape[0]} vs {y.shape[0]} rows.")
    kx, ky = _hsic_ready(x, unbiased), _hsic_ready(y, unbiased)
    return float((kx * ky).sum() / torch.sqrt((kx * kx).sum() * (ky * ky).sum()))


class MinibatchCKA:
    """All-pairs minibatch CKA between the layers of one model (``ys=None``) or of two models.

    ``update(xs, ys)`` takes one minibatch: a list of per-layer representations [n, ...] (flattened per example).
    Each layer's Gram is computed once per minibatch and every pair's HSIC comes from one matrix product of the
    flattened centred Grams; HSIC sums are float64 and reduced across processes by :meth:`sync`.
    """

    def __init__(self, unbiased: bool = True):
        self.unbiased = unbiased
        self.xy: torch.Tensor | None = None  # sum_b HSIC(K_i, L_j)  [Lx, Ly]
        self.xx: torch.Tensor | None = None  # sum_b HSIC(K_i, K_i)  [Lx]
        self.yy: torch.Tensor | None = None  # sum_b HSIC(L_j, L_j)  [Ly]
        self.batches = 0
        self.self_similarity = False

    def _centred(self, reps: list[torch.Tensor]) -> torch.Tensor:
        return torch.stack([hsic_gram(r, self.unbiased)[0].reshape(-1) for r in reps])  # [L, n*n]

    @staticmethod
    def _examples(xs: list[torch.Tensor], ys: list[torch.Tensor] | None) -> int:
        """The minibatch's number of examples; ValueError (one sentence) below 4 or when the layers disagree."""
        n = xs[0].shape[0]
        if n < 4:
            raise ValueError(
                f"MinibatchCKA needs minibatches of at least 4 examples, got {n}: raise the analysis batch size."
            )
        if any(r.shape[0] != n for r in xs + (ys or [])):
            raise ValueError("every layer's representation in a minibatch must hold the same examples.")
        return n

    @torch.no_grad()
    def update(self, xs: list[torch.Tensor], ys: list[torch.Tensor] | None = None) -> None:
        n = self._examples(xs, ys)
        scale = _hsic_scale(n, self.unbiased)
        gx = self._centred(xs)
        if ys is None:
            self.self_similarity = True
            xy = (gx @ gx.T) * scale
            xx, yy = torch.diagonal(xy).clone(), torch.diagonal(xy).clone()  # two tensors: both are summed in place
        else:
            gy = self._centred(ys)
            xy = (gx @ gy.T) * scale
            xx = (gx * gx).sum(1) * scale
            yy = (gy * gy).sum(1) * scale
        if self.xy is None:
            self.xy, self.xx, self.yy = xy, xx, yy
        else:
            self.xy += xy
            self.xx += xx
            self.yy += yy
        self.batches += 1

    def sync(self, accelerator=None) -> None:
        """Sum the HSIC accumulators over processes in one all-reduce (a no-op with one process; a process that
        saw no minibatch adds zeros)."""
        state = None if self.xy is None else {"xy": self.xy, "xx": self.xx, "yy": self.yy}
        state = all_reduce_tree(state, accelerator)
        if state is not None:
            self.xy, self.xx, self.yy = state["xy"], state["xx"], state["yy"]

    def compute(self) -> torch.Tensor:
        if self.xy is None:
            raise RuntimeError("MinibatchCKA.compute() before any update().")
        return self.xy / torch.sqrt(self.xx[:, None] * self.yy[None, :])

    def state(self) -> dict:
        return {"xy": self.xy, "xx": self.xx, "yy": self.yy}
