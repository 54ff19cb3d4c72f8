"""The measurement protocol: one class per measurement, found by name, each owning its options.

A measure lives in ONE file, ``analysis/measures/<name>.py`` (file name = measure name = the name used in recipes
and on the command line); every module of that package is imported when measures are first looked up, so a new
file there is a new measure. Measures from outside the project are named ``package.module:Class`` in a recipe's
or the CLI's measure list, or published by a package under the ``vitlab.measures`` entry-point group.

The suite (analysis/engine/suite.py) makes ONE pass over the analysis split (fixed minibatches, sharded over processes),
and a second pass over the probe-train split only when some measure asks for it. Each measure

- declares its options as a dataclass ``Options`` with defaults (``{name: analysis_suite, knn: {k: 10}}`` in a
  recipe, ``--opt knn.k=10`` on the CLI; both are checked by :func:`make_options`); the measure reads them as
  ``self.opts``, and its cached results depend on these options only (plus the weights, images, batch size),
- states what it needs of the data before anything runs (:meth:`Measure.problem`, e.g. enough probe-train
  images; a structured problem of analysis/engine/fixes.py, which each front end says in its own words), and whether it
  applies to a model at all (:meth:`Measure.applies`, e.g. attention on ViTs only),
- says which taps it needs (:meth:`Measure.taps`, :meth:`Measure.probe_taps`; names as in analysis/engine/taps.py),
- accumulates per minibatch (:meth:`Measure.update` on the analysis split, :meth:`Measure.update_probe` on
  probe-train); ``j`` is the minibatch index, identical on 1 and N processes, so gathered parts can be put in
  order with :func:`analysis.engine.reduce.collect`; a process that gets no minibatch contributes zeros,
- may say which probe-train images it reads (:meth:`Measure.probe_rows`, from the probe-train labels alone): when
  every measure with probe taps names its rows, the suite forwards only their union ``U`` (sorted; minibatch j
  holds images ``U[j*bs:(j+1)*bs]``) and sets ``probe_index = U`` on these measures, which map their own rows into
  the gathered features in :meth:`Measure.finish` (:func:`analysis.estimators.probing.expand_rows`); ``probe_index``
  None: every probe-train image, in order,
- reduces over processes and returns its result in :meth:`Measure.finish` (sums through
  :func:`analysis.engine.reduce.all_reduce_sum`; per-image features through :func:`analysis.engine.reduce.collect`); it
  may also run its own passes there (e.g. gradients), on ``ctx.model`` and ``ctx.data``,
- when it runs the model in :meth:`Measure.finish`, declares that work (:meth:`Measure.cost`, in image-forwards and
  image-backwards of the model, from its options, the image count and the model's shape: what python -m analysis
  turns into an estimate before it starts) and shows its progress through ``ctx.bar`` (the front end's bar),
- turns a result into key numbers, TensorBoard scalars and figures (static methods, so that results loaded
  back from disk are drawn by the same code).

A result is a FLAT dict ``{key: numpy array | int | float | str | list[str]}``: it is written as
``<name>.npz`` with ``np.savez(**result)`` and read back with :func:`load_result`, which gives numpy arrays
(0-d for scalars, str arrays for label lists). ``summary``, ``scalars`` and ``figures`` must accept both forms.
"""

from __future__ import annotations

import dataclasses
import functools
import typing
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

import numpy as np
import torch

from analysis.engine.fixes import Missing, Problem
from analysis.engine.reduce import ORDER_SEED, Minibatches
from train.coerce import coerce, did_you_mean
from train.errors import UserError
from vitlab.plugins import Registry

if TYPE_CHECKING:
    from accelerate import Accelerator
    from matplotlib.figure import Figure

    from analysis.families.base import Family
    from train.splits import TensorBatches

ENTRY_POINT_GROUP = "vitlab.measures"


class MeasureError(UserError, ValueError):
    """A measure name or option that does not exist or does not fit; the message is one sentence for the user."""


class AnalysisData(Protocol):
    """What a measure reads of the data: train's data bundle (``train.data.DataBundle``) for a run, or
    :class:`analysis.frontends.api.Data` for images passed from Python."""

    analysis: TensorBatches
    probe_train: TensorBatches
    num_classes: int

    def normalize(self, x: torch.Tensor) -> torch.Tensor: ...


