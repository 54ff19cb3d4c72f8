"""Offline analysis of saved runs: the training-time suite (analysis/suite.py) on any checkpoint, cached, and
cross-run comparisons on the same analysis images.

- :func:`open_run` reads a run folder (its resolved ``recipe.yaml`` and complete checkpoints).
- :func:`analyze_run` runs the suite on chosen checkpoints. A measure whose saved result carries the same
  cache key (checkpoint weights' sha256, analysis images, batch size and its own options:
  :func:`analysis.storage.cache_key`) is not
  recomputed; results go to ``analysis/step_XXXXXXX/``, figures to ``figures/step_XXXXXXX/`` and scalars and
  images to the run's TensorBoard at the checkpoint's step.
- :func:`against` computes cross-model CKA between a run's checkpoint and another run's (or the same run's
  earlier) checkpoint on the same images: the full layer-by-layer matrix (Raghu Fig. 2: ViT vs ResNet) and,
  when both models have the same layers, the per-layer CKA of same-index layers (Fig. 12: subset vs full data;
  App. G: a fine-tuned model vs its start).
- :func:`model_from_timm` loads a model that was not trained here (``timm:<arch>`` + a safetensors file), e.g. a
  public DINO or MAE ViT (``timm:vit_small_patch16_224.dino``): a pretrained tag names timm's configuration and is
  built without its weights, then the file is loaded.
- Self-supervised checkpoints: an objective other than ``supervised`` saves one module holding the backbone and
  its own networks under key prefixes (``Objective.parts`` in train/objectives, recorded in every checkpoint's
  meta.json). :func:`load_model` builds the backbone (without classifier head when the objective does not use
  labels: no measure reads the head; probes, k-NN and clustering read features) and loads the network ``run.part``
  (default ``student``, the backbone; ``teacher`` for DINO's EMA teacher). Another part's results are kept apart
  (:func:`analysis.storage.step_dir`) and labelled.

Every user error raises :class:`AnalysisError` with one sentence, before anything is written.
"""

from __future__ import annotations

import contextlib
import json
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import timm
import torch
from tqdm.auto import tqdm

from analysis import publish, storage
from analysis import suite as S
from analysis.figures import cka_heatmap, save, subplots
from analysis.measure import MeasureError, as_list, load_result, save_result
from analysis.measures.cka import cka_layers
from analysis.measures.head_subsets import head_subset_cka, head_subset_figure
from analysis.reduce import Minibatches
from analysis.runs import AnalysisError, check_run_folder
from analysis.similarity import MinibatchCKA, represent
from analysis.taps import Taps, arch_of
from train.checkpoint import (
    STEP_RE,
    CheckpointError,
    check_weights_fit,
    fit_report,
    list_checkpoints,
    load_weights,
    read_meta,
    read_weights,
    sha256_file,
    verify_checkpoint,
)
from train.data import DataError, build_data
from train.models import build_model
from train.objectives import uses_labels
from train.recipe import RecipeError, load_recipe
from train.run_folder import events_dir
from train.sources import hub_offline_mode, hub_state

DEFAULT_PART = storage.DEFAULT_PART


@dataclass
class Run:
    """A run folder, or a model from elsewhere (``checkpoints`` then maps step 0 to the weights file)."""

    path: Path
    name: str
    recipe: object
    checkpoints: dict[int, Path] = field(default_factory=dict)
    external: dict | None = None  # {"arch": "timm:...", "weights": FILE or "pretrained"} for models not trained here
    part: str = DEFAULT_PART  # the network analysed: a name in the checkpoints' objective parts (select_part)
    _data: object = field(default=None, repr=False)  # the data bundle and its fingerprint, built once (load_data)
    _fingerprint: str | None = field(default=None, repr=False)

    def step(self, spec: str | int | None) -> int:
        """A checkpoint step from ``None``/"last" (the latest), or a number that must exist."""
        if spec in (None, "", "last"):
            return max(self.checkpoints)
        try:
            s = int(spec)
        except ValueError:
            raise AnalysisError(
                f"step '{spec}' is not a number: pass e.g. {max(self.checkpoints)} or 'last'."
            ) from None
        if s not in self.checkpoints:
            raise AnalysisError(f"run {self.path} has no checkpoint at step {s}: it has {sorted(self.checkpoints)}.")
        return s

    @property
    def label(self) -> str:
        """The run's name in figures and printed lines, with the part when it is not the default one."""
        return self.name if self.part == DEFAULT_PART else f"{self.name} ({self.part})"


