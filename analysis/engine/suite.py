"""The analysis suite: every requested measurement (analysis/engine/measure.py) in ONE pass over the analysis split,
plus one pass over the probe-train split when a measure needs training features (probes, k-NN): over only the
probe-train images the measures read when each of them names its rows (:func:`probe_rows`; few-shot probes read
their shots and held-out half, k-NN the whole bank), with the same results: bit for bit where an image's features do
not depend on the other images of its minibatch (checked on CPU); a GPU may pick other kernels for another
minibatch size, so a full pass's features could differ from these in their rounding.

The same function serves the training-time callback (analysis/frontends/callbacks.py), offline analysis of saved
checkpoints (``python -m analysis``) and the notebook API (analysis/frontends/api.py). Minibatch j of the analysis split
always holds the same images; with several processes, process r takes the minibatches j = r (mod world)
(:func:`analysis.engine.reduce.shard`) and every measure reduces its state over processes, so 1 and N processes give
the same numbers. The analysis minibatches are runs of a seeded permutation of the images
(:class:`analysis.engine.reduce.Minibatches`, ``SuiteOptions.order_seed``), not of their stored order: the minibatch
estimators (CKA and those built on it) assume random minibatches. Results are written and read by
analysis/results/storage.py.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field

import numpy as np
import torch
import yaml

from analysis.engine.fixes import BatchSizes, Problem, first, sentence
from analysis.engine.measure import (
    Context,
    MeasureError,
    labels_problem,
    make_options,
    options_dict,
    registry,
    resolve,
    resolve_all,
)
from analysis.engine.reduce import ORDER_SEED, shard
from analysis.engine.taps import Taps, available_taps
from analysis.families import family_of

DEFAULT = ("cka", "norm_ratio", "attention_distance", "fewshot_probe")  # what the training-time suite runs


@dataclass
class SuiteOptions:
    """What the suite measures and how: the measures, the analysis minibatch, and each measure's own Options
    (those not given hold their defaults). A result's cache key covers the batch size, the minibatch order and its own
    options only."""

    measures: tuple = DEFAULT
    batch_size: int = 256  # analysis minibatch = the CKA minibatch (>= 4)
    options: dict = field(default_factory=dict)  # {measure name: its Options instance}
    # the analysis images' minibatches are runs of a permutation drawn from this seed (None: stored order), the same
    # for every measure and process count (analysis.engine.reduce.Minibatches)
    order_seed: int | None = ORDER_SEED
    # bytes the analysis may take beyond the model and the images (None: MEMORY_SHARE of the memory available on the
    # model's device): each minibatch's forward is cut into chunks that fit (:func:`plan_chunks`). Not part of a
    # result's cache key: a chunk's images give the same per-image tensors, to float rounding, as the whole minibatch.
    max_memory: int | None = None

    def of(self, name: str):
        """The Options of measure ``name``."""
        return self.options.get(name) or registry()[name].Options()

    def settings(self, name: str) -> dict:
        """What a result of measure ``name`` depends on besides the weights and the images."""
        return {
            "batch_size": self.batch_size,
            "order_seed": self.order_seed,
            "options": options_dict(self.of(name)),
            "version": registry()[name].version,
        }


def suite_options(measures=None, batch_size: int = 256, options: dict | None = None, max_memory=None) -> SuiteOptions:
    """SuiteOptions from user input: measure names (``None``: the default four; ``"all"`` or ``["all"]``: every
    registered measure; ``package.module:Class`` for a measure from elsewhere), ``options`` as
    ``{measure: {option: value}}`` and ``max_memory`` (bytes or a size such as ``"4GiB"``: :func:`parse_memory`;
    None: a share of the memory available). Raises MeasureError with one sentence for an unknown measure or option."""
    if measures in ("all", ["all"], ("all",)):
        names = tuple(sorted(registry()))
    else:
        names = resolve_all(DEFAULT if measures is None else measures)
    if not names:
        raise MeasureError("no measure named: pass one or more, e.g. cka,knn, or 'all'.")
    if not isinstance(batch_size, int) or isinstance(batch_size, bool) or batch_size < 4:
        raise MeasureError(f"the analysis batch size is {batch_size!r}; minibatch CKA needs an integer of at least 4.")
    if options is not None and not isinstance(options, dict):
        raise MeasureError(f"measure options must be a mapping {{measure: {{option: value}}}}, not {options!r}.")
    built = {}
    for m, vals in (options or {}).items():
        name = resolve(str(m))
        if not isinstance(vals, dict):
            raise MeasureError(f"options of measure '{m}' must be a mapping {{option: value}}, not {vals!r}.")
        built[name] = make_options(registry()[name], vals)
    budget = None if max_memory is None else parse_memory(max_memory)
    return SuiteOptions(measures=names, batch_size=batch_size, options=built, max_memory=budget)


def parse_opt_args(items: list[str]) -> dict:
    """``["knn.k=10", "fewshot_probe.seeds=[0,1]"]`` (values are YAML) -> ``{"knn": {"k": 10}, ...}``."""
    out: dict = {}
    for item in items:
        key, eq, value = item.partition("=")
        measure, dot, opt = key.partition(".")
        if not eq or not dot or not measure or not opt:
            raise MeasureError(f"--opt '{item}' is not MEASURE.OPTION=VALUE: write e.g. --opt knn.k=10.")
        try:
            out.setdefault(measure, {})[opt] = yaml.safe_load(value)
        except (yaml.YAMLError, ValueError, RecursionError):  # ValueError: an integer of over 4300 digits
            raise MeasureError(
                f"--opt '{key}': the value is not valid YAML, or too long or too deeply nested to read."
            ) from None
    return out


def batch_problem(n_images: int, batch_size: int) -> BatchSizes | None:
    """The problem (:class:`analysis.engine.fixes.BatchSizes`) if minibatch CKA cannot use these sizes (every
    minibatch, the last included, needs >= 4 images), else None."""
    if batch_size < 4 or n_images < 4 or 0 < n_images % batch_size < 4:
        return BatchSizes(n_images, batch_size)
    return None


# ---------------------------------------------------------------- the minibatch a model's analysis fits in

MEMORY_SHARE = 0.5  # of the memory available, what one minibatch's taps may take (the rest: the model, the images,
# the measures' accumulated features, other processes)
MAX_MINIBATCH = 256  # the suite's default minibatch (a run trained here analyses in those)


def tap_bytes_per_image(model, x1: torch.Tensor) -> int:
    """What the suite's taps keep of one image during a pass, in bytes: every tap of every block
    (analysis/engine/taps.py;
    a ViT block's attention map heads x tokens x tokens, its nine tokens x width tensors and the MLP hidden
    activations) captured in one forward of the one (normalised) image ``x1``, as float32."""
    names = available_taps(model)
    with torch.no_grad(), Taps(model, names) as cap:
        model(x1[:1])
    return 4 * sum(cap[n][:1].numel() for n in names)


def available_memory(device=None) -> int | None:
    """The memory this process may still allocate on ``device`` (default the CPU), in bytes, or None when it cannot
    be told: the one reader the trainer's memory check uses too (:func:`train.memory.available_bytes`: a GPU's free
    memory, or the host's MemAvailable within a cgroup's limit, shared by the host's processes)."""
    from train.memory import available_bytes

    return available_bytes(torch.device("cpu") if device is None else torch.device(device))


