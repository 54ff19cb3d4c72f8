"""The notebook API: the example in docs/analysis.md runs as written, and a model object, a DataLoader and a run folder
give the same numbers as the suite."""

import re

import numpy as np
import pytest
import torch
from conftest import ROOT, class_split, tiny_vit

from analysis.frontends.api import analyze

pytestmark = pytest.mark.usefixtures("one_thread")


def test_the_documented_example_runs(tmp_path, monkeypatch):
    text = (ROOT / "docs" / "analysis.md").read_text()
    code = re.search(r"## Analyses from Python.*?```python\n(.*?)```", text, re.S).group(1)
    monkeypatch.chdir(tmp_path)
    exec(compile(code, "docs/analysis.md", "exec"), {})
    assert (tmp_path / "cka.png").stat().st_size > 1000


def test_tensor_and_dataloader_give_the_same_numbers():
    model = tiny_vit()
    a, p = class_split(64, 0), class_split(200, 1)
    kw = dict(
        measures=["cka", "fewshot_probe", "knn"],
        options={"fewshot_probe": {"seeds": [0]}},
        batch_size=32,
        figures=False,
    )
    r1 = analyze(model, a.images, a.labels, probe_images=p.images, probe_labels=p.labels, **kw)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(a.images, a.labels), batch_size=10)
    r2 = analyze(model, loader, probe_images=p.images, probe_labels=p.labels, **kw)
    for m in ("cka", "fewshot_probe", "knn"):
        for k, v in r1["results"][m].items():
            if isinstance(v, np.ndarray) and v.dtype.kind == "f":
                np.testing.assert_array_equal(v, r2["results"][m][k])
    assert r1["summary"]["knn"]["cls"]["last"] > 0.5  # the class is visible in the images


def test_bad_input_is_one_sentence():
    model = tiny_vit()
    with pytest.raises(ValueError, match="unknown measure 'nope'"):
        analyze(model, torch.rand(8, 1, 28, 28), measures=["nope"])
    with pytest.raises(ValueError, match=r"must be \[N, C, H, W\]"):
        analyze(model, torch.rand(8, 28, 28))
    with pytest.raises(
        ValueError, match="probe_images="
    ):  # probes need images to train on, named as the API names them
        analyze(model, torch.rand(8, 1, 28, 28), torch.arange(8) % 2, measures=["fewshot_probe"])
    # images the model cannot take (torch's and timm's own errors, in one sentence), a model the taps do not know
    for x, says in ((torch.rand(8, 3, 28, 28), "to have 1 channels"), (torch.rand(8, 1, 32, 32), "Input height (32)")):
        with pytest.raises(ValueError, match=r"the model cannot take images of shape .*" + re.escape(says)):
            analyze(model, x, measures=["cka"], batch_size=4)
    with pytest.raises(ValueError, match="not a Sequential"):
        analyze(torch.nn.Sequential(torch.nn.Conv2d(1, 4, 3)), torch.rand(8, 1, 28, 28), measures=["cka"], batch_size=4)
    x = torch.rand(8, 1, 28, 28)
    x[3, 0, 5, 5], x[6, 0, 0, 0] = float("nan"), float("inf")
    with pytest.raises(ValueError, match="2 of the 8 images hold NaN or infinite values"):
        analyze(model, x, measures=["cka"], batch_size=4)
    # measures that compare with labels, given none: one sentence naming the argument that is missing, not purity 1.0
    # or a bare internal error
    a = class_split(16, 0)
    for measures, kw, says in (
        (
            ["clustering"],
            {},
            "measure clustering reads class labels, and the images to analyse have no class labels: "
            "pass labels= for the images, or leave it out of measures=.",
        ),
        (
            ["knn"],
            {"labels": a.labels},
            "measure knn reads class labels, and there are no probe_images to train on: "
            "pass probe_images= and probe_labels=",
        ),
        (
            ["cka", "knn"],
            {},
            "the images to analyse have no class labels; there are no probe_images to train on: "
            "pass labels= for the images and pass probe_images= and probe_labels=",
        ),
    ):
        with pytest.raises(ValueError, match=re.escape(says)):
            analyze(model, a.images, measures=measures, batch_size=8, **kw)
    with pytest.raises(
        ValueError, match="cls_attention does not apply to this vit: choose others in measures="
    ):  # a GAP ViT has no class token
        analyze(tiny_vit(class_token=False), torch.rand(8, 1, 28, 28), measures=["cls_attention"], batch_size=4)
    with pytest.raises(ValueError, match="no measure named"):
        analyze(model, torch.rand(8, 1, 28, 28), measures=[], batch_size=4)
    with pytest.raises(ValueError, match="repr=cls reads the class token"):  # a GAP ViT has none
        analyze(
            tiny_vit(class_token=False),
            torch.rand(8, 1, 28, 28),
            measures=["cka"],
            options={"cka": {"repr": "cls"}},
            batch_size=4,
        )


