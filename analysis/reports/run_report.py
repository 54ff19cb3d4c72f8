"""``report.md``: a run (or a comparison) at a glance — what was trained, a table of every checkpoint's headline
numbers, then each checkpoint's key numbers and its captioned figures, how the numbers moved across checkpoints, the
cross-run results, and an appendix with the per-layer lists too long for a table row. Written from what is on disk
(summary.json, npz, PNG), so it can be regenerated at any time without recomputing anything.

One convention, said once in the report: blocks are numbered from 0 (as in the figures, the TensorBoard tags and the
tables), numbers are rounded to 3 significant digits, accuracies are fractions of images and distances pixels."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np

from analysis.engine.figures import save, subplots
from analysis.engine.measure import as_list, load_result
from analysis.measures.similarity import cross_line
from analysis.results import storage
from analysis.sources.images import BUNDLED
from train.checkpoint import CheckpointError, read_meta


def _rel(path: Path, base: Path) -> str:
    return path.resolve().relative_to(base.resolve()).as_posix()


def sig(v, digits: int = 3) -> str:
    """Numbers for the summary table: floats to ``digits`` significant digits (never in e-notation), lists joined."""
    if isinstance(v, (list, tuple, np.ndarray)):
        return " ".join(sig(x, digits) for x in np.asarray(v).reshape(-1).tolist())
    if isinstance(v, (float, np.floating)) and np.isfinite(v):
        return np.format_float_positional(float(v), precision=digits, unique=False, fractional=False, trim="-")
    return str(v)


def rounded(x, digits: int = 3):
    """``x`` (nested dicts and lists) with every float rounded to ``digits`` significant digits, for JSON shown to a
    reader (the files keep every digit)."""
    if isinstance(x, dict):
        return {k: rounded(v, digits) for k, v in x.items()}
    if isinstance(x, (list, tuple, np.ndarray)):
        return [rounded(v, digits) for v in (x.tolist() if isinstance(x, np.ndarray) else x)]
    if isinstance(x, (float, np.floating)) and np.isfinite(x):
        return float(sig(x, digits))
    return x


APPENDIX_HEAD = ("| measure | key (shape) | values, from block 0 |", "| --- | --- | --- |")
LONG = 8  # a list of more numbers than this goes to the report's appendix (every digit: the step's .npz)

CONVENTIONS = (
    "Blocks are numbered from 0 (block 0 is the first) here, in the figures and in the TensorBoard tags; a list per "
    "layer starts at block 0. Numbers are rounded to 3 significant digits (every digit: `summary.json` and the `.npz` "
    "files in `analysis/step_*/`); top-1, probe and k-NN accuracies are fractions of images, distances are pixels of "
    "the input, losses nats."
)


def _split_summary(summary: dict) -> tuple[list[str], list[str]]:
    """(key-number rows, appendix rows) of a step's summary: one row per number or short list of each measure's
    summary, nested keys (clustering's metric/pool/statistic) joined by /; lists longer than :data:`LONG` go to the
    appendix rows, a pointer left in their place."""
    head = "| measure | key | value (per layer from block 0 where a list) |"
    rows, long_rows = [head, "| --- | --- | --- |"], []

    def add(name: str, key: str, v) -> None:
        if isinstance(v, dict):
            for k, v2 in v.items():
                add(name, f"{key}/{k}" if key else str(k), v2)
            return
        n = np.asarray(v).size if isinstance(v, (list, tuple, np.ndarray)) else 1
        shape = np.asarray(v).shape if n > 1 else ()
        if n > LONG:
            dims = " x ".join(map(str, shape))
            try:
                brief = _brief(np.asarray(v, dtype=float))
            except (TypeError, ValueError):  # a list of names (layers, targets): its first and last
                flat = [str(x) for x in np.asarray(v).reshape(-1)]
                brief = f"{flat[0]} ... {flat[-1]}"
            rows.append(f"| {name} | {key} | {brief}; all {dims}: appendix |")
            long_rows.append(f"| {name} | {key} ({dims}) | {sig(v)} |")
        else:
            rows.append(f"| {name} | {key} | {sig(v)} |")

    for name, s in summary.items():
        if name not in ("meta", "step") and isinstance(s, dict):
            add(name, "", s)
    return rows, long_rows


def _brief(a: np.ndarray) -> str:
    """A long list in a few numbers: a per-layer list's first (block 0's), mean and last; a table's (blocks x heads)
    range."""
    f = a[np.isfinite(a)]
    if not f.size:
        return "no finite value"
    if a.ndim == 1:
        return f"first {sig(a[0])}, mean {sig(f.mean())}, last {sig(a[-1])}"
    return f"min {sig(f.min())}, mean {sig(f.mean())}, max {sig(f.max())}"


def _summary_rows(summary: dict) -> list[str]:
    """The key-number rows of :func:`_split_summary` (long lists replaced by a pointer to the appendix)."""
    return _split_summary(summary)[0]


CAPTIONS = [  # (file-name pattern, what the figure shows): one line under each figure of a report
    (r"evolution", "Eval top-1, mean off-diagonal CKA and the last block's probe top-1 against the training step."),
    (r"cka_self", "CKA between every pair of layers (1 = the same representation up to rotation and scale)."),
    (
        r"norm_ratio_lines",
        "Norm ratio ||z|| / ||f(z)|| (skip path over branch) per block, CLS token and mean of the "
        "spatial tokens; above 1 the skip path dominates (Raghu Fig. 7 right).",
    ),
    (
        r"norm_ratio_",
        "Norm ratio ||z|| / ||f(z)|| per token and block, log colour; only the first tokens are drawn, "
        "as the token axis says (Raghu Fig. 7 left).",
    ),
    (
        r"attn_dist_heads_pixel_level",
        "Mean attention distance per head, pixel to pixel (ViT App. D.6), with uniform attention's distance dotted.",
    ),
    (
        r"attn_dist_heads",
        "Mean attention distance per head and block (ViT Fig. 7, Raghu Fig. 3); dotted: uniform "
        "attention over the token grid.",
    ),
    (
        r"probe_\d+shot",
        "Few-shot linear probe top-1 per layer for each pooling, random features as baseline, chance "
        "dotted (Raghu Fig. 11 right, 13).",
    ),
    (r"ablation_heads", "Read-out drop when one head is mean-ablated at test time, per block and head."),
    (
        r"ablation_sublayers",
        "Read-out drop per block when a branch, skip path or token path is removed at test time "
        "(left), and the last block's CKA to the unablated model (right).",
    ),
    (
        r"ablation_skip_cka",
        "CKA of every block's output to the unablated model after one block's skip path is removed.",
    ),
    (
        r"aligned_attention_mass_maps",
        "Aligned aggregated attention maps (Walmer §4.2): the share of each head's "
        "attention at each query-key offset; red frame: an offset local head.",
    ),
    (
        r"aligned_attention_maps",
        "Per offset, the mean attention over the queries that have that offset (uniform "
        "attention is flat here); red frame: an offset local head.",
    ),
    (
        r"cls_attention_maps",
        "The CLS token's attention over the patches, averaged over images, per block and head (Walmer Fig. 2).",
    ),
    (
        r"clustering",
        "Clustering of pooled features against the labels per layer, Gaussian features dashed (Walmer Fig. 9).",
    ),
    (r"knn", "k-NN top-1 per layer for each pooling, Gaussian features dashed (Walmer Fig. 7)."),
    (
        r"erf_maps",
        "Effective receptive field of the centre location per block, each map scaled to its maximum (Raghu Fig. 6).",
    ),
    (
        r"erf_concentration",
        "Share of the receptive field's mass in the centre location's own window and radius, per block.",
    ),
    (
        r"localization_score",
        "Share of tokens most similar (CKA) to their own input patch, and the CKA contrast, per "
        "layer; chance dotted (Raghu Fig. 9, 10).",
    ),
    (
        r"localization_",
        "CKA of a few tokens with every input patch at this layer; cyan: the token's own patch (Raghu Fig. 9, 10).",
    ),
    (
        r"residual_cka_lines",
        "CKA of the skip path with the branch and with the block's output, per block (Walmer App. D.4).",
    ),
    (r"residual_cka_", "CKA between the skip input of one block and the branch of another."),
    (
        r"token_norms_histogram",
        "Histogram of the patch tokens' output norms per block, outlier cut dashed (Darcet et al. 2024 Fig. 3).",
    ),
    (
        r"token_norms_outlier_map",
        "Where the high-norm outlier tokens are: the share of images with an outlier at each grid position, per block.",
    ),
    (r"token_probes_heatmap", "Few-shot probe top-1 of single tokens, per token and layer (Raghu Fig. D.4)."),
    (
        r"token_probes_maps",
        "Few-shot probe top-1 of single tokens at their grid positions, per layer (Raghu Fig. D.4).",
    ),
    (
        r"token_probes_mean",
        "Single-token probe top-1 averaged over the spatial tokens, and the CLS token's, per layer "
        "(Raghu Fig. 11 left).",
    ),
    (
        r"similarity_map",
        "A similarity estimator between every pair of layers: raw (left) and calibrated against its permutation "
        "null, (score - null mean) / null SD (right), dots where significant with family-wise error control.",
    ),
    (r"cross_cka", "CKA between every layer of this run and every layer of the other run (Raghu Fig. 2)."),
    (r"same_index", "CKA of each layer with the other run's layer of the same index (Raghu Fig. 12)."),
    (
        r"head_subsets",
        "CKA of subsets of heads, ordered by attention distance, with the other run's layers (Raghu Fig. 5).",
    ),
]


def caption(stem: str) -> str:
    """The one-line caption of a figure file (by its name); the file name when no caption matches."""
    for pattern, text in CAPTIONS:
        if re.match(pattern, stem):
            return text
    return stem.replace("_", " ") + "."


def _images(fig_dir: Path, base: Path) -> list[str]:
    """Every figure in ``fig_dir``, each followed by its caption in italics."""
    out = []
    for p in sorted(fig_dir.glob("*.png")) if fig_dir.is_dir() else []:
        out += [f"![{p.stem}]({_rel(p, base)})", "", f"*{caption(p.stem)}*", ""]
    return out


def _glance(base: Path, steps: list[int], evals: dict) -> list[str]:
    """One row per checkpoint (newest first): eval top-1 and the headline number of each core measure."""
    rows = [
        "| step | eval top-1 | CKA mean off-diagonal | probe top-1, last block | mean attention distance, all blocks "
        "(px) |",
        "| --- | --- | --- | --- | --- |",
    ]
    for s in sorted(set(steps) | set(evals), reverse=True):
        summ = storage.read_summary(storage.step_dir(base, s)) or {}
        cka = (summ.get("cka") or {}).get("mean_offdiag")
        probe = summ.get("fewshot_probe") or {}
        pool = next((p for p in ("cls", "mean_spatial", "mean") if isinstance(probe.get(p), list) and probe[p]), None)
        ad = (summ.get("attention_distance") or {}).get("mean_px")
        cells = [
            sig(evals[s]) if s in evals else "n/a",
            sig(cka) if cka is not None else "n/a",
            f"{sig(probe[pool][-1])} ({pool})" if pool else "n/a",
            sig(float(np.mean(ad))) if ad else "n/a",
        ]
        rows.append(f"| {s} | " + " | ".join(cells) + " |")
    return rows


def evolution(run_path: Path, steps: list[int], evals: dict) -> Path | None:
    """figures/evolution.png: eval top-1, mean off-diagonal CKA and the last block's probe accuracy vs step."""
    series: dict[str, list] = {}
    for s in steps:
        summ = storage.read_summary(storage.step_dir(run_path, s)) or {}
        if s in evals:
            series.setdefault("eval top-1", []).append((s, evals[s]))
        if isinstance(summ.get("cka"), dict) and "mean_offdiag" in summ["cka"]:
            series.setdefault("CKA mean off-diagonal", []).append((s, summ["cka"]["mean_offdiag"]))
        probe = summ.get("fewshot_probe")
        for pool, v in probe.items() if isinstance(probe, dict) else []:
            if isinstance(v, list) and v:
                series.setdefault(f"probe {pool}, last block", []).append((s, v[-1]))
    if not series or max(len(v) for v in series.values()) < 2:
        return None
    fig, ax = subplots(figsize=(5, 3.4))
    for name, pts in series.items():
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", ms=3, label=name)
    ax.set_xlabel("training step")
    ax.set_ylabel("top-1 or CKA (fraction)")
    ax.set_ylim(0, 1.02)
    ax.legend(fontsize=7)
    ax.set_title("across checkpoints")
    fig.tight_layout()
    out = run_path / "figures" / "evolution.png"
    out.parent.mkdir(parents=True, exist_ok=True)
    save(fig, out)
    return out


