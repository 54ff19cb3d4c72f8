"""The sections of Walmer's report before the claims: which network of each DINO run is read (its teacher), the
objectives at the study budget (throughput, top-1, k-NN share of supervised against Walmer's Table 1, collapse), the
controls of the semantic claims, and the figures that belong to no single claim (Walmer Fig. 4, 2, 7, 9 and the
cross-model CKA by depth). Each writes to ``ctx.doc`` and leaves what the claims need in ``ctx.shared``.
"""

from __future__ import annotations

import json

import numpy as np
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from analysis.engine.figures import BLOCK_AXIS, save, subplots, uniform_line
from analysis.results import folders as RF0
from analysis.studies.walmer2023 import controls as K
from analysis.studies.walmer2023 import numbers as N
from analysis.studies.walmer2023 import reads as R
from analysis.studies.walmer2023.claims import REGIME
from train.checkpoint import read_meta
from train.objectives import REGISTRY, Objective
from train.run_folder import events_dir

COLORS = {"supervised": "C0", "dino": "C1", "mae": "C2"}


def objectives(ctx) -> dict:
    """{objective: its runs} for the study's configurations named after an objective, in Walmer's order."""
    return {o: ctx.configs[o] for o in N.OBJECTIVES if o in ctx.configs}


# ------------------------------------------------------------------------------------------------ DINO's teacher


def teacher_section(ctx) -> None:
    """DINO is read by its teacher: replace the dino runs of ``ctx.configs`` by their teachers (analysed here, cached)
    when every checkpoint holds one; say which network is read either way."""
    runs = ctx.configs.get("dino")
    if not runs:
        return
    teachers = K.teacher_runs(runs, ctx.study)
    if teachers is None:
        ctx.notes.append(
            "The dino runs' checkpoints hold no DINO teacher (e.g. a run trained before the teacher was saved, or a "
            "configuration that is not DINO): dino is read by the trained backbone, whereas DINO evaluates its teacher."
        )
        ctx.shared["dino_part"] = "student"
        return
    ctx.configs["dino"] = teachers
    ctx.shared["dino_part"] = K.TEACHER
    ctx.doc.add(
        "DINO is read by its teacher (the EMA network DINO evaluates, and whose weights are the public DINO models "
        "Walmer analyses): every number of dino below, the table's included, is the teacher's "
        "(analysis/<part>/ of each dino run; the study's measures, computed by this report stage when absent).",
        "",
    )


# ------------------------------------------------------------------------------------------------ the objectives


def _result_json(run) -> dict:
    try:
        return json.loads((run.path / "result.json").read_text())
    except (OSError, ValueError):
        return {}


def throughput(run) -> tuple[float, str]:
    """Training images per second: the median of the trainer's ``train/throughput_img_s`` windows in the run's
    TensorBoard (time in callbacks, evaluation and checkpoints excluded), else steps x batch / the run's wall time."""
    tb = events_dir(run.path)
    if any(tb.glob("events.out.tfevents.*")):
        ea = EventAccumulator(str(tb), size_guidance={"scalars": 0})
        ea.Reload()
        if "train/throughput_img_s" in ea.Tags()["scalars"]:
            return float(np.median([e.value for e in ea.Scalars("train/throughput_img_s")])), "TensorBoard"
    res = _result_json(run)
    if res.get("wall_s"):
        return float(res["step"]) * run.recipe.train.batch_size / float(res["wall_s"]), "wall time"
    return float("nan"), "-"


def diagnoses(objective: str) -> bool:
    """Whether ``objective`` records a diagnosis at the end of a run (its Objective overrides ``summary``)."""
    return REGISTRY[objective].Objective.summary is not Objective.summary


def collapse_cell(runs: list[str], summaries: list[dict], diagnoses: bool | None = None) -> str:
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
                f"no ({name}: teacher entropy {s['teacher_entropy']:.2f} of log(out_dim) = {s['log_out_dim']:.2f} "
                f"nats, over the batch {s['teacher_marginal_entropy']:.2f}; largest prototype "
                f"{s['top_prototype_share']:.0%})"
            )
        else:
            cells.append(f"{name}: no diagnosis recorded (no result.json: the run has not finished)")
    return "; ".join(cells)


