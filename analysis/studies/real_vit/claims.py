"""The papers' claims that need a trained model, decided on one real ViT over its images: each declared once with
:meth:`~analysis.studies.claims.Claims.claim` beside the code that decides it, through the claim engine's
:func:`~analysis.studies.claims.judge` (analysis/studies/stats.py's rule).

One model, so there are no seeds: a claim reads per-image statistics from an :class:`ImageContext` (reads.py computes
them) and each part's 95% CI is a BCa bootstrap over the independent units of the analysis views
(``ImageContext.groups``): for the bundled photos the photo, each drawn with all its views (the cluster bootstrap of
analysis/studies/stats.py), so the interval is about photos like these 19, not about more crops of them; for a folder
of one's own images, each image. A head a claim needs (upper_global's most local head, offset_early's windows) is
chosen on photos it is not tested on: when the probe-train crops are crops of the analysis photos (the bundled
photos), the photos are split once by :func:`photo_split` (a seeded rule on the photos' indices, declared here before
any held-out number was computed): the head is chosen on the probe crops of the selection photos and tested on the
analysis views of the held-out photos only, the bootstrap resampling those photos; the verdict reads the held-out
test. Beside it, in ``measured["all_photos"]``, the number as it was before the split: chosen on all photos' probe
crops, tested on all photos' analysis views (choice and test then share photos). ``measured["chosen_on"]`` says what
the choice saw. A folder's probe images are other images than its analysis images: no split is needed there.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial

import numpy as np

from analysis.measures.aligned_attention import MIN_MASS
from analysis.studies.claims import Claims, MissingResult, Result, judge
from analysis.studies.locality import LOCAL_FRACTION
from analysis.studies.stats import Precondition, bootstrap_part

CLAIMS = Claims("real_vit")

RAGHU_5, RAGHU_6 = "Raghu et al. 2021 §5", "Raghu et al. 2021 §6"

# The selection / held-out split of the photos (issue 38), fixed on 2026-11-28 before any held-out number was computed:
# the units (photos) sorted, permuted by numpy's PCG64 seeded with SPLIT_SEED, the first ceil(SELECTION_SHARE x G)
# are the selection photos, the rest held out (the 19 bundled photos: 10 / 9). It reads only the photos' indices.
SPLIT_SEED = 38
SELECTION_SHARE = 0.5


def photo_split(units) -> tuple[np.ndarray, np.ndarray]:
    """(selection, held-out): the distinct ``units`` split by the fixed rule above (sorted arrays of unit labels)."""
    u = np.unique(units)
    if len(u) < 2:
        raise ValueError(f"a selection / held-out split needs at least 2 photos, not {len(u)}: analyse more photos.")
    k = min(len(u) - 1, int(np.ceil(SELECTION_SHARE * len(u))))
    order = np.random.default_rng(SPLIT_SEED).permutation(len(u))
    return np.sort(u[order[:k]]), np.sort(u[order[k:]])


@dataclass(frozen=True)
class HeldOut:
    """The split of one context: the ``selection`` and ``test`` photos, the probe crops of the selection photos
    (``probe`` [M] bool) and the analysis views of the held-out photos (``views`` [N] bool)."""

    selection: np.ndarray
    test: np.ndarray
    probe: np.ndarray
    views: np.ndarray

    def says(self, n_views: int) -> str:
        """What a head chosen under this split was chosen on and tested on, in words."""
        return (
            f"the probe crops of the {len(self.selection)} selection photos (photos "
            f"{', '.join(map(str, self.selection))}; split fixed by seed {SPLIT_SEED}), tested on the "
            f"{int(self.views.sum())} analysis views of the {len(self.test)} held-out photos (of {n_views})"
        )


def held_out(c) -> HeldOut | None:
    """The context's split when its probe crops are crops of its analysis photos (``photos`` and ``probe_groups``
    known), else None (the probe images are other images: the choice never saw the tested ones)."""
    if c.photos is None or c.probe_groups is None:
        return None
    selection, test = photo_split(c.photos)
    probe = np.isin(c.probe_groups, selection)
    if not probe.any():
        raise ValueError("no probe crop belongs to a selection photo: the probe crops must be crops of the photos.")
    return HeldOut(selection, test, probe, np.isin(c.photos, test))


@dataclass
class ImageContext:
    """What the claims read: per-image statistics of one model (reads.py, :func:`~.reads.per_image`), images on axis 0.

    ``distance`` [N, L, H] and ``probe_distance`` [M, L, H]: each head's mean attention distance (px) on the analysis
    views and on the probe-train crops; ``uniform``: uniform attention's distance (px); ``log_gap`` [N, 2, L]: log of
    the CLS token's norm ratio minus the spatial tokens' mean log ratio (attention, MLP); ``cls_input_spread`` [2, L]:
    how much the CLS token's skip input varies over the images; ``window_mass`` [N, K]: attention mass in each window
    of ``windows`` ((block, head, (dr, dc)) triples), ``chosen``: the windows picked on the probe crops by half
    ("first", "second"). ``groups`` [N]: each analysis view's independent unit (its photo; None: each image its own),
    what every part's bootstrap resamples; ``population``: what the intervals are about, in words ("the 19 photos");
    ``chosen_on``: what the heads and windows are chosen on, in words ("other crops (seed 1) of the same 19 photos");
    ``probe_groups`` [M]: the probe crops' photos when they are the analysis views' photos (None: other images);
    ``photos`` [N]: each analysis view's photo when the probe crops are crops of the same photos (what
    :func:`held_out` splits; kept when ``groups`` is set to None to take the views as independent images);
    ``chosen_split``: the windows chosen on the selection photos' probe crops alone, as ``chosen``."""

    distance: np.ndarray
    probe_distance: np.ndarray
    uniform: float
    log_gap: np.ndarray
    cls_input_spread: np.ndarray
    window_mass: np.ndarray
    windows: list = field(default_factory=list)
    chosen: dict = field(default_factory=dict)
    groups: np.ndarray | None = None
    population: str = ""
    chosen_on: str = "the probe-train crops"
    probe_groups: np.ndarray | None = None
    photos: np.ndarray | None = None
    chosen_split: dict = field(default_factory=dict)


