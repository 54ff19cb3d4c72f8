"""All-pairs minibatch CKA (12 layers, unbiased HSIC_1): vitlab's MinibatchCKA against the float64 algorithm it
replaced, a numpee/CKA.pytorch-style computation and two floors (the half and the full float32 Grams), at three
widths, with peak memory and the host's CPU flags.

    .venv/bin/python bench/cka_speed.py [--images 2048] [--vitb-images 512] [--batch 256] [--threads 1 2]
        [--repeats 3] [--widths default vits vitb] [--smoke]

Variants, each over the same stream of minibatches (only the CKA algebra is timed, never the features):

- ``new``:    :class:`analysis.estimators.similarity.MinibatchCKA` (Grams of mean-centred features, float32 products
summed in float64, one triangle of each by BLAS ssyrk, all pairs from one product of centred Grams);
- ``old``:    the float64 algorithm it replaced (each layer copied to float64, K = X X^T, same pair product);
- ``numpee``: the method of numpee/CKA.pytorch (github.com/numpee/CKA.pytorch), reimplemented here: a float32
              Gram per layer per minibatch (its forward hooks), then HSIC_1 of every (i, j) pair from a batched
              product of the two zero-diagonal Grams (n^3 per pair), float32 throughout;
- ``half``:   the floor: one triangle of X X^T in float32 for every layer by BLAS ssyrk (a symmetric rank-k
              update, n^2 p / 2 multiply-adds, scipy's OpenBLAS), on the raw features, and nothing else: no
              method that forms the Grams beats it. It is a floor of time, not a method: its Grams, U-centred and
              summed in float64, give CKA ~4e-7 from float64 on features with large channel means (printed as
              ``half`` under agreement), where vitlab's centred products stay within 1e-8;
- ``full``:   the whole X X^T in float32 for every layer (torch.mm), the floor of methods that form all of it.

``old`` runs once per width (at the first thread count, outside the rotation: at the ViT widths it takes minutes),
for the agreement figures and its one timing.

Widths: ``default`` = the default recipe's ViT (every block's attention and MLP outputs, 50 tokens x 96, all
tokens flattened) on Fashion-MNIST analysis images; ``vits`` = a ViT-S/16-like width (197 tokens x 384) and
``vitb`` = a ViT-B/16-like width (197 x 768), synthetic: low-rank token features shared between layers, noise and
large per-channel means (a forward pass of a real ViT over 2,048 images takes minutes on CPU). Timings do not
depend on the values; the agreement figures (``new`` and ``numpee`` vs ``old``) do. Two synthetic ``vits``
minibatches (one ``vitb``: 1.9 GB each) are cycled to make up the images; ``vitb`` runs over ``--vitb-images``.

Threads are pinned (torch.set_num_threads and the OpenMP / MKL environment) and the settings are interleaved:
for each repeat, each thread count, each width, the variants run in an order rotated by one at every repeat, so
that machine noise (this is a shared machine) hits all alike; each figure is the minimum over repeats. Peak
memory (VmHWM of a fresh process streaming minibatches through ``new`` or ``old``) must stay flat in the
number of images. The CPU model and its SIMD flags (AVX2, AVX-512, BF16, AMX change the figures) come first;
the last lines, one per width and thread count, start with ``RATIO``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys


def _pin_threads_env() -> None:
    """Before torch starts its OpenMP / MKL pools: size them for the largest --threads asked for (set_num_threads
    then picks the count for each measurement within them), so that no library runs more threads than measured."""
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    pre.add_argument("--smoke", action="store_true")
    a, _ = pre.parse_known_args()
    n = 1 if a.smoke else max(a.threads)
    for k in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ[k] = str(n)


if __name__ == "__main__":
    _pin_threads_env()

import platform  # noqa: E402
import re  # noqa: E402
import resource  # noqa: E402
import subprocess  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from analysis.estimators.similarity import MinibatchCKA, _BlasThreads, center_unbiased, represent  # noqa: E402

VARIANTS = ("new", "numpee", "half", "full")  # rotated; "old" once
WIDTHS = {"default": (50, 96), "vits": (197, 384), "vitb": (197, 768)}
SMOKE_WIDTHS = {"default": (10, 32), "vits": (20, 64), "vitb": (20, 128)}
DISTINCT = {"default": 2, "vits": 2, "vitb": 1}  # synthetic minibatches cycled (memory)


def cpu_flags() -> str:
    """'model name; flags: avx2 avx512f ...' from /proc/cpuinfo (the SIMD flags that change these figures)."""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return f"{platform.processor() or platform.machine()}; flags: unknown (no /proc/cpuinfo)"
    model = re.search(r"^model name\s*:\s*(.+)$", info, re.M)
    flags = re.search(r"^flags\s*:\s*(.+)$", info, re.M)
    simd = sorted(f for f in (flags.group(1).split() if flags else []) if re.match(r"(avx2|avx512|amx|fma$|.*bf16)", f))
    name = model.group(1).strip() if model else platform.machine()
    return f"{name}; flags: {' '.join(simd) or 'none of avx2, avx512*, amx*, *bf16'}"


# ---------------------------------------------------------------- features


def model_minibatches(images: int, batch: int):
    """[n, 4800] representations of the default ViT's 12 sublayer outputs, minibatch by minibatch."""
    from analysis.engine.taps import Taps
    from train.data import build_data
    from train.models import build_model
    from train.recipe import load_recipe

    r = load_recipe("recipes/default.yaml", [f"data.analysis_size={images}"])
    data = build_data(r)
    torch.manual_seed(0)
    model = build_model(r, data.num_classes).eval()
    layers = [
        f"blocks.{i}.{k}" for i in range(len(model.blocks)) for k in ("attn_out", "out")
    ]  # the CKA measure's layers
    for j in range(0, images, batch):
        with torch.no_grad(), Taps(model, layers) as cap:
            model(data.normalize(data.analysis.images[j : j + batch]))
        yield [represent(cap[t]) for t in layers]


