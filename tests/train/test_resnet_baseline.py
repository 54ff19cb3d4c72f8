"""The ResNet baseline (train/models.py build_resnet, recipes/resnet.yaml): a small stem as wide as the first stage,
so its blocks keep IDENTITY shortcuts at any width (Raghu et al. 2021 compare ViTs against ResNets with identity
skips); the standard ResNet-50 path unchanged; the layers inside its blocks in the paper's CKA layer set; and the
per-token measures (localization, token probes, receptive fields, few-shot probes) on it, as on the ViT."""

from __future__ import annotations

import types

import numpy as np
import pytest
import torch
import torch.nn as nn
from conftest import ROOT, class_split
from timm.models.resnet import BasicBlock, Bottleneck, ResNet

from analysis.engine.suite import make_context, run_suite, suite_options
from analysis.measures.cka import cka_layers
from train.models import build_model
from train.recipe import from_dict, load_recipe
from train.splits import TensorBatches

pytestmark = pytest.mark.usefixtures("one_thread")


def _resnet(layers=(2, 2, 2, 2), channels=(8, 8, 16, 16), **model):
    torch.manual_seed(0)
    r = from_dict(
        {"model": {"arch": "resnet", "resnet_layers": list(layers), "resnet_channels": list(channels), **model}}
    )
    return build_model(r, 10).eval()


def _stages(model):
    return [getattr(model, f"layer{s}") for s in range(1, 5)]


@pytest.mark.parametrize("channels", [(32, 32, 64, 128), (7, 12, 16, 16)])
def test_small_stem_is_as_wide_as_the_first_stage_so_its_blocks_are_identity(channels):
    """Before: timm's one-conv stem is 64 wide whatever the first stage, so layer1.0 projected 64 -> 32."""
    m = _resnet(channels=channels)
    assert (m.conv1.out_channels, m.conv1.kernel_size, m.conv1.stride) == (channels[0], (3, 3), (1, 1))
    assert m.bn1.num_features == channels[0] and isinstance(m.maxpool, nn.Identity)
    s1, *later = _stages(m)
    assert [b.downsample for b in s1] == [None, None]  # identity shortcuts
    for stage, width in zip(later, channels[1:]):
        first, second = stage
        assert (
            isinstance(first.downsample, nn.Sequential) and first.downsample[0].out_channels == width
        )  # strided: projects
        assert second.downsample is None
    assert [i["num_chs"] for i in m.feature_info] == [channels[0], *channels]
    assert [i["reduction"] for i in m.feature_info] == [1, 1, 2, 4, 8]
    x = torch.randn(2, 1, 28, 28)
    with torch.no_grad():
        assert m(x).shape == (2, 10)
        assert m.forward_features(x).shape == (2, channels[-1], 4, 4)
    # identity: layer1.0's output is relu(input + branch), the input being the stem's output
    with torch.no_grad():
        z = m.act1(m.bn1(m.conv1(x)))
        blk = m.layer1[0]
        torch.testing.assert_close(blk(z), torch.relu(z + blk.bn2(blk.conv2(blk.act1(blk.bn1(blk.conv1(z)))))))


def test_small_stem_is_timms_resnet_when_the_widths_already_agree():
    """With a 64-wide first stage (timm's stem width) the model is exactly timm's ResNet with the small stem swapped in:
    the stages come from timm's make_blocks with timm's settings, and timm's initialisation is applied."""
    ours = _resnet(layers=(2, 1, 1, 1), channels=(64, 64, 128, 128))
    torch.manual_seed(0)
    ref = ResNet(block=BasicBlock, layers=(2, 1, 1, 1), channels=(64, 64, 128, 128), in_chans=1, num_classes=10)
    ref.conv1 = nn.Conv2d(1, 64, 3, 1, 1, bias=False)
    ref.maxpool = nn.Identity()
    assert str(ours) == str(ref)
    assert [p.shape for p in ours.parameters()] == [p.shape for p in ref.parameters()]
    with torch.no_grad():
        assert all(
            float(b.bn2.weight.abs().sum()) == 0 for b in ours.layer1
        )  # timm's zero-init of each branch's last BN
        # the new stem has timm's init too (kaiming normal, fan_out: std sqrt(2 / (64 * 9)) = 0.059), not torch's
        # default (std 0.19 for a 1-channel 3x3 conv), which the swapped-in conv of the reference keeps
        assert float(ours.conv1.weight.std()) == pytest.approx((2 / (64 * 9)) ** 0.5, rel=0.15)
        assert float(ref.conv1.weight.std()) > 0.15


