"""The analysis suite: every requested measurement (analysis/measure.py) in ONE pass over the analysis split,
plus one pass over the probe-train split when a measure needs training features (probes, k-NN).

The same function serves the training-time callbacks (analysis/callbacks.py) and offline analysis of saved
checkpoints (``python -m analysis``). Minibatch j of the analysis split always holds the same images; with
several processes, process r takes the minibatches j = r (mod world) and every measure reduces its state over
processes, so 1 and N processes give the same numbers.

On disk (:func:`publish`), ``analysis/step_XXXXXXX/`` holds ``<measure>.npz`` per measure, ``summary.json``
(key numbers and the model's block layout) and ``cache.json`` (the cache key of each result: weights, analysis
images and settings, see :func:`cache_key`); PNG figures go to ``figures/step_XXXXXXX/``; the same figures
and scalars go to TensorBoard.
"""
from __future__ import annotations

import hashlib
import importlib
import json
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from analysis.measure import REGISTRY, Context, load_result, save_result
from analysis.taps import Taps, arch_of, block_names, grid_of, num_prefix_tokens

# modules that define (register) measures; imported on first use
MODULES = ("analysis.cka", "analysis.norm_ratio", "analysis.attention", "analysis.probes", "analysis.localization",
           "analysis.token_probes", "analysis.receptive_field", "analysis.residual_cka", "analysis.attention_maps",
           "analysis.knn", "analysis.clustering")
DEFAULT = ("cka", "norm_ratio", "attention_distance", "fewshot_probe")  # what the training-time suite runs


@dataclass
class SuiteOptions:
    """What the suite measures and how. Every field but ``measures`` is part of the results' cache key."""

    measures: tuple = DEFAULT
    batch_size: int = 256  # analysis minibatch = the CKA minibatch (>= 4)
    cka_repr: str = "flatten"  # flatten | cls | mean_spatial
    cka_unbiased: bool = True
    probe_shots: int = 10
    probe_seeds: tuple = (0, 1, 2)
    probe_pools: tuple = ("cls", "mean", "mean_spatial")
    token_probe_stride: int = 1
    erf_images: int = 32
    knn_k: int = 20
    knn_temperature: float = 0.07
    extra: dict = field(default_factory=dict)  # options of measures registered outside this package

    def settings(self) -> dict:
        d = asdict(self)
        d.pop("measures")
        return json.loads(json.dumps(d))  # tuples -> lists, as they are read back


def registry() -> dict:
    """Every known measure, {name: class} (importing the modules that define them)."""
    for m in MODULES:
        try:
            importlib.import_module(m)
        except ModuleNotFoundError as e:
            if e.name != m:
                raise
    return REGISTRY


def check_measures(names) -> None:
    """Raise ValueError (one sentence) for an unknown measure name."""
    known = registry()
    bad = [n for n in names if n not in known]
    if bad:
        raise ValueError(f"unknown measure '{bad[0]}': choose from {', '.join(sorted(known))}.")


def batch_problem(n_images: int, batch_size: int) -> str | None:
    """One sentence if minibatch CKA cannot use these sizes (every minibatch, the last included, needs >= 4 images)."""
    if batch_size < 4:
        return f"the analysis batch size is {batch_size}; minibatch CKA needs at least 4."
    if n_images < 4 or 0 < n_images % batch_size < 4:
        return (f"{n_images} analysis images in minibatches of {batch_size} leave a last minibatch of {n_images % batch_size or n_images} "
                "images; minibatch CKA needs at least 4: change data.analysis_size or the analysis batch size.")
    return None


def make_context(model, data, opts: SuiteOptions, accelerator=None) -> Context:
    arch = arch_of(model)
    tokens = arch in ("vit", "mixer")
    patch = None
    if tokens:
        pe = model.patch_embed if arch == "vit" else model.stem
        patch = int(pe.patch_size[0])
    return Context(model=model, data=data, opts=opts, device=next(model.parameters()).device, accelerator=accelerator,
                   arch=arch, blocks=tuple(block_names(model)), prefix=num_prefix_tokens(model),
                   grid=tuple(grid_of(model)) if tokens else None, patch_size=patch)


