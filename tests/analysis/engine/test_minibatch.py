"""The analysis minibatch of a model from elsewhere: sized from what its taps keep per image and the memory
available (a real ViT-S/14 at 256 images per minibatch was OOM-killed at 13.6 GB), said in one line; --batch-size
still wins; running out of memory anyway is one sentence naming a smaller --batch-size, exit 2."""

from __future__ import annotations

import re

import pytest
import timm
import torch
from safetensors.torch import save_file
from test_images_cli import _folder

from analysis.engine import suite as S
from analysis.frontends import runner as RN
from analysis.frontends.cli import main

pytestmark = pytest.mark.usefixtures("one_thread")
GiB = 2**30


def vit_tap_bytes(tokens: int, width: int, heads: int, depth: int, mlp_hidden: int) -> int:
    """Per image and block: the attention map (heads x tokens x tokens), nine tokens x width taps (in, norm1, heads,
    proj_in, attn_branch, attn_out, norm2, mlp_branch, out) and the MLP hidden activations; float32."""
    return 4 * depth * (heads * tokens * tokens + 9 * tokens * width + tokens * mlp_hidden)


def test_what_the_taps_keep_per_image_is_counted_from_the_model():
    m = timm.create_model("vit_tiny_patch16_224", img_size=48, num_classes=0).eval()  # 3 x 3 patches + CLS
    assert S.tap_bytes_per_image(m, torch.zeros(2, 3, 48, 48)) == vit_tap_bytes(10, 192, 3, 12, 768) == 1_212_480
    m = timm.create_model("vit_small_patch16_224", img_size=64, num_classes=0, depth=2).eval()  # 16 + 1 tokens
    assert S.tap_bytes_per_image(m, torch.zeros(1, 3, 64, 64)) == vit_tap_bytes(17, 384, 6, 2, 1536)


def test_the_minibatch_chooser_gives_known_answers():
    dinov2_s = vit_tap_bytes(257, 384, 6, 12, 1536)  # the README's real ViT-S/14 at 224: 76.9 MiB per image
    assert dinov2_s == 80_603_424
    # 304 bundled views: the largest power of two whose taps fit in half the memory available
    assert S.choose_minibatch(dinov2_s, 16 * GiB, 304) == 64  # 5.2 GB of taps, 8 GiB allowed
    assert S.choose_minibatch(dinov2_s, 4 * GiB, 304) == 16
    assert S.choose_minibatch(dinov2_s, 64 * GiB, 304) == 256  # at most the suite's default
    assert S.choose_minibatch(dinov2_s, 64 * GiB, 200) == 200  # all of them in one minibatch when they fit
    assert S.choose_minibatch(dinov2_s, GiB // 4, 304) == 4  # never below minibatch CKA's least
    # no last minibatch of 1-3 images: 258 = 256 + 2 -> 254 + 4
    assert S.choose_minibatch(1, 64 * GiB, 258) == 254
    assert S.batch_problem(258, 254) is None
    assert S.choose_minibatch(dinov2_s, 16 * GiB, 304, share=0.25) == 32


def test_out_of_memory_is_recognised():
    assert S.out_of_memory(MemoryError())
    assert S.out_of_memory(RuntimeError("[enforce fail at alloc_cpu.cpp:117] DefaultCPUAllocator: can't allocate"))
    assert S.out_of_memory(RuntimeError("DefaultCPUAllocator: not enough memory: you tried to allocate 4 GB."))
    assert not S.out_of_memory(RuntimeError("mat1 and mat2 shapes cannot be multiplied"))
    assert not S.out_of_memory(ValueError("not enough memory"))


@pytest.fixture
def tiny(tmp_path):
    m = timm.create_model("vit_tiny_patch16_224", img_size=48, num_classes=0, pretrained=False)
    f = tmp_path / "tiny.safetensors"
    save_file({k: v.contiguous() for k, v in m.state_dict().items()}, str(f))
    imgs = _folder(tmp_path / "imgs", classes=("",), n=12)
    return [
        "--model",
        "timm:vit_tiny_patch16_224",
        "--weights",
        str(f),
        "--images",
        str(imgs),
        "--measures",
        "attention_distance",
        "--no-progress",
        "--no-tensorboard",
    ]


def test_a_model_from_elsewhere_gets_a_minibatch_sized_to_it(tiny, tmp_path, monkeypatch, capsys):
    # half of the memory available is the budget; attention distances take a minibatch in chunks, so all 12 images
    # make one minibatch
    monkeypatch.setattr(S, "available_memory", lambda device=None: 2 * 8 * 1_212_480 + 1)
    assert main([*tiny, "--out", str(tmp_path / "a")]) == 0
    err = capsys.readouterr().err
    assert "minibatch 12 (its taps forwarded in chunks, within a memory budget of 9 MiB: --batch-size N" in err, err
    # minibatch CKA keeps its taps of a whole minibatch: a budget that holds those of 8 images beside a chunk of the
    # others gives 12 images in minibatches of 8 (a last one of 4)
    assert main([*tiny, "--out", str(tmp_path / "c"), "--measures", "cka", "--max-memory", "4.5MiB"]) == 0
    err = capsys.readouterr().err
    assert re.search(r"minibatch 8 \(its minibatch-CKA taps \d+ MiB, within a memory budget of 4 MiB", err), err
    assert main([*tiny, "--out", str(tmp_path / "b"), "--batch-size", "4"]) == 0  # given: it wins, nothing said
    assert "minibatch" not in capsys.readouterr().err


@pytest.mark.parametrize(
    "error",
    [RuntimeError("DefaultCPUAllocator: not enough memory: you tried to allocate 9663676416 bytes."), MemoryError()],
)
def test_running_out_of_memory_is_one_sentence_naming_a_smaller_batch_size(tiny, tmp_path, monkeypatch, capsys, error):
    def no_memory(*a, **k):
        raise error

    monkeypatch.setattr(RN, "analyze_run", no_memory)
    assert main([*tiny, "--out", str(tmp_path / "a"), "--batch-size", "12"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (
        "error: not enough memory to analyse in minibatches of 12: pass a smaller --batch-size, e.g. --batch-size 6."
    )
    monkeypatch.setattr(RN, "analyze_run", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("a bug")))
    with pytest.raises(RuntimeError, match="a bug"):  # anything else is not dressed up as a user error
        main([*tiny, "--out", str(tmp_path / "b"), "--batch-size", "12"])
