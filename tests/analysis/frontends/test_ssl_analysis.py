"""Every measure on a self-supervised checkpoint (an objective module holding a student and a teacher under key
prefixes, no classifier head), on the student or the teacher (``--part``), kept apart and labelled; the notebook API
and the comparison report on such runs; public DINO / MAE checkpoints by timm name with a local file (no network);
and one sentence + exit 2 for every bad input."""

import json
import shutil
from pathlib import Path

import fake_objective
import numpy as np
import pytest
import torch
import yaml
from conftest import TINY, _merge, read_scalars
from safetensors.torch import load_file, save_file

from analysis.engine.measure import load_result, registry
from analysis.frontends.api import analyze
from analysis.frontends.cli import main
from analysis.results import publish, storage
from analysis.results import runs as RF
from analysis.sources import models as MS
from train.checkpoint import list_checkpoints
from train.recipe import load_recipe
from train.trainer import train

# the slow measures on few images (as in test_distributed_analysis)
ARGS = [
    "--batch-size",
    "32",
    "--no-progress",
    "--opt",
    "fewshot_probe.seeds=[0]",
    "--opt",
    "fewshot_probe.shots=5",
    "--opt",
    "token_probes.shots=5",
    "--opt",
    "token_probes.seeds=[0]",
    "--opt",
    "token_probes.stride=3",
    "--opt",
    "erf.images=2",
    "--opt",
    "erf.batch=1",
]


def _train(root: Path, name: str, **sections) -> Path:
    data = _merge(
        _merge(
            TINY,
            {
                "data": {"probe_train_size": 200},
                "run": {"root": str(root)},
                "train": {"mixed_precision": "no", "eval_every": 0},
            },
        ),
        sections,
    )
    p = root / f"{name}.yaml"
    p.write_text(yaml.safe_dump(data))
    return Path(train(load_recipe(p), progress=False)["run_dir"])


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """A self-supervised run of the test-only objective (4 steps, checkpoints at 2 and 4) and a supervised one."""
    with pytest.MonkeyPatch.context() as mp:
        fake_objective.register(mp)
        root = tmp_path_factory.mktemp("runs")
        yield {
            "ssl": _train(root, "ssl", train={"objective": fake_objective.NAME, "steps": 4, "checkpoint_every": 2}),
            "sup": _train(root, "sup", train={"steps": 2, "checkpoint_every": 0}),
        }


@pytest.fixture
def ssl(runs, tmp_path, monkeypatch):
    """A fresh copy of the self-supervised run (the objective registered for the test)."""
    fake_objective.register(monkeypatch)
    run = tmp_path / "ssl"
    shutil.copytree(runs["ssl"], run)
    return run


def _tree(path: Path) -> dict:
    return {str(p): p.stat().st_mtime_ns for p in Path(path).rglob("*")}


def test_the_student_and_the_teacher_load_by_name_without_a_head(ssl):
    meta = json.loads((ssl / "checkpoints" / "step_0000004" / "meta.json").read_text())
    assert meta["objective"]["parts"] == {"student": "backbone.", "teacher": "teacher_backbone."}
    saved = load_file(str(ssl / "checkpoints" / "step_0000004" / "model.safetensors"))
    run = RF.open_run(ssl)
    data = MS.load_data(run)
    nets = {}
    for part, prefix in (("student", "backbone."), ("teacher", "teacher_backbone.")):
        model = MS.load_model(RF.select_part(run, part), 4, data)
        assert model.num_classes == 0 and not any(k.startswith("head.") for k in model.state_dict())
        want = {k[len(prefix) :]: v for k, v in saved.items() if k.startswith(prefix)}
        assert model.state_dict().keys() == want.keys() and all(
            torch.equal(model.state_dict()[k], want[k]) for k in want
        )
        nets[part] = model
    assert not torch.equal(nets["student"].blocks[0].attn.qkv.weight, nets["teacher"].blocks[0].attn.qkv.weight)
    assert RF.open_run(ssl).part == "student"  # the default


