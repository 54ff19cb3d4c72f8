"""Per-token few-shot probes (Raghu Fig. 11 left, D.4): a known answer (only token 3 carries the label), agreement
with probe_layers on single-token features, the suite's shot / validation halves, stride, CLS / GAP / ResNet through
the protocol, round-trip; ResNet tokens with Raghu App. A's patching step (a hand-made map, the patch-side rule,
the measures' defaults)."""

from __future__ import annotations

import json
import types

import numpy as np
import pytest
import torch
from conftest import tiny_vit

from analysis.engine.measure import REGISTRY, Context, load_result, save_result
from analysis.engine.taps import Taps, block_names, grid_of
from analysis.estimators.features import final_channels, patchify, pool_features, resnet_patch_side, spatial_tokens
from analysis.estimators.probing import probe_layers
from analysis.estimators.probing import probe_split as probe_halves
from analysis.measures.token_probes import TokenProbeOptions, TokenProbes, strided_positions, token_probe_accuracies

pytestmark = pytest.mark.usefixtures("one_thread")


def _vit(class_token=True):
    return tiny_vit(class_token)


def _resnet():
    from timm.models.resnet import BasicBlock, ResNet

    torch.manual_seed(0)
    m = ResNet(block=BasicBlock, layers=(1, 1, 1, 1), channels=(8, 8, 16, 16), in_chans=1, num_classes=10)
    m.conv1 = torch.nn.Conv2d(1, m.conv1.out_channels, 3, 1, 1, bias=False)
    m.maxpool = torch.nn.Identity()
    return m.eval()


def _split(n, seed):
    """Images whose top-left 4x4 patch (token 0) is bright in proportion to the label: a learnable, local signal."""
    g = torch.Generator().manual_seed(seed)
    labels = torch.arange(n) % 10
    img = torch.randint(0, 60, (n, 1, 28, 28), generator=g, dtype=torch.uint8)
    img[:, :, :4, :4] = (labels * 20 + 40).to(torch.uint8)[:, None, None, None]
    return types.SimpleNamespace(images=img, labels=labels)


