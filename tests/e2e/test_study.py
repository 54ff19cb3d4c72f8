"""Studies (analysis/studies/study.py): the study file, Raghu's claim numbers (analysis/studies/raghu2021/numbers.py)
on cases with known answers, and a tiny study end to end: train, analyse, report."""

import shutil

import numpy as np
import pytest
import yaml
from conftest import ROOT, TINY, _merge

from analysis.studies import claims as C
from analysis.studies.raghu2021 import PAPER
from analysis.studies.raghu2021 import numbers as N
from analysis.studies.raghu2021 import pilots as P
from analysis.studies.study import load_study, main
from analysis.studies.study_report import unformatted
from train.recipe import RecipeError, load_recipe


def test_partition_finds_the_block_structure_of_a_no_skip_map():
    labels = [f"{b}.{s}" for b in range(4) for s in ("attn", "mlp")]
    m = np.full((8, 8), 0.2)
    m[:4, :4] = m[4:, 4:] = 0.9  # blocks 0-1 vs 2-3
    np.fill_diagonal(m, 1.0)
    p = N.partition(m, labels, 2)
    assert p["across"] == pytest.approx(0.2) and p["within"] == pytest.approx(0.9)
    assert N.partition(m, labels, 1)["across"] > 0.2  # a boundary inside a block mixes both
    with pytest.raises(ValueError):
        N.partition(m, labels, 0)


def test_claim_numbers_on_constructed_results():
    u = N.uniformity(np.array([[1, 0.5, 0.1], [0.5, 1, 0.3], [0.1, 0.3, 1]]))
    assert u["mean_offdiag"] == pytest.approx(0.3) and u["first_last"] == pytest.approx(0.1)
    ratio = np.ones((2, 4, 5))
    ratio[0, :2, 0], ratio[0, 2:, 0], ratio[0, :, 1:] = 5.0, 0.5, 2.0  # CLS high in the first half, low in the second
    ph = N.cls_phase(ratio, 0, 1, skip=0)  # log(5 / 2) in the first half, log(0.5 / 2) in the second
    assert ph["gap_first"] == pytest.approx(np.log(2.5)) and ph["gap_second"] == pytest.approx(np.log(0.25))
    assert (ph["cls_first"], ph["cls_last"]) == pytest.approx((5.0, 0.5))
    assert N.skip_dominance(ratio) == 1.0 and N.skip_dominance(ratio, [True, False, False, False]) == 1.5
    d = np.array([[2, 20], [3, 19], [14, 15], [15, 16]], dtype=float)  # local + global heads low, global high
    hm = N.head_mix(d)
    assert (
        hm["spread_lower"] == pytest.approx(17)
        and hm["spread_upper"] == pytest.approx(1)
        and hm["mean_upper"] > hm["mean_lower"]
    )
    dr = N.drift([0.9, 0.8, 0.5, 0.3])
    assert dr == {"lower": pytest.approx(0.85), "upper": pytest.approx(0.4)}
    o = N.offset_heads(np.array([[False, True], [False, False]]))
    assert o == {"count": 1, "where": ["block 0 head 1"]}
    assert N.last_layer([0.5, 0.7, np.nan]) == 0.7


def _study(tmp_path, runs: dict, **extra) -> str:
    base = _merge(TINY, {"data": {"probe_train_size": 200}, "callbacks": []})
    (tmp_path / "tiny.yaml").write_text(yaml.safe_dump(base))
    d = {
        "study": "mini",
        "root": str(tmp_path / "runs"),
        "report": str(tmp_path / "docs" / "repro.md"),
        "runs": runs,
        **extra,
    }
    p = tmp_path / "mini.yaml"
    p.write_text(yaml.safe_dump(d))
    return str(p)


