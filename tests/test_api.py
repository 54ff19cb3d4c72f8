"""The notebook API: the README example runs as written, and a model object, a DataLoader and a run folder give
the same numbers as the suite."""
import re

import numpy as np
import pytest
import torch
from conftest import ROOT, class_split, tiny_vit

from analysis.api import analyze

pytestmark = pytest.mark.usefixtures("one_thread")


def test_the_readme_example_runs(tmp_path, monkeypatch):
    text = (ROOT / "README.md").read_text()
    code = re.search(r"## Analyses from Python.*?```python\n(.*?)```", text, re.S).group(1)
    monkeypatch.chdir(tmp_path)
    exec(compile(code, "README.md", "exec"), {})
    assert (tmp_path / "cka.png").stat().st_size > 1000


def test_tensor_and_dataloader_give_the_same_numbers():
    model = tiny_vit()
    a, p = class_split(64, 0), class_split(200, 1)
    kw = dict(measures=["cka", "fewshot_probe", "knn"], options={"fewshot_probe": {"seeds": [0]}}, batch_size=32, figures=False)
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
    with pytest.raises(ValueError, match="probe_train"):  # probes need images to train on
        analyze(model, torch.rand(8, 1, 28, 28), torch.arange(8) % 2, measures=["fewshot_probe"])
    # images the model cannot take (torch's and timm's own errors, in one sentence), a model the taps do not know
    for x, says in ((torch.rand(8, 3, 28, 28), "to have 1 channels"), (torch.rand(8, 1, 32, 32), "Input height (32)")):
        with pytest.raises(ValueError, match=r"the model cannot take images of shape .*" + re.escape(says)):
            analyze(model, x, measures=["cka"], batch_size=4)
    with pytest.raises(ValueError, match="not Sequential"):
        analyze(torch.nn.Sequential(torch.nn.Conv2d(1, 4, 3)), torch.rand(8, 1, 28, 28), measures=["cka"], batch_size=4)
    x = torch.rand(8, 1, 28, 28)
    x[3, 0, 5, 5], x[6, 0, 0, 0] = float("nan"), float("inf")
    with pytest.raises(ValueError, match="2 of the 8 images hold NaN or infinite values"):
        analyze(model, x, measures=["cka"], batch_size=4)
    # measures that compare with labels, given none: one sentence, not purity 1.0 or a bare internal error
    a = class_split(16, 0)
    for measures, kw, says in ((["clustering"], {}, "the analysis images with their class labels, and some are unknown"),
                               (["knn"], {}, "the analysis images with their class labels"),
                               (["knn"], {"labels": a.labels}, "probe-train images (probe_train) with their class labels, and there are none")):
        with pytest.raises(ValueError, match=re.escape(f"measure {measures[0]}: it needs {says}")):
            analyze(model, a.images, measures=measures, batch_size=8, **kw)
    with pytest.raises(ValueError, match="cls_attention does not apply to this vit"):  # a GAP ViT has no class token
        analyze(tiny_vit(class_token=False), torch.rand(8, 1, 28, 28), measures=["cls_attention"], batch_size=4)
    with pytest.raises(ValueError, match="no measure named"):
        analyze(model, torch.rand(8, 1, 28, 28), measures=[], batch_size=4)
    with pytest.raises(ValueError, match="repr=cls reads the class token"):  # a GAP ViT has none
        analyze(tiny_vit(class_token=False), torch.rand(8, 1, 28, 28), measures=["cka"], options={"cka": {"repr": "cls"}}, batch_size=4)