def _ratio(values, ref) -> float | None:
    vals, refs = [v for v in values if v is not None], [v for v in (ref or []) if v is not None]
    return float(np.mean(vals) / np.mean(refs)) if vals and refs and np.mean(refs) > 0 else None


def regime_note(rows: dict) -> str | None:
    """One paragraph when the objectives' k-NN order at the study budget differs from Walmer's Table 1: the claims
    about their features then compare the objectives at this budget, which the reader must know."""
    ours = {o: r["knn_vs_supervised"] for o, r in rows.items() if r.get("knn_vs_supervised") is not None}
    if len(ours) < 2 or not all(o in N.TABLE1_KNN_TOP1 for o in ours):
        return None
    order = sorted(ours, key=lambda o: -ours[o])
    paper = sorted(ours, key=lambda o: -N.TABLE1_KNN_TOP1[o])
    if order == paper:
        return None
    behind = [o for o in order if o != "supervised" and ours[o] < N.paper_share(o)]
    verb = "is" if len(behind) == 1 else "are"
    tail = (
        f", where {' and '.join(behind)} {verb} not yet what the paper measured (self-supervised objectives need "
        "many epochs)."
        if behind
        else "."
    )
    shares = "; ".join(
        f"{o} reaches {ours[o]:.2f} of supervised's k-NN top-1 here against {N.paper_share(o):.2f} there"
        for o in order
        if o != "supervised"
    )
    return (
        f"The k-NN order of the objectives at this budget is {' > '.join(order)}; in Walmer's Table 1 (ImageNet, "
        f"ViT-B/16, trained to the end) it is {' > '.join(paper)}. {shares}. The claims that compare the objectives' "
        f"features therefore compare them at this training budget{tail}"
    )


def _row(ctx, o: str, rs: list) -> dict:
    tp = [throughput(r) for r in rs]
    knn = [R.knn(ctx, r) for r in rs]
    objective = [r.recipe.train.objective for r in rs]
    summaries = [_result_json(r).get("objective") or {} for r in rs]
    return {
        "runs": [r.label for r in rs],
        "train_objective": objective,
        "img_s": [t for t, _ in tp],
        "img_s_source": sorted({s for _, s in tp}),
        "wall_s": [_result_json(r).get("wall_s") for r in rs],
        "eval_top1": [read_meta(r.checkpoints[max(r.checkpoints)]).get("eval", {}).get("top1") for r in rs],
        "eval_is_knn": [not REGISTRY[x].Objective.uses_labels for x in objective],
        "knn_top1_last_block_cls": [k["top1"] if k else None for k in knn],
        "knn_n": [k["n"] if k else None for k in knn],
        "collapsed": [s.get("collapsed") for s in summaries],
        "diagnosis": summaries,
    }


TABLE_HEAD = (
    "| objective | runs | img/s | relative to supervised | training wall (min) | eval top-1 (kind) | k-NN top-1, last "
    "block CLS (± binomial SE) | k-NN relative to supervised (Walmer Table 1; the regime needs) | collapse |"
)


def _table_line(o: str, r: dict, ref: float) -> str:
    ips = np.nanmean(r["img_s"])
    rel = ips / ref if np.isfinite(ref) and ref > 0 else float("nan")
    r["relative_img_s"] = rel
    wall = [w / 60 for w in r["wall_s"] if w]
    ev = [e for e in r["eval_top1"] if e is not None]
    kind = "k-NN monitor" if all(r["eval_is_knn"]) else "classifier" if not any(r["eval_is_knn"]) else "mixed"
    kn = [k for k in r["knn_top1_last_block_cls"] if k is not None]
    n = next((x for x in r["knn_n"] if x), 0)
    knn_cell = (
        f"{np.mean(kn):.4f} ± {N.binomial_se(float(np.mean(kn)), n):.4f} ({', '.join(f'{k:.4f}' for k in kn)})"
        if kn
        else "no k-NN result (no CLS token, or knn not measured)"
    )
    col = collapse_cell(r["runs"], r["diagnosis"], any(diagnoses(x) for x in r["train_objective"]))
    paper = N.paper_share(o) if o in N.TABLE1_KNN_TOP1 else None
    r["paper_knn_vs_supervised"] = paper
    vs = f"{r['knn_vs_supervised']:.2f}" if r["knn_vs_supervised"] is not None else "-"
    if paper is not None and o != "supervised":
        vs += f" ({paper:.2f}; {REGIME * paper:.2f})"
    ev_cell = f"{np.mean(ev):.4f} ({kind})" if ev else "-"
    return (
        f"| {o} | {', '.join(r['runs'])} | {ips:.0f} ({', '.join(f'{t:.0f}' for t in r['img_s'])}) | {rel:.2f} | "
        f"{np.mean(wall) if wall else float('nan'):.1f} | {ev_cell} | {knn_cell} | {vs} | {col} |"
    )


