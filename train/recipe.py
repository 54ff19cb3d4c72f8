"""Recipes: YAML files validated against a typed schema.

A recipe is one experiment. It is read from YAML, may inherit from another file with ``base: other.yaml``
(paths relative to the file that names them; the child's keys win, nested mappings merge), takes
``--set a.b=value`` overrides (values parsed as YAML), and is validated against the dataclasses below:
unknown keys, wrong types and out-of-range values raise :class:`RecipeError` with one sentence that names
the key and says what is allowed. The resolved recipe is written into the run folder as ``recipe.yaml``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from interventions import InterventionsConfig
from interventions import check as check_interventions
from train.callbacks import is_callback_name, known_callbacks
from train.coerce import coerce, did_you_mean, shown
from train.errors import RecipeError
from train.objectives import ObjectivesConfig
from train.objectives import check as check_objective


def _range(lo=None, hi=None, lo_open=False, why=None):
    """A numeric field's range (``why``: the reason for a bound, said when a value is out of it)."""
    return {"lo": lo, "hi": hi, "lo_open": lo_open, "why": why}


# Bounds that keep a run finishable: step counts and cadences fit torch's and TensorBoard's 32-bit step counters
# (2^31 - 1 steps), and one batch holds at most 2^20 images (a million; the default model's activations for that many
# would take ~100 GiB).
MAX_STEPS = 2**31 - 1
MAX_BATCH = 2**20
_STEPS = {"hi": MAX_STEPS, "why": "step counts are below 2^31"}
_BATCH = {"hi": MAX_BATCH, "why": "a batch holds at most 2^20 images"}


@dataclass
class AugmentConfig:
    shift: int = field(default=2, metadata=_range(0, 64))  # random translation by up to +-shift pixels (zero pad)
    hflip: bool = True  # random horizontal flip with probability 1/2
    # Inception-style crop (scale (0.08, 1), ratio (3/4, 4/3)) resized to img_size, as in the ViT paper's ImageNet
    # training: per image in the DataLoader workers for a lazy train split (seeded by (seed, epoch, index)), on the
    # whole batch on the device for an in-memory one (torch's per-step RNG, like shift and flip)
    random_resized_crop: bool = False
    # mixup / CutMix of the normalised batch on the device with soft targets (timm's Mixup, SoftTargetCrossEntropy;
    # train.label_smoothing smooths the mixed targets): on when an alpha is > 0; Beta(alpha, alpha) draws the mixing
    # weight, mix_prob is the chance a batch (mode batch) or image (pair, elem) is mixed at all, switch_prob the
    # chance of CutMix rather than mixup when both alphas are > 0. Training only: eval and analyses see plain images.
    mixup_alpha: float = field(default=0.0, metadata=_range(0.0, 100.0))
    cutmix_alpha: float = field(default=0.0, metadata=_range(0.0, 100.0))
    mix_prob: float = field(default=1.0, metadata=_range(0.0, 1.0))
    switch_prob: float = field(default=0.5, metadata=_range(0.0, 1.0))
    mix_mode: Literal["batch", "pair", "elem"] = "batch"  # one weight per batch, per pair of images, per image
    # RandAugment (torchvision's v2.RandAugment, image by image on the device after crop / shift / flip, torch's
    # per-step RNG): randaugment_ops ops per image (0: off) at magnitude randaugment_magnitude of 0-30
    randaugment_ops: int = field(default=0, metadata=_range(0, 8))
    randaugment_magnitude: int = field(default=9, metadata=_range(0, 30))


