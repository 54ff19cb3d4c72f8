"""All-pairs minibatch CKA over the default ViT's layers: vitlab's MinibatchCKA (each Gram once per minibatch,
all pairs from one matrix product) vs a loop over layer pairs that recomputes both Grams for every pair.

    .venv/bin/python bench/cka_speed.py [--images 2048] [--batch 256]

Representations come from the default recipe's ViT (every block's attention and MLP outputs: 12 layers, all
tokens flattened) on Fashion-MNIST analysis images, streamed minibatch by minibatch, so only the CKA algebra
is timed. Peak memory is measured in fresh subprocesses for 512, 1024 and 2048 images (ru_maxrss): it must
stay flat, since only one minibatch of representations and the [L, L] sums are held at a time.
"""
from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from analysis.similarity import MinibatchCKA, center_unbiased, gram, represent  # noqa: E402
from analysis.suite import cka_layers  # noqa: E402
from analysis.taps import Taps  # noqa: E402
from train.data import build_data  # noqa: E402
from train.models import build_model  # noqa: E402
from train.recipe import load_recipe  # noqa: E402


def minibatches(images: int, batch: int):
    r = load_recipe("recipes/default.yaml", [f"data.analysis_size={images}"])
    data = build_data(r)
    torch.manual_seed(0)
    model = build_model(r, data.num_classes).eval()
    layers = [t for t, _ in cka_layers(model)]
    for j in range(0, images, batch):
        with torch.no_grad(), Taps(model, layers) as cap:
            model(data.normalize(data.analysis.images[j:j + batch]))
        yield [represent(cap[t]) for t in layers]


def naive_update(sums, reps):
    """For every pair (i, j): both Grams recomputed, centred, HSIC summed — the straightforward loop."""
    L, n = len(reps), reps[0].shape[0]
    for i in range(L):
        for j in range(L):
            ki, kj = center_unbiased(gram(reps[i])), center_unbiased(gram(reps[j]))
            sums["xy"][i, j] += (ki * kj).sum() / (n * (n - 3))
            if i == j:
                sums["xx"][i] += (ki * ki).sum() / (n * (n - 3))


def timed(images: int, batch: int) -> dict:
    fast, t_fast, t_naive = MinibatchCKA(), 0.0, 0.0
    sums = None
    for reps in minibatches(images, batch):
        if sums is None:
            L = len(reps)
            sums = {"xy": torch.zeros(L, L, dtype=torch.float64), "xx": torch.zeros(L, dtype=torch.float64)}
        t0 = time.perf_counter()
        fast.update(reps)
        t1 = time.perf_counter()
        naive_update(sums, reps)
        t_naive += time.perf_counter() - t1
        t_fast += t1 - t0
    naive = sums["xy"] / torch.sqrt(sums["xx"][:, None] * sums["xx"][None, :])
    return {"fast_s": t_fast, "naive_s": t_naive, "speedup": t_naive / t_fast,
            "max_abs_diff": float((fast.compute() - naive).abs().max()), "layers": len(sums["xx"])}


def peak_rss(images: int, batch: int) -> float:
    fast = MinibatchCKA()
    for reps in minibatches(images, batch):
        fast.update(reps)
    fast.compute()
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # MiB


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--images", type=int, default=2048)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--peak-only", type=int, default=0, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.peak_only:
        print(peak_rss(a.peak_only, a.batch))
        return
    res = timed(a.images, a.batch)
    res["images"], res["batch"] = a.images, a.batch
    res["peak_rss_mib"] = {}
    for n in (512, 1024, 2048):
        out = subprocess.run([sys.executable, __file__, "--peak-only", str(n), "--batch", str(a.batch)], capture_output=True, text=True, check=True)
        res["peak_rss_mib"][n] = round(float(out.stdout.strip().splitlines()[-1]), 1)
    print(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
