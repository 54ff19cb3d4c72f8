"""CLS attention maps and aligned aggregated attention maps (Walmer et al. 2023 Fig. 2, 3, 14): known answers,
explicit-loop references, the Measures end to end on a tiny timm ViT, sum-reduction over processes, save/load."""

from __future__ import annotations

import math
import types

import numpy as np
import pytest
import torch
from conftest import tiny_vit

from analysis.engine.measure import Context, load_result, save_result
from analysis.engine.taps import Taps, block_names, grid_of
from analysis.measures.aligned_attention import (
    AlignedAttention,
    aligned_attention_maps,
    canvas_index,
    coverage,
    find_peaks,
    mass_centre,
    offset_local_heads,
)
from analysis.measures.cls_attention import ClsAttention, cls_attention_maps


def _softmax_attention(batch, heads, tokens, seed):
    g = torch.Generator().manual_seed(seed)
    return (3 * torch.randn(batch, heads, tokens, tokens, generator=g)).softmax(-1)


def _pattern_attention(grid, prefix, rule, batch=2):
    """[batch, 1, T, T]: spatial query (r, c) puts all its mass on the key rule(r, c) -> (r', c') (or on the CLS
    column when rule gives None); prefix rows attend to token 0."""
    gh, gw = grid
    t = prefix + gh * gw
    a = torch.zeros(batch, 1, t, t)
    a[:, :, :prefix, 0] = 1.0
    for r in range(gh):
        for c in range(gw):
            key = rule(r, c)
            q = prefix + r * gw + c
            if key is None:
                a[:, 0, q, 0] = 1.0
            else:
                a[:, 0, q, prefix + key[0] * gw + key[1]] = 1.0
    return a


# ----------------------------------------------------------------------------------------- aligned attention maps


def _aligned_reference(attn, grid, prefix):
    """Explicit loops: renormalise each spatial row, drop it on the canvas centred on its query, count who sees what."""
    gh, gw = grid
    b, h = attn.shape[:2]
    canvas = np.zeros((h, 2 * gh - 1, 2 * gw - 1))
    seen = np.zeros((h, 2 * gh - 1, 2 * gw - 1))
    pairs = np.zeros(h)
    a = attn.double().numpy()
    for i in range(b):
        for head in range(h):
            for q in range(gh * gw):
                row = a[i, head, prefix + q, prefix:]
                if row.sum() == 0:
                    continue
                row = row / row.sum()
                pairs[head] += 1
                r, c = divmod(q, gw)
                for k in range(gh * gw):
                    r2, c2 = divmod(k, gw)
                    canvas[head, gh - 1 + r2 - r, gw - 1 + c2 - c] += row[k]
                    seen[head, gh - 1 + r2 - r, gw - 1 + c2 - c] += 1
    return canvas / np.maximum(seen, 1), canvas / pairs[:, None, None]


@pytest.mark.parametrize("grid,prefix", [((3, 4), 1), ((4, 3), 0), ((2, 2), 5)])
def test_aligned_maps_match_explicit_loops(grid, prefix):
    attn = _softmax_attention(3, 2, prefix + grid[0] * grid[1], seed=sum(grid) + prefix)
    attn[1, 0, prefix + 1, prefix:] = 0  # a query with no spatial mass: left out of sums and counts
    maps, mass = aligned_attention_maps(attn, grid, prefix)
    ref_maps, ref_mass = _aligned_reference(attn, grid, prefix)
    assert maps.shape == (2, 2 * grid[0] - 1, 2 * grid[1] - 1) and maps.dtype == torch.float64
    np.testing.assert_allclose(maps.numpy(), ref_maps, rtol=1e-12, atol=1e-15)
    np.testing.assert_allclose(mass.numpy(), ref_mass, rtol=1e-12, atol=1e-15)
    np.testing.assert_allclose(mass.sum((1, 2)).numpy(), 1.0, rtol=1e-12)


