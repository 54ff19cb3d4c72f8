"""What the real-ViT report reads, and where from: the run (the model and the photos, loaded on first need) or its
results bundle (never: analysis/studies/bundle.py).

Everything the report computes from the model besides the suite's measures is a *report-time result*, cached in the
run's ``analysis/step_0000000/report/`` under a key of the weights' identity, the images' fingerprint and its options
(:func:`analysis.results.storage.cache_key`, as the measures' results and the studies' report-time baselines): the
claims' per-image statistics (:func:`~.reads.image_context`, minutes on a CPU), the similarity maps with their
permutation nulls, the CLS attention maps the report draws on four photos, and what the report says about the model
and the images. A second report computes none of them; a report from the bundle reads them with neither weights nor
photos. The measures' results are read from the analysis folder, but for those whose bulk the report does not show
(:data:`SHOWN`: localization's [L, 256, 256] token x patch CKA matrices, 6 MB, of which the report reads the per-block
scores; aligned_attention's per-offset means beside the mass maps it draws; cls_attention's maps before the prefix
tokens' share is removed), whose shown part is cached beside them, keyed by the full result's key.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from analysis.engine.measure import load_result
from analysis.results import storage
from analysis.studies.bundle import unwatched
from analysis.studies.real_vit.claims import ImageContext

REPORT = "report"  # the report-time results' folder, in the run's analysis step folder
# a measure's arrays the report does not read: its result is read without them (a copy cached in REPORT)
SHOWN = {"localization": ("cka",), "aligned_attention": ("maps",), "cls_attention": ("maps_raw",)}
# the last suite pass's wall time and counts (not a result: rewritten by every report from the run)
SUITE = "suite.json"


class NotCached(LookupError):
    """A report from a bundle needs a result that the bundle does not hold (for these options)."""


def _js(obj) -> np.ndarray:
    return np.array(json.dumps(obj))


def _unjs(a) -> object:
    return json.loads(str(np.asarray(a)))


@dataclass
class Source:
    """The report's inputs: ``weights`` (:func:`analysis.sources.models.weights_key`) and ``fingerprint`` (the images',
    :func:`analysis.sources.models.fingerprint`) key every cached result; ``run`` and ``data`` are None when reading a
    bundle (then a result that is not cached is :class:`NotCached`)."""

    root: Path
    weights: str
    fingerprint: str
    run: object | None = None
    data: object | None = None
    _model: object | None = None

    @property
    def step(self) -> Path:
        return storage.step_dir(Path(self.root), 0)

    @property
    def folder(self) -> Path:
        return self.step / REPORT

    def identity(self) -> dict:
        """What a bundle records to find these results again without the weights or the images."""
        return {"weights": self.weights, "fingerprint": self.fingerprint}

    def model(self):
        if self.run is None:
            raise NotCached("the model is not loaded from a results bundle")
        if self._model is None:
            from analysis.sources import models as MS

            self._model = MS.load_model(self.run, 0, self.data)
        return self._model

    def key(self, name: str, settings: dict) -> str:
        return storage.cache_key(self.weights, self.fingerprint, settings, name)

    def kept(self, name: str, settings: dict, compute) -> dict:
        """The report-time result ``name`` under ``settings``: cached, or computed by ``compute()`` (a dict of arrays)
        and cached with its wall time (``wall_s``); read back from the file either way, so that a report from the run
        and one from the bundle see the same numbers."""
        out, key = self.folder, self.key(name, settings)
        if storage.is_kept(out, name, key):
            return load_result(out / f"{name}.npz")
        if self.run is None:
            raise NotCached(f"{REPORT}/{name}.npz is not cached for these weights, images and options")
        t0 = time.time()
        with unwatched():  # what it is computed from is no part of the bundle: the result is
            res = compute()
        res["wall_s"] = time.time() - t0
        return storage.keep_result(out, name, key, res)

    def results(self, measures, opts) -> dict:
        """The suite's results of ``measures`` kept under the suite options ``opts`` (those not measured left out);
        of a measure in :data:`SHOWN`, the result without the arrays the report does not read."""
        keys, res = storage.cached_keys(self.step), {}
        for m in measures:
            key = storage.cache_key(self.weights, self.fingerprint, opts.settings(m), m)
            if keys.get(m) != key:
                continue
            if m in SHOWN:
                full = self.step / f"{m}.npz"
                res[m] = self.kept(m, {"result": key}, lambda f=full, m=m: _without(load_result(f), SHOWN[m]))
                res[m].pop("wall_s")
            else:
                res[m] = load_result(self.step / f"{m}.npz")
        return res

    def suite(self, stats: dict | None = None) -> dict:
        """The suite pass's wall time and counts: recorded from ``stats`` (a report from the run), else read back."""
        f = self.folder / SUITE
        if stats is not None:
            self.folder.mkdir(parents=True, exist_ok=True)
            storage.atomic_text(f, json.dumps(stats, indent=1))
        return json.loads(f.read_text())


def _without(res: dict, drop) -> dict:
    return {k: v for k, v in res.items() if k not in drop}


# ------------------------------------------------------------------------------------------------ the results


def context_result(ctx: ImageContext) -> dict:
    """An ImageContext as arrays (None arrays left out) and one JSON field for the rest."""
    d = asdict(ctx)
    arrays = {k: np.asarray(v) for k, v in d.items() if isinstance(v, np.ndarray)}
    rest = {k: v for k, v in d.items() if k not in arrays and v is not None}
    return {**arrays, "json": _js(rest)}


def _window(v) -> tuple:
    return int(v[0]), int(v[1]), tuple(int(x) for x in v[2])


def context_of(res: dict) -> ImageContext:
    """The ImageContext of :func:`context_result` (the windows as (block, head, (dr, dc)) tuples again)."""
    rest = _unjs(res["json"])
    rest["windows"] = [_window(w) for w in rest["windows"]]
    for k in ("chosen", "chosen_split"):
        rest[k] = {half: _window(w) for half, w in rest[k].items()}
    arrays = {k: v for k, v in res.items() if k not in ("json", "wall_s")}
    return ImageContext(**arrays, **rest)


def json_result(obj) -> dict:
    return {"json": _js(obj)}


def json_of(res: dict):
    return _unjs(res["json"])
