"""The analysis suite: CKA, norm ratios, attention distances and few-shot probes in ONE pass over the
analysis split (plus one pass over the probe-train split for the probes' training features).

The same function serves the training-time callbacks (analysis/callbacks.py) and offline analysis of saved
checkpoints. Minibatch j of the analysis split always holds the same images; with several processes,
process r takes the minibatches j = r (mod world) and every accumulator's sums are added over processes, so
1 and N processes give the same numbers.

Outputs (:func:`publish`): ``analysis/step_XXXXXXX/{cka,norm_ratio,attention_distance,probes}.npz``,
``summary.json``, PNG figures, and the same figures plus scalars in TensorBoard.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from analysis.cka import MinibatchCKA, represent
from analysis.norm_ratio import NormRatio
from analysis.taps import Taps, block_names, grid_of, is_vit

ALL = ("cka", "norm_ratio", "attention_distance", "fewshot_probe")


@dataclass
class SuiteOptions:
    measures: tuple = ALL
    batch_size: int = 256  # analysis minibatch = the CKA minibatch (>= 4)
    cka_repr: str = "flatten"  # flatten | cls | mean_spatial
    cka_unbiased: bool = True
    probe_shots: int = 10
    probe_seeds: tuple = (0, 1, 2)
    probe_pools: tuple = ("cls", "mean", "mean_spatial")


def cka_layers(model) -> list[tuple[str, str]]:
    """(tap name, label) of the layers compared by CKA: after each sublayer of a ViT block (Raghu Fig. 1 marks
    attention and MLP layers), each residual block's output in a ResNet."""
    if is_vit(model):
        return [(f"{b}.{k}", f"{b.split('.')[1]}.{s}") for b in block_names(model) for k, s in (("attn_out", "attn"), ("out", "mlp"))]
    return [(f"{b}.out", b) for b in block_names(model)]


def _shard(n_batches: int, accelerator) -> range:
    if accelerator is None or accelerator.num_processes == 1:
        return range(n_batches)
    return range(accelerator.process_index, n_batches, accelerator.num_processes)


def _gather_objects(items: list, accelerator) -> list:
    if accelerator is None or accelerator.num_processes == 1:
        return items
    from accelerate.utils import gather_object

    return gather_object(items)


@torch.no_grad()
def _features(model, data, split, taps: list[str], batch_size: int, device, accelerator, on_batch=None):
    """Run ``split`` through ``model`` in fixed minibatches (sharded over processes), calling
    ``on_batch(j, captures, labels)`` for each; returns nothing (accumulators live in the callback)."""
    n = len(split)
    n_batches = (n + batch_size - 1) // batch_size
    for j in _shard(n_batches, accelerator):
        x = split.images[j * batch_size:(j + 1) * batch_size].to(device)
        y = split.labels[j * batch_size:(j + 1) * batch_size]
        with Taps(model, taps) as cap:
            model(data.normalize(x))
        on_batch(j, cap.captures, y)


def _pool(t: torch.Tensor, how: str, num_prefix: int) -> torch.Tensor:
    if t.ndim == 4:  # ResNet: mean over positions for every pooling
        return t.mean(dim=(2, 3))
    from analysis.probes import pool_tokens

    return pool_tokens(t, how, num_prefix)


def probe_pools(model, opts: SuiteOptions) -> list[str]:
    if not is_vit(model):
        return ["mean"]
    return [p for p in opts.probe_pools if not (p == "cls" and model.num_prefix_tokens == 0)]