@dataclass
class DataConfig:
    source: Literal["fashion_mnist", "hub", "imagefolder", "parquet", "disk"] = "fashion_mnist"
    name: str | None = None  # hub data set name (e.g. cifar10) when source=hub
    path: str | None = None  # folder for imagefolder/parquet (or the Fashion-MNIST folder)
    train_split: str = "train"
    eval_split: str = "test"
    image_column: str | None = None  # default: the first Image feature, else 'image' or 'img'
    label_column: str | None = None  # default: the first ClassLabel feature, else 'label'
    img_size: int = field(default=28, metadata=_range(8, 1024))
    in_chans: int = field(default=1, metadata=_range(1, 4))
    probe_train_size: int = field(default=2000, metadata=_range(0))  # seeded, class-balanced part of train
    analysis_size: int = field(default=1024, metadata=_range(0))  # fixed, seeded, class-balanced part of eval
    eval_size: int | None = field(default=None, metadata=_range(1))  # None: the whole eval split
    train_size: int | None = field(default=None, metadata=_range(1))  # None: the whole train split
    # images held out of the train split as a validation split (0: none), chosen first, from a fixed seed
    # (train.data.VAL_SEED): train_size, a data_subset, probe_train and the normalisation statistics use the rest
    val_size: int = field(default=0, metadata=_range(0))
    num_workers: int = field(default=0, metadata=_range(0, 64))
    # auto: the train split is decoded into memory when it fits under train.data.MAX_IN_MEMORY_BYTES, else it stays
    # a memory-mapped datasets.Dataset decoded batch by batch in the DataLoader workers (ImageNet-scale data)
    in_memory: Literal["auto", "true", "false"] = "auto"
    augment: AugmentConfig = field(default_factory=AugmentConfig)


@dataclass
class ModelConfig:
    """``arch``: ``vit`` (timm VisionTransformer), ``resnet`` (timm ResNet) or ``mixer`` (timm MlpMixer, Raghu App. H).

    A mixer uses ``patch_size``, ``depth`` (number of MixerBlocks), ``embed_dim`` (channels), ``mlp_ratio``
    (channel-mixing MLP hidden = mlp_ratio * embed_dim; timm's default is 4.0) and ``mixer_token_ratio``
    (token-mixing MLP hidden = mixer_token_ratio * embed_dim, as timm counts it; timm's default is 0.5), and
    ``drop_path`` (timm gives every MixerBlock the same rate; a ViT's rate rises linearly with depth). It has no
    class token and always classifies the token mean, so ``head`` and ``num_heads`` do not apply to it.
    """

    arch: Literal["vit", "resnet", "mixer"] = "vit"
    patch_size: int = field(default=4, metadata=_range(1, 64))  # vit, mixer
    depth: int = field(default=6, metadata=_range(1, 64))  # vit, mixer: number of blocks
    embed_dim: int = field(default=96, metadata=_range(8, 8192))  # vit, mixer: token width
    num_heads: int = field(default=4, metadata=_range(1, 128))  # vit
    mlp_ratio: float = field(default=2.0, metadata=_range(0.0, 64.0, lo_open=True))  # vit MLP; mixer channel-mixing MLP
    mixer_token_ratio: float = field(
        default=0.5, metadata=_range(0.0, 64.0, lo_open=True)
    )  # mixer token-mixing MLP, x embed_dim
    head: Literal["cls", "gap"] = "cls"  # vit only (a mixer always averages its tokens; a resnet pools its map)
    drop_path: float = field(default=0.0, metadata=_range(0.0, 1.0))
    # ResNet baseline (timm ResNet, BasicBlock): blocks per stage and the widths of the stages
    resnet_layers: list[int] = field(default_factory=lambda: [2, 2, 2, 2])
    resnet_channels: list[int] = field(default_factory=lambda: [32, 64, 128, 256])
    small_stem: bool = True  # 3x3 stride-1 stem without max-pool, for 28-32 px images
    resnet_block: Literal["basic", "bottleneck"] = (
        "basic"  # bottleneck + layers [3,4,6,3] + channels [64,128,256,512]: ResNet-50
    )
    # vit / mixer: dropout after every dense layer but the qkv projection and after adding the position embedding
    # (ViT paper App. B.1: 0.1 on ImageNet); timm's drop_rate and proj_drop_rate
    dropout: float = field(default=0.0, metadata=_range(0.0, 1.0))
    # vit: learnable register tokens (Darcet et al. 2024), timm's reg_tokens; prefix tokens after the class token
    reg_tokens: int = field(default=0, metadata=_range(0, 64))
    # the seed of the model's initial weights alone (None: the run's seed, which also orders the data): runs of two
    # configurations that share a seed otherwise start from the same weights, which flatters their CKA similarity;
    # a study gives each configuration its own with `init: own`
    init_seed: int | None = field(default=None, metadata=_range(0, 2**32 - 1))


