"""Offline analysis (python -m analysis, analysis.frontends.compare): same numbers as at training time, cached,
cross-run CKA, reports, and one sentence + exit 2 for every bad input."""

import json
import os
import shutil
import types
from pathlib import Path

import numpy as np
import pytest
import yaml
from conftest import TINY, _merge

from analysis.engine import suite as S
from analysis.frontends import runner as RN
from analysis.frontends.cli import main
from analysis.reports import cross as XC
from analysis.reports.run_report import check_report
from analysis.results import folders as RF0
from analysis.results import runs as RF
from analysis.sources import models as MS
from train.recipe import load_recipe
from train.trainer import train

CB = {"name": "analysis_suite", "batch_size": 32, "fewshot_probe": {"seeds": [0]}}
ARGS = ["--batch-size", "32", "--opt", "fewshot_probe.seeds=[0]", "--no-progress", "--no-tensorboard"]


def _train(root: Path, name: str, **sections) -> Path:
    data = _merge(
        _merge(TINY, {"data": {"probe_train_size": 200}, "callbacks": [CB], "run": {"root": str(root)}}), sections
    )
    p = root / f"{name}.yaml"
    p.write_text(yaml.safe_dump(data))
    return Path(train(load_recipe(p), progress=False)["run_dir"])


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("runs")
    return {
        "vit": _train(root, "vit"),
        "resnet": _train(
            root, "resnet", model={"arch": "resnet", "resnet_layers": [1, 1, 1, 1], "resnet_channels": [8, 8, 16, 16]}
        ),
    }


def _tree(path: Path) -> dict:
    return {str(p): p.stat().st_mtime_ns for p in Path(path).rglob("*")}


def test_offline_reproduces_training_time_arrays_exactly(runs, tmp_path):
    run = tmp_path / "vit"
    shutil.copytree(runs["vit"], run)
    before = {f.name: dict(np.load(f)) for f in (run / "analysis" / "step_0000008").glob("*.npz")}
    assert set(before) == {"cka.npz", "norm_ratio.npz", "attention_distance.npz", "fewshot_probe.npz"}
    assert main([str(run), "--steps", "8", "--force", *ARGS]) == 0
    for name, arrays in before.items():
        after = dict(np.load(run / "analysis" / "step_0000008" / name))
        assert set(after) == set(arrays)
        for k in arrays:
            assert np.array_equal(arrays[k], after[k]), (name, k)


def test_second_invocation_recomputes_nothing(runs, tmp_path, monkeypatch, capsys):
    run = tmp_path / "vit"
    shutil.copytree(runs["vit"], run)
    calls = []
    real = S.run_suite
    monkeypatch.setattr(S, "run_suite", lambda *a, **k: calls.append(k.get("measures")) or real(*a, **k))
    # the training-time callback keyed its results by the checkpoints' weights: same settings -> all reused
    assert main([str(run), *ARGS]) == 0
    assert calls == [] and "0 results computed, 8 reused" in capsys.readouterr().out
    # other probe options: the probe alone is computed once (both checkpoints; CKA and the rest stay cached),
    # then reused; arrays on disk untouched the second time
    assert main([str(run), "--opt", "fewshot_probe.shots=5", *ARGS]) == 0
    assert calls == [["fewshot_probe"], ["fewshot_probe"]]
    assert "2 results computed, 6 reused" in capsys.readouterr().out.splitlines()[-1]
    tree = _tree(run / "analysis")
    assert main([str(run), "--opt", "fewshot_probe.shots=5", *ARGS]) == 0
    assert len(calls) == 2 and _tree(run / "analysis") == tree
    assert "0 results computed, 8 reused" in capsys.readouterr().out.splitlines()[-1]


def test_against_itself_gives_a_cka_diagonal_of_one_and_a_whole_report(runs, tmp_path):
    run = tmp_path / "vit"
    shutil.copytree(runs["vit"], run)
    assert main([str(run), "--against", f"{run}:8", *ARGS]) == 0
    res = np.load(XC.against_dir(RF.open_run(run), 8, RF.open_run(run), 8) / "cross_cka.npz")
    assert np.allclose(np.diag(res["matrix"]), 1.0, atol=1e-6) and np.allclose(res["same_index"], 1.0, atol=1e-6)
    assert (run / "figures" / "against" / "vit_step_0000008" / "step_0000008" / "cross_cka.png").is_file()
    report = run / "report.md"
    text = report.read_text()
    assert "## Step 8" in text and "## Step 4" in text and "Against other runs" in text and text.count("![") >= 10
    assert check_report(report) == []
    # a reader's report: the checkpoints' table first, the conventions once, every figure captioned, long lists last
    assert text.index("## Checkpoints at a glance") < text.index("## Step 8") < text.index("## Step 4")
    assert "| 8 | " in text and "| 4 | " in text and text.count("numbered from 0") == 1
    lines = text.splitlines()
    figures = [i for i, line in enumerate(lines) if line.startswith("![")]
    assert all(lines[i + 2].startswith("*") and lines[i + 2].endswith("*") for i in figures)
    assert "## Appendix" not in text or text.index("## Appendix") > text.index("Against other runs")


