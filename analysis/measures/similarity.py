"""``similarity``: a layer x layer map of any estimator of :mod:`analysis.similarity`, calibrated by a null.

Raw similarity scores grow with depth, width and the number of examples (biased HSIC on independent inputs is far
from 0 at small n), so a map read raw says little about whether two layers share more than chance; after calibrating
against a permutation null, "global" convergence between models largely disappears while local-neighbourhood agreement
survives (Groger, Wen & Brbic 2026). This measure computes, on the same images, the map of the estimator chosen by
option ``estimator`` and its permutation null, with family-wise error over the map's cells controlled by the max
statistic (:func:`analysis.similarity.permutation_map`; Westfall and Young 1993, Nichols and Holmes 2002):

    estimator      score of layers X, Y (one row per image)                                  source
    cka            linear CKA, unbiased HSIC_1 (one batch of all kept images)               Kornblith et al. 2019
    rbf_cka        CKA with an RBF kernel, bandwidth ``threshold`` x median distance        Kornblith et al. 2019
    mutual_knn     mean share of the ``k`` nearest neighbours (cosine) common to both       Huh et al. 2024
    cknna          CKA of the cosine kernels restricted to mutual ``k``-NN pairs            Huh et al. 2024
    procrustes     orthogonal Procrustes distance 2 - 2 ||X^T Y||_* (smaller: more alike)   Ding et al. 2021
    procrustes_angle  arccos ||X^T Y||_* (smaller: more alike)                              Williams et al. 2021
    svcca          mean canonical correlation of the directions keeping ``keep`` variance   Raghu et al. 2017
    pwcca          projection-weighted canonical correlations                               Morcos et al. 2018

(definitions, sources and costs in analysis/estimators/). For every cell (i, j) of the map, with ``n_perm`` seeded
permutations of the images of the columns' model (one permutation reorders every one of its layers alike):

    score[i, j]            the estimator on layer i (rows) and layer j (columns), the same images in the same order
    null_mean, null_sd     mean and SD (n_perm - 1) of the cell's permuted scores
    z[i, j]                calibrated score (score - null_mean) / null_sd (keeps the raw sign: for the Procrustes
                           distances a layer pair more alike than chance has z < 0)
    p[i, j]                (1 + #{null at least as extreme}) / (n_perm + 1)  (Phipson and Smyth 2010)
    p_fwer[i, j]           family-wise adjusted p by the max statistic over the cells of the map
    significant[i, j]      p_fwer <= ``alpha``

The exchangeable unit of the null is the image, or, when the images come in groups (``groups`` of the image source,
:class:`analysis.sources.images.ImageSet`: the bundled photos' 16 crops each carry their photo), the group: crops of
one photo are alike in every layer whatever the layers share, so permuting single crops scatters them across photos
and makes any two layers look related; the null permutes whole photos instead, the k-th kept crop of photo p going to
the k-th kept crop of photo pi(p), photos with as many kept crops exchanged among themselves
(:func:`analysis.similarity.group_permutations`; with ``images`` below the analysis images some photos may keep a
count no other photo has, and stay in place). p never falls below 1 / (n_perm + 1).

A layer's representation of one image is option ``repr``: ``mean_spatial`` (default: the mean of the spatial tokens,
a ResNet's spatial mean; one vector of D per image, as Huh et al. pool), ``cls`` (the class token) or ``flatten``
(all tokens, T x D per image, as Raghu's CKA). Every estimator takes any of them (the wide ones through the n x n
Gram). The per-image features of the first ``images`` analysis images in the suite's minibatch order (a seeded random
sample of the analysis images, the same for every model and process count) are kept until the pass ends, stored as
float16 (:func:`analysis.estimators.features.stored`): N x L x D x 2 bytes (N = min(images, analysis images), L
layers, D the features per image of ``repr``), the one part of the measure's memory that grows with the images; the
maps are computed in float64 from them once the pass is over. Layers: option ``layers`` (the sets of the ``cka``
measure, :data:`analysis.measures.cka.LAYER_SETS`; default the block outputs).

Cost (after the shared pass; no forwards of its own): the map is L^2 scores of n = N images, each prepared once per
layer (Gram O(n^2 D), k-NN table O(n^2 D), Procrustes / CCA factor O(n D min(n, D))); each permutation costs per layer
pair O(n^2) for the CKAs and CKNNA, O(n k^2) for mutual k-NN, O(r^3) SVDs for Procrustes and CCA (r = min(n, D)):
docs/analysis.md has timings. ``n_perm: 0`` computes the raw map alone.

Cross-model maps: ``python -m analysis RUN --against OTHER --measures similarity`` computes the map of RUN's layers
(rows) against OTHER's (columns) on the same images, the null permuting OTHER's images (analysis/reports/cross.py).

Result: ``score`` [La, Lb] and, with ``n_perm`` >= 2, ``null_mean``, ``null_sd``, ``z``, ``excess``, ``p``, ``p_fwer``,
``significant`` (int8) [La, Lb]; ``n_units`` (the null's exchangeable units among the ``n_images``: photos, or the
images themselves); ``labels`` (rows) and ``labels_b`` (columns), ``name_a`` / ``name_b`` (the models'
names in a cross-model map, "" for a model against itself), ``estimator``, ``repr``, ``layers``, ``lower`` (1 when
smaller scores mean more alike), ``n_images``, ``n_perm``, ``alpha``, ``seed``. With option ``second`` (another
estimator), also that estimator's ``second_score``, ``second_lower``, ... (every key above that the map computes, with
``second_`` before it; the same permutations) and ``second_estimator``: a second measure of the same layer pairs on the
same images, as a claim that reads CKA asks whether its conclusion survives a measure of another kind (Groger, Wen &
Brbic 2026: local-neighbourhood agreement such as mutual k-NN behaves differently from global CKA).
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import ClassVar, Literal

import numpy as np
import torch

from analysis.engine.figures import BLOCK_AXIS, every_nth, layer_ticks, subplots
from analysis.engine.measure import Context, Measure, as_list, register
from analysis.engine.reduce import collect
from analysis.engine.taps import Taps
from analysis.estimators.cca import pwcca, svcca
from analysis.estimators.features import stored
from analysis.estimators.kernels import rbf_cka
from analysis.estimators.neighbours import cknna, mutual_knn
from analysis.estimators.permutation import permutation_map, score_map
from analysis.estimators.procrustes import procrustes_angle, procrustes_distance
from analysis.estimators.similarity import cka, represent
from analysis.measures.cka import cka_layers, repr_problem

ESTIMATORS = ("cka", "rbf_cka", "mutual_knn", "cknna", "procrustes", "procrustes_angle", "svcca", "pwcca")
# what each estimator's score is called on figures and in the docs
NAMES = {
    "cka": "linear CKA",
    "rbf_cka": "RBF CKA",
    "mutual_knn": "mutual k-NN",
    "cknna": "CKNNA",
    "procrustes": "Procrustes distance",
    "procrustes_angle": "Procrustes angle (rad)",
    "svcca": "SVCCA",
    "pwcca": "PWCCA",
}
LOWER = ("procrustes", "procrustes_angle")  # smaller is more alike
# the colour range of a raw map: the estimator's range (CKA and CKNNA may dip below 0 by chance: drawn as 0)
RANGES = {"procrustes": (0.0, 2.0), "procrustes_angle": (0.0, float(np.pi / 2))}


@dataclass(frozen=True)
class SimilarityOptions:
    estimator: Literal["cka", "rbf_cka", "mutual_knn", "cknna", "procrustes", "procrustes_angle", "svcca", "pwcca"] = (
        "cka"  # the score of two layers (analysis.similarity)
    )
    layers: Literal["blocks", "sublayers", "paper", "all"] = "blocks"  # which layers, as the cka measure's
    repr: Literal["mean_spatial", "cls", "flatten"] = "mean_spatial"  # a layer's representation of one image
    images: int = 1000  # analysis images whose features are kept (a seeded sample; N x L x D float16)
    n_perm: int = 200  # permutations of the null (0: the raw map alone)
    seed: int = 0  # of the permutations
    alpha: float = 0.05  # family-wise error of the significant cells
    k: int = 10  # neighbours of mutual_knn and cknna
    threshold: float = 1.0  # rbf_cka's bandwidth, in median distances
    keep: float = 0.99  # svcca's share of variance kept
    # a second estimator's map and null on the same features and permutations (result keys second_*; "" for none):
    # whether a reading survives a second measure (e.g. mutual_knn beside cka; analysis/studies/calibration.py)
    second: Literal["", "cka", "rbf_cka", "mutual_knn", "cknna", "procrustes", "procrustes_angle", "svcca", "pwcca"] = (
        ""
    )

    def check(self):
        if self.n_perm == 1 or self.n_perm < 0:
            return f"n_perm must be 0 (no null) or at least 2, not {self.n_perm}."
        if self.images < 4:
            return f"images must be at least 4 (CKA's unbiased HSIC needs 4 images), not {self.images}."
        if self.second == self.estimator:
            return f"second must name another estimator than estimator ({self.estimator}), or be empty."
        if not 0 < self.alpha < 1 or self.k < 1 or self.threshold <= 0 or not 0 < self.keep <= 1:
            return (
                f"alpha must be in (0, 1), k >= 1, threshold > 0 and keep in (0, 1], not alpha={self.alpha}, "
                f"k={self.k}, threshold={self.threshold}, keep={self.keep}."
            )
        return None


def score_function(opts: SimilarityOptions):
    """The estimator of ``opts`` with its options, as :func:`analysis.similarity.permutation_map` takes it."""
    return {
        "cka": functools.partial(cka, unbiased=True),
        "rbf_cka": functools.partial(rbf_cka, threshold=opts.threshold),
        "mutual_knn": functools.partial(mutual_knn, k=opts.k),
        "cknna": functools.partial(cknna, k=opts.k),
        "procrustes": procrustes_distance,
        "procrustes_angle": procrustes_angle,
        "svcca": functools.partial(svcca, keep=opts.keep),
        "pwcca": pwcca,
    }[opts.estimator]


def images_problem(n: int, opts: SimilarityOptions) -> str | None:
    """One sentence when ``n`` analysis images (of which the measure keeps ``opts.images``) are too few for the
    estimator of ``opts``, else None."""
    need = max(4, opts.k + 1) if opts.estimator in ("mutual_knn", "cknna") else 4
    if min(n, opts.images) >= need:
        return None
    more = "analyse more images" if n < need else f"raise the similarity option images (now {opts.images})"
    lower = f" or lower the similarity option k (now {opts.k})" if need > 4 else ""
    return f"{opts.estimator} needs at least {need} images and keeps {min(n, opts.images)}: {more}{lower}."


def similarity_map(xs: list, ys: list | None, opts: SimilarityOptions, groups=None) -> dict:
    """The map of ``opts.estimator`` between the layers ``xs`` (rows) and ``ys`` (columns; None: ``xs`` against
    itself), each [n, ...] of the same images in the same order, and its null (module docstring): a result's arrays.
    ``groups`` [n]: each image's independent unit (its photo), the null's exchangeable unit; None: each image. With
    ``opts.second``, also that estimator's map and null (the same seed and groups, hence the same permutations) under
    keys ``second_<key>`` and its name under ``second_estimator``."""
    out = _one_map(xs, ys, opts, groups)
    if opts.second:
        two = _one_map(xs, ys, dataclasses.replace(opts, estimator=opts.second, second=""), groups)
        out.update({f"second_{k}": v for k, v in two.items()}, second_estimator=opts.second)
    return out


def _one_map(xs: list, ys: list | None, opts: SimilarityOptions, groups=None) -> dict:
    score = score_function(opts)
    n = int(xs[0].shape[0])
    units = n if groups is None else len(np.unique(groups))
    out: dict = {"lower": int(opts.estimator in LOWER), "n_images": n, "n_perm": int(opts.n_perm), "n_units": units}
    if opts.n_perm == 0:
        out["score"] = score_map(score, xs, ys)
        return out
    m = permutation_map(score, xs, ys, n_perm=opts.n_perm, seed=opts.seed, groups=None if units == n else groups)
    for key in ("score", "null_mean", "null_sd", "z", "excess", "p", "p_fwer"):
        out[key] = np.asarray(getattr(m, key), dtype=np.float64)
    out["significant"] = (np.nan_to_num(m.p_fwer, nan=1.0) <= opts.alpha).astype(np.int8)
    return out


TIMING_PERMUTATIONS = 8  # own_seconds times at most this many permutations


TIMING_LAYERS = (1, 2, 4)  # own_seconds times maps of these many layers


def own_seconds(opts: SimilarityOptions, n: int, layers: int, dims: int) -> float:
    """The seconds the map and its null of ``opts`` take on ``n`` images of ``layers`` layers of ``dims`` features,
    timed here (each the shortest of 3 calls: a shared machine's noise) on random features of that shape: the raw map
    of 1, 2 and 4 layers gives r(L) = c + a L + b L^2 (a layer's preparation, a pair's score), and the null of P =
    min(n_perm, 8) permutations of them each permutation's cost d(L) = (t(L, P) - r(L)) / P = f + g L + h L^2 (a
    permutation drawn, each layer's side reordered, each pair's product); the map of L layers costs
    r(L) + n_perm d(L), each fitted curve kept at or above its largest timed value's share (a noisy fit cannot go
    negative)."""
    from analysis.engine.cost import shortest_call  # the estimate times its calls as the model timing does

    gen = torch.Generator().manual_seed(0)
    xs = [torch.randn(n, dims, generator=gen) for _ in range(max(TIMING_LAYERS))]

    def timed(k: int, perms: int) -> float:
        o = dataclasses.replace(opts, n_perm=perms)
        return shortest_call(lambda: similarity_map(xs[:k], None, o))

    ls = np.array(TIMING_LAYERS, dtype=float)
    design = np.stack([np.ones_like(ls), ls, ls**2], 1)

    def at(times: list[float]) -> float:  # the quadratic through the timed points, at ``layers``
        coef = np.linalg.solve(design, np.asarray(times))
        return float(max(coef @ [1.0, layers, layers**2], max(times) * layers / ls[-1]))

    raw = [timed(k, 0) for k in TIMING_LAYERS]
    out = at(raw)
    if opts.n_perm:
        p = min(opts.n_perm, TIMING_PERMUTATIONS)
        out += opts.n_perm * at([max(0.0, timed(k, p) - r) / p for k, r in zip(TIMING_LAYERS, raw)])
    return out


@register
class SimilarityMeasure(Measure):
    """How alike layers are beyond chance: a similarity estimator's layer x layer map, calibrated by a permutation null.
    The estimator (option ``estimator``: linear or RBF CKA, mutual k-NN, CKNNA, Procrustes, SVCCA, PWCCA) between every
    pair of layers on the pooled features of up to ``images`` analysis images, with its permutation null: calibrated
    scores (score - null mean) / null SD, p-values and the cells significant with family-wise error ``alpha`` by the max
    statistic (Groger, Wen & Brbic 2026 for why; definitions in the module docstring). Opt-in (not in the default
    suite); with ``--against`` also between two models' layers."""

    name: ClassVar[str] = "similarity"
    version: ClassVar[int] = 2  # 2: the null permutes whole photos when the images are grouped (n_units)
    chunkable: ClassVar[bool] = True  # per-image rows: a minibatch may come in chunks
    Options = SimilarityOptions

    @classmethod
    def problem(cls, data, opts):
        return images_problem(len(data.analysis), opts)

    @classmethod
    def model_problem(cls, ctx, opts):
        return repr_problem(ctx, opts.repr)

    @classmethod
    def cost(cls, ctx: Context, opts, n_images: int) -> dict[str, float]:
        """No forwards of its own; its map and null in ``seconds`` (:func:`own_seconds`), for the widest layer's
        features per image (from one no-grad forward of one image) and min(images, n_images) images."""
        taps = [t for t, _ in cka_layers(ctx, opts.layers)]
        with torch.no_grad(), Taps(ctx.model, taps) as cap:
            ctx.model(ctx.data.normalize(ctx.data.analysis.images[:1].to(ctx.device)).float())
            dims = max(represent(cap[t], opts.repr, ctx.prefix).reshape(1, -1).shape[1] for t in taps)
        n = min(opts.images, n_images)
        return {"forwards": 0.0, "backwards": 0.0, "seconds": own_seconds(opts, n, len(taps), dims)}

    def __init__(self, ctx, opts=None):
        super().__init__(ctx, opts)
        self.layers = cka_layers(ctx, self.opts.layers)
        self.parts: list = []
        self.seen: dict[int, int] = {}  # images of minibatch j received so far (chunks come in order)

    def taps(self) -> set[str]:
        return {t for t, _ in self.layers}

    def update(self, j, cap, x, y) -> None:
        start = j * self.ctx.batch_size + self.seen.get(j, 0)  # this chunk's first image in the minibatch order
        b = cap[self.layers[0][0]].shape[0]
        self.seen[j] = self.seen.get(j, 0) + b
        keep = min(b, self.opts.images - start)
        if keep <= 0:
            return
        feats = {t: stored(represent(cap[t][:keep], self.opts.repr, self.ctx.prefix)) for t, _ in self.layers}
        self.parts.append((int(j), feats, torch.empty(0, dtype=torch.long)))

    def features(self) -> list[torch.Tensor]:
        """The kept images' features of every layer, [N, D] float32 each, in the minibatch order (gathered over
        processes)."""
        try:
            feats, _ = collect(self.parts, self.ctx.accelerator)
        except IndexError:  # no part on any process
            raise ValueError("no minibatches were accumulated") from None
        return [feats[t].float() for t, _ in self.layers]

    def kept_groups(self, n: int) -> np.ndarray | None:
        """The independent unit of each of the ``n`` kept images, in the order they are kept (the suite's minibatch
        order), from the image source's ``groups`` (:class:`analysis.sources.images.ImageSet`); None without them."""
        groups = getattr(self.ctx.data, "groups", None)
        if groups is None:
            return None
        mb = self.ctx.minibatches
        rows = torch.cat([mb.rows(j) for j in range(len(mb))])[:n]
        return np.asarray(groups)[rows.numpy()]

    def finish(self) -> dict:
        labels = [lab for _, lab in self.layers]
        feats = self.features()
        return {
            **similarity_map(feats, None, self.opts, self.kept_groups(int(feats[0].shape[0]))),
            **describe(self.opts, labels, labels),
        }

    @staticmethod
    def summary(r: dict) -> dict:
        """A model against itself: the means over the off-diagonal layer pairs (the diagonal is each layer with
        itself); two models (``name_a`` set): the means over all pairs and, for layers of the same names, over the
        same-index pairs (the diagonal); raw and calibrated (``_z``); the share of the pairs significant."""
        s = np.asarray(r["score"], dtype=np.float64)
        rows, cols = as_list(r["labels"]), as_list(r["labels_b"])
        cross = bool(str(r["name_a"]))
        cells = np.ones(s.shape, dtype=bool) if cross else ~np.eye(*s.shape, dtype=bool)
        what = "mean" if cross else "mean_offdiag"
        same_index = cross and rows == cols
        out: dict = {"estimator": str(r["estimator"]), "n_images": int(r["n_images"]), "n_perm": int(r["n_perm"])}
        out[what] = _mean(s[cells])
        if same_index:
            out["mean_diag"] = _mean(np.diag(s))
        if "z" in r:
            z = np.asarray(r["z"], dtype=np.float64)
            out[f"{what}_z"] = _mean(z[cells])
            if same_index:
                out["mean_diag_z"] = _mean(np.diag(z))
            sig = np.asarray(r["significant"]).astype(bool)
            out["significant_share"] = float(sig[cells].mean()) if cells.any() else None
        return out

    @staticmethod
    def scalars(r: dict) -> dict[str, float]:
        est = str(r["estimator"])
        return {
            f"similarity/{est}/{k}": float(v)
            for k, v in SimilarityMeasure.summary(r).items()
            if k.startswith(("mean", "significant")) and v is not None
        }

    @staticmethod
    def figures(r: dict, step: int | None = None) -> dict:
        return {"similarity/map": similarity_figure(r, step)}


