"""open_clip's image tower (analysis/families/openclip.py): the same weights in open_clip and in timm's CLIP ViT give
the same taps and the same results of every measure that runs on both; the attention taps recomputed from the
weights equal torch's own need_weights path; sequence-first towers and open_clip's custom blocks; the loader's
sentences and a weights file it loads."""

from __future__ import annotations

import functools
import json
import sys

import numpy as np
import pytest
import torch
import torch.nn as nn
from conftest import ROOT

open_clip = pytest.importorskip("open_clip")

from open_clip.transformer import Transformer, VisionTransformer  # noqa: E402

from analysis.engine.measure import registry  # noqa: E402
from analysis.engine.taps import Taps, available_taps  # noqa: E402
from analysis.families import family_of  # noqa: E402
from analysis.families.base import TRANSFORMER_KINDS, TapError  # noqa: E402
from analysis.families.openclip import OPENAI_MEAN, OPENAI_STD, OpenClipError, OpenClipViT, load  # noqa: E402
from analysis.frontends.api import activations, analyze  # noqa: E402

TINY = {"image_size": 32, "patch_size": 8, "width": 64, "layers": 3, "heads": 4, "mlp_ratio": 4, "output_dim": 32}
N, PROBE, CLASSES = 24, 40, 4
RTOL = 1e-5


def _tower(**extra) -> VisionTransformer:
    torch.manual_seed(0)
    m = VisionTransformer(**{**TINY, **extra}).eval()
    with torch.no_grad():  # every weight and bias away from its initial value (open_clip zeroes in_proj_bias)
        for p in m.parameters():
            p.add_(0.1 * torch.randn_like(p))
    return m


def _timm_twin(oc: VisionTransformer, act_layer=nn.GELU, init_values=None):
    """timm's CLIP ViT (pre-norm, LayerNorm eps 1e-5, class token pooled, GELU as open_clip's default tower, QuickGELU
    for OpenAI's) holding ``oc``'s weights through timm's own converter (and LayerScale's gammas, which it leaves
    as ls_1 / ls_2)."""
    from timm.models.vision_transformer import VisionTransformer as TimmViT
    from timm.models.vision_transformer import _convert_openai_clip

    tm = TimmViT(
        img_size=TINY["image_size"],
        patch_size=TINY["patch_size"],
        embed_dim=TINY["width"],
        depth=TINY["layers"],
        num_heads=TINY["heads"],
        mlp_ratio=TINY["mlp_ratio"],
        num_classes=TINY["output_dim"],
        pre_norm=True,
        class_token=True,
        global_pool="token",
        norm_layer=functools.partial(nn.LayerNorm, eps=1e-5),
        act_layer=act_layer,
        init_values=init_values,
    ).eval()
    sd = _convert_openai_clip({f"visual.{k}": v for k, v in oc.state_dict().items()}, tm)
    sd = {k.replace(".ls_1.", ".ls1.").replace(".ls_2.", ".ls2."): v for k, v in sd.items()}
    tm.load_state_dict(sd, strict=True)
    return tm


@pytest.fixture(scope="module")
def pair():
    oc = _tower()
    return oc, _timm_twin(oc)


@pytest.fixture(scope="module")
def images():
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, 256, (N, 3, 32, 32), generator=g, dtype=torch.uint8)
    px = torch.randint(0, 256, (PROBE, 3, 32, 32), generator=g, dtype=torch.uint8)
    return x, torch.arange(N) % CLASSES, px, torch.arange(PROBE) % CLASSES


def rel(a, b) -> float:
    """max |a - b| relative to the largest |b| (the scale of the array), over the positions where b is not NaN."""
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    ok = ~np.isnan(b)
    if not ok.any():
        return 0.0
    return float(np.abs(a[ok] - b[ok]).max() / max(np.abs(b[ok]).max(), 1e-30))


def test_family_of_picks_open_clip_and_its_tokens(pair):
    oc, tm = pair
    fam = family_of(oc)
    assert isinstance(fam, OpenClipViT) and fam.arch == "vit" and family_of(tm).name == "timm ViT"
    assert (
        fam.blocks(oc) == ["blocks.0", "blocks.1", "blocks.2"]
        and fam.block(oc, "blocks.2") is oc.transformer.resblocks[2]
    )
    assert (fam.prefix(oc), fam.has_class_token(oc), fam.grid(oc), fam.patch_size(oc), fam.image_size(oc)) == (
        1,
        True,
        (4, 4),
        8,
        32,
    )
    cfg = fam.preprocessing(oc)
    assert cfg["mean"] == OPENAI_MEAN and cfg["std"] == OPENAI_STD and cfg["interpolation"] == "bicubic"
    assert cfg["input_size"] == (3, 32, 32) and cfg["crop_pct"] == 1.0
    assert available_taps(oc) == available_taps(tm)
    assert "ablation" in fam.needs_internals