def objectives_section(ctx) -> None:
    """Per objective: throughput relative to supervised, the eval top-1 the trainer recorded, the k-NN top-1 of the
    analysis and its share of supervised's beside Walmer's (the regime precondition), collapse; notes."""
    objs = objectives(ctx)
    for o, rs in objs.items():
        got = sorted({r.recipe.train.objective for r in rs})
        if got != [o]:
            ctx.notes.append(
                f"Configuration {o} trains with train.objective {', '.join(got)}, not {o}: its claims compare what "
                "the runs are, under the configuration's name."
            )
    missing = [o for o in N.OBJECTIVES if o not in objs]
    if missing:
        ctx.notes.append(
            f"The study has no {', '.join(missing)} configuration: the claims that need it are not testable."
        )
    rows = {o: _row(ctx, o, rs) for o, rs in objs.items()}
    for r in rows.values():
        r["knn_vs_supervised"] = _ratio(
            r["knn_top1_last_block_cls"], rows.get("supervised", {}).get("knn_top1_last_block_cls")
        )
    ref = np.nanmean(rows["supervised"]["img_s"]) if "supervised" in rows else float("nan")
    ctx.doc.add(
        "## Objectives at the study budget",
        "",
        "Per objective (mean over seeds; every seed in brackets): training images per second (the median of the "
        "trainer's logged windows, time in evaluation, checkpoints and callbacks excluded) and relative to the "
        "supervised run; the eval top-1 the trainer recorded at the last checkpoint (the classifier's for an "
        "objective that uses labels, the k-NN monitor's on the eval split, k = 20, for one that does not); and the "
        "k-NN top-1 of the analysis on the last block's CLS token (bank: the probe-train split, queries: the "
        "analysis split), the same read-out for every objective, and as a share of supervised's beside Walmer's "
        f"(Table 1: ImageNet, ViT-B/16, FS {N.TABLE1_KNN_TOP1['supervised']}, DINO {N.TABLE1_KNN_TOP1['dino']}, "
        f"MAE {N.TABLE1_KNN_TOP1['mae']}) and the share the regime precondition of the claims needs. Throughputs "
        "compare only runs trained under the same conditions (the same --jobs, nothing else heavy on the machine).",
        "",
        TABLE_HEAD,
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    )
    for o, r in rows.items():
        ctx.doc.add(_table_line(o, r, ref))
    ctx.doc.add("")
    note = regime_note(rows)
    if note:
        ctx.doc.add(note, "")
    collapsed = [f"{n}: {c}" for r in rows.values() for n, c in zip(r["runs"], r["collapsed"]) if c]
    if collapsed:
        ctx.notes.append("Collapsed runs (their claims compare a collapsed model): " + "; ".join(collapsed) + ".")
    ctx.doc.data["objectives"] = rows


# ------------------------------------------------------------------------------------------------ controls


