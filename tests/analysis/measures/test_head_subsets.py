"""ViT attention-head subsets vs ResNet layers by CKA (Raghu et al. 2021 Fig. 5): a constructed case with CKA 1, an
independent reference for every entry, the head order on hand-built attention, and a run on tiny timm models."""

from __future__ import annotations

import functools
import math

import numpy as np
import pytest
import torch
from conftest import tiny_vit

from analysis.engine.measure import load_result, save_result
from analysis.engine.taps import Taps
from analysis.estimators.similarity import cka
from analysis.measures.attention_distance import attention_distance
from analysis.measures.head_subsets import default_resnet_layers, head_subset_cka, head_subset_figure, split_heads

N_IMAGES = 12


def normalize(x):
    return x.float() / 255


def _vit(heads=4):
    return tiny_vit(num_heads=heads)  # the shared tiny ViT (conftest), with 4 heads to sort by default


def _resnet():
    from timm.models.resnet import BasicBlock, ResNet

    torch.manual_seed(1)
    return ResNet(block=BasicBlock, layers=(1, 1, 1, 1), channels=(8, 16, 32, 64), in_chans=1, num_classes=10).eval()


def _images(n=N_IMAGES, seed=2):
    return torch.randint(0, 256, (n, 1, 28, 28), generator=torch.Generator().manual_seed(seed), dtype=torch.uint8)


@torch.no_grad()
def _manual_heads(vit, x):
    """Block 0's per-head attention outputs [B, H, T, dh], recomputed from the weights with explicit per-head loops."""
    t = vit.norm_pre(vit.patch_drop(vit._pos_embed(vit.patch_embed(x))))
    blk = vit.blocks[0]
    h = blk.norm1(t)
    c, heads = h.shape[-1], blk.attn.num_heads
    dh = c // heads
    qkv = h @ blk.attn.qkv.weight.T + blk.attn.qkv.bias  # channels: [q | k | v], each head-major
    out = []
    for i in range(heads):
        q, k, v = (qkv[..., s * c + i * dh : s * c + (i + 1) * dh] for s in range(3))
        a = torch.softmax(q @ k.transpose(1, 2) / math.sqrt(dh), dim=-1)
        out.append(a @ v)
    return torch.stack(out, 1)


def _plant_head0_in_resnet(vit, resnet):
    """Make the ResNet's layer1.0 output equal to ViT head 0's spatial output (dh = 8 channels on the 7x7 grid)."""
    seen = {}
    h1 = resnet.register_forward_pre_hook(lambda mod, args: seen.__setitem__("x", args[0]))

    def replace(mod, args, out):
        heads = _manual_heads(vit, seen["x"])[:, 0, 1:]  # [B, 49, 8]
        assert out.shape[1:] == (8, 7, 7)
        return heads.reshape(-1, 7, 7, 8).permute(0, 3, 1, 2).contiguous()

    h2 = resnet.layer1[0].register_forward_hook(replace)
    return [h1, h2]


def test_head_equal_to_resnet_layer_gives_cka_one_and_entries_match_reference():
    vit, resnet, images = _vit(), _resnet(), _images()
    handles = _plant_head0_in_resnet(vit, resnet)
    try:
        r = head_subset_cka(vit, resnet, images, normalize, batch_size=N_IMAGES)  # one minibatch: equals full-batch cka
        with Taps(resnet, r["resnet_layers"]) as cap, torch.no_grad():
            resnet(normalize(images))
        ys = [cap[t].reshape(N_IMAGES, -1) for t in r["resnet_layers"]]
        r6 = head_subset_cka(vit, resnet, images, normalize, batch_size=6)  # two minibatches
    finally:
        for h in handles:
            h.remove()
    assert (
        r["resnet_layers"] == ["layer1.0.out", "layer2.0.out"]
        and r["cka"].shape == (4, 2)
        and r["subset_cka"].shape == (3, 2)
    )
    row0 = r["head_order"].tolist().index(0)
    assert r["cka"][row0, 0] == pytest.approx(1.0, abs=1e-9)
    assert r6["cka"][r6["head_order"].tolist().index(0), 0] == pytest.approx(1.0, abs=1e-9)
    assert np.delete(r["cka"][:, 0], row0).max() < 0.99

    heads = _manual_heads(vit, normalize(images))[:, :, 1:]  # [B, H, 49, dh]
    for i, h in enumerate(r["head_order"]):
        for j, y in enumerate(ys):
            assert r["cka"][i, j] == pytest.approx(cka(heads[:, h].reshape(N_IMAGES, -1), y), abs=1e-6)
    for s, members in enumerate(r["subset_heads"]):
        feats = torch.cat([heads[:, h] for h in members], -1).reshape(N_IMAGES, -1)
        for j, y in enumerate(ys):
            assert r["subset_cka"][s, j] == pytest.approx(cka(feats, y), abs=1e-6)