def test_resnet50_path_is_unchanged():
    """small_stem false + bottleneck [3, 4, 6, 3] x [64, 128, 256, 512] is timm's ResNet-50 layout, stem and all."""
    ours = _resnet(layers=(3, 4, 6, 3), channels=(64, 128, 256, 512), small_stem=False, resnet_block="bottleneck")
    ref = ResNet(block=Bottleneck, layers=(3, 4, 6, 3), in_chans=1, num_classes=10)
    assert str(ours) == str(ref)
    assert (ours.conv1.kernel_size, ours.conv1.stride, ours.conv1.out_channels) == ((7, 7), (2, 2), 64)
    assert isinstance(ours.maxpool, nn.MaxPool2d) and ours.layer1[0].downsample is not None  # 64 -> 256 projects
    assert sum(p.numel() for p in ours.parameters()) == sum(p.numel() for p in ref.parameters())


def test_the_resnet_recipe_is_resnet18s_layout_with_identity_skips():
    r = load_recipe(ROOT / "recipes" / "resnet.yaml")
    assert (r.model.resnet_layers, r.model.resnet_channels, r.model.small_stem) == (
        [2, 2, 2, 2],
        [32, 32, 64, 128],
        True,
    )
    m = build_model(r, 10)
    blocks = [b for s in _stages(m) for b in s]
    assert (
        m.conv1.out_channels == 32
        and [b.downsample is None for b in blocks] == [True, True, False, True] + [False, True] * 2
    )


# ---------------------------------------------------------------- CKA inside blocks, and the per-token measures


def test_paper_cka_layers_of_a_resnet18_layout_include_the_layers_inside_blocks():
    """Raghu §4 takes intermediate layers as well as block outputs: layers=paper gives every conv and BN output of a
    BasicBlock and its output, 5 per block, 40 for [2, 2, 2, 2] against 8 block outputs."""
    m = _resnet()
    ctx = make_context(m, None)
    assert len(ctx.blocks) == 8
    paper, blocks = cka_layers(ctx, "paper"), cka_layers(ctx, "blocks")
    assert len(blocks) == 8 and len(paper) == 40 > len(blocks)
    assert [lab for _, lab in paper[:5]] == [
        "layer1.0.conv1",
        "layer1.0.bn1",
        "layer1.0.conv2",
        "layer1.0.bn2",
        "layer1.0",
    ]
    assert {t for t, _ in blocks} <= {t for t, _ in paper}


def _trained_looking_bn(m):
    """timm zero-initialises each branch's last BN (a constant branch has no CKA and no receptive field) and fresh
    running statistics make a BN the identity: give every BN the random affine and statistics of a trained one."""
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for mod in m.modules():
            if isinstance(mod, nn.BatchNorm2d):
                mod.weight.copy_(0.5 + torch.rand(mod.weight.shape, generator=g))
                mod.bias.copy_(torch.randn(mod.bias.shape, generator=g) * 0.3)
                mod.running_mean.copy_(torch.randn(mod.running_mean.shape, generator=g) * 0.2)
                mod.running_var.copy_(0.5 + torch.rand(mod.running_var.shape, generator=g))
    return m


def _study():
    from analysis.studies.study import load_study

    return load_study(ROOT / "recipes" / "studies" / "raghu2021.yaml")