@dataclass
class TrainConfig:
    steps: int = field(default=1000, metadata=_range(1, **_STEPS))  # optimizer steps
    batch_size: int = field(default=128, metadata=_range(1, **_BATCH))  # per process, per micro-batch
    grad_accum: int = field(default=1, metadata=_range(1, 1024))
    lr: float = field(default=1e-3, metadata=_range(0.0, 10.0, lo_open=True))
    min_lr: float = field(default=0.0, metadata=_range(0.0))
    weight_decay: float = field(default=0.05, metadata=_range(0.0, 10.0))
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    warmup_steps: int = field(default=100, metadata=_range(0, **_STEPS))
    schedule: Literal["cosine", "linear", "constant"] = "cosine"
    grad_clip: float = field(default=1.0, metadata=_range(0.0))  # 0 disables clipping
    label_smoothing: float = field(default=0.1, metadata=_range(0.0, 1.0))
    mixed_precision: Literal["no", "bf16", "fp16"] = "bf16"
    eval_every: int = field(default=500, metadata=_range(0, **_STEPS))  # 0: only at the end
    eval_batch_size: int = field(default=500, metadata=_range(1, **_BATCH))
    checkpoint_every: int = field(default=500, metadata=_range(0, **_STEPS))  # 0: only at the end
    keep_last: int = field(default=3, metadata=_range(1))
    log_every: int = field(default=10, metadata=_range(1, **_STEPS))
    # how the model is taught: supervised (cross-entropy on labels), dino, mae (train/objectives/<name>.py; options
    # in the recipe section objectives.<name>)
    objective: str = "supervised"
    # start from a pretrained run (train/init_from.py): a run folder (its last checkpoint), a checkpoint folder, or a
    # run's name under run.root; every weight but the classifier head is loaded from its network init_part
    init_from: str | None = None
    init_part: str = "student"  # the network of init_from's checkpoint: student (the backbone) or e.g. teacher (DINO)
    freeze_backbone: bool = False  # linear evaluation: only the classifier head trains, the backbone stays in eval mode
    # torch.compile (inductor) of the module the update step calls (train/compiling.py): evaluation, callbacks and
    # checkpoints see the original module; same weights as eager up to float rounding, so --resume may toggle it
    compile: bool = False


@dataclass
class CallbackConfig:
    name: str
    every: int | None = field(default=None, metadata=_range(1))  # None: at every checkpoint
    options: dict = field(default_factory=dict)

    @classmethod
    def from_recipe(cls, value):
        """``name`` alone, or a mapping whose keys other than name / every / options are the callback's options."""
        if isinstance(value, str):
            return {"name": value}
        if not isinstance(value, dict):
            return value
        own = {k: v for k, v in value.items() if k in ("name", "every", "options")}
        extra = {k: v for k, v in value.items() if k not in own}
        if extra and isinstance(own.get("options", {}), dict):
            own["options"] = {**own.get("options", {}), **extra}
        return own


@dataclass
class RunConfig:
    root: str = "runs"
    name: str | None = None  # default: recipe file name plus the overrides; a folder name, not a path


# Fields added after runs had been trained, with the value that reproduces the earlier behaviour. Recipe.hash()
# leaves such a field out while it holds that value, so runs trained before the field existed still resume.
# (An intervention added later needs no entry: see _HASHED_WHEN_ABSENT.)
ADDED_FIELDS: dict[tuple[str, ...], Any] = {
    ("data", "in_memory"): "auto",
    ("data", "augment", "random_resized_crop"): False,
    ("model", "resnet_block"): "basic",
    ("model", "dropout"): 0.0,
    ("model", "mixer_token_ratio"): 0.5,
    ("data", "augment", "mixup_alpha"): 0.0,
    ("data", "augment", "cutmix_alpha"): 0.0,
    ("data", "augment", "mix_prob"): 1.0,
    ("data", "augment", "switch_prob"): 0.5,
    ("data", "augment", "mix_mode"): "batch",
    ("data", "augment", "randaugment_ops"): 0,
    ("data", "augment", "randaugment_magnitude"): 9,
    ("train", "objective"): "supervised",
    ("data", "val_size"): 0,
    ("train", "init_from"): None,
    ("train", "init_part"): "student",
    ("train", "freeze_backbone"): False,
    ("model", "reg_tokens"): 0,
    ("model", "init_seed"): None,
    ("train", "compile"): False,
}
# The interventions that existed when the hash was defined: hashed even when absent (None / []), as they always
# were. Any other intervention is left out of the hash while absent, so adding one keeps every hash.
_HASHED_WHEN_ABSENT = ("no_skip", "data_subset", "head_mask")

