"""The analysis and report stages of ``./launch.sh study`` (analysis/reports/study.py).

``analyze_study``: the study's ``every_checkpoint`` measures (default: the core four) on every checkpoint of every
run and the study's measures on each run's last checkpoint, all with the study's measure options (cached, see analysis/offline.py). ``write_report``: cross-run
comparisons (cached) and the study's report — for recipes/studies/raghu2021.yaml, docs/reproduction.md with each
claim of Raghu et al. 2021 (and Walmer et al. 2023's offset heads): the quoted passage, the rule, the paper's number
and ours, the measured values, the noise floor and the outcome (analysis/reports/claims.py), and the same as
docs/reproduction.json beside it so two studies can be diffed. Figures the report shows are copied next to it
(docs/figures/<study>/), so the document reads on its own.

Pilot runs. Configurations whose name starts with ``vit_local`` (:data:`LOCALITY`, recipes/vit_local.yaml and its
variants) are pilots of the locality-capable regime: they may be missing or still training when the other stages run.
A missing one is said so and left out; an unfinished one is analysed at the checkpoints it has (the core measures,
attention distance among them) but gets no last-checkpoint measures. The report's pilot section shows, for every
configuration whose name starts with ``vit_``, the attention distance by block at every checkpoint and a go/no-go
(:func:`analysis.reports.claims.go_no_go`). The locality claims (head mix, head subsets, offset heads) read
``vit_local`` when all its seeds have finished, else ``vit_cls`` -- the default 4-epoch regime, Raghu Fig. 4's "not
enough data" regime, in which ViT "does not learn to attend locally" -- and say which and why.

Beside the CKA maps, the report shows their floors (:func:`analysis.baselines.cka_floors`): each layer's CKA with the
raw pixels and with the same layer at random initialisation, and the random-init model's own map.
"""

from __future__ import annotations

import json
import shutil
import sys
import time
from pathlib import Path

import numpy as np
import torch

from analysis import baselines as B
from analysis import offline as O
from analysis import storage
from analysis.figures import attention_distance_panels, layer_lines, save
from analysis.measure import as_list, load_result, registry, save_result
from analysis.measures.cka import cka_layers
from analysis.reports import claims as C
from analysis.reports import walmer_report
from analysis.reports.compare import compare
from analysis.reports.run_report import write_run_report
from analysis.suite import make_context
from train.checkpoint import STEP_RE, read_meta
from train.models import build_model

LOCALITY = "vit_local"  # the locality-capable configuration (recipes/vit_local.yaml); names starting with it are pilots
CONTROL = "control"  # the locality detectors' positive control (recipes/positive_control.yaml: heads forced local)
FALLBACK = "vit_cls"  # what the locality claims read without it: the default 4-epoch regime


def _pilot(config: str) -> bool:
    """Whether a configuration is a pilot of the locality-capable regime (it may be missing or unfinished)."""
    return config.startswith(LOCALITY)


def _open(study) -> tuple[dict, dict]:
    """The study's runs opened, and {run name: why it is absent} for the pilot runs not trained yet (other runs must
    have a checkpoint)."""
    runs, absent = {}, {}
    for name, r in study.runs.items():
        try:
            runs[name] = O.open_run(r.run_dir)
        except O.AnalysisError as e:
            if _pilot(r.config):
                absent[name] = "not started (no run folder)" if not r.run_dir.is_dir() else "no complete checkpoint yet"
                continue
            raise O.AnalysisError(f"study run '{name}' is not trained yet ({e}); run the train stage first.") from None
    for (
        name
    ) in absent:  # a configuration whose first run stopped at a no-go: its other seeds are not trained, by design
        first = study.configs()[study.runs[name].config][0].name
        if first in runs and first != name and not _progress(runs[first])[0] and pilot_check(runs[first])[0] == C.NO_GO:
            absent[name] = f"not trained: its configuration stopped at the go/no-go check of {first}"
    return runs, absent


def _progress(run) -> tuple[bool, str]:
    """(finished, a few words): finished when the last checkpoint is the final one of the recipe's steps."""
    last = max(run.checkpoints)
    total = run.recipe.train.steps
    try:
        final = bool(read_meta(run.checkpoints[last]).get("final"))
    except Exception:
        final = False
    if final and last >= total:
        return True, f"finished (step {last})"
    return False, f"unfinished (step {last} of {total})"


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
        runs, absent = _open(study)
        for name, why in absent.items():
            print(f"study {study.name}: pilot run {name}: {why}; left out of the analysis")
        for name, run in runs.items():
            O.analyze_run(run, None, study.suite_options(study.every_checkpoint))  # default: the core four
            done, state = _progress(run)
            if not done and _pilot(study.runs[name].config):
                print(
                    f"study {study.name}: pilot run {name} is {state}: its checkpoints are analysed, the study's "
                    "measures wait for its last step"
                )
                continue
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
    """The run's training wall time: result.json's, else (a run stopped before its end) its last checkpoint's."""
    f = run.path / "result.json"
    try:
        return float(json.loads(f.read_text())["wall_s"])
    except (OSError, ValueError, KeyError):
        pass
    try:
        return float(read_meta(run.checkpoints[max(run.checkpoints)])["wall_s"])
    except Exception:
        return float("nan")


