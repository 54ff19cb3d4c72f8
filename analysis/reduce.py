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
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else t.device
        out = t.to(device, copy=True)
        dist.all_reduce(out)
        return out.to(t.device)
    return t
