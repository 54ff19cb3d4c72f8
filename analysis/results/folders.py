"""What the analysis command checks of its input before it imports the analysis stack (torch, timm, matplotlib: 5-20 s
on a loaded machine): a mistyped run folder is one sentence at once. :func:`analysis.results.runs.open_run` reads the
folder after these checks."""

from __future__ import annotations

from pathlib import Path

from train.errors import UserError


class AnalysisError(UserError, ValueError):
    """Bad input to offline analysis; the message is one sentence for the user."""


def check_run_folder(path: str | Path) -> Path:
    """``path`` as a Path; AnalysisError when it is no folder, or a folder without the recipe.yaml of a vitlab run."""
    p = Path(path)
    if not p.is_dir():
        raise AnalysisError(f"run folder '{p}' does not exist: pass a folder such as runs/default.")
    if not (p / "recipe.yaml").is_file():
        raise AnalysisError(f"'{p}' is not a vitlab run folder (no recipe.yaml): pass a folder written by ./launch.sh.")
    return p
