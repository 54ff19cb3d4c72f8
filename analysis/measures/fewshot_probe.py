"""``fewshot_probe``: k-shot linear probes per block and pooling (ViT paper §4.1; Raghu et al. 2021 Fig. 11 right, 13).

The probe itself (closed-form ridge regression to {-1, 1} targets, l2 chosen on held-out images) and the
probe-train split are defined in analysis/probing.py, shared with ``token_probes``.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np

from analysis.baselines import gaussian_like
from analysis.figures import probe_plot
from analysis.measure import Measure, as_list, register
from analysis.probing import pool_features, probe_layers, probe_split, probe_split_problem
from analysis.reduce import collect


@dataclass(frozen=True)
class FewShotOptions:
    shots: int = 10  # examples per class
    seeds: tuple[int, ...] = (0, 1, 2)  # one draw of shots per seed; mean and std over seeds
    pools: tuple[str, ...] = ("cls", "mean", "mean_spatial")  # CLS token, mean of all tokens, mean of spatial tokens

    def check(self):
        if self.shots < 1:
            return f"shots must be at least 1, not {self.shots}."
        if not self.seeds:
            return "seeds must name at least one seed."
        bad = [p for p in self.pools if p not in ("cls", "mean", "mean_spatial")]
        if bad:
            return f"pool '{bad[0]}' is not one of cls, mean, mean_spatial."
        return None


_BASELINES: dict = {}  # the Gaussian-feature probe depends only on shapes, labels, shots and seeds: computed once


def _baseline(tr, va, te, train_y, test_y, layers, kw) -> dict:
    """The probe on Gaussian features of the same shapes (Walmer App. B.3), cached per process by what it
    depends on (feature shapes, labels, shots, seeds), so it is not recomputed at every checkpoint."""
    h = hashlib.sha256(repr([tuple(d[t].shape) for d in (tr, va, te) for t in layers]).encode())
    for t in (train_y, test_y, kw["val_y"]):
        h.update(t.numpy().tobytes())
    h.update(repr((kw["shots"], kw["seeds"], kw["num_classes"])).encode())
    key = h.hexdigest()
    if key not in _BASELINES:
        rnd = [{t: gaussian_like(d[t], seed=i) for t in layers} for i, d in enumerate((tr, va, te))]
        _BASELINES[key] = probe_layers(rnd[0], train_y, rnd[2], test_y, val_feats=rnd[1], **kw)
    return _BASELINES[key]


@register
class FewShotProbeMeasure(Measure):
    """ViT paper §4.1, Raghu et al. 2021 Fig. 11 right / 13: ``shots``-shot linear probes per block
    output and pooling (CLS token / mean of all tokens / mean of spatial tokens; ResNet: spatial mean), shots
    from the first half of probe-train (per seed), l2 chosen on the second half, top-1 on the analysis images
    (:func:`probe_layers`). ``baseline``: the same probes on Gaussian features of the same shapes (Walmer App.
    B.3). Result: ``mean``/``std``/``baseline`` [P, L], ``pools``, ``layers``, ``shots``, ``seeds``, ``chance``."""

    name = "fewshot_probe"
    Options = FewShotOptions

    @classmethod
    def problem(cls, data, opts):
        return probe_split_problem(data, opts.shots, "fewshot_probe.shots")

    def __init__(self, ctx, opts=None):
        super().__init__(ctx, opts)
        o = self.opts
        self.layers = [f"{b}.out" for b in ctx.blocks]
        if ctx.arch == "resnet":
            self.pools = ["mean"]
        else:
            self.pools = [p for p in o.pools if not (p == "cls" and ctx.prefix == 0)]
        self.test, self.train = [], []

    def taps(self):
        return set(self.layers)

    probe_taps = taps

    def _feats(self, cap):
        return {(t, p): pool_features(cap[t], p, self.ctx.prefix).float().cpu() for t in self.layers for p in self.pools}

    def update(self, j, cap, x, y):
        self.test.append((j, self._feats(cap), y))

    def update_probe(self, j, cap, x, y):
        self.train.append((j, self._feats(cap), y))

    def finish(self):
        o = self.opts
        test_x, test_y = collect(self.test, self.ctx.accelerator)
        pool_x, pool_y = collect(self.train, self.ctx.accelerator)
        shot_idx, val_idx = probe_split(pool_y)
        mean, std, base = [], [], []
        for p in self.pools:
            tr = {t: pool_x[(t, p)][shot_idx] for t in self.layers}
            va = {t: pool_x[(t, p)][val_idx] for t in self.layers}
            te = {t: test_x[(t, p)] for t in self.layers}
            kw = dict(shots=o.shots, seeds=tuple(o.seeds), val_y=pool_y[val_idx], num_classes=self.ctx.data.num_classes)
            r = probe_layers(tr, pool_y[shot_idx], te, test_y, val_feats=va, **kw)
            b = _baseline(tr, va, te, pool_y[shot_idx], test_y, self.layers, kw)
            mean.append([r[t][0] for t in self.layers])
            std.append([r[t][1] for t in self.layers])
            base.append([b[t][0] for t in self.layers])
        return {"mean": np.array(mean), "std": np.array(std), "baseline": np.array(base), "pools": list(self.pools),
                "layers": list(self.layers), "shots": int(o.shots), "seeds": np.array(list(o.seeds)),
                "chance": 1.0 / self.ctx.data.num_classes}

    @staticmethod
    def summary(r):
        out = {p: [float(v) for v in np.asarray(r["mean"])[i]] for i, p in enumerate(as_list(r["pools"]))}
        out["baseline_mean"] = float(np.asarray(r["baseline"]).mean())
        return out

    @staticmethod
    def scalars(r):
        m, shots = np.asarray(r["mean"]), int(r["shots"])
        return {f"probe/{shots}shot/{p}/block{i:02d}": float(m[pi, i]) for pi, p in enumerate(as_list(r["pools"])) for i in range(m.shape[1])}

    @staticmethod
    def figures(r, step=None):
        at = f" (step {step})" if step is not None else ""
        m, s, b = np.asarray(r["mean"]), np.asarray(r["std"]), np.asarray(r["baseline"])
        curves = {p: (m[i], s[i]) for i, p in enumerate(as_list(r["pools"]))}
        curves["random features"] = (b.mean(0), np.zeros(b.shape[1]))
        return {f"probe/{int(r['shots'])}shot": probe_plot(curves, title=f"{int(r['shots'])}-shot linear probe{at}", chance=float(r["chance"]))}