def test_whole_clip_model_is_refused_with_the_tower_to_pass():
    from open_clip.model import CLIP, CLIPTextCfg, CLIPVisionCfg

    clip = CLIP(
        32,
        CLIPVisionCfg(layers=1, width=32, head_width=16, patch_size=8, image_size=32),
        CLIPTextCfg(context_length=8, vocab_size=64, width=32, heads=2, layers=1),
    )
    with pytest.raises(TapError, match=r"pass its image tower, model\.visual\."):
        family_of(clip)
    assert isinstance(family_of(clip.visual), OpenClipViT)


def test_every_tap_agrees_with_timm(pair, images):
    oc, tm = pair
    x = images[0]
    a, b = activations(oc, x, taps="*"), activations(tm, x, taps="*")
    assert set(a) == set(b) and len(a) == 1 + 3 * len(TRANSFORMER_KINDS)
    worst = {k: rel(a[k], b[k]) for k in b if k != "labels"}
    assert all(a[k].shape == b[k].shape for k in worst)
    assert max(worst.values()) <= RTOL, sorted(worst.items(), key=lambda kv: -kv[1])[:3]


def test_quick_gelu_and_layer_scale_towers_agree_with_timm(images):
    """OpenAI's towers use QuickGELU; open_clip's ls_init_value adds LayerScale (attn_branch, mlp_branch after it)."""
    from open_clip.transformer import QuickGELU

    oc = _tower(act_layer=QuickGELU, ls_init_value=0.5)
    tm = _timm_twin(oc, act_layer="quick_gelu", init_values=0.5)
    x = images[0][:8]
    a, b = activations(oc, x, taps="*"), activations(tm, x, taps="*")
    worst = {k: rel(a[k], b[k]) for k in b if k != "labels"}
    assert max(worst.values()) <= RTOL, sorted(worst.items(), key=lambda kv: -kv[1])[:3]


def test_analyze_agrees_with_timm_on_every_measure(pair, images):
    oc, tm = pair
    x, y, px, py = images
    shared = sorted(set(registry()) - OpenClipViT.needs_internals)
    kw = {
        "probe_images": px,
        "probe_labels": py,
        "batch_size": 8,
        "figures": False,
        "options": {"fewshot_probe": {"shots": 5}, "token_probes": {"shots": 5}, "erf": {"images": 2, "batch": 1}},
    }
    ra = analyze(oc, x, y, measures="all", **kw)["results"]
    rb = analyze(tm, x, y, measures=shared, **kw)["results"]
    assert sorted(ra) == sorted(rb) == shared  # every measure but those that rewrite timm's forward runs
    for m in shared:
        assert ra[m].keys() == rb[m].keys(), m
        for k, vb in rb[m].items():
            va, vb = np.asarray(ra[m][k]), np.asarray(vb)
            assert va.shape == vb.shape, (m, k)
            if va.dtype.kind in "fc":
                assert np.array_equal(np.isnan(va), np.isnan(vb)), (m, k)
                assert rel(va, vb) <= RTOL, (m, k, rel(va, vb))
            else:
                assert np.array_equal(va, vb), (m, k)


@torch.no_grad()
def test_attention_taps_equal_torch_need_weights(pair):
    oc = pair[0]
    x = torch.randn(3, 3, 32, 32)
    names = available_taps(oc)
    with Taps(oc, names) as cap:
        oc(x)
    for i, blk in enumerate(oc.transformer.resblocks):
        p = f"blocks.{i}."
        h = cap[p + "norm1"]
        out, w = blk.attn(h, h, h, need_weights=True, average_attn_weights=False)
        probs = cap[p + "attn_probs"]
        assert probs.shape == (3, 4, 17, 17)
        assert torch.allclose(probs.sum(-1), torch.ones(3, 4, 17), atol=1e-6)
        assert torch.allclose(probs, w, atol=1e-6, rtol=0)
        assert torch.equal(cap[p + "heads"], cap[p + "proj_in"])
        assert torch.allclose(blk.attn.out_proj(cap[p + "heads"]), out, atol=1e-6, rtol=0)
        assert torch.allclose(cap[p + "attn_branch"], out, atol=1e-6, rtol=0)  # ls_1 is the identity here
        assert torch.allclose(cap[p + "attn_out"], cap[p + "in"] + cap[p + "attn_branch"], atol=1e-6)
        assert torch.allclose(cap[p + "out"], cap[p + "attn_out"] + cap[p + "mlp_branch"], atol=1e-6)


