"""``python -m train`` / ``accelerate launch -m train``: train one recipe.

Exit codes: 0 done, or stopped cleanly; 1 training diverged (NaN/inf); 2 bad input (recipe, data, checkpoint,
run folder in use / not writable / nothing to resume, a full disk), with one sentence on stderr
naming the problem and what to do, before anything is written (a failed checkpoint write leaves the earlier ones).

Clean stops: SIGTERM (a preempted job, ``kill``, the launcher stopping) and SIGINT (Ctrl-C) finish the current
step, checkpoint it, print ``stopped at step N; --resume continues`` and exit **0**: the run is intact and
resumable, nothing failed, and ``accelerate launch`` / torchrun report any other exit code of their workers as
a crash with a traceback. A signal that arrives before the run has set up (imports, reading the recipe) stops it
before its first step, exit 0 (:class:`EarlySignals`). Further signals while stopping, and until the process has
exited, are ignored (SIGKILL forces). Under a launcher (``accelerate launch``, torchrun, ``./launch.sh``'s
``python -m train.launch``, a sweep) on Linux each trainer asks the kernel for SIGTERM when its launcher dies
(``prctl(PR_SET_PDEATHSIG)``), so a launcher killed even with SIGKILL leaves no trainer behind: they checkpoint and
stop. Not when started directly (``nohup python -m train`` must outlive its shell).
"""

from __future__ import annotations

import argparse
import ctypes
import os
import re
import signal
import sys
import warnings

PR_SET_PDEATHSIG = 1  # linux/prctl.h
# set by vitlab's own launchers (train.launch, train.sweep) in their children's environment: their pid, so a child
# whose parent is that process dies with it (die_with_launcher) whatever the launcher's command line looks like
LAUNCHER_PID_ENV = "VITLAB_LAUNCHER_PID"
# what stops a launcher or a sweep (each forwards it to its trainers as SIGTERM): a user, a terminal, a scheduler
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
LAUNCHER_RE = re.compile(r"(^|/)(accelerate|torchrun)$|^(torch\.distributed\.(run|launch)|accelerate\.commands\.\w+)$")


def is_launcher(cmdline: bytes) -> bool:
    """Whether a process's /proc/PID/cmdline is `accelerate launch`, torchrun or ``python -m torch.distributed.run``
    (its program or module, not any argument that happens to contain the word)."""
    argv = cmdline.decode(errors="replace").split("\0")
    return any(LAUNCHER_RE.search(a) for a in argv[:3])


def asked_processes(argv: list[str]) -> int | None:
    """The ``--num_processes N`` (or ``--num-processes=N``) of an ``accelerate launch`` command line, read up to the
    script it launches (``-m MODULE`` or a file), or None."""
    for i, a in enumerate(argv):
        if a in ("-m", "--module") or (a.endswith(".py") and not a.startswith("-")):
            return None
        key, eq, val = a.partition("=")
        if key in ("--num_processes", "--num-processes"):
            val = val if eq else (argv[i + 1] if i + 1 < len(argv) else "")
            return int(val) if val.isdigit() else None
    return None