def open_run(path: str | Path, part: str | None = None) -> Run:
    """A trained run folder (``runs/<name>``), analysing its network ``part`` (default student: :func:`select_part`);
    raise AnalysisError when it is missing or has no checkpoints."""
    p = check_run_folder(path)
    try:
        recipe = load_recipe(p / "recipe.yaml")
    except RecipeError as e:
        raise AnalysisError(f"the recipe of run {p} cannot be read: {e}") from None
    ckpts = list_checkpoints(p / "checkpoints", warn=False)
    if not ckpts:
        raise AnalysisError(
            f"run {p} has no complete checkpoint: train it until its first checkpoint (./launch.sh RECIPE), or pass "
            "another run."
        )
    run = Run(p, p.name, recipe, {int(STEP_RE.match(c.name).group(1)): c for c in ckpts})
    return select_part(run, part) if part is not None else run


def checkpoint_parts(run: Run, step: int) -> dict[str, str]:
    """The networks of checkpoint ``step``: {part name: its key prefix in model.safetensors}, from the objective's
    ``parts`` in meta.json (``{"student": "backbone.", "teacher": "teacher_backbone."}`` for DINO); a supervised
    run, a run from before objectives and a model from elsewhere hold one network, saved unprefixed: ``{"student":
    ""}``."""
    if run.external:
        return {DEFAULT_PART: ""}
    try:
        meta = read_meta(run.checkpoints[step])
    except CheckpointError as e:
        raise AnalysisError(str(e)) from None
    parts = (meta.get("objective") or {}).get("parts") or {}
    return dict(parts) if isinstance(parts, dict) and parts else {DEFAULT_PART: ""}


def part_prefix(run: Run, step: int) -> str:
    """The key prefix of ``run.part`` in checkpoint ``step``; AnalysisError naming the parts it has."""
    parts = checkpoint_parts(run, step)
    if run.part not in parts:
        if run.external:
            raise AnalysisError(
                f"model {run.external['arch']} has no part '{run.part}': a model from elsewhere is one network "
                f"({DEFAULT_PART}), so leave --part out."
            )
        raise AnalysisError(
            f"run {run.path} has no part '{run.part}' (objective {run.recipe.train.objective} saves "
            f"{', '.join(parts)}): pass --part {' or --part '.join(parts)}."
        )
    return parts[run.part]


def select_part(run: Run, part: str | None) -> Run:
    """``run`` analysing its network ``part`` (None: the default, student), checked against its last checkpoint."""
    run.part = part or DEFAULT_PART
    part_prefix(run, max(run.checkpoints))
    return run