def controls_section(ctx) -> None:
    """The random-initialised network of each run's architecture and seed, and the raw pixels of each run's analysis
    images: k-NN and purity of the CLS token (controls.py); a table (mean over every run), and ``ctx.shared`` for the
    semantic claims: ``random_init`` and ``raw_pixels`` {objective: [per run]}, ``controls`` the table's means."""
    objs = {o: rs for o, rs in objectives(ctx).items() if all(R.has_cls(r) for r in rs)}
    if not objs:
        return
    init = {o: [K.random_init(r, ctx.study) for r in rs] for o, rs in objs.items()}
    pixels = {o: [K.raw_pixels(r, ctx.study) for r in rs] for o, rs in objs.items()}  # cached per analysis images
    ctx.shared["random_init"], ctx.shared["raw_pixels"] = init, pixels
    flat = [i for v in init.values() for i in v if i["knn"] is not None]
    px = [x for v in pixels.values() for x in v]
    chance = [k for rs in objs.values() for k in (R.knn(ctx, r) for r in rs) if k]
    pur = [p for rs in objs.values() for p in (R.purity(ctx, r) for r in rs) if p]
    if not flat:
        return
    ctx.shared["controls"] = {
        "init_knn": float(np.mean([i["knn"][-1] for i in flat])),
        "init_purity": float(np.mean([i["purity"][-1] for i in flat])),
        "pixels_knn": float(np.mean([x["knn"] for x in px])),
        "pixels_purity": float(np.mean([x["purity"] for x in px])),
        "chance_knn": float(np.mean([k["baseline"] for k in chance])) if chance else float("nan"),
        "chance_purity": float(np.mean([p["baseline"] for p in pur])) if pur else float("nan"),
    }
    c = ctx.shared["controls"]
    ctx.doc.add(
        "## Controls of the semantic claims",
        "",
        "What the k-NN and the clustering of the CLS token give without learned features (last block; the same bank, "
        "queries, k and k-means as the measures; mean over the runs, each on its own analysis images): Walmer's random "
        "chance (Gaussian features of the same shape, App. B.3), a random-initialised network of the same "
        "architecture (each run's recipe built under its seed: what the architecture alone gives), and the raw pixels "
        "(the flattened normalised images: what the input alone gives). A claim that features are semantic is tested "
        "against the strongest of them.",
        "",
        "| baseline | k-NN top-1 | cluster purity |",
        "| --- | --- | --- |",
        f"| Gaussian features (Walmer's chance) | {c['chance_knn']:.4f} | {c['chance_purity']:.4f} |",
        f"| random-initialised network | {c['init_knn']:.4f} | {c['init_purity']:.4f} |",
        f"| raw pixels | {c['pixels_knn']:.4f} | {c['pixels_purity']:.4f} |",
        "",
    )
    ctx.doc.data["controls"] = {"random_init": init, "raw_pixels": pixels, "means": c}


# ------------------------------------------------------------------------------------------------ figures


def _curves(
    ax, curves: dict[str, list], ylabel: str, title: str, baseline: dict | None = None, ylim=None, levels=None
) -> None:
    """One line per objective (mean over seeds, markers) with each seed thin; ``baseline`` {name: [seed curves]}
    grey, dotted / dashed / dash-dotted (random features, a random-initialised network); ``levels`` {label: value}
    black horizontal reference lines of one number, dashed (the raw pixels, which have no blocks)."""
    for o, cs in curves.items():
        cs = [np.asarray(c, dtype=float) for c in cs]
        x = np.arange(len(cs[0]))
        for c in cs:
            ax.plot(x, c, color=COLORS.get(o), lw=0.6, alpha=0.5)
        ax.plot(x, np.mean(cs, 0), color=COLORS.get(o), marker="o", ms=3, label=o)
    for j, (name, cs) in enumerate((baseline or {}).items()):
        if cs:
            ax.plot(np.arange(len(cs[0])), np.mean(cs, 0), color="grey", ls=(":", "--", "-.")[j % 3], lw=1, label=name)
    for name, v in (levels or {}).items():
        if v is not None and np.isfinite(v):
            ax.axhline(v, color="k", ls="--", lw=1, label=name)
    ax.set_xticks(range(max(len(cs[0]) for cs in curves.values())))
    ax.set_xlabel(BLOCK_AXIS)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=9)
    if ylim is not None:
        ax.set_ylim(*ylim)
    ax.legend(fontsize=6)


def _attention_figure(dist: dict[str, list], path=None, uniform: float | None = None):
    """Walmer Fig. 4: every head's attention distance by block per objective (left), the per-block means (right);
    ``uniform``: uniform attention's mean distance on the same grid and unit, the reference line of both panels (a
    head near it is global), whose axis starts at 0. Saved to ``path`` when given; returns the figure."""
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
    a.set_xlabel(BLOCK_AXIS)
    a.set_ylabel("attention distance (unit square)")
    a.set_title("every head (o seed 0, x other seeds)", fontsize=9)
    a.legend(fontsize=6)
    mean = {o: [N.head_mean(d) for d in ds] for o, ds in dist.items()}
    _curves(b, mean, "attention distance (unit square)", "mean over heads")
    top = max([float(np.nanmax(np.asarray(d))) for ds in dist.values() for d in ds] + [uniform or 0.0])
    for ax in (a, b):
        uniform_line(ax, uniform, "")
        ax.set_ylim(0, 1.08 * top)
        ax.legend(fontsize=6)
    fig.suptitle("Average attention distance by block and objective (cf. Walmer Fig. 4)", fontsize=10)
    fig.tight_layout()
    if path is not None:
        save(fig, path)
    return fig