def fewer_processes(num_processes: int, environ=None, parent_cmdline: bytes | None = None) -> str | None:
    """One sentence when this trainer's launcher was asked for more processes than started: ``accelerate launch
    --cpu --num_processes 2`` (or without --multi_gpu) runs accelerate's simple launcher, which starts ONE process
    whatever --num_processes says and tells it nothing of the count (no WORLD_SIZE; only MASTER_ADDR). Told from the
    parent's command line (``/proc/PPID/cmdline``, Linux; ``parent_cmdline`` for tests) when the parent is ``accelerate
    launch`` and set no WORLD_SIZE; else None."""
    env = os.environ if environ is None else environ
    if "WORLD_SIZE" in env:  # a launcher that starts several processes says how many; the trainer checks it
        return None
    if parent_cmdline is None:
        try:
            with open(f"/proc/{os.getppid()}/cmdline", "rb") as f:
                parent_cmdline = f.read()
        except OSError:
            return None
    argv = parent_cmdline.decode(errors="replace").split("\0")
    rest = None
    for i, a in enumerate(argv[:3]):
        if a == "accelerate.commands.launch":  # python -m accelerate.commands.launch ARGS
            rest = argv[i + 1 :]
        elif re.search(r"(^|/)accelerate$", a) and argv[i + 1 : i + 2] == ["launch"]:
            rest = argv[i + 2 :]
    if rest is None:
        return None
    asked = asked_processes(rest)
    if asked is None or asked <= num_processes:
        return None
    return (
        f"accelerate launch was asked for {asked} processes but started {num_processes} (with --cpu, or without "
        f"--multi_gpu, it runs one process whatever --num_processes says): this run trains on {num_processes}; for "
        f"{asked} CPU processes use VITLAB_NPROC={asked} ./launch.sh, or ACCELERATE_USE_CPU=true accelerate launch "
        f"--multi_gpu --num_processes {asked} --num_machines 1."
    )


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m train", description="Train a ViT / ResNet from a recipe.")
    p.add_argument("recipe_pos", nargs="*", metavar="RECIPE", help="recipe YAML (same as --recipe; one recipe only)")
    p.add_argument("--recipe", help="recipe YAML file, e.g. recipes/default.yaml")
    p.add_argument(
        "--set",
        dest="overrides",
        action="extend",
        nargs="+",
        default=[],
        metavar="KEY=VALUE",
        help="override recipe keys, e.g. --set train.steps=200 model.depth=4",
    )
    p.add_argument(
        "--resume",
        nargs="?",
        const=True,
        default=False,
        metavar="CHECKPOINT",
        help="continue the run from its latest complete checkpoint (or the given folder)",
    )
    p.add_argument(
        "--allow-process-change",
        action="store_true",
        help="resume with another number of processes than the run was trained with (the global batch and "
        "the data order change from there on)",
    )
    p.add_argument("--name", help="run folder name under run.root (default: recipe name plus overrides)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument(
        "--stop-after",
        type=int,
        metavar="STEP",
        help="checkpoint at step STEP and stop there (exit 0), resumable with --resume: the schedule stays the "
        "recipe's (e.g. train a pilot to an early check, then decide whether to finish it)",
    )
    p.add_argument(
        "--check",
        action="store_true",
        help="check the recipe and overrides, the run folder (--resume: a checkpoint to resume, made by this "
        "recipe) and that the data source opens, without training or writing, then exit (0, or 2 with one "
        "sentence): what ./launch.sh runs before starting several processes, so bad input is one sentence, "
        "not one traceback per process",
    )
    return p.parse_args(argv)


def _is_main() -> bool:
    return os.environ.get("RANK", "0") == "0"


def fail(msg: str, code: int = 2) -> int:
    if _is_main():
        print(f"error: {msg}", file=sys.stderr)
    return code


class EarlySignals:
    """SIGTERM / SIGINT from the process's start until the run installs its own handlers
    (:class:`train.run_folder.StopSignals`, which takes over the first signal caught here): a job stopped while its
    trainers import torch and read their data stops before the first step, exit 0, rather than dying by the signal
    (a crash to ``accelerate launch``) or with a KeyboardInterrupt traceback. Not under ``--check``, whose caller
    (launch.sh) must not go on to train after a Ctrl-C."""

    def __init__(self):
        self.signum: int | None = None

    def __call__(self, signum, frame) -> None:
        if self.signum is None:
            self.signum = signum


def exit_on_signal(signum, frame) -> None:
    """``--check``'s SIGTERM / SIGINT: exit 128 + the signal (launch.sh reads it as a stop before anything started),
    with no KeyboardInterrupt traceback and no shell's 'Terminated'."""
    raise SystemExit(128 + signum)


def die_with_launcher() -> bool:
    """On Linux, when the parent is a launcher (``accelerate launch``, torchrun, or one of vitlab's: ``./launch.sh``'s
    ``python -m train.launch``, a sweep, which name themselves in VITLAB_LAUNCHER_PID), have the kernel send SIGTERM
    (a clean stop) when it dies. PR_SET_PDEATHSIG rather than a thread polling os.getppid(): delivered at once,
    costs nothing, and covers SIGKILL of the launcher. Returns whether it was set."""
    if not sys.platform.startswith("linux"):
        return False
    ppid = os.getppid()
    if os.environ.get(LAUNCHER_PID_ENV) != str(ppid):
        try:
            with open(f"/proc/{ppid}/cmdline", "rb") as f:
                parent = f.read()
        except OSError:
            return False
        if not is_launcher(parent):
            return False
    try:
        if ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0) != 0:
            return False
    except (OSError, AttributeError):
        return False
    if os.getppid() != ppid:  # the launcher died before the request
        os.kill(os.getpid(), signal.SIGTERM)
    return True