def test_every_measure_on_the_student_and_on_the_teacher_kept_apart_and_labelled(ssl, capsys):
    assert main([str(ssl), "--measures", "all", "--steps", "4", *ARGS]) == 0
    assert main([str(ssl), "--measures", "all", "--steps", "4", "--part", "teacher", *ARGS]) == 0
    out = capsys.readouterr().out
    assert "ssl (teacher): " in out and str(ssl / "analysis" / "teacher") in out
    names = sorted(registry())
    student, teacher = ssl / "analysis" / "step_0000004", ssl / "analysis" / "teacher" / "step_0000004"
    assert sorted(p.stem for p in student.glob("*.npz")) == names == sorted(p.stem for p in teacher.glob("*.npz"))
    assert sorted(p.name for p in (ssl / "figures" / "teacher" / "step_0000004").glob("*.png")) == sorted(
        p.name for p in (ssl / "figures" / "step_0000004").glob("*.png")
    )
    ks, kt = storage.cached_keys(student), storage.cached_keys(teacher)
    assert ks.keys() == kt.keys() and all(ks[n] != kt[n] for n in ks)  # the part is in every cache key
    a, b = load_result(student / "norm_ratio.npz"), load_result(teacher / "norm_ratio.npz")
    assert any(isinstance(v, np.ndarray) and v.dtype.kind == "f" and not np.array_equal(v, b[k]) for k, v in a.items())
    # TensorBoard: the teacher's scalars under analysis/teacher/, the student's where they always were
    tags = read_scalars(ssl)
    assert "analysis/teacher/cka/mean_offdiag" in tags and "analysis/cka/mean_offdiag" in tags
    # figure titles say teacher
    figs = publish.make_figures(storage.load_results(teacher, ["cka", "knn"]), 4, part="teacher")
    assert figs and all(tag.startswith("teacher/") for tag in figs)
    for fig in figs.values():
        titles = [ax.get_title() for ax in fig.axes] + [fig._suptitle.get_text() if fig._suptitle else ""]
        assert any(t.startswith("teacher: ") for t in titles), titles
    # again: everything reused, for each part
    assert main([str(ssl), "--measures", "cka,knn", "--steps", "4", "--part", "teacher", *ARGS]) == 0
    assert "0 results computed, 2 reused" in capsys.readouterr().out


def test_the_notebook_api_reads_the_teacher(ssl):
    kw = dict(measures=["cka", "knn"], batch_size=32, figures=True)
    res_t, res_s = analyze(str(ssl), part="teacher", **kw), analyze(f"{ssl}:4", **kw)
    assert (
        main([str(ssl), "--measures", "cka,knn", "--part", "teacher", "--steps", "4", "--no-tensorboard", *ARGS]) == 0
    )
    saved = load_result(ssl / "analysis" / "teacher" / "step_0000004" / "knn.npz")
    np.testing.assert_array_equal(res_t["results"]["knn"]["acc"], saved["acc"])
    assert not np.array_equal(res_t["results"]["cka"]["matrix"], res_s["results"]["cka"]["matrix"])
    assert all(t.startswith("teacher/") for t in res_t["figures"]) and not any(
        t.startswith("teacher/") for t in res_s["figures"]
    )
    with pytest.raises(ValueError, match="has no part 'nope'"):
        analyze(str(ssl), part="nope", **kw)
    with pytest.raises(ValueError, match="run folder"):
        analyze(torch.nn.Identity(), torch.rand(4, 1, 28, 28), part="teacher", **kw)


def test_teacher_against_student_and_compare(ssl, tmp_path, capsys):
    assert (
        main([str(ssl), "--part", "teacher", "--against", str(ssl), "--measures", "cka", "--no-tensorboard", *ARGS])
        == 0
    )
    assert "ssl (teacher)@4 vs ssl@4: mean CKA" in capsys.readouterr().out
    res = load_result(ssl / "analysis" / "teacher" / "against" / "ssl_step_0000004" / "step_0000004" / "cross_cka.npz")
    assert res["same_index"].shape == (len(res["labels_a"]),)
    assert (ssl / "figures" / "teacher" / "against" / "ssl_step_0000004" / "step_0000004" / "cross_cka.png").is_file()
    from analysis.frontends.compare import main as compare_main

    other = tmp_path / "ssl2"
    shutil.copytree(ssl, other)
    assert (
        compare_main([str(ssl), str(other), "--measures", "cka,knn", "--out", str(tmp_path / "cmp"), "--no-progress"])
        == 0
    )
    assert (tmp_path / "cmp" / "report.md").is_file() and (tmp_path / "cmp" / "cka_grid.png").is_file()


def _bad(capsys, argv, text, watch: Path):
    before = _tree(watch)
    assert main(argv + ARGS) == 2
    err = capsys.readouterr().err
    assert text in err and err.count("\n") == 1, err
    assert _tree(watch) == before


def test_an_unknown_part_is_one_sentence_naming_the_parts(ssl, runs, tmp_path, capsys):
    _bad(
        capsys,
        [str(ssl), "--part", "nope"],
        "has no part 'nope' (objective fake_ssl saves student, teacher): pass --part student or --part teacher.",
        ssl,
    )
    sup = tmp_path / "sup"
    shutil.copytree(runs["sup"], sup)
    _bad(capsys, [str(sup), "--part", "teacher"], "has no part 'teacher' (objective supervised saves student)", sup)
    assert (
        main([str(sup), "--part", "student", "--measures", "cka", "--no-tensorboard", *ARGS]) == 0
    )  # a supervised run's one network
    assert (sup / "analysis" / "step_0000002" / "cka.npz").is_file()
    # a checkpoint whose meta.json names a part that its weights do not have
    meta = ssl / "checkpoints" / "step_0000004" / "meta.json"
    m = json.loads(meta.read_text())
    m["objective"]["parts"]["teacher"] = "nothing_here."
    meta.write_text(json.dumps(m))
    _bad(capsys, [str(ssl), "--part", "teacher", "--steps", "4"], "hold no tensors under 'nothing_here.'", ssl)


