"""The analysis and report stages of ``./launch.sh study`` (train/study.py).

``analyze_study``: the core suite on every checkpoint of every run and every measure on each run's last
checkpoint (all cached, see analysis/offline.py). ``write_report``: cross-run comparisons (cached) and the
study's report — for recipes/studies/raghu2021.yaml, docs/reproduction.md with each claim of Raghu et al. 2021
(and Walmer et al. 2023's offset heads), its figure, the measured numbers (analysis/claims.py) and whether it
held. Figures the report shows are copied next to it (docs/figures/<study>/), so the document reads on its own.
"""
from __future__ import annotations

import json
import shutil
import sys
import time
from pathlib import Path

import numpy as np

from analysis import offline as O
from analysis import storage
from analysis import suite as S
from analysis.measure import registry
from analysis.reports import claims as C
from analysis.reports.compare import compare
from analysis.reports.run_report import write_run_report
from train.checkpoint import read_meta


def _open(study) -> dict:
    runs = {}
    for name, r in study.runs.items():
        try:
            runs[name] = O.open_run(r.run_dir)
        except O.AnalysisError as e:
            raise O.AnalysisError(f"study run '{name}' is not trained yet ({e}); run the train stage first.") from None
    return runs


def _times(study) -> dict:
    f = study.root / "study_times.json"
    return json.loads(f.read_text()) if f.is_file() else {}


def _save_time(study, key: str, seconds: float) -> None:
    t = _times(study)
    t[key] = round(seconds, 1)
    study.root.mkdir(parents=True, exist_ok=True)
    (study.root / "study_times.json").write_text(json.dumps(t, indent=1))


def analyze_study(study) -> int:
    t0 = time.time()
    try:
        runs = _open(study)
        for name, run in runs.items():
            O.analyze_run(run, None, S.SuiteOptions())  # the core four on every checkpoint
            measures = study.runs[name].measures or study.measures or sorted(registry())
            O.analyze_run(run, ["last"], S.suite_options(measures))  # the study's list on the last
            write_run_report(run)
    except O.AnalysisError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    _save_time(study, "analyze_s", time.time() - t0)
    return 0


def _top1(run) -> float:
    return float(read_meta(run.checkpoints[max(run.checkpoints)]).get("eval", {}).get("top1", float("nan")))


def _train_wall(run) -> float:
    f = run.path / "result.json"
    try:
        return float(json.loads(f.read_text())["wall_s"])
    except (OSError, ValueError, KeyError):
        return float("nan")


def write_report(study) -> int:
    t0 = time.time()
    try:
        runs = _open(study)
        text = _report(study, runs)
    except O.AnalysisError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    _save_time(study, "report_s", time.time() - t0)
    out = study.report or (study.root / "report.md")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text.replace("{REPORT_S}", f"{_times(study).get('report_s', float('nan')):.0f}"))
    print(f"study {study.name}: report written to {out}")
    return 0


class _Doc:
    """Markdown lines plus the figures it shows, copied next to the document."""

    def __init__(self, study):
        self.lines: list[str] = []
        self.base = (study.report or study.root / "report.md").parent
        self.fig_dir = self.base / "figures" / study.name
        self.fig_dir.mkdir(parents=True, exist_ok=True)

    def add(self, *lines: str) -> None:
        self.lines += list(lines)

    def figure(self, path: Path, name: str, caption: str) -> None:
        if path is None or not Path(path).is_file():
            self.add(f"*(figure {name} missing)*", "")
            return
        dst = self.fig_dir / f"{name}.png"
        shutil.copyfile(path, dst)
        self.add(f"![{caption}]({dst.relative_to(self.base).as_posix()})", "", f"*{caption}*", "")


def _last(run, name: str):
    res = storage.load_results(O.step_dir(run, max(run.checkpoints)), [name])
    return res.get(name)


def _verdict(ok: bool) -> str:
    return "**held**" if ok else "**did not hold**"


def _direction(diff: float, margin: float) -> str:
    """'held' when the claimed difference exceeds ``margin``, 'did not hold' when the opposite one does, else
    'inconclusive'."""
    return "held" if diff > margin else "did not hold" if diff < -margin else "inconclusive"


def _combine(parts: list[str]) -> str:
    if all(p == "held" for p in parts):
        return "**held**"
    if "did not hold" in parts:
        return "**did not hold**" if "held" not in parts else "**partly held**"
    return "**partly held**" if "held" in parts else "**inconclusive**"


