"""Data: sources, tensors, seeded class-balanced nested subsets, augmentation, clear errors."""

import functools
import gzip
import http.server
import operator
import os
import shutil
import socket
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import ROOT

from train.data import (
    FASHION_MNIST_DIR,
    DataError,
    EpochBatchSampler,
    augment,
    balanced_indices,
    build_data,
    load_fashion_mnist,
    load_source,
    to_tensors,
)
from train.recipe import DataConfig, from_dict


def _raw(kind):
    with gzip.open(f"{FASHION_MNIST_DIR}/{kind}-images-idx3-ubyte.gz") as f:
        x = np.frombuffer(f.read(), np.uint8, offset=16).reshape(-1, 28, 28)
    with gzip.open(f"{FASHION_MNIST_DIR}/{kind}-labels-idx1-ubyte.gz") as f:
        y = np.frombuffer(f.read(), np.uint8, offset=8)
    return x, y


def test_fashion_mnist_is_a_datasets_dataset_matching_the_idx_files():
    import datasets

    dsd = load_fashion_mnist()
    assert isinstance(dsd["train"], datasets.Dataset) and len(dsd["train"]) == 60000 and len(dsd["test"]) == 10000
    x, y = to_tensors(dsd["test"], DataConfig())
    rx, ry = _raw("t10k")
    assert x.dtype == torch.uint8 and x.shape == (10000, 1, 28, 28)
    assert np.array_equal(x[:, 0].numpy(), rx) and np.array_equal(y.numpy(), ry)


def test_missing_fashion_mnist_is_one_sentence(tmp_path):
    with pytest.raises(DataError, match="apt-get install -y dataset-fashion-mnist"):
        load_fashion_mnist(str(tmp_path))


