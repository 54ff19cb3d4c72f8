"""What the suite and ablation benches share: threads pinned, the model and data they time, and the rotated,
repeated timing loop (CPU time of this process and wall time). Not a bench itself (the leading underscore)."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path


def pin_one_thread_env() -> None:
    """Before torch is imported: OpenMP / MKL / OpenBLAS pools of one thread unless the environment says otherwise
    (torch.set_num_threads then sets the count measured)."""
    for k in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        os.environ.setdefault(k, "1")


SMOKE = [
    "data.analysis_size=64",
    "data.probe_train_size=200",
    "data.train_size=512",
    "data.eval_size=256",
    "model.depth=2",
    "model.embed_dim=32",
    "model.num_heads=2",
]
# A ViT-S/16-shaped model at 224 on the default data (Fashion-MNIST upsampled, one channel): the width, depth,
# heads and token count of ViT-S/16 (197 tokens x 384, 12 blocks, 6 heads).
VITS = [
    "data.img_size=224",
    "model.patch_size=16",
    "model.depth=12",
    "model.embed_dim=384",
    "model.num_heads=6",
    "model.mlp_ratio=4.0",
]


def default_model(overrides: list[str]):
    """(data, model) of the default recipe with ``overrides``: random weights (the cost does not depend on them)."""
    import torch

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from train.data import build_data
    from train.models import build_model
    from train.recipe import load_recipe

    r = load_recipe("recipes/default.yaml", overrides)
    data = build_data(r, quiet=True)
    torch.manual_seed(0)
    return data, build_model(r, data.num_classes).eval()


def rotated_minimum(variants: dict, repeats: int, per_repeat: dict | None = None) -> tuple[dict, dict]:
    """Run every variant ``repeats`` times, in an order rotated by one at every repeat so that machine noise hits
    all alike; returns the minimum CPU time of this process and the minimum wall time of each. ``per_repeat``, if
    given, receives every repeat's CPU time of each variant (``{name: [s, ...]}``), for ratios within a repeat."""
    cpu = {k: float("inf") for k in variants}
    wall = dict(cpu)
    names = list(variants)
    for rep in range(repeats):
        for k in names[rep % len(names) :] + names[: rep % len(names)]:
            t0, w0 = time.process_time(), time.perf_counter()
            variants[k]()
            c, w = time.process_time() - t0, time.perf_counter() - w0
            cpu[k], wall[k] = min(cpu[k], c), min(wall[k], w)
            if per_repeat is not None:
                per_repeat.setdefault(k, []).append(c)
            print(f"  repeat {rep} {k:12s} {c:7.2f} s CPU ({w:7.2f} s wall)", flush=True)
    return cpu, wall
