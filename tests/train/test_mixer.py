"""MLP-Mixer (Raghu et al. 2021 App. H) as a third architecture: built from a recipe, tapped like a ViT
(token mixing in the place of attention), trained through the trainer."""

from pathlib import Path

import pytest
import torch
from conftest import ROOT
from safetensors.torch import load_file

from analysis.engine.taps import (
    TapError,
    Taps,
    arch_of,
    available_taps,
    block_names,
    grid_of,
    is_vit,
    num_prefix_tokens,
)
from analysis.families.timm_mixer import MIXER_KINDS
from train.checkpoint import list_checkpoints
from train.models import build_model
from train.recipe import RecipeError, from_dict, load_recipe

SMALL = {
    "model": {"arch": "mixer", "depth": 3, "embed_dim": 32, "mlp_ratio": 2.0, "mixer_token_ratio": 0.5, "head": "gap"}
}


def _mixer(**model):
    torch.manual_seed(0)
    return build_model(from_dict({"model": {**SMALL["model"], **model}}), 10).eval()


def _perturb_norms(m):
    """LayerNorms start at weight 1 / bias 0; make them non-trivial so a mix-up of norm1/norm2 shows."""
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for mod in m.modules():
            if isinstance(mod, torch.nn.LayerNorm):
                mod.weight.copy_(1 + 0.3 * torch.randn(mod.weight.shape, generator=g))
                mod.bias.copy_(0.1 * torch.randn(mod.bias.shape, generator=g))


def test_build_from_the_shipped_recipe():
    from timm.models.mlp_mixer import MixerBlock, MlpMixer

    r = load_recipe(ROOT / "recipes/mixer.yaml")
    assert (r.model.arch, r.model.patch_size, r.model.depth, r.model.embed_dim) == ("mixer", 4, 6, 96)
    m = build_model(r, 10)
    assert isinstance(m, MlpMixer) and len(m.blocks) == 6 and all(isinstance(b, MixerBlock) for b in m.blocks)
    assert m.global_pool == "avg" and m.head.out_features == 10 and m.stem.proj.in_channels == 1
    b = m.blocks[0]  # token MLP: 49 -> 0.5 * 96 -> 49; channel MLP: 96 -> 4.0 * 96 -> 96
    assert (b.mlp_tokens.fc1.in_features, b.mlp_tokens.fc1.out_features) == (49, 48)
    assert (b.mlp_channels.fc1.in_features, b.mlp_channels.fc1.out_features) == (96, 384)
    assert arch_of(m) == "mixer" and not is_vit(m) and num_prefix_tokens(m) == 0 and grid_of(m) == (7, 7)
    assert block_names(m) == [f"blocks.{i}" for i in range(6)]
    assert m(torch.randn(2, 1, 28, 28)).shape == (2, 10)


def test_arch_of_tells_the_three_apart():
    vit = build_model(from_dict({"model": {"depth": 1, "embed_dim": 32, "num_heads": 2}}), 10)
    gap = build_model(from_dict({"model": {"depth": 1, "embed_dim": 32, "num_heads": 2, "head": "gap"}}), 10)
    res = build_model(
        from_dict({"model": {"arch": "resnet", "resnet_layers": [1, 1, 1, 1], "resnet_channels": [8, 8, 8, 8]}}), 10
    )
    assert [arch_of(x) for x in (vit, gap, res, _mixer())] == ["vit", "vit", "resnet", "mixer"]
    assert is_vit(vit) and not is_vit(res) and not is_vit(_mixer())
    assert num_prefix_tokens(vit) == 1 and num_prefix_tokens(gap) == 0 and num_prefix_tokens(res) == 0
    assert grid_of(vit) == (7, 7)
    with pytest.raises(TapError, match="no token grid"):
        grid_of(res)
    with pytest.raises(TapError, match="not a Linear"):
        arch_of(torch.nn.Linear(2, 2))


@pytest.mark.parametrize(
    "model, words",
    [
        ({"patch_size": 5}, ["model.patch_size", "divide", "data.img_size"]),
        ({"mixer_token_ratio": 0}, ["model.mixer_token_ratio", "out of range"]),
        ({"mixer_token_ratio": 0.01}, ["model.mixer_token_ratio", "hidden unit"]),
        ({"arch": "mlp"}, ["model.arch", "'mixer'"]),
    ],
)
def test_recipe_errors_are_one_sentence(model, words):
    with pytest.raises(RecipeError) as e:
        from_dict({"model": {**SMALL["model"], **model}})
    msg = str(e.value)
    assert all(w in msg for w in words) and msg.count(". ") == 0 and msg.endswith("."), msg


def test_vit_only_interventions_are_refused_for_a_mixer():
    for iv in ({"no_skip": {"blocks": [0]}}, {"head_mask": {"block": 0, "heads": [0]}}):
        with pytest.raises(RecipeError, match="ViTs only"):
            from_dict({**SMALL, "interventions": iv})
    r = from_dict(SMALL)
    r.interventions.no_skip = type("NS", (), {"blocks": [0]})()  # past validation: models.py still refuses
    with pytest.raises(ValueError, match="ViTs only"):
        build_model(r, 10)


