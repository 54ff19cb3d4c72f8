"""Peak memory of the analysis suite against the number of images: each measure alone, in a fresh process.

    .venv/bin/python bench/memory.py [--model default|vits|vits14|vitb] [--images 64,256] [--measures cka,token_norms]
        [--batch-size 32] [--max-memory 2GiB] [--threads 2]

For every measure and image count, a child process builds the model (random weights; memory does not depend on
them) and the images (analysis and probe-train splits of that many images each, Fashion-MNIST upsampled), reads
its resident size, runs :func:`analysis.engine.suite.run_suite` with that measure alone, and reports the peak
resident size (VmHWM) less the resident size before the suite: what the analysis itself took, the images and the
model excluded. A measure whose peak does not depend on the number of images shows the same figure in every
column; the last column is the growth from the first image count to the last.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's analysis, before any installed one
from _common import SMOKE, VITS, pin_one_thread_env

VITB = [*VITS[:2], "model.depth=12", "model.embed_dim=768", "model.num_heads=12", "model.mlp_ratio=4.0"]
VITS14 = [*VITS, "model.patch_size=14"]  # DINOv2 ViT-S/14's shape at 224: 257 tokens
SHAPES = {"default": [], "vits": VITS, "vits14": VITS14, "vitb": VITB}
CHEAP = {  # the expensive measures at a size whose memory still shows (their own image counts are options)
    "erf": {"images": 2},
    "ablation": {"targets": ["skip"], "knn": False},
}


def _status(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    return 0


def child(a) -> None:
    pin_one_thread_env()
    import torch

    torch.set_num_threads(a.threads)
    from _common import default_model

    from analysis.engine.suite import run_suite, suite_options

    n = a.images_one
    shape = SMOKE if a.smoke else SHAPES[a.model]
    data, model = default_model([*shape, f"data.analysis_size={n}", f"data.probe_train_size={max(n, 200)}"])
    names = None if a.measures == "default" else a.measures.split(",")
    opts = {m: o for m, o in CHEAP.items() if names and m in names}
    so = suite_options(names, a.batch_size, opts)
    if a.max_memory:
        from analysis.engine.suite import parse_memory

        so.max_memory = parse_memory(a.max_memory)
    before = _status("VmRSS")
    t0, c0 = time.perf_counter(), time.process_time()
    run_suite(model, data, so)
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    print(json.dumps({"peak": _status("VmHWM") - before, "base": before, "s": wall, "cpu": cpu}))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", choices=tuple(SHAPES), default="vits")
    p.add_argument("--images", default="64,256")
    p.add_argument("--measures", default="cka,norm_ratio,attention_distance,token_norms")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--max-memory", default=None)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--each", action="store_true", help="each measure alone (default: all of --measures together)")
    p.add_argument("--smoke", action="store_true", help="the tiny model, 32 and 64 images (seconds)")
    p.add_argument("--images-one", type=int, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.images_one:
        return child(a)
    if a.smoke:
        a.images, a.measures, a.each, a.model = "32,64", "token_norms", True, "default"
    counts = [int(c) for c in a.images.split(",")]
    groups = a.measures.split(",") if a.each else [a.measures]
    growths = {}
    print(f"# model {a.model}, minibatch {a.batch_size}, max_memory {a.max_memory}; peak MiB above the resident size")
    print(f"{'measures':40s}" + "".join(f"{c:>9d}" for c in counts) + "   growth   seconds (wall/cpu)")
    for g in groups:
        row = []
        secs = []
        for c in counts:
            cmd = [sys.executable, __file__, "--model", a.model, "--measures", g, "--batch-size", str(a.batch_size)]
            cmd += ["--threads", str(a.threads), "--images-one", str(c)] + (["--smoke"] if a.smoke else [])
            if a.max_memory:
                cmd += ["--max-memory", a.max_memory]
            out = subprocess.run(cmd, capture_output=True, text=True, cwd=Path(__file__).resolve().parents[1])
            if out.returncode:
                print(out.stderr[-2000:], file=sys.stderr)
                row.append(float("nan"))
                secs.append("nan")
                continue
            r = json.loads(out.stdout.strip().splitlines()[-1])
            row.append(r["peak"] / 2**20)
            secs.append(f"{r['s']:.0f}/{r['cpu']:.0f}")
        growth = row[-1] / row[0] if row[0] else float("nan")
        growths[g] = growth
        cells = "".join(f"{v:9.0f}" for v in row)
        print(f"{g:40s}{cells}   {growth:5.2f}x  " + " ".join(secs), flush=True)
    print(f"# load average {os.getloadavg()[0]:.2f}")
    worst = max(growths, key=lambda g: growths[g])
    print(f"RATIO memory model={a.model} images={a.images}: max_growth={growths[worst]:.2f} ({worst})")


if __name__ == "__main__":
    main()