def choose_minibatch(
    per_image: int, available: int, n_images: int, share: float = MEMORY_SHARE, cap: int = MAX_MINIBATCH
) -> int:
    """The analysis minibatch for a model whose taps keep ``per_image`` bytes of each image, with ``available`` bytes
    of memory: all ``n_images`` in one minibatch when their taps fit in ``share`` of it and they are at most
    ``cap``; else the largest power of two that fits (at least 4, minibatch CKA's least), lowered to the largest
    size that leaves no last minibatch of 1-3 images (:func:`batch_problem`) when it would."""
    limit = min(int(available * share) // max(per_image, 1), cap)
    if 4 <= n_images <= limit:
        return n_images
    bs = 4
    while bs * 2 <= limit:
        bs *= 2
    return next((b for b in range(bs, 3, -1) if batch_problem(n_images, b) is None), bs)


_UNITS = {"": 1, "b": 1, "k": 2**10, "kb": 10**3, "kib": 2**10, "m": 2**20, "mb": 10**6, "mib": 2**20}
_UNITS |= {"g": 2**30, "gb": 10**9, "gib": 2**30, "t": 2**40, "tb": 10**12, "tib": 2**40}


def parse_memory(text) -> int:
    """Bytes from ``4GiB``, ``512MiB``, ``1.5GB``, ``8G`` (binary: G = GiB) or a plain number of bytes; MeasureError
    (one sentence) otherwise."""
    import re

    if isinstance(text, (int, float)) and not isinstance(text, bool) and text > 0:
        return int(text)
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(text))
    if not m or m.group(2).lower() not in _UNITS or float(m.group(1)) <= 0:
        raise MeasureError(f"memory '{text}' is not a size: write e.g. 4GiB, 512MiB or 8G.")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


