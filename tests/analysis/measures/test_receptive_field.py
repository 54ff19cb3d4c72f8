"""Effective receptive fields: an explicit per-image, per-channel gradient loop as reference, known supports (no token
mixing -> the centre patch only; a 3x3-conv ResNet stage -> a 7x7 window), the protocol end-to-end, sharding,
round-trip."""

from __future__ import annotations

import types

import numpy as np
import pytest
import torch
import torch.nn as nn
from conftest import TwoProcessReplay, tiny_vit
from timm.models.resnet import BasicBlock, ResNet

from analysis.engine.measure import REGISTRY, Context, load_result, save_result
from analysis.engine.taps import block_names
from analysis.measures.erf import (
    EffectiveReceptiveField,
    ERFOptions,
    centre_window,
    effective_receptive_fields,
    erf_sums,
    mean_distance,
    radius_share,
    window_share,
)

pytestmark = pytest.mark.usefixtures("one_thread")


def _vit(class_token=True, depth=2):
    return tiny_vit(class_token, depth=depth)


def _resnet():
    torch.manual_seed(0)
    m = ResNet(block=BasicBlock, layers=(1, 1, 1, 1), channels=(8, 16, 32, 64), in_chans=1, num_classes=10)
    m.conv1 = nn.Conv2d(1, m.conv1.out_channels, kernel_size=3, stride=1, padding=1, bias=False)  # small_stem
    m.maxpool = nn.Identity()
    with torch.no_grad():  # non-trivial BN statistics, so eval-mode BN is not the identity
        for mod in m.modules():
            if isinstance(mod, nn.BatchNorm2d):
                mod.running_mean.uniform_(-0.2, 0.2)
                mod.running_var.uniform_(0.5, 1.5)
                mod.weight.uniform_(0.5, 1.5)  # timm zero-inits the last BN of each branch
    return m.eval()


def _erf(model, n=8, arch="vit", accelerator=None, **opts):
    """The ERF measure on the first ``n`` of ``n`` images, options given as keyword arguments."""
    return EffectiveReceptiveField(_ctx(model, n, arch, accelerator), ERFOptions(images=n, **opts))


def _ctx(model, n=8, arch="vit", accelerator=None):
    g = torch.Generator().manual_seed(1)
    images = torch.randint(0, 256, (n, 1, 28, 28), dtype=torch.uint8, generator=g)
    split = types.SimpleNamespace(images=images, labels=torch.arange(n) % 10)
    data = types.SimpleNamespace(
        analysis=split, probe_train=split, normalize=lambda x: x.float() / 255 - 0.5, num_classes=10
    )
    tokens = arch == "vit"
    return Context(
        model=model,
        data=data,
        device=torch.device("cpu"),
        accelerator=accelerator,
        arch=arch,
        blocks=tuple(block_names(model)),
        prefix=int(getattr(model, "num_prefix_tokens", 0)),
        grid=tuple(model.patch_embed.grid_size) if tokens else None,
        patch_size=4 if tokens else None,
    )


def _vit_sublayers(model, x):
    """The ViT forward written out by hand (no hooks): {tap name: tensor} for every block."""
    z = model.norm_pre(model.patch_drop(model._pos_embed(model.patch_embed(x))))
    out = {}
    for i, blk in enumerate(model.blocks):
        a = blk.drop_path1(blk.ls1(blk.attn(blk.norm1(z))))
        z = z + a
        out[f"blocks.{i}.attn_branch"], out[f"blocks.{i}.attn_out"] = a, z
        f = blk.drop_path2(blk.ls2(blk.mlp(blk.norm2(z))))
        z = z + f
        out[f"blocks.{i}.mlp_branch"], out[f"blocks.{i}.out"] = f, z
    return out


def _reference_erf(model, images, name, centre):
    """sum over images of the mean over channels d of sum_c |d F[centre, d] / d x| -- one image and one channel at a
    time."""
    total = torch.zeros(images.shape[-2:], dtype=torch.float64)
    for b in range(images.shape[0]):
        x = images[b : b + 1].clone().requires_grad_(True)
        feat = _vit_sublayers(model, x)[name][0, centre]
        per_channel = [
            torch.autograd.grad(feat[d], x, retain_graph=True)[0][0].abs().sum(0).double() for d in range(feat.shape[0])
        ]
        total += torch.stack(per_channel).mean(0)
    return total