def write_report(study) -> int:
    t0 = time.time()
    out = study.report or (study.root / "report.md")
    try:
        runs, absent = _open(study)
        text, records, notes, extra = _report(study, runs, absent)
    except O.AnalysisError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    _save_time(study, "report_s", time.time() - t0)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text.replace("{REPORT_S}", f"{_times(study).get('report_s', float('nan')):.0f}"))
    if records:
        C.write_json(out.with_suffix(".json"), study.name, records, notes, extra)
    print(f"study {study.name}: report written to {out}" + (f" and {out.with_suffix('.json')}" if records else ""))
    return 0


class _Doc:
    """Markdown lines plus the figures it shows, copied next to the document."""

    def __init__(self, study):
        self.lines: list[str] = []
        self.base = (study.report or study.root / "report.md").parent
        self.fig_dir = self.base / "figures" / study.name
        self.fig_dir.mkdir(parents=True, exist_ok=True)
        self.data: dict = {}  # machine-readable extras for the JSON twin (pilots, the locality configuration)

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
    """Configuration name -> its opened runs in seed order (configurations none of whose runs exist are left out)."""
    out = {c: [runs[r.name] for r in rs if r.name in runs] for c, rs in study.configs().items()}
    return {c: v for c, v in out.items() if v}


def _identity_mask(run, blocks) -> np.ndarray:
    """Which of a ResNet run's residual blocks (names as the norm_ratio result lists them) have an identity shortcut,
    read off the model its recipe builds."""
    model = build_model(run.recipe, 10)
    return np.array([getattr(model.get_submodule(str(b)), "downsample", None) is None for b in blocks], dtype=bool)


def _resnet_blocks(run) -> list[str]:
    model = build_model(run.recipe, 10)
    return [n for n, m in model.named_modules() if n.count(".") == 1 and n.startswith("layer")]


# ------------------------------------------------------------------------------------------------ pilot runs


def _attention_by_step(run) -> dict[int, np.ndarray | None]:
    """{step: attention distances [L, H] (patch-centre pixels), or None where not measured} at every checkpoint the run
    has and every step whose analysis folder holds an attention distance (checkpoints pruned by keep_last included)."""
    steps = set(run.checkpoints)
    adir = run.path / "analysis"
    if adir.is_dir():
        for d in adir.iterdir():
            m = STEP_RE.match(d.name)
            if m and (d / "attention_distance.npz").is_file():
                steps.add(int(m.group(1)))
    out = {}
    for s in sorted(steps):
        try:  # a run still training may be writing it right now
            r = storage.load_results(storage.step_dir(run.path, s), ["attention_distance"]).get("attention_distance")
        except Exception:
            r = None
        out[s] = None if r is None else np.asarray(r["pixels"], dtype=float)
    return out


def _uniform(run) -> tuple[int, float]:
    m = run.recipe.model
    grid = run.recipe.data.img_size // m.patch_size
    return grid, C.uniform_distance(grid, m.patch_size)


def check_step(recipe) -> int:
    """The step of a pilot's go/no-go check: its second scheduled checkpoint."""
    return 2 * recipe.train.checkpoint_every


def pilot_check(run) -> tuple[str, str]:
    """claims.go_no_go of an opened run (analysis.offline.open_run) at :func:`check_step`, from the attention distance
    its training-time callback (or the analyze stage) measured there: (outcome, one sentence with the numbers)."""
    _, uniform = _uniform(run)
    return C.go_no_go(_attention_by_step(run), uniform, check_step(run.recipe))


def _distance_table(by_step: dict, uniform: float) -> list[str]:
    """Attention distance by block (rows) at every checkpoint (columns): smallest head / mean over heads, pixels."""
    steps = sorted(by_step)
    depth = max((len(d) for d in by_step.values() if d is not None), default=0)
    lines = ["| block | " + " | ".join(f"step {s}" for s in steps) + " |", "| --- |" + " --- |" * len(steps)]
    for b in range(depth):
        cells = [
            f"{d[b].min():.1f} / {d[b].mean():.1f}" if d is not None and b < len(d) else "-" for d in by_step.values()
        ]
        lines.append(f"| {b} | " + " | ".join(cells) + " |")
    early = [f"{d[: C.GO_BLOCKS].min() / uniform:.2f}" if d is not None else "-" for d in by_step.values()]
    lines.append(f"| blocks 0-{C.GO_BLOCKS - 1}: smallest / uniform | " + " | ".join(early) + " |")
    return lines


