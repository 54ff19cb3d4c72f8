"""What a new user sees of the analysis command line: --list and --help whole, "did you mean" for typos, paths
relative to the caller's folder through launch.sh, the offline progress bar, the figures' paper elements and
report.md's tables."""

import hashlib
import os
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
import yaml
from conftest import TINY, _merge

import analysis.engine.measure as M
from analysis.frontends.cli import list_measures, main, parser
from analysis.frontends.compare import main as compare_main
from train.recipe import load_recipe
from train.trainer import train

PLUGIN = textwrap.dedent('''
    from dataclasses import dataclass
    from typing import Literal

    from analysis.engine.measure import Measure


    @dataclass(frozen=True)
    class PluginOptions:
        mode: Literal["fast", "exact"] = "fast"  # how the plug-in computes
        layers: tuple[int, ...] = (0, 1)


    class PluginMeasure(Measure):
        """A user's own measure. Its second sentence must be listed too.

        Details that --list leaves out."""

        name = "user_plugin"
        Options = PluginOptions
''')


def test_list_shows_whole_descriptions_every_option_with_its_values(capsys):
    assert main(["--list"]) == 0
    out = capsys.readouterr().out
    blocks = {b.split("\n")[0]: b for b in out.strip().split("\n\n")}
    assert set(blocks) == set(M.registry())
    for name, cls in M.registry().items():
        first = " ".join(cls.__doc__.split("\n\n")[0].split()).replace("``", "")
        assert first in " ".join(blocks[name].split()), name  # the first paragraph whole, not cut mid-sentence
        for opt in M.options_dict(cls.Options()):
            assert f"--opt {name}.{opt}=" in blocks[name]
    cka = " ".join(blocks["cka"].split())
    assert "--opt cka.repr=flatten: one of flatten, cls, mean_spatial; a layer's representation" in cka
    assert "--opt cka.layers=sublayers: one of blocks, sublayers, paper, all" in cka
    assert "--opt cka.unbiased=true: true or false" in cka
    assert "--opt fewshot_probe.l2=null: a number or null" in " ".join(blocks["fewshot_probe"].split())


def test_list_shows_a_users_own_measure(tmp_path, monkeypatch, capsys):
    (tmp_path / "my_plugin.py").write_text(PLUGIN)
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        assert main(["--list", "--measures", "cka,my_plugin:PluginMeasure"]) == 0
    finally:
        M.REGISTRY.pop("user_plugin", None)
    out = " ".join(capsys.readouterr().out.split())
    assert "user_plugin A user's own measure. Its second sentence must be listed too." in out
    assert "Details that" not in out
    assert "--opt user_plugin.mode=fast: one of fast, exact; how the plug-in computes" in out
    assert "--opt user_plugin.layers=[0, 1]: a list of integers" in out
    assert main(["--list", "--measures", "no_such_module:Thing"]) == 2
    assert "cannot be imported" in capsys.readouterr().err


def test_help_is_whole():
    text = parser().format_help()
    assert "the analysis suite on a run's saved\ncheckpoints, cached, with figures, TensorBoard and report.md." in text
    assert "dino_vits16.safetensors \\\n        --set data.img_size=224" in text  # the continuation line kept
    assert text.rstrip().endswith("nothing is written).")
    assert list_measures(None).count("\n\n") == len(M.registry()) - 1


@pytest.mark.parametrize(
    ("argv", "hint"),
    [
        (["--measures", "ckaa"], "unknown measure 'ckaa' (did you mean cka?)"),
        (["--measures", "cka,clusterng"], "unknown measure 'clusterng' (did you mean clustering?)"),
        (["--opt", "knm.k=3"], "unknown measure 'knm' (did you mean knn?)"),
        (["--opt", "cka.rep=cls"], "unknown option 'cka.rep' (did you mean cka.repr?)"),
    ],
)
def test_a_typo_gets_the_closest_name(argv, hint, capsys, tmp_path):
    (tmp_path / "recipe.yaml").touch()  # a run folder as far as the checks before the measures' go
    assert main([str(tmp_path), *argv]) == 2
    err = capsys.readouterr().err
    assert hint in err and err.count("\n") == 1