def test_the_first_notebook_is_told_what_is_missing_in_the_apis_words():
    """The default measures with labels= but no probe images, and probe images too few per class for the shots: the
    sentence names the argument that is missing (not labels=, not a recipe key); typos get the closest name."""
    from analysis.frontends.api import activations

    model, a, p = tiny_vit(), class_split(16, 0), class_split(100, 1)  # 10 probe images per class
    with pytest.raises(ValueError) as e:
        analyze(model, a.images, labels=a.labels, batch_size=8)
    assert str(e.value) == (
        "measure fewshot_probe reads class labels, and there are no probe_images to train on: pass probe_images= and "
        "probe_labels= (a tensor [N, C, H, W] and its labels), or leave it out of measures=."
    )
    with pytest.raises(ValueError) as e:
        analyze(model, a.images, a.labels, probe_images=p.images, probe_labels=p.labels, batch_size=8)
    assert str(e.value) == (
        "measure fewshot_probe draws 10 shots per class from half of the probe_images, whose rarest class has 10 "
        "images: pass probe_images= / probe_labels= with at least 20 images per class or lower the shots with "
        "options={'fewshot_probe': {'shots': 5}}, or leave it out of measures=."
    )
    with pytest.raises(ValueError, match=re.escape("the probe_images have no class labels: pass probe_labels=")):
        analyze(model, a.images, a.labels, probe_images=p.images, measures=["knn"], batch_size=8)
    with pytest.raises(
        ValueError,
        match=re.escape(
            "last minibatch of 2 images; minibatch CKA needs at least 4: pass another batch_size= (e.g. batch_size=7)"
        ),
    ):
        analyze(model, class_split(18, 0).images, measures=["cka"], batch_size=8)
    for kw, says in (
        ({"measures": ["ckaa"]}, "unknown measure 'ckaa' (did you mean cka?)"),
        ({"options": {"knm": {"k": 3}}}, "unknown measure 'knm' (did you mean knn?)"),
        (
            {"options": {"fewshot_probe": {"shot": 3}}},
            "unknown option 'fewshot_probe.shot' (did you mean fewshot_probe.shots?)",
        ),
    ):
        with pytest.raises(ValueError, match=re.escape(says)):
            analyze(model, a.images, a.labels, **kw)
    with pytest.raises(
        ValueError,
        match=re.escape(
            "tap 'blocks.1.attn_prob' matches no tap of this VisionTransformer (did you mean blocks.1.attn_probs?)"
        ),
    ):
        activations(model, a.images, taps="blocks.1.attn_prob")


def test_activations_stream_the_taps_to_a_dict_and_to_disk(tmp_path):
    import json

    from analysis.engine.taps import Taps
    from analysis.frontends.api import activations, iter_activations

    model = tiny_vit().train()
    a = class_split(25, 0)
    names = ["blocks.0.attn_probs", "blocks.1.attn_probs", "blocks.1.out"]
    with torch.no_grad(), Taps(model.eval(), names) as cap:
        model(a.images.float() / 255)
    model.train()
    acts = activations(model, a.images, a.labels, taps=["blocks.*.attn_probs", "blocks.1.out"], batch_size=10)
    assert model.training and list(acts) == [*names, "labels"]
    assert acts["blocks.0.attn_probs"].shape == (25, 2, 50, 50) and torch.equal(acts["labels"], a.labels)
    for n in names:
        torch.testing.assert_close(acts[n], cap[n], atol=1e-6, rtol=1e-5)
    assert [s for s, _ in iter_activations(model, a.images, taps="blocks.0.out", batch_size=10)] == [0, 10, 20]
    disk = activations(
        model,
        a.images,
        a.labels,
        taps=["blocks.*.attn_probs", "blocks.1.out"],
        batch_size=10,
        out=tmp_path / "acts",
        dtype=torch.float16,
    )
    index = json.loads((tmp_path / "acts" / "index.json").read_text())
    assert index["n_images"] == 25 and sorted(index["taps"]) == sorted(names) and len(index["shards"]) == 1
    assert list(disk) == [*names, "labels"] and disk.done == 25 and disk.complete
    assert disk["blocks.1.out"].dtype == np.float16 and not disk["blocks.1.out"].flags.writeable
    np.testing.assert_allclose(disk["blocks.1.out"], acts["blocks.1.out"].numpy(), atol=2e-3, rtol=2e-3)
    np.testing.assert_array_equal(disk["labels"], a.labels.numpy())
    assert sorted(p.name for p in (tmp_path / "acts").iterdir()) == ["index.json", "shard_00000"]
    # a folder that holds other files is not touched; a pattern that matches nothing is one sentence
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match="already exists and is not empty"):
        activations(model, a.images, taps="blocks.0.out", out=tmp_path / "other")
    assert [p.name for p in (tmp_path / "other").iterdir()] == ["notes.txt"]
    with pytest.raises(ValueError, match="matches no tap.*kinds in, attn_branch"):
        activations(model, a.images, taps="blocks.*.attention")