def test_canvas_index_and_coverage():
    idx = canvas_index((2, 3))  # canvas 3 x 5, centre cell (1, 2) = flat 7
    assert idx.diagonal().eq(7).all()
    assert idx[0, 1] == 8 and idx[1, 0] == 6  # key one column right of the query -> (1, 3); left -> (1, 1)
    assert idx[0, 3] == 12 and idx[3, 0] == 2  # key one row below -> (2, 2); above -> (0, 2)
    cov = coverage((2, 3))
    assert cov.tolist() == [[1, 2, 3, 2, 1], [2, 4, 6, 4, 2], [1, 2, 3, 2, 1]]
    assert np.bincount(idx.reshape(-1).numpy(), minlength=15).reshape(3, 5).tolist() == cov.tolist()


def test_uniform_attention_is_flat_and_not_offset_local():
    grid, prefix = (7, 7), 1
    t = prefix + 49
    attn = torch.full((2, 3, t, t), 1.0 / t)
    maps, mass = aligned_attention_maps(attn, grid, prefix)
    np.testing.assert_allclose(maps.numpy(), 1 / 49, rtol=1e-12)  # per-offset mean: flat
    np.testing.assert_allclose(
        mass.numpy(), np.broadcast_to(coverage(grid) / 49**2, mass.shape), rtol=1e-12
    )  # Walmer's: a pyramid
    cls = offset_local_heads(mass.numpy())
    assert cls["peak_offset"].tolist() == [[0, 0]] * 3  # flat: ties go to the centre
    np.testing.assert_allclose(
        cls["peak_mass"], (6 + 7 + 6) ** 2 / 49**2, rtol=1e-12
    )  # 3x3 window: sum of (7-|dr|)(7-|dc|)
    np.testing.assert_allclose(cls["mass_centre"], 0, atol=1e-15)
    assert not cls["local"].any() and not cls["offset_local"].any()


def test_attention_to_self_is_local_but_not_offset():
    attn = _pattern_attention((5, 6), 1, lambda r, c: (r, c))
    _maps, mass = aligned_attention_maps(attn, (5, 6), 1)
    cls = offset_local_heads(mass.numpy())
    assert cls["peak_offset"].tolist() == [[0, 0]]
    assert cls["peak_mass"].tolist() == [pytest.approx(1.0, rel=1e-12)]
    assert cls["local"].tolist() == [True] and cls["offset_local"].tolist() == [False]


@pytest.mark.parametrize("edge", ["wrap", "cls"])
def test_attention_one_step_right_is_offset_local(edge):
    grid = (7, 7)

    def right(r, c):
        if c + 1 < grid[1]:
            return (r, c + 1)
        return (r, 0) if edge == "wrap" else None  # wrap to the row start, or all mass on CLS (query dropped)

    attn = _pattern_attention(grid, 1, right)
    maps, mass = aligned_attention_maps(attn, grid, 1)
    cls = offset_local_heads(mass.numpy())
    assert cls["peak_offset"].tolist() == [[0, 1]]
    assert cls["offset_local"].tolist() == [True] and cls["local"].tolist() == [True]
    expected_mass = 42 / 49 if edge == "wrap" else 1.0  # wrap: the 7 edge queries put their mass 6 columns left
    assert cls["peak_mass"].tolist() == [pytest.approx(expected_mass, rel=1e-12)]
    assert maps[0, 6, 7].item() == pytest.approx(1.0, rel=1e-12)  # every query that has a right neighbour attends to it


