"""``python -m analysis.frontends.compare RUN_DIR RUN_DIR ... [--reference RUN[:STEP]]``: runs side by side.

Each run is analysed at one checkpoint (``--step``, default its last; cached results are reused, missing ones
computed with the offline suite), then the comparison draws into ``--out`` (default runs/compare-<names>/):

- ``cka_grid.png``        every run's CKA heatmap in one grid (Raghu Fig. 8: the no-skip sweep; Fig. 1 ViT vs ResNet)
- ``probes.png``          few-shot probe top-1 vs normalised depth, one line per run (Fig. 11 right, 13)
- ``attention_distance.png``  attention distance per head and block, one panel per ViT (Fig. 3 vs 4)
- ``norm_ratio.png``      CLS and spatial-token norm ratios per run (Fig. 7)
- ``similarity_to_reference.png``  with --reference: CKA of same-index layers to the reference run (Fig. 12)
- ``report.md``           which step of each run was compared, a table of each run's top-1 and key numbers, and
                          the figures, each with a caption.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

from analysis.engine import suite as S
from analysis.engine.figures import (
    attention_distance_panels,
    every_nth,
    layer_ticks,
    norm_ratio_axes,
    save,
    subplots,
)
from analysis.engine.measure import MeasureError, as_list
from analysis.frontends import runner as RN
from analysis.frontends.cli import measure_options
from analysis.measures.attention_distance import AttentionDistanceMeasure
from analysis.measures.norm_ratio import NormRatioMeasure
from analysis.reports import cross as XC
from analysis.reports.run_report import LONG, sig
from analysis.results import folders as RF0
from analysis.results import runs as RF
from analysis.results import storage
from train.checkpoint import read_meta


def _panels(n: int, w: float = 3.2, h: float = 2.8, **kw):
    """A figure with n panels, up to 4 a row; unused axes hidden. Returns (fig, the n axes)."""
    cols = min(n, 4)
    rows = (n + cols - 1) // cols
    fig, axes = subplots(rows, cols, figsize=(w * cols, h * rows), squeeze=False, **kw)
    for ax in axes.flat[n:]:
        ax.axis("off")
    return fig, list(axes.flat[:n])


def cka_grid(results: dict, path: Path) -> Path | None:
    """:func:`cka_grid_figure` saved to ``path``."""
    return _save(cka_grid_figure(results), path)


def _save(fig, path: Path) -> Path | None:
    if fig is None:
        return None
    save(fig, path)
    return path


def cka_grid_figure(results: dict):
    """Every run's CKA between its layers, one panel each (origin bottom-left), one colourbar from 0 to 1, every layer
    named (every n-th beyond analysis.engine.figures.MAX_TICK_LABELS, said in the axis labels)."""
    items = [(k, r["cka"]) for k, r in results.items() if "cka" in r]
    if not items:
        return None
    fig, axes = _panels(len(items), w=3.6, h=3.6, layout="constrained")
    im = None
    for ax, (name, r) in zip(axes, items):
        im = ax.imshow(np.asarray(r["matrix"]), origin="lower", vmin=0, vmax=1, cmap="magma")
        labels = as_list(r["labels"])
        sx, sy = layer_ticks(ax, labels, "x", 5), layer_ticks(ax, labels, "y", 5)
        ax.set_xlabel("layer" + every_nth(sx), fontsize=7)
        ax.set_ylabel("layer" + every_nth(sy), fontsize=7)
        ax.set_title(name, fontsize=8)
    if im is not None:
        fig.colorbar(im, ax=axes, shrink=0.8).set_label("CKA")
    fig.suptitle("CKA between layers")
    return fig


def depth_lines(curves: dict, ylabel: str, path: Path, ylim: float = 1.0, chance: float | None = None) -> Path | None:
    """:func:`depth_figure` saved to ``path``."""
    return _save(depth_figure(curves, ylabel, ylabel, ylim, chance), path)


def depth_figure(curves: dict, ylabel: str, title: str, ylim: float = 1.0, chance: float | None = None):
    """One line per run against normalised depth (Raghu Fig. 11 right, 12, 13); ``curves`` {label: [L]}."""
    if not curves:
        return None
    fig, ax = subplots(figsize=(5.5, 3.6))
    for name, v in curves.items():
        ax.plot(np.linspace(0, 1, len(v)), v, marker="o", ms=3, label=name)
    if chance is not None:
        ax.axhline(chance, color="grey", ls=":", lw=1, label="chance")
    ax.set_xlabel("normalised depth (0 = first block, 1 = last)")
    ax.set_ylabel(ylabel)
    ax.set_ylim(0, ylim)
    ax.legend(fontsize=6)
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    return fig


def probe_lines(results: dict, path: Path) -> Path | None:
    """:func:`probe_figure` saved to ``path``."""
    return _save(probe_figure(results), path)


def probe_figure(results: dict):
    """Each run's few-shot probe top-1 against normalised depth (its CLS pool, else mean of the spatial tokens)."""
    items = [(k, r["fewshot_probe"]) for k, r in results.items() if "fewshot_probe" in r]
    if not items:
        return None
    curves = {}
    for name, r in items:
        pools = as_list(r["pools"])
        pool = "cls" if "cls" in pools else "mean_spatial" if "mean_spatial" in pools else pools[0]
        curves[f"{name} ({pool})"] = np.asarray(r["mean"])[pools.index(pool)]
    shots = int(items[0][1]["shots"])
    return depth_figure(
        curves, f"{shots}-shot top-1 (fraction)", f"{shots}-shot linear probe", chance=float(items[0][1]["chance"])
    )


