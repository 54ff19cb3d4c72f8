"""The training loop: end-to-end smoke run, exact resume, interrupted/corrupted checkpoints, NaN stop,
callback cadence and timing."""

import json
import os
import subprocess
import types
import warnings
from pathlib import Path
from typing import ClassVar

import pytest
import torch
from conftest import ROOT, read_scalars
from safetensors.torch import load_file

from train.callbacks import Callback, register_callback
from train.checkpoint import CheckpointError, list_checkpoints, read_meta, verify_checkpoint
from train.recipe import load_recipe
from train.trainer import RunExists, TrainingDiverged, is_timing_tag, lr_at, train


class Crash(RuntimeError):
    pass


@register_callback("test_crash_at")
class CrashAt(Callback):
    """Simulates the process dying right after the checkpoint of ``step`` (before its callbacks have finished), once
    per run folder: the resumed run runs the checkpoint's callbacks again, this one included, and goes on. With
    ``where: end``, in the end callbacks of a run that finishes at ``step`` instead (its final checkpoint's callbacks
    done, result.json not written yet)."""

    crashed: ClassVar[set] = set()

    def __init__(self, every=None, step=4, where="checkpoint"):
        super().__init__(every)
        self.step, self.where = step, where

    def _crash(self, ctx, where):
        if where == self.where and ctx.step == self.step and (str(ctx.run_dir), ctx.step) not in CrashAt.crashed:
            CrashAt.crashed.add((str(ctx.run_dir), ctx.step))
            raise Crash(f"simulated crash at step {ctx.step}")

    def on_checkpoint(self, ctx):
        self._crash(ctx, "checkpoint")

    def on_train_end(self, ctx):
        self._crash(ctx, "end")


@register_callback("test_poison")
class Poison(Callback):
    """Writes NaN into one weight at ``step`` (on_step_end), so the next step's loss is NaN."""

    def __init__(self, every=1, step=6):
        super().__init__(every)
        self.step = step

    def on_step_end(self, ctx):
        if ctx.step == self.step:
            with torch.no_grad():
                next(ctx.model.parameters()).fill_(float("nan"))


@register_callback("test_record")
class Record(Callback):
    calls: ClassVar[list] = []

    def __init__(self, every=None, sleep=0.0):
        super().__init__(every)
        self.sleep = sleep
        Record.calls = []

    def _rec(name):
        def f(self, ctx):
            import time

            Record.calls.append((name, ctx.step))
            time.sleep(self.sleep)

        return f

    on_train_start = _rec("start")
    on_step_end = _rec("step")
    on_checkpoint = _rec("ckpt")
    on_train_end = _rec("end")
    on_close = _rec("close")


def test_lr_schedule_warmup_then_decay():
    r = load_recipe(
        ROOT / "recipes/default.yaml", ["train.steps=100", "train.warmup_steps=10", "train.lr=1.0", "train.min_lr=0.0"]
    )
    t = r.train
    assert lr_at(0, t) == pytest.approx(0.1) and lr_at(9, t) == pytest.approx(1.0)
    assert (
        lr_at(10, t) == pytest.approx(1.0)
        and lr_at(55, t) == pytest.approx(0.5)
        and lr_at(100, t) == pytest.approx(0.0)
    )
    t.schedule = "linear"
    assert lr_at(55, t) == pytest.approx(0.5) and lr_at(28, t) == pytest.approx(0.8)


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_the_thread_share_of_a_run_is_kept_on_a_gpu_too(device, monkeypatch):
    """``--jobs N`` sets VITLAB_THREADS to each run's share of the cores; a GPU run obeys it as a CPU run does (it
    once returned early on a GPU, and N runs on one GPU host each started every core's threads). Without it a GPU
    run leaves torch's own count."""
    from train import trainer as T

    acc = types.SimpleNamespace(device=torch.device(device), num_processes=1)
    n = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        monkeypatch.setenv("VITLAB_THREADS", "1")
        T._cpu_threads(acc)
        assert torch.get_num_threads() == 1
        torch.set_num_threads(2)
        monkeypatch.delenv("VITLAB_THREADS")
        monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
        T._cpu_threads(acc)
        cores = len(os.sched_getaffinity(0))
        assert torch.get_num_threads() == (cores if device == "cpu" else 2)
    finally:
        torch.set_num_threads(n)