def test_against_a_resnet_gives_the_cross_architecture_map(runs, tmp_path):
    run = tmp_path / "vit"
    shutil.copytree(runs["vit"], run)
    a = XC.against(RF.open_run(run), RF.open_run(runs["resnet"]), 8, opts=S.SuiteOptions(batch_size=32), progress=False)
    m = a["results"][8]["matrix"]
    assert (
        m.shape == (4, 4) and np.isfinite(m).all() and "same_index" not in a["results"][8]
    )  # 2 ViT blocks x 2 sublayers vs 4 stages
    d = XC.against_dir(RF.open_run(run), 8, RF.open_run(runs["resnet"]), 8)
    heads = np.load(d / "head_subsets.npz")
    assert sorted(heads["head_order"].tolist()) == [0, 1] and np.all(
        np.diff(heads["head_distance"]) >= 0
    )  # Raghu Fig. 5
    assert (run / "figures" / "against" / "resnet_step_0000008" / "step_0000008" / "head_subsets.png").is_file()


def test_compare_draws_runs_side_by_side(runs, tmp_path):
    from analysis.frontends.compare import main as compare_main

    vit, resnet = tmp_path / "vit", tmp_path / "resnet"
    shutil.copytree(runs["vit"], vit)
    shutil.copytree(runs["resnet"], resnet)
    out = tmp_path / "cmp"
    assert compare_main([str(vit), str(resnet), "--reference", f"{vit}:4", "--out", str(out), "--no-progress"]) == 0
    for f in (
        "cka_grid.png",
        "probes.png",
        "attention_distance.png",
        "norm_ratio.png",
        "similarity_to_reference.png",
        "report.md",
    ):
        assert (out / f).is_file(), f
    assert check_report(out / "report.md") == []
    text = (out / "report.md").read_text()
    assert "| vit | 8 |" in text and "| resnet | 8 |" in text  # each run at its last step, said
    assert "Compared: vit at step 8; resnet at step 8; reference vit at step 4." in text
    assert text.count("![") == text.count("\n*") == 5  # every figure captioned


def test_compare_on_runs_too_small_for_the_probe_is_one_sentence(runs, tmp_path, capsys):
    from analysis.frontends.compare import main as compare_main

    small = tmp_path / "small"
    shutil.copytree(runs["vit"], small)
    r = yaml.safe_load((small / "recipe.yaml").read_text())
    r["data"]["probe_train_size"] = 100  # 10-shot probes need 200 (the shots come from half of it)
    (small / "recipe.yaml").write_text(yaml.safe_dump(r))
    before = _tree(small)
    assert compare_main([str(small), "--no-progress", "--out", str(tmp_path / "cmp")]) == 2
    err = capsys.readouterr().err
    # a run's images are fixed by its recipe: the fix is the command line's --opt
    assert "--opt fewshot_probe.shots=5" in err and err.count("\n") == 1
    assert _tree(small) == before and not (tmp_path / "cmp").exists()


def test_a_model_not_trained_here(tmp_path, write_recipe):
    import timm
    from safetensors.torch import save_file

    model = timm.create_model("resnet10t", num_classes=10, in_chans=1)
    save_file(model.state_dict(), tmp_path / "r.safetensors")
    p = write_recipe(data={"probe_train_size": 200})
    out = tmp_path / "ext"
    assert (
        main(
            [
                "--model",
                "timm:resnet10t",
                "--weights",
                str(tmp_path / "r.safetensors"),
                "--recipe",
                str(p),
                "--out",
                str(out),
                "--measures",
                "cka,norm_ratio",
                *ARGS,
            ]
        )
        == 0
    )
    assert (out / "analysis" / "step_0000000" / "cka.npz").is_file() and check_report(out / "report.md") == []


