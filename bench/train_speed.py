"""Training-loop speed: vitlab's loop vs a bare timm + AdamW loop on the same model and batch, bf16 vs fp32.

    .venv/bin/python bench/train_speed.py [--recipe recipes/default.yaml] [--set model.embed_dim=192 ...] [--steps 60]
        [--repeats 3] [--threads 1] [--smoke]

The four variants (bare / harness x bf16 / fp32) run the recipe's model at its batch size on Fashion-MNIST images
in this one process, interleaved, in an order rotated by one at every repeat, so that machine noise and warm
caches hit all alike; img/s excludes the first ``warmup`` steps and each figure is the median over repeats.
Threads are pinned for every variant alike (OpenMP / MKL environment before torch starts, torch.set_num_threads,
and VITLAB_THREADS, which the trainer obeys). Ratios are the figures to quote (this shared machine's absolute
speed varies +-50%); the last line starts with ``RATIO``. ``--smoke``: a tiny model for a few steps.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path


def _pin_threads_env() -> int:
    """Before torch starts its pools: the same thread count for OpenMP, MKL and the trainer (VITLAB_THREADS)."""
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--threads", type=int, default=1)
    n = max(1, pre.parse_known_args()[0].threads)
    for k in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "VITLAB_THREADS"):
        os.environ[k] = str(n)
    return n


if __name__ == "__main__":
    _pin_threads_env()

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from train.data import augment, build_data  # noqa: E402
from train.models import build_model  # noqa: E402
from train.recipe import load_recipe  # noqa: E402


def bare_loop(recipe, data, steps: int, warmup: int, bf16: bool) -> float:
    """timm model + AdamW + the same augmentation and loss, no Accelerate, no logging: img/s."""
    import timm.optim

    torch.manual_seed(0)
    model = build_model(recipe, data.num_classes).train()
    t = recipe.train
    opt = timm.optim.create_optimizer_v2(model, opt="adamw", lr=t.lr, weight_decay=t.weight_decay)
    bs, n = t.batch_size, len(data.train)
    perm = torch.randperm(n)
    t0 = None
    for s in range(steps + warmup):
        if s == warmup:
            t0 = time.perf_counter()
        idx = perm[(s * bs) % (n - bs) :][:bs]
        x = data.normalize(augment(data.train.images[idx], recipe.data.augment.shift, recipe.data.augment.hflip))
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            logits = model(x)
        loss = F.cross_entropy(logits.float(), data.train.labels[idx], label_smoothing=t.label_smoothing)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), t.grad_clip)
        opt.step()
    return steps * bs / (time.perf_counter() - t0)


def harness_loop(recipe_path: str, steps: int, warmup: int, bf16: bool, root: str, extra=()) -> float:
    """vitlab's trainer for warmup+steps steps (no eval, one final checkpoint): the logged img/s after warm-up."""
    from accelerate.state import AcceleratorState, GradientState

    from train.trainer import train

    ov = [
        f"train.steps={warmup + steps}",
        f"train.log_every={warmup}",
        "train.eval_every=0",
        "train.checkpoint_every=0",
        f"train.mixed_precision={'bf16' if bf16 else 'no'}",
        f"run.root={root}",
        f"run.name=h{time.time_ns()}",
        "data.eval_size=500",
        "callbacks=[]",
        *extra,
    ]
    r = load_recipe(recipe_path, ov)
    out = train(r, progress=False)
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    ea = EventAccumulator(out["run_dir"], size_guidance={"scalars": 0})
    ea.Reload()
    vals = [e.value for e in ea.Scalars("train/throughput_img_s") if e.step > warmup]
    return statistics.mean(vals)


SMOKE = [
    "data.train_size=256",
    "data.eval_size=64",
    "data.probe_train_size=32",
    "data.analysis_size=32",
    "model.depth=1",
    "model.embed_dim=32",
    "model.num_heads=2",
    "train.batch_size=16",
]
VARIANTS = ("bare_bf16", "harness_bf16", "bare_fp32", "harness_fp32")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--recipe", default="recipes/default.yaml")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=1, help="intra-op threads for every variant (default 1)")
    p.add_argument("--set", dest="overrides", nargs="+", default=[], metavar="KEY=VALUE")
    p.add_argument("--smoke", action="store_true", help="a tiny model, 3 steps, one repeat: checks that it runs")
    args = p.parse_args()
    if args.smoke:
        args.steps, args.warmup, args.repeats, args.overrides = 3, 1, 1, SMOKE + args.overrides
    if args.threads < 1 or args.steps < 1 or args.warmup < 1 or args.repeats < 1:
        p.error("--threads, --steps, --warmup and --repeats must be at least 1.")
    threads = _pin_threads_env()
    recipe = load_recipe(args.recipe, args.overrides)
    data = build_data(recipe)
    res = {k: [] for k in VARIANTS}
    with tempfile.TemporaryDirectory() as root:
        for rep in range(args.repeats):
            for v in VARIANTS[rep % len(VARIANTS) :] + VARIANTS[: rep % len(VARIANTS)]:
                torch.set_num_threads(threads)
                kind, prec = v.split("_")
                if kind == "bare":
                    res[v].append(bare_loop(recipe, data, args.steps, args.warmup, prec == "bf16"))
                else:
                    res[v].append(
                        harness_loop(args.recipe, args.steps, args.warmup, prec == "bf16", root, args.overrides)
                    )
                assert torch.get_num_threads() == threads, "a variant changed the thread count"
            print({k: [round(x, 1) for x in vs] for k, vs in res.items()}, flush=True)
    med = {k: statistics.median(v) for k, v in res.items()}
    summary = {
        "img_s": {k: round(v, 1) for k, v in med.items()},
        "harness_over_bare_bf16": round(med["harness_bf16"] / med["bare_bf16"], 3),
        "harness_over_bare_fp32": round(med["harness_fp32"] / med["bare_fp32"], 3),
        "bf16_over_fp32_harness": round(med["harness_bf16"] / med["harness_fp32"], 3),
        "bf16_over_fp32_bare": round(med["bare_bf16"] / med["bare_fp32"], 3),
        "threads": threads,
        "recipe": args.recipe,
        "overrides": args.overrides,
        "batch": recipe.train.batch_size,
        "steps": args.steps,
        "repeats": args.repeats,
        "load_avg_1min": round(os.getloadavg()[0], 2),
    }
    print(json.dumps(summary, indent=1))
    print(
        f"RATIO train threads={threads}: harness/bare fp32={summary['harness_over_bare_fp32']} "
        f"bf16={summary['harness_over_bare_bf16']}; bf16/fp32 harness={summary['bf16_over_fp32_harness']}"
    )


if __name__ == "__main__":
    main()
