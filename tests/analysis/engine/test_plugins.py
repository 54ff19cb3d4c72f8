"""Plug-ins: a new measure is one file, a callback can come from the user's own module, every measure's options
are set from a recipe and from the CLI (typos refused), and the suite runs once per step."""

from __future__ import annotations

import textwrap
from pathlib import Path

import numpy as np
import pytest
from conftest import class_split, read_scalars, tiny_vit

import analysis.engine.measure as M
import analysis.measures
from analysis.engine import suite as S
from analysis.engine.measure import MeasureError, make_options, registry
from train.cli import main as train_main
from train.recipe import load_recipe
from train.trainer import train

TOY = textwrap.dedent('''
    """A toy measure: the mean of every block's output, times ``scale``."""
    from dataclasses import dataclass

    import numpy as np

    from analysis.engine.measure import Measure, register
    from analysis.engine.reduce import all_reduce_sum


    @dataclass(frozen=True)
    class ToyOptions:
        scale: float = 1.0


    @register
    class ToyMean(Measure):
        """Mean block output (a test plug-in)."""

        name = "toy_mean"
        Options = ToyOptions

        def __init__(self, ctx, opts=None):
            super().__init__(ctx, opts)
            self.sums = None
            self.n = 0

        def taps(self):
            return {f"{b}.out" for b in self.ctx.blocks}

        def update(self, j, cap, x, y):
            v = np.array([float(cap[f"{b}.out"].double().mean()) * len(x) for b in self.ctx.blocks])
            self.sums = v if self.sums is None else self.sums + v
            self.n += len(x)

        def finish(self):
            return {"mean": self.opts.scale * self.sums / self.n, "blocks": list(self.ctx.blocks)}

        @staticmethod
        def scalars(r):
            return {f"toy/block{i:02d}": float(v) for i, v in enumerate(np.asarray(r["mean"]))}
''')


@pytest.fixture
def tiny_vit_and_data():
    import types

    from train.splits import TensorBatches

    a, p = class_split(64, 0), class_split(200, 1)
    data = types.SimpleNamespace(
        analysis=TensorBatches(a.images, a.labels),
        probe_train=TensorBatches(p.images, p.labels),
        num_classes=10,
        normalize=lambda x: x.float() / 255,
    )
    return tiny_vit(), data


@pytest.fixture
def toy_file(tmp_path, monkeypatch):
    """The toy measure as ONE file in the measures package's search path (nothing else is edited)."""
    d = tmp_path / "plugin_dir"
    d.mkdir()
    (d / "toy_mean.py").write_text(TOY)
    monkeypatch.setattr(analysis.measures, "__path__", [*analysis.measures.__path__, str(d)])
    monkeypatch.setattr(M.MEASURES, "_discovered", False)
    yield
    M.REGISTRY.pop("toy_mean", None)


def test_a_new_measure_is_one_file(toy_file, tiny_vit_and_data):
    assert "toy_mean" in registry()
    model, data = tiny_vit_and_data
    res = S.run_suite(model, data, S.suite_options(["toy_mean"], 32, {"toy_mean": {"scale": 2.0}}))
    one = S.run_suite(model, data, S.suite_options(["toy_mean"], 32))
    np.testing.assert_allclose(res["toy_mean"]["mean"], 2 * one["toy_mean"]["mean"])


def test_a_measure_from_the_users_own_module(tmp_path, monkeypatch, tiny_vit_and_data):
    (tmp_path / "my_measures.py").write_text(TOY)
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        opts = S.suite_options(["my_measures:ToyMean"], 32)
        assert opts.measures == ("toy_mean",)
        model, data = tiny_vit_and_data
        assert "toy_mean" in S.run_suite(model, data, opts)
    finally:
        M.REGISTRY.pop("toy_mean", None)
    with pytest.raises(MeasureError, match="cannot be imported"):
        S.suite_options(["no_such_module:Thing"])


def test_every_measure_has_options_that_are_checked():
    for name, cls in registry().items():
        make_options(cls, {})  # defaults are valid
        with pytest.raises(MeasureError, match=f"unknown option '{name}.nope'"):
            make_options(cls, {"nope": 1})
    with pytest.raises(MeasureError, match="option .knn.k. must be an integer"):
        S.suite_options(["knn"], 32, {"knn": {"k": "ten"}})
    with pytest.raises(MeasureError, match="shots must be at least 1"):
        S.suite_options(None, 32, {"fewshot_probe": {"shots": 0}})
    with pytest.raises(MeasureError, match="option .cka.repr. must be one of"):
        S.suite_options(None, 32, {"cka": {"repr": "middle"}})
    with pytest.raises(MeasureError, match="unknown measure 'ckaa'"):
        S.suite_options(["ckaa"])
    assert S.suite_options("cka").measures == ("cka",)  # a bare string is one name, not letters
    assert S.parse_opt_args(["knn.k=10", "fewshot_probe.seeds=[0, 1]"]) == {
        "knn": {"k": 10},
        "fewshot_probe": {"seeds": [0, 1]},
    }
    with pytest.raises(MeasureError, match="MEASURE.OPTION=VALUE"):
        S.parse_opt_args(["knn=10"])
    for value in ("9" * 5000, "[" * 20000 + "]" * 20000):  # Python's int() limit; the parser's recursion limit
        with pytest.raises(MeasureError, match="too long or too deeply nested"):
            S.parse_opt_args([f"knn.k={value}"])


