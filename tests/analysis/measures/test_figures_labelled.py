"""Every figure a paper reader sees says what it shows (issue 44): a title, both axes labelled, a labelled colourbar
wherever colour is a value, and no "step" in the title of a model from elsewhere (``figures(r, None)``).

Small multiples may label their axes once for the grid (``fig.supxlabel`` / ``fig.supylabel``), or on the panel at
the foot of a column and the start of a row, as a paper's grid does."""

from pathlib import Path

import numpy as np
import pytest
import torch
from matplotlib.collections import QuadMesh
from matplotlib.image import AxesImage

from analysis.engine.figures import BLOCK_AXIS
from analysis.engine.measure import registry
from analysis.engine.suite import run_suite, suite_options
from train.data import build_data
from train.models import build_model
from train.recipe import from_dict

pytestmark = pytest.mark.usefixtures("one_thread")

DATA = {"train_size": 256, "eval_size": 128, "probe_train_size": 200, "analysis_size": 64}


def _suite(model_cfg: dict) -> dict:
    """Every registered measure that applies, on a 3-block model of ``model_cfg`` (one thread)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        r = from_dict({"data": DATA, "model": {"depth": 3, "embed_dim": 32, "num_heads": 2, **model_cfg}})
        torch.manual_seed(0)
        model, data = build_model(r, 10), build_data(r)
        opts = suite_options(None, 32, {"fewshot_probe": {"seeds": [0]}, "token_probes": {"seeds": [0]}})
        return run_suite(model, data, opts, measures=sorted(registry()))
    finally:
        torch.set_num_threads(n)


@pytest.fixture(scope="module")
def results():
    """Every registered measure on a 3-block ViT with a CLS token (about 10 s)."""
    return _suite({})


def _colourbars(fig) -> list:
    return [ax for ax in fig.axes if getattr(ax, "_colorbar", None) is not None]


def _valued(ax) -> bool:
    """Whether the axes draws an image or mesh whose colour is a value (a colour map), not a photo (RGB)."""
    for a in ax.get_children():
        if isinstance(a, QuadMesh) or (isinstance(a, AxesImage) and np.asarray(a.get_array()).ndim == 2):
            return True
    return False


def _suplabel(fig, which: str) -> str:
    t = getattr(fig, f"_sup{which}label", None)
    return t.get_text() if t is not None else ""


def problems(fig) -> list[str]:
    """What a reader would miss in ``fig``: empty when every data axes is labelled and titled."""
    out = []
    bars = _colourbars(fig)
    data = [ax for ax in fig.axes if ax not in bars and ax.axison and ax.has_data()]
    sup = fig._suptitle.get_text() if fig._suptitle is not None else ""
    if not sup and not any(ax.get_title() for ax in data):
        out.append("no title")
    for i, ax in enumerate(data):
        spec = ax.get_subplotspec()
        same_col = [a for a in data if spec and a.get_subplotspec() and a.get_subplotspec().colspan == spec.colspan]
        same_row = [a for a in data if spec and a.get_subplotspec() and a.get_subplotspec().rowspan == spec.rowspan]
        if not (ax.get_xlabel() or _suplabel(fig, "x") or any(a.get_xlabel() for a in same_col)):
            out.append(f"axes {i} ({ax.get_title()!r}): no x label")
        if not (ax.get_ylabel() or _suplabel(fig, "y") or any(a.get_ylabel() for a in same_row)):
            out.append(f"axes {i} ({ax.get_title()!r}): no y label")
        if _valued(ax) and not bars:
            out.append(f"axes {i} ({ax.get_title()!r}): colour is a value but there is no colourbar")
    for cb in bars:
        if not (cb.get_ylabel() or cb.get_xlabel()):
            out.append("a colourbar without a label")
    return out


def test_every_measure_figure_is_labelled(results):
    reg = registry()
    assert set(reg) <= set(results), "every registered measure ran on the tiny ViT"
    bad = {}
    for name in sorted(reg):
        for step in (600, None):
            for tag, fig in reg[name].figures(results[name], step).items():
                p = problems(fig)
                texts = [fig._suptitle.get_text() if fig._suptitle else ""] + [ax.get_title() for ax in fig.axes]
                if step is None and any("step" in t for t in texts):
                    p.append("a model from elsewhere's figure names a step")
                if step == 600 and not any("600" in t for t in texts):
                    p.append("the step is not in the title")
                if p:
                    bad[f"{tag} (step {step})"] = p
    assert not bad, bad


def test_a_resnets_figures_are_labelled():
    """The figures drawn differently for a ResNet (one "block" sublayer, shortcuts, stages as layers), about 10 s."""
    res = _suite({"arch": "resnet", "resnet_layers": [1, 1, 1, 1], "resnet_channels": [8, 8, 16, 16]})
    reg = registry()
    figs = {tag: fig for name in res if name in reg for tag, fig in reg[name].figures(res[name], 600).items()}
    assert {"norm_ratio/lines", "erf/maps", "ablation/sublayers"} <= set(figs)
    bad = {tag: problems(fig) for tag, fig in figs.items() if problems(fig)}
    assert not bad, bad


def test_compare_figures_are_labelled(results):
    from analysis.frontends import compare as C

    other = {k: v for k, v in results.items()}
    both = {"vit_a": results, "vit_b": other}
    figs = {
        "cka_grid": C.cka_grid_figure(both),
        "probes": C.probe_figure(both),
        "attention_distance": C.attention_figure(both),
        "norm_ratio": C.norm_ratio_figure(both),
        "same_index": C.reference_figure({"vit_b": np.linspace(1, 0.5, 6)}, "vit_a"),
    }
    bad = {tag: problems(fig) for tag, fig in figs.items() if problems(fig)}
    assert not bad, bad
    nr = figs["norm_ratio"]
    assert nr.axes[0].get_xlabel() == BLOCK_AXIS and "ratio" in nr.axes[0].get_ylabel()
    assert any(line.get_label().startswith("ratio 1") for line in nr.axes[0].get_lines())  # the reference line


def test_every_measure_figure_has_a_caption_in_the_run_report(results):
    from analysis.reports.run_report import CAPTIONS, caption

    reg = registry()
    tags = [tag for name in sorted(reg) for tag in reg[name].figures(results[name], None)]
    stems = [tag.replace("/", "_") for tag in tags]
    assert not [s for s in stems if caption(s) == s.replace("_", " ") + "."], "a figure without a caption"
    assert len({caption(s) for s in stems}) > len(CAPTIONS) // 2  # not one caption for everything


def test_study_figures_are_labelled(monkeypatch, tmp_path):
    """The figures the study plug-ins draw themselves (Walmer's objectives side by side, the real ViT's distances),
    on made-up numbers: 3 objectives x 2 seeds, 4 blocks x 2 heads."""
    from analysis.studies.real_vit import figures as RV
    from analysis.studies.walmer2023 import sections as W

    drawn = {}
    for module in (W, RV):
        monkeypatch.setattr(module, "save", lambda fig, path: drawn.__setitem__(Path(path).stem, fig))
    rng = np.random.default_rng(0)
    objectives = ("supervised", "dino", "mae")
    W._attention_figure({o: [rng.uniform(0.1, 0.6, (4, 2)) for _ in range(2)] for o in objectives}, tmp_path / "a.png")
    curves = {o: [rng.uniform(0, 1, 4) for _ in range(2)] for o in objectives}
    W._panels_figure({"k-NN": (curves, "top-1 (fraction)", {"random": [rng.uniform(0, 0.2, 4)]}, (0, 1))}, "t", "p")
    m = np.eye(3) + 0.5 * (1 - np.eye(3))
    W._cka_last_figure({"CLS token": m, "all tokens": m}, list(objectives), tmp_path / "c.png")
    RV.distance_figure(rng.uniform(10, 100, (4, 2)), 80.0, tmp_path / "d.png")
    assert set(drawn) == {"a", "p", "c", "d"}
    bad = {name: problems(fig) for name, fig in drawn.items() if problems(fig)}
    assert not bad, bad
    assert drawn["d"].axes[0].get_xlabel() == BLOCK_AXIS and drawn["d"].axes[0].get_xticks()[0] == 0  # from block 0