def test_study_files_are_checked_before_anything_runs(tmp_path, capsys):
    s = load_study(ROOT / "recipes" / "studies" / "raghu2021.yaml")
    configs = {
        "vit_cls",
        "vit_gap",
        "resnet",
        "noskip_b1",
        "noskip_b3",
        "noskip_b5",
        "subset_03",
        "subset_10",
        "subset_30",
        "vit_local",
    }
    assert set(s.configs()) == configs | {"vit_local_nomix", "control"}
    # the pilot and the positive control: one seed
    assert set(s.runs) == {f"{c}_s{i}" for c in configs for i in (0, 1, 2)} | {"vit_local_nomix_s0", "control_s0"}
    assert s.runs["vit_local_s0"].go_no_go and not s.runs["vit_cls_s0"].go_no_go
    assert load_recipe(s.runs["control_s0"].recipe, s.runs["control_s0"].overrides).interventions.local_attention
    # the locality-capable family measures attention distance during training (the pilot check) despite callbacks=[]
    for name, mixup in (("vit_local_s1", 0.8), ("vit_local_nomix_s0", 0.0)):
        r = load_recipe(s.runs[name].recipe, s.runs[name].overrides)
        assert [c.name for c in r.callbacks] == ["attention_distance"] and r.data.augment.mixup_alpha == mixup
        assert (r.model.num_heads, r.train.steps, r.train.checkpoint_every) == (8, 9000, 1500)
    assert [r.seed for r in s.configs()["vit_cls"]] == [0, 1, 2] and s.runs["vit_cls_s1"].overrides[-1] == "seed=1"
    assert s.root == ROOT / "runs" / "study-raghu2021"  # the repository's
    # the committed report in docs/ is written only when --report names it: by default the report goes beside the runs
    assert s.report == s.root / "report.md" and s.committed == ROOT / "docs" / "reproduction.md"
    assert s.command() == "./launch.sh study recipes/studies/raghu2021.yaml"
    again = load_study(ROOT / "recipes" / "studies" / "raghu2021.yaml", report=ROOT / "docs" / "reproduction.md")
    assert again.report == ROOT / "docs" / "reproduction.md" and again.committed is None
    assert again.command().endswith("raghu2021.yaml --report docs/reproduction.md")
    assert (
        "erf" in s.runs["vit_cls_s0"].measures
        and "localization" in s.runs["resnet_s0"].measures
        and "aligned_attention" in s.measures
    )
    assert "data.analysis_size=2560" in s.runs["resnet_s1"].overrides
    assert s.suite_options(["cka"]).of("cka").layers == "paper"
    bad = _study(tmp_path, {"a": {"recipe": "tiny.yaml", "set": ["model.depht=3"]}})
    with pytest.raises(RecipeError, match="study run 'a': unknown key 'model.depht'"):
        load_study(bad)
    assert main([bad]) == 2 and capsys.readouterr().err.count("\n") == 1
    assert not (tmp_path / "runs").exists()
    with pytest.raises(RecipeError, match="unknown measure 'nope'"):
        load_study(_study(tmp_path, {"a": {"recipe": "tiny.yaml"}}, measures=["cka", "nope"]))
    with pytest.raises(RecipeError, match="unknown key"):
        load_study(_study(tmp_path, {"a": {"recipe": "tiny.yaml"}}, studdy=1))