# A measure's work on a minibatch's taps makes temporaries (a float64 copy of an attention map, a product beside
# it): the chunk is sized so that its taps times this factor fit (measured: bench/memory.py).
TEMPORARIES = 2.0


def tap_bytes(model, x1: torch.Tensor, taps) -> dict[str, int]:
    """{tap: bytes of one image's tensor} for ``taps`` (float32), from the shapes of one forward of the one image
    ``x1``: on the meta device (the model's parameters stood in for by meta tensors: no arithmetic, no memory, no
    forward counted by the model's own hooks' users), or, for a model whose forward needs real values there, on
    the real one."""
    from torch.func import functional_call

    names = sorted(taps)
    if not names:
        return {}
    x = x1[:1]
    with torch.no_grad():
        try:
            meta = {
                k: torch.empty_like(v, device="meta") for k, v in (*model.named_parameters(), *model.named_buffers())
            }
            with Taps(model, names) as cap:
                functional_call(model, meta, (x.to("meta"),))
        except Exception:  # a forward that reads values (.item(), data-dependent shapes): run it for real
            with Taps(model, names) as cap:
                model(x)
    return {n: 4 * cap[n][:1].numel() for n in names}


def plan_chunks(per_tap: dict[str, int], whole_taps, batch_size: int, budget: int) -> int | None:
    """Images per forward within a minibatch of ``batch_size``, or None (the whole minibatch at once) when its taps
    fit ``budget``. ``per_tap``: one image's bytes of every tap of the pass; ``whole_taps``: those read by measures
    that need the whole minibatch at once (minibatch CKA), which are kept for every image of it while the others
    are handled chunk by chunk. MeasureError (one sentence) when even those alone do not fit."""
    every = sum(per_tap.values())
    if batch_size * every * TEMPORARIES <= budget:
        return None
    whole = batch_size * sum(per_tap[t] for t in whole_taps)
    chunk = int((budget - whole * TEMPORARIES) // max(every * TEMPORARIES, 1))
    if chunk < 1:
        fits = max(4, int(budget // max(TEMPORARIES * (sum(per_tap[t] for t in whole_taps) + every), 1)))
        raise MeasureError(
            f"minibatch CKA keeps {_size(whole)} of taps for a minibatch of {batch_size} ({_size(whole * TEMPORARIES)} "
            f"with the measures' temporaries), beyond the analysis's memory budget of {_size(budget)}: use a smaller "
            f"analysis batch size (about {fits}) or a larger memory budget (--max-memory / max_memory=)."
        )
    return min(chunk, batch_size)


def _size(n: float) -> str:
    return f"{n / 2**30:.1f} GiB" if n >= 2**30 / 10 else f"{n / 2**20:.0f} MiB"


def out_of_memory(e: BaseException) -> bool:
    """Whether ``e`` is an allocation that failed for lack of memory (torch on CPU or GPU, or Python's own)."""
    if isinstance(e, MemoryError) or type(e).__name__ == "OutOfMemoryError":
        return True
    text = str(e)
    return isinstance(e, RuntimeError) and ("not enough memory" in text or "DefaultCPUAllocator" in text)


def data_problems(data, opts: SuiteOptions) -> dict[str, Problem]:
    """{measure: its problem} for each requested measure that cannot run on ``data`` with its options, in the order
    requested: labels it reads that the data lacks (:func:`analysis.engine.measure.labels_problem`: unlabelled analysis
    images, label -1, or no labelled probe-train images), else its own :meth:`analysis.engine.measure.Measure.problem`
    (e.g. too few probe-train images for its shots). Structured (analysis/engine/fixes.py): each front end says the fix
    in its own words."""
    reg = registry()
    out: dict[str, Problem] = {}
    for name in opts.measures:
        cls = reg[name]
        p = labels_problem(data, probe=cls.uses_labels == "probe") if cls.uses_labels else None
        p = p or cls.problem(data, opts.of(name))
        if p:
            out[name] = p
    return out


def problem(data, opts: SuiteOptions, front: str = "recipe") -> str | None:
    """One sentence if the suite cannot run ``opts`` on ``data`` (checked before anything is written), with the fix
    in the words of the front end ``front`` (a key of :data:`analysis.engine.fixes.VOCAB`)."""
    p = batch_problem(len(data.analysis), opts.batch_size)
    if p:
        return sentence(p, front, [])
    return first(data_problems(data, opts), front)


def model_problem(ctx: Context, opts: SuiteOptions, measures=None) -> str | None:
    """One sentence if a measure of ``measures`` (default ``opts.measures``) that applies to the model of ``ctx``
    cannot run on it with its options (:meth:`analysis.engine.measure.Measure.model_problem`)."""
    reg = registry()
    for name in resolve_all(measures if measures is not None else opts.measures):
        if reg[name].runs_on(ctx):
            p = reg[name].model_problem(ctx, opts.of(name))
            if p:
                return f"measure {name}: {p}"
    return None


def make_context(model, data, batch_size: int = 256, accelerator=None, order_seed: int | None = ORDER_SEED) -> Context:
    fam = family_of(model)
    return Context(
        model=model,
        data=data,
        device=next(model.parameters()).device,
        accelerator=accelerator,
        arch=fam.arch,
        family=fam,
        blocks=tuple(fam.blocks(model)),
        prefix=fam.prefix(model),
        grid=fam.grid(model),
        patch_size=fam.patch_size(model),
        batch_size=batch_size,
        order_seed=order_seed,
    )


@torch.no_grad()
def _pass(ctx: Context, split, taps: list[str], on_batch, rows: np.ndarray | None = None, chunk=None, whole=None):
    """Run ``split`` through the model in fixed minibatches (sharded over processes), calling ``on_batch(j, captures,
    normalised inputs, labels)`` for each: the analysis images in ``ctx.minibatches`` (a seeded permutation's runs:
    the minibatch estimators assume random minibatches); another split in stored order, only its images ``rows``
    when given (features of single images, in any order).

    With ``chunk`` (images per forward, :func:`plan_chunks`) a larger minibatch is forwarded in chunks: ``on_batch``
    gets each chunk in turn under the same ``j`` (the measures that take a minibatch in parts:
    :attr:`analysis.engine.measure.Measure.chunkable`), and ``whole = (taps, fn)`` gets ``fn(j, captures, inputs,
    labels)`` once per minibatch with only ``taps``, filled chunk by chunk into one tensor each (minibatch CKA).
    Without ``chunk`` both get the one forward's captures."""
    bs = ctx.batch_size
    if split is ctx.data.analysis and rows is None:
        mb = ctx.minibatches
        parts = ((j, mb.rows(j)) for j in mb.mine(ctx.accelerator))
    else:
        n = len(split) if rows is None else len(rows)
        parts = (
            (j, slice(j * bs, (j + 1) * bs) if rows is None else torch.as_tensor(rows[j * bs : (j + 1) * bs]))
            for j in shard((n + bs - 1) // bs, ctx.accelerator)
        )
    for j, sel in parts:
        images, y = split.images[sel], split.labels[sel]
        if chunk is None or chunk >= len(y):
            x = ctx.data.normalize(images.to(ctx.device))
            with Taps(ctx.model, taps) as cap:
                ctx.model(x)
            on_batch(j, cap.captures, x, y)
            if whole is not None:
                whole[1](j, cap.captures, x, y)
            continue
        kept: dict[str, torch.Tensor] = {}
        xs = []
        for lo in range(0, len(y), chunk):
            x = ctx.data.normalize(images[lo : lo + chunk].to(ctx.device))
            with Taps(ctx.model, taps) as cap:
                ctx.model(x)
            on_batch(j, cap.captures, x, y[lo : lo + chunk])
            if whole is not None:
                for t in whole[0]:
                    v = cap.captures[t]
                    if t not in kept:
                        kept[t] = v.new_empty((len(y), *v.shape[1:]))
                    kept[t][lo : lo + len(v)] = v
                xs.append(x)
            del cap
        if whole is not None:
            whole[1](j, kept, torch.cat(xs), y)


def make_measures(ctx: Context, opts: SuiteOptions, names=None) -> list:
    """The measures ``names`` (default ``opts.measures``) that apply to ``ctx``'s model, built with their options."""
    reg, names = registry(), resolve_all(opts.measures if names is None else names)
    return [reg[n](ctx, opts.of(n)) for n in names if reg[n].runs_on(ctx)]


def probe_rows(ms, split) -> np.ndarray | None:
    """The probe-train images the measures ``ms`` (those with probe taps) read: the sorted union of their
    :meth:`~analysis.engine.measure.Measure.probe_rows`, or None (every image) when one of them reads all, when the
    union is every image, or when the split's images are not a tensor that rows can be taken from."""
    if not isinstance(getattr(split, "images", None), torch.Tensor):
        return None
    parts = [m.probe_rows(split.labels) for m in ms]
    if not parts or any(p is None for p in parts):
        return None
    u = np.unique(np.concatenate([np.asarray(p, dtype=np.int64).reshape(-1) for p in parts]))
    if len(u) and (u[0] < 0 or u[-1] >= len(split)):
        raise ValueError(f"a measure's probe_rows names rows outside the {len(split)} probe-train images.")
    return None if len(u) == len(split) else u


def memory_budget(ctx: Context, opts: SuiteOptions) -> int:
    """The bytes a suite's passes may take for their taps: ``opts.max_memory``, else :data:`MEMORY_SHARE` of the memory
    available on the model's device (4 GiB assumed where that cannot be told)."""
    if opts.max_memory is not None:
        return int(opts.max_memory)
    avail = available_memory(ctx.device)
    return int((avail if avail is not None else 4 * 2**30) * MEMORY_SHARE)


def _measured_pass(ctx: Context, split, ms: list, kind: str, budget: int, what: str, on_stage, rows=None) -> None:
    """One pass over ``split`` feeding the measures ``ms`` (``kind`` "": :meth:`Measure.update` with
    :meth:`Measure.taps`; "probe_": ``update_probe`` with ``probe_taps``), its minibatches forwarded in chunks that fit
    ``budget`` (:func:`plan_chunks`): the measures that take a minibatch in parts get each chunk, the others the whole
    minibatch's taps at once."""
    taps_of = {m: getattr(m, f"{kind}taps")() for m in ms}
    update = {m: getattr(m, f"update{'_probe' if kind else ''}") for m in ms}
    taps = sorted(set().union(*taps_of.values()))
    parts, wholes = [m for m in ms if m.chunkable], [m for m in ms if not m.chunkable]
    whole_taps = sorted(set().union(*(taps_of[m] for m in wholes)))
    first = split.images[:1] if rows is None else split.images[torch.as_tensor(rows[:1])]
    largest = min(ctx.batch_size, len(split) if rows is None else len(rows))  # the largest minibatch of this pass
    chunk = plan_chunks(
        tap_bytes(ctx.model, ctx.data.normalize(first.to(ctx.device)), taps), whole_taps, largest, budget
    )
    on_stage(what if chunk is None else f"{what}, {chunk} images per forward to stay within {_size(budget)}")
    _pass(
        ctx,
        split,
        taps,
        lambda j, cap, x, y: [update[m](j, cap, x, y) for m in parts],
        rows,
        chunk,
        (whole_taps, lambda j, cap, x, y: [update[m](j, cap, x, y) for m in wholes]) if wholes else None,
    )


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


def feed(ctx: Context, ms: list, budget: int | None = None, on_stage=None) -> None:
    """The passes of :func:`run_suite` without the results: the analysis images (and the probe-train images, for the
    measures with probe taps) through ``ctx``'s model in eval mode and float32, feeding the measures ``ms``, each
    minibatch forwarded in chunks within ``budget`` bytes of taps (default: :func:`memory_budget`'s share of the
    device). For a caller that reads a measure's gathered state itself rather than its one result (a report that
    recomputes a measure's map under two nulls); the model's training mode is restored."""
    on_stage = on_stage or (lambda text: None)
    budget = memory_budget(ctx, SuiteOptions()) if budget is None else budget
    data, model = ctx.data, ctx.model
    was_training = model.training
    model.eval()
    try:
        with float32_forward(model):
            if any(m.taps() for m in ms):
                what = f"pass over the analysis images ({', '.join(m.name for m in ms)})"
                _measured_pass(ctx, data.analysis, ms, "", budget, what, on_stage)
            pms = [m for m in ms if m.probe_taps()]
            if pms:
                rows = probe_rows(pms, data.probe_train)  # only the images some measure reads
                for m in pms:
                    m.probe_index = rows
                n = len(data.probe_train) if rows is None else len(rows)
                what = f"pass over the probe-train images ({n} of {len(data.probe_train)})"
                _measured_pass(ctx, data.probe_train, pms, "probe_", budget, what, on_stage, rows)
    finally:
        model.train(was_training)


def run_suite(
    model,
    data,
    opts: SuiteOptions | None = None,
    accelerator=None,
    measures=None,
    on_stage=None,
    on_result=None,
    progress=None,
) -> dict:
    """The requested measures (``measures`` or ``opts.measures``; those that do not apply to the model, e.g. attention
    measures on a ResNet, are left out) of ``model`` on ``data.analysis`` (and ``data.probe_train``). Returns ``{"meta":
    {...}, <measure>: result}`` (results as in analysis/engine/measure.py). ``on_stage(text)``, when given, is called as
    each stage starts: the passes over the images, then each measure's name (its finish). ``on_result(name, result,
    meta)``, when given, is called as each measure finishes, so a front end can keep it before the next one runs (a
    stop midway keeps what finished). ``progress``: the bar factory of the measures' own long work
    (:attr:`analysis.engine.measure.Context.progress`)."""
    on_stage = on_stage or (lambda text: None)
    opts = opts or SuiteOptions()
    names = resolve_all(measures if measures is not None else opts.measures)
    p = problem(data, SuiteOptions(names, opts.batch_size, opts.options))
    if p:
        raise MeasureError(p)
    ctx = make_context(model, data, opts.batch_size, accelerator, opts.order_seed)
    ctx.progress = progress
    p = model_problem(ctx, opts, names)
    if p:
        raise MeasureError(p)
    was_training = model.training
    model.eval()
    try:
        with float32_forward(model):  # measures are built, fed and finished on the eval-mode float32 model
            ms = make_measures(ctx, opts, names)
            feed(ctx, ms, memory_budget(ctx, opts), on_stage)
            out: dict = {
                "meta": {
                    "arch": ctx.arch,
                    "family": ctx.family.name if ctx.family is not None else None,
                    "blocks": list(ctx.blocks),
                    "num_prefix_tokens": ctx.prefix,
                    "n_images": len(data.analysis),
                }
            }
            for m in ms:
                on_stage(m.name)
                with torch.no_grad():
                    out[m.name] = m.finish()
                if on_result is not None:
                    on_result(m.name, out[m.name], out["meta"])
    finally:
        model.train(was_training)
    return out
