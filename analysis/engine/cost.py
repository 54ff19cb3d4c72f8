"""What an analysis will cost, said before it starts: each measure's work in forwards and backwards of the model
(:meth:`analysis.engine.measure.Measure.cost`: a function of its options, the image count and the model's shape)
times the seconds of one image's forward and backward, timed on this model, here, on a small minibatch.

The shared pass over the analysis images (and the probe-train images where a measure reads them) is timed with the
taps the requested measures capture and their updates; a measure that runs the model again in its ``finish`` (erf's
input gradients, ablation's forwards from each target on) adds its own forwards and backwards. What a measure computes
in its ``finish`` from what it accumulated is counted where the measure prices it in ``seconds`` (similarity: its map
and permutation null, timed on random features of the real shape); the cheap ones (probes, clustering) are not.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from analysis.engine.measure import Context, registry
from analysis.engine.taps import Taps

CONFIRM_S = 600.0  # past this estimate, python -m analysis asks for --yes (and names the cheaper options)
SAY_S = 60.0  # from this estimate on, python -m analysis says it even when no measure has work of its own
TIMING_IMAGES = 64  # at most this many images in the timed minibatch
TIMING_CALL_S = 0.2  # or fewer, once one forward takes this long


@dataclass
class Timing:
    """Seconds per image of this model here: a forward with the suite's taps and the measures' updates (``shared``),
    a plain forward (``forward``) and the backward of the input's gradient alone, parameters frozen (``backward``)."""

    shared: float
    forward: float
    backward: float
    device: str = "cpu"


@dataclass
class Estimate:
    """Seconds per measure beyond the shared pass (``measures``), of the shared pass (``shared``), and the work behind
    them (``work``: {measure: {"forwards": F, "backwards": B}})."""

    timing: Timing
    shared: float = 0.0
    measures: dict[str, float] = field(default_factory=dict)
    work: dict[str, dict] = field(default_factory=dict)

    @property
    def total(self) -> float:
        return self.shared + sum(self.measures.values())

    def add(self, other: Estimate) -> None:
        """Another checkpoint's estimate added to this one."""
        self.shared += other.shared
        for k, v in other.measures.items():
            self.measures[k] = self.measures.get(k, 0.0) + v
        for k, w in other.work.items():
            mine = self.work.setdefault(k, {"forwards": 0.0, "backwards": 0.0})
            for part in ("forwards", "backwards", "seconds"):
                mine[part] = mine.get(part, 0.0) + w.get(part, 0.0)


def shortest_call(fn, repeats: int = 3) -> float:
    """The shortest of ``repeats`` timed calls of ``fn`` after one untimed call (allocations, lazy set-up): the
    machine may be shared, and the shortest call is the one least disturbed. A call of over a second is timed once
    more only (a large model: the estimate must not cost minutes itself)."""
    t0 = time.perf_counter()
    fn()
    if time.perf_counter() - t0 > 1.0:
        repeats = 1
    out = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        out = min(out, time.perf_counter() - t0)
    return out


def time_model(ctx: Context, taps: list[str], measures: list | None = None) -> Timing:
    """Seconds per image of ``ctx.model`` on its first analysis images: a plain forward, one with ``taps`` captured and
    read by ``measures``' ``update`` (throwaway measures, what they accumulate dropped; a measure whose update
    cannot take the timed minibatch, e.g. CKA's under 4 images, is left out of the timing), and the backward to the
    input (eval mode, parameters frozen, both restored). The minibatch grows from 4 images (x4) until a forward takes
    :data:`TIMING_CALL_S` or holds :data:`TIMING_IMAGES` images: a small model's time per image is that of the large
    batches erf and ablation run (not of its per-call overhead), a large model's is timed in a few seconds. The
    backward is at least half a forward (a shared machine's noise can make the difference of two timings vanish)."""
    model, data = ctx.model, ctx.data
    measures = list(measures or [])
    was_training = model.training
    flags = [(p, p.requires_grad) for p in model.parameters()]
    model.eval()
    try:
        n = min(4, len(data.analysis))  # 4: the least minibatch the measures' updates take (minibatch CKA)
        while True:
            x = data.normalize(data.analysis.images[:n].to(ctx.device)).float()
            with torch.no_grad():
                plain = shortest_call(lambda x=x: model(x))
            if plain >= TIMING_CALL_S or n >= min(TIMING_IMAGES, len(data.analysis)):
                break
            n = min(4 * n, TIMING_IMAGES, len(data.analysis))
        n = x.shape[0]

        y = data.analysis.labels[:n]

        def tapped():
            with torch.no_grad(), Taps(model, taps) as cap:
                model(x)
                for m in list(measures):
                    try:
                        m.update(0, cap.captures, x, y)
                    except Exception:
                        measures.remove(m)

        shared = shortest_call(tapped) if taps else plain
        for p, _ in flags:
            p.requires_grad_(False)

        def both():
            xr = x.detach().requires_grad_(True)
            with torch.enable_grad():
                out = model(xr)
                out = out if isinstance(out, torch.Tensor) else next(iter(out.values()))
                torch.autograd.grad(out.float().sum(), xr)

        fb = shortest_call(both)
    finally:
        for p, f in flags:
            p.requires_grad_(f)
        model.train(was_training)
    return Timing(max(shared, plain) / n, plain / n, max(fb - plain, plain / 2) / n, ctx.device.type)