def _shard(n_batches: int, accelerator) -> range:
    if accelerator is None or accelerator.num_processes == 1:
        return range(n_batches)
    return range(accelerator.process_index, n_batches, accelerator.num_processes)


@torch.no_grad()
def _pass(ctx: Context, split, taps: list[str], on_batch) -> None:
    """Run ``split`` through the model in fixed minibatches (sharded over processes), calling
    ``on_batch(j, captures, normalised inputs, labels)`` for each."""
    bs = ctx.opts.batch_size
    for j in _shard((len(split) + bs - 1) // bs, ctx.accelerator):
        x = ctx.data.normalize(split.images[j * bs:(j + 1) * bs].to(ctx.device))
        y = split.labels[j * bs:(j + 1) * bs]
        with Taps(ctx.model, taps) as cap:
            ctx.model(x)
        on_batch(j, cap.captures, x, y)


@contextmanager
def float32_forward(model):
    """Measure in float32 whatever the training precision: Accelerate's mixed precision replaces ``model.forward``
    by an autocast wrapper (kept on the unwrapped model, which callbacks see); inside this context the model's
    own forward runs, with autocast off, so training-time and offline analyses of a checkpoint agree exactly."""
    patched, original = model.__dict__.get("forward"), model.__dict__.get("_original_forward")
    if patched is not None and original is not None:
        model.forward = original
    try:
        with torch.autocast(next(model.parameters()).device.type, enabled=False):
            yield
    finally:
        if patched is not None and original is not None:
            model.forward = patched


def run_suite(model, data, opts: SuiteOptions | None = None, accelerator=None, measures=None) -> dict:
    """The requested measures (``measures`` or ``opts.measures``; those that do not apply to the model, e.g.
    attention measures on a ResNet, are left out) of ``model`` on ``data.analysis`` (and ``data.probe_train``).
    Returns ``{"meta": {...}, <measure>: result}`` (results as in analysis/measure.py)."""
    opts = opts or SuiteOptions()
    names = list(measures if measures is not None else opts.measures)
    check_measures(names)
    problem = batch_problem(len(data.analysis), opts.batch_size)
    if problem:
        raise ValueError(problem)
    ctx = make_context(model, data, opts, accelerator)
    was_training = model.training
    model.eval()
    with float32_forward(model):
        return _run(model, data, opts, accelerator, names, ctx, was_training)


def _run(model, data, opts, accelerator, names, ctx, was_training) -> dict:
    try:
        ms = [REGISTRY[n](ctx) for n in names if REGISTRY[n].applies(ctx)]
        taps = sorted(set().union(*(m.taps() for m in ms))) if ms else []
        if taps:
            _pass(ctx, data.analysis, taps, lambda j, cap, x, y: [m.update(j, cap, x, y) for m in ms])
        ptaps = sorted(set().union(*(m.probe_taps() for m in ms))) if ms else []
        if ptaps:
            _pass(ctx, data.probe_train, ptaps, lambda j, cap, x, y: [m.update_probe(j, cap, x, y) for m in ms if m.probe_taps()])
        out: dict = {"meta": {"arch": ctx.arch, "blocks": list(ctx.blocks), "num_prefix_tokens": ctx.prefix, "n_images": len(data.analysis)}}
        for m in ms:
            with torch.no_grad():
                out[m.name] = m.finish()
    finally:
        model.train(was_training)
    return out


# ---------------------------------------------------------------- cache keys


def data_fingerprint(data) -> str:
    """sha256 of the analysis and probe-train images and labels and the normalisation: two runs analysed on the
    same images have the same fingerprint."""
    h = hashlib.sha256()
    for split in (data.analysis, data.probe_train):
        for t in (split.images, split.labels):
            h.update(str(tuple(t.shape)).encode())
            h.update(t.contiguous().cpu().numpy().tobytes())
    for t in (data.mean, data.std):
        h.update(torch.as_tensor(t).double().numpy().tobytes())
    return h.hexdigest()


def weights_id(checkpoint_dir: Path) -> str | None:
    """The recorded sha256 of a checkpoint's model.safetensors (from its meta.json), or None."""
    try:
        return json.loads((Path(checkpoint_dir) / "meta.json").read_text())["files"]["model.safetensors"]
    except (OSError, ValueError, KeyError, TypeError):
        return None


def cache_key(weights: str, data_fp: str, opts: SuiteOptions, measure: str) -> str:
    """What a saved result depends on: the weights, the analysis images, the settings and the measure."""
    blob = json.dumps({"weights": weights, "data": data_fp, "settings": opts.settings(), "measure": measure}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:32]


def cached_keys(out_dir: Path) -> dict:
    try:
        return json.loads((Path(out_dir) / "cache.json").read_text())
    except (OSError, ValueError):
        return {}


# ---------------------------------------------------------------- writing, reading, logging


def summary_of(res: dict) -> dict:
    """Key numbers of a suite result (summary.json, reports): {"meta": ..., <measure>: summary}."""
    reg = registry()
    return {"meta": res.get("meta", {}), **{k: reg[k].summary(v) for k, v in res.items() if k in reg}}


def _atomic_text(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    tmp.replace(path)


def write_results(res: dict, out_dir: Path, step: int | None = None, keys: dict | None = None) -> Path:
    """``<measure>.npz`` per measure, then summary.json and cache.json (merged with what is there: results of
    other measures already in the folder stay valid), each written atomically."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    reg = registry()
    for name, r in res.items():
        if name in reg:
            tmp = out_dir / f"{name}.tmp.npz"
            save_result(r, tmp)
            tmp.replace(out_dir / f"{name}.npz")
    old = {}
    if (out_dir / "summary.json").is_file():
        try:
            old = json.loads((out_dir / "summary.json").read_text())
        except ValueError:
            old = {}
    summary = {**old, "step": step, **summary_of(res)}
    _atomic_text(out_dir / "summary.json", json.dumps(summary, indent=1))
    cache = cached_keys(out_dir)
    for name in res:
        if name in reg:
            if keys and keys.get(name):
                cache[name] = keys[name]
            else:
                cache.pop(name, None)
    _atomic_text(out_dir / "cache.json", json.dumps(cache, indent=1))
    return out_dir


def load_results(out_dir: Path, measures=None) -> dict:
    """A suite result read back from ``out_dir`` (the measures present there, or those named)."""
    out_dir = Path(out_dir)
    reg = registry()
    meta = json.loads((out_dir / "summary.json").read_text()).get("meta", {}) if (out_dir / "summary.json").is_file() else {}
    res = {"meta": meta}
    for name in measures or sorted(reg):
        f = out_dir / f"{name}.npz"
        if f.is_file():
            res[name] = load_result(f)
    return res


def make_figures(res: dict, step: int | None = None) -> dict:
    reg = registry()
    figs = {}
    for name, r in res.items():
        if name in reg:
            figs.update(reg[name].figures(r, step))
    return figs


def log_results(res: dict, writer, step: int) -> None:
    """TensorBoard scalars (tags as in DESIGN.md), through the raw SummaryWriter."""
    if writer is None:
        return
    reg = registry()
    for name, r in res.items():
        if name in reg:
            for tag, v in reg[name].scalars(r).items():
                writer.add_scalar(tag, v, step)


def publish(res: dict, out_dir: Path, writer=None, step: int | None = None, figures: bool = True, keys: dict | None = None,
            figure_dir: Path | None = None) -> Path:
    """Write arrays + summary.json (+ cache keys) to ``out_dir``, log scalars, and draw each figure once for
    PNG (into ``figure_dir``, default ``out_dir``) and TensorBoard."""
    write_results(res, out_dir, step, keys)
    log_results(res, writer, step)
    if figures:
        import matplotlib.pyplot as plt

        from analysis.figures import save

        fig_dir = Path(figure_dir or out_dir)
        fig_dir.mkdir(parents=True, exist_ok=True)
        for name, fig in make_figures(res, step).items():
            if writer is not None:
                writer.add_figure(name, fig, step, close=False)
            save(fig, fig_dir / f"{name.replace('/', '_')}.png")
            plt.close(fig)
    return Path(out_dir)
