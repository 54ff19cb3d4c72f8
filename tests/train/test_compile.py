"""train.compile: torch.compile of the update step. Exact resume (inductor, the default backend), checkpoints that load
into an uncompiled model, callbacks that see the original module (hooks by timm's names), the same training as eager,
the objectives that wrap the backbone, the compile time reported, and one sentence when inductor has no compiler.

Most runs use the aot_eager backend (VITLAB_COMPILE_BACKEND): the same graph capture, no C++ compile."""

import json
import shutil
from pathlib import Path

import pytest
import torch
from conftest import ROOT, read_scalars
from safetensors.torch import load_file

from train import compiling
from train.callbacks import Callback, register_callback
from train.checkpoint import list_checkpoints, load_weights
from train.cli import main
from train.models import build_model
from train.recipe import load_recipe
from train.trainer import train

pytestmark = pytest.mark.usefixtures("one_thread")


@register_callback("test_inspect_model")
class InspectModel(Callback):
    """At every checkpoint: what ctx.model is, and whether a forward hook on timm's ``blocks.0`` (by name) fires."""

    seen: list = []  # noqa: RUF012  (shared with the test on purpose)

    def on_checkpoint(self, ctx):
        fired = []
        block = ctx.model.get_submodule("blocks.0")
        handle = block.register_forward_hook(lambda m, i, o: fired.append(o.shape))
        was = ctx.model.training
        ctx.model.eval()
        with torch.no_grad():
            ctx.model(ctx.data.normalize(ctx.data.eval.images[:4]))
        ctx.model.train(was)
        handle.remove()
        names = [n for n, _ in ctx.model.named_modules()]
        InspectModel.seen.append((ctx.step, type(ctx.model).__name__, len(fired), names))


def _weights(run: Path) -> dict:
    return load_file(str(list_checkpoints(run / "checkpoints")[-1] / "model.safetensors"))


def test_the_key_keeps_old_hashes_and_may_change_on_resume():
    r = load_recipe(ROOT / "recipes/default.yaml")
    on = load_recipe(ROOT / "recipes/default.yaml", ["train.compile=true"])
    assert on.hash() != r.hash()  # compiled kernels round differently: another run
    assert on.resume_hash() == r.resume_hash()  # the same weights to continue from: --resume may toggle it


@pytest.mark.skipif(compiling._cxx() is None, reason="inductor needs a C++ compiler (g++ or $CXX)")
def test_compiled_run_resumes_exactly_and_its_checkpoints_load_uncompiled(write_recipe, monkeypatch):
    """Inductor, the default: 8 steps straight == 4 steps, crash, resume 4 more (bit for bit); model.safetensors holds
    the model's own keys; callbacks get the original module, whose hooked blocks fire; compile time is reported."""
    from test_train import Crash  # registers test_crash_at

    monkeypatch.delenv(compiling.BACKEND_ENV, raising=False)
    InspectModel.seen = []
    cbs = [{"name": "test_inspect_model"}]
    straight = train(load_recipe(write_recipe("straight", train={"compile": True}, callbacks=cbs)), progress=False)
    p = write_recipe("resumed", train={"compile": True}, callbacks=[*cbs, {"name": "test_crash_at", "step": 4}])
    with pytest.raises(Crash):
        train(load_recipe(p), progress=False)
    resumed = train(load_recipe(p), resume=True, progress=False)
    a, b = read_scalars(Path(straight["run_dir"])), read_scalars(Path(resumed["run_dir"]))
    assert [s for s, _ in b["train/loss"]] == list(range(1, 9))
    assert a["train/loss"] == b["train/loss"] and a["eval/top1"] == b["eval/top1"]
    wa, wb = _weights(Path(straight["run_dir"])), _weights(Path(resumed["run_dir"]))
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)

    recipe = load_recipe(p)
    fresh = build_model(recipe, 10)
    assert set(wa) == set(fresh.state_dict()) and not any("_orig_mod" in k for k in wa)
    load_weights(fresh, list_checkpoints(Path(straight["run_dir"]) / "checkpoints")[-1])  # strict
    assert all(torch.equal(fresh.state_dict()[k], wa[k]) for k in wa)

    # callbacks: the original module (not torch.compile's wrapper), timm's names, hooks that fire
    # straight; crashed during the callbacks of 4 (after this one); resumed: the callbacks of 4 again, then 8
    assert [s for s, *_ in InspectModel.seen] == [4, 8, 4, 4, 8]
    for _, kind, fired, names in InspectModel.seen:
        assert kind == "VisionTransformer" and fired == 1
        assert "blocks.0.attn" in names and not any("_orig_mod" in n for n in names)

    # compile time: TensorBoard at the first step of each segment, the checkpoints' meta, result.json (every segment)
    assert [s for s, _ in a["time/compile_s"]] == [1] and a["time/compile_s"][0][1] > 0
    assert [s for s, _ in b["time/compile_s"]] == [1, 5]
    first, second = b["time/compile_s"][0][1], b["time/compile_s"][1][1]
    result = json.loads((Path(resumed["run_dir"]) / "result.json").read_text())
    assert result["compile_s"] == pytest.approx(first + second, rel=1e-5)
    meta = json.loads((list_checkpoints(Path(resumed["run_dir"]) / "checkpoints")[-1] / "meta.json").read_text())
    assert meta["compile_s"] == result["compile_s"]