# ---------------------------------------------------------------- public checkpoints by timm name


@pytest.fixture
def no_download(monkeypatch):
    """Any attempt of timm to fetch pretrained weights fails the test."""
    import timm.models._builder as B

    def refuse(*a, **k):
        raise AssertionError("timm tried to load pretrained weights")

    monkeypatch.setattr(B, "load_pretrained", refuse)


def test_a_public_dino_checkpoint_by_its_timm_name(tmp_path, write_recipe, no_download):
    """A hub model.safetensors of timm's vit_small_patch16_224.dino (no head, timm's keys), here one saved from a
    randomly initialised model at 32 px, analysed by the same command."""
    import timm

    src = timm.create_model("vit_small_patch16_224.dino", pretrained=False, num_classes=0, img_size=32)
    save_file(src.state_dict(), tmp_path / "dino.safetensors")
    p = write_recipe(data={"probe_train_size": 200})
    out = tmp_path / "ext"
    argv = [
        "--model",
        "timm:vit_small_patch16_224.dino",
        "--weights",
        str(tmp_path / "dino.safetensors"),
        "--recipe",
        str(p),
        "--set",
        "data.img_size=32",
        "data.in_chans=3",
        "--out",
        str(out),
        "--measures",
        "cka,knn,attention_distance",
        "--no-tensorboard",
        *ARGS,
    ]
    assert main(argv) == 0
    assert {f.stem for f in (out / "analysis" / "step_0000000").glob("*.npz")} == {"cka", "knn", "attention_distance"}
    model = MS.model_from_timm("timm:vit_small_patch16_224.dino", str(tmp_path / "dino.safetensors"), 10, 3, 32)
    assert model.num_classes == 0
    assert all(torch.equal(v, src.state_dict()[k]) for k, v in model.state_dict().items())


def test_a_public_mae_checkpoint_by_its_timm_name(tmp_path, no_download):
    """timm's vit_base_patch16_224.mae (a ViT-B/16 backbone without head) loads from a file of its keys; 32 px keeps
    the position embedding small (the measures are the DINO test's)."""
    import timm

    src = timm.create_model("vit_base_patch16_224.mae", pretrained=False, num_classes=0, img_size=32)
    save_file(src.state_dict(), tmp_path / "mae.safetensors")
    model = MS.model_from_timm("timm:vit_base_patch16_224.mae", str(tmp_path / "mae.safetensors"), 10, 3, 32)
    assert model.num_classes == 0 and len(model.blocks) == 12 and model.embed_dim == 768
    assert all(torch.equal(v, src.state_dict()[k]) for k, v in model.state_dict().items())


def test_a_file_with_another_class_count_keeps_its_head(tmp_path, no_download):
    """An ImageNet classifier analysed on 10-class data: the head follows the file (no measure reads it)."""
    import timm

    save_file(timm.create_model("resnet10t", num_classes=1000, in_chans=1).state_dict(), tmp_path / "r.safetensors")
    model = MS.model_from_timm("timm:resnet10t", str(tmp_path / "r.safetensors"), 10, 1, 28)
    assert model.fc.out_features == 1000


def test_bad_public_checkpoint_input_is_one_sentence(tmp_path, write_recipe, capsys, no_download):
    import timm

    save_file(
        timm.create_model("vit_small_patch16_224.dino", pretrained=False, num_classes=0, img_size=32).state_dict(),
        tmp_path / "dino.safetensors",
    )
    p = write_recipe(data={"probe_train_size": 200})
    common = ["--weights", str(tmp_path / "dino.safetensors"), "--recipe", str(p), "--out", str(tmp_path / "ext")]
    _bad(
        capsys,
        ["--model", "timm:vit_small_patch16_224.nope", *common],
        "timm has no pretrained tag 'nope' for vit_small_patch16_224",
        tmp_path,
    )
    # weights of 32 px, 3 channels analysed at the recipe's 28 px, 1 channel
    _bad(
        capsys,
        ["--model", "timm:vit_small_patch16_224.dino", *common],
        "do not fit this model (timm:vit_small_patch16_224.dino at data.img_size=28, data.in_chans=1",
        tmp_path,
    )
    _bad(
        capsys,
        [
            "--model",
            "timm:vit_small_patch16_224.dino",
            *common,
            "--set",
            "data.img_size=32",
            "data.in_chans=3",
            "--part",
            "teacher",
        ],
        "has no part 'teacher': a model from elsewhere is one network",
        tmp_path,
    )
    assert not (tmp_path / "ext").exists()
    assert list_checkpoints(tmp_path) == []