def _pilot_section(study, runs: dict, absent: dict, doc) -> None:
    """Attention distance by block at every checkpoint of every run of the configurations named vit_*, a figure of the
    latest measured checkpoint of each, and each run's go/no-go (claims.go_no_go)."""
    configs = {c: rs for c, rs in study.configs().items() if c.startswith("vit_")}
    if not configs:
        return
    doc.add(
        "## Pilot runs: choosing a regime where local heads can appear",
        "",
        "Raghu et al. 2021 Fig. 3 (ViTs pretrained on JFT-300M) shows local and global heads in the lowest blocks; "
        'Fig. 4 (ImageNet alone) shows that "with not enough data, ViT *does not learn to attend locally* in earlier '
        'layers". The locality claims below mean something only in a regime that can learn local heads. For every '
        "ViT configuration: the mean attention distance (patch centres, pixels) by block at every checkpoint, as "
        "smallest head / mean over heads, against uniform attention's distance on the same grid. "
        f"Go/no-go: **go** when some head of the first {C.GO_BLOCKS} blocks is below {C.GO_FRACTION:g} x uniform at "
        f"the run's second scheduled checkpoint, else **no-go**; the study's train stage (a configuration with "
        "`go_no_go: true`) trains the first seed to that checkpoint, and trains the configuration on only after a "
        "go. Why {C.GO_FRACTION:g}: a head counts as local below "
        f"{C.LOCAL_FRACTION:g} x uniform (on a 7x7 grid, a head spread evenly over the 5x5 window around its query is "
        "at 0.48 x; the positive control's forced 3x3-window head, recipes/positive_control.yaml, at 0.28 x), while "
        "the default 4-epoch regime, which has no local head, keeps every head between 0.93 and 1.09 x uniform; "
        f"early in training a head on its way to local must have left that band clearly, and {C.GO_FRACTION:g} is "
        "the midpoint of 0.5 and 0.93, rounded.",
        "",
    )
    pilots, panels = {}, {}
    for c, srs in configs.items():
        for sr in srs:
            if sr.name not in runs:
                why = absent.get(sr.name, "not trained")
                doc.add(f"**{sr.name}**: {why}: no attention distance to show. Go/no-go: **{C.UNDECIDED}**.", "")
                pilots[sr.name] = {"configuration": c, "state": why, "go": C.UNDECIDED}
                continue
            run = runs[sr.name]
            _, state = _progress(run)
            if run.recipe.model.arch != "vit":
                doc.add(f"**{sr.name}**: model.arch {run.recipe.model.arch}, not a ViT: no attention heads.", "")
                continue
            grid, uniform = _uniform(run)
            by = _attention_by_step(run)
            outcome, why = pilot_check(run)
            doc.add(
                f"**{sr.name}** ({state}; {grid}x{grid} grid of {run.recipe.model.patch_size}-pixel patches, "
                f"{run.recipe.model.num_heads} heads; uniform attention {uniform:.2f} px). Go/no-go: **{outcome}**: {why}.",
                "",
                *_distance_table(by, uniform),
                "",
            )
            measured = [s for s, d in by.items() if d is not None]
            if measured:
                panels[f"{sr.name}, step {max(measured)}"] = (by[max(measured)], uniform)
            pilots[sr.name] = {
                "configuration": c,
                "state": state,
                "go": outcome,
                "why": why,
                "uniform_px": uniform,
                "smallest_early_px": {
                    s: (float(d[: C.GO_BLOCKS].min()) if d is not None else None) for s, d in by.items()
                },
            }
    doc.data["pilots"] = pilots
    if panels:
        path = study.root / "pilots" / "attention_distance.png"
        path.parent.mkdir(parents=True, exist_ok=True)
        save(
            attention_distance_panels(
                panels,
                C.GO_FRACTION,
                "Mean attention distance per head by block (cf. Raghu Fig. 3: enough data; Fig. 4: ImageNet only)",
                "pixels",
            ),
            path,
        )
        doc.figure(
            path,
            "pilot_attention_distance",
            "Mean attention distance (patch centres, pixels) of every head (dots) by "
            "block, one panel per run at its latest measured checkpoint; dotted: uniform attention on the grid, "
            f"dashed: the go threshold ({C.GO_FRACTION:g} x uniform). Raghu Fig. 3 (enough data): the lowest blocks "
            "mix heads near zero with heads near the image size; Fig. 4 (not enough data): no head is local.",
        )


