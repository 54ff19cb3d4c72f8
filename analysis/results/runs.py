"""Run folders: what a run trained here holds (its recipe, its complete checkpoints, the networks of each) and where
its analysis goes; a model from elsewhere is a :class:`Run` too (analysis/sources/models.py).

Every user error raises :class:`AnalysisError` with one sentence, before anything is written.
"""

from __future__ import annotations

import json
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from analysis.results import storage
from analysis.results.folders import AnalysisError, check_run_folder
from train.checkpoint import (
    STEP_RE,
    CheckpointError,
    list_checkpoints,
    read_meta,
)
from train.recipe import RecipeError, load_recipe

DEFAULT_PART = storage.DEFAULT_PART


@dataclass
class Run:
    """A run folder, or a model from elsewhere (``checkpoints`` then maps step 0 to the weights file)."""

    path: Path
    name: str
    recipe: object
    checkpoints: dict[int, Path] = field(default_factory=dict)
    external: dict | None = (
        None  # {"arch": "timm:...", "weights": FILE, "pretrained" or None} for models from elsewhere
    )
    part: str = DEFAULT_PART  # the network analysed: a name in the checkpoints' objective parts (select_part)
    _data: object = field(default=None, repr=False)  # the data bundle and its fingerprint, built once (load_data)
    _fingerprint: str | None = field(default=None, repr=False)
    _model: object = field(default=None, repr=False)  # a model from elsewhere that is built as saved (hf:, open_clip:)

    def step(self, spec: str | int | None) -> int:
        """A checkpoint step from ``None``/"last" (the latest), or a number that must exist."""
        if spec in (None, "", "last"):
            return max(self.checkpoints)
        try:
            s = int(spec)
        except ValueError:
            raise AnalysisError(
                f"step '{spec}' is not a number: pass e.g. {max(self.checkpoints)} or 'last'."
            ) from None
        if s not in self.checkpoints:
            raise AnalysisError(f"run {self.path} has no checkpoint at step {s}: it has {sorted(self.checkpoints)}.")
        return s

    @property
    def label(self) -> str:
        """The run's name in figures and printed lines, with the part when it is not the default one."""
        return self.name if self.part == DEFAULT_PART else f"{self.name} ({self.part})"


def open_run(path: str | Path, part: str | None = None) -> Run:
    """A trained run folder (``runs/<name>``), analysing its network ``part`` (default student: :func:`select_part`);
    raise AnalysisError when it is missing or has no checkpoints."""
    p = check_run_folder(path)
    try:
        recipe = load_recipe(p / "recipe.yaml")
    except RecipeError as e:
        raise AnalysisError(f"the recipe of run {p} cannot be read: {e}") from None
    ckpts = list_checkpoints(p / "checkpoints", warn=False)
    if not ckpts:
        raise AnalysisError(
            f"run {p} has no complete checkpoint: train it until its first checkpoint (./launch.sh RECIPE), or pass "
            "another run."
        )
    run = Run(p, p.name, recipe, {int(STEP_RE.match(c.name).group(1)): c for c in ckpts})
    return select_part(run, part) if part is not None else run


def checkpoint_parts(run: Run, step: int) -> dict[str, str]:
    """The networks of checkpoint ``step``: {part name: its key prefix in model.safetensors}, from the objective's
    ``parts`` in meta.json (``{"student": "backbone.", "teacher": "teacher_backbone."}`` for DINO); a supervised
    run, a run from before objectives and a model from elsewhere hold one network, saved unprefixed: ``{"student":
    ""}``."""
    if run.external:
        return {DEFAULT_PART: ""}
    try:
        meta = read_meta(run.checkpoints[step])
    except CheckpointError as e:
        raise AnalysisError(str(e)) from None
    parts = (meta.get("objective") or {}).get("parts") or {}
    return dict(parts) if isinstance(parts, dict) and parts else {DEFAULT_PART: ""}


def part_prefix(run: Run, step: int) -> str:
    """The key prefix of ``run.part`` in checkpoint ``step``; AnalysisError naming the parts it has."""
    parts = checkpoint_parts(run, step)
    if run.part not in parts:
        if run.external:
            raise AnalysisError(
                f"model {run.external['arch']} has no part '{run.part}': a model from elsewhere is one network "
                f"({DEFAULT_PART}), so leave --part out."
            )
        raise AnalysisError(
            f"run {run.path} has no part '{run.part}' (objective {run.recipe.train.objective} saves "
            f"{', '.join(parts)}): pass --part {' or --part '.join(parts)}."
        )
    return parts[run.part]


def select_part(run: Run, part: str | None) -> Run:
    """``run`` analysing its network ``part`` (None: the default, student), checked against its last checkpoint."""
    run.part = part or DEFAULT_PART
    part_prefix(run, max(run.checkpoints))
    return run


def front_end(run: Run) -> str:
    """The command-line front end that opened ``run``, as analysis/engine/fixes.py names it: ``images`` (--model with
    --images), ``model`` (--model on a recipe's data) or ``run`` (a run folder)."""
    if run.external:
        return "images" if run.external.get("images") else "model"
    return "run"


def step_dir(run: Run, step: int, kind: str = "analysis") -> Path:
    return storage.step_dir(run.path, step, kind, run.part)


def check_writable(run: Run) -> None:
    """AnalysisError unless results can be written into the run's folder (the nearest existing folder on its path: a
    model from elsewhere writes to a new one): tried with a temporary file, before any work."""
    p = Path(run.path).absolute()
    while not p.is_dir() and p != p.parent:
        p = p.parent
    try:
        with tempfile.TemporaryFile(dir=p):
            pass
    except OSError as e:
        raise AnalysisError(
            f"cannot write the analysis of {run.path} into {p} ({e.strerror or e}): make it writable, or copy "
            "the run folder somewhere writable and analyse the copy."
        ) from None


def pruned(run: Run, step: int, wait_s: float = 2.0) -> bool:
    """Whether checkpoint ``step`` was deleted since the run was opened (a trainer still running prunes those beyond
    ``train.keep_last``) rather than damaged: its folder is gone, or goes within ``wait_s`` (a deletion under way)."""
    if run.external:
        return False
    path = run.checkpoints[step]
    deadline = time.monotonic() + wait_s
    while path.exists():
        try:  # whole (meta.json and every file it lists): not being deleted, so the error was about its content
            if all((path / n).is_file() for n in json.loads((path / "meta.json").read_text())["files"]):
                return False
        except (OSError, ValueError, KeyError, TypeError):
            pass
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.05)
    return True


def parse_against(spec: str) -> tuple[Run, int]:
    """``OTHER_RUN[:STEP]`` -> (run, step)."""
    path, step = spec, None
    head, sep, tail = spec.rpartition(":")
    if sep and (tail.isdigit() or tail == "last"):
        path, step = head, tail
    run = open_run(path)
    return run, run.step(step)