@dataclass
class Context:
    """What a measure may use. ``data`` is a train data bundle (``data.analysis``, ``data.probe_train``:
    TensorBatches with ``.images`` uint8-or-float [N, C, H, W] and ``.labels`` [N]; ``data.normalize(x)``;
    ``data.num_classes``). ``prefix`` is the number of prefix (CLS) tokens, 0 for GAP ViTs, ResNets, Mixers.
    ``batch_size`` is the suite's analysis minibatch (also the CKA minibatch); minibatch j of the analysis images
    holds the images ``minibatches.rows(j)``, a seeded permutation's j-th run (``order_seed``; None: stored order;
    :class:`analysis.engine.reduce.Minibatches`)."""

    model: torch.nn.Module
    data: AnalysisData
    device: torch.device
    accelerator: Accelerator | None = None
    arch: str = "vit"  # vit | resnet | mixer: which measures apply (analysis/families/)
    family: Family | None = None  # the model's family adapter (analysis/families/)
    blocks: tuple = ()  # block names in forward order (Family.blocks)
    prefix: int = 0
    grid: tuple | None = None  # token grid (gh, gw) for token models
    patch_size: int | None = None  # input pixels per token side for token models
    batch_size: int = 256
    order_seed: int | None = ORDER_SEED
    # how a long measure shows its progress: ``progress(total=, desc=, unit=)`` gives a bar (tqdm's ``update(n)``,
    # ``close()``); None: no bar. Set by the front end (python -m analysis: tqdm on the main process, off with
    # --no-progress); a measure asks for one through :meth:`bar`
    progress: Callable[..., Any] | None = None

    def bar(self, total: float, desc: str, unit: str = "it"):
        """A progress bar of ``total`` units for a measure's own long work (ERF images, ablation forwards), with its
        ETA; one that does nothing when the front end asked for none. Close it when done (``with ctx.bar(...)``)."""
        return _NoBar() if self.progress is None else self.progress(total=total, desc=desc, unit=unit)

    @functools.cached_property
    def minibatches(self) -> Minibatches:
        """How the analysis images are cut into minibatches (the same for every measure and process count)."""
        return Minibatches(len(self.data.analysis), self.batch_size, self.order_seed)


class _NoBar:
    """A progress bar that shows nothing."""

    def update(self, n: float = 1) -> None:
        pass

    def close(self) -> None:
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        pass


@dataclass(frozen=True)
class NoOptions:
    """A measure without options."""


def labels_problem(data, probe: bool = False) -> Missing | None:
    """What a measure that compares against class labels lacks (:class:`analysis.engine.fixes.Missing`), or None:
    labels of the analysis images (none, or unknown: -1, what :func:`analysis.frontends.api.analyze` gives images
    passed without
    labels) and, with ``probe``, probe-train images with their labels. Each front end names the fix in its own words."""
    pieces = []
    y = data.analysis.labels
    if len(y) == 0 or int(y.min()) < 0:
        pieces.append("labels")
    if probe:
        py = data.probe_train.labels
        if len(py) == 0:
            pieces.append("probe_images")
        elif int(py.min()) < 0:
            pieces.append("probe_labels")
    return Missing(tuple(pieces)) if pieces else None


