"""python -m analysis before and during a long analysis (issue 44): the estimated cost of each measure before it
starts (refused past the threshold without --yes, with the cheaper options named), progress inside the long measures,
and a stop (Ctrl-C or SIGTERM) that keeps each result that finished, exits 0 with one line, and is continued by the
same command.

Deterministic: the slow measure (``slow_probe:Slow``, a test module) writes a marker as its ``finish`` starts and
waits there until a signal arrives (or ``SLOW_WAIT`` seconds: 0 in the rerun); the measure named before it
(norm_ratio) has finished and been written by then."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import yaml
from conftest import ROOT, TINY, _merge, tiny_vit

from analysis.engine import cost as C
from analysis.engine.measure import Context
from analysis.engine.suite import run_suite, suite_options
from analysis.frontends.cli import main
from analysis.measures.ablation import Ablation, AblationOptions
from analysis.measures.erf import EffectiveReceptiveField, ERFOptions
from train.recipe import load_recipe
from train.trainer import train

SLOW = r"""
import os, time
from pathlib import Path
from analysis.engine.measure import Measure, register


@register
class Slow(Measure):
    "A measure whose finish waits (for a test): until a signal (SLOW_SIGNAL: sent to itself), or SLOW_WAIT seconds."
    name = "slow_probe"

    def finish(self):
        Path(os.environ["SLOW_MARKER"]).write_text(str(os.getpid()))
        if os.environ.get("SLOW_SIGNAL"):
            os.kill(os.getpid(), int(os.environ["SLOW_SIGNAL"]))
        t0 = time.time()
        while time.time() - t0 < float(os.environ.get("SLOW_WAIT", "120")):
            time.sleep(0.05)
        return {"waited": float(time.time() - t0)}
