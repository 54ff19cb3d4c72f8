"""Where the analysed network and its images come from: a run folder's checkpoint (with its own data), or a model
from elsewhere (``--model timm:ARCH``, ``hf:NAME_OR_FOLDER``, ``open_clip:ARCH`` with ``--weights``), loaded through
its family (analysis/families/).

- :func:`load_model` builds a run's network and loads checkpoint ``step`` (checksums verified first); for a
  self-supervised run, the network ``run.part`` (default ``student``; ``teacher`` for DINO's EMA teacher): an
  objective other than ``supervised`` saves one module holding the backbone and its own networks under key prefixes
  (``Objective.parts`` in train/objectives, recorded in every checkpoint's meta.json).
- :func:`model_from_timm` loads a timm model that was not trained here (``timm:<arch>`` + a safetensors file), e.g. a
  public DINO or MAE ViT (``timm:vit_small_patch16_224.dino``): a pretrained tag names timm's configuration and is
  built without its weights, then the file is loaded.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import timm
import torch

from analysis.families import family_of
from analysis.results import storage
from analysis.results.folders import AnalysisError
from analysis.results.runs import (
    DEFAULT_PART,
    Run,
    part_prefix,
)
from analysis.sources.spec import check_model_spec
from train.checkpoint import (
    CheckpointError,
    fit_report,
    load_weights,
    read_weights,
    sha256_file,
    verify_checkpoint,
)
from train.data import DataError, build_data
from train.models import build_model
from train.objectives import uses_labels
from train.recipe import RecipeError, load_recipe
from train.sources import hub_offline_mode, hub_state


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
    """A model not trained here: ``arch`` = "timm:<name>" with ``weights`` a local .safetensors file (or "pretrained"
    for timm's own weights, which needs a network), "open_clip:<name>" with a weights file, or "hf:<hub name or
    save_pretrained folder>" without; results go to ``out`` (default runs/external-<name>).

    With ``images`` (a folder, or "photos": analysis/sources/images.py) those images are analysed, prepared by the
    model's own preprocessing (its family's: resize, centre crop, mean, std) at the size its weights were trained for
    (a timm ViT's position embedding's grid, ``--set data.img_size=N`` to choose; a transformers or open_clip model's
    configured size), and ``probe_images`` (a folder) trains probes and k-NN.
    Without, the analysis and probe-train images of ``recipe_path`` (+ overrides) are used, and only those are decoded
    (the train split stays on disk); ``preprocessing="model"`` normalises them with the model's mean and std,
    ``"recipe"`` with the data's own (as a run trained here on that recipe: needed to compare the two with
    --against)."""
    kind, name = check_model_spec(arch, weights)
    if kind != "hf" and weights != "pretrained" and not Path(str(weights)).is_file():
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
    size, model = None, None
    if kind != "timm":  # a transformers or open_clip model is built as saved: the images follow it
        model = external_model(arch, weights, 0, 3, 0)
        size = family_of(model).image_size(model)
        extra += ["data.in_chans=3"] + ([f"data.img_size={size}"] if size and "data.img_size" not in given else [])
    elif images is not None:
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
    name = Path(name).name if kind == "hf" and Path(name).is_dir() else name.replace("/", "_")
    path = Path(out) if out else Path(recipe.run.root) / f"external-{name}"
    run = Run(
        path,
        path.name,
        recipe,
        {0: Path(weights) if weights else Path(arch[3:])},
        external={"arch": arch, "weights": weights, "preprocessing": preprocessing},
    )
    run._model = model
    if images is not None:
        from analysis.sources.images import ImageError, image_set

        model = model if model is not None else model_from_timm(arch, weights, 1, 3, recipe.data.img_size)
        try:
            run._data = image_set(images, model, probe_images, recipe.data.img_size)
        except ImageError as e:
            raise AnalysisError(str(e)) from None
        run.external["images"] = str(images)
    return run


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


def external_model(arch: str, weights: str | None, num_classes: int, in_chans: int, img_size: int) -> torch.nn.Module:
    """The model ``arch`` names: ``timm:<name>`` built for the data's shape (:func:`model_from_timm`),
    ``hf:<hub name or folder>`` (transformers, its weights in the folder) or ``open_clip:<architecture>`` with
    ``weights``, both built as they were saved; AnalysisError (one sentence) when it cannot be."""
    kind, _, name = arch.partition(":")
    if kind == "timm":
        return model_from_timm(arch, weights, num_classes, in_chans, img_size)
    try:
        if kind == "hf":
            from analysis.families.huggingface import load

            return load(name)
        from analysis.families.openclip import load

        return load(name, weights)
    except ValueError as e:
        raise AnalysisError(str(e)) from None


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
        if run._model is not None:
            return run._model.eval()
        r = run.recipe.data
        return external_model(
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
        w, arch = run.external["weights"], run.external["arch"]
        if w == "pretrained":
            return f"{arch}:pretrained"
        if arch.startswith("hf:"):
            return _folder_key(arch)
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
    """A model from elsewhere sees a recipe's images normalised by its own preprocessing's mean and std (its family's:
    timm's pretrained configuration, a transformers image processor's, open_clip's; averaged over channels for
    greyscale data), not by the data's statistics."""
    model = run._model
    if model is None:
        try:
            model = timm.create_model(run.external["arch"][5:], pretrained=False)
        except RuntimeError:
            return  # an unknown architecture: model_from_timm says so in one sentence when the model is built
    cfg = family_of(model).preprocessing(model)
    mean, std = torch.tensor(cfg["mean"], dtype=torch.float32), torch.tensor(cfg["std"], dtype=torch.float32)
    c = run.recipe.data.in_chans
    if len(mean) != c:
        mean, std = mean.mean().repeat(c), std.mean().repeat(c)
    run._data.mean, run._data.std = mean, std


def _folder_key(arch: str) -> str:
    """The cache key of a transformers model: the sha256 of its folder's weight files, or its hub name."""
    folder = Path(arch[3:])
    if not folder.is_dir():
        return arch
    files = sorted(p for p in folder.iterdir() if p.suffix in (".safetensors", ".bin") and p.is_file())
    return "+".join(sha256_file(p) for p in files) or arch


# The data fingerprint of each run folder: {resolved folder: (repr of its recipe's data section, fingerprint)}, computed
# once per process and given by a results bundle (analysis/studies/bundle.py), which records those its report computed,
# so that a report from the bundle checks its cached report-time results without the images.
FINGERPRINTS: dict[str, tuple[str, str]] = {}


def fingerprint(run: Run) -> str:
    """:func:`analysis.results.storage.data_fingerprint` of the run's data, computed once (per run folder and data
    section: :data:`FINGERPRINTS`)."""
    if run._fingerprint is None:
        key = None if run.external else str(Path(run.path).resolve())
        data = repr(run.recipe.data)
        known = FINGERPRINTS.get(key) if key else None
        run._fingerprint = known[1] if known and known[0] == data else storage.data_fingerprint(load_data(run))
        if key:
            FINGERPRINTS[key] = (data, run._fingerprint)
    return run._fingerprint
