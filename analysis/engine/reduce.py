"""Reduction over processes and sharding of minibatches, in one place, whatever the backend (gloo on CPU, NCCL on
GPUs)."""

from __future__ import annotations

import numpy as np
import torch
from accelerate.utils import gather_object


def all_reduce_sum(t: torch.Tensor, accelerator=None) -> torch.Tensor:
    """The sum of ``t`` over all processes (``t`` itself with one process). With an Accelerator the tensor
    travels on its device (NCCL needs GPU tensors) and comes back to ``t``'s device."""
    if accelerator is not None:
        if accelerator.num_processes == 1:
            return t
        return accelerator.reduce(t.to(accelerator.device), reduction="sum").to(t.device)
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else t.device
        out = t.to(device, copy=True)
        dist.all_reduce(out)
        return out.to(t.device)
    return t


def gather_objects(items: list, accelerator=None) -> list:
    """Every process's ``items`` concatenated, on every process (``items`` itself with one process)."""
    if accelerator is None or accelerator.num_processes == 1:
        return items
    return gather_object(items)


def collect(parts: list, accelerator=None) -> tuple[dict, torch.Tensor]:
    """Per-minibatch parts ``(j, {key: Tensor [b, ...]}, labels [b])`` from every process, put in minibatch
    order j and concatenated: ({key: Tensor [N, ...]}, labels [N]) -- the same on 1 and N processes."""
    parts = sorted(gather_objects(parts, accelerator), key=lambda p: p[0])
    keys = parts[0][1].keys()
    return {k: torch.cat([p[1][k] for p in parts]) for k in keys}, torch.cat([p[2] for p in parts])


# The seed of the analysis images' minibatch order (:class:`Minibatches`); part of every cached result's key.
ORDER_SEED = 0


class Minibatches:
    """The minibatches an analysis cuts ``n`` images into: minibatch j holds the images ``rows(j)``, the j-th run of
    ``size`` in a permutation of ``range(n)`` drawn from ``seed`` (numpy's PCG64: the same on every host, process
    count and torch version), or in stored order with ``seed=None``.

    Why a permutation: the minibatch CKA estimator (Nguyen et al. 2021: unbiased HSIC summed over minibatches)
    assumes random minibatches. Images stored grouped -- 16 views of one photo in a row, class folders one after
    another -- put one photo or one class in a minibatch, and CKA measures similarity within it: on 304 views of
    19 photos, a real ViT-S/14's mean off-diagonal CKA read 0.883 in stored order and 0.666 +- 0.012 in random
    orders (one minibatch of all 304: 0.665). Every minibatch estimator over the analysis images cuts them here, so
    every measure and 1 or N processes (:meth:`mine`) see the same minibatches."""

    def __init__(self, n: int, size: int, seed: int | None = ORDER_SEED):
        self.n, self.size, self.seed = int(n), int(size), seed
        self.order = (
            None
            if seed is None
            else torch.from_numpy(np.random.default_rng(int(seed)).permutation(self.n).astype(np.int64))
        )

    def __len__(self) -> int:
        return (self.n + self.size - 1) // self.size

    def rows(self, j: int) -> torch.Tensor:
        """The indices of the images of minibatch j (int64)."""
        lo, hi = j * self.size, min((j + 1) * self.size, self.n)
        return torch.arange(lo, hi) if self.order is None else self.order[lo:hi]

    def take(self, t, j: int):
        """Minibatch j of ``t`` (images or labels, indexed by image along the first dimension)."""
        if self.order is None:
            return t[j * self.size : (j + 1) * self.size]
        return t[self.rows(j)]

    def mine(self, accelerator=None) -> range:
        """The minibatch indices this process takes (:func:`shard`)."""
        return shard(len(self), accelerator)


def shard(n_batches: int, accelerator=None) -> range:
    """The minibatch indices this process takes: j = rank (mod world), all of them with one process. A process
    may get none (fewer minibatches than processes); its accumulators then contribute zeros to every sum."""
    if accelerator is None or accelerator.num_processes == 1:
        return range(n_batches)
    return range(accelerator.process_index, n_batches, accelerator.num_processes)


def _spec(tree):
    if isinstance(tree, torch.Tensor):
        return ("tensor", tuple(tree.shape), str(tree.dtype))
    if isinstance(tree, dict):
        return {k: _spec(tree[k]) for k in sorted(tree)}
    if isinstance(tree, (list, tuple)):
        return [_spec(v) for v in tree]
    raise TypeError(f"cannot reduce a {type(tree).__name__}: give tensors in dicts and lists")


def _zeros(spec):
    if isinstance(spec, tuple):
        return torch.zeros(spec[1], dtype=getattr(torch, spec[2].split(".")[-1]))
    if isinstance(spec, dict):
        return {k: _zeros(v) for k, v in spec.items()}
    return [_zeros(v) for v in spec]


def _leaves(tree) -> list:
    if isinstance(tree, torch.Tensor):
        return [tree]
    if isinstance(tree, dict):
        return [t for k in sorted(tree) for t in _leaves(tree[k])]
    return [t for v in tree for t in _leaves(v)]


def _rebuild(tree, it):
    if isinstance(tree, torch.Tensor):
        return next(it)
    if isinstance(tree, dict):
        return {k: _rebuild(tree[k], it) for k in sorted(tree)}
    return [_rebuild(v, it) for v in tree]


def all_reduce_tree(tree, accelerator=None):
    """The sum over processes of a nested dict / list of float64 tensors (an accumulator's whole state), in ONE
    all-reduce. A process that saw no minibatch passes ``None`` and takes part with zeros of the shapes the others
    hold (their layout is exchanged first), so any number of processes works, more than there are minibatches
    too. With one process (or a stand-in without a process group) the tree comes back as it is."""
    dist = torch.distributed
    multi = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
    if not multi and not (accelerator is not None and accelerator.num_processes > 1):
        return tree
    if multi:
        specs = (
            gather_objects([None if tree is None else _spec(tree)], accelerator) if accelerator is not None else None
        )
        if specs is None:
            specs = [None] * dist.get_world_size()
            dist.all_gather_object(specs, None if tree is None else _spec(tree))
        known = [s for s in specs if s is not None]
        if not known:
            return tree
        if any(s != known[0] for s in known):
            raise ValueError("processes hold accumulators of different layouts; they cannot be summed.")
        if tree is None:
            tree = _zeros(known[0])
    elif tree is None:
        raise RuntimeError("an accumulator saw no minibatch and there is no process group to learn its layout from.")
    leaves = _leaves(tree)
    flat = all_reduce_sum(torch.cat([t.reshape(-1).to(torch.float64) for t in leaves]), accelerator)
    out, off = [], 0
    for t in leaves:
        out.append(flat[off : off + t.numel()].reshape(t.shape).to(t.device, t.dtype))
        off += t.numel()
    return _rebuild(tree, iter(out))