@torch.no_grad()
def run_suite(model, data, opts: SuiteOptions | None = None, accelerator=None) -> dict:
    """All requested measurements of ``model`` on ``data.analysis`` (and ``data.probe_train``); returns numpy
    arrays and labels (see :func:`write_results`)."""
    from analysis.attention import AttentionDistance

    opts = opts or SuiteOptions()
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    vit = is_vit(model)
    blocks = block_names(model)
    prefix = model.num_prefix_tokens if vit else 0
    want = set(opts.measures)
    if not vit:
        want.discard("attention_distance")

    taps: set[str] = set()
    layers = cka_layers(model)
    if "cka" in want:
        taps |= {t for t, _ in layers}
    if "norm_ratio" in want:
        taps |= ({f"{b}.{k}" for b in blocks for k in ("in", "attn_branch", "attn_out", "mlp_branch")} if vit
                 else {f"{b}.{k}" for b in blocks for k in ("shortcut", "branch")})
    if "attention_distance" in want:
        taps |= {f"{b}.attn_probs" for b in blocks}
    probe_taps = [f"{b}.out" for b in blocks]
    if "fewshot_probe" in want:
        taps |= set(probe_taps)
    taps = sorted(taps)

    cka = MinibatchCKA(unbiased=opts.cka_unbiased)
    nr = NormRatio()
    ad = AttentionDistance(grid_of(model), model.patch_embed.patch_size[0], prefix) if vit else None
    pools = probe_pools(model, opts)
    test_feats: list = []

    def on_batch(j, cap, y):
        if "cka" in want:
            cka.update([represent(cap[t], opts.cka_repr, prefix) for t, _ in layers])
        if "norm_ratio" in want:
            for b in blocks:
                if vit:
                    nr.update(b, "attn", cap[f"{b}.in"], cap[f"{b}.attn_branch"])
                    nr.update(b, "mlp", cap[f"{b}.attn_out"], cap[f"{b}.mlp_branch"])
                else:
                    nr.update(b, "block", cap[f"{b}.shortcut"], cap[f"{b}.branch"])
        if "attention_distance" in want:
            for i, b in enumerate(blocks):
                ad.update(i, cap[f"{b}.attn_probs"])
        if "fewshot_probe" in want:
            test_feats.append((j, {(t, p): _pool(cap[t], p, prefix).float().cpu() for t in probe_taps for p in pools}, y))

    if len(data.analysis) < 4:
        raise ValueError(f"the analysis split has {len(data.analysis)} images; the suite needs at least 4 (data.analysis_size).")
    _features(model, data, data.analysis, taps, opts.batch_size, device, accelerator, on_batch)
    out: dict = {"blocks": blocks, "num_prefix_tokens": prefix, "n_images": len(data.analysis)}

    if "cka" in want:
        cka.sync(accelerator)
        out["cka"] = {"matrix": cka.compute().numpy(), "labels": [lab for _, lab in layers], "repr": opts.cka_repr}
    if "norm_ratio" in want:
        nr.sync(accelerator)
        res = nr.compute()
        subs = ["attn", "mlp"] if vit else ["block"]
        # ViT: [sublayer, block, token]; ResNet stages differ in size, so positions are averaged: [1, block, 1]
        per_token = (lambda v: v.numpy()) if vit else (lambda v: v.mean(0, keepdim=True).numpy())
        out["norm_ratio"] = {
            "ratio": np.stack([np.stack([per_token(res[(b, s)][0]) for b in blocks]) for s in subs]),
            "cosine": np.stack([np.stack([per_token(res[(b, s)][1]) for b in blocks]) for s in subs]),
            "sublayers": subs,
        }
    if "attention_distance" in want:
        ad.sync(accelerator)
        px, unit = ad.compute(), ad.compute_unit_square()
        out["attention_distance"] = {"pixels": np.stack([px[i].double().numpy() for i in range(len(blocks))]),
                                     "unit_square": np.stack([unit[i].double().numpy() for i in range(len(blocks))])}
    if "fewshot_probe" in want:
        out["fewshot_probe"] = _probes(model, data, opts, accelerator, test_feats, probe_taps, pools, prefix, device)
    model.train(was_training)
    return out


def _collect(parts: list, accelerator) -> tuple[dict, torch.Tensor]:
    parts = sorted(_gather_objects(parts, accelerator), key=lambda p: p[0])
    keys = parts[0][1].keys()
    return {k: torch.cat([p[1][k] for p in parts]) for k in keys}, torch.cat([p[2] for p in parts])


def probe_split_problem(data, shots: int) -> str | None:
    """One sentence if the probe-train split cannot give ``shots`` per class from its shot half, else None."""
    counts = torch.bincount(data.probe_train.labels, minlength=data.num_classes)
    if len(counts) and int(counts.min()) // 2 >= shots:
        return None
    return (f"few-shot probes draw {shots} shots per class from half of the probe-train split, whose rarest class has "
            f"{int(counts.min()) if len(counts) else 0} images: raise data.probe_train_size to at least {2 * shots * data.num_classes} "
            "or lower the callback's shots.")


