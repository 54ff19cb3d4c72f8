"""The analysis and report stages of ``./launch.sh study`` (analysis/reports/study.py).

``analyze_study``: the core suite on every checkpoint of every run and the study's measures on each run's last
checkpoint, all with the study's measure options (cached, see analysis/offline.py). ``write_report``: cross-run
comparisons (cached) and the study's report — for recipes/studies/raghu2021.yaml, docs/reproduction.md with each
claim of Raghu et al. 2021 (and Walmer et al. 2023's offset heads): the quoted passage, the rule, the paper's number
and ours, the measured values, the noise floor and the outcome (analysis/reports/claims.py), and the same as
docs/reproduction.json beside it so two studies can be diffed. Figures the report shows are copied next to it
(docs/figures/<study>/), so the document reads on its own.
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
from analysis.measure import registry
from analysis.reports import claims as C
from analysis.reports import walmer_report
from analysis.reports.compare import compare
from analysis.reports.run_report import write_run_report
from train.checkpoint import read_meta
from train.models import build_model


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
            O.analyze_run(run, None, study.suite_options(None))  # the core four on every checkpoint
            measures = study.runs[name].measures or study.measures or sorted(registry())
            O.analyze_run(run, ["last"], study.suite_options(measures))  # the study's list on the last
            write_run_report(run)
    except O.AnalysisError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    _save_time(study, "analyze_s", time.time() - t0)
    return 0


def _top1(run, step: int | None = None) -> float:
    step = max(run.checkpoints) if step is None else step
    return float(read_meta(run.checkpoints[step]).get("eval", {}).get("top1", float("nan")))


def _eval_n(run) -> int:
    return int(read_meta(run.checkpoints[max(run.checkpoints)]).get("eval", {}).get("n", 0))


def _train_wall(run) -> float:
    f = run.path / "result.json"
    try:
        return float(json.loads(f.read_text())["wall_s"])
    except (OSError, ValueError, KeyError):
        return float("nan")


def write_report(study) -> int:
    t0 = time.time()
    out = study.report or (study.root / "report.md")
    try:
        runs = _open(study)
        text, records, notes = _report(study, runs)
    except O.AnalysisError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    _save_time(study, "report_s", time.time() - t0)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text.replace("{REPORT_S}", f"{_times(study).get('report_s', float('nan')):.0f}"))
    if records:
        C.write_json(out.with_suffix(".json"), study.name, records, notes)
    print(f"study {study.name}: report written to {out}" + (f" and {out.with_suffix('.json')}" if records else ""))
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


def _last(run, name: str, step: int | None = None):
    res = storage.load_results(O.step_dir(run, max(run.checkpoints) if step is None else step), [name])
    return res.get(name)


def _configs(study, runs: dict) -> dict[str, list]:
    """Configuration name -> its opened runs in seed order."""
    return {c: [runs[r.name] for r in rs] for c, rs in study.configs().items()}


def _identity_mask(run, blocks) -> np.ndarray:
    """Which of a ResNet run's residual blocks (names as the norm_ratio result lists them) have an identity shortcut,
    read off the model its recipe builds."""
    model = build_model(run.recipe, 10)
    return np.array([getattr(model.get_submodule(str(b)), "downsample", None) is None for b in blocks], dtype=bool)


def _resnet_blocks(run) -> list[str]:
    model = build_model(run.recipe, 10)
    return [n for n, m in model.named_modules() if n.count(".") == 1 and n.startswith("layer")]


_MARK = {C.HELD: "**held**", C.NOT_HELD: "**did not hold**", C.INCONCLUSIVE: "**inconclusive**", C.NOT_TESTABLE: "**not testable**"}


def _floor_text(v: C.Verdict) -> str:
    if not v.noise_floor:
        return "-"
    parts = []
    for k, f in v.noise_floor.items():
        if isinstance(f, dict) and "threshold" in f:
            se = f" (incl. {C.SE_FACTOR:g} SE {f['binomial_se']:.4f})" if "binomial_se" in f else ""
            parts.append(f"{k}: {f['threshold']:.3g}{se}")
        else:
            parts.append(f"{k}: {f}")
    return "; ".join(parts)


def _section(doc: _Doc, n: int, claim: C.Claim, v: C.Verdict) -> None:
    doc.add(f"## {n}. {claim.claim} ({claim.figure})", "", f"> \"{claim.passage}\" — {claim.source}", "",
            f"Rule: {claim.rule}", "")
    if claim.paper_value:
        doc.add(f"Paper: {claim.paper_value}. Ours: {v.ours or 'see the measured values'}.", "")
    doc.add(f"Verdict: {_MARK[v.outcome]}. {v.why}", "")


def _report(study, runs: dict) -> tuple[str, list, list]:
    doc = _Doc(study)
    times = _times(study)
    train_wall = {n: _train_wall(r) for n, r in runs.items()}
    doc.add(f"# Reproduction: {study.name}", "",
            f"Generated by `./launch.sh study {study.path.relative_to(study.path.parents[2]) if len(study.path.parents) > 2 else study.path}` "
            "from the saved runs; every number below is computed by the project (analysis/reports/claims.py on the results of "
            "analysis/measures/*.py), so rerunning the study regenerates this page and its JSON twin.", "",
            "## Runs", "", "| run | configuration | seed | recipe overrides | test top-1 (± binomial SE) | training wall (s) |",
            "| --- | --- | --- | --- | --- | --- |")
    for n, r in runs.items():
        sr, p = study.runs[n], _top1(r)
        doc.add(f"| {n} | {sr.config} | {'-' if sr.seed is None else sr.seed} | {' '.join(sr.overrides) or '-'} | "
                f"{p:.4f} ± {C.binomial_se(p, _eval_n(r)):.4f} | {train_wall[n]:.0f} |")
    total_train = np.nansum(list(train_wall.values()))
    doc.add("", f"Wall time on this machine: training {total_train / 60:.0f} min in all (each run's own wall time, other jobs "
            f"included); the last invocation's analysis stage {times.get('analyze_s', float('nan')) / 60:.1f} min (results "
            "cached by earlier invocations are not recomputed); comparisons and this report {REPORT_S} s. Measure options: "
            f"{json.dumps(study.options) if study.options else 'the defaults'}.", "")
    configs = _configs(study, runs)
    if walmer_report.applies(configs):  # objectives compared: supervised / dino / mae (Walmer et al. 2023)
        results, notes = walmer_report.walmer2023(study, configs, doc, _section)
    elif not {"vit_cls", "resnet"} <= set(configs):
        return "\n".join(doc.lines) + "\n", [], []
    else:
        results, notes = _raghu2021(study, configs, doc)
    table = ["## Claims at a glance", "",
             f"Outcomes: held / did not hold (the effect, in the paper's direction or against it, exceeds {C.NOISE_FACTOR:g}x "
             f"the largest seed-to-seed difference of the same configuration, and {C.SE_FACTOR:g} binomial standard errors "
             "for top-1), inconclusive (within that noise floor), not testable (a precondition failed; the numbers say which).",
             "", "| # | claim (the paper's direction) | figure | paper | ours | noise floor (threshold) | verdict |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for i, (claim, v) in enumerate(results, 1):
        cells = (str(i), claim.claim, claim.figure, claim.paper_value or "-", v.ours or "-", _floor_text(v), _MARK[v.outcome])
        table.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    if notes:
        table += ["", "What this study does not yet do:", ""] + [f"- {n}" for n in notes]
    at = doc.lines.index("## Runs")
    doc.lines[at:at] = table + [""]
    return "\n".join(doc.lines) + "\n", [C.record(c, v) for c, v in results], notes


def _raghu2021(study, configs: dict, doc: _Doc) -> tuple[list, list]:
    out, notes = [], []
    opts = study.suite_options(None)
    cls_runs, res_runs = configs["vit_cls"], configs["resnet"]
    cls, resnet = cls_runs[0], res_runs[0]
    root = study.root

    def add(claim_id: str, v: C.Verdict):
        claim = C.CLAIMS[claim_id]
        out.append((claim, v))
        _section(doc, len(out), claim, v)

    # 1. uniformity (Fig. 1, 2)
    blocks = _resnet_blocks(resnet)
    ident = int(_identity_mask(resnet, blocks).sum())
    if ident == 0:
        notes.append(f"The ResNet baseline has no identity shortcut (0 of {len(blocks)} blocks): the uniformity and skip-dominance "
                     "claims compare against the paper's ResNets, which have them.")
    add("uniformity", C.rule_uniformity([_last(r, "cka")["matrix"] for r in cls_runs],
                                        [_last(r, "cka")["matrix"] for r in res_runs], ident, len(blocks)))
    for r, rr in zip(cls_runs, res_runs):
        O.against(r, rr, max(rr.checkpoints), opts=opts, progress=False)
    arch = [cls] + ([configs["vit_gap"][0]] if "vit_gap" in configs else []) + [resnet]
    compare(arch, out=root / "compare-arch", opts=opts, progress=False)
    doc.figure(root / "compare-arch" / "cka_grid.png", "cka_arch", "CKA between layers: " + ", ".join(r.name for r in arch))
    fig_dir = storage.against_dir(cls.path, max(cls.checkpoints), resnet.name, max(resnet.checkpoints), "figures")
    doc.figure(fig_dir / "cross_cka.png", "cka_vit_vs_resnet", "Cross-model CKA, ViT (x) vs ResNet (y) (Raghu Fig. 2)")

    # 2. no-skip partitions (Fig. 8)
    ns = {int(k.rsplit("b", 1)[1]): v for k, v in configs.items() if k.startswith("noskip_b")}
    if ns:
        def rows(rs):
            return [{"matrix": _last(r, "cka")["matrix"], "labels": [str(s) for s in _last(r, "cka")["labels"]],
                     "top1": _top1(r), "n": _eval_n(r)} for r in rs]
        add("noskip_partition", C.rule_noskip(rows(cls_runs), {b: rows(rs) for b, rs in ns.items()}, cls.recipe.model.depth))
        compare([cls] + [ns[k][0] for k in sorted(ns)], out=root / "compare-noskip", opts=opts, progress=False)
        doc.figure(root / "compare-noskip" / "cka_grid.png", "cka_noskip", "CKA maps: normal ViT, then no skip at blocks " +
                   ", ".join(str(k) for k in sorted(ns)))

    # 3. skip dominance and the CLS phase transition (Fig. 7)
    nr = _last(resnet, "norm_ratio")
    add("skip_dominance", C.rule_skip_dominance([_last(r, "norm_ratio")["ratio"] for r in cls_runs],
                                                [_last(r, "norm_ratio")["ratio"] for r in res_runs],
                                                _identity_mask(resnet, [str(b) for b in nr["blocks"]])))
    nv = _last(cls, "norm_ratio")
    add("cls_phase", C.rule_cls_phase([_last(r, "norm_ratio")["ratio"] for r in cls_runs], [str(s) for s in nv["sublayers"]],
                                      int(nv["num_prefix_tokens"])))
    doc.figure(root / "compare-arch" / "norm_ratio.png", "norm_ratio_arch", "Norm ratios per block: " + ", ".join(r.name for r in arch))

    # 4. local and global heads (Fig. 3)
    m = cls.recipe.model
    uniform = C.uniform_distance(cls.recipe.data.img_size // m.patch_size, m.patch_size)
    add("head_mix", C.rule_head_mix([_last(r, "attention_distance")["pixels"] for r in cls_runs], uniform))
    doc.figure(root / "compare-arch" / "attention_distance.png", "attention_distance", "Mean attention distance per head and block")
    doc.figure(fig_dir / "head_subsets.png", "head_subsets", "Block-0 heads from local to global: CKA of windows of "
               "consecutive heads (lines) and of single heads (circles) to the ResNet's lower layers (Raghu Fig. 5)")

    # 5. CLS vs GAP: localization and spatial-token probes (Fig. 9, 10, 11 left)
    if "vit_gap" in configs:
        gap_runs = configs["vit_gap"]
        add("cls_localization", C.rule_difference(
            "last-block own_share, CLS - GAP", [C.last_layer(_last(r, "localization")["own_share"]) for r in cls_runs],
            [C.last_layer(_last(r, "localization")["own_share"]) for r in gap_runs], ("vit_cls", "vit_gap")))
        add("gap_token_probes", C.rule_difference(
            "last-block mean token-probe accuracy, GAP - CLS",
            [C.last_layer(_last(r, "token_probes")["mean_over_tokens"]) for r in gap_runs],
            [C.last_layer(_last(r, "token_probes")["mean_over_tokens"]) for r in cls_runs], ("vit_gap", "vit_cls")))
        for r, tag in ((cls, "cls"), (gap_runs[0], "gap")):
            d = storage.step_dir(r.path, max(r.checkpoints), "figures")
            doc.figure(d / "localization_score.png", f"localization_{tag}", f"Localization scores per block, {tag.upper()} ViT")
            doc.figure(d / "token_probes_mean.png", f"token_probes_{tag}", f"Per-token 10-shot probes, {tag.upper()} ViT")

    # 6. data subsets (Fig. 12): each subset run at its chosen checkpoint against the full-data run of the same seed
    subs = {k: v for k, v in configs.items() if k.startswith("subset_")}
    if subs:
        curves, chosen = {}, []
        for _name, rs in sorted(subs.items()):
            ds = rs[0].recipe.interventions.data_subset  # the subset size: a fraction of train, or a count
            frac = ds.fraction if ds.fraction is not None else float(ds.count)  # only the order matters
            curves[frac] = []
            for r, ref in zip(rs, cls_runs):
                step, why = C.select_checkpoint({s: read_meta(p) for s, p in r.checkpoints.items()})
                chosen.append(f"{r.name}: {why}")
                a = O.against(r, ref, max(ref.checkpoints), [step], opts=opts, progress=False)
                curves[frac].append(np.asarray(a["results"][step]["same_index"]))
        add("data_drift", C.rule_data_drift(curves))
        if any("no held-out validation" in c for c in chosen):
            notes.append("Subset runs choose no checkpoint: the trainer records eval top-1 on the test split only; a held-out "
                         "validation split carved from train (meta 'val') is missing, so the last checkpoint is read.")
        doc.add("Checkpoints read: " + "; ".join(chosen) + ".", "")
        ordered = [subs[k][0] for k in sorted(subs)]
        compare(ordered, reference=(cls, max(cls.checkpoints)), out=root / "compare-subsets", opts=opts, progress=False)
        doc.figure(root / "compare-subsets" / "similarity_to_reference.png", "subsets", "CKA of each layer to the same layer of the 100% model")

    # 7. offset local heads (Walmer Fig. 3, 14): the standard ViTs of the study
    vits = {r.name: _last(r, "aligned_attention") for k in ("vit_cls", "vit_gap") for r in configs.get(k, [])}
    add("offset_heads", C.rule_offset_heads({n: {"local": a["local"], "offset_local": a["offset_local"]}
                                             for n, a in vits.items() if a is not None}))
    d = storage.step_dir(cls.path, max(cls.checkpoints), "figures")
    doc.figure(d / "aligned_attention_mass_maps.png", "aligned_attention", "Aligned aggregated attention maps, CLS ViT")
    return out, notes
