"""A lower bound of the memory one training process needs, checked before any of it is allocated.

A recipe whose model or batch cannot fit (``data.img_size: 1024`` with ``model.patch_size: 1`` is a million tokens an
image) would otherwise fail deep in the allocator with a traceback, after the data were decoded. :func:`check` refuses
it in one sentence with the estimate and the memory available. What is counted, and counted low so that no run that
fits is refused:

- the parameters (the model built on the meta device: no memory), their gradients and AdamW's two moments, in float32:
  16 bytes a parameter;
- the activations one training micro-batch keeps for the backward pass: a ViT or Mixer block keeps at least
  (4 + 2 x mlp_ratio) x embed_dim values a token (its input, the two norms' outputs, the attention or token-mixing
  output, the MLP's hidden units before and after the activation), a ResNet block two maps of its output width;
  attention matrices are not counted (fused attention need not hold them), nor an objective's own parts; 2 bytes a
  value in bf16 / fp16, else 4.

The memory available is the GPU's free memory, or on a CPU the host's MemAvailable (lower still when a cgroup limits
the process), shared equally by the processes of the host.
"""

from __future__ import annotations

import os
from pathlib import Path

from train.errors import RecipeError

GiB = 2**30


def model_parameters(recipe) -> int:
    """The number of parameters of the recipe's model (built on the meta device: nothing allocated)."""
    import torch

    from train.models import build_model

    with torch.device("meta"):
        model = build_model(recipe, 10)
    return sum(p.numel() for p in model.parameters())


def activation_values(recipe) -> int:
    """A lower bound of the values one training micro-batch keeps for the backward pass (module docstring)."""
    m, d, b = recipe.model, recipe.data, recipe.train.batch_size
    if m.arch in ("vit", "mixer"):
        tokens = (d.img_size // m.patch_size) ** 2
        if m.arch == "vit":
            tokens += (m.head == "cls") + m.reg_tokens
        return b * m.depth * tokens * int((4 + 2 * m.mlp_ratio) * m.embed_dim)
    side = d.img_size if m.small_stem else max(1, d.img_size // 4)  # timm's stem: stride 2, then a max-pool
    expansion = 4 if m.resnet_block == "bottleneck" else 1
    total = 0
    for i, (blocks, width) in enumerate(zip(m.resnet_layers, m.resnet_channels, strict=False)):
        side = side if i == 0 else max(1, (side + 1) // 2)
        total += blocks * 2 * width * expansion * side * side
    return b * total


def available_bytes(device) -> int | None:
    """Memory this process may still allocate on ``device`` (a torch.device), or None when it cannot be told."""
    if device.type == "cuda":
        import torch

        return int(torch.cuda.mem_get_info(device)[0])
    if device.type != "cpu":
        return None
    free = []
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                free.append(int(line.split()[1]) * 1024)
    except (OSError, ValueError, IndexError):
        pass
    try:  # cgroup v2: the limit less what the group already uses
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        if limit != "max":
            free.append(int(limit) - int(Path("/sys/fs/cgroup/memory.current").read_text()))
    except (OSError, ValueError):
        pass
    if not free:
        return None
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1)
    return min(free) // max(1, local)


def problem(recipe, device) -> str | None:
    """The one sentence (the estimate and what is available) when the lower bound of the module docstring exceeds the
    memory available on ``device``, else None."""
    avail = available_bytes(device)
    if avail is None:
        return None
    state = 16 * model_parameters(recipe)
    act = activation_values(recipe) * (2 if recipe.train.mixed_precision in ("bf16", "fp16") else 4)
    if state + act <= avail:
        return None
    where = "this GPU" if device.type == "cuda" else "this host, per process"
    return (
        f"this recipe needs at least {(state + act) / GiB:.1f} GiB to train ({state / GiB:.1f} GiB of weights, "
        f"gradients and AdamW state, {act / GiB:.1f} GiB of activations for a batch of {recipe.train.batch_size}) but "
        f"{avail / GiB:.1f} GiB are free on {where}: lower train.batch_size, data.img_size or the model's size, or "
        "raise model.patch_size."
    )


def check(recipe, acc) -> None:
    """Collective: RecipeError on every process when the main process finds a :func:`problem` on its device (the
    processes agree, however their free memory differs by a few bytes)."""
    from train.collective import broadcast

    why = broadcast(acc, problem(recipe, acc.device) if acc.is_main_process else None)
    if why:
        raise RecipeError(why)
