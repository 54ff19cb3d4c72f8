"""``fewshot_probe``: k-shot linear probes per block and pooling (ViT paper §4.1; Raghu et al. 2021 Fig. 11 right, 13).

Definition. For every block output l and pooling P, with the probe-train split halved class-balanced
(:func:`analysis.estimators.probing.probe_split`: shot half S, held-out half V) and the analysis images A:

    mean[P, l] = mean over seeds s of top1_A( probe fitted on F_P,l[shots_s(S)] ),   std = sample std over seeds
    baseline[P, l] = the same on random features of the same shapes (Walmer App. B.3, analysis/estimators/baselines.py)

where the probe (analysis/estimators/probing.py, exact formulas there) is a closed-form ridge regression onto {-1, 1}^K
targets (ViT paper §4.1: "a regularized linear regression problem that maps the (frozen) representation of a subset of
training images to {-1, 1}^K target vectors"; Raghu App. A: "regularized least-squares regression, following
Dosovitskiy et al. [...] recovered efficiently in closed form", hyperparameters "tuned [...] on a heldout portion
of the training set"). Option ``method``: ``big_vision`` (default; the authors' code, big_vision
evaluators/fewshot_lsr.py: features standardised by the shots' mean and std + 1e-5, a constant feature 100 as the
bias, targets not centred) or ``centred`` (this project's earlier fit: centred features and targets, unregularised
bias). Option ``l2``: null (default) = picked on V from the method's grid (big_vision: 2^0 ... 2^20, around its
2^10), as Raghu App. A tunes on held-out data; a number = fixed (``l2: 1024`` with ``big_vision`` is big_vision's
evaluator exactly, which uses no held-out data). Pools: CLS token, mean of all tokens, mean of spatial tokens
(Raghu Fig. 11 right, F.3). ResNet: the spatial mean of each block's map, by default after Raghu App. A's patching
step (option ``resnet_tokens: patch``: p x p patches flattened to C p^2 channels, p automatic as in
analysis/estimators/features.py, or ``resnet_patch``; ``pool``: the plain spatial mean of C channels).

Where ours departs: big_vision runs in float32 and draws its shots with numpy's ``default_rng(seed)`` over the whole
train split; ours runs in float64 and draws with :func:`analysis.estimators.probing.sample_shots` from the shot half.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Literal

import numpy as np

from analysis.engine.figures import probe_plot
from analysis.engine.measure import Measure, as_list, labels_problem, register
from analysis.engine.reduce import collect
from analysis.estimators.baselines import DEFAULT_BASELINE, noise_like
from analysis.estimators.features import final_channels, has_class_token, resnet_patch_side, restored, stored
from analysis.estimators.probing import (
    DEFAULT_METHOD,
    expand_rows,
    pool_features,
    probe_layers,
    probe_rows_read,
    probe_split,
    probe_split_problem,
)


@dataclass(frozen=True)
class FewShotOptions:
    shots: int = 10  # examples per class
    seeds: tuple[int, ...] = (0, 1, 2)  # one draw of shots per seed; mean and std over seeds
    pools: tuple[str, ...] = ("cls", "mean", "mean_spatial")  # CLS token, mean of all tokens, mean of spatial tokens
    method: Literal["big_vision", "centred"] = DEFAULT_METHOD  # the probe's fit (analysis/estimators/probing.py)
    l2: float | None = None  # ridge l2; None: picked on the held-out half from the method's grid
    resnet_tokens: Literal["patch", "pool"] = "patch"  # Raghu App. A patching step before the spatial mean, or none
    resnet_patch: int = 0  # patch side for resnet_tokens=patch; 0: automatic (analysis/estimators/features.py)
    baseline: Literal["gaussian", "uniform"] = DEFAULT_BASELINE  # random features: Walmer's text / Walmer's code

    def check(self):
        if self.shots < 1:
            return f"shots must be at least 1, not {self.shots}."
        if not self.seeds:
            return "seeds must name at least one seed."
        bad = [p for p in self.pools if p not in ("cls", "mean", "mean_spatial")]
        if bad:
            return f"pool '{bad[0]}' is not one of cls, mean, mean_spatial."
        if self.l2 is not None and self.l2 <= 0:
            return f"l2 must be a positive number (or null to pick it on held-out images), not {self.l2}."
        if self.resnet_patch < 0:
            return f"resnet_patch must be >= 0 (0: automatic), not {self.resnet_patch}."
        return None


# the random-feature probe depends only on shapes, labels, shots, seeds and the probe: computed once
_BASELINES: dict = {}


def _baseline(tr, va, te, train_y, test_y, layers, kw, kind) -> dict:
    """The probe on random features of the same shapes (Walmer App. B.3), cached per process by what it
    depends on (feature shapes, labels, shots, seeds, method, l2, noise kind), so it is not recomputed at every
    checkpoint."""
    h = hashlib.sha256(repr([tuple(d[t].shape) for d in (tr, va, te) for t in layers]).encode())
    for t in (train_y, test_y, kw["val_y"]):
        h.update(t.numpy().tobytes())
    h.update(repr((kw["shots"], kw["seeds"], kw["num_classes"], kw["method"], kw["l2_grid"], kind)).encode())
    key = h.hexdigest()
    if key not in _BASELINES:
        rnd = [{t: noise_like(d[t], i, kind) for t in layers} for i, d in enumerate((tr, va, te))]
        _BASELINES[key] = probe_layers(rnd[0], train_y, rnd[2], test_y, val_feats=rnd[1], **kw)
    return _BASELINES[key]


@register
class FewShotProbeMeasure(Measure):
    """How much class information each block's output holds: few-shot linear probes (10 shots by default).
    ViT paper §4.1, Raghu et al. 2021 Fig. 11 right / 13: ``shots``-shot linear probes per block output and pooling (CLS
    token / mean of all tokens / mean of spatial tokens; ResNet: spatial mean of the patched map, Raghu App. A), shots
    from the first half of probe-train (per seed), by default big_vision's fit with l2 chosen on the second half, top-1
    on the analysis images (:func:`probe_layers`; definition in the module docstring). ``baseline``: the same probes on
    random features of the same shapes (Walmer App. B.3; Gaussian by default). Result: ``mean``/``std``/``baseline`` [P,
    L], ``pools``, ``layers``, ``shots``, ``seeds``, ``chance``, ``method``, ``feature_dim`` [L]."""

    name = "fewshot_probe"
    chunkable = True  # per-image sums / rows: a minibatch may come in chunks
    version = 2  # 2: per-image features kept as float16 (analysis.estimators.features.stored)
    uses_labels = "probe"
    Options = FewShotOptions

    @classmethod
    def problem(cls, data, opts):
        return labels_problem(data, probe=True) or probe_split_problem(data, opts.shots, cls.name)

    def __init__(self, ctx, opts=None):
        super().__init__(ctx, opts)
        o = self.opts
        self.layers = [f"{b}.out" for b in ctx.blocks]
        if ctx.arch == "resnet":
            self.pools = ["mean"]
        else:
            cls = has_class_token(ctx.model, ctx.prefix)  # registers are prefix tokens, not a class token
            self.pools = [p for p in o.pools if not (p == "cls" and not cls)]
        self.final = final_channels(ctx.model) if ctx.arch == "resnet" else None
        self.test, self.train = [], []

    def taps(self):
        return set(self.layers)

    probe_taps = taps

    def _patch(self, t) -> int:
        o = self.opts
        return resnet_patch_side(t.shape, self.final, o.resnet_tokens, o.resnet_patch) if t.ndim == 4 else 1

    def _feats(self, cap):
        return {
            (t, p): stored(pool_features(cap[t], p, self.ctx.prefix, self._patch(cap[t])))
            for t in self.layers
            for p in self.pools
        }

    def update(self, j, cap, x, y):
        self.test.append((j, self._feats(cap), y))

    def update_probe(self, j, cap, x, y):
        self.train.append((j, self._feats(cap), y))

    def probe_rows(self, labels):
        """The shots of every seed and, with l2 picked on it (null), the held-out half: all that finish reads."""
        return probe_rows_read(labels, self.opts.shots, self.opts.seeds, self.opts.l2)

    def finish(self):
        o = self.opts
        test_x, test_y = collect(self.test, self.ctx.accelerator)
        pool_x, pool_y = collect(self.train, self.ctx.accelerator)
        test_x, pool_x = restored(test_x), restored(pool_x)
        if self.probe_index is not None:  # only probe_rows were forwarded: full-size features, unread rows zero
            pool_x, pool_y = expand_rows(pool_x, pool_y, self.probe_index, self.ctx.data.probe_train.labels)
        shot_idx, val_idx = probe_split(pool_y)
        mean, std, base = [], [], []
        for p in self.pools:
            tr = {t: pool_x[(t, p)][shot_idx] for t in self.layers}
            va = {t: pool_x[(t, p)][val_idx] for t in self.layers}
            te = {t: test_x[(t, p)] for t in self.layers}
            kw = dict(
                shots=o.shots,
                seeds=tuple(o.seeds),
                val_y=pool_y[val_idx],
                num_classes=self.ctx.data.num_classes,
                method=o.method,
                l2_grid=o.l2,
            )
            r = probe_layers(tr, pool_y[shot_idx], te, test_y, val_feats=va, **kw)
            b = _baseline(tr, va, te, pool_y[shot_idx], test_y, self.layers, kw, o.baseline)
            mean.append([r[t][0] for t in self.layers])
            std.append([r[t][1] for t in self.layers])
            base.append([b[t][0] for t in self.layers])
        return {
            "mean": np.array(mean),
            "std": np.array(std),
            "baseline": np.array(base),
            "pools": list(self.pools),
            "layers": list(self.layers),
            "shots": int(o.shots),
            "seeds": np.array(list(o.seeds)),
            "chance": 1.0 / self.ctx.data.num_classes,
            "method": o.method,
            "feature_dim": np.array([int(test_x[(t, self.pools[0])].shape[-1]) for t in self.layers]),
        }

    @staticmethod
    def summary(r):
        out = {p: [float(v) for v in np.asarray(r["mean"])[i]] for i, p in enumerate(as_list(r["pools"]))}
        out["baseline_mean"] = float(np.asarray(r["baseline"]).mean())
        return out

    @staticmethod
    def scalars(r):
        m, shots = np.asarray(r["mean"]), int(r["shots"])
        return {
            f"probe/{shots}shot/{p}/block{i:02d}": float(m[pi, i])
            for pi, p in enumerate(as_list(r["pools"]))
            for i in range(m.shape[1])
        }

    @staticmethod
    def figures(r, step=None):
        at = f" (step {step})" if step is not None else ""
        m, s, b = np.asarray(r["mean"]), np.asarray(r["std"]), np.asarray(r["baseline"])
        curves = {p: (m[i], s[i]) for i, p in enumerate(as_list(r["pools"]))}
        curves["random features"] = (b.mean(0), np.zeros(b.shape[1]))
        return {
            f"probe/{int(r['shots'])}shot": probe_plot(
                curves, title=f"{int(r['shots'])}-shot linear probe{at}", chance=float(r["chance"])
            )
        }
