"""``python -m train.launch ARGS``: ``accelerate launch ARGS`` as ``./launch.sh`` runs it (several processes, or an
accelerate config), stopping the way a trainer stops.

``accelerate launch`` alone turns the ways a job is stopped into failures: SIGTERM or Ctrl-C to it (a user, or a
cluster scheduler signalling every process of the job) makes torch elastic's agent stop the trainers, wait for their
checkpoint and clean exit, and then raise its SignalException (a traceback, exit 1); and a trainer's refusal (one
sentence, exit 2) comes back wrapped in ChildFailedError's traceback. Here the launch runs in a second thread, where
torch elastic installs no signal handlers (it does only on the main thread), and the main thread:

- on the first SIGTERM, SIGINT (Ctrl-C) or SIGHUP sends SIGTERM to the trainers (this process's children: torch
  elastic starts each in a session of its own, so a terminal's Ctrl-C does not reach them) and keeps waiting: they
  checkpoint and exit 0, and so does this process. Further signals are ignored (SIGKILL forces);
- exits with the trainers' own exit code when one fails, without a traceback: 1 or 2 after the trainer's one
  sentence, anything else with one line naming the rank.

Its trainers die with it even when it is killed with SIGKILL (it names itself in VITLAB_LAUNCHER_PID:
:func:`train.cli.die_with_launcher`), and it dies with the sweep that started it the same way, stopping its trainers.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import sys
import threading

from train.cli import LAUNCHER_PID_ENV, STOP_SIGNALS, die_with_launcher


def child_pids(pid: int) -> list[int]:
    """The live (not zombie) child processes of ``pid``, from /proc (Linux; elsewhere none)."""
    out = []
    try:
        entries = os.listdir("/proc")
    except OSError:
        return out
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(fields[1]) == pid and fields[0] != b"Z":
            out.append(int(entry))
    return out


class Forward:
    """The first SIGTERM / SIGINT / SIGHUP: SIGTERM to every child, then to each child started after it (trainers
    that were still starting); the others change nothing."""

    def __init__(self):
        self.signum: int | None = None
        self.sent: set[int] = set()

    def __call__(self, signum, frame) -> None:
        if self.signum is None:
            self.signum = signum
            self.forward()

    def forward(self) -> None:
        if self.signum is None:
            return
        for pid in child_pids(os.getpid()):
            if pid not in self.sent:
                self.sent.add(pid)
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGTERM)

    def install(self) -> None:
        for s in STOP_SIGNALS:
            signal.signal(s, self)


def quiet_elastic_logs() -> None:
    """torch elastic's own lines about a launch it ends ("Sending process N closing signal SIGTERM", "failed
    (exitcode: 2)"): the trainers' own output and :func:`exit_code` say what happened."""
    for name in list(logging.root.manager.loggerDict):
        if name.startswith("torch.distributed.elastic") or name == "torch.distributed.run":
            logging.getLogger(name).setLevel(logging.CRITICAL)


def exit_code(err: BaseException | None, stopping: bool) -> int:
    """This process's exit code for how the launch ended (``err``: what accelerate's launch raised, or None)."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    if err is None:
        return 0
    if isinstance(err, ChildFailedError):
        codes = {rank: f.exitcode for rank, f in err.failures.items()}
        rank, code = err.get_first_failure()[0], err.get_first_failure()[1].exitcode
    elif isinstance(err, subprocess.CalledProcessError):  # one process: accelerate's simple launcher
        rank, code = 0, err.returncode
        codes = {0: code}
    else:
        raise err
    if stopping and all(c in (-signal.SIGTERM, -signal.SIGINT) for c in codes.values()):
        # a trainer still starting Python, before train.cli caught signals: nothing was trained
        print("stopped before the trainers started; nothing was trained (run the same command to start).", flush=True)
        return 0
    if code in (1, 2):  # the trainer's own sentence (train.cli: 2 bad input, 1 diverged) or traceback is above
        return code
    why = f"was killed by {signal.Signals(-code).name}" if code < 0 else f"exited with code {code}"
    print(f"error: trainer rank {rank} {why}; its output is above.", file=sys.stderr, flush=True)
    return code if code > 0 else 1


def main(argv=None) -> int:
    forward = Forward()
    forward.install()  # before die_with_launcher: a launcher that died already sends SIGTERM at once
    die_with_launcher()
    os.environ[LAUNCHER_PID_ENV] = str(os.getpid())  # the trainers die with this process (train.cli)

    import torch.distributed.run  # noqa: F401  (its loggers, to quiet)
    from accelerate.commands.launch import launch_command, launch_command_parser

    args = launch_command_parser().parse_args(argv)
    quiet_elastic_logs()
    ended: list[BaseException | None] = [None]

    def launch() -> None:
        try:
            launch_command(args)
        except BaseException as e:  # judged in the main thread
            ended[0] = e

    thread = threading.Thread(target=launch, name="accelerate-launch")
    thread.start()
    while thread.is_alive():
        thread.join(0.2)
        forward.forward()  # trainers started since the signal
    return exit_code(ended[0], forward.signum is not None)


if __name__ == "__main__":
    raise SystemExit(main())