def describe(opts: SimilarityOptions, rows: list[str], cols: list[str], name_a: str = "", name_b: str = "") -> dict:
    """The result's labels and settings beside its arrays."""
    return {
        "labels": list(rows),
        "labels_b": list(cols),
        "name_a": name_a,
        "name_b": name_b,
        "estimator": opts.estimator,
        "repr": opts.repr,
        "layers": opts.layers,
        "alpha": float(opts.alpha),
        "seed": int(opts.seed),
    }


def cross_line(r: dict) -> str:
    """One line on a cross-model map: the mean raw and calibrated score, the share of significant layer pairs."""
    s = SimilarityMeasure.summary(r)
    mean = s.get("mean", s.get("mean_offdiag"))
    line = f"{NAMES[s['estimator']]} mean {'n/a' if mean is None else f'{mean:.3f}'}"
    if "significant_share" in s:
        z = s.get("mean_z", s.get("mean_offdiag_z"))
        share = s["significant_share"]
        line += f", calibrated z {_num(z)}, {'n/a' if share is None else f'{share:.0%}'} of layer pairs significant"
        line += f" (family-wise error {float(r['alpha']):g}, {s['n_perm']} permutations, {s['n_images']} images)"
    return line


def _num(v) -> str:
    return "n/a" if v is None else f"{v:.3g}"


