"""The measurement protocol: one class per measurement, found by name, each owning its options.

A measure lives in ONE file, ``analysis/measures/<name>.py`` (file name = measure name = the name used in recipes
and on the command line); every module of that package is imported when measures are first looked up, so a new
file there is a new measure. Measures from outside the project are named ``package.module:Class`` in a recipe's
or the CLI's measure list, or published by a package under the ``vitlab.measures`` entry-point group.

The suite (analysis/suite.py) makes ONE pass over the analysis split (fixed minibatches, sharded over processes),
and a second pass over the probe-train split only when some measure asks for it. Each measure

- declares its options as a dataclass ``Options`` with defaults (``{name: analysis_suite, knn: {k: 10}}`` in a
  recipe, ``--opt knn.k=10`` on the CLI; both are checked by :func:`make_options`); the measure reads them as
  ``self.opts``, and its cached results depend on these options only (plus the weights, images, batch size),
- states what it needs of the data before anything runs (:meth:`Measure.problem`, e.g. enough probe-train
  images), and whether it applies to a model at all (:meth:`Measure.applies`, e.g. attention on ViTs only),
- says which taps it needs (:meth:`Measure.taps`, :meth:`Measure.probe_taps`; names as in analysis/taps.py),
- accumulates per minibatch (:meth:`Measure.update` on the analysis split, :meth:`Measure.update_probe` on
  probe-train); ``j`` is the minibatch index, identical on 1 and N processes, so gathered parts can be put in
  order with :func:`analysis.reduce.collect`; a process that gets no minibatch contributes zeros,
- reduces over processes and returns its result in :meth:`Measure.finish` (sums through
  :func:`analysis.reduce.all_reduce_sum`; per-image features through :func:`analysis.reduce.collect`); it may
  also run its own passes there (e.g. gradients), on ``ctx.model`` and ``ctx.data``,
- turns a result into key numbers, TensorBoard scalars and figures (static methods, so that results loaded
  back from disk are drawn by the same code).

A result is a FLAT dict ``{key: numpy array | int | float | str | list[str]}``: it is written as
``<name>.npz`` with ``np.savez(**result)`` and read back with :func:`load_result`, which gives numpy arrays
(0-d for scalars, str arrays for label lists). ``summary``, ``scalars`` and ``figures`` must accept both forms.
"""

from __future__ import annotations

import dataclasses
import importlib
import pkgutil
import types
import typing
from dataclasses import dataclass
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import torch

REGISTRY: dict[str, type[Measure]] = {}
ENTRY_POINT_GROUP = "vitlab.measures"


class MeasureError(ValueError):
    """A measure name or option that does not exist or does not fit; the message is one sentence for the user."""


@dataclass
class Context:
    """What a measure may use. ``data`` is a train data bundle (``data.analysis``, ``data.probe_train``:
    TensorBatches with ``.images`` uint8-or-float [N, C, H, W] and ``.labels`` [N]; ``data.normalize(x)``;
    ``data.num_classes``). ``prefix`` is the number of prefix (CLS) tokens, 0 for GAP ViTs, ResNets, Mixers.
    ``batch_size`` is the suite's analysis minibatch (also the CKA minibatch)."""

    model: torch.nn.Module
    data: Any
    device: torch.device
    accelerator: Any = None
    arch: str = "vit"  # vit | resnet | mixer
    blocks: tuple = ()  # block names in forward order (analysis.taps.block_names)
    prefix: int = 0
    grid: tuple | None = None  # token grid (gh, gw) for token models
    patch_size: int | None = None  # input pixels per token side for token models
    batch_size: int = 256


@dataclass(frozen=True)
class NoOptions:
    """A measure without options."""


