"""Fine-tuning and linear evaluation of a pretrained run (recipe keys ``train.init_from``, ``train.init_part``,
``train.freeze_backbone``), so "pretrain with MAE / DINO, then fine-tune" is one recipe each:

    ./launch.sh recipes/finetune.yaml    --set train.init_from=runs/<pretrain run>
    ./launch.sh recipes/linear_eval.yaml --set train.init_from=runs/<pretrain run>

``init_from`` is a run folder (its last complete checkpoint), a checkpoint folder (``.../checkpoints/step_XXXXXXX``)
or a run's name under ``run.root``. ``init_part`` names the network of that checkpoint to start from (``student``,
the backbone, by default; ``teacher`` for DINO's EMA teacher: the parts its objective records in meta.json). Every
weight of the new run's backbone is loaded from it except the classifier head, which is new (initialised as the
recipe's model builds it, from the recipe's seed); a backbone that does not fit (another architecture, image size or
channel count) is one sentence naming the recipe keys that differ from the pretrained run's.

``freeze_backbone: true`` is linear evaluation (DINO's and MAE's linear probing): only the classifier head trains.
The frozen backbone stays in eval mode for the whole run, so its dropout and drop-path are off and a ResNet's
BatchNorm statistics do not move: the head is trained on the very features the pretrained network computes
(deterministic, as in DINO's eval_linear.py, which runs the backbone under ``torch.no_grad`` in eval mode), and the
backbone's weights and buffers leave the run exactly as they came in. Without ``init_from`` it trains a head on a
randomly initialised backbone (the random-features baseline).

The start is recorded in the run's meta.json (``init_from``: path, checkpoint, step, part, the weights' sha256).
A resumed run loads its own checkpoint, never ``init_from`` again (the pretrained run may have moved on or be gone);
``init_from`` is part of the recipe hash, so resuming with another one is refused.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch.nn as nn
import yaml

from train.checkpoint import META, CheckpointError, fit_report, list_checkpoints, read_weights, verify_checkpoint
from train.errors import RecipeError
from train.recipe import flatten

DEFAULT_PART = "student"
# recipe keys that do not change the shapes of a model's tensors (left out when naming what differs)
_SHAPELESS = ("model.dropout", "model.drop_path")


def checkpoint_of(spec: str, run_root: str | Path = "runs") -> Path:
    """The checkpoint folder ``train.init_from`` names; CheckpointError (one sentence) when there is none."""
    p = Path(spec)
    if not p.exists() and not p.is_absolute() and (Path(run_root) / spec).exists():
        p = Path(run_root) / spec  # a run's name under run.root
    if not p.exists():
        raise CheckpointError(
            f"train.init_from '{spec}' does not exist: pass a run folder (runs/<name>) or one of its "
            "checkpoints (runs/<name>/checkpoints/step_XXXXXXX)."
        )
    if (p / META).is_file():
        return p
    if (p / "checkpoints").is_dir() or (p / "recipe.yaml").is_file():
        done = list_checkpoints(p / "checkpoints", warn=False)
        if not done:
            raise CheckpointError(
                f"train.init_from '{spec}' has no complete checkpoint: train that run until its first "
                "checkpoint, or pass another run."
            )
        return done[-1]
    raise CheckpointError(
        f"train.init_from '{spec}' is neither a run folder nor a checkpoint folder (no recipe.yaml, "
        "checkpoints/ or meta.json): pass runs/<name> or runs/<name>/checkpoints/step_XXXXXXX."
    )


def classifier_name(net: nn.Module) -> str | None:
    """The name of ``net``'s classifier head module (timm's ``get_classifier()``), or None when it has none with
    weights."""
    head = net.get_classifier() if hasattr(net, "get_classifier") else None
    if head is None or not any(True for _ in head.parameters()):
        return None
    return next((n for n, m in net.named_modules() if m is head and n), None)


def _is_head(key: str, head: str | None) -> bool:
    return head is not None and (key == head or key.startswith(head + "."))


def _differing_keys(recipe, ckpt: Path) -> list[str]:
    """``key=source value (this recipe: value)`` for the model / image keys of the pretrained run's recipe.yaml that
    differ from ``recipe``'s (those that change tensor shapes); empty when that recipe cannot be read."""
    try:
        saved = yaml.safe_load((ckpt.parent.parent / "recipe.yaml").read_text())
    except (OSError, yaml.YAMLError):
        return []
    if not isinstance(saved, dict):
        return []
    old = flatten(
        {
            "model": saved.get("model") or {},
            "data": {k: (saved.get("data") or {}).get(k) for k in ("img_size", "in_chans")},
        }
    )
    new = flatten(
        {
            "model": recipe.to_dict()["model"],
            "data": {"img_size": recipe.data.img_size, "in_chans": recipe.data.in_chans},
        }
    )
    return [
        f"{k}={old[k]} (this recipe: {new.get(k)})" for k in sorted(old) if k not in _SHAPELESS and old[k] != new.get(k)
    ]


