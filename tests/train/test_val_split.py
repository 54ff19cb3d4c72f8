"""data.val_size: a held-out validation split carved from train (never test), removed before train_size, data_subset,
probe_train and the statistics see the train split; evaluated at every evaluation, logged as val/*, recorded in every
checkpoint's meta.json (what checkpoint selection reads), and exact under resume."""

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import ROOT, read_scalars
from safetensors.torch import load_file
from test_train import Crash  # noqa: F401  (registers the test_crash_at callback)

from analysis.studies.raghu2021.numbers import select_checkpoint
from train.checkpoint import list_checkpoints
from train.cli import main
from train.data import VAL_SEED, DataError, balanced_indices, build_data
from train.recipe import RecipeError, from_dict, load_recipe
from train.trainer import train

pytestmark = pytest.mark.usefixtures("one_thread")

N_TRAIN, N_TEST = 1000, 200


@pytest.fixture(scope="module")
def id_data(tmp_path_factory):
    """A saved DatasetDict whose 28x28 images carry their row (pixels [0, 0] and [0, 1]) and their split (pixel
    [0, 2]: 1 train, 2 test), labels row mod 10: every role's images say exactly which rows they are."""
    import datasets

    feats = datasets.Features(
        {"image": datasets.Array2D((28, 28), "uint8"), "label": datasets.ClassLabel(num_classes=10)}
    )
    out = {}
    for tag, (split, n) in enumerate((("train", N_TRAIN), ("test", N_TEST)), 1):
        x = np.zeros((n, 28, 28), np.uint8)
        x[:, 0, 0], x[:, 0, 1], x[:, 0, 2] = np.arange(n) // 256, np.arange(n) % 256, tag
        out[split] = datasets.Dataset.from_dict({"image": x, "label": np.arange(n) % 10}, features=feats)
    path = tmp_path_factory.mktemp("ids") / "ds"
    datasets.DatasetDict(out).save_to_disk(str(path))
    return path


def _recipe(path, seed=0, interventions=None, **data):
    d = {"source": "disk", "path": str(path), "probe_train_size": 100, "analysis_size": 20, **data}
    return from_dict({"seed": seed, "data": d, "interventions": interventions or {}})


def _ids(split, tag=1) -> np.ndarray:
    """The rows an in-memory split's images carry (and a check that they come from split ``tag``)."""
    x = split.images[:, 0, 0].long()
    assert (x[:, 2] == tag).all()
    return (x[:, 0] * 256 + x[:, 1]).numpy()


def _train_ids(split) -> np.ndarray:
    if split.lazy:
        ids = split.rows
        assert np.array_equal(_ids(split.in_memory()), ids)  # what the workers decode is those rows
        return ids
    return _ids(split)


@pytest.mark.parametrize("in_memory", ["true", "false"])
def test_val_is_exact_disjoint_balanced_and_the_same_for_every_recipe_seed(id_data, in_memory):
    a = build_data(_recipe(id_data, in_memory=in_memory, val_size=150))
    val, tr, probe, ev = _ids(a.val), _train_ids(a.train), _ids(a.probe_train), _ids(a.eval, tag=2)
    assert a.train.lazy == (in_memory == "false")
    assert len(val) == 150 and len(set(val)) == 150 and len(tr) == N_TRAIN - 150
    assert not set(val) & set(tr) and not set(val) & set(probe)  # nothing trains or probes on val
    assert set(val) | set(tr) == set(range(N_TRAIN))
    assert len(ev) == N_TEST  # eval is the test split (pixel tag 2), val the train split (tag 1): disjoint
    assert torch.equal(a.val.labels, torch.as_tensor(val % 10)) and a.val.labels.bincount().tolist() == [15] * 10
    assert np.array_equal(np.sort(val), balanced_indices(np.arange(N_TRAIN) % 10, 150, VAL_SEED))
    assert a.meta["val_size"] == 150 and "val_hash" in a.meta
    b = build_data(_recipe(id_data, seed=1, in_memory=in_memory, val_size=150))
    assert (
        np.array_equal(_ids(b.val), val) and b.meta["val_hash"] == a.meta["val_hash"]
    )  # a fixed seed, not the recipe's
    # the normalisation statistics come from the rest, not from val
    rest = a.train.in_memory().images if a.train.lazy else a.train.images
    assert torch.allclose(a.mean, (rest.double() / 255).mean(dim=(0, 2, 3)).float())


def test_train_size_and_data_subset_draw_from_what_val_leaves(id_data):
    sub = build_data(_recipe(id_data, val_size=100, interventions={"data_subset": {"fraction": 0.1, "seed": 0}}))
    val, tr = set(_ids(sub.val)), _ids(sub.train)
    assert len(tr) == round(0.1 * (N_TRAIN - 100)) and not val & set(tr)
    assert sub.meta["data_subset"]["of"] == N_TRAIN - 100
    small = build_data(
        _recipe(id_data, val_size=100, train_size=300, interventions={"data_subset": {"count": 50, "seed": 0}})
    )
    assert set(_ids(small.val)) == val and len(_ids(small.train)) == 50 and not val & set(_ids(small.train))
    assert small.meta["data_subset"]["of"] == 300
    # nesting still holds inside the rest: the 3% subset lies inside the 10% one
    s3 = build_data(_recipe(id_data, val_size=100, interventions={"data_subset": {"fraction": 0.03, "seed": 0}}))
    assert set(_ids(s3.train)) <= set(tr)


