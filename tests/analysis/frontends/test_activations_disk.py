"""activations(..., out=DIR): sharded files listed in an index with the hash of the model and images; an interrupted
extraction continues without recomputing its finished shards, another model's or images' folder is refused untouched,
and the folder reads back a minibatch at a time (analysis/results/activation_store.py)."""

import json

import numpy as np
import pytest
import torch
from conftest import class_split, tiny_vit

from analysis.frontends import api
from analysis.frontends.api import activations
from analysis.results import activation_store as AS

pytestmark = pytest.mark.usefixtures("one_thread")

TAPS = ["blocks.*.attn_probs", "blocks.1.out"]
KW = dict(taps=TAPS, batch_size=5, shard_images=10)  # 25 images: shards [0, 10), [10, 20), [20, 25)


def _listing(folder):
    """Every file under ``folder`` with its size, inode and modification time: what 'untouched' means."""
    return {
        str(p.relative_to(folder)): (p.stat().st_size, p.stat().st_ino, p.stat().st_mtime_ns)
        for p in sorted(folder.rglob("*"))
    }


def _interrupt_after(monkeypatch, k):
    """Make the extraction raise KeyboardInterrupt (as Ctrl-C does) when it asks for its (k+1)-th minibatch."""
    stream = api._stream

    def interrupted(*args, **kw):
        for i, item in enumerate(stream(*args, **kw)):
            if i == k:
                raise KeyboardInterrupt
            yield item

    monkeypatch.setattr(api, "_stream", interrupted)


def test_an_interrupted_extraction_continues_where_it_stopped(tmp_path, monkeypatch):
    model, a = tiny_vit(), class_split(25, 0)
    whole = activations(model, a.images, a.labels, out=tmp_path / "whole", **KW)
    assert [s["stop"] for s in whole.index["shards"]] == [10, 20, 25] and whole.complete

    with monkeypatch.context() as m:
        _interrupt_after(m, 3)  # minibatches 0, 5 make shard 0; minibatch 10 is half of shard 1 when Ctrl-C comes
        with pytest.raises(KeyboardInterrupt):
            activations(model, a.images, a.labels, out=tmp_path / "acts", **KW)
    folder = tmp_path / "acts"
    assert sorted(p.name for p in folder.iterdir()) == ["index.json", "shard_00000"]  # no half shard, no lock
    part = AS.open_activations(folder)
    assert (part.done, part.n_images, part.complete) == (10, 25, False)
    assert repr(part).endswith("10 of 25 images)") and part["blocks.1.out"].shape == (10, 50, 32)
    # a killed writer's leftovers (a temporary shard, a shard the index never listed) are cleared on the rerun
    (folder / ".shard_00001.999.tmp").mkdir()
    (folder / "shard_00001").mkdir()
    (folder / "shard_00001" / "labels.npy").write_bytes(b"torn")
    first = _listing(folder / "shard_00000")

    seen = []  # the images of each forward
    hook = model.register_forward_pre_hook(lambda mod, args: seen.append(len(args[0])))
    acts = activations(model, a.images, a.labels, out=folder, **KW)
    hook.remove()
    assert seen == [5, 5, 5]  # images 10 to 24: shard 0 was not recomputed
    assert _listing(folder / "shard_00000") == first
    assert sorted(p.name for p in folder.iterdir()) == ["index.json", "shard_00000", "shard_00001", "shard_00002"]
    assert acts.complete and acts.index["shards"] == whole.index["shards"]
    for k in [*acts.taps, "labels"]:  # the same minibatches on the CPU: equal up to float32 rounding (bit-equal here)
        np.testing.assert_allclose(acts[k], whole[k], rtol=1e-6, atol=1e-7)
    # a finished folder asked again computes nothing
    seen.clear()
    hook = model.register_forward_pre_hook(lambda mod, args: seen.append(len(args[0])))
    activations(model, a.images, a.labels, out=folder, **KW)
    hook.remove()
    assert seen == []


