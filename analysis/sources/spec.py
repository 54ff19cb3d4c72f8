"""What ``--model KIND:NAME`` and ``--weights`` may be, checked without the analysis stack (no torch): the command line
refuses a wrong pair in one sentence before anything heavy is imported, and :mod:`analysis.sources.models` loads it."""

from __future__ import annotations

from analysis.results.folders import AnalysisError

SOURCES = ("timm", "hf", "open_clip")  # timm:<architecture>, hf:<hub name or folder>, open_clip:<architecture>


def check_model_spec(model: str, weights: str | None) -> tuple[str, str]:
    """(kind, name) of ``model``; AnalysisError (one sentence) when it names no source or its ``weights`` do not go
    with it (timm and open_clip need a weights file, or ``pretrained`` for timm; a transformers model carries its
    own)."""
    kind, _, name = model.partition(":")
    if kind not in SOURCES or not name:
        raise AnalysisError(
            f"--model '{model}' must look like timm:<architecture>, hf:<hub name or save_pretrained folder> or "
            "open_clip:<architecture>, e.g. timm:vit_tiny_patch16_224."
        )
    if kind == "hf" and weights:
        raise AnalysisError(
            f"--weights goes with timm: and open_clip: models; {model} carries its own weights (its folder or hub "
            "name), so leave --weights out."
        )
    if kind != "hf" and not weights:
        raise AnalysisError(
            f"--model {model} needs --weights FILE.safetensors (or --weights pretrained with a network, for timm)."
        )
    if kind == "open_clip" and weights == "pretrained":
        raise AnalysisError(
            f"--weights pretrained downloads timm's weights; {model} needs a weights file: pass --weights FILE (the "
            "whole CLIP model's state dict or its image tower's, .safetensors, .bin or .pt)."
        )
    return kind, name
