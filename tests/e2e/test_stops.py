"""Stopping a job the ways users and schedulers do, around the trainers: SIGTERM to ``./launch.sh`` (which is the
launcher, exec'd) or to every process of a 2-process job, SIGKILL to ``./launch.sh``, SIGTERM / Ctrl-C / SIGKILL to a
sweep. Each ends with the trainers' checkpoint of the step they were at and exit 0 without a traceback, or (SIGKILL)
with no trainer left running; and the refusals around them are one sentence and exit 2 with several processes too.

Deterministic: the trainers pause at the end of step 3 (the ``stop_probe:Pause`` callback writes ``paused3.<rank>``
with its pid) until the stop signal has reached them; the test signals once every trainer is paused."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import ROOT, read_scalars
from test_distributed import _alive
from test_reliability import _env, assert_one_sentence, finish, launch2, snapshot, wait_for

from train.checkpoint import list_checkpoints
from train.errors import TrainingStopped
from train.recipe import load_recipe
from train.trainer import train

# What the trainers import (stop_probe:Pause): at the end of step `step` each writes `marker`.<rank> with its pid and
# waits (up to `wait` s) until a stop signal has reached it (the trainer's own handler has then recorded it), or
# `marker`.release exists; so the run stops at exactly that step, however late the signal arrives.
PROBE = r"""
import os, signal, time
from pathlib import Path
from train.callbacks import Callback


class Pause(Callback):
    def __init__(self, every=1, step=1, marker="", wait=120.0):
        super().__init__(every)
        self.step, self.marker, self.wait = step, marker, wait

    def on_step_end(self, ctx):
        if ctx.step != self.step:
            return
        got, old = [], {}

        def seen(signum, frame):
            got.append(signum)
            if callable(old[signum]):
                old[signum](signum, frame)

        for s in (signal.SIGTERM, signal.SIGINT):
            old[s] = signal.signal(s, seen)
        try:
            Path(f"{self.marker}.{ctx.accelerator.process_index}").write_text(str(os.getpid()))
            t0 = time.time()
            while not got and time.time() - t0 < self.wait and not Path(self.marker + ".release").exists():
                time.sleep(0.05)
        finally:
            for s, h in old.items():
                signal.signal(s, h)