def _run_study_resnet():
    """The study's measures and options for its ResNet run, on the study's layout at a tiny width, on a few images."""
    s = _study()
    run = s.runs["resnet_s0"]
    r = load_recipe(run.recipe, [*run.overrides, "model.resnet_channels=[8,8,16,16]"])
    torch.manual_seed(0)
    model = _trained_looking_bn(build_model(r, 10))
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        images = class_split(264, 0)
        data = types.SimpleNamespace(
            analysis=TensorBatches(images.images[:64], images.labels[:64]),
            probe_train=TensorBatches(images.images[64:], images.labels[64:]),
            normalize=lambda x: (x.float() / 255 - 0.5) / 0.5,
            num_classes=10,
        )
        res = run_suite(model, data, suite_options(run.measures, 32, {**s.options, "erf": {"images": 4}}))
    finally:
        torch.set_num_threads(n)
    return run.measures, res


@pytest.fixture(scope="module")
def study_resnet_results():
    return _run_study_resnet()


def test_the_study_resnet_runs_every_measure_it_lists(study_resnet_results):
    """Raghu Fig. 6, 9, 11, 13 compare ViT and ResNet on these: the study lists them for its ResNet, and none is left
    out as inapplicable (attention_distance is not listed: a ResNet has no attention)."""
    measures, res = study_resnet_results
    assert {"localization", "token_probes", "erf", "fewshot_probe", "cka", "norm_ratio"} <= set(measures)
    assert "attention_distance" not in measures
    assert set(measures) <= set(res) and res["meta"]["arch"] == "resnet"
    cka = res["cka"]
    assert (
        cka["layers"] == "paper"
        and cka["matrix"].shape == (40, 40)
        and np.allclose(np.diag(cka["matrix"]), 1.0, atol=1e-6)
    )


def test_resnet_localization_takes_feature_map_positions_as_tokens(study_resnet_results):
    """Raghu §7 / Fig. 9: a ResNet token is all channels at one position; maps wider than 7 are pooled to 7x7, the last
    stage keeps its 4x4 grid. The stride-1 first stage sees little beyond its own input patch: its tokens are far more
    often most similar to their own patch than chance, and that contrast fades stage by stage."""
    r = study_resnet_results[1]["localization"]
    assert list(r["layers"]) == [f"layer{s}.{j}.out" for s in range(1, 5) for j in range(2)]
    assert r["grid"].tolist() == [[7, 7]] * 6 + [[4, 4]] * 2
    assert r["chance"][0] == pytest.approx(1 / 49) and r["chance"][-1] == pytest.approx(1 / 16)
    assert r["own_share"][0] > 10 * r["chance"][0]
    c = r["contrast"]
    assert c[0] > c[2] > c[4] > c[6] and c[0] > 0.2  # the first block of each stage


def test_resnet_token_probes_probe_every_position(study_resnet_results):
    r = study_resnet_results[1]["token_probes"]
    assert r["acc"].shape == (8, 49) and "cls_acc" not in r
    assert (
        np.isfinite(r["acc"][:6]).all() and np.isfinite(r["acc"][6:, :16]).all() and np.isnan(r["acc"][6:, 16:]).all()
    )
    assert ((r["acc"][:6] >= 0) & (r["acc"][:6] <= 1)).all()
    assert np.nanmax(r["acc"]) > 0.3  # the class squares are visible to some positions (chance 0.1)


def test_resnet_receptive_fields_grow_with_depth(study_resnet_results):
    """Raghu Fig. 6 / C.2: a ResNet's effective receptive field (centre position of each block's own map) widens
    from stage to stage."""
    r = study_resnet_results[1]["erf"]
    assert str(r["arch"]) == "resnet" and r["erf"].shape == (8, 2, 28, 28) and "attn_erf" not in r
    np.testing.assert_allclose(r["erf"].sum((2, 3)), 1.0, rtol=1e-9)
    d = r["mean_distance"][:, 0]
    assert d[0] < d[2] < d[4] < d[6]  # the first block of each stage


def test_resnet_fewshot_probes_read_every_block(study_resnet_results):
    """Raghu Fig. 13 (right): probes by depth for ViT and ResNet; a ResNet has no CLS token, so one pool (the spatial
    mean of the patched map, App. A)."""
    r = study_resnet_results[1]["fewshot_probe"]
    assert list(r["pools"]) == ["mean"] and r["mean"].shape == (1, 8)
    assert ((r["mean"] >= 0) & (r["mean"] <= 1)).all() and r["mean"].max() > 0.3