def test_right_neighbour_head_with_a_few_far_edge_queries_is_offset_local():
    """Issue 12: every query puts 0.9 of its attention on its right neighbour and 0.1 on itself, except the 7 queries of
    the last column, which look at the top-left token. On the per-offset mean map the far offset (-6, -6), which only
    the bottom-right query has, gets 1.0 > 0.9 and would win; on Walmer's aligned map (mean over all queries) the
    right neighbour holds 42 * 0.9 / 49 of the attention and is the peak."""
    grid, prefix = (7, 7), 1
    t = prefix + 49
    attn = torch.zeros(2, 1, t, t, dtype=torch.float64)
    attn[:, :, :prefix, 0] = 1.0
    for q in range(49):
        _r, c = divmod(q, 7)
        if c < 6:
            attn[:, 0, prefix + q, prefix + q + 1] = 0.9
            attn[:, 0, prefix + q, prefix + q] = 0.1
        else:
            attn[:, 0, prefix + q, prefix] = 1.0  # token (0, 0)
    maps, mass = aligned_attention_maps(attn, grid, prefix)
    assert maps[0, 0, 0].item() == pytest.approx(1.0) and maps[0, 6, 7].item() == pytest.approx(
        0.9
    )  # mean map: far cell wins
    assert mass[0, 6, 7].item() == pytest.approx(42 * 0.9 / 49, rel=1e-12)
    cls = offset_local_heads(mass.numpy())
    assert cls["peak_offset"].tolist() == [[0, 1]]
    assert cls["peak_mass"].tolist() == [pytest.approx(42 / 49, rel=1e-12)]  # (0, +1) and (0, 0) are in the 3x3 window
    assert cls["local"].tolist() == [True] and cls["offset_local"].tolist() == [True]
    # Walmer's centre of mass ("avg-att-offset" in his code): 37.8/49 at dc = +1, the 7 edge queries at (-r, -6)
    expected = [sum(-r for r in range(7)) / 49, (37.8 - 7 * 6) / 49]
    np.testing.assert_allclose(cls["mass_centre"][0], expected, rtol=1e-12)


def test_mass_centre_known_answers():
    m = np.zeros((2, 5, 7))
    m[0, 2, 3] = 1.0  # centre
    m[1, 3, 5], m[1, 1, 3] = 0.75, 0.25  # (+1, +2) and (-1, 0)
    np.testing.assert_allclose(mass_centre(m), [[0, 0], [0.5, 1.5]], rtol=1e-12)
    assert mass_centre(np.zeros((5, 7))).tolist() == [0, 0]


def test_offset_sign_convention_and_thresholds():
    grid = (6, 6)
    down_left = _pattern_attention(grid, 1, lambda r, c: (min(r + 1, 5), max(c - 1, 0)))  # key below and to the left
    far = _pattern_attention(grid, 1, lambda r, c: (r, c + 3) if c + 3 < 6 else (r, c - 3))  # 3 columns away
    attn = torch.cat([down_left, far], 1)
    _maps, mass = aligned_attention_maps(attn, grid, 1)
    cls = offset_local_heads(mass.numpy())
    assert cls["peak_offset"][0].tolist() == [1, -1]
    assert cls["offset_local"].tolist() == [True, False]  # 3 columns is beyond max_offset = 2
    assert offset_local_heads(mass.numpy(), max_offset=3)["offset_local"].tolist() == [True, True]
    # clamped at the grid edge, the edge queries look at (0, -1), (+1, 0) or (0, 0): inside the 3x3 window, outside a
    # 1x1 one
    assert cls["peak_mass"][0] == pytest.approx(1.0, rel=1e-12)
    one_cell = offset_local_heads(mass.numpy(), window=0, min_mass=0.99)
    assert one_cell["peak_mass"][0] == pytest.approx(25 / 36, rel=1e-12) and not one_cell["local"][0]


def test_peak_is_the_maximum_inside_the_window_not_its_centre_of_mass():
    """0.60 of the attention at (-2, +1) and 0.38 at (0, 0): the best 3x3 window (centred at (-1, +1)) holds both, and
    its centre of mass rounds to (-1, +1), a cell with almost no attention. The peak is the maximum inside it."""
    m = np.zeros((13, 13))  # the canvas of a 7x7 grid; (dr, dc) sits at (6 + dr, 6 + dc)
    m[6 - 2, 6 + 1], m[6, 6], m[6 + 5, 6 - 5] = 0.60, 0.38, 0.02
    cls = offset_local_heads(m[None])
    assert cls["peak_mass"][0] == pytest.approx(0.98, rel=1e-12)
    assert cls["peak_offset"][0].tolist() == [-2, 1]
    assert m[6 - 2, 6 + 1] == m.max()  # the reported cell carries the head's attention
    assert cls["local"].tolist() == [True] and cls["offset_local"].tolist() == [True]
    # equal cells inside the window: the one nearest the query
    m2 = np.zeros((13, 13))
    m2[6, 6 + 1] = m2[6, 6 + 2] = 0.45
    assert offset_local_heads(m2[None])["peak_offset"][0].tolist() == [0, 1]