"""

linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG and /proc are Linux's")


@pytest.fixture
def probe_recipe(write_recipe, tmp_path):
    """probe_recipe(name, steps) -> a tiny recipe whose trainers pause at the end of step 3; checkpoints only at the
    stop and the end."""
    (tmp_path / "stop_probe.py").write_text(PROBE)

    def make(name="tiny", steps=6):
        cb = {"name": "stop_probe:Pause", "every": 1, "step": 3, "marker": str(tmp_path / "paused3")}
        t = {"mixed_precision": "no", "steps": steps, "eval_every": 0, "checkpoint_every": 1000, "log_every": 1}
        return write_recipe(name, callbacks=[cb], train=t)

    return make


def launch(args: list, tmp_path: Path, nproc: int, tag: str = "launch", **popen) -> subprocess.Popen:
    """``VITLAB_NPROC=nproc ./launch.sh ARGS`` in the background, its output in ``tmp_path/<tag>.log``; the test's
    folder is on PYTHONPATH (the probe callback)."""
    env = {**_env(), "VITLAB_NPROC": str(nproc), "PYTHONPATH": f"{ROOT}:{tmp_path}"}
    log = tmp_path / f"{tag}.log"
    with open(log, "w") as out:
        p = subprocess.Popen(
            [str(ROOT / "launch.sh"), *map(str, args)], cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, **popen
        )
    p.log_path = log
    return p


def paused(tmp_path: Path, proc: subprocess.Popen, nproc: int) -> list[int]:
    """Waits until every trainer is paused at step 3; their pids."""
    for r in range(nproc):
        wait_for(tmp_path / f"paused3.{r}", proc)
    return [int((tmp_path / f"paused3.{r}").read_text()) for r in range(nproc)]


def parent(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def descendants(pid: int) -> list[int]:
    """``pid`` and every live process below it."""
    procs = [int(d) for d in os.listdir("/proc") if d.isdigit() and _alive(int(d))]
    children = [c for c in procs if _alive(c) and parent(c) == pid]
    return [pid] + [d for c in children for d in descendants(c)]


def assert_gone(pids: list[int], timeout=120) -> None:
    """Every trainer exits (SIGKILLed if not, so a failing test leaves nothing behind)."""
    t0 = time.time()
    while any(_alive(p) for p in pids) and time.time() - t0 < timeout:
        time.sleep(0.2)
    alive = [p for p in pids if _alive(p)]
    for p in alive:
        os.kill(p, signal.SIGKILL)
    assert not alive, f"trainers {alive} outlived what launched them"


def assert_clean_stop(rc: int, out: str, last: str = "stopped at step 3; --resume continues") -> None:
    assert rc == 0, f"rc {rc}: {out[-3000:]}"
    assert not any(w in out for w in ("Traceback", "SignalException", "ChildFailedError")), out[-3000:]
    assert out.count("stopped at step") == 1 and out.strip().splitlines()[-1] == last, out[-3000:]


def checkpoint_steps(run: Path) -> list[int]:
    return [int(json.loads((c / "meta.json").read_text())["step"]) for c in list_checkpoints(run / "checkpoints")]


@pytest.mark.multiprocess
def test_sigterm_to_the_two_process_launch_sh_then_resume(probe_recipe, tmp_path):
    """SIGTERM to the launcher of ``VITLAB_NPROC=2 ./launch.sh`` (accelerate launch, the trainers' parent): the
    trainers checkpoint step 3, one line, exit 0, no torch elastic traceback (was: exit 1, SignalException); that
    launcher is ./launch.sh's own process (exec), the pid a user or a script has. ``--resume`` with 2 processes trains
    on to the end, each step logged once."""
    p = probe_recipe()
    a = launch([p, "--no-progress"], tmp_path, 2)
    pids = paused(tmp_path, a, 2)
    launcher = parent(pids[0])
    os.kill(launcher, signal.SIGTERM)
    assert_clean_stop(*finish(a, timeout=120))
    assert launcher == a.pid
    assert_gone(pids, timeout=10)
    run = tmp_path / "runs/tiny"
    assert checkpoint_steps(run) == [3]
    b = launch([p, "--no-progress", "--resume"], tmp_path, 2, "resume")
    rc, out = finish(b, timeout=300)
    assert rc == 0 and "Traceback" not in out and "done: " in out, out[-3000:]
    assert checkpoint_steps(run) == [3, 6]
    assert [s for s, _ in read_scalars(run)["train/loss"]] == [1, 2, 3, 4, 5, 6]


@pytest.mark.slow  # a 2-process launch; the fast test_the_launchers_exit_code_is_the_trainers covers the exit code
@pytest.mark.multiprocess
def test_resume_with_two_processes_of_a_one_process_run_is_one_sentence(write_recipe, tmp_path):
    """A run trained with 1 process, resumed by ``VITLAB_NPROC=2 ./launch.sh --resume``: the trainers' one sentence
    (exit 2; was torch elastic's ChildFailedError traceback), the run folder untouched."""
    p = write_recipe(train={"steps": 4, "checkpoint_every": 1000, "eval_every": 0})
    with pytest.raises(TrainingStopped):
        train(load_recipe(p), progress=False, stop_after=2)
    before = snapshot(tmp_path / "runs")
    r = launch2([p, "--no-progress", "--resume"])
    assert_one_sentence(r, "it was trained with 1")
    assert "--allow-process-change" in r.stderr
    assert snapshot(tmp_path / "runs") == before


@pytest.mark.parametrize("nproc", [1, 2])
@pytest.mark.parametrize("case", ["empty_name", "two_recipes"])
def test_command_line_refusals_are_one_sentence(case, nproc, write_recipe, tmp_path):
    """``--name ''`` (it trained into the recipe's folder) and two recipes on one command line (the second was
    ignored): one sentence, exit 2, nothing written, with 1 and with 2 processes."""
    p = write_recipe()
    args, says = {
        "empty_name": ([p, "--name", ""], "--name is empty"),
        "two_recipes": ([p, write_recipe("other"), "--no-progress"], "2 recipes given"),
    }[case]
    r = launch2(args, {"VITLAB_NPROC": str(nproc)})
    assert_one_sentence(r, says)
    assert not (tmp_path / "runs").exists()


@pytest.mark.slow
@pytest.mark.multiprocess
def test_sigterm_to_every_process_of_the_job(probe_recipe, tmp_path):
    """What a cluster scheduler does: SIGTERM to every process of the job at once (the launcher and both
    trainers). The checkpoint of step 3, exit 0, no traceback (was: exit 1 with torch elastic's SignalException)."""
    a = launch([probe_recipe(), "--no-progress"], tmp_path, 2)
    pids = paused(tmp_path, a, 2)
    job = descendants(a.pid)
    assert set(pids) <= set(job)
    for pid in job:
        os.kill(pid, signal.SIGTERM)
    assert_clean_stop(*finish(a, timeout=120))
    assert_gone(pids, timeout=10)
    assert checkpoint_steps(tmp_path / "runs/tiny") == [3]


@pytest.mark.slow
@pytest.mark.multiprocess
@linux_only
def test_sigkill_to_the_two_process_launch_sh_leaves_no_trainer(probe_recipe, tmp_path):
    """kill -9 of ``VITLAB_NPROC=2 ./launch.sh``: the trainers get SIGTERM from the kernel, checkpoint step 3 and exit
    (was: orphaned, training on to the end)."""
    a = launch([probe_recipe(steps=1000), "--no-progress"], tmp_path, 2)
    pids = paused(tmp_path, a, 2)
    a.kill()
    a.wait()
    assert_gone(pids)
    assert checkpoint_steps(tmp_path / "runs/tiny") == [3]


def sweep(recipe: Path, tmp_path: Path, nproc: int, **popen) -> subprocess.Popen:
    """``./launch.sh sweep RECIPE --grid seed=1,2``: two runs, one at a time."""
    args = ["sweep", recipe, "--grid", "seed=1,2", "--set", "train.steps=1000"]
    return launch(args, tmp_path, nproc, "sweep", **popen)


@pytest.mark.slow
@pytest.mark.parametrize(
    "how,nproc", [("SIGTERM", 1), ("SIGTERM", 2), ("Ctrl-C to its group", 1), ("Ctrl-C to its group", 2)]
)
def test_a_stopped_sweep_waits_for_its_trainer(how, nproc, probe_recipe, tmp_path):
    """SIGTERM to ``./launch.sh sweep``, or Ctrl-C at its terminal (SIGINT to its process group), while its first run
    is at step 3: that run checkpoints step 3 and stops, the second does not start, the sweep says so and exits 0
    (was: -15 with the trainer left running; exit 1 or -2, a KeyboardInterrupt traceback)."""
    s = sweep(probe_recipe(), tmp_path, nproc, start_new_session=True)
    pids = paused(tmp_path, s, nproc)
    if how == "SIGTERM":
        s.send_signal(signal.SIGTERM)
    else:
        os.killpg(s.pid, signal.SIGINT)
    rc, out = finish(s, timeout=120)
    last = "sweep: stopped by {}: 1 run(s) stopped, 1 not started; run the same command to go on."
    assert_clean_stop(rc, out, last.format("SIGTERM" if how == "SIGTERM" else "SIGINT"))
    assert_gone(pids, timeout=10)
    runs = tmp_path / "runs"
    assert checkpoint_steps(runs / "tiny-seed_1") == [3] and not (runs / "tiny-seed_2").exists()


@pytest.mark.slow
@linux_only
def test_sigkill_to_a_sweep_leaves_no_trainer(probe_recipe, tmp_path):
    """kill -9 of the sweep: its trainer gets SIGTERM from the kernel, checkpoints step 3 and exits."""
    s = sweep(probe_recipe(), tmp_path, 1)
    pids = paused(tmp_path, s, 1)
    s.kill()
    s.wait()
    assert_gone(pids)
    assert checkpoint_steps(tmp_path / "runs/tiny-seed_1") == [3]


def test_the_launchers_exit_code_is_the_trainers(capsys):
    """train.launch (what ./launch.sh execs for several processes) turns how accelerate's launch ended into an exit
    code without a traceback: the trainers' 2 (their one sentence is above) or 1 as it is; trainers that a stop killed
    before Python caught signals: a clean stop, 0; any other code or signal: one line naming the rank."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    from train.launch import exit_code

    def failed(*codes):
        return ChildFailedError("train", {r: ProcessFailure(r, 100 + r, c, "/none") for r, c in enumerate(codes)})

    assert exit_code(None, stopping=False) == 0
    assert exit_code(failed(2, 2), stopping=False) == 2
    assert exit_code(subprocess.CalledProcessError(2, ["python"]), stopping=False) == 2
    assert capsys.readouterr().err == ""
    assert exit_code(failed(-signal.SIGTERM, -signal.SIGTERM), stopping=True) == 0
    assert "nothing was trained" in capsys.readouterr().out
    assert exit_code(failed(-signal.SIGKILL), stopping=False) == 1
    assert capsys.readouterr().err == "error: trainer rank 0 was killed by SIGKILL; its output is above.\n"
    with pytest.raises(ValueError):
        exit_code(ValueError("accelerate's own error"), stopping=False)


def test_a_signal_caught_before_the_run_stops_it_before_the_first_step(write_recipe, tmp_path):
    """A SIGTERM / Ctrl-C while the trainer imports torch and reads its recipe (train.cli.EarlySignals caught it): the
    run stops before its first step (TrainingStopped: exit 0 from the command line), nothing trained."""
    from train.cli import EarlySignals

    early = EarlySignals()
    early(signal.SIGTERM, None)
    old = signal.signal(signal.SIGTERM, early)
    try:
        with pytest.raises(TrainingStopped, match="before the first step"):
            train(load_recipe(write_recipe()), progress=False)
    finally:
        signal.signal(signal.SIGTERM, old)
    assert not list_checkpoints(tmp_path / "runs/tiny/checkpoints")
