"""``python -m train`` / ``accelerate launch -m train``: train one recipe.

Exit codes: 0 done; 1 training diverged (NaN/inf); 2 bad input (recipe, data, checkpoint, run folder), with
one sentence on stderr naming the problem and what to do, before anything is written.
"""
from __future__ import annotations

import argparse
import os
import sys
import warnings


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m train", description="Train a ViT / ResNet from a recipe.")
    p.add_argument("recipe_pos", nargs="?", metavar="RECIPE", help="recipe YAML (same as --recipe)")
    p.add_argument("--recipe", help="recipe YAML file, e.g. recipes/default.yaml")
    p.add_argument("--set", dest="overrides", action="extend", nargs="+", default=[], metavar="KEY=VALUE",
                   help="override recipe keys, e.g. --set train.steps=200 model.depth=4")
    p.add_argument("--resume", nargs="?", const=True, default=False, metavar="CHECKPOINT",
                   help="continue the run from its latest complete checkpoint (or the given folder)")
    p.add_argument("--name", help="run folder name under run.root (default: recipe name plus overrides)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p.parse_args(argv)


def _is_main() -> bool:
    return os.environ.get("RANK", "0") == "0"


def fail(msg: str, code: int = 2) -> int:
    if _is_main():
        print(f"error: {msg}", file=sys.stderr)
    return code


def main(argv=None) -> int:
    args = parse_args(argv)
    from train.recipe import RecipeError, load_recipe

    path = args.recipe or args.recipe_pos
    if not path:
        return fail("no recipe given: pass one, e.g. --recipe recipes/default.yaml.")
    overrides = list(args.overrides)
    if args.name:
        overrides.append(f"run.name={args.name}")
    try:
        recipe = load_recipe(path, overrides)
    except RecipeError as e:
        return fail(str(e))

    from train.checkpoint import CheckpointError
    from train.data import DataError
    from train.trainer import RunExists, TrainingDiverged, train

    warnings.filterwarnings("ignore", message=".*pin_memory.*")
    try:
        summary = train(recipe, overrides=[o for o in args.overrides], resume=args.resume, progress=not args.no_progress)
    except (RecipeError, DataError, CheckpointError, RunExists) as e:
        return fail(str(e))
    except TrainingDiverged as e:
        return fail(str(e), code=1)
    if _is_main():
        if summary.get("already_finished"):
            print(f"{summary['run_dir']}: already finished at step {summary['step']} (top-1 {summary['top1']}); nothing to do.")
        else:
            print(f"done: {summary['run_dir']} step {summary['step']} eval top-1 {summary['top1']:.4f} in {summary['wall_s']:.0f} s")
    return 0
