"""Reduction over processes and sharding of minibatches, in one place, whatever the backend (gloo on CPU, NCCL on GPUs)."""
from __future__ import annotations

import torch


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
    from accelerate.utils import gather_object

    return gather_object(items)


def collect(parts: list, accelerator=None) -> tuple[dict, torch.Tensor]:
    """Per-minibatch parts ``(j, {key: Tensor [b, ...]}, labels [b])`` from every process, put in minibatch
    order j and concatenated: ({key: Tensor [N, ...]}, labels [N]) -- the same on 1 and N processes."""
    parts = sorted(gather_objects(parts, accelerator), key=lambda p: p[0])
    keys = parts[0][1].keys()
    return {k: torch.cat([p[1][k] for p in parts]) for k in keys}, torch.cat([p[2] for p in parts])


def shard(n_batches: int, accelerator=None) -> range:
    """The minibatch indices this process takes: j = rank (mod world), all of them with one process. A process
    may get none (fewer minibatches than processes); its accumulators then contribute zeros to every sum."""
    if accelerator is None or accelerator.num_processes == 1:
        return range(n_batches)
    return range(accelerator.process_index, n_batches, accelerator.num_processes)
