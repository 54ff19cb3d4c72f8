"""``train.compile``: ``torch.compile`` of the module the update step calls (inductor, ``mode=None``).

What is compiled is a wrapper around the prepared trained module (the backbone, or the objective holding it; DDP-
wrapped with several processes): the module itself is untouched, so ``objective.network`` (what callbacks and
analysis taps see, hooks and module names included), evaluation, ``accelerator.save_state`` (checkpoint keys without
``_orig_mod.``) and ``load_state`` all work on the original module, and only the training step runs compiled code.

``VITLAB_COMPILE_BACKEND`` picks another ``torch.compile`` backend (``aot_eager``: no C++ compiler needed, seconds
to compile; what the tests use); the default is inductor, which needs a C++ compiler on a CPU (Triton also calls
a C compiler on a GPU): :func:`check` says so in one sentence before anything is written.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from train.errors import RecipeError

BACKEND_ENV = "VITLAB_COMPILE_BACKEND"


def backend() -> str:
    """The ``torch.compile`` backend: ``$VITLAB_COMPILE_BACKEND``, else inductor."""
    return os.environ.get(BACKEND_ENV) or "inductor"


def _cxx_name() -> str:
    """The C++ compiler inductor would run: ``$CXX``, else its default (clang++ on macOS, g++ elsewhere)."""
    return os.environ.get("CXX") or ("clang++" if sys.platform == "darwin" else "g++")


def _cxx() -> str | None:
    """The path of the C++ compiler inductor would use (:func:`_cxx_name`) when it compiles a one-line C++ file here,
    else None. Running ``--version`` is not enough (inductor's own test): ``CXX=/bin/true`` passes it and compiles
    nothing, and the run would fail at its first step with inductor's traceback."""
    path = shutil.which(_cxx_name())
    if path is None:
        return None
    with tempfile.TemporaryDirectory(prefix="vitlab-cxx-") as tmp:
        out = Path(tmp) / "probe.o"
        try:
            subprocess.run(
                [path, "-x", "c++", "-c", "-", "-o", str(out)],
                input=b"int vitlab_probe(int x) { return x + 1; }\n",
                capture_output=True,
                timeout=120,
                check=False,
            )
        except (OSError, subprocess.SubprocessError):
            return None
        return path if out.is_file() and out.stat().st_size > 0 else None


def check(recipe) -> None:
    """With ``train.compile`` on: raise RecipeError (one sentence) when the backend cannot compile on this machine."""
    if not recipe.train.compile:
        return
    import torch._dynamo

    name = backend()
    known = torch._dynamo.list_backends(exclude_tags=())
    if name not in known:
        raise RecipeError(
            f"{BACKEND_ENV}={name!r} is not a torch.compile backend: unset it (inductor) or choose one of "
            f"{', '.join(known)}."
        )
    if name == "inductor" and _cxx() is None:
        cxx = os.environ.get("CXX")
        if cxx:
            raise RecipeError(
                f"key 'train.compile' is true, but CXX={cxx!r} names no C++ compiler that works here (torch.compile's "
                "inductor backend runs it): point CXX at one (e.g. CXX=g++), unset it, or set train.compile=false."
            )
        raise RecipeError(
            f"key 'train.compile' is true, but torch.compile's inductor backend needs a C++ compiler and none was "
            f"found ({_cxx_name()}, or the one $CXX names): install one (e.g. apt-get install g++) or set "
            "train.compile=false."
        )


def compile_module(module):
    """``torch.compile(module)`` with the chosen backend and mode=None: a wrapper sharing ``module``'s parameters."""
    import torch

    return torch.compile(module, backend=backend(), mode=None)


def seconds() -> float | None:
    """Seconds torch.compile has spent compiling in this process so far (graph capture and backend, forward and
    backward, recompiles included: dynamo's own account), or None when this torch does not keep it."""
    try:
        from torch._dynamo.utils import calculate_time_spent

        return float(calculate_time_spent()["total_wall_time"])
    except (ImportError, KeyError, TypeError):
        return None