def _images(ctx) -> ImageContext:
    """The per-image statistics, or MissingResult (not testable) for a training study's context."""
    if not isinstance(ctx, ImageContext):
        raise MissingResult(
            "these claims decide over one model's per-image statistics (python -m analysis.studies.real_vit), "
            "not over a training study's runs"
        )
    return ctx


def halves(n: int) -> tuple[np.ndarray, np.ndarray]:
    """The block indices of the first and of the second half (the second has the extra block when ``n`` is odd)."""
    return np.arange(n // 2), np.arange(n // 2, n)


def _boot(c: ImageContext, name: str, values, statistic=np.mean, seed: int = 0, rows=None):
    """A bootstrap part over the context's independent units (its photos, each with all its views), built when the
    claim is judged; ``rows`` [N] bool: only those views (the held-out photos'), resampling only their units."""
    if rows is None:
        return partial(bootstrap_part, name, values, statistic, groups=c.groups, seed=seed)
    groups = None if c.groups is None else np.asarray(c.groups)[rows]
    return partial(bootstrap_part, name, np.asarray(values)[rows], statistic, groups=groups, seed=seed)


def _all_photos(parts: list, **measured) -> dict:
    """The parts computed before the split (chosen and tested on all photos), for the record beside the held-out
    verdict: each part's name, effect and CI."""
    done = [p() for p in parts]
    return {**measured, "parts": [{"name": p.name, "effect": p.effect, "ci": list(p.ci)} for p in done]}


@CLAIMS.claim(
    "head_mix",
    figure="Raghu Fig. 3",
    claim="Even the lowest layers mix local and global heads; higher layers attend globally",
    source=RAGHU_5,
    passage="we observe that even in the lowest layers of ViT, self-attention layers have a mix of local heads (small "
    "distances) and global heads (large distances).",
    rule="Lower layers mix local and global heads; higher layers attend globally (the studies' rule: spread of "
    "head distances lower minus upper half, mean distance upper minus lower half)",
)
def head_mix(ctx) -> Result:
    """Raghu Fig. 3 as the studies read it (analysis/studies/raghu2021/claims.py ``head_mix``), on per-image
    distances; precondition: the probe crops' most local head is local."""
    c = _images(ctx)
    lo, hi = halves(c.distance.shape[1])
    smallest, uniform = float(c.probe_distance.mean(0).min()), c.uniform
    pre = Precondition(
        "local head",
        smallest < LOCAL_FRACTION * uniform,
        f"a local head exists (probe crops: the most local head attends at {smallest:.1f} px = "
        f"{smallest / uniform:.2f} x uniform attention's {uniform:.1f} px; local means below {LOCAL_FRACTION:g} x)",
        {"smallest_px": smallest, "uniform_px": uniform},
    )

    def spread(x, axis):  # x [B, N, L, H] -> [B]: spread of the lower half's heads minus the upper half's
        m = x.mean(axis)
        s = m.max(-1) - m.min(-1)
        return s[:, lo].mean(-1) - s[:, hi].mean(-1)

    def mean_gap(x, axis):
        m = x.mean(axis).mean(-1)
        return m[:, hi].mean(-1) - m[:, lo].mean(-1)

    parts = [
        _boot(c, "spread of head distances, lower half minus upper half (px)", c.distance, spread),
        _boot(c, "mean distance, upper half minus lower half (px)", c.distance, mean_gap, seed=1),
    ]
    return Result(judge(parts, [pre]), measured={"chosen_on": c.chosen_on})


@CLAIMS.claim(
    "upper_global",
    figure="Raghu Fig. 3",
    claim="At higher layers, every self-attention head is global",
    source=RAGHU_5,
    passage="At higher layers, all self-attention heads are global.",
    rule="Every head of the upper half is global: its most local head (chosen on the probe crops) above "
    f"{LOCAL_FRACTION:g} x uniform attention's distance",
)
def upper_global(ctx) -> Result:
    """The upper half's most local head attends above LOCAL_FRACTION x uniform. When the probe crops are crops of the
    analysis photos, the head is chosen on the selection photos' probe crops and tested on the held-out photos'
    analysis views (:func:`held_out`); ``measured["all_photos"]`` keeps the number chosen and tested on all photos.
    Otherwise chosen on the probe images, tested on the analysis views. ``measured`` also says in how many
    leave-one-photo-out choices (the choice made without each photo's probe crops) the same head is picked."""
    c = _images(ctx)
    _, hi = halves(c.distance.shape[1])

    def most_local(probe):  # the upper half's most local head on these probe crops
        pm = probe.mean(0)[hi]
        bi, h = np.unravel_index(int(np.argmin(pm)), pm.shape)
        return int(hi[bi]), int(h)

    def stable(head, probe, units) -> str:  # the choice made without each photo in turn: does one photo decide it?
        same = sum(most_local(probe[units != g]) == head for g in np.unique(units))
        return f"{same} of {len(np.unique(units))}"

    def part(head, on: str, rows=None):
        b, h = head
        return _boot(
            c,
            f"block {b} head {h} (the upper half's most local{on}) minus {LOCAL_FRACTION:g} x uniform (px)",
            c.distance[:, b, h] - LOCAL_FRACTION * c.uniform,
            rows=rows,
        )

    head = most_local(c.probe_distance)
    measured = {"head": head, "chosen_on": c.chosen_on}
    if c.probe_groups is not None:
        measured["same_head_leaving_out_each_unit"] = stable(head, c.probe_distance, c.probe_groups)
    split = held_out(c)
    if split is None:
        return Result(judge([part(head, "")]), measured=measured)
    chosen = most_local(c.probe_distance[split.probe])
    measured = {
        "head": chosen,
        "chosen_on": split.says(len(c.photos)),
        "selection_photos": split.selection.tolist(),
        "test_photos": split.test.tolist(),
        "same_head_leaving_out_each_unit": stable(chosen, c.probe_distance[split.probe], c.probe_groups[split.probe]),
        "all_photos": _all_photos([part(head, "")], **measured),
    }
    on = f" on the {len(split.selection)} selection photos; tested on the {len(split.test)} held-out"
    return Result(judge([part(chosen, on, split.views)]), measured=measured)


@CLAIMS.claim(
    "cls_phase",
    figure="Raghu Fig. 7",
    claim="The CLS token is carried by the skip path in the first half and the spatial tokens by the long branch; "
    "in the second half this is reversed",
    source=RAGHU_6,
    passage="in the first half of the network, the CLS token (token 0) representation is primarily propagated by "
    "the skip connection branch (high norm ratio), while the spatial token representations have a large "
    "contribution coming from the long branch (lower norm ratio). Strikingly, in the second half of the "
    "network, this is reversed.",
    rule="log(CLS norm ratio) minus the spatial tokens' mean log ratio, averaged over each half's blocks whose "
    "CLS input depends on the image: above 0 in the first half, below 0 in the second (attention and MLP)",
)
def cls_phase(ctx) -> Result:
    """Four parts (attention and MLP, each half), each averaged over the half's eligible blocks. A block whose CLS skip
    input is the same vector for every image (relative spread < 1e-6: block 0's cls_token + pos_embed[0]) is left out
    of that sublayer's average: its ratio says nothing about how images are propagated. Precondition: at least 4
    eligible blocks in every half."""
    c = _images(ctx)
    L = c.log_gap.shape[2]
    lo, hi = halves(L)
    eligible = c.cls_input_spread > 1e-6  # [2, L]
    parts, counts = [], {}
    for s, sub in enumerate(("attention", "MLP")):
        for half, idx in (("first", lo), ("second", hi)):
            use = [i for i in idx if eligible[s, i]]
            counts[f"{sub} {half} half"] = len(use)
            gap = c.log_gap[:, s, use].mean(-1)  # in the paper's direction: CLS above in the first half, below after
            what = (
                "log CLS ratio minus spatial tokens' mean log ratio"
                if half == "first"
                else "spatial tokens' mean log ratio minus log CLS ratio"
            )
            span = f"blocks {use[0]}-{use[-1]}" if use else "no block"
            parts.append(_boot(c, f"{sub}, {span}: {what}", gap if half == "first" else -gap, seed=len(parts)))
    few = {k: v for k, v in counts.items() if v < 4}
    left_out = [f"{('attention', 'MLP')[s]} of block {i}" for s in range(2) for i in range(L) if not eligible[s, i]]
    pre = Precondition(
        "blocks per half",
        not few,
        "at least 4 blocks with an image-dependent CLS input in every half "
        f"({', '.join(f'{k}: {v}' for k, v in counts.items())}; left out: {', '.join(left_out) or 'none'})",
        counts,
    )
    return Result(judge(parts, [pre]), measured={"left_out": left_out})


@CLAIMS.claim(
    "offset_early",
    figure="Walmer Fig. 3, 14; App. C.1",
    claim="Offset local heads occur only in the first 3 to 6 layers",
    source="Walmer et al. 2023 App. C.1",
    passage="Offset Local Attention Heads typically only occur in the first 3 to 6 layers",
    rule=f"The first half's best offset-local head puts at least {MIN_MASS:g} of its attention in its offset "
    "window (3 x 3 tokens); the second half's best offset window holds less",
)
def offset_early(ctx) -> Result:
    """Part 1: the first half's best offset-local head puts at least MIN_MASS of its attention in its offset window;
    part 2 (in the paper's direction): the second half's best offset window holds less than MIN_MASS. The windows are
    chosen on the probe crops: when those are crops of the analysis photos, on the selection photos' probe crops
    (``chosen_split``), tested on the held-out photos' analysis views (:func:`held_out`; ``measured["all_photos"]``
    keeps the windows chosen and tested on all photos)."""
    c = _images(ctx)
    split = held_out(c)

    def parts_of(chosen: dict, rows=None) -> list:
        parts = []
        for half in ("first", "second"):
            if half not in chosen:
                continue
            b, h, off = chosen[half]
            mass = c.window_mass[:, c.windows.index((b, h, off))]
            where = f"block {b} head {h}, window at ({off[0]:+d}, {off[1]:+d})"
            if half == "first":  # written in the paper's direction: positive = as Walmer says
                name, values = f"{where}: attention mass minus {MIN_MASS:g}", mass - MIN_MASS
            else:
                name, values = f"{where}: {MIN_MASS:g} minus attention mass", MIN_MASS - mass
            on = "" if rows is None else f" (chosen on the selection photos; the {len(split.test)} held-out photos)"
            parts.append(_boot(c, name + on, values, seed=len(parts), rows=rows))
        return parts

    chosen = c.chosen if split is None else c.chosen_split
    parts = parts_of(chosen, None if split is None else split.views)
    found = "first" in chosen
    where = "probe crops" if split is None else "selection photos' probe crops"
    pre = Precondition(
        "offset head",
        found,
        f"some first-half head is offset-local on the {where}"
        if found
        else f"no head of the first half is offset-local on the {where}",
        {},
    )
    if not parts:
        parts = [_boot(c, "no window", np.zeros(c.window_mass.shape[0]))]
    measured: dict = {"chosen_on": c.chosen_on}
    if split is not None:
        every = parts_of(c.chosen)
        measured = {
            "chosen_on": split.says(len(c.photos)),
            "windows": {k: [v[0], v[1], list(v[2])] for k, v in chosen.items()},
            "selection_photos": split.selection.tolist(),
            "test_photos": split.test.tolist(),
            "all_photos": _all_photos(every, chosen_on=c.chosen_on) if every else {"chosen_on": c.chosen_on},
        }
    return Result(judge(parts, [pre]), measured=measured)


@CLAIMS.claim(
    "depth_profile",
    figure="Walmer Fig. 4 right",
    claim="Global heads in the first layer, shorter distances around layers 3-6, and distances trending up in the "
    "later layers of a contrastive model",
    source="Walmer et al. 2023 §4.3",
    passage="In all models, we observe a greater number of global attention heads in the initial layers, "
    "followed by decreased distances around layers 3-6. [...] For the models trained with explicit or "
    "contrastive supervision, the Attention Distance trends upward in the later layers.",
    rule="Mean head distance of layer 1 above layers 3-6, and of the later half above layers 3-6",
)
def depth_profile(ctx) -> Result:
    """For a contrastive (DINO-family) model: the first layer more global than layers 3-6, and the later half trending
    back up above layers 3-6 (the paper's layer n is block n - 1: layers 3-6 are blocks 2-5)."""
    c = _images(ctx)
    L = c.distance.shape[1]
    mid = np.arange(2, min(6, L))
    _, hi = halves(L)

    def first_vs_mid(x, axis):
        m = x.mean(axis).mean(-1)
        return m[:, 0] - m[:, mid].mean(-1)

    def late_vs_mid(x, axis):
        m = x.mean(axis).mean(-1)
        return m[:, hi].mean(-1) - m[:, mid].mean(-1)

    parts = [
        _boot(
            c, "block 0 minus blocks 2-5 (layer 1 minus layers 3-6), mean head distance (px)", c.distance, first_vs_mid
        ),
        _boot(c, f"blocks {hi[0]}-{hi[-1]} minus blocks 2-5 (px)", c.distance, late_vs_mid, seed=1),
    ]
    return Result(judge(parts))
