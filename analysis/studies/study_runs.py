"""A study's runs: which are trained, how far, and the numbers each one saved (used by every stage and plug-in)."""

from __future__ import annotations

import json

from analysis.results import runs as RF
from analysis.results import storage
from train.checkpoint import read_meta


def progress(run) -> tuple[bool, str]:
    """(finished, a few words): finished when the last checkpoint is the final one of the recipe's steps."""
    last = max(run.checkpoints)
    total = run.recipe.train.steps
    try:
        final = bool(read_meta(run.checkpoints[last]).get("final"))
    except Exception:
        final = False
    if final and last >= total:
        return True, f"finished (step {last})"
    return False, f"unfinished (step {last} of {total})"


def top1(run, step: int | None = None) -> float:
    step = max(run.checkpoints) if step is None else step
    return float(read_meta(run.checkpoints[step]).get("eval", {}).get("top1", float("nan")))


def eval_n(run) -> int:
    return int(read_meta(run.checkpoints[max(run.checkpoints)]).get("eval", {}).get("n", 0))


def train_wall(run) -> float:
    """The run's training wall time: result.json's, else (a run stopped before its end) its last checkpoint's."""
    f = run.path / "result.json"
    try:
        return float(json.loads(f.read_text())["wall_s"])
    except (OSError, ValueError, KeyError):
        pass
    try:
        return float(read_meta(run.checkpoints[max(run.checkpoints)])["wall_s"])
    except Exception:
        return float("nan")


def last(run, name: str, step: int | None = None):
    res = storage.load_results(RF.step_dir(run, max(run.checkpoints) if step is None else step), [name])
    return res.get(name)


def configs(study, runs: dict) -> dict[str, list]:
    """Configuration name -> its opened runs in seed order (configurations none of whose runs exist are left out)."""
    out = {c: [runs[r.name] for r in rs if r.name in runs] for c, rs in study.configs().items()}
    return {c: v for c, v in out.items() if v}


def previous(run, name: str):
    """The result ``name`` at the run's second-to-last checkpoint (None when it has one checkpoint or no result
    there): the convergence preconditions compare it with the last."""
    steps = sorted(run.checkpoints)
    if len(steps) < 2:
        return None
    try:
        return last(run, name, steps[-2])
    except Exception:
        return None
