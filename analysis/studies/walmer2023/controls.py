"""The controls of Walmer's semantic claims, and DINO read by its teacher.

Walmer's "random chance" (App. B.3) is the k-NN and the clustering on Gaussian noise of the features' shape: every
trained model beats it. Two baselines say more (computed here, cached in ``<study root>/walmer/controls.json``):

- a **random-initialised network** of the same architecture: the run's recipe built under torch seed = the run's
  seed (a fresh initialisation, not necessarily the run's own starting weights), measured by the same ``knn`` and
  ``clustering`` measures with the study's options, CLS token at every block. Features that beat it were learned,
  not given by the architecture;
- the **raw pixels**: the same k-NN (bank: the probe-train split, queries: the analysis split) and k-means on the
  flattened normalised images. Features that beat them are more semantic than the input.

DINO is evaluated by its teacher (DINO's own k-NN and linear evaluations read the teacher, and the public DINO
weights Walmer analyses are the teacher's backbone). A DINO checkpoint holds both networks (``parts`` in its
meta.json); :func:`teacher_runs` opens the teacher and analyses it with the study's measures (cached like any
analysis, in the run's ``analysis/teacher/``).
"""

from __future__ import annotations

import numpy as np
import torch

from analysis.engine import suite as S
from analysis.engine.measure import as_list, registry
from analysis.frontends import runner as RN
from analysis.measures.clustering import kmeans, purity
from analysis.results import runs as RF
from analysis.results import storage
from analysis.sources import models as MS
from train.knn import knn_accuracy
from train.models import build_model
from train.objectives import uses_labels

TEACHER = "teacher"  # the part of a DINO checkpoint that DINO evaluates


def _controls_file(root):
    """The file of this module's numbers in the study folder (:func:`analysis.results.storage.json_cached`)."""
    return root / "walmer" / "controls.json"


def _cls_curve(result: dict, key: str) -> list[float] | None:
    pools = as_list(result["pools"])
    return np.asarray(result[key])[pools.index("cls")].tolist() if "cls" in pools else None


def random_init(run, study) -> dict:
    """k-NN top-1 and cluster purity of the CLS token by block of a random-initialised network of ``run``'s
    architecture (torch seed = the run's seed): {"knn": [L], "purity": [L]} (None where the model has no CLS token)."""
    opts = study.suite_options(["knn", "clustering"])
    key = storage.cache_key(
        f"random-init:{run.recipe.model!r}:seed-{run.recipe.seed}",
        MS.fingerprint(run),
        {m: opts.settings(m) for m in ("knn", "clustering")},
        "random_init",
    )

    def compute() -> dict:
        data = MS.load_data(run)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(run.recipe.seed)
            model = build_model(run.recipe, data.num_classes if uses_labels(run.recipe) else 0).eval()
        res = S.run_suite(model, data, opts)
        return {"knn": _cls_curve(res["knn"], "acc"), "purity": _cls_curve(res["clustering"], "purity")}

    return storage.json_cached(_controls_file(study.root), key, compute)


def raw_pixels(run, study) -> dict:
    """k-NN top-1 and cluster purity of the flattened normalised images of ``run``'s data (the same bank, queries,
    k, temperature, k-means restarts and seed as the measures): {"knn": float, "purity": float}."""
    opts = study.suite_options(["knn", "clustering"])
    ko, co = opts.of("knn"), opts.of("clustering")
    key = storage.cache_key(
        "raw-pixels", MS.fingerprint(run), {m: opts.settings(m) for m in ("knn", "clustering")}, "raw_pixels"
    )

    def compute() -> dict:
        data = MS.load_data(run)
        q = data.normalize(data.analysis.images).flatten(1).double()
        b = data.normalize(data.probe_train.images).flatten(1).double()
        qy, by = data.analysis.labels, data.probe_train.labels
        acc = knn_accuracy(b, by, q, qy, min(ko.k, len(by)), ko.temperature, data.num_classes)
        assign, _, _ = kmeans(q, data.num_classes, co.seed, co.restarts, co.max_iter)
        return {"knn": float(acc), "purity": float(purity(assign, qy))}

    return storage.json_cached(_controls_file(study.root), key, compute)


def has_teacher(run) -> bool:
    """Whether the run's last checkpoint holds DINO's teacher."""
    return TEACHER in RF.checkpoint_parts(run, max(run.checkpoints))


def teacher_runs(runs: list, study) -> list | None:
    """The teacher of each run (None when some checkpoint holds none), analysed like the study analyses its runs:
    ``every_checkpoint`` measures at every checkpoint, the study's measures at the last (cached)."""
    if not runs or not all(has_teacher(r) for r in runs):
        return None
    out = []
    for r in runs:
        t = RF.open_run(r.path, TEACHER)
        measures = study.runs[r.name].measures or study.measures or sorted(registry())
        RN.analyze_run(t, None, study.suite_options(study.every_checkpoint), tensorboard=False, progress=False)
        RN.analyze_run(t, ["last"], study.suite_options(measures), tensorboard=False, progress=False)
        out.append(t)
    return out