def _bad(capsys, argv, text, watch: Path):
    before = _tree(watch)
    assert main(argv + ARGS) == 2
    err = capsys.readouterr().err
    assert text in err and err.count("\n") == 1, err
    assert _tree(watch) == before


def test_bad_inputs_get_one_sentence_and_exit_2_and_write_nothing(runs, tmp_path, capsys, write_recipe):
    import timm
    from safetensors.torch import save_file

    run = tmp_path / "vit"
    shutil.copytree(runs["vit"], run)
    _bad(capsys, [str(tmp_path / "nope")], "does not exist", tmp_path)
    empty = tmp_path / "empty"
    empty.mkdir()
    shutil.copy(run / "recipe.yaml", empty / "recipe.yaml")
    _bad(capsys, [str(empty)], "has no complete checkpoint", tmp_path)
    _bad(capsys, [str(run), "--steps", "5"], "no checkpoint at step 5", tmp_path)
    _bad(capsys, [str(run), "--measures", "cka,nope"], "unknown measure 'nope'", tmp_path)
    _bad(capsys, [str(run), "--opt", "knn.kk=3"], "unknown option 'knn.kk'", tmp_path)
    _bad(capsys, [str(run), "--opt", "fewshot_probe.shots=0"], "shots must be at least 1", tmp_path)
    _bad(capsys, [str(run), "--opt", "token_probes.seeds=a,b"], "must be an integer", tmp_path)
    _bad(capsys, [str(run), "--opt", "knn=3"], "MEASURE.OPTION=VALUE", tmp_path)
    _bad(
        capsys,
        [str(run), "--measures", "fewshot_probe", "--opt", "fewshot_probe.shots=20"],
        "lower the shots with --opt fewshot_probe.shots=10",
        tmp_path,
    )
    resnet = tmp_path / "resnet"
    shutil.copytree(runs["resnet"], resnet)
    _bad(
        capsys, [str(resnet), "--measures", "cka", "--opt", "cka.repr=cls"], "repr=cls reads the class token", tmp_path
    )
    argv = [str(run), "--batch-size", "62"]  # 64 images: a last minibatch of 2, too few for minibatch CKA
    before = _tree(tmp_path)
    assert (
        main(argv + ARGS[2:]) == 2
        and "leave a last minibatch of 2" in capsys.readouterr().err
        and _tree(tmp_path) == before
    )
    # a run analysed on other images
    other = tmp_path / "other"
    shutil.copytree(run, other)
    r = yaml.safe_load((other / "recipe.yaml").read_text())
    r["data"]["analysis_size"] = 48
    (other / "recipe.yaml").write_text(yaml.safe_dump(r))
    _bad(capsys, [str(run), "--against", str(other)], "analyse different images", tmp_path)
    # weights that do not fit the architecture
    save_file(timm.create_model("resnet10t", num_classes=10, in_chans=3).state_dict(), tmp_path / "w.safetensors")
    p = write_recipe(data={"probe_train_size": 200})
    _bad(
        capsys,
        [
            "--model",
            "timm:resnet10t",
            "--weights",
            str(tmp_path / "w.safetensors"),
            "--recipe",
            str(p),
            "--out",
            str(tmp_path / "ext"),
        ],
        "do not fit this model",
        tmp_path,
    )
    assert not (tmp_path / "ext").exists()
    # timm's pretrained weights offline (the tests run with HF_HUB_OFFLINE=1), for a model without img_size too
    _bad(
        capsys,
        ["--model", "timm:resnet10t", "--weights", "pretrained", "--recipe", str(p), "--out", str(tmp_path / "ext")],
        "HF_HUB_OFFLINE is set and timm's pretrained weights of 'resnet10t' are not in the local cache",
        tmp_path,
    )
    # a corrupted LATER checkpoint: nothing is written for the earlier one either
    w = run / "checkpoints" / "step_0000008" / "model.safetensors"
    good = w.read_bytes()
    w.write_bytes(good[:-10] + b"0" * 10)
    _bad(capsys, [str(run), "--force"], "corrupted", run / "analysis")
    w.write_bytes(good)
    # a corrupted checkpoint
    w = run / "checkpoints" / "step_0000008" / "model.safetensors"
    w.write_bytes(w.read_bytes()[:-10] + b"0" * 10)
    _bad(capsys, [str(run), "--steps", "8", "--force"], "corrupted", run / "analysis")