def _panels_figure(panels: dict[str, tuple], title: str, path=None):
    """Side by side line panels: {panel title: (curves, ylabel, baseline or None, ylim or None[, levels])}; saved to
    ``path`` when given; returns the figure."""
    fig, axes = subplots(1, len(panels), figsize=(5 * len(panels), 3.6), squeeze=False)
    for ax, (name, (curves, ylabel, base, ylim, *levels)) in zip(axes[0], panels.items()):
        _curves(ax, curves, ylabel, name, base, ylim, *levels)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    if path is not None:
        save(fig, path)
    return fig


def _cka_last_figure(mats: dict[str, np.ndarray], names: list[str], path=None):
    """Walmer Fig. 6: last-block CKA between the objectives' models (mean over seeds), a heatmap per representation;
    on the diagonal the cross-seed ceiling (two seeds of one objective, mean over seed pairs; "-" where not measured),
    the reference each row's off-diagonal cells are read against. Saved to ``path`` when given; returns the figure."""
    fig, axes = subplots(1, len(mats), figsize=(3.6 * len(mats) + 0.8, 3.5), squeeze=False, layout="constrained")
    im = None
    for ax, (title, m) in zip(axes[0], mats.items()):
        im = ax.imshow(m, vmin=0, vmax=1, cmap="magma")
        ax.set_xlabel("objective", fontsize=8)
        ax.set_ylabel("objective", fontsize=8)
        ax.set_xticks(range(len(names)), names, fontsize=7)
        ax.set_yticks(range(len(names)), names, fontsize=7)
        for i, j in np.ndindex(m.shape):
            if np.isfinite(m[i, j]):
                color = "black" if m[i, j] > 0.5 else "white"
                cell = f"{m[i, j]:.2f}" + ("\nseeds" if i == j else "")
                ax.text(j, i, cell, ha="center", va="center", fontsize=7, color=color)
            elif i == j:
                ax.text(j, i, "-", ha="center", va="center", fontsize=7, color="grey")
        ax.set_title(title, fontsize=9)
    if im is not None:
        fig.colorbar(im, ax=axes[0].tolist(), shrink=0.8).set_label("CKA (mean over seeds)")
    fig.suptitle(
        "Last-block CKA between objectives; diagonal: two seeds of one objective (cf. Walmer Fig. 6)", fontsize=10
    )
    if path is not None:
        save(fig, path)
    return fig


def cka_matrix(names: list[str], cross: dict, ceiling: dict) -> np.ndarray:
    """[objectives x objectives] mean CKA: off the diagonal ``cross`` {(a, b): per seed pair}, on it ``ceiling``
    {objective: per pair of its seeds} (NaN where not measured)."""
    m = np.full((len(names), len(names)), np.nan)
    for (a, b), v in cross.items():
        m[names.index(a), names.index(b)] = m[names.index(b), names.index(a)] = np.mean(v) if len(v) else np.nan
    for o, v in ceiling.items():
        m[names.index(o), names.index(o)] = np.mean(v) if len(v) else np.nan
    return m


def _ceilings(objs: dict, fn) -> tuple[dict, list[str]]:
    """{objective: fn(its runs)} where the seeds can be compared, and why not elsewhere (AnalysisError sentences)."""
    out, why = {}, []
    for o, rs in objs.items():
        try:
            out[o] = fn(rs)
        except RF0.AnalysisError as e:
            why.append(f"{o}: {e}")
    return out, why


def _per(ctx, fn) -> dict:
    return {o: [v for v in (fn(ctx, r) for r in rs) if v is not None] for o, rs in objectives(ctx).items()}


