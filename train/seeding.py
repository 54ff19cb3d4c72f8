"""Per-step seeds: what a training step draws is a function of (recipe seed, step, process), so a resumed run
draws the same augmentation, mixing, masks and crops as an uninterrupted one."""

from __future__ import annotations

import random

import numpy as np
import torch


def step_seed(seed: int, step: int, rank: int) -> int:
    return (seed * 1_000_003 + step) * 4096 + rank


def reseed_step(seed: int, step: int, rank: int) -> None:
    """Torch's, numpy's and Python's global RNGs from (seed, step, rank), before every optimizer step: what a step
    draws (augmentation, dropout, timm's Mixup, which uses numpy's) is then the same in a resumed run."""
    s = step_seed(seed, step, rank)
    torch.manual_seed(s)
    words = [(s >> (32 * i)) & 0xFFFFFFFF for i in range(max(1, (s.bit_length() + 31) // 32))]
    np.random.seed(words)  # the legacy global RandomState takes 32-bit words
    random.seed(s)


# step_generator's stream is apart from the global RNGs that reseed_step seeds with step_seed itself: a generator
# seeded with the same number would repeat their draws (e.g. the first torch.rand of a crop would be the flip's)
_GENERATOR_STREAM = 0x9E3779B97F4A7C15


def step_generator(seed: int, step: int, rank: int, device) -> torch.Generator:
    """A torch generator for step ``step`` on process ``rank`` (e.g. an objective's masks): the same draws after a
    resume, different on every process, and independent of the augmentation's draws from torch's global RNG."""
    g = torch.Generator(device=device)
    g.manual_seed((step_seed(seed, step, rank) ^ _GENERATOR_STREAM) & 0xFFFFFFFFFFFFFFFF)
    return g