def test_another_model_images_taps_dtype_or_batch_size_is_refused_untouched(tmp_path):
    model, a = tiny_vit(), class_split(25, 0)
    folder = tmp_path / "acts"
    activations(model, a.images, a.labels, out=folder, **KW)
    before = _listing(folder)
    changed = tiny_vit()
    with torch.no_grad():
        changed.blocks[0].attn.qkv.weight[0, 0] += 1e-3  # one weight
    other = a.images.clone()
    other[3, 0, 0, 0] ^= 1  # one pixel
    for kw, says in (
        ({"model": changed}, r"were made by a different model \(weights sha256 [0-9a-f]{12}\.\.\. there, "),
        ({"images": other}, "were made on different images, labels or normalisation"),
        (
            {"images": a.images[:20], "labels": a.labels[:20]},
            r"on different images or labels \(25 images there, 20 now",
        ),
        ({"labels": a.labels.roll(1)}, "on different images, labels or normalisation"),
        ({"normalize": lambda x: x.float() / 127.5 - 1}, "on different images, labels or normalisation"),
        ({"taps": "blocks.0.out"}, r"of other taps \(blocks.0.attn_probs, .* there; blocks.0.out now\)"),
        ({"dtype": torch.float16}, "in float32, not float16"),
        ({"batch_size": 2, "shard_images": None}, "with batch_size=5, not 2"),
        ({"shard_images": 20}, "with shard_images=10, not 20"),
    ):
        args = {"model": model, "images": a.images, "labels": a.labels, **KW, **kw}
        with pytest.raises(ValueError, match=says) as e:
            activations(args.pop("model"), args.pop("images"), out=folder, **args)
        assert str(e.value).endswith(
            ": pass the arguments they were made with to continue, or choose a new folder (or delete this one)."
        )
        assert _listing(folder) == before
    with pytest.raises(ValueError, match=r"by a different model .* and in float32, not float16: pass"):
        activations(changed, a.images, a.labels, out=folder, **{**KW, "dtype": torch.float16})
    with pytest.raises(ValueError, match="numpy files cannot hold bfloat16: give dtype=torch.float16"):
        activations(model, a.images, out=tmp_path / "bf16", dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"shard_images must be a positive multiple of batch_size \(5\), not 12"):
        activations(model, a.images, out=tmp_path / "odd", taps="blocks.0.out", batch_size=5, shard_images=12)
    with AS.writer_lock(folder), pytest.raises(ValueError, match="another process is writing the activations in"):
        activations(model, a.images, a.labels, out=folder, **KW)
    assert _listing(folder) == before


def test_the_folder_streams_back_in_order_and_in_float16(tmp_path):
    model, a = tiny_vit(), class_split(25, 0)
    mem = activations(model, a.images, a.labels, taps=TAPS, batch_size=5)
    acts = activations(model, a.images, a.labels, out=tmp_path / "acts", dtype=torch.float16, **KW)
    index = json.loads((tmp_path / "acts" / "index.json").read_text())
    assert index["format"] == 1 and index["dtype"] == "float16" and index["taps_requested"] == TAPS
    assert index["taps"]["blocks.1.out"] == {"file": "blocks.1.out.npy", "shape": [50, 32], "dtype": "float16"}
    assert list(acts) == list(mem) and acts.taps == list(mem)[:-1]
    got = list(acts.iter(batch_size=7))  # minibatches across shard boundaries, in image order
    assert [s for s, _ in got] == [0, 7, 14, 21] and [len(b["labels"]) for _, b in got] == [7, 7, 7, 4]
    for k in mem:
        rows = np.concatenate([b[k] for _, b in got])
        assert rows.dtype == (np.int64 if k == "labels" else np.float16)
        np.testing.assert_allclose(rows, mem[k].numpy(), rtol=2e-3, atol=2e-3)  # float16: 11 bits of mantissa
        np.testing.assert_array_equal(acts[k], rows)
    shards = list(acts.iter(taps="blocks.1.out"))  # a shard at a time, as read-only memory maps
    assert [(s, len(b["blocks.1.out"])) for s, b in shards] == [(0, 10), (10, 10), (20, 5)]
    assert all(isinstance(b["blocks.1.out"], np.memmap) and not b["blocks.1.out"].flags.writeable for _, b in shards)
    with pytest.raises(KeyError):
        acts["blocks.9.out"]
    with pytest.raises(ValueError, match="holds no activations"):
        AS.open_activations(tmp_path)