def command_line_problem(args: argparse.Namespace) -> str | None:
    """The one sentence for a command line that cannot be what the user meant (before the recipe is read), or None:
    no recipe, or several (the first would train, the others be ignored); an empty --name (it would fall back to the
    recipe's folder); --stop-after below 1."""
    recipes = ([args.recipe] if args.recipe else []) + args.recipe_pos
    if not recipes:
        return "no recipe given: pass one, e.g. --recipe recipes/default.yaml."
    if len(recipes) > 1:
        return (
            f"{len(recipes)} recipes given ({', '.join(recipes)}): a command trains one recipe; run one command per "
            "recipe, or ./launch.sh sweep for a grid."
        )
    if args.name is not None and not args.name.strip():
        return "--name is empty: give the run folder a name (e.g. --name baseline), or leave --name out."
    if args.stop_after is not None and args.stop_after < 1:
        return f"--stop-after must be a step of at least 1, not {args.stop_after}."
    return None


def preflight(recipe, overrides: list, resume) -> None:
    """What ``--check`` verifies beyond the recipe, with the trainer's and the data layer's own rules and messages, in
    the trainer's order, without training or writing (it reads, and takes the run folder's lock while it reads, as the
    trainer does): the callbacks' options (and against the recipe's model); with train.compile, that torch.compile's
    backend can compile here (inductor: a C++ compiler); the run folder (not in use by a live trainer; no checkpoints
    unless --resume; with --resume, a complete checkpoint whose files match their checksums, trained with this recipe:
    :func:`train.trainer.prepare_run`); that the data source opens (:func:`train.sources.check_source`, which reads no
    images). Left to the trainer: whether the checkpoint's tensors load into the model, and the number of processes
    (the launcher decides it). Raises RecipeError, RunFolderError, CheckpointError or DataError."""
    # deferred, as in main(): importing the trainer (torch, accelerate, timm) takes seconds
    from train import compiling
    from train.callbacks import build_callbacks
    from train.run_folder import RunLock, prepare_run, run_dir_for
    from train.sources import check_source

    build_callbacks(recipe.callbacks).check_recipe(recipe)
    compiling.check(recipe)  # train.compile: a C++ compiler for inductor
    run_dir = run_dir_for(recipe, overrides)
    lock = RunLock(run_dir)
    try:
        if run_dir.is_dir():  # an existing folder is locked before its checkpoints are read; a new one is not created
            lock.acquire()
        prepare_run(recipe, overrides, resume, run_dir)
    finally:
        lock.release()
    check_source(recipe.data)


def main(argv=None) -> int:
    args = parse_args(argv)
    if argv is None:  # the process entry point, not a call from Python
        # a signal during the seconds of imports and set-up: stop before the first step; --check (launch.sh's, before
        # it starts the launcher) ends at once, quietly
        handler = exit_on_signal if args.check else EarlySignals()
        for s in (signal.SIGTERM, signal.SIGINT):
            signal.signal(s, handler)
        die_with_launcher()
    # deferred: after die_with_launcher(), so a launcher that dies while these seconds of imports run takes this
    # process with it; and a bad recipe is refused before torch, accelerate and timm are loaded at all
    from train.recipe import RecipeError, load_recipe

    problem = command_line_problem(args)
    if problem:
        return fail(problem)
    overrides = list(args.overrides) + ([f"run.name={args.name}"] if args.name is not None else [])
    try:
        recipe = load_recipe(args.recipe or args.recipe_pos[0], overrides)
    except RecipeError as e:
        return fail(str(e))

    from train.errors import TrainingDiverged, TrainingStopped, UserError
    from train.run_folder import StopSignals
    from train.trainer import train

    if args.check:
        try:
            preflight(recipe, list(args.overrides), args.resume)
        except UserError as e:  # one sentence, written by the code that found the problem
            return fail(str(e))
        return 0

    warnings.filterwarnings("ignore", message=".*pin_memory.*")
    if (
        argv is None
    ):  # the process entry point: once the run is over, SIGTERM / SIGINT no longer kill the exiting process
        StopSignals.ignore_after = True
    try:
        summary = train(
            recipe,
            overrides=list(args.overrides),
            resume=args.resume,
            progress=not args.no_progress,
            allow_process_change=args.allow_process_change,
            stop_after=args.stop_after,
        )
    except UserError as e:
        return fail(str(e))
    except TrainingDiverged as e:
        return fail(str(e), code=1)
    except TrainingStopped as e:
        if _is_main():
            print(str(e), file=sys.stderr)
        return 0
    if _is_main():
        if summary.get("already_finished"):
            print(
                f"{summary['run_dir']}: already finished at step {summary['step']} (top-1 {summary['top1']}); nothing "
                "to do."
            )
        else:
            print(
                f"done: {summary['run_dir']} step {summary['step']} eval top-1 {summary['top1']:.4f} in "
                f"{summary['wall_s']:.0f} s"
            )
    return 0
