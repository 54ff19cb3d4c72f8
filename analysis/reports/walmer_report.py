"""The Walmer et al. 2023 ("Teaching Matters") part of a study's report: ViTs taught by different objectives, compared.

A study whose configurations include at least two of ``supervised``, ``dino`` and ``mae`` (the configuration names
say how each ViT is taught; recipes/studies/walmer2023.yaml) gets this report from ``./launch.sh study ... --stage
report`` (analysis/reports/study_report.py dispatches here): per objective the training throughput relative to the
supervised run and the k-NN top-1 reached; then each claim of analysis/reports/claims_walmer.py with the passage it
tests, its rule, the noise floor and the outcome, and the figures labelled as Walmer's:

- attention distance by block per objective (Walmer Fig. 4), and each objective's aligned aggregated attention maps
  (Fig. 3) and average CLS attention maps (Fig. 2) with their entropies by block;
- k-NN top-1 and k-means cluster purity of the CLS token by block per objective (Fig. 9 left, Fig. 7 left);
- cross-model CKA: the same block of two objectives by depth, and the last block's CLS and all-token CKA between
  objectives (Fig. 6);
- CKA of the attention sublayer's skip path with its branch by block (Fig. 23, the diagonal).

Everything is read from the saved results of each run's last checkpoint; cross-model CKA is computed (and cached) on
the runs' shared analysis images. The figures go to ``<study root>/walmer/`` and are copied next to the document.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from analysis import offline as O
from analysis import storage
from analysis import suite as S
from analysis.figures import save, subplots
from analysis.measure import as_list
from analysis.reports import claims as C
from analysis.reports import claims_walmer as W
from train.checkpoint import read_meta
from train.objectives import REGISTRY, Objective

COLORS = {"supervised": "C0", "dino": "C1", "mae": "C2"}


def applies(configs: dict) -> bool:
    """Whether a study compares objectives: at least two of its configurations are named after one."""
    return len(set(configs) & set(W.OBJECTIVES)) >= 2


# ------------------------------------------------------------------------------------------------ reading runs


def _last(run, name: str):
    """The saved result of measure ``name`` at the run's last checkpoint, or None."""
    return storage.load_results(O.step_dir(run, max(run.checkpoints)), [name]).get(name)


def _meta(run) -> dict:
    return read_meta(run.checkpoints[max(run.checkpoints)])


def _result_json(run) -> dict:
    f = run.path / "result.json"
    try:
        return json.loads(f.read_text())
    except (OSError, ValueError):
        return {}


def throughput(run) -> tuple[float, str]:
    """Training images per second: the median of the trainer's ``train/throughput_img_s`` windows in the run's
    TensorBoard (time in callbacks, evaluation and checkpoints excluded), else steps x batch / the run's wall time."""
    tb = run.path / "tb"
    if tb.is_dir():
        ea = EventAccumulator(str(tb), size_guidance={"scalars": 0})
        ea.Reload()
        if "train/throughput_img_s" in ea.Tags()["scalars"]:
            return float(np.median([e.value for e in ea.Scalars("train/throughput_img_s")])), "TensorBoard"
    res = _result_json(run)
    if res.get("wall_s"):
        return float(res["step"]) * run.recipe.train.batch_size / float(res["wall_s"]), "wall time"
    return float("nan"), "-"


def _pool(result, pool: str = "cls") -> int | None:
    pools = as_list(result["pools"])
    return pools.index(pool) if pool in pools else None


def _knn(run) -> dict | None:
    """Last block, CLS token: {"top1", "n", "baseline", "curve", "baseline_curve"} or None."""
    r = _last(run, "knn")
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


def _purity(run) -> dict | None:
    """Last block, CLS token: {"value", "baseline", "curve", "baseline_curve"} or None."""
    r = _last(run, "clustering")
    if r is None or _pool(r) is None:
        return None
    v, base = np.asarray(r["purity"])[_pool(r)], np.asarray(r["baseline_purity"])[_pool(r)]
    return {"value": float(v[-1]), "baseline": float(base[-1]), "curve": v, "baseline_curve": base}


def _has_cls(run) -> bool:
    m = run.recipe.model
    return m.arch == "vit" and m.head == "cls"


