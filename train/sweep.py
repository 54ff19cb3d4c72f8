"""``./launch.sh sweep RECIPE --grid key=v1,v2 [--grid key2=...] [--set key=value ...]``: one run per combination.

Each run's folder is named after its overrides (``runs/<recipe>-<key>_<value>...``). Finished runs (their
final checkpoint exists) are skipped without starting anything; interrupted ones resume from their latest
complete checkpoint, so a sweep can be stopped and started again safely. Every combination is validated
before the first run starts. Values are YAML: ``--grid interventions.no_skip.blocks=[0],[3],[5]``. Without
--grid, the recipe's ``sweep:`` section ({key: [values]}) is the grid (recipes/studies/ use this).

SIGTERM, SIGINT (Ctrl-C) or SIGHUP stop a sweep as they stop a trainer: the runs training get SIGTERM, checkpoint
and stop, no other run starts, and the sweep exits 0 once they have exited (run it again to go on). Its trainers
also stop when the sweep is killed, even by SIGKILL (``train.cli.die_with_launcher``)."""

from __future__ import annotations

import argparse
import itertools
import json
import os
import signal
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path

from train.checkpoint import callbacks_done, list_checkpoints, read_meta
from train.cli import LAUNCHER_PID_ENV, STOP_SIGNALS
from train.errors import RunsStopped, UserError
from train.recipe import RecipeError, load_recipe, run_name

ROOT = Path(__file__).resolve().parents[1]


def split_values(text: str) -> list[str]:
    """Split on commas that are not inside brackets or braces: '[0],[3],[5]' -> ['[0]', '[3]', '[5]']."""
    out, depth, cur = [], 0, ""
    for ch in text:
        if ch in "[{(":
            depth += 1
        elif ch in "]})":
            depth -= 1
        if ch == "," and depth == 0:
            out.append(cur)
            cur = ""
        else:
            cur += ch
    out.append(cur)
    return [v.strip() for v in out if v.strip()]


def combinations(grids: list[str]) -> list[list[str]]:
    axes = []
    for g in grids:
        if "=" not in g:
            raise RecipeError(f"--grid '{g}' must look like key=value1,value2 (e.g. train.lr=0.001,0.002).")
        key, vals = g.split("=", 1)
        values = split_values(vals)
        if not values:
            raise RecipeError(f"--grid '{g}' lists no values.")
        axes.append([f"{key.strip()}={v}" for v in values])
    return [list(c) for c in itertools.product(*axes)] if axes else [[]]


def is_finished(run_dir: Path) -> bool:
    """Whether the run's latest checkpoint is its final one and that checkpoint's callbacks finished (else a resume
    runs them: see train.checkpoint.CALLBACKS_DONE)."""
    ckpts = list_checkpoints(Path(run_dir) / "checkpoints", warn=False)
    if not ckpts:
        return False
    meta = read_meta(ckpts[-1])
    return bool(meta.get("final")) and callbacks_done(ckpts[-1], meta)


def reached(run_dir: Path, step: int) -> bool:
    """Whether the run has a complete checkpoint at ``step`` or later."""
    ckpts = list_checkpoints(Path(run_dir) / "checkpoints", warn=False)
    return bool(ckpts) and int(read_meta(ckpts[-1]).get("step", -1)) >= step


def _cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def _log_path(run_dir: Path) -> Path:
    return run_dir.parent / "logs" / f"{run_dir.name}.log"


def _todo(plan: list[tuple], dry_run: bool) -> tuple[list[tuple], int]:
    """(label, command, run folder, stop step) of each run of ``plan`` that still has steps to train, and how many
    were skipped (finished, or at their stop step already); with ``dry_run`` each is only listed."""
    launcher = [str(ROOT / "launch.sh")] if (ROOT / "launch.sh").is_file() else [sys.executable, "-m", "train"]
    todo, skipped = [], 0
    for i, (recipe, overrides, run_dir, *until) in enumerate(plan, 1):
        run_dir = Path(run_dir)
        stop = until[0] if until else None
        label = f"[{i}/{len(plan)}] {run_dir.name}" + (f" (to step {stop})" if stop else "")
        done = (
            "finished" if is_finished(run_dir) else f"at step {stop} already" if stop and reached(run_dir, stop) else ""
        )
        if done:
            print(f"{label}: {done}, skipped", flush=True)
            skipped += 1
            continue
        if dry_run:
            resumable = bool(list_checkpoints(run_dir / "checkpoints", warn=False))  # --resume refuses to start one
            print(f"{label}: would {'resume' if resumable else 'start'}", flush=True)
            continue
        root = f"run.root={run_dir.resolve().parent}"
        cmd = [*launcher, str(recipe), "--set", *overrides, root, f"run.name={run_dir.name}"]
        todo.append((label, cmd + (["--stop-after", str(stop)] if stop else []), run_dir, stop))
    return todo, skipped


