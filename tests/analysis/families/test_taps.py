"""Taps on every model variant; a tap that never fires raises; hooks are removed; norm ratio on known tensors."""

import pytest
import torch

from analysis.engine.taps import TapError, Taps, available_taps, block_names
from analysis.measures.norm_ratio import NormRatio, cosine, norm_ratio
from train.models import build_model
from train.recipe import from_dict

SMALL = {"model": {"depth": 3, "embed_dim": 32, "num_heads": 4}}


def _build(extra=None):
    d = {**SMALL, **(extra or {})}
    d["model"] = {**SMALL["model"], **(extra or {}).get("model", {})}
    torch.manual_seed(0)
    return build_model(from_dict(d), 10).eval()


VARIANTS = {
    "cls": {},
    "gap": {"model": {"head": "gap"}},
    "noskip": {"interventions": {"no_skip": {"blocks": [1], "where": "both"}}},
    "headmask": {"interventions": {"head_mask": {"block": 0, "heads": [1]}}},
}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_vit_taps_on_every_variant(variant):
    m = _build(VARIANTS[variant])
    fused_before = [b.attn.fused_attn for b in m.blocks]
    x = torch.randn(2, 1, 28, 28)
    names = available_taps(m)
    with torch.no_grad(), Taps(m, names) as cap:
        out = m(x)
    T = 49 + m.num_prefix_tokens
    for i in range(3):
        p = f"blocks.{i}."
        z, a, mid, f, o = (cap[p + k] for k in ("in", "attn_branch", "attn_out", "mlp_branch", "out"))
        assert z.shape == (2, T, 32) and cap[p + "mlp_hidden"].shape == (2, T, 64)
        probs = cap[p + "attn_probs"]
        assert probs.shape == (2, 4, T, T) and torch.allclose(probs.sum(-1), torch.ones(2, 4, T), atol=1e-5)
        blk = m.blocks[i]
        with torch.no_grad():  # the norm taps are what the sublayers read, on every variant
            assert torch.allclose(cap[p + "norm1"], blk.norm1(z), atol=1e-6) and torch.allclose(
                cap[p + "norm2"], blk.norm2(mid), atol=1e-6
            )
        if variant == "noskip" and i == 1:
            assert torch.allclose(mid, a) and torch.allclose(o, f)
        else:
            assert torch.allclose(mid, z + a, atol=1e-6) and torch.allclose(o, mid + f, atol=1e-6)
    # hooks removed and fused attention restored; the output is unchanged by tapping
    assert all(
        len(mod._forward_hooks) == 0
        and len(mod._forward_pre_hooks) == (1 if mod is m.blocks[0].attn.proj and variant == "headmask" else 0)
        for mod in m.modules()
    )
    assert [b.attn.fused_attn for b in m.blocks] == fused_before
    with torch.no_grad():
        assert torch.allclose(m(x), out, atol=1e-5)


def test_resnet_taps():
    m = build_model(
        from_dict({"model": {"arch": "resnet", "resnet_layers": [1, 1, 1, 1], "resnet_channels": [8, 16, 16, 16]}}), 10
    ).eval()
    with torch.no_grad():  # make the zero-initialised last BN of each branch non-trivial
        for mod in m.modules():
            if isinstance(mod, torch.nn.BatchNorm2d):
                mod.weight.fill_(0.5)
    assert block_names(m) == ["layer1.0", "layer2.0", "layer3.0", "layer4.0"]
    with torch.no_grad(), Taps(m, available_taps(m)) as cap:
        m(torch.randn(2, 1, 28, 28))
    for b in block_names(m):
        s, f, o = cap[f"{b}.shortcut"], cap[f"{b}.branch"], cap[f"{b}.out"]
        assert torch.allclose(o, torch.relu(s + f), atol=1e-5), (
            "out = act(shortcut + branch): the branch was captured before the in-place add"
        )
    assert cap["layer2.0.branch"].shape == (2, 16, 14, 14)
    # the layers inside each BasicBlock are tapped too (checked against the block's maths in
    # tests/analysis/measures/test_cka_layers.py)
    assert [n for n in available_taps(m) if n.startswith("layer1.0.")] == [
        f"layer1.0.{k}" for k in ("in", "branch", "shortcut", "out", "conv1", "bn1", "act1", "conv2", "bn2")
    ]
    assert torch.allclose(cap["layer2.0.bn2"], cap["layer2.0.branch"]) and cap["layer2.0.act1"].min() >= 0


def test_tap_that_never_fires_raises_and_unknown_tap_is_named():
    m = _build()
    with pytest.raises(TapError, match="never fired"), Taps(m, ["blocks.0.out"]):
        pass
    with pytest.raises(TapError, match="unknown tap 'blocks.9.out'"):
        Taps(m, ["blocks.9.out"])
    assert all(len(mod._forward_hooks) == 0 for mod in m.modules())


def test_norm_ratio_and_cosine_on_constructed_tensors():
    z = torch.zeros(2, 3, 4)
    z[..., 0] = torch.tensor([[3.0, 1.0, 2.0], [3.0, 1.0, 2.0]])
    f = torch.zeros(2, 3, 4)
    f[..., 0] = 1.0  # token 0: parallel, ratio 3
    f[:, 1, 0], f[:, 1, 1] = 0.0, 2.0  # token 1: orthogonal, ratio 1/2
    f[:, 2, 0] = -4.0  # token 2: opposite, ratio 1/2
    assert torch.allclose(norm_ratio(z, f), torch.tensor([3.0, 0.5, 0.5], dtype=torch.float64))
    assert torch.allclose(cosine(z, f), torch.tensor([1.0, 0.0, -1.0], dtype=torch.float64))
    # the mean over images is of per-image ratios
    z2, f2 = torch.ones(2, 1, 1), torch.tensor([[[1.0]], [[0.25]]])
    assert norm_ratio(z2, f2).item() == pytest.approx((1 + 4) / 2)
    # float64 against float32 inputs (a float64 stream with a float32 branch) and half precision are accepted
    assert torch.allclose(norm_ratio(z.double(), f), norm_ratio(z, f)) and torch.allclose(
        cosine(z.bfloat16(), f), cosine(z, f)
    )
    acc = NormRatio()
    acc.update("b0", "attn", z[:1], f[:1])
    acc.update("b0", "attn", z[1:], f[1:])
    r, c = acc.compute()[("b0", "attn")]
    assert torch.allclose(r, norm_ratio(z, f)) and torch.allclose(c, cosine(z, f))
