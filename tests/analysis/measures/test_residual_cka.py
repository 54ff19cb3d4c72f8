"""Residual-connection CKA: constructed features with known answers, an explicit HSIC reference over minibatches,
analysis.cka.cka on one minibatch, the protocol end-to-end on tiny timm ViT and ResNet, sharding and the round-trip."""

from __future__ import annotations

import types

import numpy as np
import pytest
import torch
import torch.nn as nn
from conftest import TwoProcessReplay, tiny_vit
from timm.models.resnet import BasicBlock, ResNet

from analysis.engine.measure import REGISTRY, Context, load_result, save_result
from analysis.engine.taps import Taps, block_names
from analysis.estimators.similarity import cka
from analysis.measures.residual_cka import ResidualCKA, ResidualCKAOptions, residual_cka

pytestmark = pytest.mark.usefixtures("one_thread")


def _ctx(model=None, arch="vit", blocks=("blocks.0", "blocks.1"), accelerator=None, unbiased=True, n=16):
    g = torch.Generator().manual_seed(1)
    images = torch.randint(0, 256, (n, 1, 28, 28), dtype=torch.uint8, generator=g)
    split = types.SimpleNamespace(images=images, labels=torch.arange(n) % 10)
    data = types.SimpleNamespace(analysis=split, probe_train=split, normalize=lambda x: x.float() / 255, num_classes=10)
    if model is not None:
        blocks = tuple(block_names(model))
    return Context(
        model=model,
        data=data,
        batch_size=8,
        device=torch.device("cpu"),
        accelerator=accelerator,
        arch=arch,
        blocks=blocks,
        prefix=1 if arch == "vit" else 0,
        grid=(7, 7) if arch == "vit" else None,
        patch_size=4 if arch == "vit" else None,
    )


def _hsic1(x, y):
    """Unbiased HSIC (Song et al. 2012), the explicit formula with zero-diagonal Grams."""
    x, y = x.reshape(x.shape[0], -1).double(), y.reshape(y.shape[0], -1).double()
    n = x.shape[0]
    k, l_ = x @ x.T, y @ y.T
    k.fill_diagonal_(0)
    l_.fill_diagonal_(0)
    one = torch.ones(n, 1, dtype=torch.float64)
    t = (
        torch.trace(k @ l_)
        + (one.T @ k @ one) * (one.T @ l_ @ one) / ((n - 1) * (n - 2))
        - 2 / (n - 2) * (one.T @ k @ l_ @ one)
    )
    return float(t) / (n * (n - 3))


def _minibatch_cka(xs, ys):
    """sum_b HSIC(x_b, y_b) / sqrt(sum_b HSIC(x_b, x_b) sum_b HSIC(y_b, y_b)) over the given minibatches."""
    xy = sum(_hsic1(x, y) for x, y in zip(xs, ys))
    xx = sum(_hsic1(x, x) for x in xs)
    yy = sum(_hsic1(y, y) for y in ys)
    return xy / (xx * yy) ** 0.5


def _vit_caps(g, n, blocks=2, tokens=50, dim=32, how=None):
    """Constructed captures: attn branch = an orthogonal rotation of the skip, scaled (CKA 1); mlp branch = independent
    noise (CKA ~0); the attention output = the skip (CKA 1)."""
    q, _ = torch.linalg.qr(torch.randn(dim, dim, generator=g, dtype=torch.float64))
    cap = {}
    for i in range(blocks):
        z = torch.randn(n, tokens, dim, generator=g)
        cap[f"blocks.{i}.in"] = z
        cap[f"blocks.{i}.attn_branch"] = 3.0 * (z.double() @ q).float()
        cap[f"blocks.{i}.attn_out"] = z.clone()
        cap[f"blocks.{i}.mlp_branch"] = torch.randn(n, tokens, dim, generator=g)
        cap[f"blocks.{i}.out"] = z + 0.1 * torch.randn(n, tokens, dim, generator=g)
    return cap


