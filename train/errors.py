"""Every error class of train/, in one place: each message is one sentence for the user, written by the code that
found the problem (``train/cli.py`` prints it as it is, exit 2; a divergence exits 1). This module imports nothing,
so recipe validation, the data layer and the run folder can raise them without importing each other."""

from __future__ import annotations


class UserError(Exception):
    """A problem in what the user gave (a recipe, data, a run folder, options): ``str(e)`` is the one sentence that
    the code which found the problem wrote, printed as it is (never relabelled on the way). ``analysis/`` derives
    its own errors from it (MeasureError, AnalysisError), so a training-time analysis option reaches the user
    through ``python -m train`` unchanged."""


class RecipeError(UserError, ValueError):
    """A recipe (file, base chain or override) is malformed; the message is one sentence for the user."""


class DataError(UserError, RuntimeError):
    """A data set cannot be found, reached or read; the message is one sentence for the user."""


class CheckpointError(UserError, RuntimeError):
    """A checkpoint cannot be used; the message is one sentence for the user."""


class RunFolderError(UserError, RuntimeError):
    """The run folder cannot be used as asked (in use, not writable, nothing to resume, ...); one sentence."""


class RunExists(RunFolderError):
    """The run folder already holds checkpoints and --resume was not given."""


class RunLocked(RunFolderError):
    """Another live trainer holds the run folder's lock."""


class TrainingDiverged(RuntimeError):
    """The loss or gradient became NaN/inf; training stopped without writing a checkpoint."""


class TrainingStopped(RuntimeError):
    """SIGTERM / SIGINT: the run stopped cleanly at ``step`` (checkpointed); the message is the one line to print."""

    def __init__(self, message: str, step: int):
        super().__init__(message)
        self.step = step


class RunsStopped(RuntimeError):
    """SIGTERM / SIGINT / SIGHUP to a sweep (or a study's training): its running trainers were stopped and each
    checkpointed; the message is the one line to print (exit 0: the sweep resumes when run again)."""