def _locality(study, runs: dict, absent: dict, configs: dict) -> dict:
    """Which configuration the locality claims read: {"config", "runs", "why"}. vit_local when every seed has
    finished, else vit_cls with the reason."""
    fb = configs[FALLBACK][0]
    meta = read_meta(fb.checkpoints[max(fb.checkpoints)])
    n = meta.get("data", {}).get("train_size")
    epochs = (
        f"{max(fb.checkpoints) * meta.get('global_batch', 0) / n:.0f} epochs of {n:,} images"
        if n
        else f"{max(fb.checkpoints)} steps"
    )
    regime = (
        f'the study\'s standard training ({epochs}); Raghu Fig. 4: with "not enough data" ViT "does not learn to '
        'attend locally" in earlier layers, so a "not testable" there says that this regime has no local head, '
        "not that the papers are wrong"
    )
    srs = study.configs().get(LOCALITY)
    if not srs:
        return {
            "config": FALLBACK,
            "runs": configs[FALLBACK],
            "why": f"The study has no {LOCALITY} configuration, so the locality claims read {FALLBACK}, {regime}.",
        }
    first = srs[0]
    if first.name in runs and not _progress(runs[first.name])[0]:
        outcome, verdict = pilot_check(runs[first.name])
        if outcome == C.NO_GO:
            return {
                "config": FALLBACK,
                "runs": configs[FALLBACK],
                "stopped": True,
                "why": f"{LOCALITY} stopped at its go/no-go check ({first.name}: {verdict}), so the locality "
                f"claims read {FALLBACK}, {regime}; the longer regime this study affords did not show "
                "local heads either (see the pilot section).",
            }
    pending = []
    for sr in srs:
        if sr.name not in runs:
            pending.append(f"{sr.name}: {absent.get(sr.name, 'not trained')}")
        elif not _progress(runs[sr.name])[0]:
            pending.append(f"{sr.name}: {_progress(runs[sr.name])[1]}")
    if pending:
        return {
            "config": FALLBACK,
            "runs": configs[FALLBACK],
            "why": f"{LOCALITY} has not finished ({'; '.join(pending)}), so the locality claims read {FALLBACK}, {regime}.",
        }
    seeds = ", ".join(str(sr.seed) for sr in srs if sr.seed is not None) or "its recipe's"
    return {
        "config": LOCALITY,
        "runs": configs[LOCALITY],
        "why": f"The locality claims read {LOCALITY} (seeds {seeds}; recipes/vit_local.yaml: 8 heads, about 20 epochs with "
        f"shift, flip, CutMix and mixup), the regime the pilot runs above chose, and not {FALLBACK}: that is "
        'the default 4-epoch regime, Raghu Fig. 4\'s "not enough data" regime, in which ViT "does not learn '
        'to attend locally" in earlier layers.',
    }


# ------------------------------------------------------------------------------------------------ positive control


def control_check(run, uniform: float) -> dict:
    """The locality detectors on the positive control run (recipes/positive_control.yaml: interventions.local_attention
    forces heads local or offset) at its last checkpoint: for every forced head, its attention distance and whether
    attention distance (below claims.LOCAL_FRACTION x ``uniform``) and aligned attention (local; offset local with its
    peak at the forced offset, or not offset for a centred window) report it as built. ``passed``: all of them do."""
    dist = np.asarray(_last(run, "attention_distance")["pixels"], dtype=float)
    al = _last(run, "aligned_attention")
    local, offset, peaks = (
        np.asarray(al["local"], bool),
        np.asarray(al["offset_local"], bool),
        np.asarray(al["peak_offset"]),
    )
    heads, ok = [], True
    for e in run.recipe.interventions.local_attention or []:
        for b in e.blocks:
            for h in e.heads:
                want_offset = tuple(e.offset) != (0, 0)
                px = float(dist[b, h])
                found = {
                    "distance": px < C.LOCAL_FRACTION * uniform,
                    "aligned_local": bool(local[b, h]),
                    "offset": bool(offset[b, h]) == want_offset
                    and (not want_offset or tuple(int(v) for v in peaks[b, h]) == tuple(e.offset)),
                }
                ok = ok and all(found.values())
                heads.append(
                    {
                        "block": b,
                        "head": h,
                        "offset": list(e.offset),
                        "radius": e.radius,
                        "distance_px": px,
                        "ratio": px / uniform,
                        "peak": [int(v) for v in peaks[b, h]],
                        "found": found,
                    }
                )
    forced = {(x["block"], x["head"]) for x in heads}
    free_local = [
        f"block {b} head {h}" for b, h in zip(*np.nonzero(dist < C.LOCAL_FRACTION * uniform)) if (b, h) not in forced
    ]
    return {
        "run": run.name,
        "passed": bool(heads) and ok,
        "heads": heads,
        "free_local": free_local,
        "uniform_px": uniform,
    }


def _control_section(study, configs: dict, doc) -> dict | None:
    """The positive control's section: the forced heads and what each detector reports for them (None without it)."""
    runs = configs.get(CONTROL)
    doc.add("## Positive control: do the locality detectors find heads built to be local?", "")
    if not runs:
        doc.add(
            f"This study has no {CONTROL} configuration (recipes/positive_control.yaml), so the locality verdicts rest "
            "on the detectors' tests on a tiny model (tests/test_positive_control.py) alone.",
            "",
        )
        return None
    run = runs[0]
    _, uniform = _uniform(run)
    c = control_check(run, uniform)
    doc.add(
        f"{run.name}: the default ViT with heads forced by an attention mask (interventions.local_attention), trained "
        f"{max(run.checkpoints)} steps; uniform attention on its grid {uniform:.2f} px, local below "
        f'{C.LOCAL_FRACTION:g} x = {C.LOCAL_FRACTION * uniform:.2f} px. A "did not hold" or "not testable" about '
        "locality below means something only if these detectors find the forced heads.",
        "",
        "| forced head | window | attention distance (px, x uniform) | local by distance | local by aligned attention | "
        "offset as built (peak) |",
        "| --- | --- | --- | --- | --- | --- |",
    )
    yes = {True: "yes", False: "**no**"}
    for x in c["heads"]:
        f = x["found"]
        doc.add(
            f"| block {x['block']} head {x['head']} | offset ({x['offset'][0]}, {x['offset'][1]}), radius {x['radius']} | "
            f"{x['distance_px']:.2f} ({x['ratio']:.2f} x) | {yes[f['distance']]} | {yes[f['aligned_local']]} | "
            f"{yes[f['offset']]} ({x['peak'][0]}, {x['peak'][1]}) |"
        )
    doc.add(
        "",
        f"Detectors: **{'passed' if c['passed'] else 'FAILED'}**"
        + (
            f"; heads that are local without being forced: {', '.join(c['free_local'])}"
            if c["free_local"]
            else "; no free head is local"
        )
        + ".",
        "",
    )
    doc.data["positive_control"] = c
    return c


