"""CKA layer sets (blocks / sublayers / paper / all) on tiny ViTs, Mixers and ResNets (BasicBlock, Bottleneck);
the taps they add (ViT / Mixer norm outputs, ResNet layers inside blocks) against the block's maths by hand."""

import types

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from conftest import class_split, tiny_resnet, tiny_vit
from timm.models.mlp_mixer import MlpMixer
from timm.models.resnet import BasicBlock, Bottleneck, ResNet

from analysis.engine.measure import MeasureError, make_options
from analysis.engine.suite import make_context, suite_options
from analysis.engine.taps import TapError, Taps, available_taps, block_kinds
from analysis.estimators.similarity import cka
from analysis.frontends.cli import main as analysis_main
from analysis.measures.cka import LAYER_SETS, CKAMeasure, cka_layers
from analysis.measures.localization import Localization, LocalizationOptions
from analysis.reports import cross as XC
from train.data import TensorBatches


def _bottleneck():
    torch.manual_seed(0)
    return ResNet(block=Bottleneck, layers=(1, 1, 1, 1), channels=(4, 4, 8, 8), in_chans=1, num_classes=10).eval()


def _basic_identity():
    """BasicBlocks whose layer1.1 has an identity shortcut (the others project: 64-channel stem, strides)."""
    torch.manual_seed(0)
    return ResNet(block=BasicBlock, layers=(2, 1, 1, 1), channels=(8, 8, 16, 16), in_chans=1, num_classes=10).eval()


def _mixer():
    torch.manual_seed(0)
    return MlpMixer(num_classes=10, img_size=28, in_chans=1, patch_size=4, num_blocks=2, embed_dim=16).eval()


def _perturb_bn(m):
    """Trained-looking BatchNorms (timm zero-initialises the last BN of each branch; fresh stats make bn = conv)."""
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for mod in m.modules():
            if isinstance(mod, torch.nn.BatchNorm2d):
                mod.weight.copy_(0.5 + torch.rand(mod.weight.shape, generator=g))
                mod.bias.copy_(torch.randn(mod.bias.shape, generator=g) * 0.3)
                mod.running_mean.copy_(torch.randn(mod.running_mean.shape, generator=g) * 0.2)
                mod.running_var.copy_(0.5 + torch.rand(mod.running_var.shape, generator=g))
    return m


def _labels(model, layers):
    return [lab for _, lab in cka_layers(make_context(model, None, 8), layers)]


# ---------------------------------------------------------------- the layer sets


def test_vit_layer_sets():
    m = tiny_vit()  # 2 blocks
    assert _labels(m, "blocks") == ["0.mlp", "1.mlp"]
    assert _labels(m, "sublayers") == ["0.attn", "0.mlp", "1.attn", "1.mlp"]  # the former (and default) set
    per_block = ["norm1", "attn_branch", "attn", "norm2", "mlp_hidden", "mlp_branch", "mlp"]
    assert _labels(m, "paper") == [f"{i}.{k}" for i in range(2) for k in per_block]
    every = ["norm1", "heads", "attn_branch", "attn", "norm2", "mlp_hidden", "mlp_branch", "mlp"]
    assert _labels(m, "all") == ["0.in"] + [f"{i}.{k}" for i in range(2) for k in every]
    taps = [t for t, _ in cka_layers(make_context(m, None, 8), "paper")]
    assert taps[:7] == [
        f"blocks.0.{k}" for k in ("norm1", "attn_branch", "attn_out", "norm2", "mlp_hidden", "mlp_branch", "out")
    ]


def test_mixer_layer_sets():
    m = _mixer()
    assert _labels(m, "sublayers") == ["0.token", "0.channel", "1.token", "1.channel"]
    assert _labels(m, "paper")[:7] == [
        "0.norm1",
        "0.token_branch",
        "0.token",
        "0.norm2",
        "0.channel_hidden",
        "0.channel_branch",
        "0.channel",
    ]
    assert len(_labels(m, "all")) == 1 + 2 * 7


def test_resnet_basic_layer_sets():
    m = _basic_identity()  # blocks layer1.0 (projection), layer1.1 (identity), layer2.0, layer3.0, layer4.0
    blocks = ["layer1.0", "layer1.1", "layer2.0", "layer3.0", "layer4.0"]
    assert _labels(m, "blocks") == _labels(m, "sublayers") == blocks
    assert _labels(m, "paper") == [
        lab for b in blocks for lab in (f"{b}.conv1", f"{b}.bn1", f"{b}.conv2", f"{b}.bn2", b)
    ]
    every = _labels(m, "all")
    assert every[:9] == [
        "layer1.0.in",
        "layer1.0.conv1",
        "layer1.0.bn1",
        "layer1.0.act1",
        "layer1.0.conv2",
        "layer1.0.bn2",
        "layer1.0.shortcut",
        "layer1.0",
        "layer1.1.conv1",
    ]
    # 1 input + 5 blocks x (5 inner layers + out) + 4 projection shortcuts; the identity shortcut and the branch
    # (= bn2 without SE) repeat other tensors and are left out
    assert (
        len(every) == 1 + 5 * 6 + 4
        and "layer1.1.shortcut" not in every
        and not any(lab.endswith(".branch") for lab in every)
    )
    assert "layer1.0.act2" not in every  # a BasicBlock's act2 is its output


