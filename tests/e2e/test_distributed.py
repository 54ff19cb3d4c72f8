"""Two processes on CPU (gloo) through accelerate launch: eval top-1 neither duplicates nor drops samples; a killed
launcher leaves no trainer behind."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import ROOT, read_scalars, two_process_launch
from safetensors.torch import load_file

from train.checkpoint import list_checkpoints, load_weights
from train.compiling import BACKEND_ENV
from train.data import build_data
from train.models import build_model
from train.recipe import load_recipe
from train.trainer import eval_loader, evaluate, make_accelerator


@pytest.mark.multiprocess
def test_two_process_eval_top1_equals_one_process(write_recipe, tmp_path):
    # 250 eval images in batches of 64 over 2 processes: the last batches are uneven and get padded
    p = write_recipe(
        train={"mixed_precision": "no", "steps": 4, "checkpoint_every": 4, "eval_every": 4, "eval_batch_size": 64}
    )
    cmd, env = two_process_launch(p, 29533)
    out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    run = tmp_path / "runs" / "tiny"
    # judged by what it wrote: gloo can rarely abort at interpreter exit after all work is done (seen with torch 2.x on
    # CPU)
    ckpts = list_checkpoints(run / "checkpoints")
    assert ckpts and ckpts[-1].name == "step_0000004", out.stderr[-3000:]
    meta = json.loads((ckpts[-1] / "meta.json").read_text())
    assert meta["num_processes"] == 2 and meta["global_batch"] == 64
    assert meta["torch_threads"] == max(1, len(os.sched_getaffinity(0)) // 2)
    assert meta["eval"]["n"] == 250, "every eval image counted exactly once"
    two_proc_top1 = meta["eval"]["top1"]
    assert len(list(run.rglob("events.out.tfevents*"))) == 1, "only the main process writes TensorBoard"

    # the same weights, one process
    recipe = load_recipe(p)
    acc = make_accelerator(recipe)
    data = build_data(recipe)
    model = build_model(recipe, data.num_classes)
    load_weights(model, ckpts[-1])
    model, loader = acc.prepare(model, eval_loader(data.eval, 64))
    one = evaluate(acc, model, loader, data, data.num_classes)
    assert one["n"] == 250
    assert one["top1"] == two_proc_top1
    # and an independent count: plain argmax over the whole split at once
    model.eval()
    with torch.no_grad():
        pred = acc.unwrap_model(model)(data.normalize(data.eval.images)).argmax(-1)
    assert (pred == data.eval.labels).sum().item() / 250 == pytest.approx(
        two_proc_top1, rel=1e-6
    )  # torchmetrics computes in float32


@pytest.mark.slow  # two 2-process launches: about 70 s
@pytest.mark.multiprocess
def test_two_processes_train_compiled_as_they_train_eager(write_recipe, tmp_path):
    """train.compile with 2 processes (the DDP-wrapped module compiled; aot_eager, the same graph capture as inductor
    without its C++ compile), accumulating over 2 micro-batches: the losses and weights of the eager 2-process run,
    so gradients are averaged across the processes as in eager DDP; checkpoint keys are the model's own."""
    runs = {}
    for port, (name, compiled) in enumerate((("eager", False), ("compiled", True))):
        train = {"mixed_precision": "no", "steps": 4, "checkpoint_every": 4, "eval_every": 4, "compile": compiled}
        train["grad_accum"] = 2  # accelerate's no_sync on the DDP module under the compiled wrapper, too
        cmd, env = two_process_launch(write_recipe(name, train=train), 29541 + port)
        env[BACKEND_ENV] = "aot_eager"
        out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
        runs[name] = tmp_path / "runs" / name
        ckpts = list_checkpoints(runs[name] / "checkpoints")
        assert ckpts and ckpts[-1].name == "step_0000004", out.stderr[-3000:]
    a, b = read_scalars(runs["eager"]), read_scalars(runs["compiled"])
    assert [v for _, v in b["train/loss"]] == pytest.approx([v for _, v in a["train/loss"]], rel=1e-4)
    assert "time/compile_s" in b and "time/compile_s" not in a
    wa, wb = (load_file(str(list_checkpoints(r / "checkpoints")[-1] / "model.safetensors")) for r in runs.values())
    assert wa.keys() == wb.keys() and not any("_orig_mod" in k for k in wb)
    assert max((wa[k] - wb[k]).abs().max().item() for k in wa) < 1e-4
    meta = json.loads((list_checkpoints(runs["compiled"] / "checkpoints")[-1] / "meta.json").read_text())
    assert meta["num_processes"] == 2 and meta["compile_s"] > 0 and meta["eval"]["n"] == 250