def external_run(
    arch: str,
    weights: str,
    recipe_path: str | Path,
    overrides: list[str],
    out: str | Path | None,
    images: str | Path | None = None,
    probe_images: str | Path | None = None,
    preprocessing: str = "model",
) -> Run:
    """A model not trained here: ``arch`` = "timm:<name>", ``weights`` a local .safetensors file (or "pretrained"
    for timm's own weights, which needs a network); results go to ``out`` (default runs/external-<name>).

    With ``images`` (a folder, or "photos": analysis/images.py) those images are analysed, prepared by the model's own
    timm preprocessing (resize, centre crop, mean, std) at the size its weights were trained for (their position
    embedding's grid; ``--set data.img_size=N`` to choose), and ``probe_images`` (a folder) trains probes and k-NN.
    Without, the analysis and probe-train images of ``recipe_path`` (+ overrides) are used, and only those are decoded
    (the train split stays on disk); ``preprocessing="model"`` normalises them with the model's mean and std,
    ``"recipe"`` with the data's own (as a run trained here on that recipe: needed to compare the two with
    --against)."""
    if not arch.startswith("timm:") or len(arch) <= 5:
        raise AnalysisError(f"--model '{arch}' must look like timm:<architecture>, e.g. timm:vit_tiny_patch16_224.")
    if weights != "pretrained" and not Path(weights).is_file():
        raise AnalysisError(
            f"weights file '{weights}' does not exist: pass a .safetensors file (or 'pretrained' with a network)."
        )
    if preprocessing not in ("model", "recipe"):
        raise AnalysisError(f"--preprocessing '{preprocessing}' is not one of model, recipe.")
    if probe_images is not None and images is None:
        raise AnalysisError(
            "--probe-images needs --images: the probe-train images of a recipe's data come from its train split."
        )
    given = {o.split("=", 1)[0].strip() for o in overrides}
    extra = []
    if "data.in_memory" not in given:
        extra.append(
            "data.in_memory=false"
        )  # only the analysed rows are decoded (the train split can be 60k images at 224)
    size = None
    if images is not None:
        size = None if "data.img_size" in given else implied_img_size(arch, weights)
        extra += ["data.in_chans=3"] + ([f"data.img_size={size}"] if size else [])
    try:
        recipe = load_recipe(recipe_path, list(overrides) + extra)
        if images is None and "data.eval_size" not in given and recipe.data.eval_size is None:
            # the analysis rows are a seeded choice from the eval split whatever eval_size is: decode only those
            recipe = load_recipe(
                recipe_path, list(overrides) + extra + [f"data.eval_size={max(recipe.data.analysis_size, 1)}"]
            )
    except RecipeError as e:
        raise AnalysisError(str(e)) from None
    name = arch[5:].replace("/", "_")
    path = Path(out) if out else Path(recipe.run.root) / f"external-{name}"
    run = Run(
        path,
        path.name,
        recipe,
        {0: Path(weights)},
        external={"arch": arch, "weights": weights, "preprocessing": preprocessing},
    )
    if images is not None:
        from analysis.images import ImageError, image_set

        model = model_from_timm(arch, weights, 1, 3, recipe.data.img_size)
        try:
            run._data = image_set(images, model, probe_images, recipe.data.img_size)
        except ImageError as e:
            raise AnalysisError(str(e)) from None
        run.external["images"] = str(images)
    return run


def front_end(run: Run) -> str:
    """The command-line front end that opened ``run``, as analysis/fixes.py names it: ``images`` (--model with
    --images), ``model`` (--model on a recipe's data) or ``run`` (a run folder)."""
    if run.external:
        return "images" if run.external.get("images") else "model"
    return "run"


def implied_img_size(arch: str, weights: str) -> int | None:
    """The input size a ViT's weights were trained at, from their position embedding (grid x patch size); None
    when the file has none (ResNets) or the weights are timm's own ("pretrained": its configuration's size)."""
    if weights == "pretrained":
        return None
    try:
        state, _ = read_weights(Path(weights))
    except CheckpointError as e:
        raise AnalysisError(str(e)) from None
    pos, proj = state.get("pos_embed"), state.get("patch_embed.proj.weight")
    if pos is None or proj is None or pos.ndim != 3:
        return None
    n, patch = int(pos.shape[1]), int(proj.shape[-1])
    for prefix in (1, 0, 5, 4, 2):  # CLS; none (GAP); CLS + 4 registers; registers only; CLS + distillation token
        g = int(round((n - prefix) ** 0.5)) if n > prefix else 0
        if g > 0 and g * g == n - prefix:
            return g * patch
    return None


