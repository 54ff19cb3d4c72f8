"""A model of another family from the command line: ``--model hf:FOLDER`` (a transformers ``save_pretrained``
folder) and ``--model open_clip:ARCH --weights FILE``, on an image folder, through the same runner as a timm model;
a hub name offline and the wrong arguments are one sentence and exit 2."""

from __future__ import annotations

import json

import pytest
import torch
from test_family_openclip import tiny_archs  # noqa: F401  (the fixture: tiny open_clip architectures)
from test_images_cli import _folder

from analysis.frontends.cli import main

pytestmark = pytest.mark.usefixtures("one_thread")
transformers = pytest.importorskip("transformers")
open_clip = pytest.importorskip("open_clip")

MEASURES = ["--measures", "attention_distance,norm_ratio,cka", "--no-progress", "--no-tensorboard"]


def _summary(out):
    return json.loads((out / "analysis" / "step_0000000" / "summary.json").read_text())


def test_a_transformers_folder_is_analysed_on_images(tmp_path, capsys):
    cfg = transformers.ViTConfig(
        image_size=32, patch_size=8, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64
    )
    torch.manual_seed(0)
    transformers.ViTModel(cfg, add_pooling_layer=False).save_pretrained(tmp_path / "my-vit")
    imgs = _folder(tmp_path / "imgs", classes=("",), n=6)
    out = tmp_path / "out"
    assert main(["--model", f"hf:{tmp_path / 'my-vit'}", "--images", str(imgs), "--out", str(out), *MEASURES]) == 0
    s = _summary(out)
    assert {"attention_distance", "norm_ratio", "cka"} <= set(s)
    assert s["meta"]["family"] == "transformers ViT" and s["meta"]["num_prefix_tokens"] == 1
    assert "hf:" in (out / "report.md").read_text()
    capsys.readouterr()
    # a second run reuses every result: the folder's weights are the cache key
    assert main(["--model", f"hf:{tmp_path / 'my-vit'}", "--images", str(imgs), "--out", str(out), *MEASURES]) == 0
    assert "0 results computed" in capsys.readouterr().out


def test_an_open_clip_tower_is_analysed_on_images(tiny_archs, tmp_path):  # noqa: F811
    arch = tiny_archs[0]
    torch.manual_seed(1)
    torch.save(open_clip.create_model(arch, pretrained=None).state_dict(), tmp_path / "clip.bin")
    imgs = _folder(tmp_path / "imgs", classes=("",), n=6)
    out = tmp_path / "out"
    args = ["--model", f"open_clip:{arch}", "--weights", str(tmp_path / "clip.bin"), "--images", str(imgs)]
    assert main([*args, "--out", str(out), *MEASURES]) == 0
    assert {"attention_distance", "norm_ratio", "cka"} <= set(_summary(out))


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (["--model", "hf:google/vit-base-patch16-224"], "cannot be fetched from here"),
        (["--model", "hf:x", "--weights", "w.safetensors"], "leave --weights out"),
        (["--model", "open_clip:ViT-B-32"], "needs --weights"),
        (["--model", "open_clip:ViT-B-32", "--weights", "pretrained"], "needs a weights file"),
        (["--model", "keras:vit"], "must look like timm:<architecture>, hf:"),
    ],
)
def test_wrong_model_arguments_are_one_sentence(args, words, tmp_path, capsys):
    assert main([*args, "--images", "photos", "--out", str(tmp_path / "o"), *MEASURES]) == 2
    err = capsys.readouterr().err.strip()
    assert words in err and len(err.splitlines()) == 1, err