def external_heading(run) -> str:
    """What a model from elsewhere is, for the heading of its one result (its "step 0" is the weights it was given,
    not a training step): architecture, where the weights came from, and the images."""
    e = run.external
    w = e["weights"]
    if w is None:  # a transformers folder or hub name carries its own weights
        weights = "its own weights"
    else:
        weights = "timm's pretrained weights" if w == "pretrained" else f"weights {Path(w).name}"
    images = e.get("images")
    if images == BUNDLED:
        on = "the bundled photos"
    elif images:
        on = f"the images in {images}"
    else:
        on = f"the {run.recipe.data.source} analysis images of its recipe"
    return f"{e['arch']}, {weights}, on {on}"


def _evals(run) -> dict[int, float]:
    """{step: eval top-1} of a trained run's checkpoints (none for a model from elsewhere)."""
    evals = {}
    for s, c in run.checkpoints.items():
        if run.external is None:
            try:
                top1 = read_meta(c).get("eval", {}).get("top1")
            except CheckpointError:  # deleted since the run was opened (a trainer still running prunes old ones)
                continue
            if top1 is not None:
                evals[s] = float(top1)
    return evals


def _header(run) -> list[str]:
    """What the model is: a model from elsewhere's architecture, weights and images; a run's recipe in brief."""
    r = run.recipe
    if run.external:
        src = (
            run._data.meta.get("source") if run.external.get("images") and run._data is not None else None
        ) or f"`{r.data.source}` data"
        w = run.external["weights"]
        with_w = f" with weights `{w}`" if w else ""
        return [f"Model `{run.external['arch']}`{with_w}, analysed on {src}.", ""]
    m = r.model
    desc = f"{m.arch}" + (
        f", {m.depth} blocks x {m.embed_dim}, {m.num_heads} heads, patch {m.patch_size}, head {m.head}"
        if m.arch != "resnet"
        else f", layers {m.resnet_layers}, channels {m.resnet_channels}"
    )
    iv = {k: v for k, v in r.to_dict().get("interventions", {}).items() if v}
    return [
        f"- model: {desc}",
        f"- data: {r.data.source}, {r.train.steps} steps x batch {r.train.batch_size}, lr {r.train.lr}",
        f"- interventions: {json.dumps(iv) if iv else 'none'}",
        "",
    ]