# Keys that may change when a run is resumed (--resume): they are left out of Recipe.resume_hash(). Cadences and
# folders do not change the weights, nor does train.compile (the same computation compiled; it stays in hash(), as
# compiled kernels round differently); train.steps (extend a run), train.lr, train.warmup_steps and train.grad_clip
# (the advice after a divergence) change the schedule of the steps still to come: lr_at(step) is a function of the
# recipe in force, so a resumed run with new values is exactly "old values up to the checkpoint, new ones after".
RESUMABLE: tuple[str, ...] = (
    "train.steps",
    "train.compile",
    "train.lr",
    "train.warmup_steps",
    "train.grad_clip",
    "train.eval_every",
    "train.eval_batch_size",
    "train.checkpoint_every",
    "train.keep_last",
    "train.log_every",
    "data.num_workers",
    "callbacks",
    "run",
    "sweep",
)


@dataclass
class Recipe:
    name: str = "recipe"
    seed: int = field(
        default=0, metadata=_range(0, 2**32 - 1)
    )  # numpy's legacy global seed (accelerate's set_seed) is 32-bit
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    callbacks: list[CallbackConfig] = field(default_factory=list)
    interventions: InterventionsConfig = field(default_factory=InterventionsConfig)
    objectives: ObjectivesConfig = field(default_factory=ObjectivesConfig)  # options of train.objective
    run: RunConfig = field(default_factory=RunConfig)
    # ./launch.sh sweep without --grid uses this grid: {dotted key: [value, ...]}, one run per combination
    sweep: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def _hashed(self) -> dict:
        d = self.to_dict()
        d.pop("run")
        d.pop("sweep")
        d["callbacks"] = []  # callbacks observe; they do not change the weights
        for path, default in ADDED_FIELDS.items():
            *parents, leaf = path
            sec = d
            for p in parents:
                sec = sec.get(p, {})
            if leaf in sec and sec[leaf] == default and type(sec[leaf]) is type(default):
                sec.pop(leaf)
        if all(v is None for v in d["objectives"].values()):  # added with objectives: absent keeps older hashes
            d.pop("objectives")
        for name in list(d["interventions"]):
            if name not in _HASHED_WHEN_ABSENT and d["interventions"][name] in (None, []):
                d["interventions"].pop(name)
        return d

    def hash(self) -> str:
        """sha256 (16 hex digits) of everything that changes what is trained (not the run folder's name nor the
        callbacks): the recipe's fingerprint, recorded in every checkpoint's meta.json."""
        return _digest(self._hashed())

    def resume_hash(self) -> str:
        """:meth:`hash` without the :data:`RESUMABLE` keys: what must stay the same for ``--resume``."""
        d = self._hashed()
        for key in RESUMABLE:
            *parents, leaf = key.split(".")
            sec = d
            for p in parents:
                sec = sec.get(p, {})
            sec.pop(leaf, None)
        return _digest(d)


def _digest(d: dict) -> str:
    return hashlib.sha256(json.dumps(d, sort_keys=True, default=str).encode()).hexdigest()[:16]


def resume_conflicts(recipe: Recipe, meta: dict, saved: dict | None) -> list[str] | None:
    """Whether ``recipe`` may resume the checkpoint whose meta.json is ``meta``: None when it may, else the dotted
    keys that differ and may not change (empty when they cannot be named). ``saved`` is the run's resolved
    recipe.yaml (a dict), used to name the keys and to judge checkpoints written before ``resume_hash`` was
    recorded (its own hash must then be the checkpoint's)."""
    if "resume_hash" in meta:
        same = meta["resume_hash"] == recipe.resume_hash()
    elif meta.get("recipe_hash") == recipe.hash():
        same = True
    else:
        try:
            old = from_dict(saved, name=saved.get("name", "recipe")) if isinstance(saved, dict) else None
        except RecipeError:
            old = None
        same = old is not None and old.hash() == meta.get("recipe_hash") and old.resume_hash() == recipe.resume_hash()
    if same:
        return None
    if not isinstance(saved, dict):
        return []
    old, new = flatten(saved), flatten(recipe.to_dict())
    free = tuple(RESUMABLE)
    return sorted(
        k
        for k in set(old) | set(new)
        if old.get(k) != new.get(k) and not (k in free or k.startswith(tuple(f + "." for f in free)))
    )


# ---------------------------------------------------------------- reading YAML