@pytest.mark.parametrize(
    "extra, run, message",
    [
        ({"seeds": [0, 0]}, {}, "seeds must be a list of distinct non-negative integers"),
        ({"seeds": "0,1"}, {}, "seeds must be a list"),
        ({}, {"seeds": [-1]}, "study run 'a': seeds must be"),
        ({"seeds": [0, 1]}, {"set": ["seed=3"]}, "gives seeds: give the seed in one place only"),
        ({"options": {"cka": {"layers": "some"}}}, {}, "options:"),
        ({"options": {"ckka": {"layers": "paper"}}}, {}, "unknown measure 'ckka'"),
        ({"options": {"cka": {"layerz": "paper"}}}, {}, "options:"),
        ({"options": ["cka"]}, {}, "options:"),
    ],
)
def test_seeds_and_options_are_checked(tmp_path, capsys, extra, run, message):
    p = _study(tmp_path, {"a": {"recipe": "tiny.yaml", **run}}, **extra)
    with pytest.raises(RecipeError, match=message):
        load_study(p)
    assert main([p, "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: ") and not (tmp_path / "runs").exists()


def test_seeded_runs_and_a_run_of_its_own_seeds(tmp_path):
    s = load_study(
        _study(
            tmp_path,
            {"a": {"recipe": "tiny.yaml"}, "b": {"recipe": "tiny.yaml", "seeds": [5]}},
            seeds=[0, 1],
            options={"cka": {"layers": "paper"}},
        )
    )
    assert list(s.runs) == ["a_s0", "a_s1", "b_s5"] and s.runs["b_s5"].run_dir.name == "b_s5"
    assert {k: [r.seed for r in v] for k, v in s.configs().items()} == {"a": [0, 1], "b": [5]}
    assert s.options == {"cka": {"layers": "paper"}}
    with pytest.raises(RecipeError, match="named twice"):
        load_study(_study(tmp_path, {"a": {"recipe": "tiny.yaml", "seeds": [0]}, "a_s0": {"recipe": "tiny.yaml"}}))


def test_study_only_and_jobs_are_checked(tmp_path, capsys):
    p = _study(tmp_path, {"a": {"recipe": "tiny.yaml"}, "b": {"recipe": "tiny.yaml"}}, seeds=[0, 1])
    assert main([p, "--only", "b", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "b_s0: would start" in out and "b_s1: would start" in out and "a_s0" not in out
    assert main([p, "--only", "c"]) == 2
    assert "--only names c, which the study does not have: choose from a, b (or, with --stage analyze, runs)." in (
        capsys.readouterr().err
    )
    assert main([p, "--jobs", "0"]) == 2
    assert not (tmp_path / "runs").exists()


def test_the_gpu_study_validates_and_lists_its_runs(capsys):
    """The one-GPU study (recipes/studies/raghu2021_gpu.yaml) checked on the CPU: every run's recipe loads, and the dry
    run lists 19 runs (6 configurations x 3 seeds and the positive control) and starts none."""
    p = ROOT / "recipes" / "studies" / "raghu2021_gpu.yaml"
    s = load_study(p)
    assert len(s.runs) == 19 and all(len(v) == 3 for c, v in s.configs().items() if c != "control")
    c = load_recipe(s.runs["control_s0"].recipe, s.runs["control_s0"].overrides)
    assert c.train.steps == 600 and c.interventions.local_attention and c.model.patch_size == 2
    r = load_recipe(s.runs["vit_cls_s0"].recipe, s.runs["vit_cls_s0"].overrides)
    assert (r.model.patch_size, r.model.depth, r.model.embed_dim, r.train.mixed_precision) == (2, 8, 192, "bf16")
    assert 50 <= r.train.steps * r.train.batch_size / 60000 <= 100  # epochs of Fashion-MNIST's 60,000 train images
    assert main([str(p), "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "19 runs, 0 already finished, 19 to start, 0 failed" in out and "vit_cls_s2: would start" in out


def test_the_study_resnet_has_identity_shortcuts():
    """Raghu's ResNets have identity skips: the study's baseline has ResNet-18's [2, 2, 2, 2] layout and a first stage
    as
    wide as the stem, so only each later stage's first (strided) block projects."""
    from train.models import build_model

    s = load_study(ROOT / "recipes" / "studies" / "raghu2021.yaml")
    r = load_recipe(s.runs["resnet_s0"].recipe, s.runs["resnet_s0"].overrides)
    assert r.model.resnet_layers == [2, 2, 2, 2]
    model = build_model(r, 10)
    blocks = [m for n, m in model.named_modules() if n.count(".") == 1 and n.startswith("layer")]
    assert model.conv1.out_channels == r.model.resnet_channels[0]
    assert sum(b.downsample is None for b in blocks) == 5 and len(blocks) == 8


@pytest.mark.slow  # about 40 s: the go / no-go rule is tested on its own (tests/studies/test_claims.py)
def test_go_no_go_trains_a_pilot_to_its_check_and_on_only_after_a_go(tmp_path, capsys):
    from train.checkpoint import list_checkpoints, read_meta

    # free heads after 4 tiny steps: every head near uniform attention (no-go); the positive control's forced 3x3-window
    # head in block 0 (interventions.local_attention): go
    pilot = ["callbacks=[attention_distance]", "train.checkpoint_every=2", "train.eval_every=4", "train.steps=6"]
    forced = [*pilot, "interventions.local_attention=[{blocks: [0], heads: [0], offset: [0, 0], radius: 1}]"]
    p = _study(
        tmp_path,
        {
            "vit_local": {"recipe": "tiny.yaml", "set": pilot, "go_no_go": True},
            "forced": {"recipe": "tiny.yaml", "set": forced, "go_no_go": True},
        },
        seeds=[0, 1],
        paper="raghu2021",  # the go/no-go check is the paper's (PAPER.pilot); no vit_cls + resnet to infer it from
    )
    assert main([p, "--stage", "train", "--jobs", "2"]) == 0
    out = capsys.readouterr().out
    root = tmp_path / "runs"

    def last(run):
        ck = list_checkpoints(root / run / "checkpoints", warn=False)[-1]
        return read_meta(ck)["step"], bool(read_meta(ck).get("final"))

    assert last("vit_local_s0") == (4, False) and not (root / "vit_local_s1").exists()
    assert "vit_local: no-go at the pilot check: at the second checkpoint (step 4)" in out
    assert last("forced_s0") == (6, True) and last("forced_s1") == (6, True)
    assert "forced: go at the pilot check" in out
    capsys.readouterr()
    assert main([p, "--stage", "train"]) == 0  # rerun: the decision stands, nothing trains
    out = capsys.readouterr().out
    assert "(to step 4): at step 4 already, skipped" in out and "0 started" in out and "no-go" in out
    with pytest.raises(
        RecipeError, match="go_no_go needs"
    ):  # the check reads the attention distance measured in training
        load_study(_study(tmp_path, {"x": {"recipe": "tiny.yaml", "go_no_go": True}}))
    assert main([_study(tmp_path, {"x": {"recipe": "tiny.yaml", "go_no_go": True}}), "--dry-run"]) == 2
    assert (
        "go_no_go needs a ViT with train.checkpoint_every set and the attention_distance callback"
        in capsys.readouterr().err
    )


def test_a_tiny_study_trains_analyses_and_reports(tmp_path, capsys):
    # timm's 64-channel 7x7/2 stem in front of 8-channel stages: every shortcut projects (no identity skip)
    resnet = [
        "model.arch=resnet",
        "model.resnet_layers=[1,1,1,1]",
        "model.resnet_channels=[8,8,16,16]",
        "model.small_stem=false",
    ]
    p = _study(
        tmp_path,
        {"vit_cls": {"recipe": "tiny.yaml", "measures": "all"}, "resnet": {"recipe": "tiny.yaml", "set": resnet}},
        measures=["cka", "norm_ratio", "fewshot_probe"],
        seeds=[0, 1],
        options={"cka": {"layers": "paper"}},
    )
    assert main([p, "--jobs", "2"]) == 0  # two runs at a time, 1 thread each, each one's output in runs/logs/
    assert sorted(f.name for f in (tmp_path / "runs" / "logs").iterdir()) == [
        "resnet_s0.log",
        "resnet_s1.log",
        "vit_cls_s0.log",
        "vit_cls_s1.log",
    ]
    assert "step" in (tmp_path / "runs" / "logs" / "vit_cls_s1.log").read_text()
    report = tmp_path / "docs" / "repro.md"
    text = report.read_text()
    for claim in (
        "## 1. ViT layer representations are more uniform",
        "## 3. Skip connections are much more influential",
        "## 4. In the first half of the network the CLS token",
        "## 5. Lower layers mix",
        "## 7. The first block's local heads are the most similar",
        "## 11. ViT's intermediate layers are stronger",
        "## 14. Every ViT learns offset local attention heads",
        "| part (positive = the paper's direction) | effect | 95% CI | p | test | Holm p (reversal) | outcome |",
        "| vit_cls_s1 | vit_cls | 1 |",
        "Claims at a glance",
        '> "We observe a striking phase transition',
        # the pilot section covers every vit_* configuration, the locality claims say what they read
        "## Pilot runs: choosing a regime where local heads can appear",
        "**vit_cls_s0** (finished (step 8)",
        "| block | step 4 | step 8 |",
        "## Which configuration the locality claims read",
        "The study has no vit_local configuration, so the locality claims read vit_cls",
        # the CKA floors beside the maps: every block output against the pixels and the random init
        "What the maps are read against",
        "| vit_cls_s0 | 0.mlp |",
        "| vit_cls_s0 | 1.mlp |",
        "| resnet_s0 | layer1.0 |",
        "figures/mini/cka_floors.png",
        "figures/mini/pilot_attention_distance.png",
        "Paper: not stated as a number (Fig. 1",
    ):
        assert claim in text, claim
    n = len(PAPER.claims)
    assert text.count("Paper: ") == n and text.count("Ours: ") == n  # every claim section shows both
    assert not unformatted(text)
    assert "Go/no-go: **go**" in text or "Go/no-go: **no-go**" in text
    assert "| resnet_s0 | 0." in text and "| resnet_s0 | nan" not in text  # zero-initialised BatchNorms: left out, said
    assert "constant at random initialisation" in text
    assert "figure" not in text or "missing)*" not in text.split("## 1.")[0]  # the sections before the claims
    from analysis.reports.run_report import check_report

    assert check_report(report) == []
    back = C.read_json(report.with_suffix(".json"))
    assert list(back["claims"]) == PAPER.claims.ids()  # every claim, in the paper's order
    assert back["locality_configuration"]["config"] == "vit_cls" and set(back["pilots"]) == {"vit_cls_s0", "vit_cls_s1"}
    assert all(
        back["claims"][c]["measured"]["configuration"] == "vit_cls"
        for c in ("head_mix", "head_subsets", "offset_heads")
    )
    assert back["pilots"]["vit_cls_s0"]["go"] in (P.GO, P.NO_GO)
    assert all(c["verdict"] in C.OUTCOMES and c["passage"] and c["rule"] for c in back["claims"].values())
    for cid in ("uniformity", "skip_dominance"):  # see `resnet` above: every shortcut projects
        assert back["claims"][cid]["verdict"] == "not testable" and "0 of its 4 blocks" in back["claims"][cid]["why"]
    assert "not testable" in text and "no identity shortcut" in text
    glance = text.split("## Runs")[0]  # the claims table (the pilot tables below also have rows "| 1 |")
    rows = [line for line in glance.splitlines() if line.startswith(tuple(f"| {i} |" for i in range(1, n + 1)))]
    assert len(rows) == n and all(r.count("|") - r.count("\\|") == 7 for r in rows)  # 6 cells: no stray | in a cell
    cka = np.load(tmp_path / "runs" / "vit_cls_s1" / "analysis" / "step_0000008" / "cka.npz", allow_pickle=True)
    assert any(str(lab).endswith("norm1") for lab in cka["labels"])  # the study's option: the paper's layer set
    assert (tmp_path / "runs" / "vit_cls_s0" / "analysis" / "step_0000008" / "erf.npz").is_file()  # measures: all
    assert not (tmp_path / "runs" / "resnet_s0" / "analysis" / "step_0000008" / "knn.npz").exists()  # the study's list
    capsys.readouterr()
    assert main([p]) == 0  # rerun: nothing trained again, everything cached, the report regenerated
    out = capsys.readouterr().out
    assert "4 already finished, 0 started" in out and report.is_file()
    # the runs gone, the results bundle regenerates the same verdicts and numbers (analysis/studies/bundle.py): every
    # report-time result of the Raghu plug-in (CKA floors, comparisons, figures) is read from it or drawn again
    twin = report.with_suffix(".json").read_bytes()
    shutil.rmtree(tmp_path / "runs")
    assert main([p, "--stage", "report"]) == 0
    assert "from the results bundle" in capsys.readouterr().out
    assert report.with_suffix(".json").read_bytes() == twin


def test_every_checkpoint_is_checked_and_read(tmp_path):
    s = load_study(_study(tmp_path, {"a": {"recipe": "tiny.yaml"}}, every_checkpoint=["attention_distance"]))
    assert s.every_checkpoint == ["attention_distance"]
    assert s.suite_options(s.every_checkpoint).measures == ("attention_distance",)
    assert load_study(_study(tmp_path, {"a": {"recipe": "tiny.yaml"}})).every_checkpoint is None  # the core four
    with pytest.raises(RecipeError, match="attention_distanse"):
        load_study(_study(tmp_path, {"a": {"recipe": "tiny.yaml"}}, every_checkpoint=["attention_distanse"]))


def test_a_configuration_can_start_from_weights_of_its_own(tmp_path):
    import torch

    from train.models import build_model

    p = _study(
        tmp_path,
        {
            "a": {"recipe": "tiny.yaml"},
            "b": {"recipe": "tiny.yaml", "init": "own"},
            "c": {"recipe": "tiny.yaml", "init": "own"},
        },
        seeds=[0, 1],
    )
    s = load_study(p)
    assert not any(o.startswith("model.init_seed") for o in s.runs["a_s0"].overrides)  # shared: the run's seed
    own = {n: [o for o in s.runs[n].overrides if o.startswith("model.init_seed")] for n in ("b_s0", "b_s1", "c_s0")}
    assert len({v[0] for v in own.values()}) == 3  # per configuration and seed, reproducible from the name
    assert load_study(p).runs["b_s1"].overrides == s.runs["b_s1"].overrides

    def first_weight(name):
        torch.manual_seed(0)  # the trainer seeds torch with the run's seed before building the model
        w = next(build_model(load_recipe(s.runs[name].recipe, s.runs[name].overrides), 10).parameters()).detach()
        return w, torch.rand(1)  # the global generator after the build: the data order

    (wa, ra), (wb, rb) = first_weight("a_s0"), first_weight("b_s0")
    assert not torch.equal(wa, wb) and not torch.equal(ra, rb)  # own weights; the build leaves the generator alone
    torch.manual_seed(0)
    assert torch.equal(rb, torch.rand(1))
    with pytest.raises(RecipeError, match="init must be shared"):
        load_study(_study(tmp_path, {"a": {"recipe": "tiny.yaml", "init": "mine"}}))
