"""vitlab's public face for notebooks and your own code: one import name that a file of yours cannot shadow.

    import vitlab

    res = vitlab.analyze(model, images, labels, probe_images=px, probe_labels=py)   # the analysis suite
    acts = vitlab.activations(model, images, taps="blocks.*.attn_probs")            # raw activations
    summary = vitlab.train("recipes/default.yaml", ["train.steps=200"])             # a training run

The code lives in the project's top-level packages ``train``, ``analysis`` and ``interventions`` (the command lines'
``python -m analysis`` ...); these names are generic, so a ``train.py`` or ``analysis.py`` of yours beside the
notebook would be imported in their place. ``import vitlab`` checks that each of them comes from the checkout vitlab
itself comes from, and says in one sentence which file is in the way otherwise (:func:`check_packages`).

The attributes are loaded when first used (``import vitlab`` imports no torch): :func:`analyze`, :func:`activations`,
:func:`iter_activations`, :func:`tap_names` (analysis/frontends/api.py), :func:`open_activations` (a folder
activations(out=) wrote: analysis/results/activation_store.py), :class:`Measure`, :func:`register`,
:class:`Context`, :func:`measures` (analysis/engine/measure.py: a measure of your own), :func:`load_recipe`,
:func:`train` (a recipe, from Python), :func:`load_pretrained` (the bundled real ViT-S/14:
analysis/sources/pretrained.py).
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent  # the checkout (or site-packages) vitlab comes from
PACKAGES = ("train", "analysis", "interventions")

# the analysis names come through analysis's own public face (analysis/__init__.py), which knows their modules
_LAZY = {
    "analyze": ("analysis", "analyze"),
    "activations": ("analysis", "activations"),
    "iter_activations": ("analysis", "iter_activations"),
    "tap_names": ("analysis", "tap_names"),
    "open_activations": ("analysis", "open_activations"),
    "Measure": ("analysis", "Measure"),
    "register": ("analysis", "register"),
    "Context": ("analysis", "Context"),
    "MeasureError": ("analysis", "MeasureError"),
    "measures": ("analysis.engine.measure", "registry"),
    "load_recipe": ("train.recipe", "load_recipe"),
    "load_pretrained": ("analysis.sources.pretrained", "load"),
}

__all__ = [*sorted(_LAZY), "check_packages", "train"]


def _origin(name: str) -> Path | None:
    """The file the top-level module ``name`` is (or would be) imported from, without importing it."""
    mod = sys.modules.get(name)
    if mod is not None:
        f = getattr(mod, "__file__", None)
        return Path(f).resolve() if f else None
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        return None
    return Path(spec.origin).resolve() if spec is not None and spec.origin not in (None, "namespace") else None


def check_packages() -> None:
    """ImportError with one sentence when ``train``, ``analysis`` or ``interventions`` would not be vitlab's own: a
    file or folder of that name earlier on ``sys.path`` (e.g. your ``train.py`` beside the notebook), or another
    checkout's package."""
    shadows = []  # (file or folder in the way, package name)
    for name in PACKAGES:
        origin = _origin(name)
        own = ROOT / name / "__init__.py"
        if origin is None or origin == own:
            continue
        other = origin.parent.parent
        if origin.name == "__init__.py" and all((other / p / "__init__.py").is_file() for p in PACKAGES):
            raise ImportError(
                f"vitlab comes from {ROOT} but its '{name}' package from {other}, another checkout: "
                f"start Python with PYTHONPATH={ROOT} (or run sys.path.insert(0, '{ROOT}') before importing anything "
                "of vitlab) so that one checkout's code runs."
            )
        shadows.append((origin.parent if origin.name == "__init__.py" else origin, name))
    if shadows:
        files = " and ".join(str(f) for f, _ in shadows)
        names = " and ".join(f"'{n}'" for _, n in shadows)
        renamed = ", ".join(f"my_{n}{f.suffix}" for f, n in shadows)
        one = len(shadows) == 1
        raise ImportError(
            f"{files} {'shadows' if one else 'shadow'} vitlab's {names} package{'' if one else 's'} (Python finds "
            f"{'it' if one else 'them'} first on sys.path): rename {'it' if one else 'them'} (e.g. to {renamed}) and "
            "restart Python (a notebook's kernel)."
        )


check_packages()


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        module, attr = _LAZY[name]
        value = getattr(importlib.import_module(module), attr)
        globals()[name] = value  # loaded once
        return value
    raise AttributeError(f"module 'vitlab' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*__all__, "PACKAGES", "ROOT"])


def train(recipe, overrides=(), resume: bool = False, progress: bool = True) -> dict:
    """Train ``recipe`` (a recipe file, e.g. ``"recipes/default.yaml"``, or a :func:`load_recipe` result) with
    ``overrides`` (``["train.steps=200", ...]``, as ``--set``) in this process, as ``./launch.sh RECIPE`` does on one
    process; ``resume`` continues a stopped run. Returns the summary (final step, eval top-1, wall time, run folder).
    A bad recipe raises ``train.errors.RecipeError`` (a ValueError) with one sentence."""
    from train.errors import RecipeError
    from train.recipe import Recipe, load_recipe
    from train.trainer import train as run

    overrides = list(overrides)
    if not isinstance(recipe, Recipe):
        recipe = load_recipe(recipe, overrides)
    elif overrides:
        raise RecipeError("overrides= go with a recipe file: pass its path, or set them on the Recipe object.")
    return run(recipe, overrides=overrides, resume=resume, progress=progress)
