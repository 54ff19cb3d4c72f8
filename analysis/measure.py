"""The measurement protocol of the analysis suite: one class per measurement, registered by name.

The suite (analysis/suite.py) makes ONE pass over the analysis split (fixed minibatches, sharded over
processes), and a second pass over the probe-train split only when some measure asks for it. Each measure

- says which taps it needs (:meth:`Measure.taps`, :meth:`Measure.probe_taps`; names as in analysis/taps.py),
- accumulates per minibatch (:meth:`Measure.update` on the analysis split, :meth:`Measure.update_probe` on
  probe-train); ``j`` is the minibatch index, identical on 1 and N processes, so gathered parts can be put in
  order with :func:`analysis.reduce.collect`,
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

from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import torch

REGISTRY: dict[str, type["Measure"]] = {}


@dataclass
class Context:
    """What a measure may use. ``data`` is a train.data.DataBundle (``data.analysis``, ``data.probe_train``:
    TensorBatches with ``.images`` uint8-or-float [N, C, H, W] and ``.labels`` [N]; ``data.normalize(x)``;
    ``data.num_classes``). ``prefix`` is the number of prefix (CLS) tokens, 0 for GAP ViTs, ResNets, Mixers."""

    model: torch.nn.Module
    data: Any
    opts: Any  # analysis.suite.SuiteOptions
    device: torch.device
    accelerator: Any = None
    arch: str = "vit"  # vit | resnet | mixer
    blocks: tuple = ()  # block names in forward order (analysis.taps.block_names)
    prefix: int = 0
    grid: tuple | None = None  # token grid (gh, gw) for token models
    patch_size: int | None = None  # input pixels per token side for token models


class Measure:
    """Base class; subclasses set ``name`` and register with :func:`register`."""

    name: ClassVar[str] = ""
    needs_grad: ClassVar[bool] = False  # True: finish() runs its own backward passes

    def __init__(self, ctx: Context):
        self.ctx = ctx

    @classmethod
    def applies(cls, ctx: Context) -> bool:
        """Whether this measure is defined for the model (e.g. attention measures only for ViTs)."""
        return True

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
    if not cls.name or cls.name in REGISTRY and REGISTRY[cls.name] is not cls:
        raise ValueError(f"measure name {cls.name!r} is empty or taken")
    REGISTRY[cls.name] = cls
    return cls


def save_result(r: dict, path: Path) -> None:
    np.savez(path, **{k: (np.asarray(v) if not isinstance(v, np.ndarray) else v) for k, v in r.items()})


def load_result(path: Path) -> dict:
    with np.load(path, allow_pickle=False) as f:
        return {k: f[k] for k in f.files}


def as_list(v) -> list:
    """A label list from a result, whether fresh (list) or loaded (numpy str array)."""
    return [str(s) for s in np.asarray(v).reshape(-1).tolist()]
