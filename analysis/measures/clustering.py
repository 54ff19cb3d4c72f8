"""k-means clustering of per-layer image features against the class labels (Walmer et al. 2023 §5.2, Fig. 7; App. D.5,
Fig. 24/25: purity, NMI, ARI).

Walmer et al. take the CLS token (and, separately, the average-pooled spatial tokens) at the end of every block for
the evaluation images, run k-means with k = the number of classes (50 for their ImageNet-50 subset), and score the
cluster assignments against the ground-truth image labels; the random-chance score replaces the features with
"Gaussian noise" of the same shape (App. B.3; their code draws uniform [0, 1) noise instead,
analysis/estimators/baselines.py).

Definitions (features ``X`` [N, d] used as they are, no normalisation; labels ``y`` [N]; K clusters):

    k-means      Lloyd's algorithm on squared Euclidean distance, k-means++ seeding (greedy, ``2 + floor(ln K)`` local
                 trials per centre, as scikit-learn), ``n_init`` restarts from one ``torch.Generator`` seeded with
                 ``seed``, keeping the run with the lowest inertia ``sum_i ||x_i - c_{a(i)}||^2``. Stops when no
                 assignment changes, when the squared centre shift is <= ``tol * mean_j var(X[:, j])``, or after
                 ``max_iter`` iterations. An empty cluster is re-seeded at the point farthest from its centre. float64.
    purity       (1 / N) sum_{clusters c} max_{classes k} |{i : a(i) = c, y_i = k}|
    NMI          mutual information / arithmetic mean of the two entropies (torchmetrics.clustering
                 ``normalized_mutual_info_score``, the scikit-learn default)
    ARI          adjusted Rand index (torchmetrics.clustering ``adjusted_rand_score``)

In the suite (:class:`ClusteringMeasure`, name ``"clustering"``): the analysis images' features of every block output
(tap ``<block>.out``), pooled as in :mod:`analysis.knn` (``"cls"`` for CLS models, ``"mean_spatial"``), with K =
``ctx.data.num_classes``. The baseline runs the same k-means (same seed) on random features of the same shape, seed
``BASELINE_SEED + p * L + l`` for pool p and layer l: standard Gaussian by default
(:func:`analysis.estimators.baselines.gaussian_like`, Walmer's text), uniform [0, 1) with option ``baseline: uniform``
(:func:`analysis.estimators.baselines.uniform_like`, Walmer's code). ResNet features are the plain spatial mean (Walmer
study ViTs only; Raghu's patching step is for linear probes, see analysis/estimators/features.py).
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from typing import ClassVar, Literal

import numpy as np
import torch
from torch import Tensor
from torchmetrics.functional.clustering import adjusted_rand_score, normalized_mutual_info_score

from analysis.engine.figures import depth_plot
from analysis.engine.measure import Context, Measure, as_list, labels_problem, register
from analysis.estimators.baselines import DEFAULT_BASELINE, noise_like
from analysis.estimators.features import PooledFeatures, block_tag, blocks_of, num_classes, pools_for

N_INIT = 5
MAX_ITER = 100
TOL = 1e-6
SEED = 0
BASELINE_SEED = 0
METRICS = ("purity", "nmi", "ari")


# ----------------------------------------------------------------------------------------------------------------
# k-means
# ----------------------------------------------------------------------------------------------------------------


def _sq_dists(x: Tensor, x_sq: Tensor, c: Tensor) -> Tensor:
    """Squared Euclidean distances [N, K] (expanded form, clamped at 0)."""
    return (x_sq[:, None] - 2 * x @ c.T + c.pow(2).sum(1)[None, :]).clamp_min_(0)


def _sample(weights: Tensor, n: int, gen: torch.Generator) -> Tensor:
    """``n`` indices drawn with replacement proportionally to ``weights`` (uniformly when they sum to 0), on the CPU."""
    w = weights.detach().to("cpu", torch.float64)
    if not torch.isfinite(w).all() or w.sum() <= 0:
        w = torch.ones_like(w)
    return torch.multinomial(w, n, replacement=True, generator=gen)


def kmeans_plusplus(x: Tensor, k: int, gen: torch.Generator) -> Tensor:
    """Greedy k-means++ seeding (Arthur & Vassilvitskii 2007; scikit-learn's ``_kmeans_plusplus``): the first centre
    uniformly at random, each next one the best (lowest potential) of ``2 + floor(ln k)`` candidates drawn with
    probability proportional to the squared distance to the nearest chosen centre. Returns centres [k, d]."""
    n = x.shape[0]
    trials = 2 + int(math.log(k))
    x_sq = x.pow(2).sum(1)
    first = int(torch.randint(n, (1,), generator=gen))
    centres = [x[first]]
    closest = _sq_dists(x, x_sq, x[first : first + 1])[:, 0]
    for _ in range(1, k):
        cand = _sample(closest, trials, gen).to(x.device)
        d = torch.minimum(closest[None, :], _sq_dists(x, x_sq, x[cand]).T)  # [trials, N]
        best = int(d.sum(1).argmin())
        closest = d[best]
        centres.append(x[cand[best]])
    return torch.stack(centres)


def _lloyd(x: Tensor, x_sq: Tensor, centres: Tensor, max_iter: int, tol: float) -> tuple[Tensor, Tensor, float]:
    k = centres.shape[0]
    assign = None
    for _ in range(max_iter):
        new_assign = _sq_dists(x, x_sq, centres).argmin(1)
        if assign is not None and torch.equal(new_assign, assign):
            break
        assign = new_assign
        counts = torch.bincount(assign, minlength=k).to(x.dtype)
        sums = torch.zeros_like(centres).index_add_(0, assign, x)
        new = sums / counts.clamp_min(1)[:, None]
        empty = torch.nonzero(counts == 0).flatten()
        if empty.numel():  # re-seed empty clusters at the points farthest from their centres
            far = (x - new[assign]).pow(2).sum(1).topk(empty.numel()).indices
            new[empty] = x[far]
        shift = (new - centres).pow(2).sum().item()
        centres = new
        if shift <= tol:
            break
    assign = _sq_dists(x, x_sq, centres).argmin(1)
    inertia = (x - centres[assign]).pow(2).sum().item()
    return assign, centres, inertia


def kmeans(
    x: Tensor,
    k: int,
    seed: int = SEED,
    n_init: int = N_INIT,
    max_iter: int = MAX_ITER,
    tol: float = TOL,
    init: Tensor | None = None,
) -> tuple[Tensor, Tensor, float]:
    """k-means of ``x`` [N, d] into ``k`` clusters (definition in the module docstring); float64 on ``x``'s device.

    Returns ``(assignments [N] long, centres [k, d] float64, inertia)`` of the best of ``n_init`` k-means++ restarts
    (one ``torch.Generator().manual_seed(seed)`` drives all of them, so a seed gives the same answer every time).
    ``init`` [k, d]: a single Lloyd run from these centres instead. ``tol`` is relative to the mean feature variance.
    """
    if x.ndim != 2:
        raise ValueError(f"x must be [N, d], got shape {tuple(x.shape)}")
    if not 1 <= k <= x.shape[0]:
        raise ValueError(f"need 1 <= k <= N, got k={k}, N={x.shape[0]}")
    if n_init < 1 or max_iter < 1:
        raise ValueError("n_init and max_iter must be >= 1")
    x = x.to(torch.float64)
    x_sq = x.pow(2).sum(1)
    abs_tol = tol * x.var(0, unbiased=False).mean().item()
    if init is not None:
        return _lloyd(x, x_sq, init.to(x.device, torch.float64), max_iter, abs_tol)
    gen = torch.Generator().manual_seed(int(seed))
    best = None
    for _ in range(n_init):
        run = _lloyd(x, x_sq, kmeans_plusplus(x, k, gen), max_iter, abs_tol)
        if best is None or run[2] < best[2]:
            best = run
    return best


# ----------------------------------------------------------------------------------------------------------------
# scores
# ----------------------------------------------------------------------------------------------------------------


def purity(pred: Tensor, target: Tensor) -> float:
    """(1 / N) * sum over clusters of the count of the cluster's majority class."""
    pred, target = pred.cpu().long().flatten(), target.cpu().long().flatten()
    if pred.shape != target.shape or pred.numel() == 0:
        raise ValueError("pred and target must be non-empty and of the same length")
    _, p = torch.unique(pred, return_inverse=True)
    _, t = torch.unique(target, return_inverse=True)
    nt = int(t.max()) + 1
    table = torch.bincount(p * nt + t, minlength=(int(p.max()) + 1) * nt).view(-1, nt)
    return table.max(1).values.sum().item() / pred.numel()


def cluster_scores(pred: Tensor, target: Tensor) -> dict[str, float]:
    """``{"purity", "nmi", "ari"}`` of cluster assignments ``pred`` against labels ``target`` (NMI and ARI from
    torchmetrics.clustering; NMI with the arithmetic-mean normaliser)."""

    pred, target = pred.cpu().long().flatten(), target.cpu().long().flatten()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # torchmetrics' sparse-invariant notice
        nmi = float(normalized_mutual_info_score(pred, target, "arithmetic"))
        ari = float(adjusted_rand_score(pred, target))
    return {"purity": purity(pred, target), "nmi": nmi, "ari": ari}


# ----------------------------------------------------------------------------------------------------------------
# the measure
# ----------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ClusteringOptions:
    restarts: int = N_INIT  # k-means++ initialisations; the lowest inertia wins
    max_iter: int = MAX_ITER  # Lloyd iterations per restart
    seed: int = SEED
    baseline: Literal["gaussian", "uniform"] = DEFAULT_BASELINE  # random features: Walmer's text / Walmer's code

    def check(self):
        if self.restarts < 1 or self.max_iter < 1:
            return f"restarts and max_iter must be >= 1, not {self.restarts} and {self.max_iter}."
        return None


@register
class ClusteringMeasure(Measure):
    """How well each layer's features cluster by class: k-means purity, NMI and ARI per layer and pool.
    Walmer et al. 2023 §5.2, Fig. 7; App. D.5, Fig. 24/25; with the random-chance baseline (App. B.3; option
    ``baseline``, Gaussian by default). Definitions in the module docstring: the analysis images' features of every
    block output, pooled ``"cls"`` (CLS models) and ``"mean_spatial"``, K = number of classes; options ``restarts`` (5),
    ``max_iter`` (100), ``seed`` (0), ``baseline`` (``gaussian`` | ``uniform``).

    Result: ``purity``/``nmi``/``ari`` [P, L], ``baseline_purity``/``baseline_nmi``/``baseline_ari`` [P, L],
    ``inertia`` [P, L], ``pools`` [P], ``layers`` [L] (block names), ``num_classes``, ``n_images``, ``n_init``,
    ``seed``.
    """

    name: ClassVar[str] = "clustering"
    chunkable: ClassVar[bool] = True  # per-image sums / rows: a minibatch may come in chunks
    version: ClassVar[int] = 2  # 2: per-image features kept as float16 (analysis.estimators.features.stored)
    uses_labels: ClassVar[str] = "analysis"
    Options = ClusteringOptions

    @classmethod
    def problem(cls, data, opts):
        return labels_problem(data)

    def __init__(self, ctx: Context, opts=None):
        super().__init__(ctx, opts)
        self.blocks = blocks_of(ctx)
        self.pools = pools_for(ctx)
        self.n_init = self.opts.restarts
        self.max_iter = self.opts.max_iter
        self.seed = self.opts.seed
        self.feats = PooledFeatures(self.blocks, self.pools, ctx.prefix)

    def taps(self) -> set[str]:
        return self.feats.taps()

    def update(self, j, cap, x, y) -> None:
        self.feats.add(j, cap, y)

    def finish(self) -> dict:
        feats, y = self.feats.gather(self.ctx.accelerator)
        k = num_classes(self.ctx, y)
        shape = (len(self.pools), len(self.blocks))
        out = {name: np.zeros(shape) for m in METRICS for name in (m, f"baseline_{m}")}
        out["inertia"] = np.zeros(shape)
        for p, pool in enumerate(self.pools):
            for l_, blk in enumerate(self.blocks):
                x = feats[f"{pool}|{blk}"].to(self.ctx.device, torch.float64)
                assign, _, inertia = kmeans(x, k, self.seed, self.n_init, self.max_iter)
                out["inertia"][p, l_] = inertia
                noise = noise_like(x, BASELINE_SEED + p * shape[1] + l_, self.opts.baseline)
                base, _, _ = kmeans(noise, k, self.seed, self.n_init, self.max_iter)
                for prefix, a in (("", assign), ("baseline_", base)):
                    for m, v in cluster_scores(a, y).items():
                        out[f"{prefix}{m}"][p, l_] = v
        return {
            **out,
            "pools": list(self.pools),
            "layers": list(self.blocks),
            "num_classes": k,
            "n_images": len(y),
            "n_init": self.n_init,
            "seed": self.seed,
        }

    @staticmethod
    def summary(r: dict) -> dict:
        layers = as_list(r["layers"])
        out: dict = {}
        for m in METRICS:
            vals, base = np.asarray(r[m]), np.asarray(r[f"baseline_{m}"])
            for p, pool in enumerate(as_list(r["pools"])):
                i = int(np.argmax(vals[p]))
                out.setdefault(m, {})[pool] = {
                    "last": float(vals[p, -1]),
                    "best": float(vals[p, i]),
                    "best_layer": layers[i],
                    "baseline_mean": float(base[p].mean()),
                    "per_layer": [float(v) for v in vals[p]],
                }
        return out

    @staticmethod
    def scalars(r: dict) -> dict[str, float]:
        pools = as_list(r["pools"])
        out = {}
        for m in METRICS:
            vals = np.asarray(r[m])
            out.update(
                {
                    f"clustering/{m}/{pool}/{block_tag(i)}": float(vals[p, i])
                    for p, pool in enumerate(pools)
                    for i in range(vals.shape[1])
                }
            )
        return out

    @staticmethod
    def figures(r: dict, step: int | None = None) -> dict:
        at = f" (step {step})" if step is not None else ""
        panels = {
            m.upper() if m != "purity" else m: (np.asarray(r[m]), np.asarray(r[f"baseline_{m}"])) for m in METRICS
        }
        fig = depth_plot(panels, as_list(r["pools"]), f"k-means clustering, K={int(r['num_classes'])}{at}")
        return {"clustering/metrics": fig}
