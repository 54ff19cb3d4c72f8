"""Lazy (memory-mapped, decoded in workers) train splits: same batches as in memory, seeded random-resized crops,
exact resume."""

from pathlib import Path

import numpy as np
import pytest
import test_train  # registers the test_crash_at callback
import torch
from conftest import read_scalars
from safetensors.torch import load_file

import train.data as tdata
from train.checkpoint import list_checkpoints
from train.data import (
    EpochBatchSampler,
    LazySplit,
    augment,
    batch_collate,
    batch_rrc,
    build_data,
    crop_rng,
    rrc_box,
)
from train.recipe import from_dict, load_recipe
from train.trainer import train


@pytest.fixture(scope="module")
def image_sets(tmp_path_factory):
    """An imagefolder and a parquet data set of RGB images of mixed, non-square sizes (so decoding resizes)."""
    import datasets
    from PIL import Image

    root = tmp_path_factory.mktemp("imgs")
    rng = np.random.default_rng(0)
    sizes = [(20, 24), (40, 30), (16, 16), (33, 21)]
    for split, n in (("train", 12), ("test", 5)):
        for cls in ("cat", "dog", "eel"):
            d = root / "folder" / split / cls
            d.mkdir(parents=True)
            for i in range(n):
                h, w = sizes[i % len(sizes)]
                Image.fromarray(rng.integers(0, 255, (h, w, 3), dtype=np.uint8)).save(d / f"{i}.png")
    pq = root / "pq"
    pq.mkdir()
    feats = datasets.Features({"image": datasets.Image(), "label": datasets.ClassLabel(names=["a", "b", "c"])})
    for split, n in (("train", 36), ("test", 15)):
        ims = [Image.fromarray(rng.integers(0, 255, sizes[i % 4] + (3,), dtype=np.uint8)) for i in range(n)]
        datasets.Dataset.from_dict({"image": ims, "label": [i % 3 for i in range(n)]}, features=feats).to_parquet(
            str(pq / f"{split}.parquet")
        )
    return {"imagefolder": root / "folder", "parquet": pq}


def _recipe(source, path, **data):
    d = {
        "source": source,
        "path": str(path),
        "img_size": 16,
        "in_chans": 3,
        "probe_train_size": 6,
        "analysis_size": 6,
        "augment": {"shift": 0, "hflip": False},
        **data,
    }
    return from_dict({"data": d, "model": {"patch_size": 4}})


@pytest.mark.parametrize("source", ["imagefolder", "parquet"])
def test_lazy_and_in_memory_give_identical_batches(image_sets, source):
    a = build_data(_recipe(source, image_sets[source], in_memory="true", train_size=30, eval_size=9))
    b = build_data(_recipe(source, image_sets[source], in_memory="false", train_size=30, eval_size=9))
    assert not a.train.lazy and isinstance(b.train, LazySplit) and b.meta["train_in_memory"] is False
    assert len(a.train) == len(b.train) == 30 and torch.equal(a.train.labels, b.train.labels)
    for role in ("eval", "probe_train", "analysis"):  # always in memory, the same either way
        sa, sb = getattr(a, role), getattr(b, role)
        assert not sb.lazy and torch.equal(sa.images, sb.images) and torch.equal(sa.labels, sb.labels), role
    assert torch.equal(a.mean, b.mean) and torch.equal(a.std, b.std)
    sampler = EpochBatchSampler(len(a.train), 8, seed=0)
    for epoch in (0, 1):
        sampler.set_epoch(epoch)
        la = torch.utils.data.DataLoader(a.train.dataset(), batch_sampler=sampler, collate_fn=batch_collate)
        lb = torch.utils.data.DataLoader(
            b.train.dataset(), batch_sampler=sampler, collate_fn=batch_collate, num_workers=2
        )
        batches = list(zip(la, lb))
        assert len(batches) == 3
        for (xa, ya), (xb, yb) in batches:
            assert xb.dtype == torch.uint8 and xb.shape == (8, 3, 16, 16)
            assert torch.equal(xa, xb) and torch.equal(ya, yb)


def test_auto_is_lazy_only_above_the_memory_limit(image_sets, monkeypatch):
    r = _recipe("parquet", image_sets["parquet"])
    assert not build_data(r).train.lazy
    monkeypatch.setattr(tdata, "MAX_IN_MEMORY_BYTES", 36 * 3 * 16 * 16 - 1)  # the train split no longer fits
    assert build_data(r).train.lazy


