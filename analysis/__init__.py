"""vitlab's analyses: measurements on any model of a known family (analysis/families/), at training time or offline.

    from analysis import analyze, activations, Measure, register

The package is laid out by role, each depending only on those above it:

    families/    one adapter per model family: what the engine knows of its blocks, taps, tokens, preprocessing
    engine/      the measure protocol and registry, the suite, the taps, minibatch order and reductions
    estimators/  CKA and HSIC, other similarity scores and their permutation nulls (public from
                 analysis.similarity), linear probes, pooled features, attention-map reductions, noise floors
    measures/    one measure per file, registered by name
    results/     run folders, result storage and caching, TensorBoard and figures
    sources/     where models and images come from (run checkpoints, timm / transformers / open_clip, photos)
    frontends/   the command line, the notebook API, the training-time callbacks, the cached runner
    reports/     reports of runs: one run's report, comparisons of runs, cross-model CKA
    studies/     the claim engine, its statistics and the study command; one folder per paper

The names below are loaded when first used (``import analysis`` imports no torch)."""

from __future__ import annotations

import importlib
from typing import Any

_LAZY = {
    "analyze": "analysis.frontends.api",
    "activations": "analysis.frontends.api",
    "iter_activations": "analysis.frontends.api",
    "tap_names": "analysis.frontends.api",
    "open_activations": "analysis.results.activation_store",
    "Activations": "analysis.results.activation_store",
    "Measure": "analysis.engine.measure",
    "register": "analysis.engine.measure",
    "Context": "analysis.engine.measure",
    "MeasureError": "analysis.engine.measure",
    "Taps": "analysis.engine.taps",
    "Family": "analysis.families.base",
    "family_of": "analysis.families",
}

__all__ = sorted(_LAZY)


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'analysis' has no attribute '{name}'")