@functools.lru_cache(maxsize=4)
def _hand_built(batch, heads, grid=(7, 7)):
    """head 0 uniform over all tokens; head 1 self; head 2 one column right (left in the last column); head 3 two rows
    down (up in the last two rows). Prefix (CLS) rows are uniform."""
    gh, gw = grid
    n, t = gh * gw, 1 + gh * gw
    a = torch.zeros(batch, heads, t, t)
    a[:, :, 0, :] = 1 / t
    a[:, 0] = 1 / t
    for q in range(n):
        r, c = divmod(q, gw)
        a[:, 1, 1 + q, 1 + q] = 1
        a[:, 2, 1 + q, 1 + (q + 1 if c + 1 < gw else q - 1)] = 1
        a[:, 3, 1 + q, 1 + (q + 2 * gw if r + 2 < gh else q - 2 * gw)] = 1
    return a


def test_order_follows_distance_on_hand_built_attention():
    vit, resnet, images = _vit(), _resnet(), _images()
    attn = vit.blocks[0].attn
    attn.fused_attn = False  # the hand-built attention must feed both passes

    def replace(mod, args):
        return (_hand_built(args[0].shape[0], 4).to(args[0].dtype),)

    handle = attn.attn_drop.register_forward_pre_hook(replace)
    try:
        r = head_subset_cka(vit, resnet, images, normalize, batch_size=6, resnet_layers=["layer1.0.out"])
        ru = head_subset_cka(
            vit, resnet, images, normalize, batch_size=6, resnet_layers=["layer1.0.out"], unit="unit_square", k=1
        )
        r3 = head_subset_cka(vit, resnet, images, normalize, batch_size=6, resnet_layers=["layer1.0.out"], k=3)
        rp = head_subset_cka(
            vit, resnet, images, normalize, batch_size=6, resnet_layers=["layer1.0.out"], unit="pixel_level"
        )
        with torch.no_grad():  # the head outputs are the hand-built attention applied to the values
            out = {}
            hook = attn.proj.register_forward_pre_hook(lambda mod, args: out.__setitem__("x", args[0]))
            vit(normalize(images[:2]))
            hook.remove()
            v = attn.qkv(vit.blocks[0].norm1(vit.norm_pre(vit._pos_embed(vit.patch_embed(normalize(images[:2]))))))[
                ..., 64:
            ]
    finally:
        handle.remove()
    expected = attention_distance(_hand_built(1, 4), (7, 7), 4, 1).numpy()
    assert expected[1] == 0 and expected[2] == 4 and expected[3] == 8 and expected[0] > 8
    assert r["head_order"].tolist() == [1, 2, 3, 0]
    np.testing.assert_allclose(r["head_distance"], expected[[1, 2, 3, 0]], rtol=1e-6)
    # windows of k = 2 consecutive heads in the distance order, sliding from the most local to the most global
    assert r["subset_heads"].tolist() == [[1, 2], [2, 3], [3, 0]] and list(r["subsets"]) == [
        "sorted 0-1",
        "sorted 1-2",
        "sorted 2-3",
    ]
    np.testing.assert_allclose(r["subset_distance"], [2.0, 6.0, (8 + expected[0]) / 2], rtol=1e-6)
    assert r["k"] == 2 and r["subset_cka"].shape == (3, 1) and r["cka"].shape == (4, 1)
    assert r3["subset_heads"].tolist() == [[1, 2, 3], [2, 3, 0]] and r3["subset_cka"].shape == (2, 1)
    np.testing.assert_allclose(ru["head_distance"], r["head_distance"] / 24, rtol=1e-6)  # (7 - 1) patches of 4 pixels
    assert ru["subset_heads"].tolist() == [[1], [2], [3], [0]]
    np.testing.assert_allclose(ru["subset_cka"], ru["cka"], rtol=1e-9)  # k = 1: the windows are the single heads
    assert (
        rp["head_order"].tolist() == [1, 2, 3, 0] and rp["head_distance"][0] > 0
    )  # pixel level: a self head is not at 0
    heads = split_heads(out["x"], 4, 1)  # [2, 4, 49, 8]
    torch.testing.assert_close(heads[:, 1], v[:, 1:, 8:16])  # self attention: head 1 outputs its own values


