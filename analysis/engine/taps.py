"""Taps: named intermediate tensors of any model of a known family (analysis/families/), captured with forward hooks
on the unmodified model.

A tap is named ``{block}.{kind}``: the block as its family names it (``blocks.{i}`` in every transformer and Mixer
family, ``layer{s}.{j}`` in a ResNet) and a kind (analysis/families/base.py lists the transformer kinds; each
family's file says on which of its modules each sits)::

    with Taps(model, ["blocks.0.out", "blocks.0.attn_probs"]) as cap:
        model(x)
    cap["blocks.0.out"]          # Tensor, detached

Every requested tap must fire during the context, or TapError is raised at exit; hooks are always removed and any
switch a family made for a tap (eager attention) is undone. This is the ONE place that maps tap names to modules:
every measure, the receptive fields (``graph=True``: tensors keep their autograd graph) and the head-subset
comparison read their tensors through it.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from analysis.families import family_of
from analysis.families.base import TapError, first_tensor

__all__ = [
    "TapError",
    "Taps",
    "arch_of",
    "available_taps",
    "block_kinds",
    "block_names",
    "grid_of",
    "is_vit",
    "num_prefix_tokens",
]


def arch_of(model: nn.Module) -> str:
    """``"vit"``, ``"mixer"`` or ``"resnet"``: which measures apply (analysis/families/); TapError for a model of no
    known family."""
    return family_of(model).arch


def is_vit(model: nn.Module) -> bool:
    """A transformer of any family (attention blocks with tokens)."""
    try:
        return arch_of(model) == "vit"
    except TapError:
        return False


def num_prefix_tokens(model: nn.Module) -> int:
    """Prefix tokens (class token, registers) before the spatial tokens; 0 for a model without them."""
    return family_of(model).prefix(model)


def block_names(model: nn.Module) -> list[str]:
    """The model's residual blocks in forward order: ``blocks.{i}`` (transformers, Mixers) or ``layer{s}.{j}``."""
    return family_of(model).blocks(model)


def block_kinds(model: nn.Module, block: str) -> tuple[str, ...]:
    """The tap kinds of one block (``blocks.3``, ``layer2.0``): they depend on the family and, in a ResNet, on the
    block type."""
    return family_of(model).kinds(model, block)


def available_taps(model: nn.Module) -> list[str]:
    fam = family_of(model)
    return [f"{b}.{k}" for b in fam.blocks(model) for k in fam.kinds(model, b)]


def grid_of(model: nn.Module) -> tuple[int, int]:
    """Token grid (rows, cols) of a token model; TapError for a model without tokens."""
    fam = family_of(model)
    grid = fam.grid(model)
    if grid is None:
        raise TapError(f"a {fam.name} has no token grid: grid_of applies to models with tokens.")
    return tuple(grid)


class Taps:
    """Context manager capturing the named tensors (see the module docstring) of one or more forwards.

    With ``accumulate=False`` (default) each tap keeps the tensor of the latest forward; with
    ``accumulate=True`` it keeps a list of all of them. ``to`` moves captures (e.g. "cpu") as they arrive.
    With ``graph=True`` captures keep their autograd graph (for input gradients) and a module output that is
    captured is passed on as a clone, so a later in-place op (a ResNet's ``x += shortcut``) leaves it intact.
    """

    def __init__(
        self, model: nn.Module, names: list[str], accumulate: bool = False, to=None, dtype=None, graph: bool = False
    ):
        self.model, self.names, self.accumulate, self.to, self.dtype = model, list(names), accumulate, to, dtype
        self.graph = graph
        self.family = family_of(model)
        known = set(available_taps(model))
        bad = [n for n in self.names if n not in known]
        if bad:
            blk = bad[0].rsplit(".", 1)[0]
            if blk in block_names(model):
                raise TapError(
                    f"unknown tap '{bad[0]}' for {type(model).__name__}: the tap kinds of {blk} are "
                    f"{', '.join(block_kinds(model, blk))} (see analysis/families/)."
                )
            raise TapError(
                f"unknown tap '{bad[0]}' for {type(model).__name__}: taps look like {sorted(known)[:3]} ... "
                "(see analysis/families/)."
            )
        self.captures: dict = {}
        self._handles: list = []
        self._undo: list = []

    # -- storage
    def _store(self, name: str, t: torch.Tensor) -> None:
        if not self.graph:
            t = t.detach()
        if self.dtype is not None:
            t = t.to(self.dtype)
        if self.to is not None:
            t = t.to(self.to)
        if self.accumulate:
            self.captures.setdefault(name, []).append(t)
        else:
            self.captures[name] = t

    # -- what a family's hook method registers through (analysis/families/base.py)
    def output(self, module: nn.Module, name: str, clone: bool = False) -> None:
        """Capture ``module``'s output (its first tensor when it returns a tuple) as tap ``name``; ``clone`` for an
        output that the model overwrites in place later."""

        def hook(mod, args, out):
            t = first_tensor(out)
            if self.graph:
                self._store(name, t)
                return (t.clone(), *out[1:]) if isinstance(out, tuple) else t.clone()
            self._store(name, t.clone() if clone else t)
            return None

        self.handle(module.register_forward_hook(hook))

    def input(self, module: nn.Module, name: str) -> None:
        """Capture ``module``'s first input (positional, else the first keyword argument that is a tensor)."""

        def hook(mod, args, kwargs):
            t = args[0] if args else next(v for v in kwargs.values() if isinstance(v, torch.Tensor))
            self._store(name, t)

        self.handle(module.register_forward_pre_hook(hook, with_kwargs=True))

    def store(self, name: str, t: torch.Tensor) -> None:
        """Keep ``t`` as tap ``name`` (for a family's own hook functions)."""
        self._store(name, t)

    def handle(self, h) -> None:
        """A hook handle to remove at exit."""
        self._handles.append(h)

    def on_exit(self, fn) -> None:
        """Call ``fn()`` at exit (undo a switch made for a tap, such as eager attention)."""
        self._undo.append(fn)

    def __getitem__(self, name):
        return self.captures[name]

    def __enter__(self) -> Taps:
        want: dict[str, set] = {}
        for n in self.names:
            blk, kind = n.rsplit(".", 1)
            want.setdefault(blk, set()).add(kind)
        for blk, kinds in want.items():
            self.family.hook(self.model, blk, kinds, self)
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
        for fn in reversed(self._undo):
            fn()
        self._undo.clear()
        if exc_type is None:
            missing = [n for n in self.names if n not in self.captures]
            if missing:
                raise TapError(
                    f"tap '{missing[0]}' never fired during the forward pass: the model does not run that module "
                    "(a changed block class, torch.compile, or no forward inside the context)."
                )
