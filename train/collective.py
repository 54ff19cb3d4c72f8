"""Collective helpers: every process calls them, and every process gets the same answer. With one process they
cost nothing (no communication); torch and accelerate are imported only when there are several."""

from __future__ import annotations


def broadcast(acc, value):
    """The main process's ``value`` on every process."""
    if acc.num_processes == 1:
        return value
    from accelerate.utils import broadcast_object_list

    return broadcast_object_list([value])[0]


def any_process(acc, flag: bool) -> bool:
    """True on every process when ``flag`` is true on any."""
    if acc.num_processes == 1:
        return flag
    import torch

    t = torch.tensor([1.0 if flag else 0.0], device=acc.device)
    return bool(acc.reduce(t, reduction="sum").item() > 0)


def gather_floats(acc, value) -> list[float]:
    """Each process's scalar ``value`` (a float or a one-element tensor), in process order, on every process."""
    import torch

    mine = torch.as_tensor(value, dtype=torch.float32, device=acc.device).reshape(1)
    return [float(v) for v in (acc.gather(mine) if acc.num_processes > 1 else mine).cpu()]