# ------------------------------------------------------------------------------------------------ CKA floors


def _cka_floors(run, opts) -> dict:
    """analysis.baselines.cka_floors of a run's last checkpoint, with the study's CKA options; cached in
    analysis/step_X/baselines/ under a key of the weights, the images and the options. The random-init model is the
    run's recipe built under torch seed = the run's seed (a fresh initialisation of the same architecture, not
    necessarily the training run's own starting weights: the trainer draws from the generator before building it)."""
    step = max(run.checkpoints)
    out = O.step_dir(run, step) / "baselines"
    key = storage.cache_key(
        O.weights_key(run, step) + f":init-seed-{run.recipe.seed}",
        O.fingerprint(run),
        opts.settings("cka"),
        "cka_floors",
    )
    if storage.is_cached(out, "cka_floors", key):
        return load_result(out / "cka_floors.npz")
    data = O.load_data(run)
    model = O.load_model(run, step, data)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(run.recipe.seed)
        init = build_model(run.recipe, data.num_classes).eval()
    co = opts.of("cka")
    ctx = make_context(model, data, opts.batch_size)
    res = B.cka_floors(
        model,
        init,
        data.analysis.images,
        data.normalize,
        cka_layers(ctx, co.layers),
        ctx.prefix,
        co.repr,
        opts.batch_size,
        co.unbiased,
    )
    out.mkdir(parents=True, exist_ok=True)
    save_result(res, out / "cka_floors.npz")
    storage.atomic_text(out / "cache.json", json.dumps({"cka_floors": key}))
    return load_result(out / "cka_floors.npz")


def _uniformity(m) -> dict:
    """claims.uniformity of a map in which some layers may have no CKA (nan: constant at initialisation)."""
    m = np.asarray(m, dtype=float)
    return {"mean_offdiag": float(np.nanmean(m[~np.eye(len(m), dtype=bool)])), "first_last": float(m[0, -1])}


def _floors_section(doc, arch: list, opts, root: Path) -> None:
    """Beside the CKA maps: each model's map numbers against its random initialisation, each block output's CKA with
    the pixels and with its initialisation (table), every layer's (figure)."""
    doc.add(
        "**What the maps are read against.** A layer's CKA with the raw pixels (the flattened normalised input) "
        "is how much of its similarity structure the input already has; Raghu's localization (Fig. 9) compares "
        "tokens with input patches the same way. A model of the same architecture at random initialisation gives "
        "the floor of structure that needs no learning: a random ViT carries its input through every block on the "
        'skip connections, so its own map is already near-uniform, and "ViT maps are uniform" means something '
        "only above it; a trained layer's CKA with the same layer at initialisation is how far training moved it. "
        "Same images, layers, representation and estimator as the maps; seed 0 of each configuration.",
        "",
        "| model | mean off-diagonal CKA, trained | ... at random init | first-last CKA, trained | ... at random init |",
        "| --- | --- | --- | --- | --- |",
    )
    floors = {r.name: _cka_floors(r, opts) for r in arch}
    constant = []
    for name, f in floors.items():
        u, ui = _uniformity(f["matrix"]), _uniformity(f["init_matrix"])
        doc.add(
            f"| {name} | {u['mean_offdiag']:.3f} | {ui['mean_offdiag']:.3f} | {u['first_last']:.3f} | {ui['first_last']:.3f} |"
        )
        dead = [str(lab) for lab, x in zip(f["labels"], np.diag(f["init_matrix"])) if not np.isfinite(x)]
        if dead:
            constant.append(f"{name}: {len(dead)} (e.g. {dead[0]})")
    if constant:
        doc.add(
            "",
            "Layers that are constant at random initialisation have no CKA (nan) and are left out of the means: "
            + "; ".join(constant)
            + " (timm zero-initialises the last BatchNorm of each ResNet block).",
        )
    doc.add(
        "",
        "| model | block output | CKA with pixels, trained | ... at random init | CKA trained vs the same layer at init |",
        "| --- | --- | --- | --- | --- |",
    )
    panels = {}
    for name, f in floors.items():
        labels, taps = [str(x) for x in f["labels"]], [str(x) for x in f["taps"]]
        for i, t in enumerate(taps):
            if t.endswith(".out"):
                doc.add(
                    f"| {name} | {labels[i]} | {f['pixels'][i]:.3f} | {f['init_pixels'][i]:.3f} | {f['init_same'][i]:.3f} |"
                )
        panels[name] = (
            labels,
            {
                "trained vs pixels": f["pixels"],
                "random init vs pixels": f["init_pixels"],
                "trained vs same layer at init": f["init_same"],
            },
        )
    doc.add("")
    path = root / "compare-arch" / "cka_floors.png"
    path.parent.mkdir(parents=True, exist_ok=True)
    lo = min(0.0, *(float(np.nanmin(np.r_[f["pixels"], f["init_pixels"], f["init_same"]])) for f in floors.values()))
    save(
        layer_lines(
            panels, "CKA", "CKA floors of each layer: the raw pixels and the random initialisation", (lo, 1.02)
        ),
        path,
    )
    doc.figure(
        path,
        "cka_floors",
        "Every layer's CKA with the raw pixels (trained and at random init) and with the same "
        "layer at random init: the floors the CKA maps above are read against",
    )