def test_hub_offline_is_one_sentence(monkeypatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(DataError) as e:
        load_source(DataConfig(source="hub", name="cifar10"))
    msg = str(e.value)
    assert "'cifar10' is not in the local Hugging Face cache" in msg and "HF_HUB_OFFLINE" in msg and "\n" not in msg
    assert "data.source: disk" in msg and "save_to_disk" in msg


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# in a fresh process (the offline switches are read at import): seconds load_source took, then its error or the splits
HUB_UNREACHABLE = """
import time
from train.recipe import DataConfig
from train.sources import DataError, load_source
t0 = time.perf_counter()
try:
    dsd = load_source(DataConfig(source="hub", name="cifar10"))
    out = f"{sorted(dsd)} {len(dsd['train'])}"
except DataError as e:
    out = str(e)
print(f"{time.perf_counter() - t0:.2f}")
print(out)
"""


def _run_unreachable(script: str, hf_home: Path):
    """``script`` in a fresh process with no offline switch, HF_HOME ``hf_home`` and the Hub unreachable (HF_ENDPOINT
    on a
    closed local port: the connection error of a machine without network, on any machine)."""
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE")
    }
    env.update(HF_HOME=str(hf_home), HF_ENDPOINT=f"http://127.0.0.1:{_closed_port()}", PYTHONPATH=str(ROOT))
    return subprocess.run(
        [sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120
    )


def test_hub_unreachable_without_offline_mode_is_fast_and_one_sentence(tmp_path):
    """No HF_HUB_OFFLINE, the Hub unreachable and an empty cache: one sentence within seconds, where huggingface_hub's
    retries (1 + 2 + 4 + 8 + 8 s) took about 25 s."""
    r = _run_unreachable(HUB_UNREACHABLE, tmp_path / "hf")
    lines = r.stdout.strip().splitlines()
    assert r.returncode == 0 and len(lines) == 2, r.stdout + r.stderr[-3000:]
    seconds, msg = float(lines[0]), lines[1]
    assert seconds < 5, f"{seconds} s"
    assert (
        "could not reach the Hugging Face Hub (this machine seems offline)" in msg
        and "'cifar10' is not in the local" in msg
    ), msg
    assert "save_to_disk" in msg and "HF_HUB_OFFLINE=1" in msg


def test_hub_unreachable_reads_a_cached_data_set_at_once(tmp_path):
    """No HF_HUB_OFFLINE, the Hub unreachable, the data set in the cache: loaded from the cache within seconds, where
    datasets fell back to it only after huggingface_hub's retries (about 25 s). The cache entry is one datasets wrote
    (a local parquet data set) moved to where a hub data set named 'cifar10' is cached."""
    import datasets

    cache = tmp_path / "hf/datasets"
    d = datasets.Dataset.from_dict({"image": [[[0] * 4] * 4] * 6, "label": [0, 1] * 3})
    files = {}
    for split in ("train", "test"):
        files[split] = str(tmp_path / f"{split}.parquet")
        d.to_parquet(files[split])
    datasets.load_dataset("parquet", data_files=files, cache_dir=str(cache))
    (config,) = (cache / "parquet").iterdir()
    shutil.move(
        config, cache / "cifar10" / "default"
    )  # datasets' layout: <name>/<config>/<version>/<hash>/<name>-<split>.arrow
    for f in (cache / "cifar10").rglob("parquet-*.arrow"):
        f.rename(f.with_name(f.name.replace("parquet-", "cifar10-", 1)))
    r = _run_unreachable(HUB_UNREACHABLE, tmp_path / "hf")
    lines = r.stdout.strip().splitlines()
    assert r.returncode == 0 and len(lines) == 2, r.stdout + r.stderr[-3000:]
    assert float(lines[0]) < 5 and lines[1] == "['test', 'train'] 6", lines


def test_hub_probe(monkeypatch):
    """The probe: reachable when anything answers HTTP at the endpoint (any status), unreachable on a refused
    connection."""
    import huggingface_hub.constants

    from train.sources import hub_reachable

    monkeypatch.setattr(
        huggingface_hub.constants, "HF_HUB_OFFLINE", False
    )  # the tests run offline; this talks to 127.0.0.1
    server = http.server.HTTPServer(("127.0.0.1", 0), http.server.BaseHTTPRequestHandler)  # answers 501 to HEAD
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        assert hub_reachable(f"http://127.0.0.1:{server.server_address[1]}")
    finally:
        server.shutdown()
        server.server_close()
    assert not hub_reachable(f"http://127.0.0.1:{_closed_port()}")


def test_balanced_indices_balance_determinism_nesting_seeds():
    labels = np.repeat(np.arange(10), 600)[np.random.default_rng(0).permutation(6000)]
    a = balanced_indices(labels, 180, seed=1)
    assert np.array_equal(a, balanced_indices(labels, 180, seed=1))
    assert np.bincount(labels[a], minlength=10).tolist() == [18] * 10
    odd = balanced_indices(labels, 183, seed=1)
    counts = np.bincount(labels[odd], minlength=10)
    assert counts.max() - counts.min() <= 1 and counts.sum() == 183
    small, mid, big = (balanced_indices(labels, n, seed=1) for n in (180, 600, 1800))
    assert set(small) <= set(mid) <= set(big)
    assert set(a) <= set(odd)
    assert not np.array_equal(a, balanced_indices(labels, 180, seed=2))
    assert len(balanced_indices(labels, 10**6, seed=0)) == 6000


def test_balanced_indices_with_a_small_class():
    labels = np.array([0] * 5 + [1] * 100 + [2] * 100)
    idx = balanced_indices(labels, 60, seed=0)
    assert np.bincount(labels[idx]).tolist() == [5, 28, 27] or np.bincount(labels[idx]).tolist() == [5, 27, 28]


def test_build_data_roles_are_fixed_and_seeded():
    r = from_dict({"data": {"train_size": 600, "eval_size": 300, "probe_train_size": 100, "analysis_size": 50}})
    a, b = build_data(r), build_data(r)
    assert len(a.train) == 600 and len(a.eval) == 300 and len(a.probe_train) == 100 and len(a.analysis) == 50
    assert torch.equal(a.analysis.images, b.analysis.images) and torch.equal(a.probe_train.labels, b.probe_train.labels)
    assert a.num_classes == 10 and a.class_names[0] == "T-shirt/top"
    assert a.analysis.labels.bincount().tolist() == [5] * 10
    assert 0.25 < float(a.mean) < 0.32 and 0.3 < float(a.std) < 0.4


def test_imagefolder_and_parquet_sources(tmp_path):
    from PIL import Image

    rng = np.random.default_rng(0)
    for split in ("train", "test"):
        for cls in ("cat", "dog"):
            d = tmp_path / "folder" / split / cls
            d.mkdir(parents=True)
            for i in range(6):
                Image.fromarray(rng.integers(0, 255, (20, 20, 3), dtype=np.uint8)).save(d / f"{i}.png")
    cfg = from_dict(
        {
            "data": {
                "source": "imagefolder",
                "path": str(tmp_path / "folder"),
                "img_size": 16,
                "in_chans": 3,
                "probe_train_size": 4,
                "analysis_size": 4,
            },
            "model": {"patch_size": 4},
        }
    )
    bundle = build_data(cfg)
    assert bundle.train.images.shape == (12, 3, 16, 16) and bundle.num_classes == 2

    import datasets

    pq = tmp_path / "pq"
    pq.mkdir()
    for split, n in (("train", 20), ("test", 10)):
        ds = datasets.Dataset.from_dict(
            {
                "img": [Image.fromarray(rng.integers(0, 255, (8, 8), dtype=np.uint8)) for _ in range(n)],
                "label": [i % 2 for i in range(n)],
            },
            features=datasets.Features({"img": datasets.Image(), "label": datasets.ClassLabel(names=["a", "b"])}),
        )
        ds.to_parquet(str(pq / f"{split}.parquet"))
    cfg = from_dict(
        {
            "data": {"source": "parquet", "path": str(pq), "img_size": 8, "probe_train_size": 4, "analysis_size": 4},
            "model": {"patch_size": 4},
        }
    )
    bundle = build_data(cfg)
    assert bundle.train.images.shape == (20, 1, 8, 8) and bundle.eval.labels.tolist() == [i % 2 for i in range(10)]

    # the same data saved with save_to_disk (an offline cluster's copy of a hub data set)
    datasets.load_dataset(
        "parquet", data_files={"train": str(pq / "train.parquet"), "test": str(pq / "test.parquet")}
    ).save_to_disk(str(tmp_path / "saved"))
    cfg = from_dict(
        {
            "data": {
                "source": "disk",
                "path": str(tmp_path / "saved"),
                "img_size": 8,
                "probe_train_size": 4,
                "analysis_size": 4,
            },
            "model": {"patch_size": 4},
        }
    )
    saved = build_data(cfg)
    assert torch.equal(saved.train.images, bundle.train.images) and torch.equal(saved.eval.labels, bundle.eval.labels)
    with pytest.raises(DataError, match="not a data set saved with DatasetDict.save_to_disk"):
        build_data(from_dict({"data": {"source": "disk", "path": str(pq)}}))


def test_missing_split_is_one_sentence():
    r = from_dict({"data": {"eval_split": "validation"}})
    with pytest.raises(DataError, match="data.eval_split 'validation' is not a split"):
        build_data(r)


def test_augment_shifts_and_flips_within_bounds():
    x = torch.zeros(64, 1, 8, 8, dtype=torch.uint8)
    x[:, :, 3, 2] = 255  # one bright pixel
    torch.manual_seed(0)
    y = augment(x, shift=2, hflip=False)
    pos = [divmod(int(i), 8) for i in y.view(64, -1).argmax(1)]
    assert all(abs(r - 3) <= 2 and abs(c - 2) <= 2 for r, c in pos)
    assert len(set(pos)) > 5 and int(y.sum()) == 64 * 255  # no pixel lost: it stays inside the image
    torch.manual_seed(0)
    z = augment(x, shift=0, hflip=True)
    cols = {int(i) % 8 for i in z.view(64, -1).argmax(1)}
    assert cols == {2, 5}


def test_epoch_sampler_shards_without_overlap_and_resumes_mid_epoch():
    a, b = EpochBatchSampler(100, 10, seed=3, rank=0, world=2), EpochBatchSampler(100, 10, seed=3, rank=1, world=2)
    ea, eb = list(a), list(b)
    assert len(ea) == 5 and not set(functools.reduce(operator.iadd, ea, [])) & set(
        functools.reduce(operator.iadd, eb, [])
    )
    a.set_epoch(1)
    e1 = list(a)
    assert e1 != ea
    a.set_epoch(1, start_batch=3)
    assert list(a) == e1[3:]


@pytest.mark.parametrize(
    "key,size,split",
    [
        ("train_size", 60001, "train"),
        ("probe_train_size", 70000, "train"),
        ("eval_size", 10001, "eval"),
        ("analysis_size", 20000, "eval"),
    ],
)
def test_sizes_above_a_split_are_refused_not_clamped(key, size, split):
    with pytest.raises(DataError) as e:
        build_data(from_dict({"data": {key: size}}))
    msg = str(e.value)
    assert f"data.{key} is {size}" in msg and f"{split} split holds" in msg and "\n" not in msg


def test_size_above_a_split_is_one_sentence_exit_2_before_the_run_folder(tmp_path, capsys):
    from train.cli import main

    root = tmp_path / "runs"
    assert (
        main(
            [
                str(Path(__file__).resolve().parents[2] / "recipes/tiny.yaml"),
                "--set",
                f"run.root={root}",
                "data.eval_size=20000",
            ]
        )
        == 2
    )
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: data.eval_size is 20000") and "\n" not in err and not root.exists()


def test_channel_stats_in_chunks_equal_the_one_shot_float64_statistics(monkeypatch):
    """The normalisation statistics, computed a few images at a time (no float64 copy of all 10,000), are those of
    the whole batch in float64 at once, to float32 rounding."""
    from train import data as D

    monkeypatch.setattr(D, "STATS_CHUNK", 3)  # 10 images: 4 chunks, the last one short
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, 256, (10, 3, 9, 9), dtype=torch.uint8, generator=g)
    x[:, 2] //= 8  # channels of different spread
    mean, std = D.channel_stats(x)
    ref = x.double() / 255.0
    assert mean.dtype == std.dtype == torch.float32
    torch.testing.assert_close(mean, ref.mean(dim=(0, 2, 3)).float(), rtol=1e-6, atol=0)
    torch.testing.assert_close(std, ref.std(dim=(0, 2, 3)).float(), rtol=1e-6, atol=0)
    assert D.channel_stats(torch.full((4, 1, 5, 5), 7, dtype=torch.uint8))[1].item() == pytest.approx(1e-3)  # floor