def test_constructed_features_give_known_answers():
    g = torch.Generator().manual_seed(0)
    m = ResidualCKA(_ctx())
    assert m.taps() == {
        f"blocks.{i}.{k}" for i in range(2) for k in ("in", "attn_branch", "attn_out", "mlp_branch", "out")
    }
    for j in range(3):
        m.update(j, _vit_caps(g, 64), None, None)
    r = m.finish()
    assert r["sublayers"] == ["attn", "mlp"] and r["blocks"] == ["blocks.0", "blocks.1"]
    assert (
        r["skip_branch"].shape == (2, 2)
        and r["skip_out"].shape == (2, 2)
        and r["skip_branch_matrix"].shape == (2, 2, 2)
    )
    np.testing.assert_allclose(r["skip_branch"][0], 1.0, atol=1e-9)  # rotated + scaled copy
    np.testing.assert_allclose(r["skip_out"][0], 1.0, atol=1e-9)  # attn_out = in
    assert np.abs(r["skip_branch"][1]).max() < 0.05  # independent noise
    assert (r["skip_out"][1] > 0.95).all() and (r["skip_out"][1] < 1 - 1e-4).all()  # z + small noise
    # the off-diagonal of Fig. 23's matrix pairs different blocks' independent features
    assert abs(r["skip_branch_matrix"][0, 0, 1]) < 0.05 and abs(r["skip_branch_matrix"][0, 1, 0]) < 0.05
    np.testing.assert_allclose(np.diagonal(r["skip_branch_matrix"], axis1=1, axis2=2), r["skip_branch"], rtol=0, atol=0)


@pytest.mark.parametrize("unbiased", [True, False])
def test_one_minibatch_equals_full_batch_cka(unbiased):
    g = torch.Generator().manual_seed(1)
    cap = _vit_caps(g, 12)
    cap["blocks.1.attn_branch"] = cap["blocks.1.in"] + torch.randn(12, 50, 32, generator=g)  # something in between
    for i in range(2):  # a sublayer output that is not the skip, so every tap's role shows
        cap[f"blocks.{i}.attn_out"] = cap[f"blocks.{i}.in"] + cap[f"blocks.{i}.attn_branch"]
    m = ResidualCKA(_ctx(), ResidualCKAOptions(unbiased=unbiased))
    m.update(0, cap, None, None)
    r = m.finish()
    assert r["unbiased"] == int(unbiased)
    for i in range(2):
        for s, (zk, fk, ok) in enumerate((("in", "attn_branch", "attn_out"), ("attn_out", "mlp_branch", "out"))):
            z, f, o = (cap[f"blocks.{i}.{k}"].reshape(12, -1) for k in (zk, fk, ok))
            assert r["skip_branch"][s, i] == pytest.approx(cka(z, f, unbiased=unbiased), abs=1e-6)
            assert r["skip_out"][s, i] == pytest.approx(cka(z, o, unbiased=unbiased), abs=1e-6)
            assert r["skip_branch"][s, i] == pytest.approx(
                residual_cka(cap[f"blocks.{i}.{zk}"], cap[f"blocks.{i}.{fk}"], unbiased), abs=1e-12
            )
    assert r["skip_branch_matrix"][0, 1, 0] == pytest.approx(
        cka(cap["blocks.1.in"].reshape(12, -1), cap["blocks.0.attn_branch"].reshape(12, -1), unbiased=unbiased),
        abs=1e-6,
    )


def test_minibatches_match_an_explicit_hsic_reference():
    g = torch.Generator().manual_seed(2)
    caps = [_vit_caps(g, n, tokens=6, dim=5) for n in (6, 9)]
    for c in caps:
        c["blocks.0.mlp_branch"] = torch.tanh(c["blocks.0.attn_out"] * 2) + 0.3 * c["blocks.0.mlp_branch"]
    m = ResidualCKA(_ctx())
    for j, c in enumerate(caps):
        m.update(j, c, None, None)
    r = m.finish()
    for i in range(2):
        ref = _minibatch_cka([c[f"blocks.{i}.attn_out"] for c in caps], [c[f"blocks.{i}.mlp_branch"] for c in caps])
        assert r["skip_branch"][1, i] == pytest.approx(ref, abs=1e-9)
        ref = _minibatch_cka([c[f"blocks.{i}.attn_out"] for c in caps], [c[f"blocks.{i}.out"] for c in caps])
        assert r["skip_out"][1, i] == pytest.approx(ref, abs=1e-9)
    assert 0.2 < r["skip_branch"][1, 0] < 0.99


def _run(model, ctx, measure=None, batches=((0, 8), (8, 16))):
    """The suite's analysis pass, by hand: Taps of measure.taps() per minibatch, then update."""
    m = measure or REGISTRY["residual_cka"](ctx)
    images = ctx.data.analysis.images
    for j, (a, b) in enumerate(batches):
        x = ctx.data.normalize(images[a:b])
        with torch.no_grad(), Taps(model, sorted(m.taps())) as cap:
            model(x)
        m.update(j, cap.captures, x, None)
    return m


def _vit():
    return tiny_vit()


def _resnet():
    torch.manual_seed(0)
    m = ResNet(block=BasicBlock, layers=(1, 1, 1, 1), channels=(8, 16, 32, 64), in_chans=1, num_classes=10)
    with torch.no_grad():
        for mod in m.modules():
            if isinstance(mod, nn.BatchNorm2d):
                mod.weight.uniform_(0.5, 1.5)  # timm zero-inits each branch's last BN: the branch would be constant
    return m.eval()


