"""Localization CKA (Raghu Fig. 9/10, D.1-D.3): known answers (a token-copies-its-patch ViT localizes perfectly, a
token-mixing one does not), values against analysis.cka.cka on explicit slices, ResNet, round-trip, the protocol."""

from __future__ import annotations

import types

import numpy as np
import pytest
import torch
from conftest import tiny_vit

from analysis.engine.measure import REGISTRY, Context, load_result, save_result
from analysis.engine.taps import Taps, block_names, grid_of
from analysis.estimators.similarity import cka
from analysis.measures.localization import (
    Localization,
    LocalizationOptions,
    input_patches,
    localization_cka,
    localization_scores,
    spatial_tokens,
)

pytestmark = pytest.mark.usefixtures("one_thread")


def _vit(class_token=True, embed_dim=32):
    return tiny_vit(class_token, embed_dim=embed_dim)


def _resnet():
    from timm.models.resnet import BasicBlock, ResNet

    torch.manual_seed(0)
    m = ResNet(block=BasicBlock, layers=(1, 1, 1, 1), channels=(8, 8, 16, 16), in_chans=1, num_classes=10)
    m.conv1 = torch.nn.Conv2d(1, m.conv1.out_channels, 3, 1, 1, bias=False)  # small stem: 28, 14, 7, 4 px grids
    m.maxpool = torch.nn.Identity()
    return m.eval()


def _copy_vit():
    """Patch embedding that copies each 4x4 patch into the first 16 channels, no position embedding, and blocks whose
    branches output 0: every block's spatial token is exactly its own input patch."""
    m = _vit()
    with torch.no_grad():
        w = torch.zeros(32, 1, 4, 4)
        w.view(32, 16)[:16] = torch.eye(16)
        m.patch_embed.proj.weight.copy_(w)
        m.patch_embed.proj.bias.zero_()
        m.pos_embed.zero_()
        for blk in m.blocks:
            for lin in (blk.attn.proj, blk.mlp.fc2):
                lin.weight.zero_()
                lin.bias.zero_()
    return m


def _data(n=40, seed=0):
    g = torch.Generator().manual_seed(seed)
    img = torch.randint(0, 256, (n, 1, 28, 28), generator=g, dtype=torch.uint8)
    return types.SimpleNamespace(images=img, labels=torch.arange(n) % 10)


def _ctx(model, n=40):
    vit = hasattr(model, "patch_embed")
    data = types.SimpleNamespace(
        analysis=_data(n, 0), probe_train=_data(n, 1), normalize=lambda x: x.float() / 255, num_classes=10
    )
    return Context(
        model=model,
        data=data,
        device=torch.device("cpu"),
        arch="vit" if vit else "resnet",
        blocks=tuple(block_names(model)),
        prefix=model.num_prefix_tokens if vit else 0,
        grid=grid_of(model) if vit else None,
        patch_size=4 if vit else None,
    )


