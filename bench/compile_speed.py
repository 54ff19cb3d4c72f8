"""``train.compile``: training steps per second of the recipe's model eager vs torch.compile'd, and the compile time.

    .venv/bin/python bench/compile_speed.py [--recipe recipes/default.yaml] [--set model.embed_dim=192 ...]
        [--steps 40] [--warmup 5] [--repeats 3] [--threads 1] [--backend inductor] [--warm-cache] [--smoke]

What is timed is what ``train.compile`` compiles: the update step's forward and backward of the recipe's model
(``torch.compile(model)``, mode None, as the trainer does), with the same AdamW step, gradient clipping, loss and
Fashion-MNIST batches for both variants, at the recipe's batch size and precision (fp32 unless the recipe says
bf16). Both models start from the same weights; their first losses on the same batch are compared (the compiled
step must compute the same function). The first compiled step compiles: its wall time and torch.compile's own
count are the compile time (a fresh inductor cache, so a cold compile, unless ``--warm-cache``). After ``warmup``
steps each, the two variants run ``steps`` steps at a time, interleaved, in an order rotated at every repeat;
steps/s is the median over repeats. Threads are pinned for both alike. The last line starts with ``RATIO``.
``--smoke``: a tiny model for a few steps with the aot_eager backend (no C++ compile), to check that it runs.
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path


def _pin_env() -> argparse.Namespace:
    """Before torch starts: the same thread count for OpenMP and MKL, and a fresh inductor cache (a cold compile)."""
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--threads", type=int, default=1)
    pre.add_argument("--warm-cache", action="store_true")
    a = pre.parse_known_args()[0]
    for k in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ[k] = str(max(1, a.threads))
    if not a.warm_cache:
        cache = tempfile.mkdtemp(prefix="vitlab-inductor-")
        atexit.register(shutil.rmtree, cache, ignore_errors=True)
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache
    return a


if __name__ == "__main__":
    _pin_env()

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from train import compiling  # noqa: E402
from train.data import build_data  # noqa: E402
from train.models import build_model  # noqa: E402
from train.recipe import load_recipe  # noqa: E402

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


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


class Trainee:
    """One variant: a model (eager, or its torch.compile wrapper), its AdamW, and one update step on a batch."""

    def __init__(self, recipe, num_classes: int, compiled: bool, backend: str):
        import timm.optim

        t = recipe.train
        torch.manual_seed(0)  # both variants start from the same weights
        self.model = build_model(recipe, num_classes).train()
        self.opt = timm.optim.create_optimizer_v2(
            self.model, opt="adamw", lr=t.lr, weight_decay=t.weight_decay, betas=tuple(t.betas)
        )
        self.step_model = torch.compile(self.model, backend=backend, mode=None) if compiled else self.model
        self.bf16, self.clip, self.smoothing = t.mixed_precision == "bf16", t.grad_clip, t.label_smoothing

    def step(self, x, y) -> float:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=self.bf16):
            logits = self.step_model(x)
        loss = F.cross_entropy(logits.float(), y, label_smoothing=self.smoothing)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.clip if self.clip > 0 else float("inf"))
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return loss.item()


def batches(data, batch: int):
    """Normalised train batches in a fixed order, without end (the same sequence for every call)."""
    g = torch.Generator().manual_seed(0)
    n = len(data.train)
    while True:
        for idx in torch.randperm(n, generator=g)[: n - n % batch].view(-1, batch):
            yield data.normalize(data.train.images[idx]), data.train.labels[idx]


def run(trainee: Trainee, feed, steps: int) -> float:
    """steps/s over ``steps`` update steps."""
    t0 = time.perf_counter()
    for _ in range(steps):
        trainee.step(*next(feed))
    return steps / (time.perf_counter() - t0)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--recipe", default="recipes/default.yaml")
    p.add_argument("--steps", type=int, default=40, help="steps per timed block")
    p.add_argument("--warmup", type=int, default=5, help="untimed steps of each variant after the first")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=1, help="intra-op threads for both variants (default 1)")
    p.add_argument("--backend", default=None, help="torch.compile backend (default inductor; aot_eager with --smoke)")
    p.add_argument("--warm-cache", action="store_true", help="keep inductor's cache (default: a fresh one, cold)")
    p.add_argument("--set", dest="overrides", nargs="+", default=[], metavar="KEY=VALUE")
    p.add_argument("--smoke", action="store_true", help="a tiny model, 3 steps, one repeat, aot_eager")
    args = p.parse_args()
    if args.smoke:
        args.steps, args.warmup, args.repeats, args.overrides = 3, 1, 1, SMOKE + args.overrides
        args.backend = args.backend or "aot_eager"
    backend = args.backend or compiling.backend()
    if args.threads < 1 or args.steps < 1 or args.warmup < 0 or args.repeats < 1:
        p.error("--threads, --steps and --repeats must be at least 1, --warmup at least 0.")
    torch.set_num_threads(args.threads)
    recipe = load_recipe(args.recipe, args.overrides)
    if backend == "inductor":
        recipe.train.compile = True
        compiling.check(recipe)  # a C++ compiler: one sentence, not a compiler traceback
    data = build_data(recipe, quiet=True)
    b = recipe.train.batch_size
    print(f"# cpu: {cpu_name()}; threads {args.threads}; load before: {os.getloadavg()}", flush=True)
    variants = {
        "eager": Trainee(recipe, data.num_classes, False, backend),
        "compiled": Trainee(recipe, data.num_classes, True, backend),
    }
    feeds = {k: batches(data, b) for k in variants}
    # the first step of each: the same weights and batch give the same loss; the compiled one compiles
    first = {}
    c0 = compiling.seconds() or 0.0
    for k, v in variants.items():
        t0 = time.perf_counter()
        first[k] = (v.step(*next(feeds[k])), time.perf_counter() - t0)
    compile_dynamo = (compiling.seconds() or 0.0) - c0
    loss_gap = abs(first["compiled"][0] - first["eager"][0]) / abs(first["eager"][0])
    assert loss_gap < 1e-3, f"the compiled step computes another loss: {first}"
    for k, v in variants.items():
        run(v, feeds[k], args.warmup)
    res = {k: [] for k in variants}
    names = list(variants)
    for rep in range(args.repeats):
        for k in names[rep % 2 :] + names[: rep % 2]:
            res[k].append(run(variants[k], feeds[k], args.steps))
        print({k: [round(x, 2) for x in v] for k, v in res.items()}, flush=True)
    med = {k: statistics.median(v) for k, v in res.items()}
    ratio = med["compiled"] / med["eager"]
    first_extra = first["compiled"][1] - 1.0 / med["compiled"]  # the first step's time beyond a compiled step
    summary = {
        "steps_s": {k: round(v, 2) for k, v in med.items()},
        "img_s": {k: round(v * b, 1) for k, v in med.items()},
        "compiled_over_eager": round(ratio, 3),
        "compiled_over_eager_per_repeat": [round(c / e, 3) for c, e in zip(res["compiled"], res["eager"])],
        "compile_s_first_step_extra": round(first_extra, 1),
        "compile_s_dynamo": round(compile_dynamo, 1),
        "first_loss": {k: v[0] for k, v in first.items()},
        "backend": backend,
        "cache": "warm" if args.warm_cache else "fresh (cold compile)",
        "threads": args.threads,
        "recipe": args.recipe,
        "overrides": args.overrides,
        "batch": b,
        "precision": recipe.train.mixed_precision,
        "steps": args.steps,
        "repeats": args.repeats,
        "torch": torch.__version__,
        "load_avg_1min_after": round(os.getloadavg()[0], 2),
    }
    print(json.dumps(summary, indent=1))
    print(
        f"RATIO compile threads={args.threads} backend={backend}: compiled/eager={ratio:.3f} "
        f"eager={med['eager']:.2f}/s compiled={med['compiled']:.2f}/s compile_s={first_extra:.1f}"
    )


if __name__ == "__main__":
    main()
