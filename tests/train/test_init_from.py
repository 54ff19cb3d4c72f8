"""Fine-tuning and linear evaluation of a pretrained run (train.init_from, train.init_part, train.freeze_backbone):
the first step starts from the pretrained weights (student or teacher), a frozen backbone leaves the run unchanged
while the head trains, resume is exact and never reads init_from again, the recipe hash sees init_from but keeps
older hashes, and every bad input is one sentence, exit 2, before anything is written."""

import json
import shutil
from pathlib import Path
from typing import ClassVar

import fake_objective
import pytest
import torch
import yaml
from conftest import ROOT, TINY, _merge
from safetensors.torch import load_file

from train.callbacks import Callback, register_callback
from train.checkpoint import list_checkpoints
from train.cli import main as train_main
from train.recipe import load_recipe
from train.trainer import train

pytestmark = pytest.mark.usefixtures("one_thread")

# the tiny model of conftest.TINY, as overrides of the shipped recipes (which base on default.yaml)
SMALL = [
    "model.depth=2",
    "model.embed_dim=32",
    "model.num_heads=2",
    "data.train_size=256",
    "data.eval_size=64",
    "data.probe_train_size=100",
    "data.analysis_size=32",
    "train.batch_size=32",
    "train.warmup_steps=1",
    "train.eval_every=0",
    "train.checkpoint_every=0",
    "train.eval_batch_size=64",
    "train.log_every=1",
    "train.mixed_precision=no",
    "callbacks=[]",
]


@register_callback("test_capture_start")
class CaptureStart(Callback):
    """The backbone's weights when training starts (after init_from, before the first step)."""

    state: ClassVar[dict] = {}

    def on_train_start(self, ctx):
        CaptureStart.state = {k: v.detach().clone() for k, v in ctx.model.state_dict().items()}


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory):
    """A self-supervised run (the test-only objective: a student and an EMA teacher) of 3 steps, and its root."""
    with pytest.MonkeyPatch.context() as mp:
        fake_objective.register(mp)
        root = tmp_path_factory.mktemp("pre")
        data = _merge(
            TINY,
            {
                "train": {
                    "objective": fake_objective.NAME,
                    "steps": 3,
                    "checkpoint_every": 0,
                    "eval_every": 0,
                    "mixed_precision": "no",
                },
                "run": {"root": str(root)},
            },
        )
        p = root / "ssl.yaml"
        p.write_text(yaml.safe_dump(data))
        run = Path(train(load_recipe(p), progress=False)["run_dir"])
        yield run


def _weights(run: Path, prefix: str = "") -> dict:
    state = load_file(str(list_checkpoints(run / "checkpoints")[-1] / "model.safetensors"))
    return {k[len(prefix) :]: v for k, v in state.items() if k.startswith(prefix)}


def _meta(run: Path) -> dict:
    return json.loads((list_checkpoints(run / "checkpoints")[-1] / "meta.json").read_text())


def _run(recipe: str, root: Path, *overrides: str, name: str = "ft") -> Path:
    argv = [
        str(ROOT / "recipes" / recipe),
        "--no-progress",
        "--name",
        name,
        "--set",
        *SMALL,
        f"run.root={root}",
        *overrides,
    ]
    assert train_main(argv) == 0
    return root / name


def test_finetune_starts_from_the_pretrained_student_with_a_new_head(pretrained, tmp_path):
    student = _weights(pretrained, "backbone.")
    run = _run(
        "finetune.yaml", tmp_path, f"train.init_from={pretrained}", "train.steps=2", "callbacks=[test_capture_start]"
    )
    start = CaptureStart.state
    assert set(start) - set(student) == {"head.weight", "head.bias"}  # the pretrained backbone has no head
    assert all(torch.equal(start[k], student[k]) for k in student)
    final = _weights(run)
    assert not torch.equal(
        final["blocks.0.attn.qkv.weight"], student["blocks.0.attn.qkv.weight"]
    )  # fine-tuned: it trains
    rec = _meta(run)["init_from"]
    ckpt = list_checkpoints(pretrained / "checkpoints")[-1]
    assert rec["checkpoint"] == str(ckpt) and rec["step"] == 3 and rec["part"] == "student"
    assert rec["sha256"] == json.loads((ckpt / "meta.json").read_text())["files"]["model.safetensors"]
    assert rec["objective"] == fake_objective.NAME