class _DuplicateKey(yaml.YAMLError):
    def __init__(self, key, line: int):
        super().__init__(f"duplicate key {key!r}")
        self.key, self.line = key, line


class _Anchor(yaml.YAMLError):
    def __init__(self, what: str, line: int):
        super().__init__(f"YAML {what}")
        self.what, self.line = what, line


class _Loader(yaml.SafeLoader):
    """PyYAML's safe loader, plus: ``1e-3`` is a float (YAML 1.2; YAML 1.1 wants ``1.0e-3`` and reads ``1e-3``
    as a string), a key given twice in one mapping is an error (YAML keeps the last one silently), and anchors
    (``&a``) and aliases (``*a``) are refused as they are read: a few lines of aliases of aliases ("billion
    laughs") expand to more values than any machine holds, and recipes share values through ``base:``."""

    def compose_node(self, parent, index):
        event = self.peek_event()
        if isinstance(event, yaml.AliasEvent):
            raise _Anchor(f"alias '*{event.anchor}'", event.start_mark.line + 1)
        if getattr(event, "anchor", None) is not None:
            raise _Anchor(f"anchor '&{event.anchor}'", event.start_mark.line + 1)
        return super().compose_node(parent, index)

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            try:
                key = self.construct_object(key_node, deep=True)
                hash(key)
            except (TypeError, yaml.YAMLError):
                continue  # SafeLoader itself reports an unhashable key
            if key in seen and key != "<<":
                raise _DuplicateKey(key, key_node.start_mark.line + 1)
            seen.add(key)
        return super().construct_mapping(node, deep)


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
    list("-+0123456789"),
)


def _yaml(text: str, where: str):
    """Parse YAML ``text`` with :class:`_Loader`; a syntax error or a duplicate key is one sentence about ``where``."""
    try:
        return yaml.load(text, Loader=_Loader)  # _Loader is a SafeLoader
    except _DuplicateKey as e:
        raise RecipeError(f"{where} gives the key '{e.key}' twice (line {e.line}): keep one of them.") from None
    except _Anchor as e:
        raise RecipeError(
            f"{where} uses a YAML {e.what} (line {e.line}), which recipes do not take: write the value out, or "
            "share keys through 'base: other.yaml'."
        ) from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        at = f" at line {mark.line + 1}" if mark else ""
        raise RecipeError(f"{where} is not valid YAML{at}: fix the syntax there.") from None
    except RecursionError:
        raise RecipeError(
            f"{where} nests lists or mappings too deeply to read: no recipe key needs more than a few levels."
        ) from None
    except ValueError as e:  # Python refuses to convert an integer of more than sys.get_int_max_str_digits() digits
        raise RecipeError(
            f"{where} holds a number too long to read ({str(e).split(';')[0]}): no recipe key needs one."
        ) from None


def _read_yaml(path: Path) -> dict:
    if not path.is_file():
        raise RecipeError(
            f"recipe file '{path}' does not exist: pass the path of a YAML file such as recipes/default.yaml."
        )
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        text = "\0"
    if "\0" in text:
        raise RecipeError(
            f"recipe file '{path}' is not a text file (binary or not UTF-8): pass a YAML recipe such as "
            "recipes/default.yaml."
        )
    data = _yaml(text, f"recipe file '{path}'")
    if data is None:
        raise RecipeError(
            f"recipe file '{path}' is empty (no keys, only comments or blank lines): write the keys to change, or "
            "'base: default.yaml'."
        )
    if not isinstance(data, dict):
        raise RecipeError(
            f"recipe file '{path}' must hold a mapping of keys (data:, model:, train:, ...), not a "
            f"{type(data).__name__}."
        )
    return data


def _merge(base: dict, child: dict) -> dict:
    out = dict(base)
    for k, v in child.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def _load_chain(path: Path, seen: tuple = ()) -> dict:
    path = path.resolve() if path.exists() else path
    if path in seen:
        raise RecipeError(f"recipe '{path}' inherits from itself through 'base:': remove the cycle.")
    data = _read_yaml(path)
    base = data.pop("base", None)
    if base is None:
        return data
    if not isinstance(base, str):
        raise RecipeError(f"key 'base' in '{path}' must be a file name (str), got {type(base).__name__}.")
    parent = _load_chain(path.parent / base, (*seen, path))
    parent.pop("name", None)  # a recipe is named after its own file (or its own 'name:'), not its base's
    return _merge(parent, data)