def test_resnet_bottleneck_layer_sets():
    m = _bottleneck()
    inner = ["conv1", "bn1", "act1", "conv2", "bn2", "act2", "conv3", "bn3"]
    assert block_kinds(m, "layer2.0") == ("in", "branch", "shortcut", "out", *inner)
    blocks = ["layer1.0", "layer2.0", "layer3.0", "layer4.0"]
    assert _labels(m, "paper") == [
        lab for b in blocks for lab in [f"{b}.{k}" for k in ("conv1", "bn1", "conv2", "bn2", "conv3", "bn3")] + [b]
    ]
    assert len(_labels(m, "paper")) == 4 * 7 and len(_labels(m, "all")) == 1 + 4 * (8 + 1 + 1)


def test_every_set_names_every_arch():
    assert set(LAYER_SETS) == {"blocks", "sublayers", "paper", "all"}
    assert all(set(v) == {"vit", "mixer", "resnet"} for v in LAYER_SETS.values())


# ---------------------------------------------------------------- the new taps, by hand


def test_vit_norm_taps_are_the_norm_outputs():
    m = tiny_vit()
    x = torch.randn(3, 1, 28, 28)
    with torch.no_grad(), Taps(m, available_taps(m)) as cap:
        m(x)
    with torch.no_grad():
        for i, blk in enumerate(m.blocks):
            p = f"blocks.{i}."
            assert torch.allclose(cap[p + "norm1"], blk.norm1(cap[p + "in"]), atol=1e-6)
            assert torch.allclose(cap[p + "norm2"], blk.norm2(cap[p + "attn_out"]), atol=1e-6)
            assert torch.allclose(cap[p + "mlp_hidden"], blk.mlp.act(blk.mlp.fc1(cap[p + "norm2"])), atol=1e-6)
            assert not torch.allclose(cap[p + "norm1"], cap[p + "in"], atol=1e-3)


def test_mixer_norm_taps_are_the_norm_outputs():
    m = _mixer()
    with torch.no_grad(), Taps(m, available_taps(m)) as cap:
        m(torch.randn(2, 1, 28, 28))
    with torch.no_grad():
        for i, blk in enumerate(m.blocks):
            p = f"blocks.{i}."
            assert torch.allclose(cap[p + "norm1"], blk.norm1(cap[p + "in"]), atol=1e-6)
            assert torch.allclose(cap[p + "norm2"], blk.norm2(cap[p + "attn_out"]), atol=1e-6)


@pytest.mark.parametrize("make", [_basic_identity, _bottleneck], ids=["basic", "bottleneck"])
@pytest.mark.parametrize("graph", [False, True])
def test_resnet_inner_taps_are_the_block_maths(make, graph):
    m = _perturb_bn(make())
    x = torch.randn(3, 1, 28, 28)
    with torch.no_grad():
        ref = m(x)
    with torch.set_grad_enabled(graph), Taps(m, available_taps(m), graph=graph) as cap:
        out = m(x)
    assert torch.allclose(out, ref, atol=1e-6)  # tapping changes nothing
    n_conv = 3 if make is _bottleneck else 2
    with torch.no_grad():
        for name, blk in [(f"layer{s}.{j}", b) for s in range(1, 5) for j, b in enumerate(getattr(m, f"layer{s}"))]:
            c = {k: v.detach() for k, v in cap.captures.items() if k.startswith(name + ".")}
            h = c[f"{name}.in"]
            for n in range(1, n_conv + 1):
                conv, bn = c[f"{name}.conv{n}"], c[f"{name}.bn{n}"]
                assert torch.allclose(conv, getattr(blk, f"conv{n}")(h), atol=1e-5)
                assert torch.allclose(bn, getattr(blk, f"bn{n}")(conv), atol=1e-5)
                assert (bn < 0).any(), "a bn output was captured after the in-place ReLU / shortcut add overwrote it"
                if n < n_conv:
                    h = c[f"{name}.act{n}"]
                    assert torch.allclose(h, F.relu(bn), atol=1e-6)
            shortcut = c[f"{name}.shortcut"]
            assert torch.allclose(c[f"{name}.out"], F.relu(bn + shortcut), atol=1e-5)
            assert torch.allclose(c[f"{name}.branch"], bn, atol=1e-6)