def test_smoke_run_through_launch_sh(write_recipe, tmp_path):
    """The user's path: ./launch.sh RECIPE --set ... -> checkpoints, TensorBoard tags, resolved recipe."""
    p = write_recipe(callbacks=[{"name": "sample_images", "every": 4}])
    env = {**os.environ, "VITLAB_NPROC": "1"}
    out = subprocess.run(
        [str(ROOT / "launch.sh"), str(p), "--no-progress"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    run = tmp_path / "runs" / "tiny"
    assert [c.name for c in list_checkpoints(run / "checkpoints")] == ["step_0000004", "step_0000008"]
    for c in list_checkpoints(run / "checkpoints"):
        meta = verify_checkpoint(c)
        assert {"model.safetensors", "optimizer.bin"} <= set(meta["files"]) and meta["recipe_hash"]
        assert meta["step"] == int(c.name[5:]) and "epoch" in meta
        assert meta["torch_threads"] == len(os.sched_getaffinity(0)), "accelerate launch's OMP_NUM_THREADS=1 was undone"
    assert json.loads((run / "checkpoints/step_0000008/meta.json").read_text())["final"] is True
    resolved = load_recipe(run / "recipe.yaml")
    assert resolved.hash() == load_recipe(p).hash()
    scalars = read_scalars(run)
    for tag in ("train/loss", "train/lr", "train/throughput_img_s", "eval/top1", "time/callbacks_s"):
        assert tag in scalars, (tag, sorted(scalars))
    assert [s for s, _ in scalars["train/loss"]] == list(range(1, 9))
    assert [s for s, _ in scalars["eval/top1"]] == [4, 8]
    assert all(v > 0 for _, v in scalars["train/throughput_img_s"])
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    ea = EventAccumulator(str(run), size_guidance={"tensors": 0, "images": 0})
    ea.Reload()
    assert "data/train_samples" in ea.Tags()["images"]
    hp = ea.PluginTagToContent("hparams")
    assert hp and b"train.lr" in b"".join(hp.values())
    assert len(list(run.rglob("events.out.tfevents*"))) == 1  # one writer, no stray hparams folder
    from tensorboard.backend.event_processing.plugin_event_multiplexer import EventMultiplexer

    # TensorBoard names a run by its events' folder: `tensorboard --logdir runs` lists the run's own name
    assert list(EventMultiplexer().AddRunsFromDirectory(str(run.parent)).Runs()) == [run.name]
    result = json.loads((run / "result.json").read_text())
    assert result["step"] == 8 and 0.0 <= result["top1"] <= 1.0


def _final_weights(run: Path) -> dict:
    return load_file(str(list_checkpoints(run / "checkpoints")[-1] / "model.safetensors"))


def test_resume_is_exact(write_recipe, tmp_path):
    """2N steps straight == N steps, crash, resume N more: same loss sequence and final weights."""
    straight = train(load_recipe(write_recipe("straight")), progress=False)
    p = write_recipe("resumed", callbacks=[{"name": "test_crash_at", "step": 4}])
    with pytest.raises(Crash):
        train(load_recipe(p), progress=False)
    with pytest.raises(RunExists, match="--resume"):
        train(load_recipe(p), progress=False)
    resumed = train(load_recipe(p), resume=True, progress=False)
    assert resumed["step"] == straight["step"] == 8
    a, b = read_scalars(Path(straight["run_dir"])), read_scalars(Path(resumed["run_dir"]))
    assert [s for s, _ in b["train/loss"]] == list(range(1, 9))
    assert a["train/loss"] == b["train/loss"]
    assert a["eval/top1"] == b["eval/top1"]
    wa, wb = _final_weights(Path(straight["run_dir"])), _final_weights(Path(resumed["run_dir"]))
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    # a finished run resumed again does nothing
    again = train(load_recipe(p), resume=True, progress=False)
    assert again.get("already_finished") and again["step"] == 8


def test_stop_after_checkpoints_there_and_resumes_exactly(write_recipe):
    """--stop-after 3 (not a checkpoint step): checkpointed at 3, not final, TrainingStopped; the resumed run equals a
    straight one (the schedule is the recipe's), and asking again at or past the step trains nothing."""
    from train.trainer import TrainingStopped

    straight = train(load_recipe(write_recipe("straight")), progress=False)
    p = write_recipe("paused")
    with pytest.raises(TrainingStopped, match="stopped after step 3 as asked"):
        train(load_recipe(p), progress=False, stop_after=3)
    ck = list_checkpoints(Path(straight["run_dir"]).parent / "paused" / "checkpoints")
    assert [c.name for c in ck] == ["step_0000003"] and not read_meta(ck[-1]).get("final")
    with pytest.raises(TrainingStopped, match="stopped after step 3"):  # already there: nothing more
        train(load_recipe(p), resume=True, progress=False, stop_after=2)
    resumed = train(load_recipe(p), resume=True, progress=False)
    wa, wb = _final_weights(Path(straight["run_dir"])), _final_weights(Path(resumed["run_dir"]))
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    # every logged curve is the straight run's, tag for tag, step for step, value for value, but the timings
    a, b = read_scalars(Path(straight["run_dir"])), read_scalars(Path(resumed["run_dir"]))
    assert {"train/loss", "train/lr", "train/grad_norm", "eval/top1", "eval/loss"} <= set(a)
    assert {t: v for t, v in a.items() if not is_timing_tag(t)} == {t: v for t, v in b.items() if not is_timing_tag(t)}
    # ... which differ: the stop's checkpoint at step 3 adds a point to time/checkpoint_s
    assert [s for s, _ in a["time/checkpoint_s"]] == [4, 8] and [s for s, _ in b["time/checkpoint_s"]] == [3, 4, 8]
    assert is_timing_tag("train/throughput_img_s") and not is_timing_tag("train/loss")


def test_resume_is_exact_when_it_starts_an_epoch(write_recipe):
    """Stopped at the last step of an epoch (512 images / 32 = 16 batches), resumed: the resumed run creates its
    DataLoader iterator at start-up, the straight one when the epoch runs out mid-loop; neither may move torch's
    global RNG, which the step's shift / flip (on by default) and dropout draw from."""
    from train.trainer import TrainingStopped

    kw = dict(train={"steps": 18, "checkpoint_every": 0, "eval_every": 0, "log_every": 2})
    straight = train(load_recipe(write_recipe("straight", **kw)), progress=False)
    p = write_recipe("paused", **kw)
    with pytest.raises(TrainingStopped):
        train(load_recipe(p), progress=False, stop_after=16)
    resumed = train(load_recipe(p), resume=True, progress=False)
    wa, wb = _final_weights(Path(straight["run_dir"])), _final_weights(Path(resumed["run_dir"]))
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    assert read_scalars(Path(straight["run_dir"]))["train/loss"] == read_scalars(Path(resumed["run_dir"]))["train/loss"]


def test_resume_with_grad_accum_across_epoch_boundary(write_recipe):
    """Accumulation windows that straddle an epoch end resume exactly too (512 imgs / 96 = 5 batches/epoch)."""
    kw = dict(
        train={"batch_size": 96, "grad_accum": 2, "steps": 6, "checkpoint_every": 3, "eval_every": 0, "log_every": 1}
    )
    straight = train(load_recipe(write_recipe("s", **kw)), progress=False)
    p = write_recipe("r", callbacks=[{"name": "test_crash_at", "step": 3}], **kw)
    with pytest.raises(Crash):
        train(load_recipe(p), progress=False)
    resumed = train(load_recipe(p), resume=True, progress=False)
    a, b = read_scalars(Path(straight["run_dir"])), read_scalars(Path(resumed["run_dir"]))
    assert a["train/loss"] == b["train/loss"] and len(a["train/loss"]) == 6
    wa, wb = _final_weights(Path(straight["run_dir"])), _final_weights(Path(resumed["run_dir"]))
    assert all(torch.equal(wa[k], wb[k]) for k in wa)


def test_resume_with_another_recipe_is_refused(write_recipe):
    p = write_recipe(train={"steps": 4})
    train(load_recipe(p), progress=False)
    from train.recipe import RecipeError

    with pytest.raises(RecipeError, match="different recipe.*train.weight_decay"):  # train.lr may change on resume
        train(load_recipe(p, ["train.weight_decay=0.5", "run.name=tiny"]), resume=True, progress=False)


def test_interrupted_checkpoint_skipped_with_warning_and_corrupted_one_is_an_error(write_recipe, tmp_path):
    p = write_recipe(callbacks=[{"name": "test_crash_at", "step": 8}])
    with pytest.raises(Crash):
        train(load_recipe(p), progress=False)
    ckpts = tmp_path / "runs/tiny/checkpoints"
    # an interrupted write of step 8: its meta.json (written last) never appeared
    (ckpts / "step_0000008" / "meta.json").unlink()
    (ckpts / ".staging-step_0000012").mkdir()
    r = load_recipe(p)
    r.callbacks = []  # callbacks do not change what is trained: the same run resumes without the crash
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        out = train(r, resume=True, progress=False)
    msgs = [str(x.message) for x in w]
    assert any("step_0000008" in m and "interrupted" in m for m in msgs), msgs
    assert any(".staging-step_0000012" in m for m in msgs), msgs
    assert out["step"] == 8
    # now corrupt the newest complete checkpoint: resuming names the file and refuses
    f = ckpts / "step_0000008" / "model.safetensors"
    raw = bytearray(f.read_bytes())
    raw[-10] ^= 0xFF
    f.write_bytes(bytes(raw))
    with pytest.raises(CheckpointError, match=r"step_0000008 is corrupted \(model.safetensors does not match"):
        train(r, resume=True, progress=False)
    with pytest.raises(CheckpointError, match="corrupted"):
        verify_checkpoint(ckpts / "step_0000008")


def test_nan_loss_stops_with_message_and_keeps_last_good_checkpoint(write_recipe, tmp_path):
    p = write_recipe(callbacks=[{"name": "test_poison", "every": 1, "step": 6}])
    with pytest.raises(TrainingDiverged) as e:
        train(load_recipe(p), progress=False)
    msg = str(e.value)
    assert "diverged at step 7" in msg and "nan" in msg and "step_0000004" in msg
    # advice that can be followed: a changed lr is a new run (resume refuses a changed recipe)
    assert "start a new run" in msg and "resume" not in msg
    ckpts = list_checkpoints(tmp_path / "runs/tiny/checkpoints")
    assert [c.name for c in ckpts] == ["step_0000004"]
    verify_checkpoint(ckpts[0])
    w = load_file(str(ckpts[0] / "model.safetensors"))
    assert all(torch.isfinite(v).all() for v in w.values())


def test_nan_exit_code_from_cli(write_recipe, capsys):
    from train.cli import main

    p = write_recipe(callbacks=[{"name": "test_poison", "every": 1, "step": 2}])
    assert main([str(p), "--no-progress"]) == 1
    assert "diverged" in capsys.readouterr().err


def test_callback_cadence_and_time_excluded_from_throughput(write_recipe):
    p = write_recipe(
        callbacks=[{"name": "test_record", "every": 3, "sleep": 0.0}, {"name": "test_record", "sleep": 4.0}],
        train={"log_every": 4},
    )
    out = train(load_recipe(p), progress=False)
    calls = Record.calls
    assert ("start", 0) in calls and ("end", 8) in calls
    assert [s for n, s in calls if n == "step"] == [3, 6]
    assert sorted(s for n, s in calls if n == "ckpt") == [4, 8]  # every=None: every checkpoint, not every 3 steps
    sc = read_scalars(Path(out["run_dir"]))
    cb = dict(sc["time/callbacks_s"])
    assert cb[4] >= 4.0 and cb[8] >= 4.0
    # steps 5-8 of this tiny model take well under 4 s (about 1.5 s on 2 cores shared by 4 busy jobs); had the 4 s
    # callback after step 4 been counted, the throughput logged at step 8 would be below 4 x 32 images / 4 s
    ips = dict(sc["train/throughput_img_s"])
    assert sorted(ips) == [4, 8] and ips[8] > 4 * 32 / 4.0


def test_run_folder_is_not_overwritten(write_recipe, capsys):
    from train.cli import main

    p = write_recipe(train={"steps": 2, "checkpoint_every": 1, "eval_every": 0})
    assert main([str(p), "--no-progress"]) == 0
    assert main([str(p), "--no-progress"]) == 2
    assert "already holds checkpoints" in capsys.readouterr().err


@pytest.mark.parametrize("how", ["finished", "crash", "diverged"])
def test_on_close_runs_once_however_the_run_ends(how, write_recipe):
    """on_close (where callbacks finish background work) runs exactly once: after a normal finish, after an
    exception from anywhere (here a callback's), and after divergence."""
    cbs = [{"name": "test_record"}] + {
        "finished": [],
        "crash": [{"name": "test_crash_at", "step": 4}],
        "diverged": [{"name": "test_poison", "every": 1, "step": 6}],
    }[how]
    r = load_recipe(write_recipe(callbacks=cbs, train={"steps": 8, "checkpoint_every": 4}))
    if how == "finished":
        train(r, progress=False)
    else:
        with pytest.raises(Crash if how == "crash" else TrainingDiverged):
            train(r, progress=False)
    closes = [c for c in Record.calls if c[0] == "close"]
    assert len(closes) == 1, Record.calls
    if how != "diverged":
        assert closes[0][1] == {"finished": 8, "crash": 4}[how], closes


def test_progress_bar_ends_on_the_reported_top1_and_names_the_final_stages(write_recipe, capsys):
    """The bar's last top-1 is the final evaluation's (the one the run reports), not the evaluation before it, and
    between steps it says what the run is doing (evaluating, the checkpoint and its callbacks)."""
    import re

    summary = train(load_recipe(write_recipe(train={"eval_every": 3}, callbacks=[])), progress=True)
    err = capsys.readouterr().err
    frames = [f for f in re.split(r"[\r\n]", err) if "top1=" in f]
    assert frames, err[-2000:]
    last = re.search(r"top1=([0-9.]+)", frames[-1]).group(1)
    assert last == f"{summary['top1']:.4f}", (frames[-1], summary["top1"])
    for stage in ("now=evaluating", "now=checkpoint"):
        assert stage in err, stage


def test_a_run_trained_with_a_tb_folder_resumes_into_it(write_recipe):
    """Runs trained before the events moved into the run folder keep them in <run>/tb: a resumed run (and an
    offline analysis) writes there, so its curves stay one TensorBoard run."""
    from train.trainer import TrainingStopped

    p = write_recipe(callbacks=[])
    with pytest.raises(TrainingStopped, match="stopped after step 4"):
        train(load_recipe(p), stop_after=4, progress=False)
    run = Path(load_recipe(p).run.root) / "tiny"
    (run / "tb").mkdir()
    for f in run.glob("events.out.tfevents.*"):
        f.rename(run / "tb" / f.name)
    train(load_recipe(p), resume=True, progress=False)
    assert not list(run.glob("events.out.tfevents.*"))
    scalars = read_scalars(run / "tb")
    assert [s for s, _ in scalars["train/loss"]] == list(range(1, 9))


@pytest.mark.parametrize(
    "text,why",
    [
        ("[1, 2]", "it holds a JSON list, not an object"),
        ('{"step": "abc", "files": {}}', "its 'step' is \"abc\", not an integer"),
        ('{"step": 4, "final": "yes", "files": {}}', "its 'final' is \"yes\", not true or false"),
    ],
)
def test_a_malformed_meta_json_is_one_sentence_naming_it_exit_2(tmp_path, capsys, text, why):
    """meta.json edited into valid JSON that is not what vitlab writes: --resume, --check and a sweep's plan each say
    so in one sentence naming the file (exit 2), and nothing in the run folder changes (but the lock file, which a
    refused trainer leaves as it found it)."""
    from train.cli import main
    from train.sweep import main as sweep_main

    root = tmp_path / "runs"
    ck = root / "tiny" / "checkpoints" / "step_0000004"
    ck.mkdir(parents=True)
    (ck / "meta.json").write_text(text)
    before = sorted((str(f), f.stat().st_mtime_ns) for f in root.rglob("*") if f.is_file())
    recipe = str(ROOT / "recipes/tiny.yaml")
    for args in ([recipe, "--resume"], [recipe, "--resume", "--check"]):
        assert main([*args, "--set", f"run.root={root}", "--no-progress"]) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("error: ") and "\n" not in err, err
        assert f"{ck / 'meta.json'} is malformed ({why})" in err, err
    assert sweep_main([recipe, "--grid", "seed=0", "--set", f"run.root={root}", "run.name=tiny", "--dry-run"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err and "meta.json is malformed" in err, err
    after = sorted((str(f), f.stat().st_mtime_ns) for f in root.rglob("*") if f.is_file() and f.name != ".lock")
    assert after == before


def test_a_checkpoint_whose_callbacks_did_not_finish_gets_them_on_resume(write_recipe, tmp_path):
    """Killed while the checkpoint of step 2 ran its callbacks (the checkpoint itself complete): --resume runs that
    checkpoint's callbacks first, so its analysis results and TensorBoard points exist after all; the final
    checkpoint's too (then the end callbacks and result.json follow), and a checkpoint whose callbacks finished is
    not analysed twice."""
    from train.checkpoint import CALLBACKS_DONE
    from train.sweep import is_finished

    cbs = [{"name": "test_crash_at", "step": 2}, {"name": "cka"}, {"name": "test_record"}]  # the crash comes first
    p = write_recipe(callbacks=cbs, train={"steps": 4, "checkpoint_every": 2, "eval_every": 0})
    run = tmp_path / "runs/tiny"
    with pytest.raises(Crash):
        train(load_recipe(p), progress=False)
    ck2 = run / "checkpoints/step_0000002"
    assert verify_checkpoint(ck2)["marks_callbacks"] and not (ck2 / CALLBACKS_DONE).exists()
    assert not (run / "analysis/step_0000002").exists() and ("ckpt", 2) not in Record.calls

    out = train(load_recipe(p), resume=True, progress=False)
    assert out["step"] == 4 and Record.calls[:2] == [("start", 2), ("ckpt", 2)], Record.calls
    assert [c for c in Record.calls if c[0] == "ckpt"] == [("ckpt", 2), ("ckpt", 4)]
    for step in (2, 4):
        assert (run / f"analysis/step_{step:07d}/summary.json").is_file()
        assert (run / f"checkpoints/step_{step:07d}" / CALLBACKS_DONE).is_file()
    cka = [t for t in read_scalars(run) if t.startswith("analysis/") and "cka" in t]
    assert cka and all(2 in [s for s, _ in read_scalars(run)[t]] for t in cka), cka

    # the final checkpoint's callbacks interrupted: resuming the finished run runs them, the end callbacks, result.json
    assert is_finished(run)
    (run / "checkpoints/step_0000004" / CALLBACKS_DONE).unlink()
    (run / "result.json").unlink()
    assert not is_finished(run)  # a sweep resumes it
    again = train(load_recipe(p), resume=True, progress=False)
    assert not again.get("already_finished") and again["step"] == 4
    assert Record.calls == [("start", 4), ("ckpt", 4), ("end", 4), ("close", 4)], Record.calls
    assert json.loads((run / "result.json").read_text())["step"] == 4
    # and once they have finished, a resume does nothing
    assert train(load_recipe(p), resume=True, progress=False).get("already_finished") and Record.calls == []


@pytest.mark.parametrize(
    "overrides,words",
    [
        (
            ["data.in_chans=3"],
            ["data.in_chans is 3 but the images of this data set are greyscale", "set data.in_chans"],
        ),
        (["train.mixed_precision=fp16"], ["'train.mixed_precision' is fp16, which needs a GPU", "bf16 or no on a CPU"]),
        (
            ["data.img_size=1024", "model.patch_size=1"],
            ["needs at least 32.5 GiB to train", "32.0 GiB of activations for a batch of 32", "8.0 GiB are free"],
        ),
    ],
    ids=["grey-data-3-channels", "fp16-on-cpu", "a-million-tokens"],
)
def test_what_the_data_or_machine_cannot_serve_is_refused(tmp_path, capsys, monkeypatch, overrides, words):
    """Greyscale data with data.in_chans 3, fp16 on a CPU (accelerate would train in float32), a model whose lower
    bound of memory (a million tokens an image) exceeds what is free (here 8 GiB, whatever this host has): one
    sentence, exit 2, no run folder."""
    from train import memory
    from train.cli import main

    if "fp16" in overrides[0] and torch.cuda.is_available():
        pytest.skip("fp16 is refused on a CPU only")
    monkeypatch.setattr(memory, "available_bytes", lambda device: 8 * memory.GiB)
    root = tmp_path / "runs"
    assert main([str(ROOT / "recipes/tiny.yaml"), "--set", f"run.root={root}", *overrides, "--no-progress"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err, err
    for w in words:
        assert w in err, (w, err)
    assert not root.exists()