def test_a_truncated_cached_result_is_recomputed(runs, tmp_path, monkeypatch):
    run = tmp_path / "vit"
    shutil.copytree(runs["vit"], run)
    f = run / "analysis" / "step_0000004" / "cka.npz"
    f.write_bytes(f.read_bytes()[:100])
    calls = []
    real = S.run_suite
    monkeypatch.setattr(S, "run_suite", lambda *a, **k: calls.append(k.get("measures")) or real(*a, **k))
    assert main([str(run), *ARGS]) == 0
    assert calls == [["cka"]] and np.load(f)["matrix"].shape == (4, 4)


def test_launch_sh_analyze_is_wired():
    text = (Path(__file__).resolve().parents[3] / "launch.sh").read_text()
    assert (
        "analyze)" in text
        and "-m analysis" in text
        and os.access(Path(__file__).resolve().parents[3] / "launch.sh", os.X_OK)
    )


def test_checkpoints_pruned_while_analysing_are_skipped(runs, tmp_path, monkeypatch, capsys):
    """A trainer still running prunes checkpoints beyond train.keep_last while a run is analysed: one deleted after the
    run was opened (before its checksums are read) and one deleted while another is analysed are skipped, in one line,
    not reported as damaged (no advice to delete anything); the rest is analysed and the report written."""
    run = tmp_path / "vit"
    shutil.copytree(runs["vit"], run)
    real_open = RF.open_run

    def open_then_prune(*a, **k):
        r = real_open(*a, **k)
        shutil.rmtree(run / "checkpoints" / "step_0000004")
        return r

    monkeypatch.setattr(RF, "open_run", open_then_prune)
    assert main([str(run), *ARGS]) == 0  # the checkpoints are listed again once the data are built: 8 alone
    cap = capsys.readouterr()
    assert "delete the folder" not in cap.out + cap.err and "not written by vitlab" not in cap.err, cap
    assert "(steps 8)" in cap.out, cap.out
    assert check_report(run / "report.md") == []
    monkeypatch.setattr(RF, "open_run", real_open)
    # deleted after that, while the checkpoints' checksums are read
    run1 = tmp_path / "vit1"
    shutil.copytree(runs["vit"], run1)
    real_key = MS.weights_key

    def prune_then_key(r, step):
        shutil.rmtree(run1 / "checkpoints" / "step_0000004", ignore_errors=True)
        return real_key(r, step)

    monkeypatch.setattr(RN, "weights_key", prune_then_key)  # looked up by the runner
    assert main([str(run1), *ARGS]) == 0
    cap = capsys.readouterr()
    assert "delete the folder" not in cap.out + cap.err and "not written by vitlab" not in cap.err, cap
    assert "skipped step(s) 4: deleted while being analysed" in cap.out and "(steps 8)" in cap.out, cap.out
    assert check_report(run1 / "report.md") == []
    monkeypatch.setattr(RN, "weights_key", real_key)
    # deleted while the earlier one is computed (--force: nothing is reused)
    run2 = tmp_path / "vit2"
    shutil.copytree(runs["vit"], run2)
    real = S.run_suite

    def suite_then_prune(*a, **k):
        shutil.rmtree(run2 / "checkpoints" / "step_0000008", ignore_errors=True)
        return real(*a, **k)

    monkeypatch.setattr(S, "run_suite", suite_then_prune)
    assert main([str(run2), "--force", *ARGS]) == 0
    cap = capsys.readouterr()
    assert "skipped step(s) 8" in cap.out and "(steps 4)" in cap.out and "delete the folder" not in cap.out + cap.err, (
        cap
    )


