"""Summing accumulator state over processes, whatever the backend (gloo on CPU, NCCL on GPUs)."""
from __future__ import annotations

import torch


def all_reduce_sum(t: torch.Tensor, accelerator=None) -> torch.Tensor:
    """The sum of ``t`` over all processes (``t`` itself with one process). With an Accelerator the tensor
    travels on its device (NCCL needs GPU tensors) and comes back to ``t``'s device."""
    if accelerator is not None:
        if accelerator.num_processes == 1:
            return t
        return accelerator.reduce(t.to(accelerator.device), reduction="sum").to(t.device)
    if torch.distributed.is_available() and torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
        t = t.clone()
        torch.distributed.all_reduce(t)
    return t