def test_a_mistyped_flag_gets_the_closest_flag(capsys):
    with pytest.raises(SystemExit) as e:
        main(["runs/x", "--mesures", "cka"])
    assert e.value.code == 2
    assert "--mesures (did you mean --measures?)" in capsys.readouterr().err


# ---------------------------------------------------------------- launch.sh: paths and the shared virtualenv

ROOT = Path(__file__).resolve().parents[3]


def fake_venv(path: Path) -> Path:
    """A virtualenv whose python records pip calls (nothing is installed) and runs everything else on this Python."""
    (path / "bin").mkdir(parents=True)
    py = path / "bin" / "python"
    py.write_text(
        "#!/bin/sh\n"
        f'if [ "$1 $2" = "-m pip" ]; then echo "pip $* in $PWD" >> "{path}/pip.log"; exit 0; fi\n'
        f'exec "{sys.executable}" "$@"\n'
    )
    py.chmod(0o755)
    return path


def launch(script: Path, args: list[str], cwd: Path, venv: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "VITLAB_VENV": str(venv), "VITLAB_NPROC": "1"}
    env.pop("VITLAB_REINSTALL", None)
    return subprocess.run([str(script), *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


def stamp_of(checkout: Path) -> str:
    return f"{checkout} {hashlib.sha256((checkout / 'pyproject.toml').read_bytes()).hexdigest()}\n"


@pytest.mark.skipif(not Path("/usr/share/datasets/fashion-mnist").is_dir(), reason="launch.sh's setup wants the data")
def test_launch_sh_resolves_paths_against_the_callers_folder(tmp_path):
    venv = fake_venv(tmp_path / "venv")
    (venv / ".vitlab-installed").write_text(stamp_of(ROOT))
    here = tmp_path / "elsewhere"
    (here / "runs" / "x").mkdir(parents=True)  # a folder that is not a run: the caller's runs/x, not the repository's
    r = launch(ROOT / "launch.sh", ["analyze", "runs/x", "--no-progress"], here, venv)
    assert r.returncode == 2, r.stderr
    assert "'runs/x' is not a vitlab run folder (no recipe.yaml)" in r.stderr
    r = launch(ROOT / "launch.sh", ["analyze", "runs/y"], here, venv)
    assert r.returncode == 2 and "run folder 'runs/y' does not exist" in r.stderr
    assert not (venv / "pip.log").exists()


@pytest.mark.skipif(not Path("/usr/share/datasets/fashion-mnist").is_dir(), reason="launch.sh's setup wants the data")
def test_launch_sh_pretrained_runs_the_converter_in_the_virtualenv(tmp_path):
    """The README's offline real-ViT step: ./launch.sh pretrained is python -m analysis.sources.pretrained in the venv
    (the system Python has no torch), with paths relative to the caller's folder."""
    venv = fake_venv(tmp_path / "venv")
    (venv / ".vitlab-installed").write_text(stamp_of(ROOT))
    r = launch(ROOT / "launch.sh", ["pretrained", "--onnx", "missing.onnx"], tmp_path, venv)
    assert r.returncode == 2, r.stderr
    assert r.stderr.strip() == "error: ONNX file 'missing.onnx' does not exist."
    r = launch(ROOT / "launch.sh", ["pretrained", "--help"], tmp_path, venv)
    assert r.returncode == 0 and "usage: python -m analysis.sources.pretrained" in r.stdout


@pytest.mark.skipif(not Path("/usr/share/datasets/fashion-mnist").is_dir(), reason="launch.sh's setup wants the data")
def test_a_second_checkout_sharing_the_virtualenv_does_not_reinstall_itself(tmp_path):
    venv = fake_venv(tmp_path / "venv")
    a, b = tmp_path / "a", tmp_path / "b"
    for c in (a, b):
        c.mkdir()
        shutil.copy2(ROOT / "launch.sh", c / "launch.sh")
        (c / "pyproject.toml").write_text('[project]\nname = "vitlab"\n')

    def installs() -> list[str]:
        log = venv / "pip.log"
        return [line for line in log.read_text().splitlines() if " -e " in line] if log.exists() else []

    assert launch(a / "launch.sh", ["setup"], tmp_path, venv).returncode == 0
    assert installs() == [f"pip -m pip install -q -e .[dev] in {a}"]
    assert (venv / ".vitlab-installed").read_text() == stamp_of(a)
    time.sleep(0.05)
    (b / "pyproject.toml").touch()  # newer than the stamp: the old stamp compared times and reinstalled b
    r = launch(b / "launch.sh", ["setup"], tmp_path, venv)
    assert r.returncode == 0 and len(installs()) == 1 and r.stderr == ""
    (b / "pyproject.toml").write_text('[project]\nname = "vitlab"\ndependencies = ["x"]\n')
    r = launch(b / "launch.sh", ["setup"], tmp_path, venv)
    assert r.returncode == 0 and len(installs()) == 1
    assert f"was installed by {a}, whose pyproject.toml differs" in r.stderr  # said, not done
    (a / "pyproject.toml").write_text('[project]\nname = "vitlab"\nversion = "2"\n')  # the installer's own change
    assert launch(a / "launch.sh", ["setup"], tmp_path, venv).returncode == 0
    assert len(installs()) == 2 and (venv / ".vitlab-installed").read_text() == stamp_of(a)
    assert launch(a / "launch.sh", ["setup"], tmp_path, venv).returncode == 0 and len(installs()) == 2
    shutil.rmtree(a)  # the checkout that installed it is gone: the next one takes the virtualenv over
    assert launch(b / "launch.sh", ["setup"], tmp_path, venv).returncode == 0
    assert installs()[-1] == f"pip -m pip install -q -e .[dev] in {b}"


# ---------------------------------------------------------------- progress, compare's options


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    """A 2-block ViT trained 8 steps, checkpoints at steps 4 and 8, no training-time analysis."""
    root = tmp_path_factory.mktemp("runs")
    p = root / "tiny.yaml"
    p.write_text(yaml.safe_dump(_merge(TINY, {"callbacks": [], "run": {"root": str(root)}})))
    return Path(train(load_recipe(p), progress=False)["run_dir"])


def test_the_offline_bar_names_the_measure_being_computed(tiny_run, tmp_path, capsys):
    run = tmp_path / "run"
    shutil.copytree(tiny_run, run)
    assert main([str(run), "--measures", "cka,norm_ratio", "--batch-size", "32", "--no-tensorboard"]) == 0
    err = capsys.readouterr().err
    # each measure's figures and TensorBoard as it finishes (kept at once: a stop keeps it)
    stages = ("pass over the analysis images (cka, norm_ratio)", "cka", "norm_ratio", "cka: figures, TensorBoard")
    for stage in (*stages, "norm_ratio: figures, TensorBoard"):
        for step in (4, 8):
            assert f"step {step}: {stage}" in err, (stage, step)
    assert "4/4 [" in err and "1/4 [" in err and "measure" in err  # one tick per measure, not per checkpoint
    # everything cached: the bar fills at once
    assert main([str(run), "--measures", "cka,norm_ratio", "--batch-size", "32", "--no-tensorboard"]) == 0
    assert "4/4 [" in capsys.readouterr().err


def test_compare_takes_measure_options(tiny_run, tmp_path, capsys):
    run = tmp_path / "run"
    shutil.copytree(tiny_run, run)
    args = [str(run), "--measures", "cka", "--batch-size", "32", "--no-progress", "--out", str(tmp_path / "c")]
    assert compare_main([*args, "--opt", "cka.layers=blocks"]) == 0
    labels = np.load(run / "analysis" / "step_0000008" / "cka.npz")["labels"]
    assert len(labels) == 2  # the 2 block outputs, not the default sublayers
    assert compare_main([*args, "--opt", "cka.layer=blocks"]) == 2
    assert "unknown option 'cka.layer' (did you mean cka.layers?)" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        compare_main(["--help"])
    out = capsys.readouterr().out
    assert "usage: python -m analysis.frontends.compare" in out and "--opt MEASURE.OPTION=VALUE" in out


# ---------------------------------------------------------------- figures a paper reader recognises


def _inside(fig, artist) -> bool:
    """Whether ``artist`` is drawn wholly inside the figure (not clipped at its edge)."""
    fig.canvas.draw()
    box, edge = artist.get_window_extent(), fig.bbox
    return box.x0 >= edge.x0 - 0.5 and box.y0 >= edge.y0 - 0.5 and box.x1 <= edge.x1 + 0.5 and box.y1 <= edge.y1 + 0.5


def test_attention_distance_figure_has_head_legend_uniform_line_and_whole_labels():
    from analysis.measures.attention_distance import AttentionDistanceMeasure, grid_distances

    rng = np.random.default_rng(0)
    r = {"pixels": rng.uniform(1, 12, (6, 4)), "blocks": [f"blocks.{i}" for i in range(6)], "patch_size": 4}
    r["unit_square"] = r["pixels"] / (6 * 4)  # a 7x7 grid: unit-square distances are pixels / ((7 - 1) * 4)
    expected = float(grid_distances((7, 7), 4).mean())
    # an independent reference: the mean distance over every pair of the 49 patch centres, 4 px apart
    rc = np.stack(np.meshgrid(np.arange(7), np.arange(7), indexing="ij"), -1).reshape(-1, 2) * 4.0
    assert expected == pytest.approx(np.linalg.norm(rc[:, None] - rc[None], axis=-1).mean())
    assert AttentionDistanceMeasure.uniform(r) == pytest.approx(expected)  # a result saved without its grid
    assert AttentionDistanceMeasure.uniform({**r, "grid": [7, 7]}) == pytest.approx(expected)
    fig = AttentionDistanceMeasure.figures(r, step=3)["attn_dist/heads"]
    ax = fig.axes[0]
    legend = ax.get_legend()
    texts = [t.get_text() for t in legend.get_texts()]
    assert texts[:4] == ["head 0", "head 1", "head 2", "head 3"] and texts[4].startswith("uniform attention (14.4 px")
    (line,) = [ln for ln in ax.get_lines() if ln.get_label().startswith("uniform attention")]
    assert line.get_ydata()[0] == pytest.approx(expected) and ax.get_ylim()[1] > expected
    assert _inside(fig, ax.yaxis.label) and _inside(fig, ax.xaxis.label) and _inside(fig, legend)
    # more heads than tab10 has colours: a colourbar names them instead
    from analysis.engine.figures import attention_distance_plot

    fig = attention_distance_plot(rng.uniform(1, 12, (4, 16)), uniform=10.0)
    assert any(a.get_ylabel() == "head" for a in fig.axes[1:]) and _inside(fig, fig.axes[0].yaxis.label)


def test_a_truncated_norm_ratio_heatmap_says_which_tokens_it_shows():
    from analysis.measures.norm_ratio import NormRatioMeasure

    blocks = [f"blocks.{i}" for i in range(3)]
    r = {"ratio": np.ones((2, 3, 257)), "blocks": blocks, "sublayers": ["attn", "mlp"], "num_prefix_tokens": 1}
    ax = NormRatioMeasure.figures(r, step=0)["norm_ratio/attn"].axes[0]
    assert ax.get_ylabel() == "tokens 0-15 of 257 (0 = CLS)"
    assert ax.get_title() == "norm ratio, attn (step 0), tokens 0-15 of 257"
    assert ax.images[0].get_array().shape == (16, 3)
    # every token drawn: nothing to say
    ax = NormRatioMeasure.figures({**r, "ratio": np.ones((2, 3, 10)), "num_prefix_tokens": 0})["norm_ratio/mlp"].axes[0]
    assert ax.get_ylabel() == "token" and ax.get_title() == "norm ratio, mlp"


def test_cka_figures_have_colourbar_axis_labels_and_every_layer_named(tmp_path):
    from analysis.frontends.compare import cka_grid
    from analysis.measures.cka import CKAMeasure

    labels = [f"{b}.{k}" for b in range(6) for k in ("norm1", "attn", "norm2", "mlp")]
    m = np.random.default_rng(0).uniform(0, 1, (24, 24))
    fig = CKAMeasure.figures({"matrix": m, "labels": labels, "layers": "sublayers"}, step=5)["cka/self"]
    ax, cbar = fig.axes
    assert ax.get_title() == "CKA between sublayers (step 5)"
    assert cbar.get_ylabel() == "CKA" and cbar.get_ylim() == (0.0, 1.0)
    assert ax.get_xlabel() == "layer" and ax.get_ylabel() == "layer"
    assert [t.get_text() for t in ax.get_xticklabels()] == labels == [t.get_text() for t in ax.get_yticklabels()]
    many = [f"l{i}" for i in range(90)]
    fig = CKAMeasure.figures({"matrix": np.eye(90), "labels": many, "layers": "all"})["cka/self"]
    assert fig.axes[0].get_xlabel() == "layer (every 3rd labelled)" and len(fig.axes[0].get_xticklabels()) == 30
    # compare's grid: one panel per run, every layer named on both axes, one colourbar
    results = {n: {"cka": {"matrix": m, "labels": labels}} for n in ("a", "b", "c")}
    drawn = {}
    import analysis.frontends.compare as C

    real = C.save
    C.save = lambda fig, path: drawn.setdefault("fig", fig) and real(fig, path)
    try:
        cka_grid(results, tmp_path / "cka_grid.png")
    finally:
        C.save = real
    axes = drawn["fig"].axes
    panels, bars = axes[:3], axes[3:]
    assert [a.get_title() for a in panels] == ["a", "b", "c"] and len(bars) == 1 and bars[0].get_ylabel() == "CKA"
    for a in panels:
        assert a.get_xlabel() == "layer" and a.get_ylabel() == "layer"
        assert [t.get_text() for t in a.get_xticklabels()] == labels


def test_cls_attention_maps_share_one_scale_with_a_colourbar():
    cls_attention = M.registry()["cls_attention"]
    maps = np.random.default_rng(0).uniform(0, 1, (3, 2, 4, 4))
    maps[1, 1] *= 5  # one head far more peaked: the others must not each be stretched to their own maximum
    fig = cls_attention.figures({"maps": maps, "blocks": ["blocks.0", "blocks.1", "blocks.2"]}, step=1)
    fig = fig["cls_attention/maps"]
    images = [im for a in fig.axes for im in a.get_images()]
    assert len(images) == 6 and {im.get_clim() for im in images} == {(0.0, float(maps.max()))}
    (cbar,) = [a for a in fig.axes if a.get_ylabel() == "CLS attention weight"]
    assert cbar.get_ylim() == pytest.approx((0.0, float(maps.max())))


# ---------------------------------------------------------------- report.md


def test_report_tables_clustering_rows_to_3_significant_digits():
    from analysis.reports.run_report import _summary_rows

    summary = {
        "clustering": {
            "purity": {"cls": {"last": 0.412345678, "best": 0.0123456, "best_layer": "blocks.3", "per_layer": [1 / 3]}}
        },
        "attention_distance": {"mean_px": [12.3456, 1234.5]},
        "meta": {"arch": "vit"},
    }
    rows = _summary_rows(summary)
    assert "| clustering | purity/cls/last | 0.412 |" in rows
    assert "| clustering | purity/cls/best | 0.0123 |" in rows
    assert "| clustering | purity/cls/best_layer | blocks.3 |" in rows
    assert "| clustering | purity/cls/per_layer | 0.333 |" in rows
    assert "| attention_distance | mean_px | 12.3 1230 |" in rows
    assert not any("{" in r for r in rows) and len(rows) == 7


# ---------------------------------------------------------------- TensorBoard


def test_hparams_show_booleans_as_words_and_lists_as_yaml():
    from train.recipe import flatten
    from train.run_folder import _hparam_values

    hp = flatten(
        _hparam_values(
            {
                "train": {"lr": 0.001, "steps": 8, "compile": False},
                "callbacks": [{"name": "analysis_suite", "every": 600}, "sample_images"],
                "interventions": {"no_skip": None, "head_mask": {}},
            }
        )
    )
    assert hp == {
        "train.lr": 0.001,
        "train.steps": 8,
        "train.compile": "false",  # TensorBoard's hparams would show a bool (an int) as 0
        "callbacks": "[{name: analysis_suite, every: 600}, sample_images]",
        "interventions.no_skip": "null",
        "interventions.head_mask": "{}",
    }


def test_the_custom_scalars_layout_puts_training_first(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.plugins.custom_scalar import layout_pb2
    from torch.utils.tensorboard import SummaryWriter

    from train.recipe import Recipe
    from train.run_folder import write_hparams as _write_hparams

    w = SummaryWriter(str(tmp_path))
    _write_hparams(w, Recipe(), {})
    w.close()
    ea = EventAccumulator(str(tmp_path), size_guidance={"tensors": 0})
    ea.Reload()
    raw = ea.Tensors("custom_scalars__config__")[0].tensor_proto.string_val[0]
    layout = layout_pb2.Layout.FromString(raw)
    assert [c.title for c in layout.category] == ["training", "time (s)", "analysis (key numbers)"]
    first = layout.category[0].chart[0]
    assert first.title.startswith("loss") and "^train/loss$" in first.multiline.tag


# ---------------------------------------------------------------- --measures all on a run too small for some


@pytest.fixture
def few_probe_images(tiny_run, tmp_path):
    """(a copy of the tiny run, whose 100 probe-train images are too few for 10 shots per class; the CLI's options)"""
    run = tmp_path / "run"
    shutil.copytree(tiny_run, run)
    return run, [str(run), "--steps", "8", "--batch-size", "32", "--no-progress", "--no-tensorboard"]


def test_measures_all_skips_each_measure_whose_precondition_fails_with_a_line(few_probe_images, capsys):
    """100 probe-train images are too few for 10 shots per class: with --measures all the probes are skipped with a
    line each saying why and the rest is kept; named, such a measure stops the run before anything is computed."""
    from analysis.engine import suite as S
    from analysis.frontends.cli import runnable
    from analysis.results import runs as RF

    run, base = few_probe_images
    assert main([*base, "--measures", "cka,fewshot_probe"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: measure fewshot_probe draws 10 shots") and "\n" not in err
    assert "--opt fewshot_probe.shots=5" in err and "data.probe_train_size to" not in err  # the command line's words
    assert not (run / "analysis").exists()  # nothing computed
    kept = runnable(RF.open_run(run), S.suite_options("all"), "all")
    lines = capsys.readouterr().err.splitlines()
    assert [ln.partition(":")[0] for ln in lines] == ["skipped fewshot_probe", "skipped token_probes"], lines
    assert all("probe-train" in ln for ln in lines)
    assert set(kept.measures) == set(M.registry()) - {"fewshot_probe", "token_probes"}


@pytest.mark.slow
def test_measures_all_runs_what_can_run_and_names_each_skipped_measure(few_probe_images, capsys):
    """100 probe-train images are too few for 10 shots per class: with --measures all the probes are skipped with a
    line each saying why, and everything else is computed; named, such a measure still stops the run (exit 2)."""
    run, base = few_probe_images
    assert main([*base, "--measures", "fewshot_probe"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: measure fewshot_probe draws 10 shots") and "\n" not in err
    assert not (run / "analysis").exists()  # nothing computed
    assert main([*base, "--measures", "all", "--opt", "ablation.targets=[branches]", "--opt", "erf.images=4"]) == 0
    err = capsys.readouterr().err
    skipped = {line.split(":")[0].removeprefix("skipped ") for line in err.splitlines() if line.startswith("skipped ")}
    assert skipped == {"fewshot_probe", "token_probes"}, err
    assert "skipped fewshot_probe: " in err and "probe-train" in err
    summary = yaml.safe_load((run / "analysis" / "step_0000008" / "summary.json").read_text())
    assert set(summary) >= set(M.registry()) - skipped - {"meta"} and not skipped & set(summary)


def test_report_moves_long_lists_to_the_appendix_and_says_its_conventions_once():
    from analysis.reports.run_report import CONVENTIONS, LONG, _split_summary

    per_block = [0.8668000102043152 + i / 100 for i in range(24)]
    rows, appendix = _split_summary(
        {"ablation": {"heads_drop": [per_block[:12], per_block[12:]], "clean": {"top1": 0.8668000102043152}}}
    )
    assert "| ablation | clean/top1 | 0.867 |" in rows and not any("0.8668000" in r for r in rows + appendix)
    (heads,) = [r for r in rows if "heads_drop" in r]
    assert "min 0.867, mean 0.982, max 1.1; all 2 x 12: appendix" in heads and len(heads.split()) < 3 * LONG
    assert appendix == ["| ablation | heads_drop (2 x 12) | " + " ".join(f"{v:.3g}" for v in per_block) + " |"]
    assert "numbered from 0" in CONVENTIONS
    names = [f"blocks.{i}.out" for i in range(LONG + 4)]  # a long list of names (a measure's layers): no crash
    rows, appendix = _split_summary({"token_probes": {"layers": names}})
    assert any("blocks.0.out ... blocks.11.out; all 12: appendix" in r for r in rows) and "blocks.5.out" in appendix[0]
