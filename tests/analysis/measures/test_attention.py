"""Mean attention distance per head: known answers (patch centres, Walmer's unit square, the ViT paper's pixel-level
distance), prefix handling, accumulation and the sum-reduced sync."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from analysis.measures.attention_distance import (
    FLOAT32_RTOL,
    UNITS,
    AttentionDistance,
    AttentionDistanceMeasure,
    attention_distance,
    grid_distances,
)


@pytest.fixture(autouse=True)
def _float64_attention():
    """The known answers below are checked to 1e-12, so the hand-built attention is float64 (computed in float64);
    float32 attention (what models give) is checked against it in its own test."""
    before = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(before)


def _self_attention(batch, heads, grid, prefix):
    n = grid[0] * grid[1]
    attn = torch.zeros(batch, heads, prefix + n, prefix + n)
    attn[:, :, :prefix, 0] = 1.0  # prefix rows: anything, they are dropped as queries
    attn[:, :, prefix:, prefix:] = torch.eye(n)
    return attn


def _reference_mean_pairwise(grid, patch):
    """Mean over all ordered (q, k) spatial pairs, self pairs included, of the Euclidean pixel distance."""
    pos = [(r * patch, c * patch) for r, c in itertools.product(range(grid[0]), range(grid[1]))]
    return sum(math.dist(p, q) for p, q in itertools.product(pos, pos)) / len(pos) ** 2


def _softmax_attention(batch, heads, tokens, seed):
    g = torch.Generator().manual_seed(seed)
    return (3 * torch.randn(batch, heads, tokens, tokens, generator=g, dtype=torch.float64)).softmax(-1)


def test_grid_distances_are_exact():
    d = grid_distances((2, 3), 4)
    assert d.shape == (6, 6) and d.dtype == torch.float64
    assert d.diagonal().eq(0).all() and d[0, 1] == 4 and d[0, 3] == 4 and d[0, 5] == pytest.approx(math.hypot(4, 8))
    # Walmer's unit square: token (r, c) at (r / (gh - 1), c / (gw - 1)), so token 5 = (1, 2) sits at the corner (1, 1)
    torch.testing.assert_close(
        grid_distances((2, 3), 4, unit="unit_square")[0, 5], torch.tensor(math.sqrt(2), dtype=torch.float64)
    )
    assert grid_distances((2, 3), 4, unit="unit_square")[0, 1] == 0.5


def test_unit_square_on_a_2x2_grid_by_hand():
    """The four tokens sit at the corners of the unit square: sides 1, diagonals sqrt(2) (Walmer's code)."""
    s = math.sqrt(2)
    torch.testing.assert_close(
        grid_distances((2, 2), 16, unit="unit_square"),
        torch.tensor([[0, 1, 1, s], [1, 0, s, 1], [1, s, 0, 1], [s, 1, 1, 0]], dtype=torch.float64),
    )
    uniform = torch.full((1, 1, 5, 5), 0.2)  # CLS + 4 tokens: each query's spatial row renormalises to 1/4 each
    assert attention_distance(uniform, (2, 2), 16, 1, unit="unit_square").item() == pytest.approx(
        (2 + s) / 4, rel=1e-12
    )
    right = torch.tensor([[0, 1, 0, 0], [1, 0, 0, 0], [0, 0, 0, 1], [0, 0, 1, 0]], dtype=torch.float64)[None, None]
    assert attention_distance(right, (2, 2), 16, 0, unit="unit_square").item() == pytest.approx(1.0, rel=1e-12)


def test_pixel_level_distance_of_a_purely_local_head_by_hand():
    """ViT paper App. D.6: an identity head on a 2x2 grid of 2x2-pixel patches. From each of the 4 query pixels the
    4 pixels of its own patch (weight 1/4 each) are at 0, 1, 1 and sqrt(2): (2 + sqrt(2)) / 4 for every query pixel;
    the patch-centre distance of the same head is 0."""
    attn = _self_attention(3, 2, (2, 2), 1)
    torch.testing.assert_close(
        attention_distance(attn, (2, 2), 2, 1, unit="pixel_level"),
        torch.full((2,), (2 + math.sqrt(2)) / 4, dtype=torch.float64),
        rtol=1e-12,
        atol=0,
    )
    assert attention_distance(attn, (2, 2), 2, 1).eq(0).all()
    # a head looking one token right (left in the last column), 1x1 grid rows of 2 tokens, patches of 2 pixels:
    # pixel column offsets 2 + (i - i') with i, i' in {0, 1}: 1, 2, 2, 3 and row offsets 0, 0, 1, 1 (each pair once)
    right = torch.tensor([[0, 1], [1, 0]], dtype=torch.float64)[None, None]
    expected = sum(math.hypot(dr, dc) for dr in (0, 0, 1, -1) for dc in (1, 2, 2, 3)) / 16
    assert attention_distance(right, (1, 2), 2, 0, unit="pixel_level").item() == pytest.approx(expected, rel=1e-12)


def test_pixel_level_matches_pixel_loops_and_bounds_patch_centres():
    grid, patch = (2, 3), 3

    def pixels(t):
        r, c = divmod(t, grid[1])
        return [(r * patch + i, c * patch + j) for i in range(patch) for j in range(patch)]

    ref = [[sum(math.dist(u, v) for u in pixels(a) for v in pixels(b)) / patch**4 for b in range(6)] for a in range(6)]
    d = grid_distances(grid, patch, unit="pixel_level")
    torch.testing.assert_close(d, torch.tensor(ref, dtype=torch.float64), rtol=1e-12, atol=1e-12)
    assert (d >= grid_distances(grid, patch) - 1e-12).all()  # convexity of the norm: pixel-level >= patch centres
    attn = _softmax_attention(2, 3, 1 + 6, seed=9)
    assert (
        attention_distance(attn, grid, patch, 1, unit="pixel_level") > attention_distance(attn, grid, patch, 1)
    ).all()


@pytest.mark.parametrize("prefix", [0, 1, 5])
def test_all_mass_on_self_gives_zero(prefix):
    out = attention_distance(_self_attention(2, 3, (4, 4), prefix), (4, 4), 16, prefix)
    assert out.dtype == torch.float64 and out.shape == (3,)
    assert out.eq(0).all()


@pytest.mark.parametrize("side", [3, 7])
def test_uniform_attention_gives_mean_pairwise_distance(side):
    grid, patch, prefix = (side, side), 4, 1
    t = prefix + side * side
    attn = torch.full((2, 2, t, t), 1.0 / t)  # the CLS column gets mass too: dropped, rows renormalised to uniform
    out = attention_distance(attn, grid, patch, prefix)
    ref = _reference_mean_pairwise(grid, patch)
    torch.testing.assert_close(out, torch.full((2,), ref, dtype=torch.float64), rtol=1e-12, atol=0)


def test_cls_column_is_dropped_and_row_renormalised():
    grid, patch = (3, 3), 16
    attn = torch.zeros(1, 1, 10, 10)
    attn[0, 0, 0, 0] = 1.0
    for q in range(9):
        r, c = divmod(q, 3)
        neighbour = r * 3 + (c + 1 if c < 2 else c - 1)
        attn[0, 0, 1 + q, 0] = 0.9  # most mass on CLS
        attn[0, 0, 1 + q, 1 + neighbour] = 0.1  # the rest on a horizontal neighbour, 1 patch away
    assert attention_distance(attn, grid, patch, 1).item() == pytest.approx(patch, rel=1e-12)


def test_fixed_offset_one_row_down_gives_patch_size():
    grid, patch, prefix = (4, 5), 8, 1
    n = 20
    attn = torch.zeros(1, 2, prefix + n, prefix + n)
    attn[:, :, 0, 0] = 1.0
    for q in range(n):
        r, _c = divmod(q, 5)
        attn[0, 0, prefix + q, prefix + (q + 5 if r < 3 else q)] = 1.0  # head 0: one row down, self in the last row
        attn[0, 1, prefix + q, prefix + (q + 5 if r < 3 else q - 5)] = 1.0  # head 1: one row down, else one row up
    out = attention_distance(attn, grid, patch, prefix)
    # head 0: the 15 queries with a row below are exactly patch_size away, the 5 in the last row are at 0
    assert out.tolist() == [pytest.approx(patch * 15 / 20, rel=1e-12), pytest.approx(patch, rel=1e-12)]
    # unit square on a non-square grid: vertical steps are divided by (grid[0] - 1) * patch
    unit = attention_distance(attn, grid, patch, prefix, unit="unit_square")
    torch.testing.assert_close(unit, out / ((grid[0] - 1) * patch), rtol=1e-12, atol=0)


def test_unit_square_is_pixels_over_corner_centre_span():
    attn = _softmax_attention(3, 4, 1 + 36, seed=0)
    px = attention_distance(attn, (6, 6), 16, 1)
    unit = attention_distance(attn, (6, 6), 16, 1, unit="unit_square")
    torch.testing.assert_close(unit, px / (5 * 16), rtol=1e-12, atol=0)  # (g - 1) patches between corner centres
    # non-square grid: horizontal steps are divided by (grid[1] - 1) * patch
    n = 3 * 5
    horiz = torch.zeros(1, 1, n, n)
    for q in range(n):
        horiz[0, 0, q, q + 1 if q % 5 < 4 else q - 1] = 1.0
    assert attention_distance(horiz, (3, 5), 8, 0, unit="unit_square").item() == pytest.approx(1 / 4, rel=1e-12)
    with pytest.raises(ValueError):
        attention_distance(attn, (6, 6), 16, 1, unit="patches")


def test_no_prefix_tokens_gap_model():
    grid, patch = (3, 3), 4
    attn = torch.full((2, 3, 9, 9), 1.0 / 9)
    torch.testing.assert_close(
        attention_distance(attn, grid, patch, 0),
        torch.full((3,), _reference_mean_pairwise(grid, patch), dtype=torch.float64),
        rtol=1e-12,
        atol=0,
    )
    with pytest.raises(ValueError):
        attention_distance(attn, grid, patch, 1)  # T does not match 1 + 3 * 3


def test_different_heads_get_different_values():
    grid, patch = (5, 5), 16
    attn = _self_attention(2, 3, grid, 1)
    attn[:, 1] = 1.0 / 26  # head 1 uniform
    attn[:, 2] = _softmax_attention(2, 1, 26, seed=1)[:, 0]
    out = attention_distance(attn, grid, patch, 1)
    assert out[0] == 0 and out[1].item() == pytest.approx(_reference_mean_pairwise(grid, patch), rel=1e-12)
    assert len(set(out.tolist())) == 3


def test_accumulator_over_batches_equals_function_on_concatenation():
    grid, patch, prefix = (4, 4), 16, 1
    a1, a2 = _softmax_attention(2, 3, 17, seed=2), _softmax_attention(5, 3, 17, seed=3)
    b1, b2 = _softmax_attention(2, 3, 17, seed=4), _softmax_attention(5, 3, 17, seed=5)
    acc = AttentionDistance(grid, patch, prefix)
    for blk, (x1, x2) in {0: (a1, a2), 3: (b1, b2)}.items():
        acc.update(blk, x1)
        acc.update(blk, x2)
    px = acc.compute()
    assert list(px) == [0, 3] and all(v.dtype == torch.float64 for v in px.values())
    assert acc.count[0].tolist() == [7 * 16] * 3 and acc.sums["pixels"][0].dtype == torch.float64
    for blk, whole in {0: torch.cat([a1, a2]), 3: torch.cat([b1, b2])}.items():
        for u in UNITS:
            torch.testing.assert_close(
                acc.compute(u)[blk], attention_distance(whole, grid, patch, prefix, unit=u), rtol=1e-12, atol=0
            )
    acc.reset()
    assert acc.compute() == {}
    with pytest.raises(ValueError):
        acc.update(0, _softmax_attention(1, 3, 10, seed=0))


@pytest.mark.parametrize("prefix", [0, 1])
def test_float32_attention_is_within_1e7_of_float64_and_half_types_are_computed_in_float32(prefix):
    """Models give float32 (or bf16) attention: its key sums are float32 (the map's own precision), the rest
    float64, and each head's mean over softmax rows is within 1e-7 relative of the float64 computation on the same
    map (about 1e-8 measured: the roundings average out over queries; a uniform head, where they do not, is in
    tests/interventions/test_positive_control.py); an all-CLS query stays uncounted."""
    grid, patch = (7, 7), 16
    a64 = _softmax_attention(8, 4, prefix + 49, seed=8)
    a64[0, 1, prefix + 3, prefix:] = 0  # a query with no spatial mass
    a32 = a64.float()
    ref = attention_distance(a32.double(), grid, patch, prefix)  # the same float32 values, computed in float64
    for unit in UNITS:
        r = attention_distance(a32.double(), grid, patch, prefix, unit=unit)
        got = attention_distance(a32, grid, patch, prefix, unit=unit)
        assert got.dtype == torch.float64
        torch.testing.assert_close(got, r, rtol=1e-7, atol=0)
    acc = AttentionDistance(grid, patch, prefix)
    acc.update(0, a32)
    assert acc.count[0].tolist() == [8 * 49, 8 * 49 - 1, 8 * 49, 8 * 49]
    half = attention_distance(a32.bfloat16(), grid, patch, prefix)
    # computed in float32: the same as the float32 copy of the bf16 map within float32 key sums' documented tolerance
    # (not bit-identical: the copy is contiguous, the float32 map a strided view, and BLAS may sum them in another
    # order; 7e-9 relative on an AMD Zen 4 host, 0 on an Intel AMX one)
    as32 = attention_distance(a32.bfloat16().float(), grid, patch, prefix)
    torch.testing.assert_close(half, as32, rtol=FLOAT32_RTOL, atol=FLOAT32_RTOL * float(as32.abs().max()))
    assert (half - ref).abs().max() < 1e-2 * ref.abs().max()  # bf16 rounding of the map itself


def test_reduce_sums_state_like_two_processes():
    grid, patch = (3, 3), 8
    a1, a2 = _softmax_attention(3, 2, 10, seed=6), _softmax_attention(4, 2, 10, seed=7)
    one, rank0, rank1 = (AttentionDistance(grid, patch, 1) for _ in range(3))
    one.update(1, torch.cat([a1, a2]))
    rank0.update(1, a1)
    rank1.update(1, a2)
    other = torch.cat([*(rank1.sums[u][1] for u in UNITS), rank1.count[1]])
    rank0.reduce_(lambda flat: flat + other)  # what a SUM all_reduce does on rank 0
    for u in UNITS:
        torch.testing.assert_close(rank0.compute(u)[1], one.compute(u)[1], rtol=1e-12, atol=0)
    assert rank0.count[1].tolist() == one.count[1].tolist()
    one.sync()  # no process group: nothing happens
    one.sync(_AcceleratorLike())
    assert one.count[1].tolist() == [7 * 9] * 2


class _AcceleratorLike:
    """The part of accelerate.Accelerator that sync uses: a device and a collective sum."""

    num_processes = 2
    device = "cpu"

    @staticmethod
    def reduce(t, reduction="sum"):
        import torch.distributed as dist

        assert reduction == "sum"
        t = t.clone()
        dist.all_reduce(t)
        return t


def _sync_worker(rank, init_file, out_file):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    try:
        acc = AttentionDistance((3, 3), 8, 1)
        acc.update(1, _softmax_attention(3 + rank, 2, 10, seed=10 + rank))
        if rank == 1:
            acc.update(4, _softmax_attention(2, 2, 10, seed=20))  # a block only rank 1 saw
        acc.sync(None if rank == 0 else _AcceleratorLike())  # rank 1 passes an accelerator-like object (CPU device)
        if rank == 0:
            torch.save({"px": acc.compute(), "unit": acc.compute("unit_square")}, out_file)
    finally:
        dist.destroy_process_group()


@pytest.mark.multiprocess
def test_sync_over_two_gloo_processes_equals_one_process(tmp_path):
    torch.multiprocessing.spawn(_sync_worker, args=(str(tmp_path / "init"), str(tmp_path / "out.pt")), nprocs=2)
    got = torch.load(tmp_path / "out.pt")
    both = torch.cat([_softmax_attention(3, 2, 10, seed=10), _softmax_attention(4, 2, 10, seed=11)])
    assert sorted(got["px"]) == [1, 4]
    torch.testing.assert_close(got["px"][1], attention_distance(both, (3, 3), 8, 1), rtol=1e-12, atol=0)
    torch.testing.assert_close(
        got["unit"][4],
        attention_distance(_softmax_attention(2, 2, 10, seed=20), (3, 3), 8, 1, unit="unit_square"),
        rtol=1e-12,
        atol=0,
    )


def test_measure_result_names_each_distance_and_figures_label_them():
    import types

    import matplotlib.pyplot as plt
    import numpy as np

    ctx = types.SimpleNamespace(grid=(2, 2), patch_size=2, prefix=1, blocks=("blocks.0", "blocks.1"), accelerator=None)
    m = AttentionDistanceMeasure(ctx)
    attn = _self_attention(2, 3, (2, 2), 1)
    m.update(0, {"blocks.0.attn_probs": attn, "blocks.1.attn_probs": torch.full_like(attn, 0.2)}, None, None)
    r = m.finish()
    assert set(r) == {"pixels", "unit_square", "pixel_level", "blocks", "patch_size", "grid"}
    # uniform attention on the 2x2 grid, 2 px apart: 4 pairs at 0, 8 at 2, 4 at 2 sqrt(2) -> 1 + sqrt(2) / 2
    assert AttentionDistanceMeasure.uniform(r) == pytest.approx(1 + math.sqrt(2) / 2)
    np.testing.assert_allclose(r["pixels"][0], 0)
    np.testing.assert_allclose(r["pixel_level"][0], (2 + math.sqrt(2)) / 4, rtol=1e-12)
    np.testing.assert_allclose(r["unit_square"][1], (2 + math.sqrt(2)) / 4, rtol=1e-12)  # uniform over the 4 corners
    assert AttentionDistanceMeasure.summary(r)["mean_px_pixel_level"][0] == pytest.approx((2 + math.sqrt(2)) / 4)
    figs = AttentionDistanceMeasure.figures(r)
    assert "patch centres" in figs["attn_dist/heads"].axes[0].get_ylabel()
    assert "pixel to pixel" in figs["attn_dist/heads_pixel_level"].axes[0].get_ylabel()
    for f in figs.values():
        plt.close(f)
