"""The analysis suite's cost at a checkpoint against one plain forward pass over the same images.

    .venv/bin/python bench/suite_speed.py [--repeats 3] [--threads 1] [--smoke]

On the default recipe's model (random weights: the cost does not depend on them) and its data (1,024 analysis
and 2,000 probe-train images), each repeat times, in an order rotated by one at every repeat so machine noise
hits all alike, with threads pinned:

- ``forward``: one plain forward pass over the analysis and probe-train images in the suite's minibatches, no
  hooks (what any analysis must pay at least);
- ``suite``:   :func:`analysis.suite.run_suite` with the default measures (CKA, norm ratios, attention
  distances, few-shot probes), no figures -- what the training-time callback computes;
- ``figures``: drawing the suite's figures once and writing them as PNG and to a TensorBoard writer (the
  training-time callback does this in a background thread, off the training path: analysis/callbacks.py).

Each figure is the minimum over repeats. The last line starts with ``RATIO``.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

if __name__ == "__main__":
    for k in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ.setdefault(k, "1")

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from analysis import storage
from analysis.suite import run_suite, suite_options
from train.data import build_data
from train.models import build_model
from train.recipe import load_recipe


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--smoke", action="store_true", help="tiny sizes, one repeat (seconds)")
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    over = (
        [
            "data.analysis_size=64",
            "data.probe_train_size=200",
            "data.train_size=512",
            "data.eval_size=256",
            "model.depth=2",
            "model.embed_dim=32",
            "model.num_heads=2",
        ]
        if a.smoke
        else []
    )
    r = load_recipe("recipes/default.yaml", over)
    data = build_data(r, quiet=True)
    torch.manual_seed(0)
    model = build_model(r, data.num_classes).eval()
    opts = suite_options(None, 32 if a.smoke else 256)
    bs = opts.batch_size

    @torch.no_grad()
    def forward():
        for split in (data.analysis, data.probe_train):
            for j in range(0, len(split), bs):
                model(data.normalize(split.images[j : j + bs]))

    res = run_suite(model, data, opts)
    tmp = Path(tempfile.mkdtemp())
    from torch.utils.tensorboard import SummaryWriter  # deferred: only the figures variant needs it

    writer = SummaryWriter(str(tmp / "tb"))

    def figures():
        storage.publish(res, tmp / "a", writer, 0, figures=True, figure_dir=tmp / "f")

    variants = {"forward": forward, "suite": lambda: run_suite(model, data, opts), "figures": figures}
    best = {k: float("inf") for k in variants}
    names = list(variants)
    for rep in range(1 if a.smoke else a.repeats):
        for k in names[rep % len(names) :] + names[: rep % len(names)]:
            t0 = time.perf_counter()
            variants[k]()
            best[k] = min(best[k], time.perf_counter() - t0)
    writer.close()
    for k, v in best.items():
        print(f"{k:8s} {v:7.3f} s")
    print(
        f"RATIO suite threads={a.threads}: suite/forward={best['suite'] / best['forward']:.2f} "
        f"(suite+figures)/forward={(best['suite'] + best['figures']) / best['forward']:.2f}"
    )


if __name__ == "__main__":
    main()