def model_from_timm(arch: str, weights: str, num_classes: int, in_chans: int, img_size: int) -> torch.nn.Module:
    """timm.create_model(arch) for the data's shape, with weights from a safetensors file (or timm's pretrained).

    ``arch`` may carry timm's pretrained tag (``timm:vit_small_patch16_224.dino``, ``timm:vit_base_patch16_224.mae``):
    with a file, the tag only picks timm's configuration (``pretrained=False``, no network) and the file's tensors,
    keyed as timm's own (a hub ``model.safetensors``), are loaded. The classifier head follows the file: none when it
    holds no head (DINO's and MAE's backbones), the file's class count when it holds one (no measure reads the head)."""
    name = arch[5:]
    pretrained = weights == "pretrained"
    hub = hub_state() if pretrained else None  # offline: the download reads the cache or fails at once, no retries
    state = None
    if not pretrained:
        try:
            state, _ = read_weights(Path(weights))
        except CheckpointError as e:
            raise AnalysisError(str(e)) from None
    kw = {"num_classes": num_classes, "in_chans": in_chans, "pretrained": pretrained}
    try:
        with hub_offline_mode() if hub == "unreachable" else contextlib.nullcontext():
            try:
                model = timm.create_model(name, img_size=img_size, **kw)
            except TypeError:  # models without an img_size argument (ResNets)
                model = timm.create_model(name, **kw)
    except RuntimeError as e:
        if "Unknown model" in str(e):
            raise AnalysisError(f"timm has no architecture '{name}': see timm.list_models().") from None
        if "Invalid pretrained tag" in str(e):
            raise AnalysisError(
                f"timm has no pretrained tag '{name.partition('.')[2]}' for {name.partition('.')[0]}: see "
                f"timm.list_models('{name.partition('.')[0]}*', pretrained=True)."
            ) from None
        raise
    except OSError as e:  # also what huggingface_hub raises offline (its errors subclass OSError)
        if hub is not None:
            why = "HF_HUB_OFFLINE is set" if hub == "set" else "the Hugging Face Hub does not answer (offline?)"
            raise AnalysisError(
                f"{why} and timm's pretrained weights of '{name}' are not in the local cache: pass a local --weights "
                "FILE.safetensors (./launch.sh pretrained makes a real ViT-S/14 one without a network)."
            ) from None
        raise AnalysisError(
            f"timm could not download the pretrained weights of '{name}' ({type(e).__name__}): pass a local "
            "--weights FILE.safetensors when offline."
        ) from None
    if state is not None:
        _head_like(model, state)
        try:
            model.load_state_dict(state)
        except RuntimeError:
            raise AnalysisError(
                f"weights in {weights} do not fit this model ({arch} at data.img_size={img_size}, "
                f"data.in_chans={in_chans}: "
                f"{fit_report(model.state_dict(), state) or 'load_state_dict refused them'}): pass the architecture "
                "they belong to and the image size and channels they were trained at (e.g. --set data.img_size=224 "
                "data.in_chans=3)."
            ) from None
    return model


def _head_like(model: torch.nn.Module, state: dict) -> None:
    """Give ``model`` the classifier head ``state`` holds: none when it holds no head weights, else as many classes."""
    head = model.get_classifier() if hasattr(model, "get_classifier") else None
    if not isinstance(head, torch.nn.Linear):
        return
    name = next(n for n, m in model.named_modules() if m is head)
    w = state.get(f"{name}.weight")
    if w is None:
        model.reset_classifier(0)
    elif w.ndim == 2 and w.shape[0] != head.out_features:
        model.reset_classifier(int(w.shape[0]))


def load_model(run: Run, step: int, data) -> torch.nn.Module:
    """The run's model with the weights of checkpoint ``step`` (checksums verified first)."""
    if run.external:
        r = run.recipe.data
        return model_from_timm(
            run.external["arch"], run.external["weights"], data.num_classes, r.in_chans, r.img_size
        ).eval()
    prefix = part_prefix(run, step)
    # an objective without labels trains a backbone without classifier head (as the trainer builds it)
    model = build_model(run.recipe, data.num_classes if uses_labels(run.recipe) else 0)
    try:
        verify_checkpoint(run.checkpoints[step])
        load_weights(model, run.checkpoints[step], prefix=prefix)
    except CheckpointError as e:
        raise AnalysisError(str(e)) from None
    return model.eval()


def weights_key(run: Run, step: int) -> str:
    """What a result's cache key says about the network analysed: the weights' sha256 (plus the part when it is not
    the default one: a student and a teacher share one model.safetensors)."""
    if run.external:
        w = run.external["weights"]
        if w == "pretrained":
            return f"{run.external['arch']}:pretrained"
        return sha256_file(Path(w))
    wid = storage.weights_id(run.checkpoints[step])
    if wid is None:
        raise AnalysisError(
            f"checkpoint {run.checkpoints[step]} records no model.safetensors checksum: it was not written by vitlab."
        )
    return wid if run.part == DEFAULT_PART else f"{wid}:{run.part}"


def load_data(run: Run):
    """The run's data bundle, built on first use and kept on the Run (building it decodes the eval-side splits)."""
    if run._data is None:
        try:
            run._data = build_data(run.recipe, quiet=True)
        except DataError as e:
            raise AnalysisError(str(e)) from None
        if run.external and run.external.get("preprocessing", "model") == "model":
            _model_normalisation(run)
    return run._data