def _probes(model, data, opts, accelerator, test_parts, probe_taps, pools, prefix, device) -> dict:
    """10-shot probes per layer and pooling: shots from the first half of probe_train (seeded, per seed), the
    regulariser picked on the second half, top-1 on the analysis images."""
    from analysis.probes import probe_layers

    train_parts: list = []

    def on_batch(j, cap, y):
        train_parts.append((j, {(t, p): _pool(cap[t], p, prefix).float().cpu() for t in probe_taps for p in pools}, y))

    _features(model, data, data.probe_train, probe_taps, opts.batch_size, device, accelerator, on_batch)
    test_x, test_y = _collect(test_parts, accelerator)
    pool_x, pool_y = _collect(train_parts, accelerator)
    from train.data import balanced_indices

    problem = probe_split_problem(data, opts.probe_shots)
    if problem:
        raise ValueError(problem)
    half = balanced_indices(pool_y.numpy(), len(pool_y) // 2, seed=12345)
    rest = np.setdiff1d(np.arange(len(pool_y)), half)
    shot_idx, val_idx = torch.as_tensor(half), torch.as_tensor(rest)
    res = {}
    for p in pools:
        tr = {t: pool_x[(t, p)][shot_idx] for t in probe_taps}
        va = {t: pool_x[(t, p)][val_idx] for t in probe_taps}
        te = {t: test_x[(t, p)] for t in probe_taps}
        r = probe_layers(tr, pool_y[shot_idx], te, test_y, shots=opts.probe_shots, seeds=tuple(opts.probe_seeds),
                         val_feats=va, val_y=pool_y[val_idx])
        res[p] = {"mean": np.array([r[t][0] for t in probe_taps]), "std": np.array([r[t][1] for t in probe_taps])}
    return {"pools": list(pools), "layers": probe_taps, "shots": opts.probe_shots, "seeds": list(opts.probe_seeds),
            "mean": np.stack([res[p]["mean"] for p in pools]), "std": np.stack([res[p]["std"] for p in pools]),
            "chance": 1.0 / data.num_classes}


# ---------------------------------------------------------------- writing and logging


def summary_of(res: dict) -> dict:
    """Key numbers of a suite result (what summary.json and report tables show)."""
    s: dict = {"n_images": res["n_images"], "blocks": len(res["blocks"])}
    if "cka" in res:
        m = res["cka"]["matrix"]
        off = m[~np.eye(len(m), dtype=bool)]
        s["cka"] = {"mean_offdiag": float(off.mean()) if off.size else 1.0, "first_last": float(m[0, -1]),
                    "adjacent_mean": float(np.mean([m[i, i + 1] for i in range(len(m) - 1)])) if len(m) > 1 else 1.0}
    if "norm_ratio" in res:
        r = res["norm_ratio"]["ratio"]
        p = res["num_prefix_tokens"]
        d = {}
        for si, sub in enumerate(res["norm_ratio"]["sublayers"]):
            if p:
                d[f"{sub}/cls"] = [float(v) for v in r[si, :, 0]]
            d[f"{sub}/spatial"] = [float(v) for v in r[si, :, p:].mean(-1)]
        s["norm_ratio"] = d
    if "attention_distance" in res:
        px = res["attention_distance"]["pixels"]
        s["attention_distance"] = {"mean_px": [float(v) for v in px.mean(1)], "min_px": [float(v) for v in px.min(1)],
                                   "max_px": [float(v) for v in px.max(1)]}
    if "fewshot_probe" in res:
        fp = res["fewshot_probe"]
        s["fewshot_probe"] = {p: [float(v) for v in fp["mean"][i]] for i, p in enumerate(fp["pools"])}
    return s


def write_results(res: dict, out_dir: Path, step: int | None = None) -> Path:
    """Arrays (npz) and summary.json into ``out_dir``; returns it."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    if "cka" in res:
        np.savez(out_dir / "cka.npz", matrix=res["cka"]["matrix"], labels=np.array(res["cka"]["labels"]))
    if "norm_ratio" in res:
        np.savez(out_dir / "norm_ratio.npz", ratio=res["norm_ratio"]["ratio"], cosine=res["norm_ratio"]["cosine"],
                 sublayers=np.array(res["norm_ratio"]["sublayers"]), blocks=np.array(res["blocks"]))
    if "attention_distance" in res:
        np.savez(out_dir / "attention_distance.npz", **res["attention_distance"])
    if "fewshot_probe" in res:
        fp = res["fewshot_probe"]
        np.savez(out_dir / "probes.npz", mean=fp["mean"], std=fp["std"], pools=np.array(fp["pools"]), layers=np.array(fp["layers"]))
    summary = {"step": step, **summary_of(res)}
    tmp = out_dir / "summary.json.tmp"
    tmp.write_text(json.dumps(summary, indent=1))
    tmp.replace(out_dir / "summary.json")
    return out_dir


def publish(res: dict, out_dir: Path, writer=None, step: int | None = None, figures: bool = True) -> Path:
    """Write arrays + summary.json, log scalars, and draw each figure once for both PNG and TensorBoard."""
    write_results(res, out_dir, step)
    log_results(res, writer, step)
    if figures:
        import matplotlib.pyplot as plt

        from analysis.figures import save

        for name, fig in make_figures(res, step).items():
            if writer is not None:
                writer.add_figure(name, fig, step, close=False)
            save(fig, Path(out_dir) / f"{name.replace('/', '_')}.png")
            plt.close(fig)
    return Path(out_dir)


def make_figures(res: dict, step: int | None = None) -> dict:
    from analysis import figures as F

    at = f" (step {step})" if step is not None else ""
    figs = {}
    if "cka" in res:
        figs["cka/self"] = F.cka_heatmap(res["cka"]["matrix"], res["cka"]["labels"], title=f"CKA{at}")
    if "norm_ratio" in res:
        nr, p, blocks = res["norm_ratio"], res["num_prefix_tokens"], [b.split(".", 1)[-1] for b in res["blocks"]]
        curves = {}
        for si, sub in enumerate(nr["sublayers"]):
            figs[f"norm_ratio/{sub}"] = F.norm_ratio_heatmap(nr["ratio"][si], blocks, title=f"norm ratio, {sub}{at}", has_cls=p > 0)
            if p:
                curves[f"{sub} CLS"] = nr["ratio"][si, :, 0]
            curves[f"{sub} spatial"] = nr["ratio"][si, :, p:].mean(-1)
        figs["norm_ratio/lines"] = F.norm_ratio_lines(curves, title=f"norm ratio ||z||/||f(z)||{at}")
    if "attention_distance" in res:
        figs["attn_dist/heads"] = F.attention_distance_plot(res["attention_distance"]["pixels"], title=f"attention distance{at}")
    if "fewshot_probe" in res:
        fp = res["fewshot_probe"]
        curves = {p: (fp["mean"][i], fp["std"][i]) for i, p in enumerate(fp["pools"])}
        figs["probe/10shot"] = F.probe_plot(curves, title=f"{fp['shots']}-shot linear probe{at}", chance=fp["chance"])
    return figs


def log_results(res: dict, writer, step: int) -> None:
    """TensorBoard scalars (tags as in DESIGN.md), through the raw SummaryWriter."""
    if writer is None:
        return
    blocks = res["blocks"]
    p = res["num_prefix_tokens"]
    tag = lambda i: f"block{i:02d}"  # noqa: E731
    if "cka" in res:
        s = summary_of({"cka": res["cka"], "n_images": 0, "blocks": blocks})["cka"]
        for k, v in s.items():
            writer.add_scalar(f"cka/{k}", v, step)
    if "norm_ratio" in res:
        nr = res["norm_ratio"]
        for si, sub in enumerate(nr["sublayers"]):
            for i in range(len(blocks)):
                if p:
                    writer.add_scalar(f"norm_ratio/{sub}/cls/{tag(i)}", float(nr["ratio"][si, i, 0]), step)
                writer.add_scalar(f"norm_ratio/{sub}/spatial/{tag(i)}", float(nr["ratio"][si, i, p:].mean()), step)
    if "attention_distance" in res:
        px = res["attention_distance"]["pixels"]
        for i in range(px.shape[0]):
            for h in range(px.shape[1]):
                writer.add_scalar(f"attn_dist/{tag(i)}/head{h:02d}", float(px[i, h]), step)
    if "fewshot_probe" in res:
        fp = res["fewshot_probe"]
        for pi, pool in enumerate(fp["pools"]):
            for i in range(len(fp["layers"])):
                writer.add_scalar(f"probe/{fp['shots']}shot/{pool}/{tag(i)}", float(fp["mean"][pi, i]), step)