@torch.no_grad()
def test_sequence_first_blocks_give_the_same_taps(pair):
    oc = pair[0]
    seq = _tower()
    seq.transformer = Transformer(TINY["width"], TINY["layers"], TINY["heads"], TINY["mlp_ratio"], batch_first=False)
    seq.load_state_dict(oc.state_dict())
    seq.eval()
    assert not seq.transformer.resblocks[0].attn.batch_first
    x = torch.randn(2, 3, 32, 32)
    names = available_taps(oc)
    with Taps(oc, names) as a:
        oc(x)
    with Taps(seq, names) as b:
        seq(x)
    for n in names:
        assert b[n].shape == a[n].shape and torch.allclose(b[n], a[n], atol=1e-5, rtol=1e-5), n


@torch.no_grad()
def test_custom_blocks_with_qk_norm():
    m = _tower(qk_norm=True)
    attn = m.transformer.resblocks[0].attn
    names = available_taps(m)
    with Taps(m, names) as cap:
        m(torch.randn(2, 3, 32, 32))
    h = cap["blocks.0.norm1"]
    q, k, v = nn.functional.linear(h, attn.in_proj_weight, attn.in_proj_bias).chunk(3, dim=-1)
    q, k, v = (t.view(2, 17, 4, 16).transpose(1, 2) for t in (q, k, v))
    probs = ((attn.ln_q(q) * attn.scale) @ attn.ln_k(k).transpose(-2, -1)).softmax(-1)
    assert torch.allclose(cap["blocks.0.attn_probs"], probs, atol=1e-6)
    heads = (probs @ v).transpose(1, 2).reshape(2, 17, 64)
    assert torch.allclose(cap["blocks.0.heads"], heads, atol=1e-6) and torch.equal(
        cap["blocks.0.heads"], cap["blocks.0.proj_in"]
    )
    assert torch.allclose(attn.out_proj(heads), cap["blocks.0.attn_branch"], atol=1e-6)


def test_finding_a_family_does_not_import_open_clip(pair, monkeypatch):
    """matches() reads the class's module name: with open_clip unimportable every family is still found; and no file
    of analysis/ but the adapter names open_clip's modules, and the adapter imports it in its loader only."""
    import ast

    monkeypatch.setitem(sys.modules, "open_clip", None)  # any import of open_clip would raise ImportError
    oc, tm = pair
    assert [OpenClipViT().matches(m) for m in (oc, tm)] == [True, False]
    assert family_of(tm).name == "timm ViT" and family_of(oc).name == "open_clip ViT"
    adapter = ROOT / "analysis/families/openclip.py"
    top = ast.parse(adapter.read_text()).body
    assert not [n for n in top if isinstance(n, (ast.Import, ast.ImportFrom)) and "open_clip" in ast.dump(n)]
    names = ("import open_clip", "from open_clip", "open_clip.")
    others = [p for p in (ROOT / "analysis").rglob("*.py") if p != adapter and any(n in p.read_text() for n in names)]
    assert not others


# ---------------------------------------------------------------------------------------------------------- loader


@pytest.fixture(scope="module")
def tiny_archs(tmp_path_factory):
    """Two tiny architectures registered with open_clip (its add_model_config), so that the loader builds in ms."""
    d = tmp_path_factory.mktemp("oc_configs")
    text = {"context_length": 8, "vocab_size": 64, "width": 32, "heads": 2, "layers": 1}
    for name, width in (("vitlab-test-tiny", 64), ("vitlab-test-tiny-wide", 96)):
        vision = {"image_size": 32, "patch_size": 8, "width": width, "layers": 2, "head_width": 16}
        (d / f"{name}.json").write_text(json.dumps({"embed_dim": 32, "vision_cfg": vision, "text_cfg": text}))
    timm_tower = {
        "timm_model_name": "vit_tiny_patch16_224",
        "timm_pool": "token",
        "timm_proj": "none",
        "image_size": 224,
    }
    (d / "vitlab-test-timm.json").write_text(json.dumps({"embed_dim": 192, "vision_cfg": timm_tower, "text_cfg": text}))
    resnet = {"image_size": 64, "layers": [1, 1, 1, 1], "width": 16, "head_width": 16}
    (d / "vitlab-test-rn.json").write_text(json.dumps({"embed_dim": 32, "vision_cfg": resnet, "text_cfg": text}))
    open_clip.add_model_config(d)
    return "vitlab-test-tiny", "vitlab-test-tiny-wide", "vitlab-test-timm", "vitlab-test-rn"