def test_find_peaks_tie_break_and_shape():
    m = np.zeros((2, 3, 5, 5))
    m[0, 0, 0, 0] = m[0, 0, 4, 4] = m[0, 0, 2, 3] = 1.0  # (0, +1) is nearest the centre
    m[1, 2, 1, 1] = 2.0
    peaks = find_peaks(m)
    assert peaks.shape == (2, 3, 2)
    assert peaks[0, 0].tolist() == [0, 1] and peaks[1, 2].tolist() == [-1, -1] and peaks[0, 1].tolist() == [0, 0]


# ------------------------------------------------------------------------------------------------ CLS attention maps


def test_cls_maps_known_answer_and_grid_orientation():
    grid, prefix = (2, 3), 1
    attn = torch.zeros(2, 2, 7, 7, dtype=torch.float64)
    attn[:, :, 1:, 1] = 1.0  # spatial rows: irrelevant
    attn[0, :, 0, 0], attn[0, :, 0, 1 + 5] = 0.5, 0.5  # image 0: half on CLS, half on token (1, 2)
    attn[1, :, 0, 0], attn[1, :, 0, 1 + 1] = 0.5, 0.5  # image 1: half on token (0, 1)
    attn[:, 1, 0, :] = 1.0 / 7  # head 1 uniform
    out = cls_attention_maps(attn, grid, prefix)
    assert out["maps"].shape == (2, 2, 3) and out["maps"].dtype == torch.float64
    assert out["maps"][0].tolist() == [[0, 0.5, 0], [0, 0, 0.5]]
    assert out["maps_raw"][0].tolist() == [[0, 0.25, 0], [0, 0, 0.25]]
    np.testing.assert_allclose(out["maps"][1].numpy(), 1 / 6, rtol=1e-12)
    np.testing.assert_allclose(out["prefix_mass"].numpy(), [0.5, 1 / 7], rtol=1e-12)
    np.testing.assert_allclose(
        out["entropy"].numpy(), [0.0, math.log(6)], rtol=1e-12, atol=1e-15
    )  # per image: one token
    np.testing.assert_allclose(
        out["map_entropy"].numpy(), [math.log(2), math.log(6)], rtol=1e-12
    )  # average: two tokens


def test_cls_maps_against_loops_with_registers():
    grid, prefix = (3, 3), 3
    attn = _softmax_attention(4, 2, prefix + 9, seed=3)
    attn[2, 1, 0, prefix:] = 0  # an image whose CLS row has no spatial mass: left out of maps and entropy
    out = cls_attention_maps(attn, grid, prefix)
    a = attn.double().numpy()
    for h in range(2):
        rows = [a[b, h, 0, prefix:] / a[b, h, 0, prefix:].sum() for b in range(4) if a[b, h, 0, prefix:].sum() > 0]
        ref = np.mean(rows, 0).reshape(3, 3)
        np.testing.assert_allclose(out["maps"][h].numpy(), ref, rtol=1e-12)
        np.testing.assert_allclose(
            out["entropy"][h].item(), np.mean([-(r * np.log(r)).sum() for r in rows]), rtol=1e-12
        )
        np.testing.assert_allclose(out["maps_raw"][h].numpy(), a[:, h, 0, prefix:].mean(0).reshape(3, 3), rtol=1e-12)
        np.testing.assert_allclose(out["prefix_mass"][h].item(), a[:, h, 0, :prefix].sum(1).mean(), rtol=1e-12)
    with pytest.raises(ValueError):
        cls_attention_maps(attn, grid, 0)