def test_compiled_training_follows_eager_and_resume_may_turn_compile_off(write_recipe, monkeypatch):
    """fp32, aot_eager: the compiled update step trains the model's own parameters to what eager training gives
    (float rounding apart); a compiled run stopped at step 4 resumes with train.compile=false."""
    from test_train import Crash

    monkeypatch.setenv(compiling.BACKEND_ENV, "aot_eager")
    fp32 = {"mixed_precision": "no"}
    eager = train(load_recipe(write_recipe("eager", train=fp32)), progress=False)
    p = write_recipe("compiled", train={**fp32, "compile": True}, callbacks=[{"name": "test_crash_at", "step": 4}])
    with pytest.raises(Crash):
        train(load_recipe(p), progress=False)
    resumed = train(load_recipe(p, ["train.compile=false"]), resume=True, progress=False)
    a, b = read_scalars(Path(eager["run_dir"])), read_scalars(Path(resumed["run_dir"]))
    assert [s for s, _ in b["train/loss"]] == list(range(1, 9))
    assert [v for _, v in b["train/loss"]] == pytest.approx([v for _, v in a["train/loss"]], rel=1e-4)
    wa, wb = _weights(Path(eager["run_dir"])), _weights(Path(resumed["run_dir"]))
    assert wa.keys() == wb.keys()
    moved = max((wa[k] - wb[k]).abs().max().item() for k in wa)
    assert moved < 1e-4, moved
    assert "time/compile_s" not in a and [s for s, _ in b["time/compile_s"]] == [
        1
    ]  # the eager segment compiles nothing
    assert json.loads((Path(resumed["run_dir"]) / "result.json").read_text())["compile_s"] > 0


@pytest.mark.parametrize(
    "objective,options",
    [
        pytest.param(  # about 20 s (a second compile at step 2); MAE covers a wrapping objective by default
            "dino",
            {"dino": {"out_dim": 64, "hidden_dim": 32, "bottleneck_dim": 16, "local_crops_number": 2}},
            marks=pytest.mark.slow,
        ),
        ("mae", {"mae": {"decoder_dim": 16, "decoder_depth": 1, "decoder_heads": 2}}),
    ],
)
def test_objectives_that_wrap_the_backbone_train_compiled(write_recipe, monkeypatch, objective, options):
    """DINO and MAE: the objective module (backbone, teacher / decoder) is what is compiled; its checkpoint keys are
    its own and callbacks get the backbone."""
    monkeypatch.setenv(compiling.BACKEND_ENV, "aot_eager")
    InspectModel.seen = []
    p = write_recipe(
        objective,
        train={"objective": objective, "compile": True, "steps": 3, "checkpoint_every": 3, "eval_every": 3},
        objectives=options,
        callbacks=[{"name": "test_inspect_model"}],
    )
    out = train(load_recipe(p), progress=False)
    s = read_scalars(Path(out["run_dir"]))
    assert len(s["train/loss"]) == 3 and all(torch.isfinite(torch.tensor(v)) for _, v in s["train/loss"])
    w = _weights(Path(out["run_dir"]))
    assert any(k.startswith("backbone.blocks.0.") for k in w) and not any("_orig_mod" in k for k in w)
    assert InspectModel.seen and InspectModel.seen[0][1] == "VisionTransformer" and InspectModel.seen[0][2] == 1
    assert out["compile_s"] > 0


def test_no_compiler_or_an_unknown_backend_is_one_sentence(tmp_path, capsys, monkeypatch):
    root = tmp_path / "runs"
    args = [str(ROOT / "recipes/default.yaml"), "--set", f"run.root={root}", "train.compile=true"]
    monkeypatch.delenv(compiling.BACKEND_ENV, raising=False)
    monkeypatch.setattr(compiling, "_cxx", lambda: None)
    for extra in ([], ["--check"]):
        assert main([*args, *extra]) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("error: ") and "\n" not in err, err
        assert "C++ compiler" in err and "train.compile=false" in err
    monkeypatch.setenv(compiling.BACKEND_ENV, "no_such_backend")
    assert main(args) == 2
    err = capsys.readouterr().err.strip()
    assert "VITLAB_COMPILE_BACKEND='no_such_backend'" in err and "aot_eager" in err and "\n" not in err
    assert not root.exists()
    # off (the default), neither is looked at
    assert compiling.check(load_recipe(ROOT / "recipes/default.yaml")) is None


def test_the_compiler_check_honours_cxx_and_compiles(tmp_path, capsys, monkeypatch):
    """The compiler is $CXX's (else g++), and it must compile a C++ file: CXX naming no program, or a program that
    compiles nothing (/bin/true, which passes inductor's own --version test), is one sentence naming CXX, exit 2,
    before anything is written."""
    monkeypatch.delenv(compiling.BACKEND_ENV, raising=False)
    root = tmp_path / "runs"
    args = [str(ROOT / "recipes/tiny.yaml"), "--set", f"run.root={root}", "train.compile=true"]
    for cxx in ("/bin/true", str(tmp_path / "no-such-cxx")):
        monkeypatch.setenv("CXX", cxx)
        assert compiling._cxx() is None
        for extra in ([], ["--check"]):
            assert main([*args, *extra]) == 2
            err = capsys.readouterr().err.strip()
            assert err.startswith("error: ") and "\n" not in err, err
            assert f"CXX={cxx!r} names no C++ compiler" in err and "train.compile=false" in err, err
    assert not root.exists()
    if shutil.which("g++"):  # a real compiler, named or found by default
        monkeypatch.setenv("CXX", "g++")
        assert compiling._cxx() == shutil.which("g++")
        monkeypatch.delenv("CXX")
        assert compiling._cxx() == shutil.which("g++")
