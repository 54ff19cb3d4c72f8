"""The real-ViT report as a paper plug-in: found by analysis.studies.papers(), claiming no training study, and its five
claims decided by the claim engine over synthetic per-image arrays whose answer is known (held, did not hold,
inconclusive, not testable); the intervals resample the photos a view was cut from, and the report says what they are
about and what the heads were chosen on. The real model's run is python -m analysis.studies.real_vit
(docs/real-vit.md)."""

from __future__ import annotations

import json
import types
from pathlib import Path

import numpy as np
import pytest

from analysis import studies
from analysis.studies import claims as C
from analysis.studies.real_vit import PAPER
from analysis.studies.real_vit.claims import CLAIMS, ImageContext

N, L, H = 24, 12, 6
UNIFORM = 80.0  # local below 0.5 x 80 = 40 px
SIGN = np.where(np.arange(N) % 2 == 0, 1.0, -1.0)  # alternating images: a per-image effect whose mean is exactly 0


def _profile() -> np.ndarray:
    """[L, H] head distances (px) as a DINO-like ViT has them: block 0 mixed and more global than blocks 1-5, which
    mix local and global heads; the upper half all global."""
    d = np.empty((L, H))
    d[0] = [15, 90, 110, 115, 120, 125]
    d[1:6] = [10, 20, 40, 80, 100, 110]
    d[6:] = [100, 105, 110, 115, 120, 125]
    d[6, 0] = 90  # the upper half's most local head
    return d


def _noisy(profile: np.ndarray, seed: int, n: int = N) -> np.ndarray:
    return profile[None] + np.random.default_rng(seed).normal(0, 2, size=(n, *profile.shape))


def _flat() -> np.ndarray:
    """Every statistic's per-image value is +x or -x on alternating images: mean exactly 0."""
    return 2 * UNIFORM * 0.25 + SIGN[:, None, None] * (np.arange(L)[None, :, None] + 1) * np.ones((N, L, H))


WINDOWS = [(3, 4, (-1, 0)), (7, 5, (0, 1))]