def _report(study, runs: dict) -> str:
    doc = _Doc(study)
    times = _times(study)
    train_wall = {n: _train_wall(r) for n, r in runs.items()}
    doc.add(f"# Reproduction: {study.name}", "",
            f"Generated by `./launch.sh study {study.path.relative_to(study.path.parents[2]) if len(study.path.parents) > 2 else study.path}` "
            "from the saved runs; every number below is computed by the project (analysis/claims.py on the results of "
            "analysis/*.py), so rerunning the study regenerates this page.", "",
            "## Runs", "", "| run | recipe overrides | test top-1 | training wall (s) |", "| --- | --- | --- | --- |")
    for n, r in runs.items():
        doc.add(f"| {n} | {' '.join(study.runs[n].overrides) or '-'} | {_top1(r):.4f} | {train_wall[n]:.0f} |")
    total_train = np.nansum(list(train_wall.values()))
    doc.add("", f"Wall time on this machine: training {total_train / 60:.0f} min in all (each run's own wall time, other jobs "
            f"included); the last invocation's analysis stage {times.get('analyze_s', float('nan')) / 60:.1f} min (results "
            "cached by earlier invocations are not recomputed); comparisons and this report {REPORT_S} s.", "")
    claims = _raghu2021(study, runs, doc, compare) if {"vit_cls", "resnet"} <= set(runs) else []
    if claims:
        table = ["## Claims at a glance", "", "| # | claim | figure | measured | verdict |", "| --- | --- | --- | --- | --- |"]
        table += [f"| {i} | {c} | {f} | {m} | {v} |" for i, (c, f, m, v) in enumerate(claims, 1)]
        doc.lines[doc.lines.index("## Runs"):doc.lines.index("## Runs")] = table + [""]
    return "\n".join(doc.lines) + "\n"