def attention_panels(results: dict, path: Path) -> Path | None:
    """:func:`attention_figure` saved to ``path``."""
    return _save(attention_figure(results), path)


def attention_figure(results: dict):
    """Raghu Fig. 3 vs 4: each ViT's mean attention distance per head (coloured by head, named in the legend) and
    block, and uniform attention's distance on its grid (dotted)."""
    panels = {
        k: (np.asarray(r["attention_distance"]["pixels"]), AttentionDistanceMeasure.uniform(r["attention_distance"]))
        for k, r in results.items()
        if "attention_distance" in r
    }
    if not panels:
        return None
    return attention_distance_panels(panels, unit="px")


def norm_ratio_panels(results: dict, path: Path) -> Path | None:
    """:func:`norm_ratio_figure` saved to ``path``."""
    return _save(norm_ratio_figure(results), path)


def norm_ratio_figure(results: dict):
    """Raghu Fig. 7 right for several runs: each run's norm ratio ||z|| / ||f(z)|| (skip path over branch) per block,
    of the CLS token and the mean over the spatial tokens, for each sublayer, on one log scale; dotted: ratio 1."""
    items = [(k, NormRatioMeasure.curves(r["norm_ratio"])) for k, r in results.items() if "norm_ratio" in r]
    if not items:
        return None
    fig, axes = _panels(len(items), w=3.6, h=3.2, sharey=True)
    for i, (ax, (name, curves)) in enumerate(zip(axes, items)):
        norm_ratio_axes(ax, curves, legend_size=5)
        ax.set_title(name, fontsize=8)
        if i % 4:  # the y scale is shared: labelled once a row
            ax.set_ylabel("")
    fig.suptitle("norm ratio ||z|| / ||f(z)|| per block: the CLS token and the mean of the spatial tokens", fontsize=9)
    fig.tight_layout()
    return fig


def reference_lines(same: dict, ref_name: str, path: Path) -> Path | None:
    """:func:`reference_figure` saved to ``path``."""
    return _save(reference_figure(same, ref_name), path)


def reference_figure(same: dict, ref_name: str):
    """Raghu Fig. 12: each run's CKA with ``ref_name`` at the same layer index, against normalised depth."""
    return depth_figure(same, f"CKA to {ref_name}, same layer", f"similarity to {ref_name} per layer", ylim=1.02)


def compare(
    runs: list,
    step: str | None = None,
    reference=None,
    out: Path | None = None,
    opts: S.SuiteOptions | None = None,
    progress: bool = True,
) -> dict:
    """Analyse (cached) and draw ``runs`` side by side; ``reference`` is (Run, step) or None. Returns {"results":
    {name: suite result}, "same_index": {name: [L]}, "top1": {name: float}, "figures": [paths], "out": Path}."""
    opts = opts or S.SuiteOptions()
    names = [r.name for r in runs]
    if len(set(names)) != len(names):
        raise RF0.AnalysisError(f"two runs have the same folder name ({names}): copy or rename one to compare them.")
    out = Path(out) if out else runs[0].path.parent / ("compare-" + "-".join(names))[:120]
    results, top1, same, steps = {}, {}, {}, {}
    for run in runs:
        s = run.step(step)
        steps[run.name] = None if run.external is not None else s  # a model from elsewhere: its weights, no step
        RN.analyze_run(run, [s], opts, progress=progress)
        results[run.name] = storage.load_results(RF.step_dir(run, s), opts.measures)
        if run.external is None:
            v = read_meta(run.checkpoints[s]).get("eval", {}).get("top1")
            if v is not None:
                top1[run.name] = float(v)
    if reference is not None:
        ref, ref_step = reference
        for run in runs:
            if run.path.resolve() == ref.path.resolve() and run.step(step) == ref_step:
                continue
            a = XC.against(run, ref, ref_step, [step] if step else None, opts, progress=progress)
            r = next(iter(a["results"].values()))
            if "same_index" in r:
                same[run.name] = np.asarray(r["same_index"])
    out.mkdir(parents=True, exist_ok=True)
    figs = [
        cka_grid(results, out / "cka_grid.png"),
        probe_lines(results, out / "probes.png"),
        attention_panels(results, out / "attention_distance.png"),
        norm_ratio_panels(results, out / "norm_ratio.png"),
    ]
    if reference is not None:
        figs.append(reference_lines(same, reference[0].name, out / "similarity_to_reference.png"))
    figs = [f for f in figs if f is not None]
    res = {"results": results, "same_index": same, "top1": top1, "figures": figs, "out": out, "steps": steps}
    write_compare_report(res, reference)
    return res