def labels_problem(data, probe: bool = False) -> str | None:
    """One sentence if the analysis images (and with ``probe`` the probe-train images) have no labels or unknown ones
    (-1, what :func:`analysis.api.analyze` gives images passed without labels), for a measure that compares against them."""
    for split, what, how in (
        (data.analysis, "the analysis images", "labels"),
        *(((data.probe_train, "probe-train images (probe_train)", "probe_images and probe_labels"),) if probe else ()),
    ):
        y = split.labels
        if len(y) == 0 or int(y.min()) < 0:
            return (
                f"it needs {what} with their class labels, and {'there are none' if len(y) == 0 else 'some are unknown'}: "
                f"pass {how} (from Python), or analyse a run folder."
            )
    return None


class Measure:
    """Base class; subclasses set ``name`` (and ``Options``) and register with :func:`register`."""

    name: ClassVar[str] = ""
    Options: ClassVar[type] = NoOptions
    needs_grad: ClassVar[bool] = False  # True: finish() runs its own backward passes
    # what it reads of the labels: "" none; "analysis" the analysis images' labels; "probe" also labelled probe-train
    # images
    uses_labels: ClassVar[str] = ""
    version: ClassVar[int] = 1  # raise it when the definition changes: cached results of older versions are recomputed

    def __init__(self, ctx: Context, opts=None):
        self.ctx = ctx
        self.opts = opts if opts is not None else self.Options()

    @classmethod
    def applies(cls, ctx: Context) -> bool:
        """Whether this measure is defined for the model (e.g. attention measures only for ViTs)."""
        return True

    @classmethod
    def problem(cls, data, opts) -> str | None:
        """One sentence if this measure cannot run on ``data`` with ``opts`` (checked before anything is written)."""
        return None

    @classmethod
    def model_problem(cls, ctx: Context, opts) -> str | None:
        """One sentence if this measure, applying to the model of ``ctx``, cannot run on it with ``opts`` (e.g. an
        option that reads a class token the model lacks). ``ctx.model`` may be on the meta device (no weights):
        read its structure only. Checked before anything is written, at training time before the first step."""
        return None

    def taps(self) -> set[str]:
        return set()

    def update(self, j: int, cap: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> None:
        """One analysis minibatch: taps ``cap``, normalised inputs ``x`` (on ctx.device), labels ``y`` (CPU)."""

    def probe_taps(self) -> set[str]:
        return set()

    def update_probe(self, j: int, cap: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> None:
        """One probe-train minibatch (only called when :meth:`probe_taps` is not empty)."""

    def finish(self) -> dict:
        """Reduce over processes and return the result (a flat dict, see the module docstring)."""
        raise NotImplementedError

    @staticmethod
    def summary(r: dict) -> dict:
        """Key numbers (JSON-able) for summary.json and reports."""
        return {}

    @staticmethod
    def scalars(r: dict) -> dict[str, float]:
        """TensorBoard scalars {tag: value}; tags read group/detail (e.g. knn/cls/block03)."""
        return {}

    @staticmethod
    def figures(r: dict, step: int | None = None) -> dict:
        """{tag: matplotlib Figure} (TensorBoard image tag, also the PNG file name with / -> _)."""
        return {}


def register(cls: type[Measure]) -> type[Measure]:
    if not cls.name or (cls.name in REGISTRY and REGISTRY[cls.name].__qualname__ != cls.__qualname__):
        raise ValueError(f"measure name {cls.name!r} is empty or taken")
    if not dataclasses.is_dataclass(cls.Options):
        raise TypeError(f"measure {cls.name!r}: Options must be a dataclass")
    REGISTRY[cls.name] = cls
    return cls


_discovered = False


def registry() -> dict[str, type[Measure]]:
    """Every known measure, {name: class}: the modules of analysis/measures/ and the ``vitlab.measures`` entry points."""
    global _discovered
    if not _discovered:
        import analysis.measures as pkg  # deferred: its modules import this one (they register on import)

        for m in pkgutil.iter_modules(pkg.__path__):
            importlib.import_module(f"{pkg.__name__}.{m.name}")
        for ep in entry_points(group=ENTRY_POINT_GROUP):
            ep.load()
        _discovered = True
    return REGISTRY


def resolve(name: str) -> str:
    """A measure's registered name from ``name`` (a registered name, or ``package.module:Class`` of a Measure
    subclass, imported and registered here); MeasureError (one sentence) when there is none."""
    known = registry()
    if name in known:
        return name
    if ":" in name:
        mod, _, attr = name.partition(":")
        try:
            cls = getattr(importlib.import_module(mod), attr)
        except (ImportError, AttributeError) as e:
            raise MeasureError(
                f"measure '{name}' cannot be imported ({e}): give an importable package.module:Class."
            ) from None
        if not (isinstance(cls, type) and issubclass(cls, Measure)):
            raise MeasureError(f"'{name}' is not a Measure subclass (analysis.measure.Measure).")
        return register(cls).name
    raise MeasureError(
        f"unknown measure '{name}': choose from {', '.join(sorted(known))} (or give package.module:Class)."
    )


def resolve_all(names) -> tuple[str, ...]:
    """Registered names for a list of measure names; a bare string is one name, not a list of letters."""
    if isinstance(names, str):
        names = [names]
    return tuple(resolve(str(n)) for n in names)


# ---------------------------------------------------------------- options


def _coerce(value, tp, where: str):
    """``value`` as type ``tp`` (bool, int, float, str, tuple[...], X | None, Literal[...]); MeasureError otherwise."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        return _coerce(value, inner[0], where)
    if origin is typing.Literal:
        if value not in args:
            raise MeasureError(f"{where} must be one of {', '.join(map(str, args))}, not {value!r}.")
        return value
    if origin in (tuple, list) or tp in (tuple, list):
        items = value if isinstance(value, (list, tuple)) else [value]
        if origin is tuple and len(args) == 2 and args[1] is Ellipsis:
            return tuple(_coerce(v, args[0], f"{where}[{i}]") for i, v in enumerate(items))
        return tuple(items)
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise MeasureError(f"{where} must be true or false, not {value!r}.")
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise MeasureError(f"{where} must be an integer, not {value!r}.")
    if tp is float:
        if isinstance(value, str):
            try:
                value = float(value)  # YAML 1.1 reads 1e-3 as a string
            except ValueError:
                pass
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        raise MeasureError(f"{where} must be a number, not {value!r}.")
    if tp is str:
        if isinstance(value, str):
            return value
        raise MeasureError(f"{where} must be a string, not {value!r}.")
    return value


def make_options(cls: type[Measure], values: dict | None = None):
    """The measure's Options from a mapping of overrides (recipe or CLI), each key and type checked."""
    values = dict(values or {})
    fields = {f.name: f for f in dataclasses.fields(cls.Options)}
    hints = typing.get_type_hints(cls.Options)
    bad = [k for k in values if k not in fields]
    if bad:
        allowed = ", ".join(sorted(fields)) or "none"
        raise MeasureError(f"unknown option '{cls.name}.{bad[0]}': the options of {cls.name} are {allowed}.")
    opts = cls.Options(**{k: _coerce(v, hints[k], f"option {cls.name}.{k}") for k, v in values.items()})
    check = getattr(opts, "check", None)
    if check is not None:
        problem = check()
        if problem:
            raise MeasureError(f"option {cls.name}: {problem}")
    return opts


def options_dict(opts) -> dict:
    """JSON-able options (tuples as lists, as they are read back)."""
    return {k: (list(v) if isinstance(v, tuple) else v) for k, v in dataclasses.asdict(opts).items()}


# ---------------------------------------------------------------- results on disk


def save_result(r: dict, path: Path) -> None:
    np.savez(path, **{k: (np.asarray(v) if not isinstance(v, np.ndarray) else v) for k, v in r.items()})


def load_result(path: Path) -> dict:
    with np.load(path, allow_pickle=False) as f:
        return {k: f[k] for k in f.files}


def as_list(v) -> list:
    """A label list from a result, whether fresh (list) or loaded (numpy str array)."""
    return [str(s) for s in np.asarray(v).reshape(-1).tolist()]