"""
ARGS = ["--measures", "norm_ratio,slow_probe:Slow", "--batch-size", "32", "--no-progress", "--no-tensorboard"]


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    """A tiny ViT run with one checkpoint (step 2), no training-time analysis."""
    root = tmp_path_factory.mktemp("runs")
    t = {"steps": 2, "checkpoint_every": 2, "eval_every": 0}
    data = _merge(TINY, {"run": {"root": str(root)}, "callbacks": [], "train": t})
    p = root / "tiny.yaml"
    p.write_text(yaml.safe_dump(data))
    return Path(train(load_recipe(p), progress=False)["run_dir"])


def _start(run: Path, tmp_path: Path, wait: float = 120) -> tuple[subprocess.Popen, Path]:
    (tmp_path / "slow_probe.py").write_text(SLOW)
    marker = tmp_path / "slow.started"
    marker.unlink(missing_ok=True)
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{ROOT}", "SLOW_MARKER": str(marker)}
    env["SLOW_WAIT"] = str(wait)
    p = subprocess.Popen(
        [sys.executable, "-m", "analysis", str(run), *ARGS],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    return p, marker


def _stop_midway(run: Path, tmp_path: Path, signum: int) -> tuple[int, str, str]:
    p, marker = _start(run, tmp_path)
    t0 = time.time()
    while not marker.exists() and p.poll() is None and time.time() - t0 < 120:
        time.sleep(0.05)
    assert marker.exists(), p.communicate()
    p.send_signal(signum)
    out, err = p.communicate(timeout=60)
    return p.returncode, out, err


@pytest.fixture(autouse=True)
def _forget_the_slow_measure():
    """The slow measure is registered by name when a test imports it: forgotten afterwards, so that other tests'
    ``--measures all`` and registry counts do not meet it."""
    yield
    from analysis.engine.measure import MEASURES

    MEASURES.known.pop("slow_probe", None)
    sys.modules.pop("slow_probe", None)


def _kept(run: Path) -> dict:
    return json.loads((run / "analysis" / "step_0000002" / "cache.json").read_text())


def _in_process(run: Path, tmp_path: Path, monkeypatch, wait: float = 0, signum: int | None = None) -> int:
    """python -m analysis in this process, the slow measure importable; it signals itself with ``signum``."""
    (tmp_path / "slow_probe.py").write_text(SLOW)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("SLOW_MARKER", str(tmp_path / "slow.started"))
    monkeypatch.setenv("SLOW_WAIT", str(wait))
    if signum is not None:
        monkeypatch.setenv("SLOW_SIGNAL", str(int(signum)))
    else:
        monkeypatch.delenv("SLOW_SIGNAL", raising=False)
    return main([str(run), *ARGS])


def test_ctrl_c_keeps_the_finished_result_and_the_same_command_continues(run, tmp_path, monkeypatch, capsys):
    copy = tmp_path / "tiny"
    shutil.copytree(run, copy)
    rc, out, err = _stop_midway(copy, tmp_path, signal.SIGINT)
    folder = copy / "analysis"
    assert rc == 0 and "Traceback" not in err, err
    assert out.strip().splitlines()[-1] == (
        f"stopped: 1 of 2 results kept in {folder}; run the same command again to continue."
    )
    assert set(_kept(copy)) == {"norm_ratio"} and np.load(folder / "step_0000002" / "norm_ratio.npz")["ratio"].size
    assert not (folder / "step_0000002" / "slow_probe.npz").exists() and (copy / "report.md").is_file()
    before = (folder / "step_0000002" / "norm_ratio.npz").stat().st_mtime_ns
    assert _in_process(copy, tmp_path, monkeypatch) == 0  # the same command again (in this process: faster)
    assert "1 results computed, 1 reused from cache" in capsys.readouterr().out
    assert (folder / "step_0000002" / "norm_ratio.npz").stat().st_mtime_ns == before  # reused, not rewritten
    assert set(_kept(copy)) == {"norm_ratio", "slow_probe"}


def test_sigterm_stops_the_same_way_and_the_handlers_are_restored(run, tmp_path, monkeypatch, capsys):
    copy = tmp_path / "tiny"
    shutil.copytree(run, copy)
    old = signal.getsignal(signal.SIGTERM)
    assert _in_process(copy, tmp_path, monkeypatch, wait=120, signum=signal.SIGTERM) == 0
    out = capsys.readouterr().out
    assert out.strip().splitlines()[-1] == (
        f"stopped: 1 of 2 results kept in {copy / 'analysis'}; run the same command again to continue."
    )
    assert set(_kept(copy)) == {"norm_ratio"} and signal.getsignal(signal.SIGTERM) is old  # handlers restored


@pytest.mark.slow
def test_sigterm_to_the_process_stops_it_with_exit_0(run, tmp_path):
    copy = tmp_path / "tiny"
    shutil.copytree(run, copy)
    rc, out, err = _stop_midway(copy, tmp_path, signal.SIGTERM)
    assert rc == 0 and "Traceback" not in err, err
    assert out.strip().splitlines()[-1].startswith("stopped: 1 of 2 results kept in ")
    assert set(_kept(copy)) == {"norm_ratio"}


def test_a_long_estimate_is_refused_without_yes_naming_the_cheaper_options(run, tmp_path, monkeypatch, capsys):
    copy = tmp_path / "tiny"
    shutil.copytree(run, copy)
    monkeypatch.setattr(C, "CONFIRM_S", 0.01)
    args = [str(copy), "--measures", "erf,norm_ratio", "--batch-size", "32", "--no-progress", "--no-tensorboard"]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "estimated cost of 1 checkpoint of tiny, 64 images" in err and "  erf: " in err
    last = err.strip().splitlines()[-1]
    assert last.startswith("error: this analysis would take about ") and "pass --yes to go on" in last
    assert "--opt erf.images=" in last and not (copy / "analysis").exists()
    assert main([*args, "--yes", "--opt", "erf.images=1"]) == 0
    assert set(_kept(copy)) == {"erf", "norm_ratio"}


def _ctx(n=16):
    """The tiny ViT and n labelled images as analysis and probe-train splits."""
    from conftest import class_split

    from analysis.frontends.api import Data, _images

    a, p = class_split(n, 0), class_split(n, 1)
    return tiny_vit(), Data(_images(a.images, a.labels), _images(p.images, p.labels), 10)


def test_the_declared_work_follows_the_options_and_the_model():
    model, data = _ctx()
    from analysis.engine.suite import make_context

    ctx: Context = make_context(model, data, 8)
    # erf: per chunk of 8 images, 16 copies x 2 rounds cover the 32 channels: images x 32 forwards
    w = EffectiveReceptiveField.cost(ctx, ERFOptions(images=16, batch=8), 16)
    assert w["forwards"] == 16 * 32 and 0 < w["backwards"] <= 16 * 32 * 8
    assert EffectiveReceptiveField.cost(ctx, ERFOptions(images=4, batch=8), 16)["forwards"] == 4 * 32
    # ablation: one unablated forward per image and, per target, the blocks from its own on
    a = Ablation.cost(ctx, AblationOptions(targets=("blocks.1.attn",)), 16)
    assert a == {"forwards": 16 * (1 + 1 / 2), "backwards": 0.0}
    few = Ablation.cost(ctx, AblationOptions(targets=("branches",)), 16)["forwards"]
    assert few < Ablation.cost(ctx, AblationOptions(), 16)["forwards"]


def test_long_measures_tick_the_front_ends_bar_and_on_result_sees_each_result():
    model, data = _ctx(16)
    bars, kept = [], []

    class Bar:
        def __init__(self, total, desc, unit):
            self.total, self.desc, self.unit, self.n = total, desc, unit, 0
            bars.append(self)

        def update(self, n=1):
            self.n += n

        def close(self):
            pass

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            pass

    opts = suite_options(["erf", "ablation", "norm_ratio"], 8, {"erf": {"images": 4}, "ablation": {"knn": False}})
    res = run_suite(
        model, data, opts, on_result=lambda name, r, meta: kept.append((name, meta["n_images"])), progress=Bar
    )
    assert [(b.desc.split(":")[0], b.unit, b.n == b.total) for b in bars] == [
        ("erf", "image", True),
        ("ablation", "target", True),
    ]
    assert bars[0].total == 4 and kept == [(n, 16) for n in res if n != "meta"]


def test_similarity_prices_its_own_map_and_null_in_seconds(monkeypatch):
    """The similarity measure runs no forwards of its own but computes its map and null after the pass: its cost is
    priced in seconds, timed here, and the estimate follows the option that drives it (n_perm) and lands within a
    factor of the measured time of the same map and null (each the shortest of 3 calls); the estimate's lines name
    it."""
    import torch

    from analysis.engine.suite import make_context
    from analysis.measures.similarity import SimilarityMeasure, SimilarityOptions, own_seconds, similarity_map

    torch.manual_seed(0)
    model, data = _ctx(64)
    ctx: Context = make_context(model, data, 8)
    cheap = SimilarityMeasure.cost(ctx, SimilarityOptions(n_perm=0), 64)
    dear = SimilarityMeasure.cost(ctx, SimilarityOptions(n_perm=400), 64)
    assert cheap["forwards"] == cheap["backwards"] == 0.0 and 0 < cheap["seconds"] < dear["seconds"]
    # against the measured map: 4 layers of 32 features, 256 images, 100 permutations (timings: generous bounds)
    opts = SimilarityOptions(n_perm=100, images=256)
    xs = [torch.randn(256, 32) for _ in range(4)]
    measured = C.shortest_call(lambda: similarity_map(xs, None, opts))
    est = own_seconds(opts, 256, 4, 32)
    assert measured / 5 < est < measured * 5, (est, measured)
    # the estimate's lines say it, and a checkpoint's estimates add up
    e = C.Estimate(C.Timing(1e-3, 1e-3, 1e-3), measures={"similarity": 2.0}, work={"similarity": dict(dear)})
    assert "of its own computation" in "\n".join(C.lines(e, "x"))
    e.add(C.Estimate(e.timing, measures={"similarity": 2.0}, work={"similarity": dict(dear)}))
    assert e.work["similarity"]["seconds"] == pytest.approx(2 * dear["seconds"])