def _model_normalisation(run: Run) -> None:
    """A model from elsewhere sees a recipe's images normalised by its own pretrained configuration's mean and std
    (timm.data.resolve_data_config; averaged over channels for greyscale data), not by the data's statistics."""
    from timm.data import resolve_data_config

    try:
        cfg = resolve_data_config({}, model=timm.create_model(run.external["arch"][5:], pretrained=False))
    except RuntimeError:
        return  # an unknown architecture: model_from_timm says so in one sentence when the model is built
    mean, std = torch.tensor(cfg["mean"], dtype=torch.float32), torch.tensor(cfg["std"], dtype=torch.float32)
    c = run.recipe.data.in_chans
    if len(mean) != c:
        mean, std = mean.mean().repeat(c), std.mean().repeat(c)
    run._data.mean, run._data.std = mean, std


def fingerprint(run: Run) -> str:
    """:func:`analysis.storage.data_fingerprint` of the run's data, computed once."""
    if run._fingerprint is None:
        run._fingerprint = storage.data_fingerprint(load_data(run))
    return run._fingerprint


def step_dir(run: Run, step: int, kind: str = "analysis") -> Path:
    return storage.step_dir(run.path, step, kind, run.part)


class _Writer:
    """The run's TensorBoard writer, opened on first use (nothing is created when everything is cached)."""

    def __init__(self, run: Run, enabled: bool):
        self.run, self.enabled, self.w = run, enabled, None

    def get(self):
        if self.enabled and self.w is None:
            from torch.utils.tensorboard import SummaryWriter  # deferred: importing tensorboard costs ~1 s

            self.w = SummaryWriter(str(events_dir(self.run.path)), flush_secs=10)
        return self.w

    def close(self):
        if self.w is not None:
            self.w.close()


def analyze_run(
    run: Run,
    steps=None,
    opts: S.SuiteOptions | None = None,
    force: bool = False,
    tensorboard: bool = True,
    progress: bool = True,
) -> dict:
    """Run the suite on ``steps`` (default: every checkpoint) of ``run``, reusing cached results.
    Returns {"computed": [(step, measure)], "reused": [(step, measure)], "steps": [...], "skipped": [...]}: steps whose
    checkpoint was deleted while this ran (pruned by a trainer still running) are skipped, not reported as damaged."""
    opts = opts or S.SuiteOptions()
    check_writable(run)
    data, fp = load_data(run), fingerprint(run)
    if not steps and not run.external:  # every checkpoint: those complete now (a trainer still running adds and prunes)
        run.checkpoints = {
            int(STEP_RE.match(c.name).group(1)): c for c in list_checkpoints(run.path / "checkpoints", warn=False)
        } or run.checkpoints
    steps = sorted({run.step(s) for s in (steps or sorted(run.checkpoints))})
    problem = S.problem(data, opts, front_end(run))  # e.g. too few probe-train images for the shots: nothing written
    if problem:
        raise AnalysisError(f"run {run.path}: {problem}")
    stats: dict = {"computed": [], "reused": [], "steps": steps, "skipped": [], "not_applicable": [], "model": ""}
    all_gone = AnalysisError(
        f"the checkpoints of run {run.path} to analyse ({', '.join(map(str, steps))}) were deleted while being "
        "analysed (a trainer still running keeps only its last train.keep_last): analyse newer ones, e.g. --steps "
        "last."
    )
    wkeys = _checked_weights(run, steps, data, stats)
    if not wkeys:
        raise all_gone
    writer = _Writer(run, tensorboard)
    bar = tqdm(total=len(wkeys) * len(opts.measures), desc=f"analyse {run.name}", disable=not progress, unit="measure")
    try:
        for step in list(wkeys):
            keys = {n: storage.cache_key(wkeys[step], fp, opts.settings(n), n) for n in opts.measures}
            _analyse_step(run, step, data, opts, keys, force, stats, writer, bar)
    finally:
        writer.close()
        bar.close()
    stats["steps"] = [s for s in steps if s not in stats["skipped"]]
    if not stats["steps"]:
        raise all_gone
    return stats