def _alive(pid: int) -> bool:
    """A process that exists and is not a zombie (its parent, the killed launcher, cannot reap it)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.multiprocess
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux-only")
def test_sigkill_of_the_two_process_launcher_leaves_no_trainer(write_recipe, tmp_path):
    """kill -9 of `accelerate launch` (2 processes): both trainers get SIGTERM from the kernel, agree on the step,
    checkpoint it and exit; none is left running beside the user's next --resume."""
    from test_reliability import DRIVER, pause

    driver = tmp_path / "driver.py"
    driver.write_text(DRIVER)
    p = write_recipe(
        callbacks=[pause(tmp_path, 3)],
        train={"mixed_precision": "no", "eval_every": 0, "steps": 100000, "checkpoint_every": 1000},
    )
    cmd, env = two_process_launch(p, 29534, script=driver)
    env["PYTHONPATH"] = str(ROOT)
    log = open(tmp_path / "launcher.log", "w")  # noqa: SIM115
    launcher = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    markers = [tmp_path / f"paused3.{r}" for r in (0, 1)]
    t0 = time.time()
    while not all(m.exists() for m in markers):
        assert launcher.poll() is None and time.time() - t0 < 300, (tmp_path / "launcher.log").read_text()[-3000:]
        time.sleep(0.1)
    pids = [int(m.read_text()) for m in markers]
    launcher.kill()
    launcher.wait()
    (tmp_path / "paused3.release").touch()
    t0 = time.time()
    while any(_alive(pid) for pid in pids) and time.time() - t0 < 60:
        time.sleep(0.2)
    alive = [pid for pid in pids if _alive(pid)]
    for pid in alive:  # do not leave them behind if the test fails
        os.kill(pid, 9)
    assert not alive, f"trainers {alive} outlived their launcher"
    ckpts = list_checkpoints(tmp_path / "runs/tiny/checkpoints")
    assert ckpts and ckpts[-1].name == "step_0000003", (tmp_path / "launcher.log").read_text()[-3000:]
    meta = json.loads((ckpts[-1] / "meta.json").read_text())
    assert meta["num_processes"] == 2 and len(meta["log_window"] or {"loss": [0, 0]}["loss"]) == 2


@pytest.mark.slow  # two 2-process launches: about a minute
@pytest.mark.multiprocess
def test_two_processes_agree_to_run_an_interrupted_checkpoints_callbacks(write_recipe, tmp_path):
    """The final checkpoint of a 2-process run with an analysis callback (collective: every process takes part),
    its callbacks marked unfinished (the mark and the results removed, as a kill -9 while they ran leaves them):
    --resume with 2 processes runs them again on both, which agree (one process alone would wait forever in the
    analysis' reductions), and finishes the run."""
    from train.checkpoint import CALLBACKS_DONE

    train = {"mixed_precision": "no", "steps": 2, "checkpoint_every": 2, "eval_every": 2}
    p = write_recipe(train=train, data={"analysis_size": 32}, callbacks=[{"name": "cka", "figures": False}])
    run = tmp_path / "runs" / "tiny"
    cmd, env = two_process_launch(p, 29561)
    out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    ck = run / "checkpoints" / "step_0000002"
    assert (ck / CALLBACKS_DONE).is_file() and (run / "result.json").is_file(), out.stderr[-3000:]
    (ck / CALLBACKS_DONE).unlink()
    (run / "result.json").unlink()
    summary = run / "analysis" / "step_0000002" / "summary.json"
    summary.unlink()
    out = subprocess.run([*cmd, "--resume"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert summary.is_file() and (ck / CALLBACKS_DONE).is_file(), out.stderr[-3000:]
    assert json.loads((run / "result.json").read_text())["step"] == 2 and "already finished" not in out.stdout