def test_init_part_teacher_starts_from_the_teacher(pretrained, tmp_path):
    teacher, student = _weights(pretrained, "teacher_backbone."), _weights(pretrained, "backbone.")
    ckpt = list_checkpoints(pretrained / "checkpoints")[-1]  # a checkpoint folder, not the run
    _run(
        "finetune.yaml",
        tmp_path,
        f"train.init_from={ckpt}",
        "train.init_part=teacher",
        "train.steps=1",
        "callbacks=[test_capture_start]",
    )
    start = CaptureStart.state
    assert all(torch.equal(start[k], teacher[k]) for k in teacher)
    assert not all(
        torch.equal(teacher[k], student[k]) for k in teacher
    )  # the two networks differ, so this tells them apart


def test_linear_eval_changes_nothing_in_the_frozen_backbone(pretrained, tmp_path):
    """The shipped linear_eval recipe with init_from on the command line (model.dropout and drop_path on, to show
    that the frozen backbone runs in eval mode)."""
    student = _weights(pretrained, "backbone.")
    run = _run(
        "linear_eval.yaml",
        tmp_path,
        f"train.init_from={pretrained}",
        "train.steps=3",
        "model.drop_path=0.2",
        "model.dropout=0.2",
        "callbacks=[test_capture_start]",
    )
    head0 = {k: CaptureStart.state[k] for k in ("head.weight", "head.bias")}
    final = _weights(run)
    assert set(final) == set(student) | {"head.weight", "head.bias"}
    assert all(torch.equal(final[k], student[k]) for k in student), "a frozen backbone weight changed"
    assert not torch.equal(final["head.weight"], head0["head.weight"])  # the head trained
    assert _meta(run)["init_from"]["freeze_backbone"] is True
    # the optimizer holds the head only
    opt = torch.load(list_checkpoints(run / "checkpoints")[-1] / "optimizer.bin", weights_only=False)
    assert sum(len(g["params"]) for g in opt["param_groups"]) == 2


def test_frozen_backbone_stays_in_eval_mode():
    from train import init_from
    from train.models import build_model

    r = load_recipe(
        ROOT / "recipes/linear_eval.yaml",
        ["model.depth=2", "model.embed_dim=32", "model.num_heads=2", "model.drop_path=0.5"],
    )
    net = build_model(r, 10)
    assert init_from.freeze(net) == 32 * 10 + 10
    net.train()
    assert net.training and net.head.training
    assert not any(m.training for n, m in net.named_modules() if n and not n.startswith("head"))
    x = torch.rand(4, 1, 28, 28)
    assert torch.equal(net.forward_features(x), net.forward_features(x))  # no dropout / drop-path
    net.eval()
    net.train(True)
    assert not net.blocks[0].training


def test_resume_of_an_init_from_run_is_exact_and_does_not_read_init_from_again(pretrained, tmp_path):
    src = tmp_path / "src"
    shutil.copytree(pretrained, src)
    common = [f"train.init_from={src}", "train.steps=4", "train.checkpoint_every=2"]
    straight = _run("finetune.yaml", tmp_path, *common, "callbacks=[]", name="straight")
    argv = [
        str(ROOT / "recipes/finetune.yaml"),
        "--no-progress",
        "--name",
        "resumed",
        "--set",
        *SMALL,
        f"run.root={tmp_path}",
        *common,
        "callbacks=[{name: test_stop_after, step: 2}]",
    ]
    assert train_main(argv) == 0  # stopped cleanly after the checkpoint of step 2
    assert [c.name for c in list_checkpoints(tmp_path / "resumed" / "checkpoints")] == ["step_0000002"]
    shutil.rmtree(src)  # the pretrained run is gone: resume must not need it
    assert train_main([*argv, "--resume"]) == 0
    a, b = _weights(straight), _weights(tmp_path / "resumed")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert _meta(tmp_path / "resumed")["init_from"] == _meta(straight)["init_from"]