def _checked_weights(run: Run, steps: list[int], data, stats: dict) -> dict[int, str]:
    """{step: weights key} of the checkpoints to analyse. Every checkpoint is checked before any result is written
    (a corrupted one stops the run here, not midway); one that a trainer still running pruned since the run was
    opened is skipped (``stats["skipped"]``)."""
    wkeys, own = {}, None
    for step in steps:
        try:
            wkeys[step] = weights_key(run, step)
            if run.external:
                continue
            if own is None:  # the recipe's model without weights: do the checkpoints' tensors fit it (cached or not)?
                with torch.device("meta"):
                    own = build_model(run.recipe, data.num_classes if uses_labels(run.recipe) else 0).state_dict()
            try:
                verify_checkpoint(run.checkpoints[step])
                check_weights_fit(own, run.checkpoints[step], part_prefix(run, step))
            except CheckpointError as e:
                raise AnalysisError(str(e)) from None
        except AnalysisError:
            if not pruned(run, step):
                raise
            stats["skipped"].append(step)
            wkeys.pop(step, None)
    return wkeys


def _analyse_step(run: Run, step: int, data, opts: S.SuiteOptions, keys: dict, force: bool, stats: dict, writer, bar):
    """The measures of one checkpoint that are not cached (all with ``force``): computed and published; ``bar``
    ticks once per measure and shows the stage under way."""
    todo = [n for n in opts.measures if force or not storage.is_cached(step_dir(run, step), n, keys[n])]
    stats["reused"] += [(step, n) for n in opts.measures if n not in todo]
    bar.update(len(opts.measures) - len(todo))  # cached: done at once
    if not todo:
        return
    try:
        model = load_model(run, step, data)
    except AnalysisError:
        if not pruned(run, step):
            raise
        stats["skipped"].append(step)
        return
    try:
        res = S.run_suite(model, data, opts, measures=todo, on_stage=(stages := _Stages(bar, step, todo)))
    except MeasureError as e:  # an option the model cannot serve (cka.repr=cls without a class token)
        raise AnalysisError(f"run {run.path}: {e}") from None
    meta = res["meta"]
    stats["model"] = f"a {meta['arch']}" + (
        " without a class token" if meta["arch"] == "vit" and not meta["num_prefix_tokens"] else ""
    )
    stats["not_applicable"] += [n for n in todo if n not in res and n not in stats["not_applicable"]]
    if not stats["computed"] and not stats["reused"] and len(res) == 1:  # nothing asked applies: say so, write nothing
        raise AnalysisError(
            f"run {run.path}: {' and '.join(todo)} {'does' if len(todo) == 1 else 'do'} not apply to this model "
            f"({stats['model']}): see python -m analysis --list for what each measure needs."
        )
    stats["computed"] += [(step, n) for n in res if n != "meta"]
    stages("figures, TensorBoard")
    publish_step(run, step, res, writer.get(), {n: keys[n] for n in res if n != "meta"})
    bar.update(len(todo) - sum(1 for n in todo if n in res))  # measures that do not apply to this model


class _Stages:
    """The suite's ``on_stage`` for the offline progress bar: the stage under way as its postfix (``step 600: cka``)
    and one tick per measure as it finishes (the passes over the images tick nothing)."""

    def __init__(self, bar, step: int, measures: list[str]):
        self.bar, self.step, self.measures, self.current = bar, step, set(measures), None

    def __call__(self, stage: str) -> None:
        if self.current in self.measures:
            self.bar.update(1)
        self.current = stage
        self.bar.set_postfix_str(f"step {self.step}: {stage}")


def check_writable(run: Run) -> None:
    """AnalysisError unless results can be written into the run's folder (the nearest existing folder on its path: a
    model from elsewhere writes to a new one): tried with a temporary file, before any work."""
    p = Path(run.path).absolute()
    while not p.is_dir() and p != p.parent:
        p = p.parent
    try:
        with tempfile.TemporaryFile(dir=p):
            pass
    except OSError as e:
        raise AnalysisError(
            f"cannot write the analysis of {run.path} into {p} ({e.strerror or e}): make it writable, or copy "
            "the run folder somewhere writable and analyse the copy."
        ) from None


def pruned(run: Run, step: int, wait_s: float = 2.0) -> bool:
    """Whether checkpoint ``step`` was deleted since the run was opened (a trainer still running prunes those beyond
    ``train.keep_last``) rather than damaged: its folder is gone, or goes within ``wait_s`` (a deletion under way)."""
    if run.external:
        return False
    path = run.checkpoints[step]
    deadline = time.monotonic() + wait_s
    while path.exists():
        try:  # whole (meta.json and every file it lists): not being deleted, so the error was about its content
            if all((path / n).is_file() for n in json.loads((path / "meta.json").read_text())["files"]):
                return False
        except (OSError, ValueError, KeyError, TypeError):
            pass
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.05)
    return True