def test_vit_end_to_end_matches_direct_cka_on_taps(tmp_path):
    model = _vit()
    ctx = _ctx(model)
    assert ResidualCKA.applies(ctx)
    r = _run(model, ctx, batches=((0, 16),)).finish()
    with (
        torch.no_grad(),
        Taps(model, ["blocks.1.attn_out", "blocks.1.mlp_branch", "blocks.0.in", "blocks.0.attn_out"]) as cap,
    ):
        model(ctx.data.normalize(ctx.data.analysis.images))
    assert r["skip_branch"][1, 1] == pytest.approx(
        residual_cka(cap["blocks.1.attn_out"], cap["blocks.1.mlp_branch"]), abs=1e-6
    )
    assert r["skip_out"][0, 0] == pytest.approx(residual_cka(cap["blocks.0.in"], cap["blocks.0.attn_out"]), abs=1e-6)
    assert np.isfinite(r["skip_branch"]).all() and (r["skip_out"] > 0.5).all()  # at init the skip dominates the output
    _check_round_trip(r, tmp_path, n_sub=2, n_blocks=2)


def test_resnet_end_to_end(tmp_path):
    model = _resnet()
    ctx = _ctx(model, arch="resnet")
    m = _run(model, ctx)
    assert "layer2.0.shortcut" in m.taps() and "layer1.0.branch" in m.taps()
    r = m.finish()
    assert r["sublayers"] == ["block"] and r["blocks"] == ["layer1.0", "layer2.0", "layer3.0", "layer4.0"]
    assert r["skip_branch"].shape == (1, 4) and r["skip_branch_matrix"].shape == (1, 4, 4)
    assert np.isfinite(r["skip_branch"]).all() and (np.abs(r["skip_branch"]) <= 1 + 1e-9).all()
    # reference: explicit minibatch HSIC on the taps of both minibatches
    names = ["layer3.0.shortcut", "layer3.0.branch", "layer3.0.out"]
    caps = []
    for a, b in ((0, 8), (8, 16)):
        with torch.no_grad(), Taps(model, names) as cap:
            model(ctx.data.normalize(ctx.data.analysis.images[a:b]))
        caps.append(cap.captures)
    assert r["skip_branch"][0, 2] == pytest.approx(
        _minibatch_cka([c[names[0]] for c in caps], [c[names[1]] for c in caps]), abs=1e-6
    )
    assert r["skip_out"][0, 2] == pytest.approx(
        _minibatch_cka([c[names[0]] for c in caps], [c[names[2]] for c in caps]), abs=1e-6
    )
    _check_round_trip(r, tmp_path, n_sub=1, n_blocks=4)


def _check_round_trip(r, tmp_path, n_sub, n_blocks):
    save_result(r, tmp_path / "residual_cka.npz")
    back = load_result(tmp_path / "residual_cka.npz")
    import matplotlib.pyplot as plt

    for rr in (r, back):
        s = ResidualCKA.scalars(rr)
        assert len(s) == 2 * n_sub * n_blocks
        sub = str(np.asarray(rr["sublayers"]).reshape(-1)[0])
        assert s[f"residual_cka/{sub}/skip_branch/block00"] == pytest.approx(float(r["skip_branch"][0, 0]))
        assert s[f"residual_cka/{sub}/skip_out/block{n_blocks - 1:02d}"] == pytest.approx(float(r["skip_out"][0, -1]))
        summ = ResidualCKA.summary(rr)
        assert len(summ[f"{sub}_skip_branch"]) == n_blocks
        figs = ResidualCKA.figures(rr, step=5)
        assert set(figs) == {"residual_cka/lines"} | {
            f"residual_cka/{x}/matrix" for x in (["attn", "mlp"] if n_sub == 2 else ["block"])
        }
        for f in figs.values():
            plt.close(f)
    assert ResidualCKA.scalars(back) == ResidualCKA.scalars(r)


@pytest.mark.parametrize("rank1_batches", [((8, 16),), ()])
def test_two_processes_give_the_one_process_answer(rank1_batches):
    model = _vit()
    one = _run(model, _ctx(model), batches=((0, 8), *rank1_batches)).finish()
    log = []
    _run(
        model, _ctx(model, accelerator=TwoProcessReplay(1, log)), batches=rank1_batches
    ).finish()  # may hold no minibatch
    two = _run(model, _ctx(model, accelerator=TwoProcessReplay(0, log)), batches=((0, 8),)).finish()
    assert not log
    for k in ("skip_branch", "skip_out", "skip_branch_matrix"):
        np.testing.assert_allclose(two[k], one[k], rtol=1e-12, atol=1e-12)
