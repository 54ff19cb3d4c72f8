"""What a new user sees of the analysis command line: --list and --help whole, "did you mean" for typos, paths
relative to the caller's folder through launch.sh, the offline progress bar, the figures' paper elements and
report.md's tables."""

import textwrap

import pytest

import analysis.measure as M
from analysis.__main__ import list_measures, main, parser

PLUGIN = textwrap.dedent('''
    from dataclasses import dataclass
    from typing import Literal

    from analysis.measure import Measure


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
        (["runs/x", "--measures", "ckaa"], "unknown measure 'ckaa' (did you mean cka?)"),
        (["runs/x", "--measures", "cka,clusterng"], "unknown measure 'clusterng' (did you mean clustering?)"),
        (["runs/x", "--opt", "knm.k=3"], "unknown measure 'knm' (did you mean knn?)"),
        (["runs/x", "--opt", "cka.rep=cls"], "unknown option 'cka.rep' (did you mean cka.repr?)"),
    ],
)
def test_a_typo_gets_the_closest_name(argv, hint, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert hint in err and err.count("\n") == 1


def test_a_mistyped_flag_gets_the_closest_flag(capsys):
    with pytest.raises(SystemExit) as e:
        main(["runs/x", "--mesures", "cka"])
    assert e.value.code == 2
    assert "--mesures (did you mean --measures?)" in capsys.readouterr().err