# ---------------------------------------------------------------------------------------- Measures, end to end


def _tiny_vit(class_token=True):
    return tiny_vit(class_token)


def _ctx(model, accelerator=None):
    g = torch.Generator().manual_seed(1)
    split = types.SimpleNamespace(
        images=torch.randint(0, 256, (12, 1, 28, 28), generator=g, dtype=torch.uint8),
        labels=torch.randint(0, 10, (12,), generator=g),
    )
    data = types.SimpleNamespace(analysis=split, probe_train=split, normalize=lambda x: x.float() / 255, num_classes=10)
    return Context(
        model=model,
        data=data,
        device=torch.device("cpu"),
        accelerator=accelerator,
        arch="vit",
        blocks=tuple(block_names(model)),
        prefix=model.num_prefix_tokens,
        grid=grid_of(model),
        patch_size=4,
    )


def _run(measure, ctx, batches, replay=None):
    """Drive a Measure through its protocol over the given minibatch indices (batch size 4), running the model in a
    Taps context (or replaying captures recorded by an earlier run); returns the captures per minibatch."""
    caps = {}
    for j in batches:
        x = ctx.data.analysis.images[4 * j : 4 * (j + 1)]
        if replay is None:
            with Taps(ctx.model, sorted(measure.taps())) as cap, torch.no_grad():
                ctx.model(ctx.data.normalize(x))
            caps[j] = cap.captures
        else:
            caps[j] = replay[j]
        measure.update(j, caps[j], ctx.data.normalize(x), ctx.data.analysis.labels[4 * j : 4 * (j + 1)])
    return caps


class _RecordingAccelerator:
    """Two 'processes' replayed one after the other: the first records its packed state, the second adds it."""

    num_processes = 2
    device = torch.device("cpu")

    def __init__(self, other=None):
        self.other, self.seen = other, None

    def reduce(self, t, reduction="sum"):
        assert reduction == "sum"
        self.seen = t.clone()
        return t if self.other is None else t + self.other.seen


@pytest.mark.parametrize("cls", [ClsAttention, AlignedAttention])
def test_measure_end_to_end_and_round_trip(cls, tmp_path):
    model = _tiny_vit()
    ctx = _ctx(model)
    assert cls.applies(ctx)
    m = cls(ctx)
    assert m.taps() == {"blocks.0.attn_probs", "blocks.1.attn_probs"}
    per_batch = _run(m, ctx, [0, 1, 2])
    caps = {k: torch.cat([per_batch[j][k] for j in range(3)]) for k in per_batch[0]}
    r = m.finish()
    assert r["n_images"] == 12 and list(r["blocks"]) == ["blocks.0", "blocks.1"]
    for i in range(2):  # accumulated over minibatches == the definition on all images at once
        a = caps[f"blocks.{i}.attn_probs"]
        if cls is ClsAttention:
            ref = cls_attention_maps(a, (7, 7), 1)
            for k in ("maps", "maps_raw", "prefix_mass", "entropy", "map_entropy"):
                np.testing.assert_allclose(r[k][i], ref[k].numpy(), rtol=1e-10, atol=1e-14)
        else:
            maps, mass = aligned_attention_maps(a, (7, 7), 1)
            np.testing.assert_allclose(r["maps"][i], maps.numpy(), rtol=1e-10)
            np.testing.assert_allclose(r["mass_maps"][i], mass.numpy(), rtol=1e-10)
    shapes = (
        {"maps": (2, 2, 7, 7)}
        if cls is ClsAttention
        else {"maps": (2, 2, 13, 13), "peak_offset": (2, 2, 2), "offset_local": (2, 2)}
    )
    assert all(r[k].shape == s for k, s in shapes.items())

    # two processes (minibatches 0, 2 and 1) give the same numbers as one
    first = _RecordingAccelerator()
    m0, m1 = cls(_ctx(model, first)), cls(_ctx(model, _RecordingAccelerator(first)))
    _run(m0, m0.ctx, [0, 2], replay=per_batch)
    _run(m1, m1.ctx, [1], replay=per_batch)
    m0.finish()
    r2 = m1.finish()
    for k in r:
        if isinstance(r[k], np.ndarray) and r[k].dtype.kind == "f":
            np.testing.assert_allclose(r2[k], r[k], rtol=1e-12, atol=1e-15)
        else:
            assert np.array_equal(np.asarray(r2[k]), np.asarray(r[k])), k

    save_result(r, tmp_path / "r.npz")
    back = load_result(tmp_path / "r.npz")
    assert cls.summary(back) == cls.summary(r)
    assert cls.scalars(back) == cls.scalars(r)
    scalars = cls.scalars(back)
    if cls is ClsAttention:
        assert set(scalars) == {f"cls_attention/{k}/block{i:02d}" for k in ("entropy", "map_entropy") for i in range(2)}
        assert all(0 <= v <= math.log(49) + 1e-9 for v in scalars.values())
    else:
        assert scalars["aligned_attention/offset_local_count"] == sum(
            scalars[f"aligned_attention/offset_local_count/block{i:02d}"] for i in range(2)
        )
    figs = cls.figures(back, step=3)
    assert figs and all(tag.startswith(cls.name + "/") for tag in figs)
    import matplotlib.pyplot as plt

    for f in figs.values():
        plt.close(f)


