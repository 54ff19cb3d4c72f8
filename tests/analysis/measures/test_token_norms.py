"""token_norms (Darcet et al. 2024 high-norm tokens) against constructed cases with known answers: a block output with
one token scaled 10x, a scaled register token, a model without outliers, a position probe on synthetic features."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import class_split
from test_registers import GRID, reg_vit

from analysis.engine.measure import load_result, save_result
from analysis.frontends.api import activations, analyze
from analysis.measures.token_norms import (
    TokenNorms,
    _position_probe,
    first_outlier_step,
    outlier_mask,
)

ROW, COL = 2, 5  # where the planted outlier goes


def scale_token(model, block: int, index: int, factor: float):
    """A forward hook multiplying token ``index`` of ``blocks[block]``'s output by ``factor``; returns the handle."""

    def hook(mod, args, out):
        out = out.clone()
        out[:, index] *= factor
        return out

    return model.blocks[block].register_forward_hook(hook)


def run(model, n=24, **opts):
    x = class_split(n, 0).images
    return analyze(model, x, measures=["token_norms"], options={"token_norms": opts}, batch_size=8, figures=False)[
        "results"
    ]["token_norms"]


@pytest.mark.parametrize("class_token", [True, False])
def test_planted_outlier_found_once_at_its_place(class_token):
    m = reg_vit(class_token)
    p = m.num_prefix_tokens
    index = p + ROW * GRID[1] + COL
    clean = run(m)
    assert clean["share_images"].tolist() == [0.0, 0.0]  # negative control: no outlier in the untouched model
    assert clean["max_over_median"].max() < 4.0  # the bright squares: ~3.9x the noise tokens' median, under k
    h = scale_token(m, 0, index, 10.0)
    try:
        r = run(m)
        attn = activations(m, class_split(24, 0).images, taps=["blocks.1.attn_probs"])["blocks.1.attn_probs"]
    finally:
        h.remove()
    assert r["share_images"][0] == 1.0 and r["count"][0] == 1.0
    expected = np.zeros(GRID)
    expected[ROW, COL] = 1.0
    np.testing.assert_array_equal(r["outlier_map"][0], expected)
    assert int(r["n_images"]) == 24
    # block 0 reads the embeddings (no outlier keys); block 1 reads block 0's output, whose outlier is planted
    assert r["attn_images"][0] == 0 and math.isnan(r["attn_patch_on_outliers"][0])
    assert r["attn_images"][1] == 24
    a = attn.double().mean(1)  # [B, T, T]
    assert r["attn_uniform_on_outliers"][1] == pytest.approx(1 / a.shape[-1])
    spatial_q = [t for t in range(p, a.shape[-1]) if t != index]
    # float32 attention from two forwards (the measure's minibatch, the activations API's): the same entries, but the
    # kernels' blocking, and so their rounding, depends on the host's SIMD width (2e-9 relative on an AVX-512 host)
    assert r["attn_patch_on_outliers"][1] == pytest.approx(float(a[:, spatial_q, index].mean()), rel=1e-6)
    if class_token:
        assert r["attn_cls_on_outliers"][1] == pytest.approx(float(a[:, 0, index].mean()), rel=1e-6)
    else:
        assert math.isnan(r["attn_cls_on_outliers"][1])


def test_register_tokens_never_in_spatial_maps():
    """A register token scaled 100x is not a spatial outlier (registers are prefix tokens); its norm shows in
    prefix_norm."""
    m = reg_vit(True)
    clean = run(m)
    h = scale_token(m, 0, 2, 100.0)  # token 0 is CLS, 1..4 registers
    try:
        r = run(m)
    finally:
        h.remove()
    assert r["share_images"][0] == 0.0 and r["outlier_map"].sum() == 0.0
    assert r["prefix_norm"].shape == (2, 5)
    assert r["prefix_norm"][0, 2] == pytest.approx(100 * clean["prefix_norm"][0, 2], rel=1e-4)
    assert r["prefix_norm"][0, 2] > 10 * r["median_norm"][0]


def test_outlier_rule():
    norms = torch.tensor([[9.0, 1.0, 1.0, 1.0, 4.1], [1.0, 2.0, 2.0, 2.0, 8.0]])
    # prefix 1: image 0's spatial median is 1 (4.1 > 4 x 1), image 1's is 2 (8.0 is not > 4 x 2); the prefix is never
    assert outlier_mask(norms, 1, 4.0).tolist() == [[False, False, False, True], [False, False, False, False]]