def _set_override(d: dict, assignment: str) -> None:
    if "=" not in assignment:
        raise RecipeError(f"override '{assignment}' must look like key.sub=value (e.g. train.steps=200).")
    key, raw = assignment.split("=", 1)
    try:
        value = _yaml(raw, f"override '{assignment}'") if raw.strip() else None
    except RecipeError:
        value = raw
    parts = key.strip().split(".")
    cur = d
    for p in parts[:-1]:
        nxt = cur.get(p)
        if nxt is None:
            nxt = cur[p] = {}
        if not isinstance(nxt, dict):
            raise RecipeError(f"override '{assignment}': '{p}' is not a section, so it has no key '{parts[-1]}'.")
        cur = nxt
    cur[parts[-1]] = value


# ---------------------------------------------------------------- validation against the dataclasses' field types


def _check_range(value, meta: dict, key: str) -> None:
    """``metadata`` {lo, hi, lo_open} of a numeric field (see :func:`_range`)."""
    if not meta or value is None or isinstance(value, bool) or not isinstance(value, (int, float)):
        return
    lo, hi, lo_open = meta.get("lo"), meta.get("hi"), meta.get("lo_open")
    if (lo is None or (value > lo if lo_open else value >= lo)) and (hi is None or value <= hi):
        return
    lo_s = "" if lo is None else (f"> {lo}" if lo_open else f">= {lo}")
    hi_s = "" if hi is None else f"<= {hi}"
    why = f" ({meta['why']})" if meta.get("why") and hi is not None and value > hi else ""
    raise RecipeError(
        f"key '{key}' is {shown(value)}, out of range: it must be {' and '.join(s for s in (lo_s, hi_s) if s)}{why}."
    )


def _build(cls, data: dict, prefix: str = ""):
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    kwargs = {}
    for k, v in data.items():
        key = f"{prefix}.{k}" if prefix else str(k)
        if k not in fields:
            near = did_you_mean(str(k), fields, f"{prefix}." if prefix else "")
            raise RecipeError(f"unknown key '{key}'{near}: allowed keys here are {', '.join(sorted(fields))}.")
        kwargs[k] = coerce(v, hints[k], key, RecipeError, build=_build)
        _check_range(kwargs[k], fields[k].metadata, key)
    for name, f in fields.items():
        if name not in kwargs and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise RecipeError(f"key '{prefix + '.' if prefix else ''}{name}' is required.")
    return cls(**kwargs)


def _model_checks(m: ModelConfig, d: DataConfig) -> str | None:
    if m.arch in ("vit", "mixer") and d.img_size % m.patch_size:
        return f"key 'model.patch_size' ({m.patch_size}) must divide 'data.img_size' ({d.img_size})."
    if m.arch == "mixer":
        for key, ratio, what in (
            ("mixer_token_ratio", m.mixer_token_ratio, "token"),
            ("mlp_ratio", m.mlp_ratio, "channel"),
        ):
            if int(ratio * m.embed_dim) < 1:
                return (
                    f"key 'model.{key}' ({ratio}) times 'model.embed_dim' ({m.embed_dim}) "
                    f"must give at least 1 hidden unit for the {what}-mixing MLP."
                )
    if m.arch == "vit" and m.embed_dim % m.num_heads:
        return f"key 'model.num_heads' ({m.num_heads}) must divide 'model.embed_dim' ({m.embed_dim})."
    if m.arch != "resnet":
        return None
    if m.dropout > 0:
        return (
            f"key 'model.dropout' ({m.dropout}) applies to model.arch vit and mixer only: set it to 0 for a resnet "
            "(use model.drop_path)."
        )
    if len(m.resnet_layers) != 4 or len(m.resnet_channels) != 4:
        return (
            "keys 'model.resnet_layers' and 'model.resnet_channels' must each list 4 numbers (timm ResNets have 4 "
            "stages)."
        )
    if any(v < 1 for v in m.resnet_layers + m.resnet_channels):
        return "keys 'model.resnet_layers' and 'model.resnet_channels' must hold positive integers."
    return None