def test_open_activations_is_public():
    import analysis
    import vitlab

    assert vitlab.open_activations is analysis.open_activations is AS.open_activations


def test_an_extraction_stopped_inside_its_first_shard_starts_again(tmp_path, monkeypatch):
    model, a = tiny_vit(), class_split(25, 0)
    with monkeypatch.context() as m:
        _interrupt_after(m, 1)  # one minibatch of the first shard's two
        with pytest.raises(KeyboardInterrupt):
            activations(model, a.images, a.labels, out=tmp_path / "acts", **KW)
    assert [p.name for p in (tmp_path / "acts").iterdir()] == ["index.json"]  # the taps' shapes, no shard yet
    part = AS.open_activations(tmp_path / "acts")
    assert (part.done, part.n_images) == (0, 25) and part["blocks.1.out"].shape == (0, 50, 32)
    assert list(part.iter(batch_size=4)) == []
    acts = activations(model, a.images, a.labels, out=tmp_path / "acts", **KW)
    assert acts.complete and [s["start"] for s in acts.index["shards"]] == [0, 10, 20]


def test_a_killed_writer_leaves_whole_shards_that_a_rerun_completes(tmp_path):
    """SIGKILL in the middle of the second shard (no finally runs): the lock file and the half shard stay behind; the
    rerun takes the lock (flock died with the process), clears them and completes the folder."""
    import os
    import subprocess
    import sys

    from conftest import ROOT

    script = f"""
import os, signal, sys
sys.path[:0] = [{str(ROOT)!r}, {str(ROOT / "tests")!r}]
import torch
torch.set_num_threads(1)
from conftest import class_split, tiny_vit
from analysis.frontends import api
stream = api._stream
def killed(*args, **kw):
    for i, item in enumerate(stream(*args, **kw)):
        if i == 3:
            os.kill(os.getpid(), signal.SIGKILL)
        yield item
api._stream = killed
a = class_split(25, 0)
api.activations(tiny_vit(), a.images, a.labels, out={str(tmp_path / "acts")!r}, **{KW!r})
"""
    proc = subprocess.run([sys.executable, "-c", script], env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=120)
    assert proc.returncode == -9
    left = sorted(p.name for p in (tmp_path / "acts").iterdir())
    assert left[0] == ".lock" and left[1].startswith(".shard_00001.") and left[1].endswith(".tmp")
    assert left[2:] == ["index.json", "shard_00000"]
    assert AS.open_activations(tmp_path / "acts").done == 10
    model, a = tiny_vit(), class_split(25, 0)
    acts = activations(model, a.images, a.labels, out=tmp_path / "acts", **KW)
    assert acts.complete and sorted(p.name for p in (tmp_path / "acts").iterdir()) == [
        "index.json",
        "shard_00000",
        "shard_00001",
        "shard_00002",
    ]
    whole = activations(model, a.images, a.labels, taps=TAPS, batch_size=5)
    np.testing.assert_allclose(acts["blocks.1.out"], whole["blocks.1.out"].numpy(), rtol=1e-6, atol=1e-7)


def test_a_folder_of_the_layout_before_shards_reads_back_and_is_not_continued(tmp_path):
    x, y = np.arange(24, dtype=np.float32).reshape(4, 2, 3), np.arange(4)
    np.save(tmp_path / "blocks.0.out.npy", x)
    np.save(tmp_path / "labels.npy", y)
    arrays = {"blocks.0.out": [4, 2, 3], "labels": [4]}
    index = {"n_images": 4, "batch_size": 2, "arrays": {k: {"file": f"{k}.npy", "shape": v} for k, v in arrays.items()}}
    (tmp_path / "index.json").write_text(json.dumps(index))
    old = AS.open_activations(tmp_path)
    assert old.complete and old.taps == ["blocks.0.out"]
    np.testing.assert_array_equal(old["blocks.0.out"], x)
    assert [(s, b["labels"].tolist()) for s, b in old.iter(batch_size=3)] == [(0, [0, 1, 2]), (3, [3])]
    with pytest.raises(ValueError, match="were made by an older vitlab, which recorded no hash of their model"):
        activations(tiny_vit(), class_split(4, 0).images, taps="blocks.0.out", batch_size=2, out=tmp_path)