def attention_figures(ctx, root) -> None:
    dist = {o: v for o, v in _per(ctx, R.distances).items() if v}
    if dist:
        uniform = next(
            (u for rs in objectives(ctx).values() for u in (R.uniform_distance(ctx, r) for r in rs) if u), None
        )
        _attention_figure(dist, root / "attention_distance.png", uniform)
        ctx.doc.figure(
            root / "attention_distance.png",
            "attention_distance",
            "Average attention distance (token grid on a unit square) of every head by block and objective, and the "
            "per-block mean (cf. Walmer Fig. 4); dotted: uniform attention's mean distance on the same grid"
            + (f" ({uniform:.3f})" if uniform else ""),
        )
    cls_att = {o: v for o, v in _per(ctx, lambda c, r: c.last(r, "cls_attention")).items() if v}
    if cls_att:
        mx = next(float(a["max_entropy"]) for v in cls_att.values() for a in v)
        _panels_figure(
            {
                "entropy of the average CLS map": (
                    {o: [N.head_mean(a["map_entropy"]) for a in v] for o, v in cls_att.items()},
                    "nats (mean over heads)",
                    None,
                    (0, mx * 1.05),
                ),
                "per-image CLS attention entropy": (
                    {o: [N.head_mean(a["entropy"]) for a in v] for o, v in cls_att.items()},
                    "nats (mean over heads)",
                    None,
                    (0, mx * 1.05),
                ),
            },
            f"CLS attention entropy by block and objective (uniform attention: {mx:.2f} nats)",
            root / "cls_entropy.png",
        )
        ctx.doc.figure(
            root / "cls_entropy.png",
            "cls_entropy",
            "Entropy of the CLS token's attention over the spatial tokens by block: of the map averaged over images "
            "(left) and per image (right), mean over heads; thin lines: seeds",
        )


def semantic_panels(knn: dict, pur: dict, init: list, pixels: list) -> dict:
    """The panels of the semantic figure: per objective the k-NN top-1 and the purity curves of the CLS token, grey
    the Gaussian features' and the random-initialised network's curves, and a dashed line at the raw pixels' read-out
    (mean over runs; one number, no blocks), labelled with it -- every baseline the semantic claims are tested
    against."""
    base_k = {
        "Gaussian features": [k["baseline_curve"] for v in knn.values() for k in v],
        "random-init network": [i["knn"] for i in init],
    }
    base_p = {
        "Gaussian features": [p["baseline_curve"] for v in pur.values() for p in v],
        "random-init network": [i["purity"] for i in init],
    }
    px_k = float(np.mean([x["knn"] for x in pixels])) if pixels else None
    px_p = float(np.mean([x["purity"] for x in pixels])) if pixels else None
    panels = {}
    if knn:
        panels["k-NN top-1 (k = 20), CLS token"] = (
            {o: [k["curve"] for k in v] for o, v in knn.items()},
            "top-1",
            base_k,
            (0, 1),
            {f"raw pixels ({px_k:.3f})": px_k} if px_k is not None else {},
        )
    if pur:
        panels["k-means cluster purity, CLS token"] = (
            {o: [p["curve"] for p in v] for o, v in pur.items()},
            "purity",
            base_p,
            (0, 1),
            {f"raw pixels ({px_p:.3f})": px_p} if px_p is not None else {},
        )
    return panels


def semantic_figure(ctx, root) -> None:
    knn, pur = {o: v for o, v in _per(ctx, R.knn).items() if v}, {o: v for o, v in _per(ctx, R.purity).items() if v}
    if not knn and not pur:
        return
    init = [i for v in ctx.shared.get("random_init", {}).values() for i in v if i and i["knn"] is not None]
    pixels = [x for v in ctx.shared.get("raw_pixels", {}).values() for x in v if x]
    _panels_figure(
        semantic_panels(knn, pur, init, pixels),
        "Global semantics of the CLS token by block and objective (cf. Walmer Fig. 9 left, Fig. 7 left)",
        root / "semantic.png",
    )
    ctx.doc.figure(
        root / "semantic.png",
        "semantic",
        "k-NN top-1 (left) and cluster purity (right) of the CLS token at every block's output; grey: the same "
        "read-out on random Gaussian features (dotted) and of a random-initialised network (dashed); black dashed: "
        "the raw pixels (one number, labelled) (cf. Walmer Fig. 9 left, Fig. 7 left)",
    )


