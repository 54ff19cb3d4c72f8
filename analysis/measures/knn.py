"""Weighted k-NN classification per layer (Walmer et al. 2023 §6.1 / Fig. 9 left; DINO, Caron et al. 2021 §4.1, App.).

The protocol is DINO's ``knn_classifier`` (eval_knn.py), which Walmer et al. apply to the features of every block.
The definition (cosine similarity of L2-normalised features, the k = 20 nearest bank entries vote with weight
exp(similarity / T), T = 0.07) is written once, in train/knn.py, which the trainer's k-NN monitor uses too. The
reported number is top-1 accuracy (a fraction in [0, 1]) over the queries. When the bank has fewer
than k entries, k is reduced to the bank size (all entries vote); the effective k is stored in the result.

In the suite (:class:`KNNMeasure`, name ``"knn"``): the bank is the probe-train split, the queries are the analysis
split; the features of every block's output (tap ``<block>.out``) are pooled per image to one vector: ``"cls"`` (the CLS
token, models with a prefix token only) and ``"mean_spatial"`` (mean of the tokens after the prefix; ResNet: the spatial
mean over H, W). Walmer uses the CLS token; the spatial mean is the "average-pooled spatial tokens" variant of their
§5.2 / Table 6. The pooled features are kept as float16 until the pass ends (N x L x pools x D: the one part of
the measure's memory that grows with the images; :func:`analysis.estimators.features.stored`), then compared in
float32: a query whose nearest neighbours tie to 5e-4 may vote otherwise than with float32 features (one query of
40 on the tiny test model).
The random-chance baseline (Walmer App. B.3) is the same k-NN on random features of the same shapes,
drawn for bank and queries together, with seed ``BASELINE_SEED + p * L + l`` for pool p and layer l (seed 0 for the
first): by default standard Gaussian (:func:`analysis.estimators.baselines.gaussian_like`, Walmer's text), with option
``baseline: uniform`` uniform [0, 1) (:func:`analysis.estimators.baselines.uniform_like`, Walmer's code); why the text
is the default in analysis/estimators/baselines.py. ResNet features are the plain spatial mean (Walmer study ViTs only;
Raghu's patching step is for linear probes, see analysis/estimators/features.py).

Everything is computed in float64.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Literal

import numpy as np
import torch

from analysis.engine.figures import depth_plot
from analysis.engine.measure import Context, Measure, as_list, labels_problem, register
from analysis.estimators.baselines import DEFAULT_BASELINE, noise_like
from analysis.estimators.features import PooledFeatures, block_tag, blocks_of, num_classes, pools_for
from train.knn import TEMPERATURE, K, knn_accuracy, knn_predict  # noqa: F401  (the definition; re-exported)

BASELINE_SEED = 0


@dataclass(frozen=True)
class KNNOptions:
    k: int = K  # neighbours that vote
    temperature: float = TEMPERATURE  # vote weight exp(similarity / temperature)
    baseline: Literal["gaussian", "uniform"] = DEFAULT_BASELINE  # random features: Walmer's text / Walmer's code

    def check(self):
        if self.k < 1 or self.temperature <= 0:
            return f"k must be >= 1 and temperature > 0, not k={self.k}, temperature={self.temperature}."
        return None


# ----------------------------------------------------------------------------------------------------------------
# the definition
# ----------------------------------------------------------------------------------------------------------------

# knn_predict / knn_accuracy live in train/knn.py (the trainer's k-NN monitor uses the same definition)


# ----------------------------------------------------------------------------------------------------------------
# the measure
# ----------------------------------------------------------------------------------------------------------------


@register
class KNNMeasure(Measure):
    """How semantic each layer's features are without training a read-out: weighted k-NN top-1 per layer and pool.
    Walmer et al. 2023 §6.1, Fig. 9 left; protocol of DINO; with the random-chance baseline (Walmer App. B.3).
    Definition in the module docstring: bank = probe-train features, queries = analysis features, every block's output
    pooled by ``"cls"`` (CLS models) and ``"mean_spatial"``; options ``k`` (default 20), ``temperature`` T (default
    0.07), ``baseline`` (``gaussian``, Walmer's text, or ``uniform``, Walmer's code).

    Result: ``acc`` [P, L], ``baseline`` [P, L] (float64 fractions), ``pools`` [P], ``layers`` [L] (block names),
    ``k`` (effective k = min(k, bank size)), ``temperature``, ``num_classes``, ``n_bank``, ``n_query``.
    """

    name: ClassVar[str] = "knn"
    chunkable: ClassVar[bool] = True  # per-image sums / rows: a minibatch may come in chunks
    version: ClassVar[int] = 2  # 2: per-image features kept as float16 (analysis.estimators.features.stored)
    uses_labels: ClassVar[str] = "probe"
    Options = KNNOptions

    @classmethod
    def problem(cls, data, opts):
        return labels_problem(data, probe=True)

    def __init__(self, ctx: Context, opts=None):
        super().__init__(ctx, opts)
        self.blocks = blocks_of(ctx)
        self.pools = pools_for(ctx)
        self.k = self.opts.k
        self.temperature = self.opts.temperature
        self.queries = PooledFeatures(self.blocks, self.pools, ctx.prefix)
        self.bank = PooledFeatures(self.blocks, self.pools, ctx.prefix)

    def taps(self) -> set[str]:
        return self.queries.taps()

    def update(self, j, cap, x, y) -> None:
        self.queries.add(j, cap, y)

    def probe_taps(self) -> set[str]:
        return self.bank.taps()

    def update_probe(self, j, cap, x, y) -> None:
        self.bank.add(j, cap, y)

    def finish(self) -> dict:
        acc = self.ctx.accelerator
        q_feats, q_y = self.queries.gather(acc)
        b_feats, b_y = self.bank.gather(acc)
        c = num_classes(self.ctx, q_y, b_y)
        dev = self.ctx.device
        n_layers = len(self.blocks)
        res = np.zeros((2, len(self.pools), n_layers))
        for p, pool in enumerate(self.pools):
            for l_, blk in enumerate(self.blocks):
                key = f"{pool}|{blk}"
                bank, queries = b_feats[key].to(dev), q_feats[key].to(dev)
                res[0, p, l_] = knn_accuracy(bank, b_y, queries, q_y, self.k, self.temperature, c)
                noise = noise_like(
                    torch.cat([bank, queries]).double(), BASELINE_SEED + p * n_layers + l_, self.opts.baseline
                )
                res[1, p, l_] = knn_accuracy(
                    noise[: len(bank)], b_y, noise[len(bank) :], q_y, self.k, self.temperature, c
                )
        return {
            "acc": res[0],
            "baseline": res[1],
            "pools": list(self.pools),
            "layers": list(self.blocks),
            "k": min(self.k, len(b_y)),
            "temperature": self.temperature,
            "num_classes": c,
            "n_bank": len(b_y),
            "n_query": len(q_y),
        }

    @staticmethod
    def summary(r: dict) -> dict:
        acc, base, layers = np.asarray(r["acc"]), np.asarray(r["baseline"]), as_list(r["layers"])
        out: dict = {"k": int(r["k"])}
        for p, pool in enumerate(as_list(r["pools"])):
            i = int(np.argmax(acc[p]))
            out[pool] = {
                "last": float(acc[p, -1]),
                "best": float(acc[p, i]),
                "best_layer": layers[i],
                "baseline_mean": float(base[p].mean()),
                "per_layer": [float(v) for v in acc[p]],
            }
        return out

    @staticmethod
    def scalars(r: dict) -> dict[str, float]:
        acc = np.asarray(r["acc"])
        return {
            f"knn/{pool}/{block_tag(i)}": float(acc[p, i])
            for p, pool in enumerate(as_list(r["pools"]))
            for i in range(acc.shape[1])
        }

    @staticmethod
    def figures(r: dict, step: int | None = None) -> dict:
        at = f" (step {step})" if step is not None else ""
        fig = depth_plot(
            {"top-1": (np.asarray(r["acc"]), np.asarray(r["baseline"]))},
            as_list(r["pools"]),
            f"k-NN (k={int(r['k'])}, T={float(r['temperature']):g}){at}",
            ylim=(0, 1),
        )
        return {"knn/accuracy": fig}