def test_colour_from_grey_images_is_refused_for_training(tmp_path):
    """data.in_chans 3 on greyscale images: refused when the trainer asks (colour_from_grey=False), for array data
    (Fashion-MNIST) and for image files alike; colour images with in_chans 3 and greyscale ones with 1 are taken, and
    offline analysis (the default) still shows a colour model greyscale images in 3 channels."""
    import datasets
    from PIL import Image

    from train.decode import image_channels
    from train.recipe import from_dict

    rng = np.random.default_rng(0)
    sizes = {"probe_train_size": 4, "analysis_size": 4, "img_size": 8}
    for mode, shape, channels in (("L", (8, 8), 1), ("RGB", (8, 8, 3), 3)):
        pq = tmp_path / mode
        pq.mkdir()
        for split, n in (("train", 12), ("test", 6)):
            ims = [Image.fromarray(rng.integers(0, 255, shape, dtype=np.uint8), mode) for _ in range(n)]
            feats = datasets.Features({"image": datasets.Image(), "label": datasets.ClassLabel(names=["a", "b"])})
            ds = datasets.Dataset.from_dict({"image": ims, "label": [i % 2 for i in range(n)]}, features=feats)
            ds.to_parquet(str(pq / f"{split}.parquet"))
        recipe = from_dict({"data": {"source": "parquet", "path": str(pq), "in_chans": 3, **sizes}})
        assert image_channels(load_source(recipe.data)["train"], recipe.data) == channels
        if channels == 1:
            with pytest.raises(DataError, match="data.in_chans is 3 but the images of this data set are greyscale"):
                build_data(recipe, colour_from_grey=False)
        else:
            assert build_data(recipe, colour_from_grey=False).train.images.shape == (12, 3, 8, 8)
    fm = from_dict(
        {"data": {"in_chans": 3, "train_size": 20, "eval_size": 10, "probe_train_size": 4, "analysis_size": 4}}
    )
    with pytest.raises(DataError, match="greyscale"):
        build_data(fm, colour_from_grey=False)
    assert build_data(fm).analysis.images.shape[1] == 3
    grey = from_dict({"data": {"train_size": 20, "eval_size": 10, "probe_train_size": 4, "analysis_size": 4}})
    assert build_data(grey, colour_from_grey=False).train.images.shape[1] == 1