def test_batched_erf_matches_explicit_per_channel_loop():
    model = _vit()
    x = torch.randn(2, 1, 28, 28, generator=torch.Generator().manual_seed(2))
    names = ["blocks.0.attn_branch", "blocks.1.out"]
    with torch.no_grad():  # as the suite calls finish()
        sums, shapes = effective_receptive_fields(model, x, names, prefix=1, grid=(7, 7))
    centre = 1 + 3 * 7 + 3
    for n in names:
        ref = _reference_erf(model, x, n, centre)
        assert shapes[n] == (50, 32) and sums[n].dtype == torch.float64
        torch.testing.assert_close(sums[n], ref, rtol=1e-5, atol=1e-9)
    # averaged over channels is not |gradient of the channel sum|
    xg = x.clone().requires_grad_(True)
    feats = _vit_sublayers(model, xg)["blocks.1.out"][:, centre]
    of_sum = torch.autograd.grad(feats.sum(), xg)[0].abs().sum((0, 1)).double() / feats.shape[1]
    assert not torch.allclose(of_sum, sums["blocks.1.out"], rtol=1e-2)


def test_channel_rounds_give_the_same_sum():
    model = _vit(depth=1)
    for p in model.parameters():
        p.requires_grad_(False)
    x = torch.randn(2, 1, 28, 28, generator=torch.Generator().manual_seed(3))
    names = {"blocks.0.out": 32}

    def forward(xr):
        return _vit_sublayers(model, xr)

    whole = erf_sums(forward, x, names, 1, (7, 7))  # one round of 32 copies
    rounds = erf_sums(forward, x, names, 1, (7, 7), max_images=26)  # rounds of 13 channels, the last one short
    for n in names:
        torch.testing.assert_close(whole[n], rounds[n], rtol=1e-12, atol=1e-12)


class _PerToken(nn.Module):
    """Attention replaced by a per-token linear map: no token mixing at all."""

    def __init__(self, dim):
        super().__init__()
        self.lin = nn.Linear(dim, dim)

    def forward(self, x, attn_mask=None, is_causal=False, **kw):
        return self.lin(x)


@pytest.mark.parametrize("class_token", [True, False])
def test_no_token_mixing_keeps_the_erf_inside_the_centre_patch(class_token):
    model = _vit(class_token)
    torch.manual_seed(4)
    for blk in model.blocks:
        blk.attn = _PerToken(32)
    with torch.no_grad():
        r = _erf(model, n=2).finish()
    assert r["window"].tolist() == [[12, 16, 12, 16]] * 2  # the patch of grid position (3, 3)
    for key in ("concentration", "attn_concentration", "radius_share", "attn_radius_share"):
        np.testing.assert_allclose(r[key], 1.0, atol=1e-6)
    assert r["erf"][:, :, 12:16, 12:16].min() > 0  # every pixel of the patch matters


def test_token_mixing_spreads_the_erf():
    model = _vit()
    with torch.no_grad():
        r = _erf(model, n=4).finish()
    assert r["erf"].shape == (2, 2, 28, 28) and r["attn_erf"].shape == (2, 2, 28, 28)
    np.testing.assert_allclose(r["erf"].sum((2, 3)), 1.0, rtol=1e-9)
    assert (r["erf"] >= 0).all()
    assert (r["concentration"] < 0.99).all() and (r["attn_concentration"][:, 1] < 0.99).all()
    assert (r["concentration"] > 0).all()
    # the attention branch alone depends less on the centre patch than the post-residual stream (Raghu Fig. C.4)
    assert (r["attn_concentration"][:, 1] < r["attn_concentration"][:, 0]).all()


def test_no_skip_block_post_residual_is_its_branch():
    from interventions.no_skip import block_classes as _block_cls

    _, NoSkipBlock = _block_cls()
    model = _vit()
    blk = model.blocks[1]
    blk.__class__ = NoSkipBlock
    blk.skip_attn, blk.skip_mlp = True, False  # block 1 output = its MLP branch alone
    with torch.no_grad():
        r = _erf(model, n=2).finish()
    np.testing.assert_allclose(r["erf"][1, 0], r["erf"][1, 1], rtol=1e-12, atol=1e-15)
    assert not np.allclose(r["erf"][0, 0], r["erf"][0, 1])


def test_scores_on_hand_made_maps():
    erf = torch.zeros(8, 8, dtype=torch.float64)
    erf[4, 4], erf[4, 6], erf[0, 0] = 2.0, 1.0, 1.0
    win = centre_window((5, 4, 4), (8, 8))  # 4x4 map on an 8x8 input: position (2, 2) covers rows/cols 4..5
    assert win == (4, 6, 4, 6)
    assert window_share(erf, win) == pytest.approx(0.5)
    # window centre (5, 5): (4, 4) is at sqrt(0.5), (4, 6) at sqrt(2.5), (0, 0) at sqrt(2 * 4.5^2)
    assert radius_share(erf, win, 1.0) == pytest.approx(0.5)
    assert radius_share(erf, win, 2.0) == pytest.approx(0.75)
    assert mean_distance(erf, win) == pytest.approx((2 * 0.5**0.5 + 2.5**0.5 + 2**0.5 * 4.5) / 4)
    assert centre_window((50, 32), (28, 28), prefix=1, grid=(7, 7)) == (12, 16, 12, 16)