def test_cache_keys_cover_only_the_measures_own_options():
    a = S.suite_options(None, 32)
    b = S.suite_options(None, 32, {"fewshot_probe": {"shots": 5}})
    assert a.settings("cka") == b.settings("cka") and a.settings("fewshot_probe") != b.settings("fewshot_probe")


def test_options_from_a_recipe_and_typos_refused(write_recipe, tmp_path, capsys):
    p = write_recipe(
        "knn_opts", callbacks=[{"name": "analysis_suite", "batch_size": 32, "measures": ["knn"], "knn": {"k": 3}}]
    )
    run = Path(train(load_recipe(p), progress=False)["run_dir"])
    assert int(np.load(run / "analysis" / "step_0000008" / "knn.npz")["k"]) == 3
    bad = write_recipe(
        "typo",
        callbacks=[{"name": "analysis_suite", "measures": ["knn"], "knn": {"kk": 3}}],
        run={"root": str(tmp_path / "other")},
    )
    assert train_main([str(bad), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "unknown option 'knn.kk'" in err and err.count("\n") == 1
    assert not (tmp_path / "other").exists()


CALLBACK = textwrap.dedent("""
    from pathlib import Path

    from train.callbacks import Callback


    class Marker(Callback):
        def __init__(self, every=None, word="hello"):
            super().__init__(every)
            self.word = word

        def on_checkpoint(self, ctx):
            if ctx.accelerator.is_main_process:
                with open(Path(ctx.run_dir) / "marks.txt", "a") as f:
                    f.write(f"{self.word} {ctx.step}\\n")
""")


def test_a_callback_from_the_users_own_module(write_recipe, tmp_path, monkeypatch):
    (tmp_path / "my_callbacks.py").write_text(CALLBACK)
    monkeypatch.syspath_prepend(str(tmp_path))
    p = write_recipe("user_cb", callbacks=[{"name": "my_callbacks:Marker", "word": "mark"}])
    run = Path(train(load_recipe(p), progress=False)["run_dir"])
    assert (run / "marks.txt").read_text().split("\n")[:2] == ["mark 4", "mark 8"]


def test_the_suite_runs_once_at_a_step_that_is_both_due_and_a_checkpoint(write_recipe, monkeypatch):
    import analysis.frontends.callbacks as AC

    calls = []
    real = AC.run_suite
    monkeypatch.setattr(AC, "run_suite", lambda model, data, opts, acc: calls.append(1) or real(model, data, opts, acc))
    # every 2 steps; checkpoints at 4 and 8: steps 2, 4, 6, 8 once each (before the fix 4 and 8 ran twice)
    p = write_recipe("twice", callbacks=[{"name": "analysis_suite", "every": 2, "batch_size": 32, "measures": ["cka"]}])
    run = Path(train(load_recipe(p), progress=False)["run_dir"])
    assert len(calls) == 4
    assert [s for s, _ in read_scalars(run)["analysis/cka/mean_offdiag"]] == [2, 4, 6, 8]
    assert (run / "analysis" / "step_0000004" / "cache.json").read_text().count(
        "cka"
    ) == 1  # the checkpoint's run is keyed


def test_sample_images_at_every_checkpoint_by_default(write_recipe):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    p = write_recipe("samples", callbacks=["sample_images"])
    run = Path(train(load_recipe(p), progress=False)["run_dir"])
    ea = EventAccumulator(str(run), size_guidance={"images": 0})
    ea.Reload()
    assert [e.step for e in ea.Images("data/train_samples")] == [0, 4, 8]


def test_entry_points_are_read_once_per_path(monkeypatch):
    """importlib.metadata reads every installed distribution on each call: the registries read a group once per
    sys.path (a suite run looked names up 23 times, ~5% of its time), and again when sys.path changes."""
    import sys

    from train.callbacks import CALLBACKS
    from vitlab import plugins as _registry

    calls = []
    real = _registry.entry_points
    monkeypatch.setattr(_registry, "entry_points", lambda group: calls.append(group) or real(group=group))
    _registry._group_entry_points.cache_clear()
    for _ in range(5):
        assert "cka" in CALLBACKS and "cka" in CALLBACKS.names()
    assert calls == ["vitlab.callbacks"]
    monkeypatch.setattr(sys, "path", [*sys.path, "/nonexistent-vitlab-test"])
    assert "cka" in CALLBACKS
    assert calls == ["vitlab.callbacks"] * 2
    _registry._group_entry_points.cache_clear()