def synthetic_minibatch(n: int, tokens: int, dim: int, seed: int, layers: int = 12) -> list[torch.Tensor]:
    """A residual-stream-like stack of [n, tokens * dim] float32 layers: each layer adds a rank-16 update of the
    tokens to the previous one, plus noise; a few channels carry large means (as in trained ViTs)."""
    g = torch.Generator().manual_seed(seed)
    mean = torch.zeros(dim)
    mean[torch.randperm(dim, generator=g)[:4]] = 30.0
    h = torch.randn(n, tokens, dim, generator=g)
    out = []
    for _ in range(layers):
        z = torch.randn(n, tokens, 16, generator=g)
        h = h + z @ torch.randn(16, dim, generator=g) / 4 + 0.3 * torch.randn(n, tokens, dim, generator=g)
        out.append((h + mean).reshape(n, -1))
    return out


def feature_stream(width: str, images: int, batch: int, smoke: bool, distinct: int | None = 2):
    """Minibatches of per-layer features for a width: real model features for ``default`` (synthetic in smoke
    mode); synthetic ``vits``, ``distinct`` different minibatches cycled (None: a fresh one every minibatch)."""
    if width == "default" and not smoke:
        yield from model_minibatches(images, batch)
        return
    tokens, dim = (SMOKE_WIDTHS if smoke else WIDTHS)[width]
    made = {}
    for b, j in enumerate(range(0, images, batch)):
        n = min(batch, images - j)
        if distinct is None:
            yield synthetic_minibatch(n, tokens, dim, seed=b)
            continue
        if (b % distinct, n) not in made:
            made[b % distinct, n] = synthetic_minibatch(n, tokens, dim, seed=b % distinct)
        yield made[b % distinct, n]


# ---------------------------------------------------------------- the variants


class OldMinibatchCKA:
    """The float64 algorithm MinibatchCKA used before: each layer copied to float64, K = X X^T, U(K), one product."""

    def __init__(self):
        self.xy = None

    def update(self, reps):
        n = reps[0].shape[0]
        us = []
        for r in reps:
            x = r.reshape(n, -1).to(torch.float64)
            k = x @ x.T
            k.fill_diagonal_(0)
            means = k.sum(0) / (n - 2)
            means = means - means.sum() / (2 * (n - 1))
            k = k - means[:, None] - means[None, :]
            k.fill_diagonal_(0)
            us.append(k.reshape(-1))
        g = torch.stack(us)
        xy = (g @ g.T) / (n * (n - 3))
        self.xy = xy if self.xy is None else self.xy + xy

    def compute(self):
        d = torch.diagonal(self.xy)
        return self.xy / torch.sqrt(d[:, None] * d[None, :])


