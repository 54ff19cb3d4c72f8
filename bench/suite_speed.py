"""The analysis suite's cost at a checkpoint against one plain forward pass over the same images.

    .venv/bin/python bench/suite_speed.py [--repeats 3] [--threads 1] [--model default|vits] [--images N] [--smoke]

On the default recipe's model (random weights: the cost does not depend on them) and its data (1,024 analysis
and 2,000 probe-train images), or with ``--model vits`` a ViT-S/16-shaped model at 224 (12 blocks x 384, 6 heads,
197 tokens; Fashion-MNIST upsampled) over ``--images`` analysis and as many probe-train images (default 512),
each repeat times, in an order rotated by one at every repeat so machine noise hits all alike, with threads
pinned:

- ``forward``: one plain forward pass over the analysis and probe-train images in the suite's minibatches, no
  hooks (the whole probe-train split: what an analysis reading every image must pay at least);
- ``intermediates``: the same as ``forward`` through timm's ``forward_intermediates``, collecting every block's
  output (what a user's own feature extraction of the same blocks costs, without the suite's other taps);
- ``forward_read``: the same over the analysis images and only the probe-train images the suite reads
  (:func:`analysis.engine.suite.probe_rows`: the few-shot probes' shots and held-out half), the floor of ``suite``;
- ``suite``:   :func:`analysis.engine.suite.run_suite` with the default measures (CKA, norm ratios, attention
  distances, few-shot probes), no figures -- what the training-time callback computes;
- ``suite_all_rows``: the same with its probe-train pass over every image (:func:`analysis.engine.suite.probe_rows`
  replaced by "all of them"), as the suite did before it forwarded only what it reads; the same results;
- ``figures``: drawing the suite's figures once and writing them as PNG and to a TensorBoard writer (the
  training-time callback does this in a background thread, off the training path: analysis/frontends/callbacks.py).

Each figure is the minimum over repeats of this process's CPU time (on a shared machine other jobs inflate wall
time far more; wall times are printed too); the median and range of suite/forward within each repeat come
before it, since a single lucky repeat moves a ratio of minima. The last line starts with ``RATIO``.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import SMOKE, VITS, default_model, pin_one_thread_env, rotated_minimum

if __name__ == "__main__":
    pin_one_thread_env()

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from analysis.engine import suite as S
from analysis.engine.suite import run_suite, suite_options
from analysis.results import publish


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--model", choices=("default", "vits", "vitb"), default="default")
    p.add_argument("--images", type=int, default=512, help="analysis and probe-train images of --model vits")
    p.add_argument("--smoke", action="store_true", help="tiny sizes, one repeat (seconds)")
    p.add_argument(
        "--max-memory",
        default="8GiB",
        help="the suite's memory budget (default 8GiB: fixed, so the minibatch plan does not follow the memory other "
        "jobs leave free)",
    )
    a = p.parse_args()
    if a.images < 4:
        p.error(f"--images {a.images}: the suite needs at least 4 analysis images.")
    torch.set_num_threads(a.threads)
    over = SMOKE if a.smoke else []
    if a.model in ("vits", "vitb") and not a.smoke:
        shape = VITS if a.model == "vits" else [*VITS, "model.embed_dim=768", "model.num_heads=12"]  # ViT-B/16
        over = [*shape, f"data.analysis_size={a.images}", f"data.probe_train_size={max(a.images, 256)}"]
    data, model = default_model(over)
    opts = suite_options(None, 32 if a.smoke else 256, max_memory=a.max_memory)
    bs = opts.batch_size

    ctx = S.make_context(model, data, bs)
    ms = S.make_measures(ctx, opts)
    read = S.probe_rows([m for m in ms if m.probe_taps()], data.probe_train)
    read_images = data.probe_train.images if read is None else data.probe_train.images[torch.as_tensor(read)]

    @torch.no_grad()
    def forward(probe_images=data.probe_train.images):
        for images in (data.analysis.images, probe_images):
            for j in range(0, len(images), bs):
                model(data.normalize(images[j : j + bs]))

    @torch.no_grad()
    def intermediates():
        blocks = list(range(len(model.blocks)))
        for images in (data.analysis.images, data.probe_train.images):
            for j in range(0, len(images), bs):
                model.forward_intermediates(data.normalize(images[j : j + bs]), indices=blocks, intermediates_only=True)

    def suite_all_rows():
        rows = S.probe_rows
        S.probe_rows = lambda ms, split: None
        try:
            run_suite(model, data, opts)
        finally:
            S.probe_rows = rows

    res = run_suite(model, data, opts)
    tmp = Path(tempfile.mkdtemp())
    from torch.utils.tensorboard import SummaryWriter  # deferred: only the figures variant needs it

    writer = SummaryWriter(str(tmp / "tb"))

    def figures():
        publish.publish(res, tmp / "a", writer, 0, figures=True, figure_dir=tmp / "f")

    variants = {
        "forward": forward,
        "intermediates": intermediates,
        "forward_read": lambda: forward(read_images),
        "suite": lambda: run_suite(model, data, opts),
        "suite_all_rows": suite_all_rows,
        "figures": figures,
    }
    runs: dict = {}
    best, wall = rotated_minimum(variants, 1 if a.smoke else a.repeats, runs)
    writer.close()
    for k, v in best.items():
        print(f"{k:14s} {v:7.3f} s CPU ({wall[k]:7.3f} s wall)")
    print(
        f"# model {a.model}, {len(data.analysis)} analysis + {len(data.probe_train)} probe-train images, of which "
        f"the suite reads {len(read_images)}; load average {os.getloadavg()[0]:.2f}"
    )
    paired = sorted(s / f for s, f in zip(runs["suite"], runs["forward"]))  # within a repeat: the same machine state
    print(
        f"# suite/forward within each repeat: median {paired[len(paired) // 2]:.2f} "
        f"(range {paired[0]:.2f}-{paired[-1]:.2f}, {len(paired)} repeats)"
    )
    print(
        f"RATIO suite threads={a.threads}: suite/forward={best['suite'] / best['forward']:.2f} "
        f"suite/forward_read={best['suite'] / best['forward_read']:.2f} "
        f"suite/suite_all_rows={best['suite'] / best['suite_all_rows']:.2f} "
        f"(suite+figures)/forward={(best['suite'] + best['figures']) / best['forward']:.2f} "
        f"suite/intermediates={best['suite'] / best['intermediates']:.2f}"
    )


if __name__ == "__main__":
    main()
