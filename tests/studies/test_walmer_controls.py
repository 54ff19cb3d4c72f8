"""The references Walmer's report draws and reads its claims against (analysis/studies/walmer2023/sections.py,
reads.py): the raw pixels' line in the semantic figure, uniform attention's line in the attention-distance figure
(axis from 0), the cross-seed ceiling on the diagonal of the last-block CKA figure, and messages of the generated
text that name runs by repository-relative paths, never the machine's absolute ones."""

from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from analysis.measures.attention_distance import AttentionDistanceMeasure
from analysis.reports import cross as XC
from analysis.results import storage
from analysis.results.folders import AnalysisError
from analysis.studies.locality import uniform_distance
from analysis.studies.walmer2023 import sections as S


def _curve(v, n=6):
    return np.linspace(0.2, v, n)


def test_the_semantic_figure_draws_the_raw_pixels_labelled_with_their_number():
    knn = {"mae": [{"curve": _curve(0.72), "baseline_curve": np.full(6, 0.1)} for _ in range(3)]}
    pur = {"mae": [{"curve": _curve(0.52), "baseline_curve": np.full(6, 0.13)} for _ in range(3)]}
    init = [{"knn": _curve(0.47), "purity": _curve(0.33)} for _ in range(3)]
    pixels = [{"knn": 0.78, "purity": 0.55}, {"knn": 0.80, "purity": 0.57}]
    fig = S._panels_figure(S.semantic_panels(knn, pur, init, pixels), "t")
    (k, p) = fig.axes[:2]
    lines = {line.get_label(): line for line in k.get_lines()}
    assert {"mae", "Gaussian features", "random-init network", "raw pixels (0.790)"} <= set(lines)
    px = lines["raw pixels (0.790)"]
    assert np.allclose(px.get_ydata(), 0.79) and px.get_linestyle() == "--"  # the mean over the runs, one level
    assert "raw pixels (0.560)" in [t.get_text() for t in p.get_legend().get_texts()]
    # no raw pixels measured: no line, and no label pretending one
    fig = S._panels_figure(S.semantic_panels(knn, pur, init, []), "t")
    assert not any(line.get_label().startswith("raw pixels") for line in fig.axes[0].get_lines())


def test_the_attention_figure_draws_uniform_attention_and_starts_at_zero():
    r = {"pixels": np.zeros((6, 4)), "unit_square": np.zeros((6, 4)), "patch_size": 4, "grid": [7, 7]}
    u = AttentionDistanceMeasure.uniform(r, "unit_square")
    # a 7 x 7 grid on the unit square: the pixel distance over (7 - 1) x 4 px per unit
    assert u == pytest.approx(uniform_distance(7, 4) / 24, rel=1e-9)
    dist = {o: [np.full((6, 4), 0.45) + 0.01 * s for s in range(2)] for o in ("supervised", "mae")}
    fig = S._attention_figure(dist, None, u)
    for ax in fig.axes[:2]:
        ref = [line for line in ax.get_lines() if line.get_label().startswith("uniform attention")]
        assert len(ref) == 1 and np.allclose(ref[0].get_ydata(), u)
        assert ref[0].get_label() == f"uniform attention ({u:.3g})"
        assert ax.get_ylim()[0] == 0 and ax.get_ylim()[1] >= u  # the axis is not zoomed on the heads


def test_the_last_block_cka_figure_puts_the_cross_seed_ceiling_on_its_diagonal():
    names = ["supervised", "dino", "mae"]
    cross = {("supervised", "dino"): [0.2, 0.1], ("supervised", "mae"): [0.4, 0.5], ("dino", "mae"): [0.3, 0.3]}
    m = S.cka_matrix(names, cross, {"supervised": [0.9, 0.8, 0.7], "mae": []})
    assert m[0, 0] == pytest.approx(0.8) and np.isnan(m[1, 1]) and np.isnan(m[2, 2])  # not 1.0: two seeds' CKA
    assert m[0, 2] == m[2, 0] == pytest.approx(0.45) and m[1, 2] == pytest.approx(0.3)
    fig = S._cka_last_figure({"CLS token": m}, names)
    texts = [t.get_text() for t in fig.axes[0].texts]
    assert "0.80\nseeds" in texts and texts.count("-") == 2 and "1.00" not in " ".join(texts)


def _run(path: Path, seed: int, data: str):
    return SimpleNamespace(path=path, recipe=SimpleNamespace(seed=seed, data=data))


def test_messages_of_the_generated_text_name_runs_relative_to_the_repository(monkeypatch, tmp_path):
    """The issue's case: docs/teaching-matters.md said "runs /work/main/runs/study-walmer2023/supervised_s0 and ...":
    the cross-run refusal names the runs relative to the repository, and a run outside it by a relative path too."""
    inside = storage.REPOSITORY / "runs" / "study-walmer2023"
    a, b = _run(inside / "supervised_s0", 0, "d"), _run(inside / "supervised_s1", 1, "other")
    monkeypatch.setattr(XC, "load_data", lambda run: None)
    monkeypatch.setattr(XC, "fingerprint", lambda run: str(run.recipe.seed))
    for call in (lambda: XC.check_same_images(a, b), lambda: XC.images_for(a, b, on_other_images=True)):
        with pytest.raises(AnalysisError) as e:
            call()
        msg = str(e.value)
        assert "runs runs/study-walmer2023/supervised_s0 and runs/study-walmer2023/supervised_s1" in msg
        assert str(storage.REPOSITORY) not in msg and not any(w.startswith("/") for w in msg.split())
    assert storage.shown(inside / "x") == "runs/study-walmer2023/x"
    outside = storage.shown(tmp_path / "r")
    assert not Path(outside).is_absolute() and (storage.REPOSITORY / outside).resolve() == (tmp_path / "r").resolve()
    # same data settings, other seed: read on the other's images, its fingerprint
    c = _run(inside / "supervised_s2", 2, "d")
    assert XC.images_for(a, c, on_other_images=True)[1] == "2"