def check(recipe, objective) -> None:
    """The recipe's init_from keys against its objective; RecipeError (one sentence) when they do not go together."""
    t = recipe.train
    if t.freeze_backbone and not objective.uses_labels:
        raise RecipeError(
            f"train.freeze_backbone trains only a classifier head, which train.objective '{objective.name}' does not "
            "have: set train.objective=supervised for linear evaluation, or train.freeze_backbone=false."
        )
    if t.init_part != DEFAULT_PART and not t.init_from:
        raise RecipeError(
            f"train.init_part is '{t.init_part}' but train.init_from is not set: give the pretrained run "
            "(--set train.init_from=runs/<name>) or leave train.init_part out."
        )


def load_pretrained(recipe, net: nn.Module) -> dict:
    """Load ``train.init_from``'s network ``train.init_part`` into ``net``, all but its classifier head; return the
    record for meta.json. CheckpointError (one sentence) when it cannot be done; nothing is written either way."""
    t = recipe.train
    ckpt = checkpoint_of(t.init_from, recipe.run.root)
    meta = verify_checkpoint(ckpt)
    parts = (meta.get("objective") or {}).get("parts") or {DEFAULT_PART: ""}
    if t.init_part not in parts:
        raise CheckpointError(
            f"train.init_part is '{t.init_part}' but {ckpt} holds {', '.join(parts)} (objective "
            f"{(meta.get('objective') or {}).get('name', 'supervised')}): set train.init_part={next(iter(parts))}."
        )
    state, _ = read_weights(ckpt, parts[t.init_part])
    head = classifier_name(net)
    own = {k: v for k, v in net.state_dict().items() if not _is_head(k, head)}
    state = {k: v for k, v in state.items() if not _is_head(k, head)}  # a supervised source's head is not this run's
    why = fit_report(own, state)
    if why:
        keys = _differing_keys(recipe, ckpt)
        fix = (
            f"its run was trained with {', '.join(keys)}: set the same (--set "
            f"{' '.join(k.split(' ')[0] for k in keys)})"
            if keys
            else "the recipe's model section and data.img_size / in_chans must match the pretrained run's"
        )
        raise CheckpointError(f"train.init_from {ckpt} does not fit this model ({why}); {fix}.")
    net.load_state_dict(
        state, strict=False
    )  # strict but for the head, checked above: the head keeps its new initialisation
    return {
        "path": str(t.init_from),
        "checkpoint": str(ckpt),
        "step": int(meta.get("step", 0)),
        "part": t.init_part,
        "sha256": meta["files"]["model.safetensors"],
        "objective": (meta.get("objective") or {}).get("name", "supervised"),
    }


def freeze(net: nn.Module) -> int:
    """Linear evaluation: every parameter but the classifier head's stops training, and every module but the head
    stays in eval mode whatever ``train()`` is called (no dropout / drop-path, BatchNorm statistics frozen).
    Returns the number of parameters left to train."""
    head = classifier_name(net)
    frozen = [m for n, m in net.named_modules() if n and not _is_head(n, head)]
    trained = 0
    for n, p in net.named_parameters():
        p.requires_grad_(_is_head(n, head))
        trained += p.numel() if p.requires_grad else 0
    plain_train = net.train

    def train(mode: bool = True):
        plain_train(mode)
        for m in frozen:
            m.training = False
        return net

    net.train = train  # an instance attribute: DDP's and the trainer's train() calls reach it through the module tree
    net.train(net.training)
    return trained


def apply(recipe, objective, resumed_meta: dict | None) -> dict | None:
    """Called by the trainer right after the objective is built, before the optimizer and before anything is
    written: freeze the backbone for linear evaluation, and on a fresh start load ``train.init_from``. Returns what
    meta.json records under ``init_from`` (the resumed checkpoint's own record on resume), or None."""
    t = recipe.train
    check(recipe, objective)
    net = objective.network
    record = None
    if t.init_from:
        record = resumed_meta.get("init_from") if resumed_meta is not None else load_pretrained(recipe, net)
    if t.freeze_backbone:
        if not freeze(net):
            raise RecipeError(
                "train.freeze_backbone leaves nothing to train (the model has no classifier head): set it to false."
            )
        if not t.init_from and resumed_meta is None and os.environ.get("RANK", "0") == "0":
            print(
                "note: train.freeze_backbone without train.init_from trains a linear head on a randomly initialised "
                "backbone "
                "(the random-features baseline).",
                file=sys.stderr,
            )
        record = {**(record or {}), "freeze_backbone": True}
    return record