def publish_step(run: Run, step: int, res: dict, writer, keys: dict) -> None:
    """Arrays and cache keys to analysis/step_X/, PNGs to figures/step_X/, scalars and images to TensorBoard."""
    publish.publish(
        res,
        step_dir(run, step),
        writer,
        step,
        keys=keys,
        figure_dir=step_dir(run, step, "figures"),
        part=run.part,
        titled=not run.external,  # a model from elsewhere has no training step to name
    )


# ---------------------------------------------------------------- cross-run comparisons


def parse_against(spec: str) -> tuple[Run, int]:
    """``OTHER_RUN[:STEP]`` -> (run, step)."""
    path, step = spec, None
    head, sep, tail = spec.rpartition(":")
    if sep and (tail.isdigit() or tail == "last"):
        path, step = head, tail
    run = open_run(path)
    return run, run.step(step)


@torch.no_grad()
def cross_cka(model_a, model_b, data, opts: S.SuiteOptions) -> dict:
    """Minibatch CKA between every layer of ``model_a`` and every layer of ``model_b`` on the analysis images
    (same minibatches for both; the ``cka`` measure's options -- representation, estimator and layer set, as in
    analysis/similarity.py). Result: ``matrix`` [La, Lb], ``labels_a``, ``labels_b`` and, when both have the same
    layer labels, ``same_index`` [L] = the diagonal."""
    co = opts.of("cka")
    ca, cb = S.make_context(model_a, data, opts.batch_size), S.make_context(model_b, data, opts.batch_size)
    la, lb = cka_layers(ca, co.layers), cka_layers(cb, co.layers)
    acc = MinibatchCKA(unbiased=co.unbiased)
    split = data.analysis
    mb = Minibatches(len(split), opts.batch_size, opts.order_seed)  # the suite's minibatches
    for j in range(len(mb)):
        x = data.normalize(mb.take(split.images, j))
        with Taps(model_a, [t for t, _ in la]) as capa:
            model_a(x.to(ca.device))
        with Taps(model_b, [t for t, _ in lb]) as capb:
            model_b(x.to(cb.device))
        acc.update(
            [represent(capa[t], co.repr, ca.prefix) for t, _ in la],
            [represent(capb[t], co.repr, cb.prefix) for t, _ in lb],
        )
    m = acc.compute().numpy()
    out = {"matrix": m, "labels_a": [lab for _, lab in la], "labels_b": [lab for _, lab in lb], "repr": co.repr}
    if out["labels_a"] == out["labels_b"]:
        out["same_index"] = np.diag(m).copy()
    return out


def check_same_images(run: Run, other: Run) -> tuple:
    """Both runs' data; raise AnalysisError unless they analyse the same images."""
    data, odata = load_data(run), load_data(other)
    if fingerprint(run) != fingerprint(other):
        if run.recipe.data == other.recipe.data:  # the same settings: the seeds drew different analysis images
            raise AnalysisError(
                f"runs {run.path} and {other.path} analyse different images (same data settings, but the analysis "
                f"images are drawn with each recipe's seed: {run.recipe.seed} vs {other.recipe.seed}): cross-run CKA "
                "needs the same images, so compare runs of one seed, or call analysis.offline.against(..., "
                "on_other_images=True) to read both models on the second run's images."
            )
        raise AnalysisError(
            f"runs {run.path} and {other.path} analyse different images (their data sections differ): "
            "cross-run CKA needs the same analysis images, so compare runs made with the same data settings."
        )
    return data, odata


def against_dir(run: Run, step: int, other: Run, other_step: int, kind: str = "analysis") -> Path:
    other_name = other.name if other.part == DEFAULT_PART else f"{other.name}.{other.part}"
    return storage.against_dir(run.path, step, other_name, other_step, kind, run.part)