def _block_outputs(labels) -> np.ndarray:
    """Indices of the block outputs among cross-CKA layer labels ("3.mlp" is block 3's output, cka.layer_label)."""
    labels = [str(x) for x in labels]
    idx = [i for i, lab in enumerate(labels) if lab.endswith(".mlp")]
    return np.array(idx if idx else range(len(labels)))


def _cross(a, b, opts) -> dict:
    """Cross-model CKA of a's last checkpoint against b's (analysis/offline.py against, cached)."""
    step = max(a.checkpoints)
    return O.against(a, b, max(b.checkpoints), [step], opts, progress=False)["results"][step]


def _cls_cka(a, b, study) -> float:
    """Linear CKA of the last block's CLS token between two runs' last checkpoints (Walmer Fig. 6 left), cached in
    ``<study root>/walmer/cls_cka.json`` under a key of both weights, the images and the CKA estimator."""
    opts = study.suite_options(["cka"])
    co = opts.of("cka")
    key = ":".join(
        [
            O.weights_key(a, max(a.checkpoints)),
            O.weights_key(b, max(b.checkpoints)),
            O.fingerprint(a),
            str(opts.batch_size),
            str(co.unbiased),
        ]
    )
    f = study.root / "walmer" / "cls_cka.json"
    cache = json.loads(f.read_text()) if f.is_file() else {}
    if key not in cache:
        data, bdata = O.check_same_images(a, b)
        cls = S.suite_options(
            ["cka"], opts.batch_size, {"cka": {"repr": "cls", "layers": "blocks", "unbiased": co.unbiased}}
        )
        res = O.cross_cka(
            O.load_model(a, max(a.checkpoints), data), O.load_model(b, max(b.checkpoints), bdata), data, cls
        )
        cache[key] = float(np.asarray(res["matrix"])[-1, -1])
        f.parent.mkdir(parents=True, exist_ok=True)
        storage.atomic_text(f, json.dumps(cache, indent=1))
    return cache[key]


# ------------------------------------------------------------------------------------------------ figures


def _curves(ax, curves: dict[str, list], ylabel: str, title: str, baseline: dict | None = None, ylim=None) -> None:
    """One line per objective (mean over seeds, markers) with each seed thin; ``baseline`` {objective: [seed curves]}
    dotted (random features)."""
    for o, cs in curves.items():
        cs = [np.asarray(c, dtype=float) for c in cs]
        x = np.arange(len(cs[0]))
        for c in cs:
            ax.plot(x, c, color=COLORS.get(o), lw=0.6, alpha=0.5)
        ax.plot(x, np.mean(cs, 0), color=COLORS.get(o), marker="o", ms=3, label=o)
        if baseline and baseline.get(o):
            ax.plot(x, np.mean(baseline[o], 0), color=COLORS.get(o), ls=":", lw=1, label=f"{o}, random features")
    ax.set_xticks(range(max(len(cs[0]) for cs in curves.values())))
    ax.set_xlabel("block")
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=9)
    if ylim is not None:
        ax.set_ylim(*ylim)
    ax.legend(fontsize=6)


def _attention_figure(dist: dict[str, list], path: Path) -> Path:
    """Walmer Fig. 4: every head's attention distance by block per objective (left), the per-block means (right)."""
    fig, (a, b) = subplots(1, 2, figsize=(10, 3.6), sharey=True)
    k = len(dist)
    for j, (o, ds) in enumerate(dist.items()):
        for s, d in enumerate(ds):
            d = np.asarray(d)
            x = np.repeat(np.arange(len(d)), d.shape[1]) + (j - (k - 1) / 2) * 0.22
            a.scatter(
                x,
                d.reshape(-1),
                s=8,
                color=COLORS.get(o),
                alpha=0.8,
                marker="o" if s == 0 else "x",
                label=o if s == 0 else None,
            )
    a.set_xticks(range(max(len(d) for ds in dist.values() for d in ds)))
    a.set_xlabel("block")
    a.set_ylabel("attention distance (unit square)")
    a.set_title("every head (o seed 0, x other seeds)", fontsize=9)
    a.legend(fontsize=6)
    _curves(b, {o: [np.asarray(d).mean(1) for d in ds] for o, ds in dist.items()}, "", "mean over heads")
    fig.suptitle("Average attention distance by block and objective (cf. Walmer Fig. 4)", fontsize=10)
    fig.tight_layout()
    save(fig, path)
    return path