def ctx(distance=None, probe=None, log_gap=None, spread=None, mass=None, chosen=None, **units) -> ImageContext:
    rng = np.random.default_rng(3)
    if log_gap is None:
        gap = np.where(np.arange(L) < L // 2, 1.0, -1.0)  # CLS above the spatial tokens in the first half only
        log_gap = gap[None, None, :] + rng.normal(0, 0.1, size=(N, 2, L))
    if spread is None:
        spread = np.ones((2, L))
        spread[0, 0] = 0.0  # block 0's attention: the same CLS input for every image
    if mass is None:
        mass = np.stack([0.7 + rng.normal(0, 0.03, N), 0.2 + rng.normal(0, 0.03, N)], 1)
    return ImageContext(
        distance=_noisy(_profile(), 0) if distance is None else distance,
        probe_distance=_noisy(_profile(), 1, 36) if probe is None else probe,
        uniform=UNIFORM,
        log_gap=log_gap,
        cls_input_spread=spread,
        window_mass=mass,
        windows=list(WINDOWS),
        chosen=dict(zip(("first", "second"), WINDOWS)) if chosen is None else chosen,
        **units,
    )


def outcomes(c) -> dict[str, str]:
    return {claim.id: r.outcome for claim, r in C.run_claims(PAPER, c)}


def test_the_plugin_is_found_and_claims_no_training_study():
    assert studies.papers()["real_vit"] is PAPER
    assert CLAIMS.ids() == ["head_mix", "upper_global", "cls_phase", "offset_early", "depth_profile"]
    for configs in ({"vit_cls": [], "resnet": []}, {"vit_reg0": [], "vit_reg4": []}, {"supervised": [], "dino": []}):
        assert not PAPER.applies(configs)
        assert studies.paper_for(types.SimpleNamespace(name="mine", paper=None), configs).name != "real_vit"
    assert studies.paper_for(types.SimpleNamespace(name="mine", paper=None), {"a": [], "b": []}) is None


def test_a_dino_like_model_holds_the_claims():
    out = C.run_claims(PAPER, ctx())
    assert {c.id: r.outcome for c, r in out} == dict.fromkeys(CLAIMS.ids(), C.HELD)
    by = {c.id: r for c, r in out}
    assert by["upper_global"].measured["head"] == (6, 0)  # the upper half's most local head on the probe crops
    assert by["cls_phase"].measured["left_out"] == ["attention of block 0"]
    assert "blocks 1-5" in by["cls_phase"].decision.parts[0].name  # block 0 left out of the attention's first half
    assert all(p.test == "bootstrap BCa" and p.n == (N,) for r in by.values() for p in r.decision.parts)
    rec = [C.record(c, r) for c, r in out]
    assert json.loads(json.dumps(rec))[0]["verdict"] == C.HELD and rec[0]["passage"].startswith("we observe")


def test_the_reversed_model_does_not_hold_them():
    rng = np.random.default_rng(5)
    c = ctx(
        distance=_noisy(_profile()[::-1], 0),  # local heads at the top, global ones at the bottom
        probe=_noisy(_profile()[::-1], 1, 36),
        log_gap=-ctx().log_gap,
        mass=np.stack([0.2 + rng.normal(0, 0.03, N), 0.8 + rng.normal(0, 0.03, N)], 1),
    )
    assert outcomes(c) == dict.fromkeys(CLAIMS.ids(), C.NOT_HELD)


def test_no_effect_is_inconclusive():
    # heads that differ from image to image, in pairs that cancel (the mean stays exactly flat): a spread of head
    # distances that varies over the images (an exactly constant one is degenerate: not testable, not inconclusive)
    wobble = SIGN[:, None, None] * np.repeat(np.random.default_rng(0).normal(0, 0.5, (N // 2, L, H)), 2, axis=0)
    c = ctx(
        distance=_flat() + wobble,
        log_gap=SIGN[:, None, None] * np.ones((N, 2, L)),
        mass=np.stack([0.5 + 0.1 * SIGN, 0.5 - 0.1 * SIGN], 1),
    )
    assert outcomes(c) == dict.fromkeys(CLAIMS.ids(), C.INCONCLUSIVE)


def test_a_missing_precondition_makes_a_claim_not_testable():
    spread = np.ones((2, L))
    spread[1, :3] = 0.0  # the MLP's first half keeps 3 blocks: fewer than 4
    c = ctx(probe=_noisy(_profile() + 60, 1, 36), spread=spread, chosen={"second": WINDOWS[1]})
    out = {claim.id: r for claim, r in C.run_claims(PAPER, c)}
    assert out["head_mix"].outcome == C.NOT_TESTABLE and "most local head attends at" in out["head_mix"].why
    assert out["cls_phase"].outcome == C.NOT_TESTABLE and "MLP first half: 3" in out["cls_phase"].why
    assert out["offset_early"].outcome == C.NOT_TESTABLE
    assert "no head of the first half" in out["offset_early"].why.lower()
    assert out["depth_profile"].outcome == C.HELD  # no precondition
    none = {claim.id: r for claim, r in C.run_claims(PAPER, ctx(chosen={}))}["offset_early"]
    assert none.outcome == C.NOT_TESTABLE and [p.name for p in none.decision.parts] == ["no window"]


def test_a_training_study_that_names_the_paper_gets_not_testable_claims():
    study_ctx = types.SimpleNamespace(configs={"vit_cls": []}, shared={})
    out = C.run_claims(PAPER, study_ctx)
    assert [r.outcome for _, r in out] == [C.NOT_TESTABLE] * 5
    assert "per-image statistics" in out[0][1].why


def test_the_windows_are_chosen_on_the_probe_crops():
    from analysis.studies.real_vit.reads import offset_windows

    mass = np.full((L, H), 0.1)
    offset = np.zeros((L, H), bool)
    peaks = np.zeros((L, H, 2), int)
    mass[2, 1], offset[2, 1], peaks[2, 1] = 0.6, True, (1, 0)
    mass[4, 3], offset[4, 3], peaks[4, 3] = 0.7, True, (0, -2)
    mass[1, 0] = 0.9  # most mass, but not offset-local: not chosen for the first half
    mass[9, 2], peaks[9, 2] = 0.3, (1, 1)  # the second half's best offset window, though not offset-local
    assert offset_windows(mass, offset, peaks) == {"first": (4, 3, (0, -2)), "second": (9, 2, (1, 1))}
    assert offset_windows(mass, np.zeros_like(offset), np.zeros_like(peaks)) == {}


def _summary(claims: dict, **extra) -> dict:
    """The summary a real-ViT report is written from: toy numbers around ``claims`` (records by id)."""
    d = np.full(L, 50.0)
    return {
        "model": "timm:toy",
        "images": {"source": "toy photos", "preprocessing": {"size": 224}},
        "uniform_px": UNIFORM,
        "grid": [16, 16],
        "patch": 14,
        "n_analysis": N,
        "n_probe": 36,
        "wall_s": {"suite": 1.0, "claims": 2.0},
        "computed": 0,
        "reused": 11,
        "claims": claims,
        "attention_distance": {"min_px": d.tolist(), "mean_px": d.tolist(), "max_px": d.tolist()},
        "norm_ratio": {s: {"cls": d.tolist(), "spatial": d.tolist()} for s in ("attn", "mlp")},
        "offset_local_heads": [],
        "other_measures": {},
        **extra,
    }


def test_the_report_shows_each_claim_from_its_record(tmp_path):
    pytest.importorskip("matplotlib")
    from analysis.studies.real_vit import report as R

    results = C.run_claims(PAPER, ctx())
    s = _summary({c.id: C.record(c, r) for c, r in results}, other_measures={"knn": [0.5]})
    out = tmp_path / "docs" / "real-vit.md"
    R.write(s, out, out.parent / "figures" / "real-vit", ["cka_self.png"])
    md = out.read_text()
    assert "| head_mix | Raghu Fig. 3 | **held** | spread of head distances" in md
    assert "### depth_profile (Walmer Fig. 4 right)" in md and "Verdict: **held**. Every part" in md
    assert "![cka_self.png](figures/real-vit/cka_self.png)" in md and "- none" in md
    back = C.read_json(out.with_suffix(".json"))
    assert back["paper"] == "real_vit" and back["claims"]["cls_phase"]["verdict"] == C.HELD
    assert back["uniform_px"] == UNIFORM and Path(out).with_suffix(".json").is_file()


def test_run_claims_takes_a_context_without_training_runs():
    """A claim that needs a configuration is not testable on per-image arrays, which have none (no AttributeError)."""
    toy = C.Paper("toy", "t", C.Claims("toy"))
    toy.claims.claim("x", figure="f", claim="c", source="s", passage="p", rule="r", needs=["vit_cls"])(lambda c: None)
    ((_, r),) = C.run_claims(toy, ctx())
    assert r.outcome == C.NOT_TESTABLE and "no runs of vit_cls" in r.why


PHOTOS = np.repeat(np.arange(8), 3)  # 24 views: 3 crops of each of 8 photos


def _photo_effect(seed: int = 7) -> np.ndarray:
    """Per-view distances whose photo moves all its crops together (SD 6 px per photo, 2 px per crop)."""
    rng = np.random.default_rng(seed)
    return _noisy(_profile(), 0) + rng.normal(0, 6, size=(8, 1, H))[PHOTOS]


def test_the_claims_resample_the_photos():
    """With the views' photos in the context, every part is a bootstrap over the 8 photos (n = 8), the same interval
    bootstrap_part gives on those values with groups=photo; photo-level noise makes it wider than the view-level one."""
    from analysis.studies.stats import bootstrap_part

    c = ctx(distance=_photo_effect(), groups=PHOTOS, population="the 8 photos")
    by = {claim.id: r for claim, r in C.run_claims(PAPER, c)}
    parts = [p for r in by.values() for p in r.decision.parts]
    assert all(p.n == (8,) and p.test == "bootstrap BCa over 8 groups" for p in parts)
    (part,) = by["upper_global"].decision.parts
    values = c.distance[:, 6, 0] - 0.5 * UNIFORM
    assert part.ci == bootstrap_part("x", values, groups=PHOTOS).ci
    per_view = {claim.id: r for claim, r in C.run_claims(PAPER, ctx(distance=c.distance))}
    (views,) = per_view["upper_global"].decision.parts
    assert part.ci[1] - part.ci[0] > 1.5 * (views.ci[1] - views.ci[0])
    assert by["upper_global"].measured["chosen_on"] == "the probe-train crops"
    assert "same_head_leaving_out_each_unit" not in by["upper_global"].measured  # probe photos unknown


def test_the_head_choice_says_whether_one_photo_decides_it():
    """The upper half's most local head chosen again with each probe photo left out: always the same head on the
    DINO-like profile; one photo whose crops make another head very local decides the choice: that head is picked in
    the 11 leave-one-out choices that keep the photo, not in the one that leaves it out."""
    probe_photos = np.repeat(np.arange(12), 3)
    by = {claim.id: r for claim, r in C.run_claims(PAPER, ctx(probe_groups=probe_photos))}
    assert by["upper_global"].measured["same_head_leaving_out_each_unit"] == "12 of 12"
    probe = _noisy(_profile(), 1, 36)
    probe[:, 6, 1] = 92.0
    probe[:3, 6, 1] = 0.0  # photo 0's crops: head (6, 1) attends at 0 px, pulling its mean to 84.3 px < 90 px
    r = {claim.id: r for claim, r in C.run_claims(PAPER, ctx(probe=probe, probe_groups=probe_photos))}["upper_global"]
    assert r.measured["head"] == (6, 1) and r.measured["same_head_leaving_out_each_unit"] == "11 of 12"


def test_the_report_states_the_population_and_where_heads_are_chosen(tmp_path):
    pytest.importorskip("matplotlib")
    from analysis.studies.real_vit import report as R

    chosen_on = "other crops (seed 1) of the same 8 photos"
    c = ctx(distance=_photo_effect(), groups=PHOTOS, population="the 8 photos", chosen_on=chosen_on)
    c.probe_groups = np.repeat(np.arange(12), 3)
    claims = R.claim_records(c)
    part = claims["upper_global"]["decision"]["parts"][0]
    assert part["ci_views"][1] - part["ci_views"][0] < part["ci"][1] - part["ci"][0]  # the views' CI: too narrow
    assert claims["upper_global"]["measured"]["chosen_on"] == chosen_on
    s = _summary(claims, population="the 8 photos", units=8, chosen_on=chosen_on)
    out = tmp_path / "real-vit.md"
    R.write(s, out, tmp_path / "figures", [])
    md = out.read_text()
    assert "The 24 analysis views are crops of the 8 photos" in md and "resamples the 8 photos" in md
    assert f"chosen on {chosen_on} and tested on the analysis views" in md
    lo, hi = part["ci_views"]
    assert f"[{part['ci'][0]:+.3g}, {part['ci'][1]:+.3g}] ({lo:+.3g}, {hi:+.3g})" in md
    assert md.count(f"The head or window is chosen on {chosen_on}") == 3  # head_mix, upper_global, offset_early
    assert "each photo left out in turn (on the other photos' probe crops), the same head is picked 12 of 12" in md
    # each image its own unit (a folder of one's own images): no second interval, no photo sentence
    own = R.claim_records(ctx(groups=np.arange(N), population=f"these {N} images"))
    assert "ci_views" not in own["head_mix"]["decision"]["parts"][0]
    assert R._unit({**s, "population": f"these {N} images", "units": N, "chosen_on": "the images of p/"})[0] == (
        f"Every interval resamples these {N} images, each an independent unit; the intervals are about these {N} "
        "images."
    )


def test_the_photos_carry_their_photo_and_a_folder_its_images(tmp_path):
    """analysis/sources/images.py: each bundled view keeps its photo's index as its group (the 19 photos), each image
    of a folder is its own."""
    pytest.importorskip("skimage", reason="the dev extra's scikit-image ships the photos (pip install -e '.[dev]')")
    timm = pytest.importorskip("timm")
    from PIL import Image

    from analysis.sources.images import image_set

    model = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32, num_classes=0)
    photos = image_set("photos", model, img_size=32, views=2, probe_views=1)
    assert np.array_equal(photos.groups, np.repeat(np.arange(19), 2))
    assert np.array_equal(photos.groups, photos.analysis.labels.numpy())
    assert photos.population == photos.meta["population"] == "the 19 photos" and photos.meta["groups"] == 19
    assert photos.meta["probe"] == "other crops (seed 1) of the same 19 photos"
    assert np.array_equal(photos.probe_groups, np.arange(19)) and len(photos.probe_train) == 19
    for k in range(3):
        Image.fromarray(np.full((40, 50, 3), 60 * k, np.uint8)).save(tmp_path / f"{k}.png")
    own = image_set(str(tmp_path), model, img_size=32)
    assert np.array_equal(own.groups, np.arange(3)) and own.population == "these 3 images"
    assert own.meta["probe"] == "no probe images" and own.probe_groups is None


def test_the_measures_figures_are_drawn_from_the_results_with_no_step_and_blocks_from_0():
    """The report draws the measures' figures it shows from their results (not copies of whatever the run's figure
    folder holds, which an earlier version may have titled "(step 0)" and numbered otherwise): no training step in any
    title, blocks on the x axis from 0 as in the report's tables and text ("Blocks are numbered from 0")."""
    from analysis.engine.figures import BLOCK_AXIS
    from analysis.studies.real_vit.figures import suite_figures

    blocks = [f"blocks.{i}" for i in range(12)]
    res = {"norm_ratio": {"ratio": np.ones((2, 12, 5)), "blocks": blocks, "sublayers": ["attn", "mlp"],
                          "num_prefix_tokens": 1}}  # fmt: skip
    figs = suite_figures(res, {"norm_ratio_lines.png", "cka_self.png"})
    assert set(figs) == {"norm_ratio_lines.png"}  # only the figures asked for, and only those with results
    ax = figs["norm_ratio_lines.png"].axes[0]
    assert "step" not in ax.get_title() and ax.get_xlabel() == BLOCK_AXIS == "block (0 = first)"
    assert ax.get_xticks()[0] == 0 and max(ax.get_lines()[0].get_xdata()) == 11  # blocks 0-11, not 1-12


def test_the_split_is_a_fixed_rule_on_the_photo_indices():
    """photo_split: the photos permuted by numpy's PCG64 seeded SPLIT_SEED, the first ceil(half) for selection (19
    photos: 10 / 9), disjoint, covering every photo, the same on every call and whatever the views' order."""
    from analysis.studies.real_vit.claims import SPLIT_SEED, photo_split

    sel, test = photo_split(np.repeat(np.arange(19), 16))
    order = np.random.default_rng(SPLIT_SEED).permutation(19)
    assert np.array_equal(sel, np.sort(order[:10])) and np.array_equal(test, np.sort(order[10:]))
    assert len(sel) == 10 and len(test) == 9 and not set(sel) & set(test)
    again = photo_split(np.random.default_rng(0).permutation(np.repeat(np.arange(19), 16)))
    assert all(np.array_equal(a, b) for a, b in zip(again, (sel, test)))
    with pytest.raises(ValueError, match="at least 2 photos"):
        photo_split([3, 3])


SPLIT_PHOTOS = np.repeat(np.arange(8), 3)  # 24 analysis views: 3 crops of each of 8 photos
SPLIT_PROBE = np.repeat(np.arange(8), 4)  # 32 probe crops: 4 of each photo


def test_upper_globals_head_is_chosen_on_selection_photos_and_tested_on_the_held_out_ones():
    """Hand-made: on the held-out photos' probe crops head (6, 1) attends at 0 px, so a choice that saw them would
    pick it (as the all-photos choice does); the selection photos' probe crops make (6, 0) the most local. On the
    selection photos' analysis views (6, 0) is local (0 px: a reversal); on the held-out ones global (90 px). The
    held-out test picks (6, 0) and holds, resampling the 4 held-out photos: neither choice nor test saw the other
    side's photos; the all-photos number is recorded beside it."""
    from analysis.studies.real_vit.claims import photo_split

    sel, test = photo_split(SPLIT_PHOTOS)
    probe = _noisy(_profile(), 1, 32)
    probe[:, 6, 1] = 92.0
    probe[np.isin(SPLIT_PROBE, test), 6, 1] = 0.0
    distance = _noisy(_profile(), 0)
    distance[np.isin(SPLIT_PHOTOS, sel), 6, 0] = 0.0
    c = ctx(distance=distance, probe=probe, groups=SPLIT_PHOTOS, probe_groups=SPLIT_PROBE, photos=SPLIT_PHOTOS)
    r = {claim.id: r for claim, r in C.run_claims(PAPER, c)}["upper_global"]
    assert r.measured["head"] == (6, 0) and r.outcome == C.HELD
    (part,) = r.decision.parts
    assert part.n == (4,) and "tested on the 4 held-out" in part.name
    assert r.measured["test_photos"] == test.tolist() and r.measured["selection_photos"] == sel.tolist()
    assert (
        "4 selection photos" in r.measured["chosen_on"]
        and "12 analysis views of the 4 held-out" in (r.measured["chosen_on"])
    )
    before = r.measured["all_photos"]
    assert before["head"] == (6, 1)  # the choice that saw every photo's probe crops, tested on every view
    assert before["parts"][0]["effect"] == pytest.approx(distance[:, 6, 1].mean() - 0.5 * UNIFORM)
    # the held-out part is the bootstrap of the held-out views alone, over their photos
    from analysis.studies.stats import bootstrap_part

    rows = np.isin(SPLIT_PHOTOS, test)
    assert part.ci == bootstrap_part("x", distance[rows, 6, 0] - 0.5 * UNIFORM, groups=SPLIT_PHOTOS[rows]).ci
    # without the views' photos (a folder: probe images are other images) nothing is split
    plain = {claim.id: r for claim, r in C.run_claims(PAPER, ctx(probe=probe, probe_groups=SPLIT_PROBE))}
    assert plain["upper_global"].measured["head"] == (6, 1) and "all_photos" not in plain["upper_global"].measured


def test_offset_earlys_windows_come_from_the_selection_photos_and_are_tested_on_the_held_out_ones():
    """The windows chosen on the selection photos (``chosen_split``) decide the verdict, on the held-out photos'
    views only; the windows chosen on all photos (``chosen``) are recorded beside it. Window 0's mass is 0.9 on the
    selection photos' views and 0.1 on the held-out ones (the all-photos window would have looked offset-local)."""
    from analysis.studies.real_vit.claims import photo_split

    sel, _ = photo_split(SPLIT_PHOTOS)
    rng = np.random.default_rng(4)
    w_all, w_sel = (2, 1, (1, 0)), (3, 4, (-1, 0))
    second = (7, 5, (0, 1))
    mass = np.stack([np.where(np.isin(SPLIT_PHOTOS, sel), 0.9, 0.1), 0.7 + rng.normal(0, 0.03, N), 0.2 + 0 * SIGN], 1)
    probe = _noisy(_profile(), 1, 32)
    c = ctx(mass=mass, probe=probe, groups=SPLIT_PHOTOS, probe_groups=SPLIT_PROBE, photos=SPLIT_PHOTOS)
    c.windows = [w_all, w_sel, second]
    c.chosen, c.chosen_split = {"first": w_all, "second": second}, {"first": w_sel, "second": second}
    r = {claim.id: r for claim, r in C.run_claims(PAPER, c)}["offset_early"]
    first, _ = r.decision.parts
    assert "block 3 head 4" in first.name and first.n == (4,) and first.effect == pytest.approx(0.7 - 0.5, abs=0.05)
    assert r.measured["windows"]["first"] == [3, 4, [-1, 0]]
    before = r.measured["all_photos"]["parts"][0]
    assert "block 2 head 1" in before["name"] and before["effect"] == pytest.approx((4 * 0.9 + 4 * 0.1) / 8 - 0.5)


def test_the_windows_of_the_split_see_only_the_selection_photos_probe_crops(monkeypatch):
    """image_context's window choice for the split runs aligned_attention on the selection photos' probe crops
    alone: the crops handed to it (labelled by photo) are those, in order."""
    import torch

    from analysis.sources.images import ImageSet
    from analysis.studies.real_vit import reads
    from analysis.studies.real_vit.claims import photo_split
    from train.splits import TensorBatches

    seen = []

    def fake_suite(model, data, opts):
        seen.append(data.probe_train.labels.clone())
        return {"aligned_attention": {"mass_maps": None}}

    def fake_heads(*a):
        return {
            "peak_mass": np.zeros((2, 1)),
            "offset_local": np.zeros((2, 1), bool),
            "peak_offset": np.zeros((2, 1, 2)),
        }

    monkeypatch.setattr(reads.S, "run_suite", fake_suite)
    monkeypatch.setattr(reads, "offset_local_heads", fake_heads)
    probe = TensorBatches(torch.zeros(32, 3, 4, 4, dtype=torch.uint8), torch.from_numpy(SPLIT_PROBE))
    data = ImageSet(probe, probe, 8, [str(i) for i in range(8)], torch.zeros(3), torch.ones(3))
    sel, _ = photo_split(SPLIT_PHOTOS)
    assert reads.probe_windows(None, data, np.isin(SPLIT_PROBE, sel)) == {}
    assert np.array_equal(seen[-1].numpy(), SPLIT_PROBE[np.isin(SPLIT_PROBE, sel)])
    reads.probe_windows(None, data)
    assert np.array_equal(seen[-1].numpy(), SPLIT_PROBE)


def test_the_report_shows_the_split_and_the_two_nulls(tmp_path):
    """The report says which photos chose the heads and which tested them, gives the all-photos number beside the
    held-out one, and tables the similarity maps under the view-level and the photo-level nulls."""
    pytest.importorskip("matplotlib")
    from analysis.studies.real_vit import report as R

    c = ctx(
        probe=_noisy(_profile(), 1, 32),
        groups=SPLIT_PHOTOS,
        probe_groups=SPLIT_PROBE,
        photos=SPLIT_PHOTOS,
        population="the 8 photos",
        chosen_on="other crops (seed 1) of the same 8 photos",
    )
    claims = R.claim_records(c)
    row = {"mean_offdiag": 0.63, "pairs": 66, "max_p_fwer": 0.005}
    sim = {
        "n_images": 24,
        "n_perm": 200,
        "n_units": 8,
        "distinct_photo_permutations": 40320,
        "estimators": {
            "cka": {
                "view": {**row, "mean_offdiag_z": 140.0, "significant_pairs": 66},
                "photo": {**row, "mean_offdiag_z": 9.3, "significant_pairs": 63},
            }
        },
    }
    s = _summary(claims, population="the 8 photos", units=8, chosen_on=c.chosen_on, split=R.split_of(c), similarity=sim)
    out = tmp_path / "real-vit.md"
    R.write(s, out, tmp_path / "figures", [])
    md = out.read_text()
    assert "the 16 probe crops of the selection photos (0, 2, 5, 7)" in md
    assert "the 12 analysis views of the held-out photos (1, 3, 4, 6)" in md
    assert (
        md.count("Before the split (chosen on other crops (seed 1) of the same 8 photos") == 2
    )  # upper_global, offset
    assert "| linear CKA | 0.630 | views permuted | 140 | 66 of 66 | 0.005 |" in md
    assert "| linear CKA | 0.630 | photos permuted | 9.3 | 63 of 66 | 0.005 |" in md
    assert "p never below 1 / 201" in md and "4.03e+04 distinct permutations" in md
