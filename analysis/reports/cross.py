"""Cross-model CKA between a run's checkpoint and another run's (or the same run's earlier) checkpoint on the same
images: the full layer-by-layer matrix (Raghu Fig. 2: ViT vs ResNet) and, when both models have the same layers, the
per-layer CKA of same-index layers (Fig. 12: subset vs full data; App. G: a fine-tuned model vs its start). When the
``similarity`` measure is among the measures asked for, also its estimator's map between the two models' layers with
its permutation null (raw and calibrated, FWER-significant cells; analysis/measures/similarity.py), cached by its own
options like a measure's result (``similarity.npz`` beside ``cross_cka.npz``).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from tqdm.auto import tqdm

from analysis.engine import suite as S
from analysis.engine.figures import cka_heatmap, save, subplots
from analysis.engine.measure import as_list, load_result, save_result
from analysis.engine.reduce import Minibatches
from analysis.engine.taps import Taps, arch_of
from analysis.estimators.similarity import MinibatchCKA, represent
from analysis.measures.cka import cka_layers
from analysis.measures.head_subsets import head_subset_cka, head_subset_figure
from analysis.measures.similarity import SimilarityMeasure, describe, similarity_map
from analysis.results import publish, storage
from analysis.results.folders import AnalysisError
from analysis.results.runs import (
    DEFAULT_PART,
    Run,
    check_writable,
)
from analysis.sources.models import (
    fingerprint,
    load_data,
    load_model,
    weights_key,
)


@torch.no_grad()
def cross_cka(model_a, model_b, data, opts: S.SuiteOptions) -> dict:
    """Minibatch CKA between every layer of ``model_a`` and every layer of ``model_b`` on the analysis images
    (same minibatches for both; the ``cka`` measure's options -- representation, estimator and layer set, as in
    analysis/estimators/similarity.py). Result: ``matrix`` [La, Lb], ``labels_a``, ``labels_b`` and, when both have the
    same layer labels, ``same_index`` [L] = the diagonal."""
    co = opts.of("cka")
    ca, cb = S.make_context(model_a, data, opts.batch_size), S.make_context(model_b, data, opts.batch_size)
    la, lb = cka_layers(ca, co.layers), cka_layers(cb, co.layers)
    acc = MinibatchCKA(unbiased=co.unbiased)
    for _, capa, capb, _ in paired_forwards(model_a, model_b, data, opts, [t for t, _ in la], [t for t, _ in lb]):
        acc.update(
            [represent(capa[t], co.repr, ca.prefix) for t, _ in la],
            [represent(capb[t], co.repr, cb.prefix) for t, _ in lb],
        )
    m = acc.compute().numpy()
    out = {"matrix": m, "labels_a": [lab for _, lab in la], "labels_b": [lab for _, lab in lb], "repr": co.repr}
    if out["labels_a"] == out["labels_b"]:
        out["same_index"] = np.diag(m).copy()
    return out


@torch.no_grad()
def paired_forwards(model_a, model_b, data, opts: S.SuiteOptions, taps_a, taps_b):
    """Both models on each of the suite's analysis minibatches (the same images, in the suite's order): yields
    ``(j, captures of model_a, captures of model_b, labels)``."""
    split = data.analysis
    mb = Minibatches(len(split), opts.batch_size, opts.order_seed)  # the suite's minibatches
    dev_a, dev_b = next(model_a.parameters()).device, next(model_b.parameters()).device
    for j in range(len(mb)):
        x = data.normalize(mb.take(split.images, j))
        with Taps(model_a, list(taps_a)) as capa:
            model_a(x.to(dev_a))
        with Taps(model_b, list(taps_b)) as capb:
            model_b(x.to(dev_b))
        yield j, capa, capb, mb.take(split.labels, j)


def cross_similarity(model_a, model_b, data, opts: S.SuiteOptions, name_a: str, name_b: str) -> dict:
    """The ``similarity`` measure's map between every layer of ``model_a`` (rows) and every layer of ``model_b``
    (columns) on the same analysis images, with its permutation null permuting ``model_b``'s images (one permutation
    reorders all its layers alike; analysis/measures/similarity.py). Each model's features are kept as the measure
    keeps them (the first ``images`` images in the suite's minibatch order); AnalysisError when an option does not
    fit a model (``repr: cls`` without a class token)."""
    so = opts.of("similarity")
    ma, mb = (
        SimilarityMeasure(S.make_context(m, data, opts.batch_size, None, opts.order_seed), so)
        for m in (model_a, model_b)
    )
    for name, m in ((name_a, ma), (name_b, mb)):
        problem = SimilarityMeasure.model_problem(m.ctx, so)
        if problem:
            raise AnalysisError(f"{name}: {problem}")
    for j, capa, capb, y in paired_forwards(model_a, model_b, data, opts, sorted(ma.taps()), sorted(mb.taps())):
        ma.update(j, capa, None, y)
        mb.update(j, capb, None, y)
    rows, cols = ([lab for _, lab in m.layers] for m in (ma, mb))
    fb = mb.features()
    groups = mb.kept_groups(int(fb[0].shape[0]))  # the null's unit: the photo when the images are crops of photos
    return {**similarity_map(ma.features(), fb, so, groups), **describe(so, rows, cols, name_a, name_b)}


def check_same_images(run: Run, other: Run) -> tuple:
    """Both runs' data; raise AnalysisError unless they analyse the same images."""
    _same_images(run, other)
    return load_data(run), load_data(other)


def _same_images(run: Run, other: Run) -> None:
    """AnalysisError unless both runs analyse the same images (by their fingerprints: a results bundle gives them
    without the images, analysis/sources/models.py FINGERPRINTS)."""
    if fingerprint(run) != fingerprint(other):
        names = f"runs {storage.shown(run.path)} and {storage.shown(other.path)}"
        if run.recipe.data == other.recipe.data:  # the same settings: the seeds drew different analysis images
            raise AnalysisError(
                f"{names} analyse different images (same data settings, but the analysis images are drawn with each "
                f"recipe's seed: {run.recipe.seed} vs {other.recipe.seed}): cross-run CKA needs the same images, so "
                "compare runs of one seed, or call analysis.reports.cross.against(..., on_other_images=True) to read "
                "both models on the second run's images."
            )
        raise AnalysisError(
            f"{names} analyse different images (their data sections differ): cross-run CKA needs the same analysis "
            "images, so compare runs made with the same data settings."
        )


def images_for(run: Run, other: Run, on_other_images: bool = False) -> tuple:
    """(a function giving (data for ``run``'s model, data for ``other``'s), the fingerprint of the images both are read
    on): the runs' own images when they analyse the same ones (checked by fingerprint, :func:`_same_images`), or with
    ``on_other_images`` both on ``other``'s analysis images, which needs the same data settings (two seeds of one
    configuration). The images are loaded only when the function is called: a cached result needs only the
    fingerprint (a results bundle has no images, analysis/studies/bundle.py)."""
    if not on_other_images:
        _same_images(run, other)
        return (lambda: (load_data(run), load_data(other))), fingerprint(run)
    if run.recipe.data != other.recipe.data:
        raise AnalysisError(
            f"runs {storage.shown(run.path)} and {storage.shown(other.path)} have different data sections: reading "
            "one on the other's analysis images needs the same data settings (only the seed may differ)."
        )

    def both() -> tuple:
        data = load_data(other)
        return data, data

    return both, fingerprint(other)


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
    """Cross-run CKA of ``run``'s checkpoints (default: the last) against ``other`` at ``other_step``, and the
    ``similarity`` measure's cross-model map when ``opts.measures`` names it; cached like :func:`analyze_run`. Returns
    {"results": {step: cross CKA result}, "computed": [...], "reused": [...], "similarity": {step: result}} (the
    cross CKA's steps computed and reused; "similarity" empty unless asked for).

    Both runs must analyse the same images. Runs of different seeds draw different analysis images (the split is
    seeded by the recipe's seed); ``on_other_images=True`` then reads both models on ``other``'s analysis images,
    provided the two recipes' data sections are the same (a cross-seed comparison of one configuration)."""
    opts = opts or S.SuiteOptions()
    steps = sorted(run.step(s) for s in (steps or [None]))
    check_writable(run)
    load, fp = images_for(run, other, on_other_images)
    data = odata = None  # the images, loaded when a result is not cached
    stats: dict = {"results": {}, "computed": [], "reused": [], "similarity": {}}
    omodel = None
    for step in tqdm(steps, desc=f"{run.name} vs {other.name}", disable=not progress, unit="ckpt"):
        out = against_dir(run, step, other, other_step)
        fig_dir = against_dir(run, step, other, other_step, "figures")
        wkey = weights_key(run, step) + ":" + weights_key(other, other_step)
        key = storage.cache_key(wkey, fp, opts.settings("cka"), "cross_cka")
        skey = storage.cache_key(wkey, fp, opts.settings("similarity"), "cross_similarity")
        names = (f"{run.label}@{step}", f"{other.label}@{other_step}")
        need_cka = force or not storage.is_kept(out, "cross_cka", key)
        need_sim = "similarity" in opts.measures and (force or not storage.is_cached(out, "similarity", skey))
        model = None
        if (need_cka or need_sim) and data is None:
            data, odata = load()
        if need_cka or need_sim:
            omodel = omodel if omodel is not None else load_model(other, other_step, odata)
            model = load_model(run, step, data)
        if need_sim:
            sim = cross_similarity(model, omodel, data, opts, *names)
            publish.publish(  # titled=False: the models' names in the titles say their steps
                {"similarity": sim},
                out,
                None,
                step,
                keys={"similarity": skey},
                figure_dir=fig_dir,
                part=run.part,
                titled=False,
            )
        if "similarity" in opts.measures:
            stats["similarity"][step] = load_result(out / "similarity.npz")
        if not need_cka:
            stats["results"][step] = load_result(out / "cross_cka.npz")
            stats["reused"].append(step)
            continue
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
        if heads is not None:
            save_result(heads, out / "head_subsets.npz")
        stats["results"][step] = storage.keep_result(out, "cross_cka", key, res)
        draw_cross(res, fig_dir, *names, heads)
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
        ax.set_xlabel(f"layer of {name_a} (block 0 first)")
        ax.set_ylabel("CKA, same layer")
        ax.set_title(f"{name_a} vs {name_b}, layer by layer")
        fig.tight_layout()
        paths.append(fig_dir / "same_index.png")
        save(fig, paths[-1])
    if heads is not None:
        paths.append(fig_dir / "head_subsets.png")
        save(head_subset_figure(heads, title=f"{name_a} block-0 heads vs {name_b}"), paths[-1])
    return paths