def _panels_figure(panels: dict[str, tuple], title: str, path: Path) -> Path:
    """Side by side line panels: {panel title: (curves, ylabel, baseline or None, ylim or None)}."""
    fig, axes = subplots(1, len(panels), figsize=(5 * len(panels), 3.6), squeeze=False)
    for ax, (name, (curves, ylabel, base, ylim)) in zip(axes[0], panels.items()):
        _curves(ax, curves, ylabel, name, base, ylim)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    save(fig, path)
    return path


def _cka_last_figure(mats: dict[str, np.ndarray], names: list[str], path: Path) -> Path:
    """Walmer Fig. 6: last-block CKA between the objectives' models (mean over seeds), one heatmap per representation."""
    fig, axes = subplots(1, len(mats), figsize=(3.6 * len(mats), 3.3), squeeze=False)
    for ax, (title, m) in zip(axes[0], mats.items()):
        ax.imshow(m, vmin=0, vmax=1, cmap="magma")
        ax.set_xticks(range(len(names)), names, fontsize=7)
        ax.set_yticks(range(len(names)), names, fontsize=7)
        for i in range(len(names)):
            for j in range(len(names)):
                if np.isfinite(m[i, j]):
                    ax.text(
                        j,
                        i,
                        f"{m[i, j]:.2f}",
                        ha="center",
                        va="center",
                        fontsize=7,
                        color="black" if m[i, j] > 0.5 else "white",
                    )
        ax.set_title(title, fontsize=9)
    fig.suptitle("Last-block CKA between objectives (cf. Walmer Fig. 6)", fontsize=10)
    fig.tight_layout()
    save(fig, path)
    return path


# ------------------------------------------------------------------------------------------------ the section


def _diagnoses(objective: str) -> bool:
    """Whether ``objective`` records a diagnosis at the end of a run (its Objective overrides ``summary``)."""
    return REGISTRY[objective].Objective.summary is not Objective.summary


def _collapse_cell(runs: list[str], summaries: list[dict], diagnoses: bool | None = None) -> str:
    """The objective's own collapse diagnosis per run (train/objectives: DINO's teacher entropy against log(out_dim)
    and the largest prototype's share): the diagnosis where a run collapsed, else the numbers it rests on; "n/a"
    for an objective that diagnoses none (supervised, MAE). ``diagnoses``: whether the objective does (default:
    whether any run recorded a diagnosis); a run of such an objective without one (no result.json) says so."""
    if not (any(summaries) if diagnoses is None else diagnoses):
        return "n/a (no collapse diagnosis for this objective)"
    cells = []
    for name, s in zip(runs, summaries):
        if s.get("collapsed"):
            cells.append(f"{name}: {s['collapsed']}")
        elif "teacher_entropy" in s:
            cells.append(
                f"no ({name}: teacher entropy {s['teacher_entropy']:.2f} of log(out_dim) = {s['log_out_dim']:.2f} nats, "
                f"over the batch {s['teacher_marginal_entropy']:.2f}; largest prototype {s['top_prototype_share']:.0%})"
            )
        else:
            cells.append(f"{name}: no diagnosis recorded (no result.json: the run has not finished)")
    return "; ".join(cells)