class _Runs:
    """The runs training at once: started with their share of the cores, reaped as they end (a failure is
    reported and the rest go on); on a stop signal (:meth:`stop`) the running ones get SIGTERM and no other starts."""

    def __init__(self, jobs: int):
        self.jobs = jobs
        self.env = os.environ.copy()
        if jobs > 1:
            self.env["VITLAB_THREADS"] = str(max(1, _cores() // jobs))
        self.env[LAUNCHER_PID_ENV] = str(os.getpid())  # each trainer stops if this process dies, even by SIGKILL
        self.running: list[tuple[str, Path, subprocess.Popen, object, int | None]] = []
        self.failed: list[tuple[str, int]] = []
        self.stopped: list[str] = []
        self.started = 0
        self.signum: int | None = None

    def stop(self, signum, frame) -> None:
        """The signal handler: the first signal asks every running run to checkpoint and stop (SIGTERM; those in a
        terminal's process group got a Ctrl-C themselves too, which they take as the same request); later ones
        change nothing."""
        if self.signum is None:
            self.signum = signum
            for entry in list(self.running):
                _terminate(entry[2])

    def start(self, label: str, cmd: list[str], run_dir: Path, stop: int | None) -> None:
        while len(self.running) >= self.jobs and self.signum is None:
            self.reap(block=False)
            time.sleep(0.2)
        if self.signum is not None:
            return
        # decided at launch, not when planned: with jobs > 1 an earlier run may have written this folder meanwhile
        resume = bool(list_checkpoints(run_dir / "checkpoints", warn=False))
        print(f"{label}: {'resuming' if resume else 'starting'}", flush=True)
        log = None
        if self.jobs > 1:
            _log_path(run_dir).parent.mkdir(parents=True, exist_ok=True)
            log = open(_log_path(run_dir), "a")  # noqa: SIM115  (closed when reaped; the trainer owns the run folder)
        stderr = subprocess.STDOUT if log is not None else None
        proc = subprocess.Popen(cmd + (["--resume"] if resume else []), env=self.env, stdout=log, stderr=stderr)
        self.running.append((label, run_dir, proc, log, stop))
        self.started += 1
        if self.signum is not None:  # the signal came while it started, before stop() could see it
            _terminate(proc)

    def _ended(self, label: str, run_dir: Path, proc: subprocess.Popen, log, stop: int | None) -> None:
        if log is not None:
            log.close()
        done = is_finished(run_dir) or (stop and reached(run_dir, stop))
        # asked to stop: exit 0 (stopped at a checkpoint), or killed by the signal before its trainer started
        stopped = {0} | {-s for s in STOP_SIGNALS} | {128 + s for s in STOP_SIGNALS}
        if self.signum is not None and not done and proc.returncode in stopped:
            self.stopped.append(run_dir.name)
            print(f"{label}: stopped; run the sweep again to resume it", flush=True)
        elif proc.returncode != 0 or not done:
            self.failed.append((run_dir.name, proc.returncode))
            where = f"; its output is in {_log_path(run_dir)}" if log is not None else ""
            print(
                f"{label}: failed with exit code {proc.returncode}{where}; the rest go on (run this again to resume "
                "it)",
                flush=True,
            )
        elif log is not None:
            print(f"{label}: finished", flush=True)

    def reap(self, block: bool) -> None:
        while self.running and (block or any(e[2].poll() is not None for e in self.running)):
            for entry in list(self.running):
                if entry[2].poll() is None:
                    continue
                self.running.remove(entry)
                self._ended(*entry)
            if block and self.running:
                time.sleep(0.2)
            block = block and bool(self.running)


def _terminate(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)


@contextmanager
def _stop_signals(handler):
    """``handler`` for SIGTERM / SIGINT / SIGHUP meanwhile (main thread only: elsewhere signals stay as they are)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    old = {s: signal.signal(s, handler) for s in STOP_SIGNALS}
    try:
        yield
    finally:
        for s, h in old.items():
            signal.signal(s, h)


def launch_runs(plan: list[tuple], dry_run: bool = False, jobs: int = 1) -> tuple[list, int, int]:
    """Train each (recipe, overrides, run_dir) of ``plan`` in its own ``./launch.sh`` process: finished runs are
    skipped, interrupted ones resume, a failed run is reported and the rest go on. Returns (failed [(name, exit
    code)], started, skipped), or raises RunsStopped once the runs have stopped on a SIGTERM / SIGINT / SIGHUP. A plan
    entry may carry a fourth item, a step: that run trains only to it
    (``--stop-after``) and counts as done, or is skipped, once it has a checkpoint there.

    ``jobs`` > 1 trains that many runs at once, each with an equal share of this machine's cores (VITLAB_THREADS),
    its output in ``<runs root>/logs/<run>.log``: small models train faster side by side than one after the other
    with all threads (two 1-thread runs of the default ViT on 2 cores: ~1.3x the images per second of one 2-thread
    run)."""
    todo, skipped = _todo(plan, dry_run)
    runs = _Runs(jobs)
    with _stop_signals(runs.stop):
        for entry in todo:
            runs.start(*entry)
        runs.reap(block=True)
    if runs.signum is not None:
        failed = f", {len(runs.failed)} failed" if runs.failed else ""
        raise RunsStopped(
            f"stopped by {signal.Signals(runs.signum).name}: {len(runs.stopped)} run(s) stopped"
            f"{failed}, {len(todo) - runs.started} not started; run the same command to go on."
        )
    return runs.failed, len(todo), skipped


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="./launch.sh sweep", description=__doc__.split("\n")[0])
    p.add_argument("recipe")
    p.add_argument("--grid", action="append", default=[], metavar="KEY=V1,V2", help="one axis of the grid (repeatable)")
    p.add_argument(
        "--set",
        dest="overrides",
        action="extend",
        nargs="+",
        default=[],
        metavar="KEY=VALUE",
        help="overrides shared by every run",
    )
    p.add_argument("--dry-run", action="store_true", help="list the runs and their state, start nothing")
    p.add_argument(
        "--jobs", type=int, default=1, help="runs trained at once, each with an equal share of the cores (default 1)"
    )
    args = p.parse_args(argv)
    if args.jobs < 1:
        print(f"error: --jobs must be at least 1, not {args.jobs}.", file=sys.stderr)
        return 2

    plan = []
    try:
        grids = args.grid
        if not grids:  # the recipe's own sweep: section
            base = load_recipe(args.recipe, args.overrides)
            grids = [f"{k}={','.join(json.dumps(v) for v in vals)}" for k, vals in base.sweep.items()]
            if not grids:
                raise RecipeError(
                    f"recipe '{args.recipe}' has no sweep: section and no --grid was given: add --grid key=v1,v2."
                )
        for combo in combinations(grids):
            overrides = list(args.overrides) + combo
            recipe = load_recipe(args.recipe, overrides)
            run_dir = Path(recipe.run.root) / run_name(recipe, combo)
            plan.append((combo, run_dir))
    except RecipeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    names = [d for _, d in plan]
    if len(set(names)) != len(names):
        print("error: two grid points map to the same run folder: make the grid values distinct.", file=sys.stderr)
        return 2

    try:
        failed, started, skipped = launch_runs(
            [(args.recipe, list(args.overrides) + combo, d) for combo, d in plan], args.dry_run, args.jobs
        )
    except UserError as e:  # a run folder the plan cannot read (a malformed meta.json): one sentence
        print(f"error: {e}", file=sys.stderr)
        return 2
    except RunsStopped as e:
        print(f"sweep: {e}", flush=True)
        return 0
    print(f"sweep: {len(plan)} runs, {skipped} already finished, {started} started, {len(failed)} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