def _ctx(model, n_test=30, n_train=200):
    vit = hasattr(model, "patch_embed")
    data = types.SimpleNamespace(
        analysis=_split(n_test, 0), probe_train=_split(n_train, 1), normalize=lambda x: x.float() / 255, num_classes=10
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
def _run(measure, ctx, batch_size=64):
    """Drive a Measure through the protocol, as the suite does: analysis pass, then probe-train pass, then finish."""
    for split, taps, fn in (
        (ctx.data.analysis, measure.taps(), measure.update),
        (ctx.data.probe_train, measure.probe_taps(), measure.update_probe),
    ):
        for j in range((len(split.labels) + batch_size - 1) // batch_size):
            x = ctx.data.normalize(split.images[j * batch_size : (j + 1) * batch_size])
            with Taps(ctx.model, sorted(taps)) as cap:
                ctx.model(x)
            fn(j, cap.captures, x, split.labels[j * batch_size : (j + 1) * batch_size])
    return measure.finish()


def _only_token3(n, seed, tokens=6, dim=8):
    g = torch.Generator().manual_seed(seed)
    means = 6.0 * torch.randn(10, dim, generator=torch.Generator().manual_seed(99))
    y = torch.arange(n) % 10
    x = torch.randn(n, tokens, dim, generator=g)
    x[:, 3] += means[y]
    return x, y


def test_registered():
    assert REGISTRY["token_probes"] is TokenProbes


def test_only_the_informative_token_is_accurate():
    tr_x, tr_y = _only_token3(100, 0)
    te_x, te_y = _only_token3(500, 1)
    acc, std = token_probe_accuracies(tr_x, tr_y, te_x, te_y, shots=10, seeds=(0, 1, 2))
    assert acc.shape == std.shape == (6,)
    assert acc[3] > 0.9
    others = np.delete(acc, 3)
    assert (others < 0.2).all() and abs(others.mean() - 0.1) < 0.05
    # the same as probe_layers on the single-token features, token by token
    for t in (0, 3, 5):
        ref = probe_layers({"x": tr_x[:, t]}, tr_y, {"x": te_x[:, t]}, te_y, shots=10, seeds=(0, 1, 2))["x"]
        assert (acc[t], std[t]) == pytest.approx(ref, abs=0)


def test_with_validation_features_matches_probe_layers():
    tr_x, tr_y = _only_token3(100, 2)
    va_x, va_y = _only_token3(60, 3)
    te_x, te_y = _only_token3(200, 4)
    acc, std = token_probe_accuracies(
        tr_x, tr_y, te_x, te_y, shots=5, seeds=(0, 1), val_x=va_x, val_y=va_y, num_classes=10
    )
    ref = probe_layers(
        {"x": tr_x[:, 3]}, tr_y, {"x": te_x[:, 3]}, te_y, shots=5, seeds=(0, 1), val_feats={"x": va_x[:, 3]}, val_y=va_y
    )["x"]
    assert (acc[3], std[3]) == pytest.approx(ref, abs=0)


def test_strided_positions():
    assert strided_positions((7, 7), 1).tolist() == list(range(49))
    assert strided_positions((7, 7), 3).tolist() == [0, 3, 6, 21, 24, 27, 42, 45, 48]
    assert strided_positions((4, 5), 2).tolist() == [0, 2, 4, 10, 12, 14]
    with pytest.raises(ValueError):
        strided_positions((7, 7), 0)


def test_halves_are_the_suites():
    from train.data import balanced_indices

    y = torch.arange(200) % 10
    shot, val = probe_halves(y)
    assert shot.tolist() == balanced_indices(y.numpy(), 100, seed=12345).tolist()
    assert sorted(shot.tolist() + val.tolist()) == list(range(200)) and torch.bincount(y[shot]).tolist() == [10] * 10


def test_cls_vit_through_the_protocol_equals_explicit_probes():
    ctx = _ctx(_vit())
    r = _run(TokenProbes(ctx, TokenProbeOptions(shots=5, seeds=(0, 1), stride=3)), ctx)
    assert r["layers"] == ["blocks.0.out", "blocks.1.out"] and r["grid"].tolist() == [[7, 7], [7, 7]]
    assert r["acc"].shape == r["std"].shape == r["token_index"].shape == (2, 9)
    assert r["token_index"][0].tolist() == [0, 3, 6, 21, 24, 27, 42, 45, 48]
    assert r["cls_acc"].shape == r["cls_std"].shape == (2,) and r["mean_over_tokens"].shape == (2,)
    np.testing.assert_allclose(r["mean_over_tokens"], r["acc"].mean(1))
    assert r["shots"] == 5 and r["seeds"].tolist() == [0, 1] and r["chance"] == 0.1 and r["n_images"] == 30
    # explicit reference: features of every image, the suite's halves, probe_layers on token 24 (+1 for CLS) and the CLS
    # token
    feats = {}
    for name, split in (("test", ctx.data.analysis), ("train", ctx.data.probe_train)):
        with Taps(ctx.model, ["blocks.1.out"]) as cap:
            ctx.model(ctx.data.normalize(split.images))
        feats[name] = cap["blocks.1.out"].half().float()  # kept as float16 by the measure (features.stored)
    shot, val = probe_halves(ctx.data.probe_train.labels)
    ytr = ctx.data.probe_train.labels
    for col, tok in ((4, 1 + 24), (None, 0)):
        f = feats["train"][:, tok]
        ref = probe_layers(
            {"t": f[shot]},
            ytr[shot],
            {"t": feats["test"][:, tok]},
            ctx.data.analysis.labels,
            shots=5,
            seeds=(0, 1),
            val_feats={"t": f[val]},
            val_y=ytr[val],
            num_classes=10,
        )["t"]
        got = (r["acc"][1, col], r["std"][1, col]) if col is not None else (r["cls_acc"][1], r["cls_std"][1])
        assert got == pytest.approx(ref, abs=1e-12)
    # the label is written into token 0's patch: that token beats the mean of the others
    assert r["acc"][0, 0] > r["acc"][0, 1:].mean() + 0.2
    assert set(TokenProbes.scalars(r)) == {f"token_probes/{k}/block{i:02d}" for k in ("mean", "cls") for i in range(2)}


def test_gap_vit_round_trip(tmp_path):
    ctx = _ctx(_vit(class_token=False), n_train=100)
    r = _run(TokenProbes(ctx, TokenProbeOptions(shots=5, seeds=(0,), stride=2)), ctx)
    assert "cls_acc" not in r and r["acc"].shape == (2, 16) and (r["std"] == 0).all()
    save_result(r, tmp_path / "token_probes.npz")
    back = load_result(tmp_path / "token_probes.npz")
    for fn in (TokenProbes.summary, TokenProbes.scalars):
        assert fn(back) == fn(r)
    json.dumps(TokenProbes.summary(back))
    assert set(TokenProbes.scalars(back)) == {"token_probes/mean/block00", "token_probes/mean/block01"}
    figs = TokenProbes.figures(back, step=5)
    assert set(figs) == {"token_probes/heatmap", "token_probes/maps", "token_probes/mean"}
    from analysis.engine.figures import save

    for tag, fig in figs.items():
        save(fig, tmp_path / f"{tag.replace('/', '_')}.png")
    assert (tmp_path / "token_probes_maps.png").stat().st_size > 0


def test_resnet_pads_the_small_last_stage():
    ctx = _ctx(_resnet(), n_train=100)
    r = _run(TokenProbes(ctx, TokenProbeOptions(shots=5, seeds=(0,), stride=2)), ctx)
    assert r["grid"].tolist() == [[7, 7], [7, 7], [7, 7], [4, 4]] and "cls_acc" not in r
    assert r["acc"].shape == (4, 16)  # 7x7 grids at stride 2: 16 tokens; 4x4 at stride 2: 4 tokens + NaN padding
    assert (
        np.isnan(r["acc"][3, 4:]).all()
        and np.isfinite(r["acc"][3, :4]).all()
        and r["token_index"][3].tolist() == [0, 2, 8, 10] + [-1] * 12
    )
    np.testing.assert_allclose(r["mean_over_tokens"][3], r["acc"][3, :4].mean())
    figs = TokenProbes.figures(r)
    import matplotlib.pyplot as plt

    for f in figs.values():
        plt.close(f)


def test_too_few_probe_images_is_explained():
    ctx = _ctx(_vit(), n_train=100)
    assert "probe_train_size to at least 200" in str(
        TokenProbes.problem(ctx.data, TokenProbeOptions(shots=10, stride=7))
    )
    assert TokenProbes.problem(ctx.data, TokenProbeOptions(shots=5)) is None


# ---------------------------------------------------------------- ResNet tokens: Raghu App. A's patching step


def test_patchify_a_hand_made_feature_map():
    fmap = torch.arange(2 * 4 * 4, dtype=torch.float32).reshape(1, 2, 4, 4)  # channel c, row r, col s: 16c + 4r + s
    tokens, grid = spatial_tokens(fmap, patch=2)
    assert grid == (2, 2) and tokens.shape == (1, 4, 8)
    # each 2x2 patch flattened as (channel, row in patch, col in patch), patches in row-major order
    assert tokens[0].tolist() == [
        [0, 1, 4, 5, 16, 17, 20, 21],
        [2, 3, 6, 7, 18, 19, 22, 23],
        [8, 9, 12, 13, 24, 25, 28, 29],
        [10, 11, 14, 15, 26, 27, 30, 31],
    ]
    assert patchify(fmap, 2).shape == (1, 8, 2, 2) and patchify(fmap, 1) is fmap
    # then pooled like a plain map: max_side 1 averages the four patch tokens
    pooled, g1 = spatial_tokens(fmap, patch=2, max_side=1)
    assert g1 == (1, 1) and pooled[0, 0].tolist() == tokens[0].mean(0).tolist()
    assert pool_features(fmap, "mean_spatial", 0, patch=2)[0].tolist() == tokens[0].mean(0).tolist()
    # without patching a token is one position's channels (Raghu §7)
    plain, g = spatial_tokens(fmap)
    assert g == (4, 4) and plain[0, 5].tolist() == [5, 21]
    # a 5x5 map: the last row and column do not fill a patch and are dropped
    odd = torch.arange(25.0).reshape(1, 1, 5, 5)
    assert patchify(odd, 2)[0, :, 1, 1].tolist() == [12, 13, 17, 18]
    with pytest.raises(ValueError):
        patchify(fmap, 5)


def test_patch_side_rule():
    # ResNet-50 at 224 px: C p^2 at most 2048, the pooled 7x7 grid kept
    sides = [resnet_patch_side((1, c, h, h), 2048) for c, h in ((256, 56), (512, 28), (1024, 14), (2048, 7))]
    assert sides == [2, 2, 1, 1]
    assert (
        resnet_patch_side((1, 8, 28, 28), 1024) == 4
    )  # 7 would divide 28 and fit the channels, but shrink the grid below 7
    assert resnet_patch_side((1, 16, 7, 7), 1024) == 1
    assert resnet_patch_side((1, 32, 28, 28), 256) == 2  # 3 would give 288 > 256 channels
    assert (
        resnet_patch_side((1, 8, 28, 28), 1024, mode="pool") == 1
        and resnet_patch_side((1, 8, 28, 28), 1024, patch=3) == 3
    )
    assert final_channels(_resnet()) == 16 and final_channels(types.SimpleNamespace(module=_resnet())) == 16


def _resnet_wide():
    """Channels 8, 16, 32, 64: stages 1 and 2 get 2x2 patches (32 and 64 channels per token), 3 and 4 none."""
    from timm.models.resnet import BasicBlock, ResNet

    torch.manual_seed(0)
    m = ResNet(block=BasicBlock, layers=(1, 1, 1, 1), channels=(8, 16, 32, 64), in_chans=1, num_classes=10)
    m.conv1 = torch.nn.Conv2d(1, m.conv1.out_channels, 3, 1, 1, bias=False)
    m.maxpool = torch.nn.Identity()
    return m.eval()


@torch.no_grad()
def test_resnet_tokens_are_patched_by_default_and_equal_explicit_probes():
    ctx = _ctx(_resnet_wide(), n_train=100)
    opts = dict(shots=5, seeds=(0,), stride=3)
    r = _run(TokenProbes(ctx, TokenProbeOptions(**opts)), ctx)
    pooled = _run(TokenProbes(ctx, TokenProbeOptions(resnet_tokens="pool", **opts)), ctx)
    assert r["token_dim"].tolist() == [32, 64, 32, 64] and pooled["token_dim"].tolist() == [8, 16, 32, 64]
    assert r["grid"].tolist() == pooled["grid"].tolist() == [[7, 7], [7, 7], [7, 7], [4, 4]]  # same token grid
    np.testing.assert_array_equal(r["acc"][2:], pooled["acc"][2:])  # unpatched stages are unchanged
    # explicit reference for stage 1: 2x2 patches of the 28x28 map, pooled to 7x7, probe on token 24
    feats = {}
    for name, split in (("test", ctx.data.analysis), ("train", ctx.data.probe_train)):
        with Taps(ctx.model, ["layer1.0.out"]) as cap:
            ctx.model(ctx.data.normalize(split.images))
        feats[name] = spatial_tokens(cap["layer1.0.out"], patch=2)[0]
    assert feats["test"].shape[1:] == (49, 32)
    shot, val = probe_halves(ctx.data.probe_train.labels)
    ytr = ctx.data.probe_train.labels
    f = feats["train"][:, 24]
    ref = probe_layers(
        {"t": f[shot]},
        ytr[shot],
        {"t": feats["test"][:, 24]},
        ctx.data.analysis.labels,
        shots=5,
        seeds=(0,),
        val_feats={"t": f[val]},
        val_y=ytr[val],
        num_classes=10,
    )["t"]
    col = r["token_index"][0].tolist().index(24)
    assert r["acc"][0, col] == pytest.approx(ref[0], abs=1e-12)


@torch.no_grad()
def test_fewshot_probe_patches_resnet_maps_by_default():
    from analysis.measures.fewshot_probe import FewShotOptions, FewShotProbeMeasure

    ctx = _ctx(_resnet_wide(), n_train=100)
    r = _run(FewShotProbeMeasure(ctx, FewShotOptions(shots=5, seeds=(0,))), ctx)
    pooled = _run(FewShotProbeMeasure(ctx, FewShotOptions(shots=5, seeds=(0,), resnet_tokens="pool")), ctx)
    assert r["feature_dim"].tolist() == [32, 64, 32, 64] and pooled["feature_dim"].tolist() == [8, 16, 32, 64]
    assert str(r["method"]) == "big_vision" and r["mean"].shape == (1, 4)
    np.testing.assert_array_equal(r["mean"][:, 2:], pooled["mean"][:, 2:])


def test_probe_options_are_checked():
    from analysis.engine.measure import MeasureError, make_options
    from analysis.measures.fewshot_probe import FewShotProbeMeasure

    assert make_options(TokenProbes, {"method": "centred", "l2": "1e3", "resnet_tokens": "pool"}).l2 == 1000.0
    assert (
        make_options(FewShotProbeMeasure, {}).method == "big_vision"
        and make_options(FewShotProbeMeasure, {}).l2 is None
    )
    for cls, bad in (
        (TokenProbes, {"method": "sklearn"}),
        (TokenProbes, {"l2": 0}),
        (FewShotProbeMeasure, {"resnet_tokens": "crop"}),
        (FewShotProbeMeasure, {"baseline": "normal"}),
        (FewShotProbeMeasure, {"resnet_patch": -1}),
    ):
        with pytest.raises(MeasureError):
            make_options(cls, bad)