def against(
    run: Run,
    other: Run,
    other_step: int,
    steps=None,
    opts: S.SuiteOptions | None = None,
    force: bool = False,
    progress: bool = True,
    on_other_images: bool = False,
) -> dict:
    """Cross-run CKA of ``run``'s checkpoints (default: the last) against ``other`` at ``other_step``; cached like
    :func:`analyze_run`. Returns {"results": {step: result}, "computed": [...], "reused": [...]}.

    Both runs must analyse the same images. Runs of different seeds draw different analysis images (the split is
    seeded by the recipe's seed); ``on_other_images=True`` then reads both models on ``other``'s analysis images,
    provided the two recipes' data sections are the same (a cross-seed comparison of one configuration)."""
    opts = opts or S.SuiteOptions()
    steps = sorted(run.step(s) for s in (steps or [None]))
    check_writable(run)
    if on_other_images:
        if run.recipe.data != other.recipe.data:
            raise AnalysisError(
                f"runs {run.path} and {other.path} have different data sections: reading one on the other's "
                "analysis images needs the same data settings (only the seed may differ)."
            )
        data = odata = load_data(other)
        fp = fingerprint(other)
    else:
        data, odata = check_same_images(run, other)
        fp = fingerprint(run)
    stats: dict = {"results": {}, "computed": [], "reused": []}
    omodel = None
    for step in tqdm(steps, desc=f"{run.name} vs {other.name}", disable=not progress, unit="ckpt"):
        out = against_dir(run, step, other, other_step)
        key = storage.cache_key(
            weights_key(run, step) + ":" + weights_key(other, other_step), fp, opts.settings("cka"), "cross_cka"
        )
        f = out / "cross_cka.npz"
        if not force and storage.is_cached(out, "cross_cka", key):
            stats["results"][step] = load_result(f)
            stats["reused"].append(step)
            continue
        omodel = omodel if omodel is not None else load_model(other, other_step, odata)
        model = load_model(run, step, data)
        res = cross_cka(model, omodel, data, opts)
        heads = None
        if (
            arch_of(model) == "vit" and arch_of(omodel) == "resnet"
        ):  # Raghu Fig. 5: heads sorted by distance vs ResNet layers
            heads = head_subset_cka(
                model,
                omodel,
                data.analysis.images,
                data.normalize,
                batch_size=opts.batch_size,
                unbiased=opts.of("cka").unbiased,
                order_seed=opts.order_seed,
            )
        out.mkdir(parents=True, exist_ok=True)
        save_result(res, out / "cross_cka.npz")
        if heads is not None:
            save_result(heads, out / "head_subsets.npz")
        (out / "cache.json").write_text(json.dumps({"cross_cka": key}))
        fig_dir = against_dir(run, step, other, other_step, "figures")
        draw_cross(res, fig_dir, f"{run.label}@{step}", f"{other.label}@{other_step}", heads)
        stats["results"][step] = load_result(out / "cross_cka.npz")
        stats["computed"].append(step)
    return stats


def draw_cross(res: dict, fig_dir: Path, name_a: str, name_b: str, heads: dict | None = None) -> list[Path]:
    """Raghu Fig. 2 (heatmap of A's layers vs B's), with same-index layers Fig. 12 (CKA per layer), and for a ViT
    against a ResNet Fig. 5 (the first block's heads, sorted by attention distance, vs the ResNet's lower layers)."""
    fig_dir.mkdir(parents=True, exist_ok=True)
    paths = [fig_dir / "cross_cka.png"]
    fig = cka_heatmap(
        np.asarray(res["matrix"]).T,
        as_list(res["labels_a"]),
        as_list(res["labels_b"]),
        title=f"CKA: {name_a} vs {name_b}",
        xname=name_a,
        yname=name_b,
    )
    save(fig, paths[0])
    if "same_index" in res:
        v = np.asarray(res["same_index"])
        fig, ax = subplots(figsize=(5, 3.2))
        ax.plot(range(len(v)), v, marker="o", ms=3)
        ax.set_xticks(range(len(v)), as_list(res["labels_a"]), rotation=90, fontsize=6)
        ax.set_ylim(0, 1.02)
        ax.set_ylabel("CKA, same layer")
        ax.set_title(f"{name_a} vs {name_b}, layer by layer")
        fig.tight_layout()
        paths.append(fig_dir / "same_index.png")
        save(fig, paths[-1])
    if heads is not None:
        paths.append(fig_dir / "head_subsets.png")
        save(head_subset_figure(heads, title=f"{name_a} block-0 heads vs {name_b}"), paths[-1])
    return paths