def _mean(v: np.ndarray) -> float | None:
    v = v[np.isfinite(v)]
    return float(v.mean()) if v.size else None


def _axis_name(r: dict, which: str) -> str:
    name = str(r["name_a" if which == "a" else "name_b"])
    what = BLOCK_AXIS if str(r["layers"]) == "blocks" else "layer (block 0 = first)"
    return f"{name}: {what}" if name else what


def similarity_figure(r: dict, step: int | None = None):
    """The raw map (left) beside the calibrated one (right, z = (score - null mean) / null SD, diverging around 0,
    the cells significant with family-wise error alpha dotted); rows of the result on x, columns on y, origin
    bottom-left as the CKA maps. Without a null, the raw map alone."""
    est = str(r["estimator"])
    score = np.asarray(r["score"], dtype=np.float64)
    rows, cols = as_list(r["labels"]), as_list(r["labels_b"])
    calibrated = "z" in r
    fig, axes = subplots(1, 2 if calibrated else 1, figsize=(10.4 if calibrated else 5.4, 4.6), layout="constrained")
    axes = np.atleast_1d(axes)
    xname, yname = _axis_name(r, "a"), _axis_name(r, "b")
    panels = [(axes[0], score.T, "magma_r" if int(r["lower"]) else "magma", RANGES.get(est, (0.0, 1.0)), NAMES[est])]
    if calibrated:
        z = np.asarray(r["z"], dtype=np.float64)
        zf = z[np.isfinite(z)]
        top = max(float(np.abs(zf).max()), 1.0) if zf.size else 1.0
        panels.append((axes[1], z.T, "RdBu_r", (-top, top), f"calibrated {NAMES[est]}: z vs the null"))
    for ax, m, cmap, (vmin, vmax), label in panels:
        im = ax.imshow(m, origin="lower", cmap=cmap, vmin=vmin, vmax=vmax, aspect="auto")
        fig.colorbar(im, ax=ax, fraction=0.046).set_label(label)
        sx, sy = layer_ticks(ax, rows, "x"), layer_ticks(ax, cols, "y")
        ax.set_xlabel(xname + every_nth(sx))
        ax.set_ylabel(yname + every_nth(sy))
    at = f" (step {step})" if step is not None else ""
    between = f"{r['name_a']} vs {r['name_b']}" if str(r["name_a"]) else "between layers"
    axes[0].set_title(f"{NAMES[est]} {between}, raw{at}", fontsize=9)
    if calibrated:
        sig = np.asarray(r["significant"]).astype(bool).T
        yy, xx = np.nonzero(sig)
        axes[1].scatter(xx, yy, s=6, c="k", marker=".", label=f"FWER <= {float(r['alpha']):g}")
        if len(xx):
            axes[1].legend(fontsize=6, loc="upper left")
        axes[1].set_title(
            f"calibrated: {int(r['n_perm'])} permutations, {int(r['n_images'])} images{at}",
            fontsize=9,
        )
    return fig