class NumpeeStyleCKA:
    """numpee/CKA.pytorch's computation, reimplemented: a Gram per layer in the features' dtype (float32), then for
    every (i, j) pair in groups, HSIC_1 = [tr(K~L~) + 1'K~1 1'L~1 / ((n-1)(n-2)) - 2/(n-2) 1'K~L~1] / (n(n-3)) from
    a batched product K~ L~ of the zero-diagonal Grams; self-HSIC the same way; sums in float32."""

    def __init__(self, group: int = 512, eps: float = 1e-4):
        self.group, self.eps = group, eps
        self.xy = self.xx = None

    @staticmethod
    def hsic1(k, l_):
        n = k.shape[1]
        k, l_ = k.clone(), l_.clone()
        k.diagonal(dim1=-2, dim2=-1).fill_(0)
        l_.diagonal(dim1=-2, dim2=-1).fill_(0)
        kl = torch.bmm(k, l_)
        t1 = kl.diagonal(dim1=-2, dim2=-1).sum(-1)
        t2 = k.sum((-2, -1)) * l_.sum((-2, -1)) / ((n - 1) * (n - 2))
        t3 = kl.sum((-2, -1)) * (2 / (n - 2))
        return (t1 + t2 - t3) / (n * n - 3 * n)

    def update(self, reps):
        grams = [r @ r.T for r in reps]
        L = len(grams)
        if self.xy is None:
            self.xy, self.xx = torch.zeros(L * L), torch.zeros(L)
        for s in range(0, L, self.group):
            k = torch.stack(grams[s : s + self.group])
            self.xx[s : s + len(k)] += self.hsic1(k, k) * self.eps
        for s in range(0, L * L, self.group):
            idx = range(s, min(s + self.group, L * L))
            k = torch.stack([grams[i % L] for i in idx])
            l_ = torch.stack([grams[i // L] for i in idx])
            self.xy[s : s + len(idx)] += self.hsic1(k, l_) * self.eps

    def compute(self):
        L = len(self.xx)
        return (self.xy.reshape(L, L) / torch.sqrt(self.xx[None, :] * self.xx[:, None])).double()


class FullFloor:
    """The whole float32 Grams alone."""

    def update(self, reps):
        for r in reps:
            r @ r.T

    def compute(self):
        return None


class HalfFloor:
    """One triangle of each float32 Gram alone (BLAS ssyrk on the raw features, as many threads as torch)."""

    def update(self, reps):
        from scipy.linalg.blas import ssyrk

        with _BlasThreads():
            for r in reps:
                ssyrk(1.0, r.numpy().T, trans=1)  # row-major [n, p] = column-major [p, n]: A^T A, no copy

    def compute(self):
        return None


class FloorGramsCKA(MinibatchCKA):
    """MinibatchCKA with the half floor's own Grams (raw float32 ssyrk, no centring) in place of its centred ones,
    U-centred and summed in float64 as usual: for the agreement figure only (untimed), what the floor would give as
    a CKA method."""

    def _centred(self, reps):
        from scipy.linalg.blas import ssyrk

        grams = [torch.from_numpy(ssyrk(1.0, r.numpy().T, trans=1)).double() for r in reps]
        return torch.stack([center_unbiased(k.triu() + k.triu(1).T).reshape(-1) for k in grams])


def make(variant: str):
    return {
        "new": MinibatchCKA,
        "old": OldMinibatchCKA,
        "numpee": NumpeeStyleCKA,
        "half": HalfFloor,
        "full": FullFloor,
        "half_grams": FloorGramsCKA,
    }[variant]()


def run_variant(variant: str, batches) -> tuple[float, torch.Tensor | None]:
    acc, t = make(variant), 0.0
    for reps in batches:
        t0 = time.perf_counter()
        acc.update(reps)
        t += time.perf_counter() - t0
    t0 = time.perf_counter()
    m = acc.compute()
    return t + time.perf_counter() - t0, m


# ---------------------------------------------------------------- memory


def peak_rss(width: str, variant: str, images: int, batch: int, smoke: bool) -> float:
    acc = make(variant)
    for reps in feature_stream(width, images, batch, smoke, distinct=None):
        acc.update(reps)
    acc.compute()
    try:  # this process's own high-water mark: ru_maxrss keeps the parent's peak across fork + exec on Linux
        with open("/proc/self/status") as f:
            return next(int(ln.split()[1]) for ln in f if ln.startswith("VmHWM:")) / 1024  # MiB
    except (OSError, StopIteration):
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


# ---------------------------------------------------------------- main


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--images", type=int, default=2048)
    p.add_argument("--vitb-images", type=int, default=512, help="images at the vitb width (default 512: time)")
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--widths", nargs="+", default=list(WIDTHS), choices=list(WIDTHS))
    p.add_argument(
        "--memory", type=int, nargs="*", default=[512, 1024, 2048], help="image counts for peak memory (none: skip)"
    )
    p.add_argument(
        "--smoke",
        action="store_true",
        help="tiny synthetic features, one repeat, one thread, one memory probe: checks that it runs",
    )
    p.add_argument("--peak-only", nargs=3, metavar=("WIDTH", "VARIANT", "IMAGES"), help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.smoke:
        a.images, a.vitb_images, a.batch, a.threads, a.repeats, a.memory = 64, 64, 32, [1], 1, [64]
    if a.batch < 4 or min(a.images, a.vitb_images) < a.batch:
        p.error(
            f"--batch {a.batch} with --images {a.images} / --vitb-images {a.vitb_images}: use a batch of at least 4 "
            "and at least one batch of images at every width."
        )
    return a


def time_all(a: argparse.Namespace, streams: dict) -> tuple[dict, dict]:
    """Every variant at every thread count and width, rotated per repeat; ``old`` once per width."""
    times = {(w, t, v): [] for w in a.widths for t in a.threads for v in (*VARIANTS, "old")}
    results = {}
    for w in a.widths:
        torch.set_num_threads(a.threads[0])
        s, results[w, "old"] = run_variant("old", streams[w])
        times[w, a.threads[0], "old"].append(s)
        print(f"# threads {a.threads[0]} {w}: old={s:.3f}s (once)", flush=True)
    for rep in range(a.repeats):
        for t in a.threads:
            torch.set_num_threads(t)
            for w in a.widths:
                order = VARIANTS[rep % len(VARIANTS) :] + VARIANTS[: rep % len(VARIANTS)]
                for v in order:
                    s, results[w, v] = run_variant(v, streams[w])
                    times[w, t, v].append(s)
                print(
                    f"# repeat {rep} threads {t} {w}: " + " ".join(f"{v}={times[w, t, v][-1]:.3f}s" for v in order),
                    flush=True,
                )
    return times, results


def peak_memory(a: argparse.Namespace) -> dict:
    """VmHWM of fresh processes streaming minibatches through new and old (the widths up to vits)."""
    out = {}
    widths = [w for w in a.widths if w != "vitb"]
    for w in widths[:1] if a.smoke else widths:
        for v in ("new",) if a.smoke else ("new", "old"):
            for n in a.memory:
                cmd = [sys.executable, __file__, "--peak-only", w, v, str(n), "--batch", str(min(a.batch, n))]
                res = subprocess.run(
                    cmd + (["--smoke"] if a.smoke else []),
                    capture_output=True,
                    text=True,
                    check=True,
                    env={**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"},
                )
                out[f"{w}/{v}/{n}"] = round(float(res.stdout.strip().splitlines()[-1]), 1)
    return out


def main() -> None:
    a = parse_args()
    if a.peak_only:
        torch.set_num_threads(1)
        print(peak_rss(a.peak_only[0], a.peak_only[1], int(a.peak_only[2]), a.batch, a.smoke))
        return
    print(f"# cpu: {cpu_flags()}", flush=True)
    with _BlasThreads():  # its one-time library scan (0.1-0.4 s) outside the timings
        pass
    images = {w: a.vitb_images if w == "vitb" else a.images for w in a.widths}
    streams = {w: list(feature_stream(w, images[w], a.batch, a.smoke, DISTINCT[w])) for w in a.widths}
    times, results = time_all(a, streams)
    out = {
        "cpu": cpu_flags(),
        "images": images,
        "batch": a.batch,
        "repeats": a.repeats,
        "layers": len(streams[a.widths[0]][0]),
        "load_avg_1min": round(os.getloadavg()[0], 2),
        "seconds_min": {},
        "agreement_vs_old": {},
    }
    for w in a.widths:
        ref = results[w, "old"]
        big = ref.abs() >= 0.1
        results[w, "half"] = run_variant("half_grams", streams[w])[1]
        for v in ("new", "numpee", "half"):
            d = (results[w, v] - ref).abs()
            out["agreement_vs_old"][f"{w}/{v}"] = {
                "max_abs": float(d.max()),
                "max_rel_where_abs_ge_0.1": float((d[big] / ref.abs()[big]).max()),
            }
        for t in a.threads:
            out["seconds_min"][f"{w}/{t}thr"] = {
                v: round(min(times[w, t, v]), 4) for v in (*VARIANTS, "old") if times[w, t, v]
            }
    del streams
    out["peak_rss_mib"] = peak_memory(a)
    print(json.dumps(out, indent=1))
    old = {w: out["seconds_min"][f"{w}/{a.threads[0]}thr"]["old"] for w in a.widths}
    for w in a.widths:
        for t in a.threads:
            s = out["seconds_min"][f"{w}/{t}thr"]
            half = s["half"]
            print(
                f"RATIO cka {w} threads={t}: new/half={s['new'] / half:.3f} new/full={s['new'] / s['full']:.3f} "
                f"numpee/new={s['numpee'] / s['new']:.2f} old/new={old[w] / s['new']:.2f} new={s['new']:.3f}s "
                f"max_abs_vs_old={out['agreement_vs_old'][f'{w}/new']['max_abs']:.1e} "
                f"(half's Grams as CKA: {out['agreement_vs_old'][f'{w}/half']['max_abs']:.1e})"
            )


if __name__ == "__main__":
    main()