def test_sweep_on_tiny_models_has_the_stated_shapes_and_order():
    """Raghu Fig. 5 sweep on a 4-head tiny ViT: windows of k heads slide along the distance order, local -> global."""
    vit, resnet, images = _vit(heads=4), _resnet(), _images(8)
    r = head_subset_cka(vit, resnet, images, normalize, batch_size=4)
    order = r["head_order"].tolist()
    assert sorted(order) == [0, 1, 2, 3] and r["k"] == 2
    assert r["cka"].shape == (4, 2) and r["subset_cka"].shape == (3, 2) and r["subset_heads"].shape == (3, 2)
    assert r["subset_heads"].tolist() == [order[0:2], order[1:3], order[2:4]]
    assert np.all(np.diff(r["subset_distance"]) >= 0) and np.all(np.diff(r["head_distance"]) >= 0)
    np.testing.assert_allclose(
        r["subset_distance"], [r["head_distance"][i : i + 2].mean() for i in range(3)], rtol=1e-12
    )
    assert np.isfinite(r["subset_cka"]).all()
    r1 = head_subset_cka(vit, resnet, images, normalize, batch_size=4, k=4)  # one window: all heads
    assert r1["subset_heads"].tolist() == [order] and r1["subset_cka"].shape == (1, 2)
    with pytest.raises(ValueError):
        head_subset_cka(vit, resnet, images, normalize, batch_size=4, k=5)


def test_runs_on_tiny_timm_models_and_round_trip(tmp_path):
    vit, resnet, images = _vit(heads=2), _resnet(), _images(10)
    vit.train()
    r = head_subset_cka(vit, resnet, images, normalize, batch_size=5)
    assert vit.training and not resnet.training  # modes restored
    assert r["head_order"].shape == (2,) and sorted(r["head_order"].tolist()) == [0, 1]
    assert r["head_distance"].shape == (2,) and np.all(np.diff(r["head_distance"]) >= 0)
    assert r["cka"].shape == (2, 2) and r["subset_cka"].shape == (2, 2) and np.isfinite(r["cka"]).all()
    assert r["subset_heads"].tolist() == [[r["head_order"][0]], [r["head_order"][1]]]
    np.testing.assert_allclose(r["subset_cka"], r["cka"], rtol=1e-9)  # k = 1: the subsets are the single extreme heads
    assert r["n_images"] == 10 and r["block"] == 0 and r["unit"] == "pixels"
    assert default_resnet_layers(resnet, stages=(1, 2, 3)) == ["layer1.0.out", "layer2.0.out", "layer3.0.out"]
    save_result(r, tmp_path / "hs.npz")
    back = load_result(tmp_path / "hs.npz")
    import matplotlib.pyplot as plt

    for res in (r, back):
        fig = head_subset_figure(res)
        assert len(fig.axes[0].lines) >= 2
        plt.close(fig)
    with pytest.raises(ValueError):
        head_subset_cka(vit, resnet, images, normalize, batch_size=8)  # a last minibatch of 2 images
    with pytest.raises(ValueError):
        head_subset_cka(resnet, vit, images, normalize)
