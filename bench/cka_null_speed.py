"""The permutation null of minibatch CKA against CKA itself: what 1,000 permutations cost at the default width and
at ViT-S/16 width, one minibatch of 256 images.

    .venv/bin/python bench/cka_null_speed.py [--images 256] [--layers 12] [--perms 1000] [--threads 1]
        [--repeats 3] [--widths default vits] [--smoke]

Two cases per width, each timed as the minimum over repeats (the variants alternate within a repeat, so that
noise on this shared machine hits both alike):

- ``map``:  a layer x layer map of ``--layers`` layers against themselves (the ``cka`` measure's case):
            :class:`MinibatchCKA` ``.update`` against :class:`PermutedMinibatchCKA` ``.update`` (same Grams, plus
            the null: every permutation's map from the permuted centred Grams);
- ``pair``: one pair of layers: :func:`cka` against :func:`permutation_test` ``(cka, x, y, n_perm)``.

Widths: ``default`` = the default recipe's ViT (recipes/default.yaml: 49 patches + CLS = 50 tokens x 96, all tokens
flattened: 4,800 features); ``vits`` = ViT-S/16 (197 tokens x 384: 75,648 features). The features are synthetic
(timings do not depend on the values); the map's layers are one tensor named ``--layers`` times (each layer's Gram
is still computed, as it would be), so that ViT-S/16 needs 77 MB, not 930 MB. The last lines, one per width and
case, start with ``RATIO`` (null + CKA over CKA alone) and the load average comes first.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

WIDTHS = {"default": (50, 96), "vits": (197, 384)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--images", type=int, default=256)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--perms", type=int, default=1000)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--widths", nargs="+", default=list(WIDTHS), choices=list(WIDTHS))
    ap.add_argument("--smoke", action="store_true", help="tiny sizes: checks that the bench runs")
    a = ap.parse_args()
    if a.smoke:
        a.images, a.layers, a.perms, a.repeats, a.widths = 16, 3, 20, 1, ["default"]
    for k in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        os.environ[k] = str(a.threads)
    import torch

    from analysis.similarity import MinibatchCKA, PermutedMinibatchCKA, cka, permutation_test

    torch.set_num_threads(a.threads)
    print(f"load average {os.getloadavg()}, {os.cpu_count()} CPUs, {a.threads} thread(s), torch {torch.__version__}")
    g = torch.Generator().manual_seed(0)
    for width in a.widths:
        tokens, dim = WIDTHS[width]
        x = torch.randn(a.images, tokens * dim, generator=g) + 3 * torch.randn(tokens * dim, generator=g)
        y = x + torch.randn(a.images, tokens * dim, generator=g)
        layers = [x] * a.layers

        def cka_map(layers=layers):
            MinibatchCKA().update(layers)

        def null_map(layers=layers):
            PermutedMinibatchCKA(n_perm=a.perms).update(layers)

        def cka_pair(x=x, y=y):
            cka(x, y)

        def null_pair(x=x, y=y):
            permutation_test(cka, x, y, n_perm=a.perms)

        cases = {"map": (cka_map, null_map), "pair": (cka_pair, null_pair)}
        best = {(c, v): float("inf") for c in cases for v in (0, 1)}
        for fns in cases.values():  # warm-up: first calls load BLAS kernels and allocate
            for f in fns:
                f()
        for r in range(a.repeats):
            for c, fns in cases.items():
                for v in (r % 2, 1 - r % 2):  # alternate which runs first
                    t = time.perf_counter()
                    fns[v]()
                    best[c, v] = min(best[c, v], time.perf_counter() - t)
        for c in cases:
            base, null = best[c, 0], best[c, 1]
            what = f"{a.layers} x {a.layers} map" if c == "map" else "one pair"
            print(
                f"RATIO {width} ({tokens} x {dim} = {tokens * dim} features, {a.images} images) {what}: CKA "
                f"{base:.3f} s, CKA + null of {a.perms} permutations {null:.3f} s: "
                f"null / CKA = {(null - base) / base:.2f}"
            )


if __name__ == "__main__":
    main()
