"""Register tokens (timm reg_tokens, Darcet et al. 2024) as prefix tokens: the recipe key, its hash, and every
measure that pools, maps or reads the class token, on a CLS + 4 register ViT and a GAP ViT with 4 registers."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import ROOT, class_split
from timm.models.vision_transformer import VisionTransformer

from analysis.engine.measure import Context
from analysis.estimators.features import has_class_token, pools_for
from analysis.frontends.api import activations, analyze
from analysis.measures.cka import CKAMeasure
from train.models import build_model
from train.recipe import RecipeError, load_recipe

GRID, PATCH = (7, 7), 4


def reg_vit(class_token: bool = True, reg_tokens: int = 4):
    torch.manual_seed(0)
    kw = {} if class_token else {"class_token": False, "global_pool": "avg"}
    return VisionTransformer(
        img_size=28,
        patch_size=PATCH,
        in_chans=1,
        num_classes=10,
        embed_dim=32,
        depth=2,
        num_heads=2,
        mlp_ratio=2.0,
        reg_tokens=reg_tokens,
        **kw,
    ).eval()


# ---------------------------------------------------------------- the recipe key


def test_existing_recipe_hashes_are_unchanged():
    """Recipes without reg_tokens keep the hashes their runs were trained under (computed before the key existed),
    so those runs still resume; a register model hashes differently."""
    before = {  # Recipe.hash(), resume_hash() of the shipped recipes before model.reg_tokens was added
        "default": ("82a396f18b71fd7d", "75d884e4c3044ba4"),
        "vit_gap": ("a0412a46ec200ce6", "f66709d4c854c2a5"),
        "dino": ("fe6ecdfaebe9c66c", "069e839405de07c9"),
    }
    for name, (h, rh) in before.items():
        r = load_recipe(ROOT / f"recipes/{name}.yaml")
        assert (r.hash(), r.resume_hash()) == (h, rh), name
        assert load_recipe(ROOT / f"recipes/{name}.yaml", ["model.reg_tokens=0"]).hash() == h
    assert load_recipe(ROOT / "recipes/default.yaml", ["model.reg_tokens=4"]).hash() != before["default"][0]


def test_reg_tokens_range_and_model():
    with pytest.raises(RecipeError, match="reg_tokens"):
        load_recipe(ROOT / "recipes/default.yaml", ["model.reg_tokens=-1"])
    with pytest.raises(RecipeError, match="reg_tokens"):
        load_recipe(ROOT / "recipes/default.yaml", ["model.reg_tokens=65"])
    for head, prefix in (("cls", 5), ("gap", 4)):
        r = load_recipe(ROOT / "recipes/default.yaml", ["model.reg_tokens=4", f"model.head={head}", "model.depth=1"])
        m = build_model(r, 10)
        assert m.num_prefix_tokens == prefix and m.num_reg_tokens == 4
        assert m(torch.zeros(2, 1, 28, 28)).shape == (2, 10)


# ---------------------------------------------------------------- measures treat registers as prefix tokens


def _data(n=40):
    return class_split(n, 0), class_split(60, 1)


@pytest.mark.parametrize("class_token", [True, False])
def test_pooling_and_class_token(class_token):
    m = reg_vit(class_token)
    p = m.num_prefix_tokens
    assert has_class_token(m, p) is class_token
    ctx = Context(model=m, data=None, device=torch.device("cpu"), prefix=p, grid=GRID, patch_size=PATCH)
    assert pools_for(ctx) == (["cls", "mean_spatial"] if class_token else ["mean_spatial"])
    problem = CKAMeasure.model_problem(ctx, CKAMeasure.Options(repr="cls"))
    assert (problem is None) is class_token


@pytest.mark.parametrize("class_token", [True, False])
def test_measures_drop_registers(class_token):
    """Measures on a register ViT against references computed here from its attention probabilities and tokens,
    with the registers (and the class token) dropped as prefix tokens."""
    m = reg_vit(class_token)
    p = m.num_prefix_tokens
    test, probe = _data()
    res = analyze(
        m,
        test.images,
        test.labels,
        probe_images=probe.images,
        probe_labels=probe.labels,
        measures=["attention_distance", "norm_ratio", "fewshot_probe", "cls_attention", "token_norms"],
        options={"fewshot_probe": {"shots": 2}},
        figures=False,
    )["results"]
    acts = activations(m, test.images, taps=["blocks.*.attn_probs", "blocks.*.out"])
    # attention distance over spatial queries and keys (pixels between patch centres)
    rr, cc = torch.meshgrid(torch.arange(GRID[0]), torch.arange(GRID[1]), indexing="ij")
    pos = torch.stack([rr.flatten(), cc.flatten()], 1).double()
    dist = torch.cdist(pos, pos) * PATCH
    for i in range(2):
        a = acts[f"blocks.{i}.attn_probs"].double()[:, :, p:, p:]
        a = a / a.sum(-1, keepdim=True)
        ref = (a * dist).sum(-1).mean((0, 2))
        torch.testing.assert_close(torch.as_tensor(res["attention_distance"]["pixels"][i]), ref)
    assert int(res["norm_ratio"]["num_prefix_tokens"]) == p
    assert ("cls" in {str(s) for s in res["fewshot_probe"]["pools"]}) is class_token
    assert ("cls_attention" in res) is class_token
    if class_token:
        a = acts["blocks.1.attn_probs"].double()[:, :, 0]
        torch.testing.assert_close(torch.as_tensor(res["cls_attention"]["prefix_mass"][1]), a[..., :p].sum(-1).mean(0))
        assert res["cls_attention"]["maps"].shape[-2:] == GRID
    tn = res["token_norms"]
    assert int(tn["num_registers"]) == 4 and int(tn["num_prefix_tokens"]) == p
    assert tn["outlier_map"].shape[-2:] == GRID
    norms = acts["blocks.1.out"].norm(dim=-1).double()
    torch.testing.assert_close(
        torch.as_tensor(tn["quantiles"][1][2]), norms[:, p:].flatten().quantile(0.5), rtol=1e-5, atol=1e-5
    )
    reg = slice(int(class_token), p)
    a = acts["blocks.1.attn_probs"].double().mean(1)
    torch.testing.assert_close(torch.as_tensor(tn["attn_patch_on_registers"][1]), a[:, p:, reg].sum(-1).mean(1).mean(0))
    assert math.isnan(tn["attn_cls_on_registers"][1]) is (not class_token)


@pytest.mark.parametrize("name", ["registers", "registers_gpu"])
def test_register_studies_load(name):
    from analysis.studies.study import load_study

    s = load_study(ROOT / "recipes" / "studies" / f"{name}.yaml")
    assert s.every_checkpoint == ["token_norms"] and set(s.configs()) == {"vit_reg0", "vit_reg4"}
    for run in s.runs.values():
        r = load_recipe(run.recipe, run.overrides)
        assert r.model.reg_tokens == (4 if run.config == "vit_reg4" else 0)
        assert r.train.keep_last * r.train.checkpoint_every >= r.train.steps  # every checkpoint stays to be measured