def test_a_kind_the_block_lacks_is_refused_with_the_block_kinds():
    with pytest.raises(
        TapError, match=r"unknown tap 'layer1.0.conv3' .*tap kinds of layer1.0 are in, branch, shortcut, out, conv1"
    ):
        Taps(tiny_resnet(), ["layer1.0.conv3"])


# ---------------------------------------------------------------- measures on the new layers


def _run_cka(model, layers, x):
    ctx = make_context(model, None, len(x))
    measure = CKAMeasure(ctx, make_options(CKAMeasure, {"layers": layers}))
    with torch.no_grad(), Taps(model, sorted(measure.taps())) as cap:
        model(x)
    measure.update(0, cap.captures, x, None)
    return measure.finish(), cap


@pytest.mark.parametrize("make", [_bottleneck, tiny_vit], ids=["bottleneck", "vit"])
def test_cka_measure_on_all_layers_is_pairwise_cka_of_the_taps(make):
    m = _perturb_bn(make())
    x = torch.randn(12, 1, 28, 28)
    r, cap = _run_cka(m, "all", x)
    L = len(r["labels"])
    assert r["matrix"].shape == (L, L) and np.allclose(np.diag(r["matrix"]), 1.0) and r["layers"] == "all"
    taps = r["taps"]
    for i, j in [(0, L - 1), (1, 2), (L // 2, L // 3)]:  # one minibatch: minibatch CKA == cka on the whole set
        want = cka(cap[taps[i]].flatten(1), cap[taps[j]].flatten(1))
        assert r["matrix"][i, j] == pytest.approx(
            want, abs=2e-7
        )  # float32 Gram products summed in float64 (analysis/estimators/similarity.py)


def test_cross_cka_uses_the_layer_set():
    s = class_split(16, 0)
    split = TensorBatches(s.images, s.labels)
    data = types.SimpleNamespace(analysis=split, normalize=lambda x: x.float() / 255)
    vit, res = tiny_vit(), _perturb_bn(tiny_resnet())  # timm zero-initialises the last BN: a constant bn2 has no CKA
    out = XC.cross_cka(vit, res, data, suite_options(["cka"], 8, {"cka": {"layers": "paper"}}))
    assert out["matrix"].shape == (2 * 7, 4 * 5)
    assert out["labels_a"][:3] == ["0.norm1", "0.attn_branch", "0.attn"] and out["labels_b"][:2] == [
        "layer1.0.conv1",
        "layer1.0.bn1",
    ]
    same = XC.cross_cka(res, res, data, suite_options(["cka"], 8, {"cka": {"layers": "all"}}))
    assert np.allclose(same["same_index"], 1.0) and len(same["same_index"]) == 1 + 4 * 6 + 4


def test_localization_reads_resnet_inner_taps():
    m = tiny_resnet()
    split = class_split(16, 1)
    data = types.SimpleNamespace(analysis=split, normalize=lambda x: x.float() / 255)
    ctx = make_context(m, data, 8)
    loc = Localization(ctx, LocalizationOptions(kinds=("conv1", "act1", "out")))
    for j in range(2):
        x = data.normalize(split.images[8 * j : 8 * (j + 1)])
        with torch.no_grad(), Taps(m, sorted(loc.taps())) as cap:
            m(x)
        loc.update(j, cap.captures, x, split.labels[8 * j : 8 * (j + 1)])
    r = loc.finish()
    assert r["layers"][:3] == ["layer1.0.conv1", "layer1.0.act1", "layer1.0.out"] and np.isfinite(r["own_share"]).all()


# ---------------------------------------------------------------- bad input


def test_unknown_layer_set_is_one_sentence():
    with pytest.raises(MeasureError) as e:
        make_options(CKAMeasure, {"layers": "nonsense"})
    msg = str(e.value)
    assert msg == "option 'cka.layers' must be one of 'blocks', 'sublayers', 'paper', 'all', got 'nonsense'."


def test_cli_refuses_an_unknown_layer_set_before_anything(tmp_path, capsys):
    run = tmp_path / "runs" / "none"
    run.mkdir(parents=True)
    (run / "recipe.yaml").touch()  # a run folder as far as the checks before the measures' go
    assert analysis_main([str(run), "--opt", "cka.layers=nonsense"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == "error: option 'cka.layers' must be one of 'blocks', 'sublayers', 'paper', 'all', got 'nonsense'."
    assert sorted(p.name for p in run.iterdir()) == ["recipe.yaml"]  # nothing written