def _objectives_table(objs: dict, doc) -> dict:
    """Per objective: throughput relative to supervised, the eval top-1 the trainer recorded and the k-NN top-1 of
    the analysis. Returns the numbers (also for the JSON twin)."""
    rows = {}
    for o, rs in objs.items():
        tp = [throughput(r) for r in rs]
        knn = [_knn(r) for r in rs]
        evals = [_meta(r).get("eval", {}).get("top1") for r in rs]
        objective = [r.recipe.train.objective for r in rs]
        summaries = [_result_json(r).get("objective") or {} for r in rs]
        rows[o] = {
            "runs": [r.name for r in rs],
            "train_objective": objective,
            "img_s": [t for t, _ in tp],
            "img_s_source": sorted({s for _, s in tp}),
            "wall_s": [_result_json(r).get("wall_s") for r in rs],
            "eval_top1": evals,
            "eval_is_knn": [not REGISTRY[x].Objective.uses_labels for x in objective],
            "knn_top1_last_block_cls": [k["top1"] if k else None for k in knn],
            "knn_n": [k["n"] if k else None for k in knn],
            "collapsed": [s.get("collapsed") for s in summaries],
            "diagnosis": summaries,
        }
    ref = np.nanmean(rows["supervised"]["img_s"]) if "supervised" in rows else float("nan")
    doc.add(
        "## Objectives at the study budget",
        "",
        "Per objective (mean over seeds; every seed in brackets): training images per second (the median of the "
        "trainer's logged windows, time in evaluation, checkpoints and callbacks excluded) and relative to the "
        "supervised run; the eval top-1 the trainer recorded at the last checkpoint (the classifier's for an "
        "objective that uses labels, the k-NN monitor's on the eval split, k = 20, for one that does not); and the "
        "k-NN top-1 of the analysis on the last block's CLS token (bank: the probe-train split, queries: the "
        "analysis split), the same read-out for every objective, and as a share of supervised's beside Walmer's "
        f"(Table 1: ImageNet, ViT-B/16, FS {W.TABLE1_KNN_TOP1['supervised']}, DINO {W.TABLE1_KNN_TOP1['dino']}, "
        f"MAE {W.TABLE1_KNN_TOP1['mae']}). Throughputs compare only runs trained under the "
        "same conditions (the same --jobs, nothing else heavy on the machine).",
        "",
        "| objective | runs | img/s | relative to supervised | training wall (min) | eval top-1 (kind) | k-NN top-1, last block CLS (± binomial SE) | k-NN relative to supervised (Walmer Table 1) | collapse |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    )
    for o, r in rows.items():
        ips = np.nanmean(r["img_s"])
        rel = ips / ref if np.isfinite(ref) and ref > 0 else float("nan")
        r["relative_img_s"] = rel
        wall = [w / 60 for w in r["wall_s"] if w]
        ev = [e for e in r["eval_top1"] if e is not None]
        kind = "k-NN monitor" if all(r["eval_is_knn"]) else "classifier" if not any(r["eval_is_knn"]) else "mixed"
        kn = [k for k in r["knn_top1_last_block_cls"] if k is not None]
        n = next((x for x in r["knn_n"] if x), 0)
        knn_cell = (
            f"{np.mean(kn):.4f} ± {C.binomial_se(float(np.mean(kn)), n):.4f} ({', '.join(f'{k:.4f}' for k in kn)})"
            if kn
            else "no k-NN result (no CLS token, or knn not measured)"
        )
        col = _collapse_cell(r["runs"], r["diagnosis"], any(_diagnoses(x) for x in r["train_objective"]))
        r["knn_vs_supervised"] = _ratio(kn, rows.get("supervised", {}).get("knn_top1_last_block_cls"))
        paper = W.TABLE1_KNN_TOP1.get(o)
        r["paper_knn_vs_supervised"] = paper / W.TABLE1_KNN_TOP1["supervised"] if paper else None
        vs = (f"{r['knn_vs_supervised']:.2f}" if r["knn_vs_supervised"] is not None else "-") + (
            f" ({r['paper_knn_vs_supervised']:.2f})" if paper else ""
        )
        doc.add(
            f"| {o} | {', '.join(r['runs'])} | {ips:.0f} ({', '.join(f'{t:.0f}' for t in r['img_s'])}) | {rel:.2f} | "
            f"{np.mean(wall) if wall else float('nan'):.1f} | "
            f"{(f'{np.mean(ev):.4f} (' + kind + ')') if ev else '-'} | {knn_cell} | {vs} | {col} |"
        )
    doc.add("")
    regime = _regime_note(rows)
    if regime:
        doc.add(regime, "")
    return rows


def _ratio(values, ref) -> float | None:
    vals, refs = [v for v in values if v is not None], [v for v in (ref or []) if v is not None]
    return float(np.mean(vals) / np.mean(refs)) if vals and refs and np.mean(refs) > 0 else None


def _regime_note(rows: dict) -> str | None:
    """One paragraph when the objectives' k-NN order at the study budget differs from Walmer's Table 1: the claims
    about their features then compare the objectives at this budget, which the reader must know."""
    ours = {o: r["knn_vs_supervised"] for o, r in rows.items() if r.get("knn_vs_supervised") is not None}
    if len(ours) < 2 or not all(o in W.TABLE1_KNN_TOP1 for o in ours):
        return None
    order = sorted(ours, key=lambda o: -ours[o])
    paper = sorted(ours, key=lambda o: -W.TABLE1_KNN_TOP1[o])
    if order == paper:
        return None
    behind = [
        o for o in order if o != "supervised" and ours[o] < W.TABLE1_KNN_TOP1[o] / W.TABLE1_KNN_TOP1["supervised"]
    ]
    return (
        f"The k-NN order of the objectives at this budget is {' > '.join(order)}; in Walmer's Table 1 (ImageNet, ViT-B/16, "
        f"trained to the end) it is {' > '.join(paper)}. "
        + "; ".join(
            f"{o} reaches {ours[o]:.2f} of supervised's k-NN top-1 here against "
            f"{W.TABLE1_KNN_TOP1[o] / W.TABLE1_KNN_TOP1['supervised']:.2f} there"
            for o in order
            if o != "supervised"
        )
        + ". The claims that compare the objectives' features therefore compare them at this training budget"
        + (
            f", where {' and '.join(behind)} {'is' if len(behind) == 1 else 'are'} not yet what the paper measured "
            "(self-supervised objectives need many epochs)."
            if behind
            else "."
        )
    )


def walmer2023(study, configs: dict, doc, section) -> tuple[list, list]:
    """The claims of analysis/reports/claims_walmer.py on the study's supervised / dino / mae configurations, with
    the objectives' table and Walmer's figures, added to ``doc``; ``section(doc, n, claim, verdict)`` writes one
    claim (study_report's). Returns ([(claim, verdict)], notes)."""
    out, notes = [], []
    objs = {o: configs[o] for o in W.OBJECTIVES if o in configs}
    fig_root = study.root / "walmer"
    fig_root.mkdir(parents=True, exist_ok=True)
    opts = study.suite_options(None)

    def add(claim_id: str, v: C.Verdict):
        claim = W.CLAIMS[claim_id]
        out.append((claim, v))
        section(doc, len(out), claim, v)

    for o, rs in objs.items():
        got = sorted({r.recipe.train.objective for r in rs})
        if got != [o]:
            notes.append(
                f"Configuration {o} trains with train.objective {', '.join(got)}, not {o}: its claims compare "
                "what the runs are, under the configuration's name."
            )
    missing = [o for o in W.OBJECTIVES if o not in objs]
    if missing:
        notes.append(f"The study has no {', '.join(missing)} configuration: the claims that need it are not testable.")
    rows = _objectives_table(objs, doc)
    collapsed = [f"{n}: {c}" for r in rows.values() for n, c in zip(r["runs"], r["collapsed"]) if c]
    if collapsed:
        notes.append("Collapsed runs (their claims compare a collapsed model): " + "; ".join(collapsed) + ".")
    if hasattr(doc, "data"):  # the JSON twin's extras, where the report keeps them
        doc.data["objectives"] = rows

    def per(fn) -> dict[str, list]:
        """objective -> the runs' values of ``fn(run)``, runs without one left out."""
        return {o: [v for v in (fn(r) for r in rs) if v is not None] for o, rs in objs.items()}

    # 1. offset local heads (Fig. 3, 14)
    aligned = per(lambda r: _last(r, "aligned_attention"))
    add(
        "offset_heads_every_objective",
        W.rule_offset_heads(
            {o: [{"local": a["local"], "offset_local": a["offset_local"]} for a in v] for o, v in aligned.items()}
        ),
    )
    for o, rs in objs.items():
        d = storage.step_dir(rs[0].path, max(rs[0].checkpoints), "figures")
        doc.figure(
            d / "aligned_attention_mass_maps.png",
            f"aligned_attention_{o}",
            f"Aligned aggregated attention maps, {rs[0].name} (cf. Walmer Fig. 3)",
        )

    # 2. attention distance by depth (Fig. 4)
    def distances(r):  # Walmer §4.3: the token grid on a unit square
        a = _last(r, "attention_distance")
        return None if a is None else np.asarray(a["unit_square"])

    dist = per(distances)
    add("reconstruction_stays_local", W.rule_reconstruction_local(dist))
    if any(dist.values()):
        doc.figure(
            _attention_figure({o: v for o, v in dist.items() if v}, fig_root / "attention_distance.png"),
            "attention_distance",
            "Average attention distance (token grid on a unit square) of every head by "
            "block and objective, and the per-block mean (cf. Walmer Fig. 4)",
        )

    # 3. CLS attention maps and their entropy (Fig. 2)
    cls_att = per(lambda r: _last(r, "cls_attention"))
    add(
        "reconstruction_cls_covers_more",
        W.rule_cls_covers_more({o: [a["map_entropy"] for a in v] for o, v in cls_att.items()}),
    )
    add("supervised_cls_sparse", W.rule_cls_sparse({o: [a["entropy"] for a in v] for o, v in cls_att.items()}))
    if any(cls_att.values()):
        mx = next(float(a["max_entropy"]) for v in cls_att.values() for a in v)
        doc.figure(
            _panels_figure(
                {
                    "entropy of the average CLS map": (
                        {o: [np.asarray(a["map_entropy"]).mean(1) for a in v] for o, v in cls_att.items() if v},
                        "nats (mean over heads)",
                        None,
                        (0, mx * 1.05),
                    ),
                    "per-image CLS attention entropy": (
                        {o: [np.asarray(a["entropy"]).mean(1) for a in v] for o, v in cls_att.items() if v},
                        "nats (mean over heads)",
                        None,
                        (0, mx * 1.05),
                    ),
                },
                f"CLS attention entropy by block and objective (uniform attention: {mx:.2f} nats)",
                fig_root / "cls_entropy.png",
            ),
            "cls_entropy",
            "Entropy of the CLS token's attention over the spatial tokens by block: of the map averaged over "
            "images (left) and per image (right), mean over heads; thin lines: seeds",
        )
        for o, rs in objs.items():
            d = storage.step_dir(rs[0].path, max(rs[0].checkpoints), "figures")
            if (d / "cls_attention_maps.png").is_file():
                doc.figure(
                    d / "cls_attention_maps.png",
                    f"cls_attention_{o}",
                    f"Average CLS attention maps, {rs[0].name} (cf. Walmer Fig. 2)",
                )

    # 4. semantic CLS features: k-NN and clustering by depth (Fig. 7, 9)
    knn, purity = per(_knn), per(_purity)
    add(
        "contrastive_beats_reconstruction",
        W.rule_more_semantic(knn, {o: [p["value"] for p in v] for o, v in purity.items()}, "dino", "mae"),
    )
    add(
        "supervised_most_semantic",
        W.rule_more_semantic(knn, {o: [p["value"] for p in v] for o, v in purity.items()}, "supervised", "dino"),
    )
    add("reconstruction_cls_above_chance", W.rule_above_chance(knn.get("mae", []), purity.get("mae", [])))
    add(
        "contrastive_semantic_earlier",
        W.rule_semantic_earlier(knn, {o: [p["curve"] for p in v] for o, v in purity.items()}),
    )
    if any(knn.values()) or any(purity.values()):
        doc.figure(
            _panels_figure(
                {
                    "k-NN top-1 (k = 20), CLS token": (
                        {o: [k["curve"] for k in v] for o, v in knn.items() if v},
                        "top-1",
                        {o: [k["baseline_curve"] for k in v] for o, v in knn.items() if v},
                        (0, 1),
                    ),
                    "k-means cluster purity, CLS token": (
                        {o: [p["curve"] for p in v] for o, v in purity.items() if v},
                        "purity",
                        {o: [p["baseline_curve"] for p in v] for o, v in purity.items() if v},
                        (0, 1),
                    ),
                },
                "Global semantics of the CLS token by block and objective (cf. Walmer Fig. 9 left, Fig. 7 left)",
                fig_root / "semantic.png",
            ),
            "semantic",
            "k-NN top-1 (left) and cluster purity (right) of the CLS token at every block's output; dotted: the "
            "same read-out on random Gaussian features (cf. Walmer Fig. 9 left, Fig. 7 left)",
        )

    # 5. cross-model CKA: depth (Fig. 1, 2) and the last block (Fig. 6)
    names = list(objs)
    pairs = [(a, b) for i, a in enumerate(names) for b in names[i + 1 :]]
    same, last_all, last_cls = {}, {}, {}
    for a, b in pairs:
        k = C._paired(objs[a], objs[b])
        res = [_cross(ra, rb, opts) for ra, rb in zip(objs[a][:k], objs[b][:k])]
        curves = [np.asarray(r["same_index"])[_block_outputs(r["labels_a"])] for r in res if "same_index" in r]
        same[W.pair_name(a, b)] = curves
        last_all[(a, b)] = [float(c[-1]) for c in curves]
        if all(_has_cls(r) for r in objs[a][:k] + objs[b][:k]):
            last_cls[(a, b)] = [_cls_cka(ra, rb, study) for ra, rb in zip(objs[a][:k], objs[b][:k])]
    add("objectives_diverge_late", W.rule_diverge_late(same))
    add("cls_similar_by_supervision", W.rule_cls_groups({W.pair_name(*p): v for p, v in last_cls.items()}))
    if any(same.values()):
        doc.figure(
            _panels_figure(
                {"same block, two objectives": ({p: c for p, c in same.items() if c}, "CKA", None, (0, 1.02))},
                "Cross-model CKA of the same block's output by depth",
                fig_root / "cka_depth.png",
            ),
            "cka_depth",
            "Linear CKA between the same block's outputs of two models taught differently (same "
            "seed), by block; thin lines: seeds. Walmer shows attention diverging in the mid-to-late layers (Fig. 2) "
            "and compares features at the last layer only (Fig. 6)",
        )
        mats = {}
        for title, vals in (("CLS token", last_cls), ("all tokens (study's CKA representation)", last_all)):
            if vals:
                m = np.full((len(names), len(names)), np.nan)
                np.fill_diagonal(m, 1.0)
                for (a, b), v in vals.items():
                    m[names.index(a), names.index(b)] = m[names.index(b), names.index(a)] = np.mean(v) if v else np.nan
                mats[title] = m
        doc.figure(
            _cka_last_figure(mats, names, fig_root / "cka_last.png"),
            "cka_last",
            "Last-block CKA between the objectives' models, mean over seeds: the CLS token (left, Walmer Fig. 6 "
            "left) and all tokens (right; Walmer's right panel uses the spatial tokens)",
        )
        for (a, b), v in last_all.items():
            doc.add(f"Last-block CKA (all tokens) {a} vs {b}: {', '.join(f'{x:.3f}' for x in v)} by seed.")
        for (a, b), v in last_cls.items():
            doc.add(f"Last-block CKA (CLS token) {a} vs {b}: {', '.join(f'{x:.3f}' for x in v)} by seed.")
        doc.add("")

    # 6. residual connections (Fig. 23)
    def attn_skip(r):
        res = _last(r, "residual_cka")
        if res is None or "attn" not in as_list(res["sublayers"]):
            return None
        return np.asarray(res["skip_branch"])[as_list(res["sublayers"]).index("attn")]

    skip = per(attn_skip)
    add("residual_shift_supervised", W.rule_residual_shift(skip))
    if any(skip.values()):
        doc.figure(
            _panels_figure(
                {
                    "attention sublayer: CKA(z, f(z)) in the same block": (
                        {o: v for o, v in skip.items() if v},
                        "CKA",
                        None,
                        (0, 1.02),
                    )
                },
                "Skip path vs branch by block and objective (cf. Walmer Fig. 23, its diagonal)",
                fig_root / "residual.png",
            ),
            "residual",
            "CKA between what the attention sublayer's skip connection carries (z) and what its branch "
            "computes (f(z)) in the same block, by objective; thin lines: seeds (the diagonal of Walmer Fig. 23)",
        )
    return out, notes