def _data_checks(d: DataConfig, t: TrainConfig) -> str | None:
    if d.source == "hub" and not d.name:
        return "key 'data.name' must name a Hugging Face hub data set (e.g. cifar10) when data.source is 'hub'."
    if d.source in ("imagefolder", "parquet", "disk") and not d.path:
        return f"key 'data.path' must give a folder when data.source is '{d.source}'."
    if d.val_size and d.train_split == d.eval_split:
        return (
            f"key 'data.val_size' ({d.val_size}) holds out part of the train split, which is also the eval split "
            f"('{d.eval_split}') here: give data.eval_split another split, or set data.val_size to 0."
        )
    for key, size, of, split in (
        ("analysis_size", d.analysis_size, d.eval_size, "eval"),
        ("probe_train_size", d.probe_train_size, d.train_size, "train"),
    ):
        if of is not None and size > of:
            return (
                f"key 'data.{key}' ({size}) is more than the {split} split holds ('data.{split}_size' ({of})): "
                f"lower it to at most {of}."
            )
    a = d.augment
    if (a.mixup_alpha > 0 or a.cutmix_alpha > 0) and t.batch_size % 2:
        return (
            f"key 'train.batch_size' ({t.batch_size}) must be even when data.augment.mixup_alpha or cutmix_alpha "
            "is > 0 (timm's Mixup pairs each image with the batch's mirror image): make it even."
        )
    return None


def _train_checks(t: TrainConfig) -> str | None:
    if t.min_lr > t.lr:
        return f"key 'train.min_lr' ({t.min_lr}) must not exceed 'train.lr' ({t.lr})."
    if len(t.betas) != 2 or not all(0.0 <= b < 1.0 for b in t.betas):
        return f"key 'train.betas' must be two numbers in [0, 1), got {t.betas}."
    return None


def _run_checks(r: Recipe) -> str | None:
    for i, cb in enumerate(r.callbacks):
        if not is_callback_name(cb.name):
            return (
                f"key 'callbacks[{i}].name' is '{cb.name}', which is not a known callback"
                f"{did_you_mean(cb.name, known_callbacks())}: choose one of {', '.join(sorted(known_callbacks()))}, or "
                "give package.module:Class."
            )
    for k, v in r.sweep.items():
        if not isinstance(v, list) or not v:
            return f"key 'sweep.{k}' must be a non-empty list of values to try."
    name = r.run.name
    if name is not None and (not name or name in (".", "..") or "/" in name or "\\" in name or "\0" in name):
        return (
            f"key 'run.name' ({name!r}, also --name) must be a folder name, not a path: no '/', '\\' or '..' (the "
            "folder goes under run.root)."
        )
    return None


def _cross_checks(r: Recipe) -> None:
    """Checks between keys (and of the interventions and objective against the rest): the first problem's sentence."""
    msg = (
        _model_checks(r.model, r.data)
        or _data_checks(r.data, r.train)
        or _train_checks(r.train)
        or _run_checks(r)
        or check_interventions(r)
        or check_objective(r)
    )
    if msg:
        raise RecipeError(msg)


def from_dict(data: dict, name: str = "recipe") -> Recipe:
    data = dict(data)
    data.setdefault("name", name)
    recipe = _build(Recipe, data)
    _cross_checks(recipe)
    return recipe


def load_recipe(path: str | Path, overrides: list[str] | tuple = ()) -> Recipe:
    """Read ``path`` (following ``base:``), apply ``key=value`` overrides, validate; raise RecipeError."""
    path = Path(path)
    data = _load_chain(path)
    for o in overrides:
        _set_override(data, o)
    return from_dict(data, name=path.stem)


def run_name(recipe: Recipe, overrides: list[str] | tuple = ()) -> str:
    """``<recipe name>[-<overrides>]`` with characters that are awkward in folder names replaced."""
    if recipe.run.name:
        return recipe.run.name
    parts = [recipe.name] + [o for o in overrides if not o.startswith("run.")]
    s = "-".join(parts)
    keep = "".join(c if c.isalnum() or c in "._-" else "_" for c in s)
    return keep[:200]


def dump(recipe: Recipe) -> str:
    return yaml.safe_dump(recipe.to_dict(), sort_keys=False)


def flatten(d: dict, prefix: str = "") -> dict:
    """Dotted keys; lists and None stringified (what TensorBoard hparams accept)."""
    out = {}
    for k, v in d.items():
        key = f"{prefix}.{k}" if prefix else str(k)
        if isinstance(v, dict) and v:
            out.update(flatten(v, key))
        elif isinstance(v, (bool, int, float, str)):
            out[key] = v
        else:
            out[key] = json.dumps(v, default=str)
    return out