def test_two_analyses_writing_one_folder_at_once(runs, tmp_path):
    """Two analyses of one run (threads here; processes alike) write results into the same folder at once: no write
    trips over the other's temporary files, and cache.json / summary.json keep both measures' entries."""
    import threading

    from analysis.results import storage

    res = storage.load_results(runs["vit"] / "analysis" / "step_0000008", ["cka", "norm_ratio"])
    out = tmp_path / "step_0000008"
    errors = []

    def write(name):
        try:
            for i in range(60):
                storage.write_results({"meta": res["meta"], name: res[name]}, out, 8, {name: f"{name}-{i}"})
                storage.atomic_text(out / "note.txt", name)
        except Exception as e:
            errors.append(repr(e))

    threads = [threading.Thread(target=write, args=(n,)) for n in ("cka", "norm_ratio")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert storage.cached_keys(out) == {"cka": "cka-59", "norm_ratio": "norm_ratio-59"}
    import json

    assert {"cka", "norm_ratio"} <= set(json.loads((out / "summary.json").read_text()))
    assert sorted(p.name for p in out.iterdir()) == [
        "cache.json",
        "cka.npz",
        "norm_ratio.npz",
        "note.txt",
        "summary.json",
    ]


@pytest.mark.parametrize("garbage", [b"{not json", b"[1, 2]"])
def test_an_unreadable_summary_json_is_rewritten(garbage, runs, tmp_path, monkeypatch, capsys):
    """summary.json garbled or not a mapping: the step's measures are recomputed (as for a garbled .npz) and the
    summary rewritten whole, the report written; no traceback."""
    run = tmp_path / "vit"
    shutil.copytree(runs["vit"], run)
    f = run / "analysis" / "step_0000004" / "summary.json"
    good = json.loads(f.read_text())
    f.write_bytes(garbage)
    calls = []
    real = S.run_suite
    monkeypatch.setattr(S, "run_suite", lambda *a, **k: calls.append(k.get("measures")) or real(*a, **k))
    assert main([str(run), *ARGS]) == 0
    assert calls == [["cka", "norm_ratio", "attention_distance", "fewshot_probe"]], calls
    assert set(json.loads(f.read_text())) == set(good)
    assert check_report(run / "report.md") == [] and "## Step 4" in (run / "report.md").read_text()
    # garbled again, and only one measure asked for: the others' key numbers come back from their files
    f.write_bytes(garbage)
    assert main([str(run), "--measures", "cka", *ARGS]) == 0
    assert set(json.loads(f.read_text())) == set(good)


@pytest.fixture
def read_only(tmp_path):
    """read_only(folder): the folder made read-only (a read-only bind mount for root, whom permissions do not stop;
    chmod for anyone else), restored afterwards."""
    import stat
    import subprocess

    done = []

    def make(folder: Path):
        if os.geteuid() == 0:
            r = subprocess.run(["mount", "--bind", str(folder), str(folder)], capture_output=True)
            if r.returncode != 0:
                pytest.skip("cannot bind-mount here")
            done.append(("mount", folder))
            subprocess.run(["mount", "-o", "remount,bind,ro", str(folder)], check=True)
        else:
            for p in [folder, *folder.rglob("*")]:
                p.chmod(p.stat().st_mode & ~(stat.S_IWUSR | stat.S_IWGRP | stat.S_IWOTH))
            done.append(("chmod", folder))

    yield make
    for how, folder in done:
        if how == "mount":
            subprocess.run(["umount", "-l", str(folder)], check=False)
        else:
            for p in [folder, *folder.rglob("*")]:
                p.chmod(p.stat().st_mode | stat.S_IWUSR)


def test_a_read_only_run_folder_is_one_sentence(runs, tmp_path, read_only, capsys):
    """Analysing a run whose folder cannot be written (with TensorBoard, without, and against another run): one
    sentence and exit 2 before any work, nothing changed; it used to end in a traceback from the writer thread."""
    run = tmp_path / "vit"
    shutil.copytree(runs["vit"], run)
    read_only(run)
    before = _tree(run)
    for extra in (["--force"], ["--force", "--no-tensorboard"], ["--against", str(run)]):
        args = [str(run), *extra, "--batch-size", "32", "--opt", "fewshot_probe.seeds=[0]", "--no-progress"]
        assert main(args) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"error: cannot write the analysis of {run}") and err.count("\n") == 1, err
    assert _tree(run) == before