def _raghu2021(study, runs: dict, doc: _Doc, compare) -> list:
    out = []
    cls, resnet = runs["vit_cls"], runs["resnet"]
    root = study.root

    # 1. uniformity (Fig. 1, 2)
    a = O.against(cls, resnet, max(resnet.checkpoints))
    cross = next(iter(a["results"].values()))
    u_v, u_r = C.uniformity(_last(cls, "cka")["matrix"]), C.uniformity(_last(resnet, "cka")["matrix"])
    ok = u_v["mean_offdiag"] > u_r["mean_offdiag"] and u_v["first_last"] > u_r["first_last"]
    m = (f"mean off-diagonal CKA ViT {u_v['mean_offdiag']:.3f} vs ResNet {u_r['mean_offdiag']:.3f}; first-last layer "
         f"{u_v['first_last']:.3f} vs {u_r['first_last']:.3f}")
    out.append(("ViT layer representations are more uniform than ResNet's", "Fig. 1, 2", m, _verdict(ok)))
    doc.add("## 1. ViT representations are more uniform than ResNet's (Raghu Fig. 1, 2)", "",
            "Rule: held if the ViT's mean off-diagonal self-CKA and its first-vs-last-layer CKA both exceed the ResNet's.", "",
            f"Measured: {m}. Mean cross-model CKA (ViT layers x ResNet layers): {np.asarray(cross['matrix']).mean():.3f}. "
            f"Verdict: {_verdict(ok)}. The ResNet baseline (recipes/resnet.yaml) has one residual block per stage, so its "
            "CKA map has 4 layers against the ViT's 12 and its stages are far shallower than Raghu's ResNet-50.", "")
    compare([cls, runs.get("vit_gap", cls), resnet] if "vit_gap" in runs else [cls, resnet], out=root / "compare-arch", progress=False)
    doc.figure(root / "compare-arch" / "cka_grid.png", "cka_arch", "CKA between layers: CLS ViT, GAP ViT, ResNet")
    fig_dir = storage.against_dir(cls.path, max(cls.checkpoints), resnet.name, max(resnet.checkpoints), "figures")
    doc.figure(fig_dir / "cross_cka.png", "cka_vit_vs_resnet", "Cross-model CKA, ViT (x) vs ResNet (y) (Raghu Fig. 2)")

    # 2. no-skip partitions (Fig. 8)
    ns = {n: r for n, r in runs.items() if n.startswith("noskip_b")}
    if ns:
        rows, oks = [], []
        for n, r in sorted(ns.items()):
            b = int(n.rsplit("b", 1)[1])
            c = _last(r, "cka")
            p = C.partition(c["matrix"], [str(s) for s in c["labels"]], b)
            base = C.partition(_last(cls, "cka")["matrix"], [str(s) for s in _last(cls, "cka")["labels"]], b)
            drop = _top1(cls) - _top1(r)
            ok = p["across"] < base["across"] - 0.05 and drop > 0
            oks.append(ok)
            rows.append(f"| {b} | {p['across']:.3f} | {base['across']:.3f} | {p['within']:.3f} | {_top1(r):.4f} | {100 * drop:+.2f} | {_verdict(ok)} |")
        compare([cls] + [ns[k] for k in sorted(ns)], out=root / "compare-noskip", progress=False)
        m = "; ".join(r.split("|")[1].strip() + ": across " + r.split("|")[2].strip() + " vs " + r.split("|")[3].strip() for r in rows)
        out.append(("Removing block i's skip connections partitions the CKA map at i and costs accuracy", "Fig. 8",
                    f"CKA across the partition (no-skip vs normal) per block: {m}", _verdict(all(oks)) + f" ({sum(oks)}/{len(oks)} blocks)"))
        doc.add("## 2. No skip connection at block i partitions the representations (Raghu Fig. 8)", "",
                "Rule, per block i: held if the mean CKA between layers before block i and layers from block i on is at "
                "least 0.05 lower than in the normal ViT at the same boundary, and test top-1 is lower.", "",
                "| block i | CKA across, no skip | CKA across, normal ViT | CKA within sides, no skip | top-1 | top-1 drop (points) | verdict |",
                "| --- | --- | --- | --- | --- | --- | --- |", *rows, "")
        doc.figure(root / "compare-noskip" / "cka_grid.png", "cka_noskip", "CKA maps: normal ViT, then no skip at blocks " +
                   ", ".join(k.rsplit("b", 1)[1] for k in sorted(ns)))

    # 3. skip dominance and the CLS phase transition (Fig. 7)
    nv, nr = _last(cls, "norm_ratio"), _last(resnet, "norm_ratio")
    dv, dr = C.skip_dominance(nv["ratio"]), C.skip_dominance(nr["ratio"])
    ph = C.cls_phase(nv["ratio"], 0, int(nv["num_prefix_tokens"]))
    ok = dv > dr and ph["cls_first"] < ph["spatial_first"] and ph["cls_last"] > 2 * ph["cls_first"]
    m = (f"median norm ratio ViT {dv:.2f} vs ResNet {dr:.2f}; attention sublayer, CLS {ph['cls_first']:.2f} -> {ph['cls_last']:.2f}, "
         f"spatial {ph['spatial_first']:.2f} -> {ph['spatial_last']:.2f} (first -> last block)")
    out.append(("The skip path dominates more in ViT than in ResNet, with a CLS / spatial phase transition", "Fig. 7", m, _verdict(ok)))
    doc.add("## 3. Skip connections dominate more in ViT, with a CLS-token phase transition (Raghu Fig. 7)", "",
            "Rule: held if the ViT's median norm ratio ||z||/||f(z)|| exceeds the ResNet's, and in the attention sublayer "
            "the CLS token's ratio starts below the spatial tokens' and more than doubles by the last block.", "",
            f"Measured: {m}. Verdict: {_verdict(ok)}.", "")
    doc.figure(root / "compare-arch" / "norm_ratio.png", "norm_ratio_arch", "Norm ratios per block: CLS ViT, GAP ViT, ResNet")

    # 4. local and global heads (Fig. 3)
    hm = C.head_mix(_last(cls, "attention_distance")["pixels"])
    # a real mix means heads that differ: the lower spread must be at least twice the upper one and a quarter of the
    # mean distance (near-uniform heads all sit at ~14.4 px on the 7x7 grid and differ by noise)
    ok = (hm["spread_lower"] > 2 * hm["spread_upper"] and hm["spread_lower"] > 0.25 * hm["mean_lower"]
          and hm["mean_upper"] > hm["mean_lower"])
    m = (f"spread of head distances lower / upper half {hm['spread_lower']:.2f} / {hm['spread_upper']:.2f} px; "
         f"mean distance {hm['mean_lower']:.2f} / {hm['mean_upper']:.2f} px (uniform attention on the 7x7 grid: 14.4 px)")
    out.append(("Lower layers mix local and global heads, higher layers are global", "Fig. 3", m, _verdict(ok)))
    doc.add("## 4. Lower layers mix local and global heads, higher layers attend globally (Raghu Fig. 3)", "",
            "Rule: held if the spread of attention distances over heads (max - min) in the lower half of the blocks is at "
            "least twice the upper half's and at least a quarter of the mean distance, and the mean distance is larger in "
            "the upper half.", "", f"Measured: {m}. Verdict: {_verdict(ok)}.", "")
    doc.figure(root / "compare-arch" / "attention_distance.png", "attention_distance", "Mean attention distance per head and block")
    doc.figure(fig_dir / "head_subsets.png", "head_subsets", "Block-0 heads from local to global: CKA of windows of "
               "consecutive heads (lines) and of single heads (circles) to the ResNet's lower layers (Raghu Fig. 5)")

    # 5. CLS vs GAP: localization and spatial-token probes (Fig. 9, 10, 11 left)
    if "vit_gap" in runs:
        gap = runs["vit_gap"]
        lc, lg = C.last_layer(_last(cls, "localization")["own_share"]), C.last_layer(_last(gap, "localization")["own_share"])
        tc = C.last_layer(_last(cls, "token_probes")["mean_over_tokens"])
        tg = C.last_layer(_last(gap, "token_probes")["mean_over_tokens"])
        parts = [_direction(lc - lg, 0.02), _direction(tg - tc, 0.01)]
        v = _combine(parts)
        m = (f"last block, share of tokens most similar to their own input patch: CLS {lc:.3f} vs GAP {lg:.3f} ({parts[0]}); "
             f"mean 10-shot accuracy of single spatial tokens: CLS {tc:.3f} vs GAP {tg:.3f} ({parts[1]})")
        out.append(("CLS ViTs keep spatial information better than GAP ViTs, and their spatial tokens probe worse", "Fig. 9-11", m, v))
        doc.add("## 5. CLS-trained ViTs localize better, GAP-trained spatial tokens probe better (Raghu Fig. 9, 10, 11 left)", "",
                "Rule, two parts: the CLS model's last-block localization share exceeds the GAP model's by more than 0.02, and "
                "its mean per-token probe accuracy is lower by more than 0.01 (one 1024-image analysis set: smaller "
                "differences are called inconclusive).", "", f"Measured: {m}. Verdict: {v}.", "")
        for r, tag in ((cls, "cls"), (gap, "gap")):
            d = storage.step_dir(r.path, max(r.checkpoints), "figures")
            doc.figure(d / "localization_score.png", f"localization_{tag}", f"Localization scores per block, {tag.upper()} ViT")
            doc.figure(d / "token_probes_mean.png", f"token_probes_{tag}", f"Per-token 10-shot probes, {tag.upper()} ViT")

    # 6. data subsets (Fig. 12)
    subs = {n: r for n, r in runs.items() if n.startswith("subset_")}
    if subs:
        ordered = [subs[k] for k in sorted(subs)]
        res = compare(ordered, reference=(cls, max(cls.checkpoints)), out=root / "compare-subsets", progress=False)
        d = {n: C.drift(v) for n, v in res["same_index"].items()}
        uppers = [d[r.name]["upper"] for r in ordered]
        smallest = d[ordered[0].name]
        ok = all(a <= b for a, b in zip(uppers, uppers[1:])) and smallest["upper"] < smallest["lower"]
        m = "; ".join(f"{n}: lower {v['lower']:.3f}, upper {v['upper']:.3f}" for n, v in d.items())
        out.append(("With less pretraining data, higher layers drift further from the full-data model", "Fig. 12",
                    f"same-index CKA to the 100% model: {m}", _verdict(ok)))
        doc.add("## 6. Less data: higher layers drift further from the full-data model (Raghu Fig. 12)", "",
                "Rule: held if the mean same-layer CKA to the 100% model over the upper half of the layers rises with the "
                "subset size, and for the smallest subset it is below the lower half's.", "",
                f"Measured (per-layer values in compare-subsets/report.md): {m}. Top-1: " +
                ", ".join(f"{r.name} {_top1(r):.4f}" for r in ordered) + f", 100% {_top1(cls):.4f}. Verdict: {_verdict(ok)}.", "")
        doc.figure(root / "compare-subsets" / "similarity_to_reference.png", "subsets", "CKA of each layer to the same layer of the 100% model")

    # 7. offset local heads (Walmer Fig. 3, 14)
    counts = {n: C.offset_heads(_last(r, "aligned_attention")["offset_local"]) for n, r in runs.items()
              if _last(r, "aligned_attention") is not None}
    total = sum(c["count"] for c in counts.values())
    ok = total > 0
    m = "; ".join(f"{n}: {c['count']}" + (f" ({', '.join(c['where'][:4])})" if c["where"] else "") for n, c in counts.items())
    out.append(("Offset local attention heads appear (Walmer)", "Walmer Fig. 3, 14", f"offset local heads per ViT: {m}", _verdict(ok)))
    doc.add("## 7. Offset local attention heads (Walmer et al. 2023 Fig. 3, 14)", "",
            "Rule: held if any ViT of the study has a head whose aligned attention map peaks away from the query, within 2 "
            "tokens, with at least half its mass in the 3x3 window around the peak (analysis/measures/aligned_attention.py).", "",
            f"Measured: {m}. Verdict: {_verdict(ok)}.", "")
    d = storage.step_dir(cls.path, max(cls.checkpoints), "figures")
    doc.figure(d / "aligned_attention_mass_maps.png", "aligned_attention", "Aligned aggregated attention maps, CLS ViT")
    return out