def test_resnet_stage1_receptive_field_is_7x7():
    model = _resnet()
    x = torch.randn(3, 1, 28, 28, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        sums, shapes = effective_receptive_fields(model, x, ["layer1.0.out", "layer1.0.branch", "layer2.0.branch"])
    assert shapes["layer1.0.out"] == (8, 28, 28) and shapes["layer2.0.branch"] == (16, 14, 14)
    for name in ("layer1.0.out", "layer1.0.branch"):
        e = sums[name]
        inside = e[11:18, 11:18]  # stem 3x3 + conv 3x3 + conv 3x3 around (14, 14)
        assert inside.sum() > 0 and e.sum() == pytest.approx(float(inside.sum()), rel=0, abs=0)
        ring = inside.clone()
        ring[1:-1, 1:-1] = 0
        assert ring.sum() > 0  # the bound is tight: the 5x5 window does not hold everything
    assert (sums["layer2.0.branch"][9:20, 9:20] > 0).sum() > 49  # a stride-2 block reaches further

    # the branch alone, written out by hand (the block adds the shortcut in place: the tap must not see it)
    def branch(xr):
        z = model.maxpool(model.act1(model.bn1(model.conv1(xr))))
        blk = model.layer1[0]
        return {"layer1.0.branch": blk.bn2(blk.conv2(blk.act1(blk.bn1(blk.conv1(z)))))}

    for p in model.parameters():
        p.requires_grad_(False)
    with torch.enable_grad():
        ref = erf_sums(branch, x, {"layer1.0.branch": 8})["layer1.0.branch"]
    torch.testing.assert_close(sums["layer1.0.branch"], ref, rtol=1e-6, atol=1e-12)
    assert not torch.allclose(sums["layer1.0.out"], ref, rtol=1e-3)


def test_resnet_end_to_end():
    model = _resnet()
    ctx = _ctx(model, n=2, arch="resnet")
    assert EffectiveReceptiveField.applies(ctx)
    with torch.no_grad():
        r = EffectiveReceptiveField(ctx).finish()
    assert r["erf"].shape == (4, 2, 28, 28) and "attn_erf" not in r
    assert r["blocks"] == ["layer1.0", "layer2.0", "layer3.0", "layer4.0"]
    assert r["window"].tolist()[:2] == [[14, 15, 14, 15], [14, 16, 14, 16]]
    assert r["radius"] == 3.5
    np.testing.assert_allclose(r["concentration"][0, 0], r["erf"][0, 0, 14, 14], rtol=1e-9)
    e = r["erf"][0]
    np.testing.assert_allclose(e[:, 11:18, 11:18].sum((1, 2)), 1.0, rtol=1e-9)


def test_protocol_round_trip_and_state(tmp_path):
    model = _vit()
    model.train()
    model.blocks[0].attn.qkv.weight.requires_grad_(False)
    flags = [p.requires_grad for p in model.parameters()]
    ctx = _ctx(model, n=3)
    m = REGISTRY["erf"](ctx, ERFOptions(images=3, batch=2))
    assert m.needs_grad and m.taps() == set()
    with torch.no_grad():
        r = m.finish()
    assert model.training and [p.requires_grad for p in model.parameters()] == flags
    assert r["images"] == 3 and r["variants"] == ["residual", "branch"] and r["blocks"] == ["blocks.0", "blocks.1"]
    save_result(r, tmp_path / "erf.npz")
    back = load_result(tmp_path / "erf.npz")
    for rr in (r, back):
        s = EffectiveReceptiveField.scalars(rr)
        assert set(s) >= {
            "erf/concentration/residual/block00",
            "erf/concentration/branch/block01",
            "erf/concentration/attn_branch/block01",
        }
        assert s["erf/concentration/residual/block01"] == pytest.approx(float(r["concentration"][1, 0]))
        summ = EffectiveReceptiveField.summary(rr)
        assert summ["images"] == 3 and len(summ["concentration_branch"]) == 2
        figs = EffectiveReceptiveField.figures(rr, step=3)
        assert set(figs) == {"erf/maps", "erf/concentration"}
        import matplotlib.pyplot as plt

        for f in figs.values():
            plt.close(f)
    assert EffectiveReceptiveField.scalars(back) == EffectiveReceptiveField.scalars(r)


def test_two_processes_give_the_one_process_answer():
    model = _vit()
    with torch.no_grad():
        one = _erf(model, n=5, batch=2).finish()
        log = []
        _erf(model, n=5, batch=2, accelerator=TwoProcessReplay(1, log)).finish()  # chunk 1
        two = _erf(model, n=5, batch=2, accelerator=TwoProcessReplay(0, log)).finish()  # chunks 0, 2
    assert two["images"] == 5
    for k in ("erf", "attn_erf", "concentration", "mean_distance"):
        np.testing.assert_allclose(two[k], one[k], rtol=1e-10, atol=1e-14)