def test_taps_fire_with_token_shapes_and_decompose_the_block():
    m = _mixer()
    _perturb_norms(m)
    names = available_taps(m)
    assert len(names) == 3 * len(MIXER_KINDS) and not any(n.endswith("attn_probs") for n in names)
    x = torch.randn(2, 1, 28, 28)
    with torch.no_grad():
        ref = m(x)
        with Taps(m, names) as cap:
            out = m(x)
    for i in range(3):
        p = f"blocks.{i}."
        z, a, mid, h, f, o = (cap[p + k] for k in ("in", "attn_branch", "attn_out", "mlp_hidden", "mlp_branch", "out"))
        assert z.shape == a.shape == mid.shape == f.shape == o.shape == (2, 49, 32) and h.shape == (2, 49, 64)
        # the drop_path module serves both branches: a hook that kept its last call would give a == f here
        assert torch.allclose(z + a, mid, atol=1e-6) and torch.allclose(mid + f, o, atol=1e-6)
        assert not torch.allclose(a, f, atol=1e-3)
        # an independent reference: the block's maths written out, with the transposes explicit
        blk = m.blocks[i]
        with torch.no_grad():
            a_ref = blk.mlp_tokens(blk.norm1(z).permute(0, 2, 1)).permute(0, 2, 1)
            h_ref = torch.nn.functional.gelu(blk.mlp_channels.fc1(blk.norm2(z + a_ref)))
            f_ref = blk.mlp_channels.fc2(h_ref)
        assert (
            torch.allclose(a, a_ref, atol=1e-6)
            and torch.allclose(h, h_ref, atol=1e-6)
            and torch.allclose(f, f_ref, atol=1e-6)
        )
        if i:
            assert torch.equal(z, cap[f"blocks.{i - 1}.out"])
    assert torch.equal(out, ref)  # tapping changes nothing, and every hook is gone afterwards
    assert all(len(mod._forward_hooks) == 0 and len(mod._forward_pre_hooks) == 0 for mod in m.modules())


def test_one_branch_tap_alone_and_accumulated_forwards():
    m = _mixer()
    x1, x2 = torch.randn(2, 1, 28, 28), torch.randn(3, 1, 28, 28)
    with torch.no_grad(), Taps(m, ["blocks.1.mlp_branch", "blocks.1.attn_out", "blocks.1.out"], accumulate=True) as cap:
        m(x1)
        m(x2)
    assert [t.shape[0] for t in cap["blocks.1.mlp_branch"]] == [2, 3]  # the call counter restarts at every forward
    for mid, f, o in zip(cap["blocks.1.attn_out"], cap["blocks.1.mlp_branch"], cap["blocks.1.out"]):
        assert torch.allclose(mid + f, o, atol=1e-6)
    with torch.no_grad(), Taps(m, ["blocks.2.attn_branch", "blocks.2.in", "blocks.2.attn_out"]) as cap:
        m(x1)
    assert torch.allclose(cap["blocks.2.in"] + cap["blocks.2.attn_branch"], cap["blocks.2.attn_out"], atol=1e-6)


def test_branch_taps_are_what_is_added_under_drop_path_in_training():
    m = _mixer(drop_path=0.5).train()  # DropPath (not Identity) zeroes/rescales whole samples, differently per call
    torch.manual_seed(3)
    with torch.no_grad(), Taps(m, available_taps(m)) as cap:
        m(torch.randn(8, 1, 28, 28))
    dropped = 0
    for i in range(3):
        p = f"blocks.{i}."
        assert torch.allclose(cap[p + "in"] + cap[p + "attn_branch"], cap[p + "attn_out"], atol=1e-6)
        assert torch.allclose(cap[p + "attn_out"] + cap[p + "mlp_branch"], cap[p + "out"], atol=1e-6)
        dropped += int((cap[p + "attn_branch"].flatten(1).abs().sum(1) == 0).sum())
    assert dropped > 0  # drop_path was live


def test_zeroed_branches_make_the_block_the_identity(monkeypatch):
    m = _mixer()
    x = torch.randn(2, 1, 28, 28)
    blk = m.blocks[1]
    monkeypatch.setattr(blk.mlp_tokens, "forward", lambda t: torch.zeros_like(t))
    with torch.no_grad(), Taps(m, ["blocks.1.in", "blocks.1.attn_out", "blocks.1.mlp_branch", "blocks.1.out"]) as cap:
        m(x)
    assert torch.equal(cap["blocks.1.attn_out"], cap["blocks.1.in"])  # no token mixing: the stream is unchanged
    assert not torch.equal(cap["blocks.1.out"], cap["blocks.1.in"])
    monkeypatch.setattr(blk.mlp_channels, "forward", lambda t: torch.zeros_like(t))
    with (
        torch.no_grad(),
        Taps(m, ["blocks.1.in", "blocks.1.attn_branch", "blocks.1.mlp_branch", "blocks.1.out"]) as cap,
    ):
        m(x)
    assert torch.equal(cap["blocks.1.out"], cap["blocks.1.in"])
    assert not cap["blocks.1.attn_branch"].any() and not cap["blocks.1.mlp_branch"].any()


def test_two_training_steps_through_the_trainer(write_recipe):
    from train.trainer import train

    p = write_recipe(
        "tiny_mixer",
        model={"arch": "mixer", "head": "gap", "mlp_ratio": 2.0, "mixer_token_ratio": 0.5},
        train={"steps": 2, "eval_every": 2, "checkpoint_every": 2, "mixed_precision": "no"},
        data={"eval_size": 64},
        callbacks=[],
    )
    r = load_recipe(p)
    assert r.model.arch == "mixer" and r.callbacks == []
    out = train(r, progress=False)
    assert out["step"] == 2 and 0.0 <= out["top1"] <= 1.0
    ckpts = list_checkpoints(Path(out["run_dir"]) / "checkpoints")
    assert [c.name for c in ckpts] == ["step_0000002"]
    weights = load_file(str(ckpts[-1] / "model.safetensors"))
    assert "blocks.1.mlp_tokens.fc1.weight" in weights and weights["stem.proj.weight"].shape == (32, 1, 4, 4)
