"""Every bench script runs: its --smoke invocation exits 0 and prints its ratio line (tiny sizes, a few seconds)."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
SCRIPTS = sorted(p.name for p in (ROOT / "bench").glob("*.py") if not p.name.startswith("_"))  # _common: shared
RATIO = {  # what each script's RATIO line must hold
    "ablation_speed.py": (
        r"^RATIO ablation threads=1: heads/suite=[\d.]+ \(\(suite\+heads\)-suite\)/suite=-?[\d.]+ "
        r"heads_nocka/suite=[\d.]+$"
    ),
    "cka_speed.py": (
        r"^RATIO cka (default|vits|vitb) threads=1: new/half=[\d.]+ new/full=[\d.]+ numpee/new=[\d.]+ "
        r"old/new=[\d.]+ .*max_abs_vs_old="
    ),
    "compile_speed.py": (
        r"^RATIO compile threads=1 backend=\w+: compiled/eager=[\d.]+ eager=[\d.]+/s compiled=[\d.]+/s "
        r"compile_s=-?[\d.]+$"
    ),
    "input_speed.py": (
        r"^RATIO input size=224: lazy=\d+/s timm=\d+/s lazy/timm=[\d.]+( tv=\d+/s lazy/tv=[\d.]+)? "
        r"workers_for_3000/s=\d+$"
    ),
    "cka_null_speed.py": (
        r"^RATIO \w+ \(\d+ x \d+ = \d+ features, \d+ images\) (\d+ x \d+ map|one pair): CKA [\d.]+ s, CKA \+ null "
        r"of \d+ permutations [\d.]+ s: null / CKA = -?[\d.]+$"
    ),
    "memory.py": r"^RATIO memory model=\w+ images=[\d,]+: max_growth=([\d.]+|nan) \([\w,]+\)$",
    "suite_speed.py": (
        r"^RATIO suite threads=1: suite/forward=[\d.]+ suite/forward_read=[\d.]+ suite/suite_all_rows=[\d.]+ "
        r"\(suite\+figures\)/forward=[\d.]+ suite/intermediates=[\d.]+$"
    ),
    "train_speed.py": r"^RATIO train threads=1: harness/bare fp32=[\d.]+ bf16=[\d.]+; bf16/fp32 harness=[\d.]+$",
}


def test_every_bench_script_has_a_smoke_check():
    assert set(SCRIPTS) == set(RATIO), "a bench script without a smoke check here (or a check for a removed script)"


@pytest.mark.parametrize("script", SCRIPTS)
def test_bench_smoke(script):
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}
    r = subprocess.run(
        [sys.executable, f"bench/{script}", "--smoke"], cwd=ROOT, capture_output=True, text=True, timeout=300, env=env
    )
    assert r.returncode == 0, r.stderr[-3000:]
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("RATIO")]
    assert lines and all(re.match(RATIO[script], ln) for ln in lines), r.stdout[-2000:]
    if script == "cka_speed.py":
        assert len(lines) == 3  # every width
        assert re.search(r"^# cpu: .+; flags: ", r.stdout, re.M)  # the host's SIMD flags are named
        assert all(float(re.search(r"max_abs_vs_old=(\S+)", ln).group(1)) < 1e-6 for ln in lines)