CAPTIONS = {
    "cka_grid": "CKA between every pair of layers of each run, one panel per run (Raghu Fig. 1, 8).",
    "probes": "Few-shot linear probe top-1 against normalised depth, one line per run (its CLS pool, else the mean of "
    "the spatial tokens); chance dotted (Raghu Fig. 11 right, 13).",
    "attention_distance": "Mean attention distance per head and block, one panel per ViT; dotted: uniform attention "
    "on its grid (Raghu Fig. 3, 4).",
    "norm_ratio": "Norm ratio ||z|| / ||f(z)|| per block, CLS token and mean of the spatial tokens, one panel per run; "
    "dotted: ratio 1, above it the skip path dominates (Raghu Fig. 7).",
    "similarity_to_reference": "CKA of each run's layer with the reference run's layer of the same index, against "
    "normalised depth (Raghu Fig. 12).",
}


def _at(res: dict, name: str) -> str:
    s = res.get("steps", {}).get(name)
    return "its weights (not trained here)" if s is None else f"step {s}"


def write_compare_report(res: dict, reference=None) -> Path:
    out = res["out"]
    lines = [
        "# Comparison",
        "",
        "Compared: "
        + "; ".join(f"{name} at {_at(res, name)}" for name in res["results"])
        + (f"; reference {reference[0].name} at step {reference[1]}" if reference is not None else "")
        + ".",
        "",
        "Blocks are numbered from 0 in the figures; numbers are rounded to 3 significant digits; top-1 and probe "
        "accuracies are fractions of images, distances pixels of the input.",
        "",
        "| run | step | eval top-1 | CKA mean off-diagonal | probe top-1, last block | mean attention distance (px) |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for name, r in res["results"].items():
        summ = storage.summary_of(r)
        probe = summ.get("fewshot_probe", {})
        pool = next((p for p in ("cls", "mean_spatial", "mean") if p in probe), None)
        ad = summ.get("attention_distance", {}).get("mean_px")
        cka = summ.get("cka", {}).get("mean_offdiag", float("nan"))
        step, top1 = res.get("steps", {}).get(name), res["top1"].get(name)
        lines.append(
            f"| {name} | {'n/a' if step is None else step} | {'n/a' if top1 is None else sig(top1)} | {sig(cka)} | "
            f"{f'{sig(probe[pool][-1])} ({pool})' if pool else 'n/a'} | "
            f"{sig(float(np.mean(ad))) if ad else 'n/a'} |"
        )
    same = [""]
    if res["same_index"]:
        same = ["", f"CKA of same-index layers to {reference[0].name} (step {reference[1]}), from block 0:", ""]
        same += [f"- {k}: {sig(v)}" for k, v in res["same_index"].items()]
        long = max(np.asarray(v).size for v in res["same_index"].values()) > LONG
        if long:  # after the figures, which show them
            lines += ["", "The CKA of same-index layers to the reference, layer by layer: in the appendix."]
    else:
        long = False
    if not long:
        lines += same
    for p in res["figures"]:
        lines += ["", f"![{p.stem}]({p.name})", "", f"*{CAPTIONS.get(p.stem, p.stem.replace('_', ' '))}*"]
    if long:
        lines += ["", "## Appendix", *same]
    path = out / "report.md"
    path.write_text("\n".join(lines) + "\n")
    return path


def main(argv=None) -> int:
    intro, _, rest = __doc__.partition("\n\n")
    p = argparse.ArgumentParser(
        prog="python -m analysis.frontends.compare",
        description=intro,
        epilog=rest,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("runs", nargs="+", help="run folders")
    p.add_argument("--step", help="checkpoint step of every run (default: each run's last)")
    p.add_argument("--reference", metavar="RUN[:STEP]", help="per-layer similarity of every run to this one (Fig. 12)")
    p.add_argument("--out", help="output folder (default runs/compare-<names>)")
    p.add_argument("--measures", help="comma-separated measures (default: the core four)")
    p.add_argument("--batch-size", type=int, default=256, help="analysis minibatch (also the CKA minibatch, >= 4)")
    p.add_argument(
        "--opt",
        action="append",
        default=[],
        metavar="MEASURE.OPTION=VALUE",
        help="a measure's option, as for python -m analysis, e.g. --opt fewshot_probe.shots=4; repeatable",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    args = p.parse_args(argv)
    try:
        try:
            opts = measure_options(args.measures, args.batch_size, args.opt)
        except MeasureError as e:
            raise RF0.AnalysisError(str(e)) from None
        runs = [RF.open_run(r) for r in args.runs]
        if args.step:
            [r.step(args.step) for r in runs]
        reference = RF.parse_against(args.reference) if args.reference else None
        if reference:
            for r in runs:
                XC.check_same_images(r, reference[0])
        res = compare(runs, args.step, reference, args.out, opts, progress=not args.no_progress)
    except RF0.AnalysisError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"comparison of {len(runs)} runs: {res['out'] / 'report.md'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
