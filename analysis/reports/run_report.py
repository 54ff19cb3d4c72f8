"""``report.md``: a run (or a comparison) at a glance — what was trained, each checkpoint's key numbers and its
figures, how the numbers moved across checkpoints, and the cross-run results. Written from what is on disk
(summary.json, npz, PNG), so it can be regenerated at any time without recomputing anything."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np

from analysis.engine.figures import save, subplots
from analysis.engine.measure import as_list, load_result
from analysis.results import storage
from analysis.sources.images import BUNDLED
from train.checkpoint import CheckpointError, read_meta


def fmt(v, digits: int = 3) -> str:
    """Numbers for tables: floats rounded, lists of floats joined."""
    if isinstance(v, (list, tuple, np.ndarray)):
        v = list(np.asarray(v).reshape(-1))
        return " ".join(fmt(x, digits) for x in v)
    if isinstance(v, (float, np.floating)):
        return f"{float(v):.{digits}f}"
    return str(v)


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


def _summary_rows(summary: dict) -> list[str]:
    """One row per number of each measure's summary; nested keys (clustering's metric/pool/statistic) joined by /."""
    rows = ["| measure | key | value (per layer where a list) |", "| --- | --- | --- |"]

    def add(name: str, key: str, v) -> None:
        if isinstance(v, dict):
            for k, v2 in v.items():
                add(name, f"{key}/{k}" if key else str(k), v2)
        else:
            rows.append(f"| {name} | {key} | {sig(v)} |")

    for name, s in summary.items():
        if name not in ("meta", "step") and isinstance(s, dict):
            add(name, "", s)
    return rows


def _images(fig_dir: Path, base: Path) -> list[str]:
    return [f"![{p.stem}]({_rel(p, base)})" for p in sorted(fig_dir.glob("*.png"))] if fig_dir.is_dir() else []


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
    ax.set_xlabel("step")
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


def write_run_report(run) -> Path:
    """runs/<name>/report.md from the run's saved analyses (every step with a summary.json)."""
    base = run.path
    steps = sorted(
        int(p.name.split("_")[1]) for p in (base / "analysis").glob("step_*") if storage.read_summary(p) is not None
    )
    evals = {}
    for s, c in run.checkpoints.items():
        if run.external is None:
            try:
                top1 = read_meta(c).get("eval", {}).get("top1")
            except CheckpointError:  # deleted since the run was opened (a trainer still running prunes old ones)
                continue
            if top1 is not None:
                evals[s] = float(top1)
    r = run.recipe
    lines = [f"# {run.name}", ""]
    if run.external:
        src = (
            run._data.meta.get("source") if run.external.get("images") and run._data is not None else None
        ) or f"`{r.data.source}` data"
        w = run.external["weights"]
        with_w = f" with weights `{w}`" if w else ""
        lines += [f"Model `{run.external['arch']}`{with_w}, analysed on {src}.", ""]
    else:
        m = r.model
        desc = f"{m.arch}" + (
            f", {m.depth} blocks x {m.embed_dim}, {m.num_heads} heads, patch {m.patch_size}, head {m.head}"
            if m.arch != "resnet"
            else f", layers {m.resnet_layers}, channels {m.resnet_channels}"
        )
        iv = {k: v for k, v in r.to_dict().get("interventions", {}).items() if v}
        lines += [
            f"- model: {desc}",
            f"- data: {r.data.source}, {r.train.steps} steps x batch {r.train.batch_size}, lr {r.train.lr}",
            f"- interventions: {json.dumps(iv) if iv else 'none'}",
            f"- eval top-1 by checkpoint: {', '.join(f'{s}: {v:.4f}' for s, v in sorted(evals.items())) or 'n/a'}",
            "",
        ]
    ev = evolution(base, steps, evals)
    if ev is not None:
        lines += ["## Across checkpoints", "", f"![evolution]({_rel(ev, base)})", ""]
    for s in reversed(steps):
        summ = storage.read_summary(storage.step_dir(base, s)) or {}
        lines += [
            f"## {external_heading(run)}" if run.external else f"## Step {s}",
            "",
            *_summary_rows(summ),
            "",
            *_images(storage.step_dir(base, s, "figures"), base),
            "",
        ]
    against_root = base / "analysis" / "against"
    if against_root.is_dir():
        lines += ["## Against other runs", ""]
        for other in sorted(p for p in against_root.iterdir() if p.is_dir()):
            for sd in sorted(p for p in other.iterdir() if (p / "cross_cka.npz").is_file()):
                res = load_result(sd / "cross_cka.npz")
                lines += [f"### step {int(sd.name.split('_')[1])} vs {other.name}", ""]
                m = np.asarray(res["matrix"])
                lines.append(f"- mean CKA over all layer pairs: {m.mean():.3f}")
                if "same_index" in res:
                    lines.append(
                        f"- CKA of same-index layers ({', '.join(as_list(res['labels_a']))}): {fmt(res['same_index'])}"
                    )
                lines += ["", *_images(base / "figures" / "against" / other.name / sd.name, base), ""]
    out = base / "report.md"
    storage.atomic_text(out, "\n".join(lines) + "\n")
    return out


def check_report(path: Path) -> list[str]:
    """Images referenced by a report.md that do not exist (empty when the report is whole)."""
    path = Path(path)
    return [m for m in re.findall(r"!\[[^\]]*\]\(([^)]+)\)", path.read_text()) if not (path.parent / m).is_file()]