@torch.no_grad()
def _run(measure, ctx, batch_size=16):
    """Drive a Measure through the protocol, as the suite does: fixed minibatches j, taps, normalised inputs."""
    split = ctx.data.analysis
    for j in range((len(split.labels) + batch_size - 1) // batch_size):
        x = ctx.data.normalize(split.images[j * batch_size : (j + 1) * batch_size])
        with Taps(ctx.model, sorted(measure.taps())) as cap:
            ctx.model(x)
        measure.update(j, cap.captures, x, split.labels[j * batch_size : (j + 1) * batch_size])
    return measure.finish()


def test_registered():
    assert REGISTRY["localization"] is Localization


def test_input_patches_are_the_vit_patches():
    x = torch.arange(2 * 3 * 8 * 12, dtype=torch.float32).reshape(2, 3, 8, 12)
    p = input_patches(x, (2, 3))
    assert len(p) == 6 and all(q.shape == (2, 3 * 4 * 4) for q in p)
    torch.testing.assert_close(p[4], x[:, :, 4:8, 4:8].reshape(2, -1))  # row 1, col 1
    # a coarser, non-dividing grid: 7 px side over 3 rows -> [0, 3), [2, 5), [4, 7)
    q = input_patches(torch.randn(1, 1, 7, 7), (3, 3))
    assert [t.shape[1] for t in q] == [9] * 9


def test_copy_model_localizes_perfectly_through_the_protocol():
    ctx = _ctx(_copy_vit())
    r = _run(Localization(ctx), ctx)
    assert r["layers"] == ["blocks.0.out", "blocks.1.out"] and r["cka"].shape == (2, 49, 49)
    assert r["grid"].tolist() == [[7, 7], [7, 7]] and r["n_images"] == 40
    for i in range(2):
        np.testing.assert_allclose(np.diagonal(r["cka"][i]), 1.0, rtol=0, atol=1e-9)
        off = r["cka"][i][~np.eye(49, dtype=bool)]
        assert np.abs(off).max() < 0.5  # independent random pixels: small (unbiased) cross similarity
    np.testing.assert_array_equal(r["own_share"], [1.0, 1.0])
    assert (r["contrast"] > 0.9).all()


def test_mixing_tokens_do_not_localize():
    torch.manual_seed(0)
    x = torch.randn(200, 1, 28, 28)
    patches = torch.stack(input_patches(x, (7, 7)), 1)  # [n, 49, 16]
    tokens = patches.mean(1, keepdim=True) + 0.5 * torch.randn(200, 49, 16)  # every token = mean of all patches + noise
    share, contrast = localization_scores(localization_cka(tokens, x, (7, 7), batch_size=50))
    assert share < 0.15  # chance is 1/49 ~ 0.02
    assert abs(contrast) < 0.05
    # the same patches with the noise but no mixing do localize
    share2, contrast2 = localization_scores(
        localization_cka(patches + 0.5 * torch.randn(200, 49, 16), x, (7, 7), batch_size=50)
    )
    assert share2 == 1.0 and contrast2 > 0.5


def test_scores_on_a_hand_matrix():
    m = np.array([[0.9, 0.1, 0.2], [0.8, 0.5, 0.1], [np.nan, 0.0, np.nan]])
    share, contrast = localization_scores(m)
    assert share == pytest.approx(0.5)  # row 0 best at 0 (own), row 1 best at 0 (not own), row 2 has no own value
    assert contrast == pytest.approx((0.9 + 0.5) / 2 - (0.1 + 0.2 + 0.8 + 0.1 + 0.0) / 5)


def test_values_match_cka_on_explicit_slices():
    ctx = _ctx(_vit(), n=24)
    r = _run(
        Localization(ctx, LocalizationOptions(kinds=("attn_out", "out"))), ctx, batch_size=24
    )  # one minibatch: minibatch CKA == cka on the whole set
    x = ctx.data.normalize(ctx.data.analysis.images)
    layers = ["blocks.0.attn_out", "blocks.0.out", "blocks.1.attn_out", "blocks.1.out"]
    with Taps(ctx.model, layers) as cap:
        ctx.model(x)
    assert r["layers"] == layers and r["block_index"].tolist() == [0, 0, 1, 1]
    for li, tap in enumerate(r["layers"]):
        tok = cap[tap][:, 1:]
        for t, q in [(0, 0), (3, 17), (24, 24), (48, 5)]:
            qr, qc = divmod(q, 7)
            ref = cka(tok[:, t], x[:, :, 4 * qr : 4 * qr + 4, 4 * qc : 4 * qc + 4].reshape(24, -1))
            assert r["cka"][li, t, q] == pytest.approx(ref, rel=1e-8, abs=1e-10)
    assert set(Localization.scalars(r)) == {
        f"localization/{k}/{t}"
        for k in ("own_share", "contrast")
        for t in ("block00", "block01", "block00_attn_out", "block01_attn_out")
    }


def test_minibatches_accumulate_hsic():
    torch.manual_seed(1)
    x = torch.randn(30, 1, 8, 8)
    tokens = torch.randn(30, 4, 5)
    a = localization_cka(tokens, x, (2, 2), batch_size=10)
    assert a.shape == (4, 4) and a.dtype == torch.float64
    # explicit reference: per-batch unbiased HSIC sums from analysis.cka's centring
    from analysis.estimators.similarity import center_unbiased, gram

    ref = torch.zeros(4, 4, dtype=torch.float64)
    for t in range(4):
        for q in range(4):
            r0, c0 = divmod(q, 2)
            xy = xx = yy = 0.0
            for s in range(0, 30, 10):
                k = center_unbiased(gram(tokens[s : s + 10, t]))
                lm = center_unbiased(gram(x[s : s + 10, :, 4 * r0 : 4 * r0 + 4, 4 * c0 : 4 * c0 + 4]))
                xy, xx, yy = xy + (k * lm).sum(), xx + (k * k).sum(), yy + (lm * lm).sum()
            ref[t, q] = xy / (xx * yy).sqrt()
    torch.testing.assert_close(a, ref, rtol=1e-9, atol=1e-12)


def test_constant_patch_gives_nan_not_noise():
    torch.manual_seed(2)
    x = torch.randn(16, 1, 8, 8)
    x[:, :, :4, :4] = 0.37  # patch 0 constant over every image
    m = localization_cka(torch.stack(input_patches(x, (2, 2)), 1), x, (2, 2))
    assert (
        torch.isnan(m[:, 0]).all() and torch.isnan(m[0]).all() and torch.isfinite(m[1:, 1:]).all()
    )  # token 0 is constant too
    share, contrast = localization_scores(m.numpy())
    assert share == 1.0 and np.isfinite(contrast)


def test_resnet_pools_large_maps_and_pads(tmp_path):
    model = _resnet()
    ctx = _ctx(model, n=24)
    r = _run(Localization(ctx), ctx, batch_size=12)
    assert r["layers"] == ["layer1.0.out", "layer2.0.out", "layer3.0.out", "layer4.0.out"]
    assert r["grid"].tolist() == [[7, 7], [7, 7], [7, 7], [4, 4]]  # 28 and 14 px maps pooled to 7, 4 px map kept
    assert r["cka"].shape == (4, 49, 49)
    assert (
        np.isnan(r["cka"][3, 16:]).all()
        and np.isnan(r["cka"][3, :, 16:]).all()
        and np.isfinite(r["cka"][3, :16, :16]).all()
    )
    assert np.isfinite(r["own_share"]).all() and r["chance"].tolist() == [1 / 49] * 3 + [1 / 16]
    # layer 1 against the definition on the pooled map (4x4 px input patches); layer 4 with 7x7 px input patches
    x = ctx.data.normalize(ctx.data.analysis.images)
    with Taps(model, ["layer1.0.out", "layer4.0.out"]) as cap:
        model(x)
    pooled = torch.nn.functional.adaptive_avg_pool2d(cap["layer1.0.out"], 7).flatten(2).transpose(1, 2)
    np.testing.assert_allclose(r["cka"][0], localization_cka(pooled, x, (7, 7), 12).numpy(), rtol=1e-9, atol=1e-12)
    t4, g4 = spatial_tokens(cap["layer4.0.out"])
    assert g4 == (4, 4)
    np.testing.assert_allclose(
        r["cka"][3, :16, :16], localization_cka(t4, x, (4, 4), 12).numpy(), rtol=1e-9, atol=1e-12
    )
    one = localization_cka(t4, x, (4, 4))  # one minibatch: token 5 = (1, 1) against input pixels [7, 14) x [7, 14)
    assert one[5, 5].item() == pytest.approx(cka(t4[:, 5], x[:, :, 7:14, 7:14].reshape(24, -1)), rel=1e-8)
    figs = Localization.figures(r)
    assert set(figs) == {
        "localization/block00",
        "localization/block01",
        "localization/block02",
        "localization/block03",
        "localization/score",
    }
    _close(figs)


def test_resnet_patch_option_tokens():
    """resnet_tokens=patch (Raghu App. A's probe patching step, not the default here): with a fixed 2x2 patch the 28x28
    map of layer 1 becomes 14x14 tokens of 4 * 8 channels, pooled to 7x7: the same grid, other tokens."""
    model = _resnet()
    ctx = _ctx(model, n=24)
    assert LocalizationOptions().resnet_tokens == "pool"
    r = _run(Localization(ctx, LocalizationOptions(resnet_tokens="patch", resnet_patch=2)), ctx, batch_size=12)
    # a fixed side applies to every map: layer 3 (7x7) drops its last row and column (3x3), layer 4 (4x4) gives 2x2
    assert r["grid"].tolist() == [[7, 7], [7, 7], [3, 3], [2, 2]]
    x = ctx.data.normalize(ctx.data.analysis.images)
    with Taps(model, ["layer1.0.out"]) as cap:
        model(x)
    fmap = cap["layer1.0.out"]
    patched = torch.nn.functional.pixel_unshuffle(fmap, 2)
    tokens = torch.nn.functional.adaptive_avg_pool2d(patched, 7).flatten(2).transpose(1, 2)
    assert tokens.shape == (24, 49, 32)
    np.testing.assert_allclose(r["cka"][0], localization_cka(tokens, x, (7, 7), 12).numpy(), rtol=1e-9, atol=1e-12)
    plain = _run(Localization(ctx), ctx, batch_size=12)
    assert not np.allclose(r["cka"][0], plain["cka"][0])


def test_round_trip_and_figures(tmp_path):
    ctx = _ctx(_vit(class_token=False), n=24)
    r = _run(Localization(ctx), ctx, batch_size=12)
    save_result(r, tmp_path / "localization.npz")
    back = load_result(tmp_path / "localization.npz")
    for fn in (Localization.summary, Localization.scalars):
        assert fn(back) == fn(r)
    assert set(Localization.scalars(back)) == {
        f"localization/{k}/block{i:02d}" for k in ("own_share", "contrast") for i in range(2)
    }
    import json

    json.dumps(Localization.summary(back))
    figs = Localization.figures(back, step=3)
    assert set(figs) == {"localization/block00", "localization/block01", "localization/score"}
    from analysis.engine.figures import save

    for tag, fig in figs.items():
        save(fig, tmp_path / f"{tag.replace('/', '_')}.png")
    assert (tmp_path / "localization_block01.png").stat().st_size > 0


def test_small_last_batch_is_skipped():
    ctx = _ctx(_vit(), n=34)
    r = _run(Localization(ctx), ctx, batch_size=16)  # batches 16, 16, 2: the last is skipped
    assert r["n_images"] == 32


def _close(figs):
    import matplotlib.pyplot as plt

    for f in figs.values():
        plt.close(f)


def test_state_is_additive_over_shards_like_two_processes():
    """Rank 0 takes minibatches j = 0, 2 and rank 1 j = 1; summing their HSIC state (what sync's all-reduce does) gives
    the single-process result."""
    ctx = _ctx(_vit(), n=36)
    one = _run(Localization(ctx), ctx, batch_size=12)
    ranks = [Localization(ctx), Localization(ctx)]
    x_all = ctx.data.normalize(ctx.data.analysis.images)
    for j in range(3):
        x = x_all[12 * j : 12 * (j + 1)]
        with Taps(ctx.model, sorted(ranks[0].taps())) as cap:
            ctx.model(x)
        ranks[j % 2].update(j, cap.captures, x, ctx.data.analysis.labels[12 * j : 12 * (j + 1)])
    for lay in ranks[0].layers:
        a, b = ranks[0].acc[lay], ranks[1].acc[lay]
        a.xy, a.xx, a.yy = a.xy + b.xy, a.xx + b.xx, a.yy + b.yy
    ranks[0].images += ranks[1].images
    two = ranks[0].finish()
    np.testing.assert_allclose(two["cka"], one["cka"], rtol=1e-12, atol=1e-14)
    np.testing.assert_array_equal(two["own_share"], one["own_share"])
    assert two["n_images"] == one["n_images"] == 36