@register_callback("test_stop_after")
class StopAfter(Callback):
    """Asks the trainer to stop (as SIGTERM does) at the checkpoint of ``step``."""

    def __init__(self, every=None, step=2):
        super().__init__(every)
        self.step = step

    def on_checkpoint(self, ctx):
        if ctx.step == self.step:
            import os
            import signal

            os.kill(os.getpid(), signal.SIGTERM)


def test_init_from_is_in_the_recipe_hash_and_older_hashes_stay():
    base = load_recipe(ROOT / "recipes/tiny.yaml")
    # the hash of recipes/tiny.yaml before init_from existed (computed at commit af79f3f)
    assert base.hash() == TINY_HASH_BEFORE
    assert (
        load_recipe(
            ROOT / "recipes/tiny.yaml",
            ["train.init_from=null", "train.init_part=student", "train.freeze_backbone=false"],
        ).hash()
        == TINY_HASH_BEFORE
    )
    changed = {
        load_recipe(ROOT / "recipes/tiny.yaml", [o]).hash()
        for o in ("train.init_from=runs/a", "train.init_from=runs/b", "train.freeze_backbone=true")
    }
    assert len(changed) == 3 and TINY_HASH_BEFORE not in changed
    a = load_recipe(ROOT / "recipes/tiny.yaml", ["train.init_from=runs/a"])
    assert a.resume_hash() != load_recipe(ROOT / "recipes/tiny.yaml", ["train.init_from=runs/b"]).resume_hash()


TINY_HASH_BEFORE = "4423f2cf36f28a9e"


def _bad(capsys, tmp_path, recipe: str, overrides: list[str], text: str, objective=None) -> None:
    before = sorted(p.name for p in tmp_path.iterdir())
    argv = [
        str(ROOT / "recipes" / recipe),
        "--no-progress",
        "--name",
        "bad",
        "--set",
        *SMALL,
        f"run.root={tmp_path}",
        "train.steps=1",
        *overrides,
    ]
    assert train_main(argv) == 2
    err = capsys.readouterr().err
    assert text in err and err.startswith("error: ") and err.count("\n") == 1, err
    assert sorted(p.name for p in tmp_path.iterdir()) == before and not (tmp_path / "bad").exists()


def test_bad_init_from_is_one_sentence_exit_2_and_writes_nothing(pretrained, tmp_path, capsys, monkeypatch):
    fake_objective.register(monkeypatch)
    _bad(capsys, tmp_path, "finetune.yaml", [f"train.init_from={tmp_path / 'nope'}"], "does not exist")
    empty = tmp_path / "empty"
    empty.mkdir()
    shutil.copy(pretrained / "recipe.yaml", empty / "recipe.yaml")
    _bad(capsys, tmp_path, "finetune.yaml", [f"train.init_from={empty}"], "has no complete checkpoint")
    (tmp_path / "junk").mkdir()
    _bad(
        capsys,
        tmp_path,
        "finetune.yaml",
        [f"train.init_from={tmp_path / 'junk'}"],
        "neither a run folder nor a checkpoint",
    )
    _bad(
        capsys,
        tmp_path,
        "finetune.yaml",
        [f"train.init_from={pretrained}", "model.depth=3"],
        "its run was trained with model.depth=2 (this recipe: 3)",
    )
    _bad(
        capsys,
        tmp_path,
        "finetune.yaml",
        [f"train.init_from={pretrained}", "model.embed_dim=64", "model.num_heads=2"],
        "does not fit this model",
    )
    _bad(
        capsys,
        tmp_path,
        "finetune.yaml",
        [f"train.init_from={pretrained}", "train.init_part=nope"],
        "holds student, teacher",
    )
    _bad(capsys, tmp_path, "finetune.yaml", ["train.init_part=teacher"], "train.init_from is not set")
    _bad(capsys, tmp_path, "linear_eval.yaml", [f"train.objective={fake_objective.NAME}"], "does not have")
    # a corrupted pretrained checkpoint
    src = tmp_path / "src"
    shutil.copytree(pretrained, src)
    w = list_checkpoints(src / "checkpoints")[-1] / "model.safetensors"
    w.write_bytes(w.read_bytes()[:-10] + b"0" * 10)
    _bad(capsys, tmp_path, "finetune.yaml", [f"train.init_from={src}"], "corrupted")
