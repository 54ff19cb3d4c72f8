"""The ablation measure's cost against the analysis suite's on the same images (issue 24's target: all head ablations
of the default model in at most about 3x the suite's time).

    .venv/bin/python bench/ablation_speed.py [--repeats 3] [--threads 1] [--all] [--smoke]

On the default recipe's model (random weights: the cost does not depend on them) and its data (1,024 analysis and
2,000 probe-train images, minibatches of 256), each repeat times, in an order rotated by one at every repeat so
machine noise hits all alike, with threads pinned:

- ``forward``:        one plain forward pass over the analysis images in the suite's minibatches (the unit);
- ``suite``:          :func:`analysis.engine.suite.run_suite` with the default measures (CKA, norm ratios, attention
                      distances, few-shot probes), no figures -- what bench/suite_speed.py times;
- ``heads``:          the ablation measure alone with ``targets: [heads]`` (mean ablation, every read-out: top-1,
                      loss, k-NN, CKA of later blocks): its own pass over the analysis images for the means and over
                      the probe-train images for the k-NN bank, then the ablation passes;
- ``suite+heads``:    both in one suite run, so the two share the passes over the analysis and probe-train images;
- ``heads_nocka``:    ``heads`` without the CKA read-out (``cka: false``);
- ``all`` (``--all``): the ablation measure alone with every target (heads, branches, skip paths, token paths).

Each figure is the CPU time of this process (``time.process_time``; one thread by default), the minimum over
repeats: on a shared machine other jobs inflate wall time by up to 2x here, this process's CPU time much less. The
last line starts with ``RATIO``: heads / suite, and the marginal cost of adding the head ablations to a suite run,
((suite+heads) - suite) / suite.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import SMOKE, default_model, pin_one_thread_env, rotated_minimum

if __name__ == "__main__":
    pin_one_thread_env()

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from analysis.engine.suite import DEFAULT, run_suite, suite_options


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--all", action="store_true", help="also time every target (about 4x the head ablations)")
    p.add_argument("--smoke", action="store_true", help="tiny sizes, one repeat (seconds)")
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    data, model = default_model(SMOKE if a.smoke else [])
    bs = 32 if a.smoke else 256
    heads = {"ablation": {"targets": ["heads"]}}
    opts = {
        "suite": suite_options(None, bs),
        "heads": suite_options(["ablation"], bs, heads),
        "suite+heads": suite_options([*list(DEFAULT), "ablation"], bs, heads),
        "heads_nocka": suite_options(["ablation"], bs, {"ablation": {"targets": ["heads"], "cka": False}}),
    }
    if a.all:
        opts["all"] = suite_options(["ablation"], bs)

    @torch.no_grad()
    def forward():
        for j in range(0, len(data.analysis), bs):
            model(data.normalize(data.analysis.images[j : j + bs]))

    variants = {"forward": forward, **{k: (lambda o=o: run_suite(model, data, o)) for k, o in opts.items()}}
    best, _ = rotated_minimum(variants, 1 if a.smoke else a.repeats)
    for k, v in best.items():
        print(f"{k:12s} {v:7.2f} s CPU")
    f = best["forward"]
    print(
        "in forwards of the analysis images: "
        + ", ".join(f"{k} {v / f:.1f}" for k, v in best.items() if k != "forward")
    )
    print(
        f"RATIO ablation threads={a.threads}: heads/suite={best['heads'] / best['suite']:.2f} "
        f"((suite+heads)-suite)/suite={(best['suite+heads'] - best['suite']) / best['suite']:.2f} "
        f"heads_nocka/suite={best['heads_nocka'] / best['suite']:.2f}"
        + (f" all/suite={best['all'] / best['suite']:.2f}" if "all" in best else "")
    )


if __name__ == "__main__":
    main()