def estimate(ctx: Context, opts, names, timing: Timing | None = None) -> Estimate:
    """The estimate of the measures ``names`` (those that apply to ``ctx``'s model) with ``opts`` (SuiteOptions) on
    ``ctx``'s images, one checkpoint: the shared pass's images times the tapped forward, and each measure's own
    forwards and backwards (:meth:`~analysis.engine.measure.Measure.cost`) times the plain ones."""
    from analysis.engine.suite import make_measures  # suite imports nothing of this module

    ms = make_measures(ctx, opts, names)
    taps = sorted(set().union(*(m.taps() for m in ms))) if ms else []
    ptaps = sorted(set().union(*(m.probe_taps() for m in ms))) if ms else []
    timing = timing or time_model(ctx, taps, [m for m in ms if m.taps()])
    est = Estimate(timing)
    if taps:
        est.shared += len(ctx.data.analysis) * timing.shared
    if ptaps:
        est.shared += len(ctx.data.probe_train) * timing.shared
    reg = registry()
    for m in ms:
        w = reg[m.name].cost(ctx, m.opts, len(ctx.data.analysis))
        est.work[m.name] = dict(w)
        s = w.get("forwards", 0.0) * timing.forward + w.get("backwards", 0.0) * timing.backward + w.get("seconds", 0.0)
        if s > 0:
            est.measures[m.name] = s
    return est


def duration(s: float) -> str:
    """Seconds as a person says them: ``40 s``, ``12 min``, ``2 h 05 min``."""
    if s < 90:
        return f"{max(s, 1):.0f} s"
    if s < 3600:
        return f"{s / 60:.0f} min"
    return f"{int(s // 3600)} h {int(s % 3600 // 60):02d} min"


def lines(est: Estimate, what: str) -> list[str]:
    """The estimate as lines for the user: the timed forward, the shared pass, each measure with work of its own,
    the total. ``what``: the model and images (e.g. ``step 600 (2 checkpoints), 512 images``)."""
    t = est.timing
    out = [
        f"estimated cost of {what} (one image: forward {t.forward * 1e3:.3g} ms, with the taps {t.shared * 1e3:.3g} "
        f"ms, backward {t.backward * 1e3:.3g} ms, timed here on {t.device}):"
    ]
    if est.shared:
        out.append(f"  the pass over the images every measure shares: {duration(est.shared)}")
    for name, s in est.measures.items():
        w = est.work.get(name, {})
        parts = [f"{w[k]:,.0f} image {k}" for k in ("forwards", "backwards") if w.get(k)]
        parts += [f"{duration(w['seconds'])} of its own computation"] if w.get("seconds") else []
        out.append(f"  {name}: {duration(s)} ({', '.join(parts)})")
    out.append(f"  total: about {duration(est.total)}")
    return out


def cheaper(est: Estimate, opts) -> list[str]:
    """``--opt`` settings that make the costly measures cheaper, each with what it does."""
    out = []
    budget = CONFIRM_S / 2
    if est.measures.get("erf", 0) > budget / 2:
        n = opts.of("erf").images
        fewer = max(1, min(n - 1, int(n * budget / 2 / est.measures["erf"])))
        out.append(f"--opt erf.images={fewer} (of {n} images)")
    if est.measures.get("ablation", 0) > budget / 2:
        out.append("--opt ablation.targets=[branches,skip] (no single heads)")
    return out