def test_no_val_size_leaves_every_role_as_it_was(id_data):
    a = build_data(_recipe(id_data))
    assert a.val is None and a.meta["val_size"] == 0 and "val_hash" not in a.meta
    assert np.array_equal(_ids(a.train), np.arange(N_TRAIN))
    assert np.array_equal(np.sort(_ids(a.probe_train)), balanced_indices(np.arange(N_TRAIN) % 10, 100, 1))
    assert (
        load_recipe(ROOT / "recipes/default.yaml", ["data.val_size=0"]).hash()
        == load_recipe(ROOT / "recipes/default.yaml").hash()
    )
    assert (
        load_recipe(ROOT / "recipes/default.yaml", ["data.val_size=5000"]).hash()
        != load_recipe(ROOT / "recipes/default.yaml").hash()
    )


def test_sizes_that_do_not_fit_beside_val_are_refused(id_data):
    with pytest.raises(DataError, match=rf"data.val_size is {N_TRAIN} but the train split holds {N_TRAIN} images"):
        build_data(_recipe(id_data, val_size=N_TRAIN))
    with pytest.raises(
        DataError, match=r"data.train_size is 950 but the train split holds 900 images once data.val_size \(100\)"
    ):
        build_data(_recipe(id_data, val_size=100, train_size=950))
    with pytest.raises(RecipeError, match="data.val_size.*also the eval split"):
        _recipe(id_data, val_size=10, eval_split="train")


@pytest.mark.parametrize(
    "overrides,words",
    [
        (["data.val_size=-1"], ["data.val_size", ">= 0"]),
        (["data.val_size=60000"], ["data.val_size is 60000", "train split holds 60000"]),
        (["data.val_size=500", "data.eval_split=train"], ["data.val_size", "eval split"]),
        (["data.val_size=1.5"], ["data.val_size", "int"]),
    ],
)
def test_bad_val_size_is_one_sentence_exit_2_before_the_run_folder(tmp_path, capsys, overrides, words):
    root = tmp_path / "runs"
    assert main([str(ROOT / "recipes/tiny.yaml"), "--set", f"run.root={root}", *overrides]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err, err
    for w in words:
        assert w in err, (w, err)
    assert not root.exists()


def _metas(run: Path) -> dict:
    return {
        int(c.name.split("_")[1]): json.loads((c / "meta.json").read_text())
        for c in list_checkpoints(run / "checkpoints")
    }


VAL_RUN = {"data": {"val_size": 200}, "train": {"eval_every": 4, "checkpoint_every": 2}}


def test_every_evaluation_measures_val_and_every_checkpoint_records_it(write_recipe):
    out = train(load_recipe(write_recipe("val", **VAL_RUN)), progress=False)
    run = Path(out["run_dir"])
    scalars = read_scalars(run)
    assert [s for s, _ in scalars["val/top1"]] == [s for s, _ in scalars["eval/top1"]] == [4, 8]
    assert [s for s, _ in scalars["val/loss"]] == [4, 8]
    metas = _metas(run)
    assert sorted(metas) == [4, 6, 8]  # keep_last 3 of 2, 4, 6, 8
    for m in metas.values():
        assert m["val"]["n"] == 200 and 0.0 <= m["val"]["top1"] <= 1.0 and m["val"]["loss"] > 0
        assert m["data"]["val_size"] == 200 and m["eval"]["n"] == 250
    assert metas[6]["val"] == metas[4]["val"] and metas[8]["val"]["top1"] == pytest.approx(scalars["val/top1"][-1][1])
    best, why = select_checkpoint(metas)
    assert metas[best]["val"]["top1"] == max(m["val"]["top1"] for m in metas.values()) and "held-out validation" in why
    # without val_size nothing is recorded, so selection cannot use the test split by mistake
    plain = train(load_recipe(write_recipe("plain", train={"steps": 4})), progress=False)
    assert "val" not in _metas(Path(plain["run_dir"]))[4] and "val/top1" not in read_scalars(Path(plain["run_dir"]))


def test_resume_is_exact_with_a_val_split(write_recipe):
    straight = train(load_recipe(write_recipe("s", **VAL_RUN)), progress=False)
    p = write_recipe("r", callbacks=[{"name": "test_crash_at", "step": 4}], **VAL_RUN)
    with pytest.raises(RuntimeError, match="simulated crash"):
        train(load_recipe(p), progress=False)
    resumed = train(load_recipe(p), resume=True, progress=False)
    a, b = read_scalars(Path(straight["run_dir"])), read_scalars(Path(resumed["run_dir"]))
    assert a["train/loss"] == b["train/loss"] and a["val/top1"] == b["val/top1"] and a["val/loss"] == b["val/loss"]
    ma, mb = _metas(Path(straight["run_dir"])), _metas(Path(resumed["run_dir"]))
    assert ma[6]["val"] == mb[6]["val"] == mb[4]["val"]  # step 6 has no evaluation: the resumed run restored step 4's
    assert ma[8]["val"] == mb[8]["val"]
    wa = load_file(str(list_checkpoints(Path(straight["run_dir"]) / "checkpoints")[-1] / "model.safetensors"))
    wb = load_file(str(list_checkpoints(Path(resumed["run_dir"]) / "checkpoints")[-1] / "model.safetensors"))
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