def test_applies():
    gap = _ctx(_tiny_vit(class_token=False))
    assert not ClsAttention.applies(gap) and AlignedAttention.applies(gap)
    from timm.models.vision_transformer import VisionTransformer

    registers_only = VisionTransformer(
        img_size=28,
        patch_size=4,
        in_chans=1,
        num_classes=10,
        embed_dim=32,
        depth=1,
        num_heads=2,
        class_token=False,
        reg_tokens=2,
        global_pool="avg",
    )
    ctx = _ctx(registers_only)
    assert ctx.prefix == 2 and not ClsAttention.applies(ctx) and AlignedAttention.applies(ctx)
    resnet_ctx = Context(model=torch.nn.Linear(1, 1), data=None, device=torch.device("cpu"), arch="resnet")
    assert not ClsAttention.applies(resnet_ctx) and not AlignedAttention.applies(resnet_ctx)


def test_aligned_figure_marks_offset_local_heads_after_round_trip(tmp_path):
    """A result built from hand-made attention (head 0: one step right; head 1: uniform) keeps its verdicts on disk."""
    grid = (7, 7)
    right = _pattern_attention(grid, 1, lambda r, c: (r, c + 1) if c < 6 else (r, 0), batch=4)
    attn = torch.cat([right, torch.full_like(right, 1 / 50)], 1)
    ctx = _ctx(_tiny_vit())
    m = AlignedAttention(ctx)
    m.update(0, {b: attn for b in m.taps()}, None, None)
    r = m.finish()
    save_result(r, tmp_path / "a.npz")
    back = load_result(tmp_path / "a.npz")
    assert back["offset_local"].tolist() == [[True, False], [True, False]]
    assert back["peak_offset"][:, 0].tolist() == [[0, 1], [0, 1]]
    s = AlignedAttention.summary(back)
    assert s["offset_local_count"] == 2 and s["offset_local_heads"] == [
        "block00.head00 (+0,+1)",
        "block01.head00 (+0,+1)",
    ]
    assert AlignedAttention.scalars(back)["aligned_attention/offset_local_count/block01"] == 1.0
    figs = AlignedAttention.figures(back)
    ax = figs["aligned_attention/maps"].axes[0]
    assert ax.get_title() == "(+0,+1)" and figs["aligned_attention/maps"].axes[1].get_title() == ""
    import matplotlib.pyplot as plt

    for f in figs.values():
        plt.close(f)