def test_what_used_to_pass_silently_is_said(runs, tmp_path, capsys):
    """Empty names in --measures / --steps, a measure that does not apply to the model, a later checkpoint whose weights
    do not fit (with --force) and a recipe.yaml that no longer fits cached results: one sentence, exit 2, nothing
    written (no results of the earlier step, no events file); a measure among others that does not apply is named."""
    import hashlib

    run, resnet = tmp_path / "vit", tmp_path / "resnet"
    shutil.copytree(runs["vit"], run)
    shutil.copytree(runs["resnet"], resnet)
    _bad(capsys, [str(run), "--measures", ","], "has an empty name", tmp_path)
    _bad(capsys, [str(run), "--steps", "4,,8"], "has an empty step", tmp_path)
    _bad(
        capsys,
        [str(resnet), "--measures", "cls_attention"],
        "cls_attention does not apply to this model (a resnet)",
        tmp_path,
    )
    assert main([str(resnet), "--measures", "cka,attention_distance", *ARGS]) == 0
    assert "attention_distance: not applicable to this model (a resnet), nothing computed" in capsys.readouterr().out
    # step 8 holding another model's weights (its checksum recorded, so only the shapes tell)
    ck = run / "checkpoints" / "step_0000008"
    shutil.copy(resnet / "checkpoints" / "step_0000008" / "model.safetensors", ck / "model.safetensors")
    meta = json.loads((ck / "meta.json").read_text())
    meta["files"]["model.safetensors"] = hashlib.sha256((ck / "model.safetensors").read_bytes()).hexdigest()
    (ck / "meta.json").write_text(json.dumps(meta))
    _bad(capsys, [str(run), "--force", "--batch-size", "32", "--no-progress"], "do not fit this model", run)
    shutil.rmtree(run)
    shutil.copytree(runs["vit"], run)
    r = yaml.safe_load((run / "recipe.yaml").read_text())
    r["model"]["depth"] = 3
    (run / "recipe.yaml").write_text(yaml.safe_dump(r))
    _bad(capsys, [str(run)], "do not fit this model", run)  # every result is cached


def test_against_a_run_of_another_seed_reads_both_on_its_images(runs, tmp_path):
    """Seeds draw different analysis images, so cross-run CKA refuses them, unless both models are read on the
    reference run's images (the cross-seed ceiling): same weights there give a diagonal of one. A run with other
    data settings is still refused."""
    run = tmp_path / "vit_s1"
    shutil.copytree(runs["vit"], run)
    r = yaml.safe_load((run / "recipe.yaml").read_text())
    (run / "recipe.yaml").write_text(yaml.safe_dump({**r, "seed": r["seed"] + 1}))
    a, ref = RF.open_run(run), RF.open_run(runs["vit"])
    with pytest.raises(RF0.AnalysisError, match="analyse different images .same data settings.*seed: 1 vs 0"):
        XC.against(a, ref, 8, opts=S.SuiteOptions(batch_size=32), progress=False)
    res = XC.against(a, ref, 8, opts=S.SuiteOptions(batch_size=32), progress=False, on_other_images=True)
    assert np.allclose(res["results"][8]["same_index"], 1.0, atol=1e-6)
    other = tmp_path / "vit_other_data"
    shutil.copytree(runs["vit"], other)
    r["data"]["analysis_size"] = r["data"]["analysis_size"] // 2
    (other / "recipe.yaml").write_text(yaml.safe_dump(r))
    with pytest.raises(RF0.AnalysisError, match="different data sections"):
        XC.against(RF.open_run(other), ref, 8, opts=S.SuiteOptions(batch_size=32), progress=False, on_other_images=True)
    # Walmer's cross-seed ceiling of the last-block CLS CKA: the same weights under two seeds, both read on the
    # earlier seed's images, give 1; without that, the refusal names the runs relative to the repository
    from analysis.studies.walmer2023 import reads as WR

    study = types.SimpleNamespace(root=tmp_path, suite_options=lambda m: S.suite_options(m, 32))
    assert WR.cls_ceiling([ref, a], study) == pytest.approx([1.0], abs=1e-6)
    with pytest.raises(RF0.AnalysisError, match="analyse different images") as e:
        WR.cls_cka(a, ref, study)
    assert not any(w.startswith("/") for w in str(e.value).split())


def test_a_kept_result_joins_the_folders_cache_and_reads_back(tmp_path):
    """storage.keep_result, the one writer of results that are no measure's (cross-run CKA, the CKA floors, the
    real-ViT report's statistics): saved under its key beside the keys already there, returned as read back."""
    from analysis.results import storage

    out = tmp_path / "step_0000008"
    storage.keep_result(out, "cross_cka", "k1", {"matrix": np.eye(2)})
    back = storage.keep_result(out, "cka_floors", "k2", {"pixels": np.arange(3.0)})
    assert storage.cached_keys(out) == {"cross_cka": "k1", "cka_floors": "k2"}
    assert storage.is_kept(out, "cross_cka", "k1") and not storage.is_kept(out, "cross_cka", "k2")
    np.testing.assert_array_equal(back["pixels"], np.arange(3.0))
    assert sorted(p.name for p in out.iterdir()) == ["cache.json", "cka_floors.npz", "cross_cka.npz"]  # no temp left
