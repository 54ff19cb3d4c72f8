"""The ResNet baseline (train/models.py build_resnet, recipes/resnet.yaml): a small stem as wide as the first stage,
so its blocks keep IDENTITY shortcuts at any width (Raghu et al. 2021 compare ViTs against ResNets with identity
skips); the standard ResNet-50 path unchanged; the layers inside its blocks in the paper's CKA layer set; and the
per-token measures (localization, token probes, receptive fields, few-shot probes) on it, as on the ViT."""
from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn as nn
from conftest import ROOT, class_split
from timm.models.resnet import BasicBlock, Bottleneck, ResNet

from analysis.measures.cka import cka_layers
from analysis.suite import make_context, run_suite, suite_options
from analysis.taps import block_names
from train.models import build_model
from train.recipe import from_dict, load_recipe

pytestmark = pytest.mark.usefixtures("one_thread")


def _resnet(layers=(2, 2, 2, 2), channels=(8, 8, 16, 16), **model):
    torch.manual_seed(0)
    r = from_dict({"model": {"arch": "resnet", "resnet_layers": list(layers), "resnet_channels": list(channels), **model}})
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
        assert isinstance(first.downsample, nn.Sequential) and first.downsample[0].out_channels == width  # strided: projects
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
        assert all(float(b.bn2.weight.abs().sum()) == 0 for b in ours.layer1)  # timm's zero-init of each branch's last BN
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
    assert (r.model.resnet_layers, r.model.resnet_channels, r.model.small_stem) == ([2, 2, 2, 2], [32, 32, 64, 128], True)
    m = build_model(r, 10)
    blocks = [b for s in _stages(m) for b in s]
    assert m.conv1.out_channels == 32 and [b.downsample is None for b in blocks] == [True, True, False, True] + [False, True] * 2