def test_loader_unknown_arch_names_close_ones():
    with pytest.raises(OpenClipError, match=r"open_clip has no model 'ViT-B-3' \(did you mean ViT-B-32\?\)") as e:
        load("ViT-B-3")
    assert isinstance(e.value, ValueError) and str(e.value).count(". ") == 0


def test_loader_reads_whole_model_and_tower_weights(tiny_archs, tmp_path):
    from safetensors.torch import save_file

    arch = tiny_archs[0]
    torch.manual_seed(3)
    clip = open_clip.create_model(arch, pretrained=None)
    torch.save(clip.state_dict(), tmp_path / "clip.bin")
    save_file(clip.visual.state_dict(), str(tmp_path / "visual.safetensors"))
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        want = clip.visual.eval()(x)
        for f in ("clip.bin", "visual.safetensors"):
            got = load(arch, tmp_path / f)
            assert not got.training and isinstance(family_of(got), OpenClipViT)
            assert torch.equal(got(x), want), f
    fresh = load(arch)  # no weights: open_clip's random initialisation, with create_model's preprocessing
    assert OpenClipViT().preprocessing(fresh)["mean"] == OPENAI_MEAN and OpenClipViT().grid(fresh) == (4, 4)


def test_loader_without_open_clip_says_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "open_clip", None)  # import open_clip raises ImportError
    with pytest.raises(OpenClipError, match=r"pip install open_clip_torch\.$"):
        load("ViT-B-32")


def test_loader_refuses_weights_that_do_not_fit(tiny_archs, tmp_path):
    small, wide = tiny_archs[:2]
    torch.save(open_clip.create_model(small, pretrained=None).state_dict(), tmp_path / "small.pt")
    with pytest.raises(OpenClipError, match=r"do not fit open_clip's vitlab-test-tiny-wide image tower \(.+ of shape"):
        load(wide, tmp_path / "small.pt")
    torch.save({"visual.conv1.weight": torch.zeros(64, 3, 8, 8)}, tmp_path / "partial.pt")
    with pytest.raises(OpenClipError, match=r"tensors missing"):
        load(small, tmp_path / "partial.pt")
    (tmp_path / "junk.bin").write_bytes(b"not a state dict")
    with pytest.raises(OpenClipError, match=r"cannot read weights file"):
        load(small, tmp_path / "junk.bin")


def test_head_subsets_agree_with_timm(pair, images):
    """head_subset_cka (Raghu Fig. 5, a two-model function, not a registered measure) reads the family, not timm."""
    from timm.models.resnet import BasicBlock, ResNet

    from analysis.measures.head_subsets import head_subset_cka

    torch.manual_seed(1)
    resnet = ResNet(block=BasicBlock, layers=(1, 1, 1, 1), channels=(8, 16, 32, 64), num_classes=4).eval()
    oc, tm = pair
    x = images[0][:16]
    ra, rb = (head_subset_cka(m, resnet, x, lambda b: b.float() / 255, batch_size=8) for m in (oc, tm))
    assert ra.keys() == rb.keys()
    for k, vb in rb.items():
        va, vb = np.asarray(ra[k]), np.asarray(vb)
        assert (rel(va, vb) <= RTOL) if va.dtype.kind in "fc" else np.array_equal(va, vb), k


def test_loader_refuses_a_resnet_tower(tiny_archs):
    with pytest.raises(OpenClipError, match=r"image tower is a ModifiedResNet, which vitlab does not read: it reads"):
        load(tiny_archs[3])


def test_loader_gives_the_timm_model_a_tower_wraps(tiny_archs, tmp_path):
    arch = tiny_archs[2]
    torch.manual_seed(4)
    clip = open_clip.create_model(arch, pretrained=None)
    torch.save(clip.state_dict(), tmp_path / "clip.pt")
    net = load(arch, tmp_path / "clip.pt")
    assert family_of(net).name == "timm ViT" and not net.training
    want = clip.visual.trunk.state_dict()
    assert all(torch.equal(v, want[k]) for k, v in net.state_dict().items())