def _against(base: Path) -> tuple[list[str], list[str]]:
    """(the section on the cross-run results under analysis/against/, their long lists for the appendix)."""
    against_root = base / "analysis" / "against"
    if not against_root.is_dir():
        return [], []
    lines, appendix = ["## Against other runs", ""], []
    for other in sorted(p for p in against_root.iterdir() if p.is_dir()):
        for sd in sorted(p for p in other.iterdir() if (p / "cross_cka.npz").is_file()):
            res = load_result(sd / "cross_cka.npz")
            heading = f"step {int(sd.name.split('_')[1])} vs {other.name}"
            lines += [f"### {heading}", "", f"- mean CKA over all layer pairs: {sig(np.asarray(res['matrix']).mean())}"]
            if "same_index" in res:
                same, labels = np.asarray(res["same_index"]), ", ".join(as_list(res["labels_a"]))
                if same.size > LONG:
                    lines.append(f"- CKA of same-index layers: {same.size} numbers, in the appendix")
                    appendix += [f"### {heading}", "", f"CKA of same-index layers ({labels}): {sig(same)}", ""]
                else:
                    lines.append(f"- CKA of same-index layers ({labels}): {sig(same)}")
            if (sd / "similarity.npz").is_file():
                lines.append(f"- {cross_line(load_result(sd / 'similarity.npz'))}")
            lines += ["", *_images(base / "figures" / "against" / other.name / sd.name, base), ""]
    return lines, appendix


