"""``data_subset: {fraction: f | count: n, seed: s}`` (Raghu et al. 2021 §8, ViT paper §4.3): pretrain on a
class-balanced, seeded, nested subset of the train split (after ``data.train_size``): for one seed the 3%
subset lies inside the 10% one. The data layer records its size and the hash of its indices in meta.json.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Config:
    """Pretrain on a class-balanced, seeded, nested subset of the train split (give fraction or count)."""

    fraction: float | None = field(default=None, metadata={"lo": 0.0, "hi": 1.0, "lo_open": True})
    count: int | None = field(default=None, metadata={"lo": 1})
    seed: int = field(default=0, metadata={"lo": 0})


def check(cfg: Config, recipe) -> str | None:
    if (cfg.fraction is None) == (cfg.count is None):
        return "key 'interventions.data_subset' needs exactly one of 'fraction' (0 < f <= 1) or 'count' (n >= 1)."
    return None


def select_train(cfg: Config, labels, balanced_indices):
    """``balanced_indices(labels, n, seed)`` with n = count, or fraction x the split's size (rounded)."""
    n = cfg.count if cfg.count is not None else int(round(cfg.fraction * len(labels)))
    if n > len(labels):
        raise ValueError(
            f"interventions.data_subset.count {n} exceeds the train split's {len(labels)} images: lower it."
        )
    return balanced_indices(labels, n, cfg.seed)