class Measure:
    """Base class; subclasses set ``name`` (and ``Options``) and register with :func:`register`."""

    name: ClassVar[str] = ""
    Options: ClassVar[type] = NoOptions
    needs_grad: ClassVar[bool] = False  # True: finish() runs its own backward passes
    # what it reads of the labels: "" none; "analysis" the analysis images' labels; "probe" also labelled probe-train
    # images
    uses_labels: ClassVar[str] = ""
    version: ClassVar[int] = 1  # raise it when the definition changes: cached results of older versions are recomputed
    # True: update() / update_probe() may get a minibatch in consecutive parts under the same j (per-image sums or
    # rows), so a minibatch too large for memory is forwarded in chunks; False (minibatch CKA): the whole minibatch
    chunkable: ClassVar[bool] = False

    def __init__(self, ctx: Context, opts: Any = None):  # opts: an instance of the measure's Options
        self.ctx = ctx
        self.opts = opts if opts is not None else self.Options()

    @classmethod
    def applies(cls, ctx: Context) -> bool:
        """Whether this measure is defined for the model (e.g. attention measures only for ViTs)."""
        return True

    @classmethod
    def runs_on(cls, ctx: Context) -> bool:
        """:meth:`applies`, and the model's family gives what the measure reads (a measure that rewrites the forward
        pass needs modules that only some families have: ``Family.needs_internals``)."""
        return cls.applies(ctx) and (ctx.family is None or cls.name not in ctx.family.needs_internals)

    @classmethod
    def problem(cls, data: AnalysisData, opts: Any) -> Problem | None:
        """What keeps this measure from running on ``data`` with ``opts`` (checked before anything is written): a
        structured problem of analysis/engine/fixes.py (:class:`~analysis.engine.fixes.TooFewShots`, ...), which each
        front end says in its own words, or one sentence."""
        return None

    @classmethod
    def model_problem(cls, ctx: Context, opts: Any) -> str | None:
        """One sentence if this measure, applying to the model of ``ctx``, cannot run on it with ``opts`` (e.g. an
        option that reads a class token the model lacks). ``ctx.model`` may be on the meta device (no weights):
        read its structure only. Checked before anything is written, at training time before the first step."""
        return None

    @classmethod
    def cost(cls, ctx: Context, opts: Any, n_images: int) -> dict[str, float]:
        """What this measure costs beyond the suite's shared pass over the images, on the model of ``ctx`` with
        ``opts`` and ``n_images`` analysis images: ``{"forwards": F, "backwards": B}`` in image-forwards of the whole
        model and image-backwards of the whole model (gradients of the input only), which
        :mod:`analysis.engine.cost` turns into seconds with a timed forward and backward of this model. The default:
        nothing beyond the shared pass (the measure only reads taps and reduces them). A measure that runs the model
        in :meth:`finish` (erf, ablation) says how often; ``ctx.model`` is the model itself (read its shape, run no
        pass beyond one image's). A measure whose :meth:`finish` computes for long on what it accumulated adds
        ``"seconds"``, timed here (similarity's map and permutation null)."""
        return {"forwards": 0.0, "backwards": 0.0}

    def taps(self) -> set[str]:
        return set()

    def update(self, j: int, cap: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> None:
        """One analysis minibatch: taps ``cap``, normalised inputs ``x`` (on ctx.device), labels ``y`` (CPU)."""

    def probe_taps(self) -> set[str]:
        return set()

    def update_probe(self, j: int, cap: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> None:
        """One probe-train minibatch (only called when :meth:`probe_taps` is not empty): the images
        ``probe_index[j*bs:(j+1)*bs]`` when the suite forwards a subset (:meth:`probe_rows`), else ``j*bs:(j+1)*bs``."""

    # set by the suite before the probe-train pass: the sorted probe-train rows it forwards, None when all of them
    probe_index: np.ndarray | None = None

    def probe_rows(self, labels: torch.Tensor) -> np.ndarray | None:
        """The sorted indices of the probe-train images whose features this measure reads, from ``labels`` (those of
        the whole probe-train split, known before any forward); None (default): all of them. When every measure with
        probe taps gives indices, the suite forwards only their union and sets :attr:`probe_index`; the measure's
        result must not depend on whether it did (analysis/measures/fewshot_probe.py)."""
        return None

    def finish(self) -> dict[str, Any]:
        """Reduce over processes and return the result (a flat dict, see the module docstring)."""
        raise NotImplementedError

    @staticmethod
    def summary(r: dict[str, Any]) -> dict[str, Any]:
        """Key numbers (JSON-able) for summary.json and reports."""
        return {}

    @staticmethod
    def scalars(r: dict[str, Any]) -> dict[str, float]:
        """TensorBoard scalars {tag: value}; tags read group/detail (e.g. knn/cls/block03)."""
        return {}

    @staticmethod
    def figures(r: dict[str, Any], step: int | None = None) -> dict[str, Figure]:
        """{tag: matplotlib Figure} (TensorBoard image tag, also the PNG file name with / -> _)."""
        return {}


def _is_measure(obj) -> str | None:
    return (
        None
        if isinstance(obj, type) and issubclass(obj, Measure)
        else "a Measure subclass (analysis.engine.measure.Measure)"
    )


MEASURES = Registry("measure", "analysis.measures", group=ENTRY_POINT_GROUP, accepts=_is_measure, near=did_you_mean)
REGISTRY: dict[str, type[Measure]] = MEASURES.known  # the measures found so far; registry() finds them all


def register(cls: type[Measure]) -> type[Measure]:
    """Class decorator: make a Measure subclass known under ``cls.name``."""
    if not dataclasses.is_dataclass(cls.Options):
        raise TypeError(f"measure {cls.name!r}: Options must be a dataclass")
    return MEASURES.add(cls.name, cls)


def registry() -> dict[str, type[Measure]]:
    """Every known measure, {name: class}: the modules of analysis/measures/ and the ``vitlab.measures`` entry
    points."""
    return MEASURES.items()


def resolve(name: str) -> str:
    """A measure's registered name from ``name`` (a registered name, or ``package.module:Class`` of a Measure
    subclass, imported and registered here); MeasureError (one sentence) when there is none."""
    if name in registry():
        return name
    return register(MEASURES.get(name, MeasureError)).name


def resolve_all(names) -> tuple[str, ...]:
    """Registered names for a list of measure names; a bare string is one name, not a list of letters."""
    if isinstance(names, str):
        names = [names]
    return tuple(resolve(str(n)) for n in names)


# ---------------------------------------------------------------- options


def make_options(cls: type[Measure], values: dict[str, Any] | None = None) -> Any:
    """The measure's Options from a mapping of overrides (recipe or CLI), each key and type checked by the recipe's
    coercion engine (:mod:`train.coerce`: the same types and the same sentences as recipe keys)."""
    values = dict(values or {})
    fields = {f.name: f for f in dataclasses.fields(cls.Options)}
    hints = typing.get_type_hints(cls.Options)
    bad = [k for k in values if k not in fields]
    if bad:
        allowed = ", ".join(sorted(fields)) or "none"
        near = did_you_mean(bad[0], fields, f"{cls.name}.")
        raise MeasureError(f"unknown option '{cls.name}.{bad[0]}'{near}: the options of {cls.name} are {allowed}.")
    opts = cls.Options(
        **{k: coerce(v, hints[k], f"{cls.name}.{k}", MeasureError, noun="option") for k, v in values.items()}
    )
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