def cka_figures(ctx, root) -> None:
    """Cross-model CKA of the same block's output by depth (features; Walmer compares features at the last layer
    only, Fig. 6) and the last block's CKA between objectives (all tokens; the CLS heatmap is drawn when the CLS
    claim has computed it); the residual figure (Fig. 23)."""
    objs = objectives(ctx)
    names = list(objs)
    same, last_all = {}, {}
    for a, b in ((a, b) for i, a in enumerate(names) for b in names[i + 1 :]):
        curves = [R.cross_same_index(ra, rb, ctx.opts) for ra, rb in zip(objs[a], objs[b])]
        curves = [c for c in curves if c is not None]
        if curves:
            same[f"{a} vs {b}"] = curves
            last_all[(a, b)] = [float(c[-1]) for c in curves]
    if same:
        _panels_figure(
            {"same block, two objectives": (same, "CKA", None, (0, 1.02))},
            "Cross-model CKA of the same block's output by depth",
            root / "cka_depth.png",
        )
        ctx.doc.figure(
            root / "cka_depth.png",
            "cka_depth",
            "Linear CKA between the same block's outputs of two models taught differently (same seed), by block; thin "
            "lines: seeds. Walmer compares features at the last layer only (Fig. 6); the attention claim (Fig. 2) is "
            "tested on the CLS attention maps",
        )
        ctx.doc.add(
            *[
                f"Last-block CKA (all tokens) {a} vs {b}: {', '.join(f'{x:.3f}' for x in v)} by seed."
                for (a, b), v in last_all.items()
            ],
            "",
        )
    cls, cls_ceiling, why = {}, {}, []
    if all(R.has_cls(r) for rs in objs.values() for r in rs):
        for a, b in ((a, b) for i, a in enumerate(names) for b in names[i + 1 :]):
            cls[(a, b)] = [R.cls_cka(ra, rb, ctx.study) for ra, rb in zip(objs[a], objs[b])]
        cls_ceiling, why = _ceilings(objs, lambda rs: R.cls_ceiling(rs, ctx.study))
    all_ceiling, why_all = _ceilings(objs, lambda rs: R.all_tokens_ceiling(rs, ctx.opts)) if last_all else ({}, [])
    mats = {}
    for title, vals, ceil in (
        ("CLS token", cls, cls_ceiling),
        ("all tokens (study's CKA representation)", last_all, all_ceiling),
    ):
        if vals:
            mats[title] = cka_matrix(names, vals, ceil)
    if mats:
        _cka_last_figure(mats, names, root / "cka_last.png")  # shown under the CLS claim
        seeds_ceil = ", ".join(f"{o} {np.mean(v):.3f}" for o, v in all_ceiling.items() if len(v))
        said = (
            f"Cross-seed ceiling of the last-block CKA (all tokens; two seeds of one objective, both read on the "
            f"earlier seed's images): {seeds_ceil}."
        )
        # the CLS token's ceiling is quoted by the claim that reads it (cls_similar_by_supervision), not here
        ctx.doc.add(
            *([said] if seeds_ceil else []), *[f"No cross-seed ceiling for {w}" for w in sorted(set(why + why_all))]
        )
        ctx.doc.add("")
    skip = {o: v for o, v in _per(ctx, R.attn_skip).items() if v}
    if skip:
        _panels_figure(
            {"attention sublayer: CKA(z, f(z)) in the same block": (skip, "CKA", None, (0, 1.02))},
            "Skip path vs branch by block and objective (cf. Walmer Fig. 23, its diagonal)",
            root / "residual.png",
        )  # shown under the residual claim


def figures_section(ctx) -> None:
    """The figures several claims read (attention distance, CLS entropy, semantics) and the cross-model CKA by depth,
    which no claim tests; also draws the figures single claims show (last-block CKA, residual)."""
    root = ctx.study.root / "walmer"
    root.mkdir(parents=True, exist_ok=True)
    ctx.doc.add("## Figures", "")
    attention_figures(ctx, root)
    semantic_figure(ctx, root)
    cka_figures(ctx, root)


SECTIONS = (teacher_section, objectives_section, controls_section, figures_section)