def test_position_probe_known_answer():
    """Normal tokens encode their position linearly, the outliers are noise: the probe gets ~all normal tokens right
    and the outliers at about chance."""
    g = torch.Generator().manual_seed(0)
    b, n, d = 60, 16, 32
    code = torch.randn(n, d, generator=g)
    feats = code[None].expand(b, n, d) + 0.05 * torch.randn(b, n, d, generator=g)
    masks = torch.zeros(b, n, dtype=torch.bool)
    masks[:, 3] = True
    feats[masks] = torch.randn(int(masks.sum()), d, generator=g)
    acc_n, acc_o, n_o = _position_probe(feats, masks)
    assert acc_n > 0.99 and acc_o < 0.3 and n_o == b


def test_first_outlier_step_and_figures(tmp_path):
    m = reg_vit(True, 0)
    clean = run(m)
    h = scale_token(m, 1, 1 + 10, 10.0)
    try:
        planted = run(m)
    finally:
        h.remove()
    assert first_outlier_step({0: clean, 100: clean, 200: planted, 300: planted}) == 200
    no_probe = run(m, probe_images=0, attention=False)  # the cheap variant: norms and outliers only
    assert np.isnan(no_probe["probe_acc_normal"]).all() and "attn_cls_on_outliers" not in no_probe
    np.testing.assert_array_equal(no_probe["share_images"], clean["share_images"])
    assert first_outlier_step({0: clean, 100: clean}) is None
    save_result(planted, tmp_path / "token_norms.npz")
    loaded = load_result(tmp_path / "token_norms.npz")
    assert first_outlier_step({5: loaded}) == 5
    figs = TokenNorms.figures(loaded, step=5)
    assert set(figs) == {"token_norms/histogram", "token_norms/outlier_map"}
    s = TokenNorms.summary(loaded)
    assert s["share_images_per_block"]["block01"] == 1.0
    assert "token_norms/share_images/block01" in TokenNorms.scalars(loaded)


def test_across_checkpoints_at_training_time_and_offline(write_recipe):
    """A 4-register run with token_norms in its training-time suite: every checkpoint has the result, the offline
    analysis (python -m analysis RUN --measures token_norms --force) recomputes it exactly, and
    first_outlier_step reads the run's results."""
    from analysis.frontends.cli import main
    from analysis.measures.token_norms import load_run_results
    from train.recipe import load_recipe
    from train.trainer import train

    cb = {"name": "analysis_suite", "batch_size": 32, "measures": ["token_norms"], "token_norms": {"probe_images": 32}}
    p = write_recipe("reg4", model={"reg_tokens": 4}, callbacks=[cb])
    run = Path(train(load_recipe(p), progress=False)["run_dir"])
    at_training = load_run_results(run)
    assert sorted(at_training) == [4, 8]
    assert int(at_training[8]["num_registers"]) == 4 and int(at_training[8]["num_prefix_tokens"]) == 5
    argv = [str(run), "--measures", "token_norms", "--opt", "token_norms.probe_images=32", "--batch-size", "32"]
    assert main([*argv, "--force", "--no-progress", "--no-tensorboard"]) == 0  # recomputed, not read back
    offline = load_run_results(run)
    for step in (4, 8):
        for key, v in at_training[step].items():
            np.testing.assert_array_equal(np.asarray(v), np.asarray(offline[step][key]), err_msg=key)
    step = first_outlier_step(offline)
    assert step is None or step in (4, 8)


def test_streamed_ridge_is_scikit_learns_ridge_classifier():
    """StreamingRidge fit from sums of chunks predicts as make_pipeline(StandardScaler(), RidgeClassifier(1.0)) fit on
    all the rows at once: two classes (scikit-learn's one-column case), several, and a constant feature."""
    from sklearn.linear_model import RidgeClassifier
    from sklearn.pipeline import make_pipeline
    from sklearn.preprocessing import StandardScaler

    from analysis.estimators.probing import StreamingRidge

    g = torch.Generator().manual_seed(0)
    for classes in (2, 3, 7):
        x = torch.randn(400, 12, generator=g, dtype=torch.float64) + 3
        x[:, 4] = 2.0
        y = torch.randint(0, classes, (400,), generator=g)
        x += 0.8 * torch.nn.functional.one_hot(y, 12).double()  # some signal
        ridge = StreamingRidge(12, classes + 2)  # two classes never seen: left out as scikit-learn does
        for lo in range(0, 400, 64):
            ridge.add(x[lo : lo + 64], y[lo : lo + 64])
        xt = torch.randn(300, 12, generator=g, dtype=torch.float64) + 3
        xt[:, 4] = 2.0
        ref = make_pipeline(StandardScaler(), RidgeClassifier(alpha=1.0)).fit(x.numpy(), y.numpy())
        mean, scale, w, b, _present = ridge.fit()
        scores = ((xt - mean) / scale) @ w + b
        np.testing.assert_allclose(scores.numpy().squeeze(), ref.decision_function(xt.numpy()), rtol=1e-9, atol=1e-9)
        assert (StreamingRidge.predict(ridge.fit(), xt).numpy() == ref.predict(xt.numpy())).all()
