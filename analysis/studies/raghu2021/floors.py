"""Raghu Fig. 1-2's maps read against their floors, and the ResNet facts the uniformity and skip claims need.

Beside the CKA maps, the report shows their floors (:func:`analysis.estimators.baselines.cka_floors`): each layer's CKA
with the
raw pixels and with the same layer at random initialisation, and the random-init model's own map.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from analysis.engine.figures import layer_lines, save
from analysis.engine.measure import load_result
from analysis.engine.suite import make_context
from analysis.estimators import baselines as B
from analysis.measures.cka import cka_layers
from analysis.results import runs as RF
from analysis.results import storage
from analysis.sources import models as MS
from train.models import build_model


def _cka_floors(run, opts) -> dict:
    """analysis.estimators.baselines.cka_floors of a run's last checkpoint, with the study's CKA options; cached in
    analysis/step_X/baselines/ under a key of the weights, the images and the options. The random-init model is the
    run's recipe built under torch seed = the run's seed (a fresh initialisation of the same architecture, not
    necessarily the training run's own starting weights: the trainer draws from the generator before building it)."""
    step = max(run.checkpoints)
    out = RF.step_dir(run, step) / "baselines"
    key = storage.cache_key(
        MS.weights_key(run, step) + f":init-seed-{run.recipe.seed}",
        MS.fingerprint(run),
        opts.settings("cka"),
        "cka_floors",
    )
    if storage.is_kept(out, "cka_floors", key):  # no summary.json here: is_cached, a measure's test, never held
        return load_result(out / "cka_floors.npz")
    data = MS.load_data(run)
    model = MS.load_model(run, step, data)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(run.recipe.seed)
        init = build_model(run.recipe, data.num_classes).eval()
    co = opts.of("cka")
    ctx = make_context(model, data, opts.batch_size)
    res = B.cka_floors(
        model,
        init,
        data.analysis.images,
        data.normalize,
        cka_layers(ctx, co.layers),
        ctx.prefix,
        co.repr,
        opts.batch_size,
        co.unbiased,
        opts.order_seed,
    )
    return storage.keep_result(out, "cka_floors", key, res)


def _uniformity(m) -> dict:
    """claims.uniformity of a map in which some layers may have no CKA (nan: constant at initialisation)."""
    m = np.asarray(m, dtype=float)
    return {"mean_offdiag": float(np.nanmean(m[~np.eye(len(m), dtype=bool)])), "first_last": float(m[0, -1])}


def floors_section(doc, arch: list, opts, root: Path) -> None:
    """Beside the CKA maps: each model's map numbers against its random initialisation, each block output's CKA with
    the pixels and with its initialisation (table), every layer's (figure)."""
    doc.add(
        "**What the maps are read against.** A layer's CKA with the raw pixels (the flattened normalised input) "
        "is how much of its similarity structure the input already has; Raghu's localization (Fig. 9) compares "
        "tokens with input patches the same way. A model of the same architecture at random initialisation gives "
        "the floor of structure that needs no learning: a random ViT carries its input through every block on the "
        'skip connections, so its own map is already near-uniform, and "ViT maps are uniform" means something '
        "only above it; a trained layer's CKA with the same layer at initialisation is how far training moved it. "
        "Same images, layers, representation and estimator as the maps; seed 0 of each configuration.",
        "",
        "| model | mean off-diagonal CKA, trained | ... at random init | first-last CKA, trained | ... at random init "
        "|",
        "| --- | --- | --- | --- | --- |",
    )
    floors = {r.name: _cka_floors(r, opts) for r in arch}
    constant = []
    for name, f in floors.items():
        u, ui = _uniformity(f["matrix"]), _uniformity(f["init_matrix"])
        doc.add(
            f"| {name} | {u['mean_offdiag']:.3f} | {ui['mean_offdiag']:.3f} | {u['first_last']:.3f} | "
            f"{ui['first_last']:.3f} |"
        )
        dead = [str(lab) for lab, x in zip(f["labels"], np.diag(f["init_matrix"])) if not np.isfinite(x)]
        if dead:
            constant.append(f"{name}: {len(dead)} (e.g. {dead[0]})")
    if constant:
        doc.add(
            "",
            "Layers that are constant at random initialisation have no CKA (nan) and are left out of the means: "
            + "; ".join(constant)
            + " (timm zero-initialises the last BatchNorm of each ResNet block).",
        )
    doc.add(
        "",
        "| model | block output | CKA with pixels, trained | ... at random init | CKA trained vs the same layer at "
        "init |",
        "| --- | --- | --- | --- | --- |",
    )
    panels = {}
    for name, f in floors.items():
        labels, taps = [str(x) for x in f["labels"]], [str(x) for x in f["taps"]]
        for i, t in enumerate(taps):
            if t.endswith(".out"):
                doc.add(
                    f"| {name} | {labels[i]} | {f['pixels'][i]:.3f} | {f['init_pixels'][i]:.3f} | "
                    f"{f['init_same'][i]:.3f} |"
                )
        panels[name] = (
            labels,
            {
                "trained vs pixels": f["pixels"],
                "random init vs pixels": f["init_pixels"],
                "trained vs same layer at init": f["init_same"],
            },
        )
    doc.add("")
    path = root / "compare-arch" / "cka_floors.png"
    path.parent.mkdir(parents=True, exist_ok=True)
    lo = min(0.0, *(float(np.nanmin(np.r_[f["pixels"], f["init_pixels"], f["init_same"]])) for f in floors.values()))
    save(
        layer_lines(
            panels, "CKA", "CKA floors of each layer: the raw pixels and the random initialisation", (lo, 1.02)
        ),
        path,
    )
    doc.figure(
        path,
        "cka_floors",
        "Every layer's CKA with the raw pixels (trained and at random init) and with the same "
        "layer at random init: the floors the CKA maps above are read against",
    )


def identity_mask(run, blocks) -> np.ndarray:
    """Which of a ResNet run's residual blocks (names as the norm_ratio result lists them) have an identity shortcut,
    read off the model its recipe builds."""
    model = build_model(run.recipe, 10)
    return np.array([getattr(model.get_submodule(str(b)), "downsample", None) is None for b in blocks], dtype=bool)


def resnet_blocks(run) -> list[str]:
    model = build_model(run.recipe, 10)
    return [n for n, m in model.named_modules() if n.count(".") == 1 and n.startswith("layer")]
