"""A launcher that starts fewer processes than it was asked for (issue 44): ``accelerate launch --cpu
--num_processes 2`` runs accelerate's simple launcher, which starts ONE process, sets no WORLD_SIZE and tells it
nothing of the 2 (only MASTER_ADDR / MASTER_PORT); the trainer reads the count from its parent's command line and
says so in one sentence, then trains on the one process."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from train.cli import asked_processes, fewer_processes


def _cmdline(*argv: str) -> bytes:
    return "\0".join(argv).encode() + b"\0"


@pytest.mark.parametrize(
    "argv, asked",
    [
        (["--cpu", "--num_processes", "2", "-m", "train"], 2),
        (["--num-processes=4", "train.py"], 4),
        (["--cpu", "-m", "train", "--num_processes", "2"], None),  # the trainer's own arguments
        (["--num_processes"], None),
    ],
)
def test_the_asked_count_is_read_up_to_the_launched_script(argv, asked):
    assert asked_processes(argv) == asked


def test_one_process_of_two_asked_is_one_sentence_naming_what_to_run():
    parent = _cmdline(sys.executable, "/venv/bin/accelerate", "launch", "--cpu", "--num_processes", "2", "-m", "train")
    msg = fewer_processes(1, {}, parent)
    assert msg.startswith("accelerate launch was asked for 2 processes but started 1 ")
    assert "VITLAB_NPROC=2 ./launch.sh" in msg and "--multi_gpu --num_processes 2" in msg and msg.count(". ") == 0
    module = _cmdline(sys.executable, "-m", "accelerate.commands.launch", "--num_processes=3", "x.py")
    assert "asked for 3 processes" in fewer_processes(1, {}, module)
    assert fewer_processes(2, {}, parent) is None  # as many as asked
    assert fewer_processes(1, {"WORLD_SIZE": "2"}, parent) is None  # torchrun's launch: the trainer checks WORLD_SIZE
    assert fewer_processes(1, {}, _cmdline("bash", "-c", "accelerate launch --num_processes 2")) is None
    assert fewer_processes(1, {}, _cmdline("/venv/bin/accelerate", "config")) is None


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the parent's command line is read from /proc")
def test_accelerate_launch_cpu_with_two_processes_trains_one_and_says_so(write_recipe, tmp_path):
    recipe = write_recipe("tiny", train={"steps": 2, "checkpoint_every": 2, "eval_every": 0})
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR")}
    accelerate = str(Path(sys.executable).parent / "accelerate")
    cmd = [accelerate, "launch", "--cpu", "--num_processes", "2", "--num_machines", "1", "--mixed_precision", "no"]
    cmd += ["--dynamo_backend", "no", "-m", "train", "--recipe", str(recipe), "--no-progress"]
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    warn = [line for line in r.stderr.splitlines() if line.startswith("warning: accelerate launch was asked")]
    assert len(warn) == 1 and "asked for 2 processes but started 1" in warn[0]
    run_dir = next(Path(tmp_path).rglob("result.json"))
    assert json.loads(run_dir.read_text())["num_processes"] == 1