def write_run_report(run) -> Path:
    """runs/<name>/report.md from the run's saved analyses (every step with a summary.json): the model, the
    conventions, every checkpoint's headline numbers, then per checkpoint its key numbers and captioned figures, the
    cross-run results, and an appendix with the long per-layer lists."""
    base = run.path
    steps = sorted(
        int(p.name.split("_")[1]) for p in (base / "analysis").glob("step_*") if storage.read_summary(p) is not None
    )
    evals = _evals(run)
    lines = [f"# {run.name}", "", *_header(run), CONVENTIONS, ""]
    if not run.external:
        lines += ["## Checkpoints at a glance", "", *_glance(base, steps, evals), ""]
    ev = evolution(base, steps, evals)
    if ev is not None:
        lines += ["## Across checkpoints", "", f"![evolution]({_rel(ev, base)})", "", f"*{caption('evolution')}*", ""]
    appendix = []
    for s in reversed(steps):
        summ = storage.read_summary(storage.step_dir(base, s)) or {}
        heading = external_heading(run) if run.external else f"Step {s}"
        rows, long_rows = _split_summary(summ)
        lines += [f"## {heading}", "", "Key numbers:", "", *rows, ""]
        figs = _images(storage.step_dir(base, s, "figures"), base)
        if figs:
            lines += ["Figures:", "", *figs]
        if long_rows:
            appendix += [f"### {heading}", "", *APPENDIX_HEAD]
            appendix += [*long_rows, ""]
    against, more = _against(base)
    lines += against
    appendix += more
    if appendix:
        lines += [
            "## Appendix: per-layer numbers",
            "",
            f"The lists of more than {LONG} numbers, rounded (every digit: the step's `summary.json` and `.npz`).",
            "",
            *appendix,
        ]
    out = base / "report.md"
    storage.atomic_text(out, "\n".join(lines) + "\n")
    return out


def check_report(path: Path) -> list[str]:
    """Images referenced by a report.md that do not exist (empty when the report is whole)."""
    path = Path(path)
    return [m for m in re.findall(r"!\[[^\]]*\]\(([^)]+)\)", path.read_text()) if not (path.parent / m).is_file()]