_MARK = {
    C.HELD: "**held**",
    C.NOT_HELD: "**did not hold**",
    C.INCONCLUSIVE: "**inconclusive**",
    C.NOT_TESTABLE: "**not testable**",
}


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
    doc.add(
        f"## {n}. {claim.claim} ({claim.figure})",
        "",
        f'> "{claim.passage}" — {claim.source}',
        "",
        f"Rule: {claim.rule}",
        "",
    )
    doc.add(f"Paper: {claim.paper_value or 'no number in the text'}. Ours: {v.ours or 'see the measured values'}.", "")
    doc.add(f"Verdict: {_MARK[v.outcome]}. {v.why}", "")


def _report(study, runs: dict, absent: dict | None = None) -> tuple[str, list, list, dict]:
    absent = absent or {}
    doc = _Doc(study)
    times = _times(study)
    train_wall = {n: _train_wall(r) for n, r in runs.items()}
    configs = _configs(study, runs)
    walmer = walmer_report.applies(configs)  # objectives compared: supervised / dino / mae (Walmer et al. 2023)
    title = "Teaching matters: the training objective" if walmer else "Reproduction"
    doc.add(
        f"# {title}: {study.name}",
        "",
        f"Generated by `./launch.sh study {study.path.relative_to(study.path.parents[2]) if len(study.path.parents) > 2 else study.path}` "
        "from the saved runs; every number below is computed by the project "
        f"({'analysis/reports/claims_walmer.py' if walmer else 'analysis/reports/claims.py'} on the results of "
        "analysis/measures/*.py), so rerunning the study regenerates this page and its JSON twin.",
        "",
        "## Runs",
        "",
        "| run | configuration | seed | recipe overrides | test top-1 (± binomial SE) | training wall (s) |",
        "| --- | --- | --- | --- | --- | --- |",
    )
    for n, sr in study.runs.items():
        seed, ov = "-" if sr.seed is None else sr.seed, " ".join(sr.overrides) or "-"
        if n not in runs:
            doc.add(f"| {n} | {sr.config} | {seed} | {ov} | {absent.get(n, 'not trained')} | - |")
            continue
        r, (done, state) = runs[n], _progress(runs[n])
        p = _top1(r)
        doc.add(
            f"| {n} | {sr.config} | {seed} | {ov} | {p:.4f} ± {C.binomial_se(p, _eval_n(r)):.4f}"
            f"{'' if done else ' (' + state + ')'} | {train_wall[n]:.0f} |"
        )
    total_train = np.nansum(list(train_wall.values()))
    doc.add(
        "",
        f"Wall time on this machine: training {total_train / 60:.0f} min in all (each run's own wall time, other jobs "
        f"included); the last invocation's analysis stage {times.get('analyze_s', float('nan')) / 60:.1f} min (results "
        "cached by earlier invocations are not recomputed); comparisons and this report {REPORT_S} s. Measure options: "
        f"{json.dumps(study.options) if study.options else 'the defaults'}.",
        "",
    )
    if walmer:
        results, notes = walmer_report.walmer2023(study, configs, doc, _section)
    else:
        _pilot_section(study, runs, absent, doc)
        if not {"vit_cls", "resnet"} <= set(configs):
            return "\n".join(doc.lines) + "\n", [], [], doc.data
        results, notes = _raghu2021(study, configs, doc, _locality(study, runs, absent, configs))
    table = [
        "## Claims at a glance",
        "",
        f"Outcomes: held / did not hold (the effect, in the paper's direction or against it, exceeds {C.NOISE_FACTOR:g}x "
        f"the largest seed-to-seed difference of the same configuration, and {C.SE_FACTOR:g} binomial standard errors "
        "for top-1), inconclusive (within that noise floor), not testable (a precondition failed; the numbers say which).",
        "",
        "| # | claim (the paper's direction) | figure | paper | ours | noise floor (threshold) | verdict |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for i, (claim, v) in enumerate(results, 1):
        cells = (
            str(i),
            claim.claim,
            claim.figure,
            claim.paper_value or "-",
            v.ours or "-",
            _floor_text(v),
            _MARK[v.outcome],
        )
        table.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    if notes:
        table += ["", "What this study does not yet do:", ""] + [f"- {n}" for n in notes]
    at = doc.lines.index("## Runs")
    doc.lines[at:at] = [*table, ""]
    return "\n".join(doc.lines) + "\n", [C.record(c, v) for c, v in results], notes, doc.data


def _raghu2021(study, configs: dict, doc: _Doc, loc: dict) -> tuple[list, list]:
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
        notes.append(
            f"The ResNet baseline has no identity shortcut (0 of {len(blocks)} blocks): the uniformity and skip-dominance "
            "claims compare against the paper's ResNets, which have them."
        )
    add(
        "uniformity",
        C.rule_uniformity(
            [_last(r, "cka")["matrix"] for r in cls_runs],
            [_last(r, "cka")["matrix"] for r in res_runs],
            ident,
            len(blocks),
        ),
    )
    for r, rr in zip(cls_runs, res_runs):
        O.against(r, rr, max(rr.checkpoints), opts=opts, progress=False)
    arch = [cls] + ([configs["vit_gap"][0]] if "vit_gap" in configs else []) + [resnet]
    compare(arch, out=root / "compare-arch", opts=opts, progress=False)
    doc.figure(
        root / "compare-arch" / "cka_grid.png", "cka_arch", "CKA between layers: " + ", ".join(r.name for r in arch)
    )
    fig_dir = storage.against_dir(cls.path, max(cls.checkpoints), resnet.name, max(resnet.checkpoints), "figures")
    doc.figure(fig_dir / "cross_cka.png", "cka_vit_vs_resnet", "Cross-model CKA, ViT (x) vs ResNet (y) (Raghu Fig. 2)")
    _floors_section(doc, arch, opts, root)

    # 2. no-skip partitions (Fig. 8)
    ns = {int(k.rsplit("b", 1)[1]): v for k, v in configs.items() if k.startswith("noskip_b")}
    if ns:

        def rows(rs):
            return [
                {
                    "matrix": _last(r, "cka")["matrix"],
                    "labels": [str(s) for s in _last(r, "cka")["labels"]],
                    "top1": _top1(r),
                    "n": _eval_n(r),
                }
                for r in rs
            ]

        add(
            "noskip_partition",
            C.rule_noskip(rows(cls_runs), {b: rows(rs) for b, rs in ns.items()}, cls.recipe.model.depth),
        )
        compare([cls] + [ns[k][0] for k in sorted(ns)], out=root / "compare-noskip", opts=opts, progress=False)
        doc.figure(
            root / "compare-noskip" / "cka_grid.png",
            "cka_noskip",
            "CKA maps: normal ViT, then no skip at blocks " + ", ".join(str(k) for k in sorted(ns)),
        )

    # 3. skip dominance and the CLS phase transition (Fig. 7)
    nr = _last(resnet, "norm_ratio")
    add(
        "skip_dominance",
        C.rule_skip_dominance(
            [_last(r, "norm_ratio")["ratio"] for r in cls_runs],
            [_last(r, "norm_ratio")["ratio"] for r in res_runs],
            _identity_mask(resnet, [str(b) for b in nr["blocks"]]),
        ),
    )
    nv = _last(cls, "norm_ratio")
    add(
        "cls_phase",
        C.rule_cls_phase(
            [_last(r, "norm_ratio")["ratio"] for r in cls_runs],
            [str(s) for s in nv["sublayers"]],
            int(nv["num_prefix_tokens"]),
        ),
    )
    doc.figure(
        root / "compare-arch" / "norm_ratio.png",
        "norm_ratio_arch",
        "Norm ratios per block: " + ", ".join(r.name for r in arch),
    )

    # 4. local and global heads (Fig. 3) and head subsets (Fig. 5), on the locality configuration
    control = _control_section(study, configs, doc)
    if control is not None and not control["passed"]:
        notes.append(
            f"The positive control ({control['run']}) did not find every forced head: the locality verdicts "
            "below may reflect the detectors, not the models."
        )
    lname, lruns = loc["config"], loc["runs"]
    doc.add("## Which configuration the locality claims read", "", loc["why"], "")
    doc.data["locality_configuration"] = {"config": lname, "runs": [r.name for r in lruns], "why": loc["why"]}
    if lname != LOCALITY:
        notes.append(loc["why"])
    uniform = _uniform(lruns[0])[1]

    def locality(claim_id: str, v: C.Verdict):
        v.measured["configuration"] = lname
        add(claim_id, v)

    locality("head_mix", C.rule_head_mix([_last(r, "attention_distance")["pixels"] for r in lruns], uniform, lname))
    doc.figure(
        root / "compare-arch" / "attention_distance.png",
        "attention_distance",
        "Mean attention distance per head and "
        "block: "
        + ", ".join(r.name for r in arch)
        + (f" (the locality configuration {lname}: pilot figure above)" if lname != FALLBACK else ""),
    )
    subsets = []
    for r, rr in zip(lruns, res_runs):
        O.against(r, rr, max(rr.checkpoints), opts=opts, progress=False)
        subsets.append(
            load_result(
                storage.against_dir(r.path, max(r.checkpoints), rr.name, max(rr.checkpoints)) / "head_subsets.npz"
            )
        )
    locality("head_subsets", C.rule_head_subsets(subsets, uniform, lname))
    sub_fig = storage.against_dir(
        lruns[0].path, max(lruns[0].checkpoints), resnet.name, max(resnet.checkpoints), "figures"
    )
    doc.figure(
        sub_fig / "head_subsets.png",
        "head_subsets",
        f"{lruns[0].name}: block-0 heads from local to global: CKA of "
        "windows of consecutive heads (lines) and of single heads (circles) to the ResNet's lower layers (Raghu Fig. 5)",
    )

    # 5. CLS vs GAP: localization and spatial-token probes (Fig. 9, 10, 11 left)
    if "vit_gap" in configs:
        gap_runs = configs["vit_gap"]
        add(
            "cls_localization",
            C.rule_difference(
                "last-block own_share, CLS - GAP",
                [C.last_layer(_last(r, "localization")["own_share"]) for r in cls_runs],
                [C.last_layer(_last(r, "localization")["own_share"]) for r in gap_runs],
                ("vit_cls", "vit_gap"),
            ),
        )
        add(
            "gap_token_probes",
            C.rule_difference(
                "last-block mean token-probe accuracy, GAP - CLS",
                [C.last_layer(_last(r, "token_probes")["mean_over_tokens"]) for r in gap_runs],
                [C.last_layer(_last(r, "token_probes")["mean_over_tokens"]) for r in cls_runs],
                ("vit_gap", "vit_cls"),
            ),
        )
        for r, tag in ((cls, "cls"), (gap_runs[0], "gap")):
            d = storage.step_dir(r.path, max(r.checkpoints), "figures")
            doc.figure(
                d / "localization_score.png", f"localization_{tag}", f"Localization scores per block, {tag.upper()} ViT"
            )
            doc.figure(
                d / "token_probes_mean.png", f"token_probes_{tag}", f"Per-token 10-shot probes, {tag.upper()} ViT"
            )

    # 5b. effective receptive fields (Fig. 6) and intermediate linear probes (Fig. 13 right), ViT vs ResNet
    if all(_last(r, "erf") is not None for r in cls_runs + res_runs):
        add(
            "erf",
            C.rule_erf(
                [np.asarray(_last(r, "erf")["mean_distance"])[:, 0] for r in cls_runs],
                [np.asarray(_last(r, "erf")["mean_distance"])[:, 0] for r in res_runs],
            ),
        )
        for r, tag in ((cls, "vit"), (resnet, "resnet")):
            doc.figure(
                storage.step_dir(r.path, max(r.checkpoints), "figures") / "erf_maps.png",
                f"erf_{tag}",
                f"Effective receptive fields by block, {r.name} (Raghu Fig. 6, C.1, C.2)",
            )

    def mean_pool(r):
        fp = _last(r, "fewshot_probe")
        return np.asarray(fp["mean"], dtype=float)[as_list(fp["pools"]).index("mean")]

    if all(_last(r, "fewshot_probe") is not None for r in cls_runs + res_runs):
        add(
            "intermediate_probes",
            C.rule_difference(
                "middle-half 10-shot accuracy, ViT - ResNet",
                [C.middle_mean(mean_pool(r)) for r in cls_runs],
                [C.middle_mean(mean_pool(r)) for r in res_runs],
                ("vit_cls", "resnet"),
            ),
        )

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
            notes.append(
                "Subset runs choose no checkpoint: the trainer records eval top-1 on the test split only; a held-out "
                "validation split carved from train (meta 'val') is missing, so the last checkpoint is read."
            )
        doc.add("Checkpoints read: " + "; ".join(chosen) + ".", "")
        ordered = [subs[k][0] for k in sorted(subs)]
        compare(ordered, reference=(cls, max(cls.checkpoints)), out=root / "compare-subsets", opts=opts, progress=False)
        doc.figure(
            root / "compare-subsets" / "similarity_to_reference.png",
            "subsets",
            "CKA of each layer to the same layer of the 100% model",
        )

    # 7. offset local heads (Walmer Fig. 3, 14): the locality configuration, else the standard ViTs of the study
    vit_runs = lruns if lname == LOCALITY else [r for k in ("vit_cls", "vit_gap") for r in configs.get(k, [])]
    vits = {r.name: _last(r, "aligned_attention") for r in vit_runs}
    locality(
        "offset_heads",
        C.rule_offset_heads(
            {n: {"local": a["local"], "offset_local": a["offset_local"]} for n, a in vits.items() if a is not None}
        ),
    )
    d = storage.step_dir(lruns[0].path, max(lruns[0].checkpoints), "figures")
    doc.figure(
        d / "aligned_attention_maps.png",
        "aligned_attention",
        f"{lruns[0].name}: per offset, the mean attention over "
        "the queries that have that offset. Uniform attention is flat here, so a peak is a preference; in Walmer's "
        "aligned aggregated maps (next figure: each offset's share of all attention) uniform attention on a 7x7 grid "
        "already looks like a centred peak, because central offsets have the most queries",
    )
    doc.figure(
        d / "aligned_attention_mass_maps.png",
        "aligned_attention_mass",
        f"Aligned aggregated attention maps (Walmer §4.2), {lruns[0].name}",
    )
    return out, notes
