"""What Walmer's claims read from a study: each run's saved results (its last checkpoint), and cross-model CKA between
two runs (computed and cached on the runs' shared analysis images)."""

from __future__ import annotations

import numpy as np

from analysis.engine import suite as S
from analysis.engine.measure import as_list
from analysis.measures.attention_distance import AttentionDistanceMeasure
from analysis.reports import cross as XC
from analysis.results import storage
from analysis.sources import models as MS


def _pool(result, pool: str = "cls") -> int | None:
    pools = as_list(result["pools"])
    return pools.index(pool) if pool in pools else None


def knn(ctx, run, previous: bool = False) -> dict | None:
    """k-NN of the CLS token (analysis/measures/knn.py): {"top1" (last block), "n", "baseline" (Gaussian features,
    last block), "curve" [L], "baseline_curve" [L]}, or None (no CLS token, or not measured). ``previous``: at the
    run's second-to-last checkpoint."""
    return _knn(ctx.previous(run, "knn") if previous else ctx.last(run, "knn"))


def knn_at(ctx, run, step: int) -> dict | None:
    """:func:`knn` at checkpoint ``step`` (None where it was not measured there)."""
    return _knn(ctx.last(run, "knn", step, optional=True))


def _knn(r) -> dict | None:
    if r is None or _pool(r) is None:
        return None
    acc, base = np.asarray(r["acc"])[_pool(r)], np.asarray(r["baseline"])[_pool(r)]
    return {
        "top1": float(acc[-1]),
        "n": int(r["n_query"]),
        "baseline": float(base[-1]),
        "curve": acc,
        "baseline_curve": base,
    }


def purity(ctx, run) -> dict | None:
    """k-means cluster purity of the CLS token: {"value" (last block), "baseline", "curve" [L], "baseline_curve"}."""
    r = ctx.last(run, "clustering")
    if r is None or _pool(r) is None:
        return None
    v, base = np.asarray(r["purity"])[_pool(r)], np.asarray(r["baseline_purity"])[_pool(r)]
    return {"value": float(v[-1]), "baseline": float(base[-1]), "curve": v, "baseline_curve": base}


def distances(ctx, run, unit: str = "unit_square", previous: bool = False):
    """Attention distances [L, H] (``unit_square``: Walmer's token grid on a 1 x 1 square; ``pixels``: patch-centre
    pixels, for the locality precondition), or None."""
    a = ctx.previous(run, "attention_distance") if previous else ctx.last(run, "attention_distance")
    return None if a is None else np.asarray(a[unit], dtype=float)


def uniform_distance(ctx, run, unit: str = "unit_square") -> float | None:
    """Uniform attention's mean distance on the run's token grid, in ``unit`` (the attention_distance measure's own
    reference, :meth:`AttentionDistanceMeasure.uniform`), or None when the run has no attention-distance result."""
    a = ctx.last(run, "attention_distance")
    return None if a is None else AttentionDistanceMeasure.uniform(a, unit)


def attn_skip(ctx, run):
    """residual_cka skip_branch of the attention sublayer [L], or None."""
    res = ctx.last(run, "residual_cka")
    if res is None or "attn" not in as_list(res["sublayers"]):
        return None
    return np.asarray(res["skip_branch"])[as_list(res["sublayers"]).index("attn")]


def has_cls(run) -> bool:
    m = run.recipe.model
    return m.arch == "vit" and m.head == "cls"


def block_outputs(labels) -> np.ndarray:
    """Indices of the block outputs among cross-CKA layer labels ("3.mlp" is block 3's output, cka.layer_label)."""
    labels = [str(x) for x in labels]
    idx = [i for i, lab in enumerate(labels) if lab.endswith(".mlp")]
    return np.array(idx if idx else range(len(labels)))


def cross_same_index(a, b, opts, on_other_images: bool = False) -> np.ndarray | None:
    """Linear CKA of the same block's outputs of a's and b's last checkpoints (analysis/reports/cross.py against,
    cached); ``on_other_images``: both read on b's analysis images (two seeds of one objective draw different ones)."""
    step = max(a.checkpoints)
    r = XC.against(a, b, max(b.checkpoints), [step], opts, progress=False, on_other_images=on_other_images)
    r = r["results"][step]
    return np.asarray(r["same_index"])[block_outputs(r["labels_a"])] if "same_index" in r else None


def cls_cka(a, b, study, on_other_images: bool = False) -> float:
    """Linear CKA of the last block's CLS token between two runs' last checkpoints (Walmer Fig. 6 left), cached in
    ``<study root>/walmer/cls_cka.json`` under a key of both weights, the images and the CKA estimator;
    ``on_other_images``: both read on b's analysis images (:func:`analysis.reports.cross.images_for`)."""
    opts = study.suite_options(["cka"])
    co = opts.of("cka")
    load, fp = XC.images_for(a, b, on_other_images)
    key = ":".join(
        [
            MS.weights_key(a, max(a.checkpoints)),
            MS.weights_key(b, max(b.checkpoints)),
            fp,
            str(opts.batch_size),
            str(co.unbiased),
        ]
    )

    def compute() -> float:
        data, bdata = load()
        cls = S.suite_options(
            ["cka"], opts.batch_size, {"cka": {"repr": "cls", "layers": "blocks", "unbiased": co.unbiased}}
        )
        res = XC.cross_cka(
            MS.load_model(a, max(a.checkpoints), data), MS.load_model(b, max(b.checkpoints), bdata), data, cls
        )
        return float(np.asarray(res["matrix"])[-1, -1])

    return storage.json_cached(study.root / "walmer" / "cls_cka.json", key, compute)


def seed_pairs(runs: list) -> list[tuple]:
    """Every pair of two seeds of one objective, (later seed, earlier seed): the cross-seed ceiling reads both on the
    earlier seed's analysis images (as Raghu's data-drift ceiling does)."""
    return [(runs[j], runs[i]) for i in range(len(runs)) for j in range(i + 1, len(runs))]


def cls_ceiling(runs: list, study) -> list[float]:
    """The cross-seed ceiling of the last-block CLS CKA: :func:`cls_cka` between every two seeds of one objective, both
    read on the earlier seed's images -- what a different initialisation and data order alone leave of the CKA, the
    reference cross-objective CKA is read against (Kornblith et al. 2019's sanity check of a similarity index: the
    same layer of two seeds of one network). One value per seed pair; AnalysisError when the seeds' data settings
    differ."""
    return [cls_cka(a, b, study, on_other_images=True) for a, b in seed_pairs(runs)]


def all_tokens_ceiling(runs: list, opts) -> list[float]:
    """The same ceiling for the study's CKA representation (all tokens): the last block's same-index CKA between
    every two seeds of one objective (:func:`cross_same_index` on the earlier seed's images)."""
    out = [cross_same_index(a, b, opts, on_other_images=True) for a, b in seed_pairs(runs)]
    return [float(c[-1]) for c in out if c is not None]