def test_lazy_crops_are_seeded_by_seed_epoch_index(image_sets):
    r = _recipe(
        "imagefolder",
        image_sets["imagefolder"],
        in_memory="false",
        augment={"random_resized_crop": True, "shift": 0, "hflip": False},
    )
    split = build_data(r).train
    plain = build_data(_recipe("imagefolder", image_sets["imagefolder"], in_memory="false")).train
    idx = [5, 0, 17, 33, 2]
    e0 = split.take(idx, epoch=0)
    assert torch.equal(e0, split.take(idx, epoch=0))  # deterministic
    assert torch.equal(e0[1:3], split.take([0, 17], epoch=0))  # per image: independent of the batch it is in
    assert not torch.equal(e0, split.take(idx, epoch=1))  # a new crop each epoch
    assert not torch.equal(e0, plain.take(idx))  # it does crop
    # through workers, in any order, with the epoch riding on the sampler's batches
    sampler = EpochBatchSampler(len(split), 6, seed=3)
    sampler.set_epoch(2)
    loader = torch.utils.data.DataLoader(
        split.dataset(), batch_sampler=sampler, collate_fn=batch_collate, num_workers=2
    )
    for b, (x, _) in zip(list(sampler), loader):
        assert b.epoch == 2 and torch.equal(x, split.take(b, epoch=2))
    other_seed = LazySplit(split.ds, split.rows, split.labels, split.cfg, crop_seed=split.crop_seed + 1)
    assert not torch.equal(e0, other_seed.take(idx, epoch=0))


def test_rrc_box_is_inside_the_image_with_allowed_area_and_ratio():
    for i in range(300):
        w, h = (300, 200) if i % 2 else (50, 400)
        x0, y0, x1, y1 = rrc_box(w, h, crop_rng(0, 0, i))
        assert 0 <= x0 < x1 <= w and 0 <= y0 < y1 <= h
        cw, ch = x1 - x0, y1 - y0  # tries that fit, and the central fallback crop, both keep these bounds
        assert 0.08 * w * h * 0.9 <= cw * ch <= w * h and 0.72 <= cw / ch <= 1.39


def test_batch_rrc_on_the_device_is_seeded_and_keeps_shape():
    x = torch.randint(0, 256, (16, 3, 32, 32), dtype=torch.uint8)
    torch.manual_seed(1)
    a = batch_rrc(x)
    torch.manual_seed(1)
    b = augment(x, shift=0, hflip=False, rrc=True)
    assert a.dtype == torch.uint8 and a.shape == x.shape and torch.equal(a, b)
    assert not torch.equal(a, x)
    flat = torch.full((4, 1, 8, 8), 77, dtype=torch.uint8)
    assert torch.equal(batch_rrc(flat), flat)  # a constant image stays constant


def _final_weights(run: Path) -> dict:
    return load_file(str(list_checkpoints(run / "checkpoints")[-1] / "model.safetensors"))


def test_resume_is_exact_with_a_lazy_cropped_split(write_recipe):
    """N steps + crash + resume + N steps == 2N steps with the train split decoded and cropped in a worker."""
    kw = dict(
        data={
            "in_memory": "false",
            "num_workers": 1,
            "train_size": 144,
            "augment": {"random_resized_crop": True, "shift": 0, "hflip": True},
        },
        model={"dropout": 0.1},
        train={"steps": 4, "checkpoint_every": 2, "eval_every": 0, "batch_size": 48},
    )  # 3 batches/epoch: crosses one
    # sample_images decodes (and crops) lazy images itself; as any callback, it must not disturb the run
    straight = train(
        load_recipe(write_recipe("lazy_s", callbacks=[{"name": "sample_images", "every": 2, "n": 8}], **kw)),
        progress=False,
    )
    p = write_recipe("lazy_r", callbacks=[{"name": "test_crash_at", "step": 2}], **kw)
    with pytest.raises(test_train.Crash):
        train(load_recipe(p), progress=False)
    resumed = train(load_recipe(p), resume=True, progress=False)
    a, b = read_scalars(Path(straight["run_dir"])), read_scalars(Path(resumed["run_dir"]))
    assert [s for s, _ in b["train/loss"]] == list(range(1, 5)) and a["train/loss"] == b["train/loss"]
    wa, wb = _final_weights(Path(straight["run_dir"])), _final_weights(Path(resumed["run_dir"]))
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    ea = EventAccumulator(straight["run_dir"], size_guidance={"images": 0})
    ea.Reload()
    assert [e.step for e in ea.Images("data/train_samples")] == [0, 2, 4]
