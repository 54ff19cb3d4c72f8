"""Recipes: typed schema, inheritance, overrides, and one-sentence errors with exit code 2."""

import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from conftest import shipped_recipes

from train.cli import main
from train.recipe import Recipe, RecipeError, load_recipe, run_name

ROOT = Path(__file__).resolve().parents[2]


def test_every_shipped_recipe_validates():
    recipes = shipped_recipes()
    assert len(recipes) >= 5
    for p in recipes:
        r = load_recipe(p)
        assert isinstance(r, Recipe) and r.name == p.stem


def test_base_inheritance_and_overrides(tmp_path):
    (tmp_path / "parent.yaml").write_text("model: {depth: 4, embed_dim: 64}\ntrain: {steps: 100, lr: 0.002}\n")
    (tmp_path / "child.yaml").write_text("base: parent.yaml\nmodel: {depth: 3}\n")
    r = load_recipe(
        tmp_path / "child.yaml",
        ["train.steps=7", "model.head=gap", "train.betas=[0.9, 0.95]", "train.mixed_precision=no"],
    )
    assert r.train.mixed_precision == "no"  # YAML's boolean 'no' is read as the choice 'no'
    r = load_recipe(tmp_path / "child.yaml", ["train.steps=7", "model.head=gap", "train.betas=[0.9, 0.95]"])
    assert (r.model.depth, r.model.embed_dim, r.model.head) == (3, 64, "gap")
    assert (r.train.steps, r.train.lr, r.train.betas) == (7, 0.002, [0.9, 0.95])
    assert run_name(r, ["train.steps=7"]) == "child-train.steps_7"
    # the hash sees training changes but not the run folder
    assert (
        r.hash()
        != load_recipe(tmp_path / "child.yaml", ["train.steps=8", "model.head=gap", "train.betas=[0.9, 0.95]"]).hash()
    )
    assert (
        r.hash()
        == load_recipe(
            tmp_path / "child.yaml", ["train.steps=7", "model.head=gap", "train.betas=[0.9, 0.95]", "run.name=x"]
        ).hash()
    )


def test_callbacks_and_interventions_parse(tmp_path):
    p = tmp_path / "r.yaml"
    p.write_text(
        yaml.safe_dump(
            {
                "callbacks": ["sample_images", {"name": "sample_images", "every": 5, "n": 8}],
                "interventions": {
                    "no_skip": {"blocks": [1], "where": "attn"},
                    "head_mask": {"block": 0, "heads": [1]},
                    "data_subset": {"fraction": 0.1, "seed": 3},
                },
            }
        )
    )
    r = load_recipe(p)
    assert r.callbacks[0].name == "sample_images" and r.callbacks[0].every is None
    assert r.callbacks[1].every == 5 and r.callbacks[1].options == {"n": 8}
    assert r.interventions.no_skip.blocks == [1] and r.interventions.head_mask[0].heads == [1]
    assert r.interventions.data_subset.fraction == 0.1


MALFORMED = [
    # (yaml text or None for a missing file, overrides, words the sentence must contain)
    ("trian: {steps: 3}\n", [], ["unknown key 'trian' (did you mean train?)"]),
    ("train: {stpes: 3}\n", [], ["unknown key 'train.stpes' (did you mean train.steps?)", "warmup_steps"]),
    ("{}\n", ["train.stpes=5"], ["unknown key 'train.stpes' (did you mean train.steps?)"]),
    ("{}\n", ["train.zzzzz=5"], ["unknown key 'train.zzzzz': allowed keys here are"]),
    ("train: {steps: many}\n", [], ["train.steps", "int"]),
    ("train: {steps: true}\n", [], ["train.steps", "int"]),
    ("train: {lr: -0.1}\n", [], ["train.lr", "out of range", "> 0.0"]),
    ("model: {head: avg}\n", [], ["model.head", "'cls'", "'gap'"]),
    ("model: {patch_size: 5}\n", [], ["model.patch_size", "data.img_size"]),
    ("model: {embed_dim: 100, num_heads: 3}\n", [], ["model.num_heads", "model.embed_dim"]),
    ("train: {lr: 0.1, min_lr: 0.5}\n", [], ["train.min_lr", "train.lr"]),
    ("train: {steps: [1\n", [], ["not valid YAML"]),
    ("- 1\n- 2\n", [], ["mapping"]),
    (None, [], ["does not exist"]),
    ("base: nowhere.yaml\n", [], ["nowhere.yaml", "does not exist"]),
    ("callbacks: [no_such_callback]\n", [], ["callbacks[0].name", "no_such_callback", "sample_images"]),
    ("callbacks: [sample_imags]\n", [], ["'sample_imags', which is not a known callback (did you mean sample_images"]),
    ("interventions: {no_skip: {blocks: [9]}}\n", [], ["interventions.no_skip.blocks", "0..5"]),
    ("interventions: {head_mask: {block: 0, heads: [4]}}\n", [], ["head_mask[0].heads", "0..3"]),
    ("interventions: {data_subset: {fraction: 0.1, count: 5}}\n", [], ["exactly one of"]),
    ("interventions: {data_subset: {fraction: 1.5}}\n", [], ["interventions.data_subset.fraction", "<= 1.0"]),
    ("data: {source: hub}\n", [], ["data.name"]),
    ("{}\n", ["train.steps"], ["override", "key.sub=value"]),
    ("{}\n", ["train.steps.x=3"], ["key 'train.steps' must be an integer"]),
    ("{}\n", ["model.arch=transformer"], ["model.arch", "'vit'", "'resnet'"]),
    ("model: {arch: resnet, resnet_layers: [1, 1]}\n", [], ["model.resnet_layers", "4"]),
    # limits that keep a run finishable, the rule stated
    ("{}\n", [f"train.steps={10**30}"], ["'train.steps'", "<= 2147483647 (step counts are below 2^31)"]),
    ("train: {steps: 1e30}\n", [], ["'train.steps' must be an integer"]),
    ("{}\n", [f"train.eval_batch_size={10**12}"], ["'train.eval_batch_size'", "<= 1048576 (a batch holds at most"]),
    ("{}\n", [f"train.batch_size={2**20 + 2}"], ["'train.batch_size'", "<= 1048576"]),
    # YAML anchors and aliases: refused as they are read, before anything expands
    ("train: {steps: &n 3, warmup_steps: *n}\n", [], ["anchor '&n' (line 1)", "base: other.yaml"]),
    ("train: {steps: *n}\n", [], ["alias '*n' (line 1)"]),
    # sizes of split roles the recipe itself bounds
    ("data: {eval_size: 100, analysis_size: 200}\n", [], ["'data.analysis_size' (200)", "'data.eval_size' (100)"]),
    ("data: {train_size: 100, probe_train_size: 200}\n", [], ["'data.probe_train_size' (200)", "(100)"]),
]


@pytest.mark.parametrize("text,overrides,words", MALFORMED, ids=[str(i) for i in range(len(MALFORMED))])
def test_malformed_recipe_one_sentence_exit_2(tmp_path, capsys, text, overrides, words):
    p = tmp_path / "bad.yaml"
    if text is not None:
        p.write_text(text)
    root = tmp_path / "runs"
    args = [str(p), "--set", f"run.root={root}", *(["--set", *overrides] if overrides else [])]
    code = main(args)
    err = capsys.readouterr().err.strip()
    assert code == 2
    assert err.startswith("error: ") and "\n" not in err, err
    for w in words:
        assert w in err, (w, err)
    assert not root.exists(), "a recipe error must not create the run folder"


def test_recipe_error_exit_code_from_a_real_process(tmp_path):
    p = subprocess.run(
        [sys.executable, "-m", "train", "--recipe", str(tmp_path / "missing.yaml")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert p.returncode == 2
    assert "does not exist" in p.stderr and p.stderr.count("\n") == 1


def test_base_cycle_is_an_error(tmp_path):
    (tmp_path / "a.yaml").write_text("base: b.yaml\n")
    (tmp_path / "b.yaml").write_text("base: a.yaml\n")
    with pytest.raises(RecipeError, match="inherits from itself"):
        load_recipe(tmp_path / "a.yaml")


def test_exponent_floats_are_floats_in_files_and_overrides(tmp_path):
    """YAML 1.1 reads 1e-3 as a string; recipes read it as the float everyone means."""
    p = tmp_path / "r.yaml"
    p.write_text("train: {lr: 1e-3, min_lr: 1E-5, weight_decay: 5e-2}\n")
    r = load_recipe(p, ["train.warmup_steps=10"])
    assert (r.train.lr, r.train.min_lr, r.train.weight_decay) == (1e-3, 1e-5, 0.05)
    assert load_recipe(p, ["train.lr=1e-4"]).train.lr == 1e-4
    assert load_recipe(p, ["train.lr=+2.5e-4"]).train.lr == 2.5e-4
    with pytest.raises(RecipeError, match="train.steps.*int"):
        load_recipe(p, ["train.steps=1e3"])  # a float, not silently an int


BAD_INPUT = [
    # (file bytes, overrides, words the sentence must contain)
    (b"", [], ["empty"]),
    (b"# only a comment\n\n   # and another\n", [], ["empty"]),
    (b"train: {steps: 3}\nmodel: {depth: 2}\ntrain: {lr: 0.1}\n", [], ["'train'", "twice", "line 3"]),
    (b"train:\n  steps: 3\n  steps: 4\n", [], ["'steps'", "twice"]),
    (bytes(range(256)) * 4, [], ["not a text file"]),
    (b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR", [], ["not a text file"]),
    (b"{}\n", ["run.name=../../x"], ["run.name", "folder name"]),
    (b"{}\n", ["run.name=a/b"], ["run.name", "folder name"]),
    (b"{}\n", ["run.name=.."], ["run.name", "folder name"]),
    (b"seed: 4294967296\n", [], ["'seed'", "<= 4294967295"]),  # numpy's global seed is 32-bit
    (b"{}\n", ["seed=4294967296"], ["'seed'", "<= 4294967295"]),
    (b"model: {depth: " + b"9" * 5000 + b"}\n", [], ["number too long to read"]),
    (b"{}\n", ["seed=" + "9" * 5000], ["'seed' must be an integer", "(5002 characters)"]),
    (b"model: {depth: " + b"[" * 20000 + b"]" * 20000 + b"}\n", [], ["nests lists or mappings too deeply"]),
    (b"{}\n", ["model.depth=" + "[" * 20000 + "]" * 20000], ["'model.depth' must be an integer", "(40002 characters)"]),
]


def test_the_largest_seed_trains():
    """seed 2**32 - 1, the largest the recipe takes, seeds everything the trainer seeds."""
    from accelerate.utils import set_seed

    from train.seeding import reseed_step, step_generator
    from train.splits import EpochBatchSampler

    r = load_recipe(ROOT / "recipes/tiny.yaml", [f"seed={2**32 - 1}"])
    set_seed(r.seed)
    reseed_step(r.seed, 10**7, 7)
    step_generator(r.seed, 10**7, 7, "cpu")
    s = EpochBatchSampler(64, 8, r.seed, 1, 2)
    s.set_epoch(10**5)
    assert len(list(s)) == 4


@pytest.mark.parametrize("raw,overrides,words", BAD_INPUT, ids=[str(i) for i in range(len(BAD_INPUT))])
def test_bad_recipe_input_is_one_sentence_exit_2(tmp_path, capsys, raw, overrides, words):
    p = tmp_path / "bad.yaml"
    p.write_bytes(raw)
    root = tmp_path / "runs"
    code = main([str(p), "--set", f"run.root={root}", *overrides])
    err = capsys.readouterr().err.strip()
    assert code == 2 and err.startswith("error: ") and "\n" not in err, err
    for w in words:
        assert w in err, (w, err)
    assert not root.exists()


def test_name_with_path_separators_is_refused_before_anything_is_written(tmp_path, capsys):
    root = tmp_path / "deep" / "runs"
    code = main([str(ROOT / "recipes/tiny.yaml"), "--set", f"run.root={root}", "--name", "../../escaped"])
    assert code == 2 and "run.name" in capsys.readouterr().err
    assert not (tmp_path / "escaped").exists() and not root.exists()


def test_resumable_keys_leave_the_resume_hash_and_the_rest_stay_in_it():
    from train.recipe import RESUMABLE, resume_conflicts

    base = load_recipe(ROOT / "recipes/default.yaml")
    free = [
        "train.steps=3600",
        "train.lr=0.001",
        "train.warmup_steps=200",
        "train.grad_clip=0.5",
        "train.eval_every=100",
        "train.checkpoint_every=100",
        "train.keep_last=5",
        "train.log_every=1",
        "train.eval_batch_size=100",
        "data.num_workers=2",
        "callbacks=[]",
        "run.name=x",
    ]
    for o in free:
        r = load_recipe(ROOT / "recipes/default.yaml", [o])
        assert r.resume_hash() == base.resume_hash(), o
        assert o.split("=")[0] in RESUMABLE or o.split("=")[0].split(".")[0] in RESUMABLE
    for o in [
        "model.depth=4",
        "seed=1",
        "data.img_size=32",
        "train.batch_size=64",
        "train.weight_decay=0.1",
        "train.schedule=linear",
        "train.min_lr=0.0001",
        "interventions.no_skip.blocks=[1]",
        "data.augment.shift=2",
        "train.mixed_precision=bf16",
    ]:
        r = load_recipe(ROOT / "recipes/default.yaml", [o])
        assert r.resume_hash() != base.resume_hash(), o
        assert r.hash() != base.hash(), o
    # a checkpoint that records resume_hash: judged by it; one written before it was recorded: by its full hash,
    # or by the run's saved recipe.yaml when that recipe is the checkpoint's own
    new = {"recipe_hash": base.hash(), "resume_hash": base.resume_hash()}
    old = {"recipe_hash": base.hash()}
    lr = load_recipe(ROOT / "recipes/default.yaml", ["train.lr=0.001", "train.steps=3000"])
    deep = load_recipe(ROOT / "recipes/default.yaml", ["model.depth=4"])
    saved = base.to_dict()
    assert resume_conflicts(lr, new, saved) is None and resume_conflicts(lr, old, saved) is None
    assert resume_conflicts(base, old, None) is None
    assert resume_conflicts(lr, old, None) == []  # cannot tell without the saved recipe: refused
    assert resume_conflicts(deep, new, saved) == ["model.depth"] and resume_conflicts(deep, old, saved) == [
        "model.depth"
    ]
    assert (
        resume_conflicts(lr, old, deep.to_dict()) is not None
    )  # a saved recipe that is not the checkpoint's own proves nothing


def test_resume_may_change_lr_cadence_and_extend_steps_but_not_the_model(write_recipe):
    """The divergence advice (lower train.lr, set train.grad_clip, then resume) can be followed, a finished run can
    be extended with more steps, and the steps after the checkpoint follow the new recipe's schedule."""
    from train.trainer import lr_at, train

    p = write_recipe(train={"steps": 4, "checkpoint_every": 2, "eval_every": 0, "log_every": 1})
    train(load_recipe(p), progress=False)
    more = load_recipe(
        p,
        [
            "train.steps=6",
            "train.lr=0.0005",
            "train.grad_clip=0.5",
            "train.log_every=2",
            "train.keep_last=1",
            "run.name=tiny",
        ],
    )
    out = train(more, resume=True, progress=False)
    assert out["step"] == 6 and not out.get("already_finished")
    from conftest import read_scalars

    lrs = dict(read_scalars(Path(out["run_dir"]))["train/lr"])
    assert lrs[6] == pytest.approx(lr_at(5, more.train))
    with pytest.raises(RecipeError, match="different recipe.*model.depth"):
        train(load_recipe(p, ["train.steps=8", "model.depth=3", "run.name=tiny"]), resume=True, progress=False)


def test_measure_options_the_model_cannot_serve_are_refused_before_training(write_recipe, tmp_path, capsys):
    """cka with repr=cls on a GAP ViT (no class token): --check (what launch.sh runs first) and the trainer refuse it
    in one sentence, exit 2, before the run folder exists (it used to train to the first checkpoint and fail there)."""
    p = write_recipe(model={"head": "gap"}, callbacks=[{"name": "cka", "repr": "cls"}])
    for extra in (["--check"], ["--no-progress"]):
        assert main([str(p), *extra]) == 2
        err = capsys.readouterr().err
        assert (
            err.startswith("error: callback 'cka': measure cka: option repr=cls reads the class token")
            and err.count("\n") == 1
        ), err
        assert not (tmp_path / "runs").exists()
    p = write_recipe(
        model={"head": "gap"}, callbacks=[{"name": "analysis_suite", "measures": ["cka"], "cka": {"repr": "cls"}}]
    )
    assert main([str(p), "--check"]) == 2 and "repr=cls" in capsys.readouterr().err


def test_billion_laughs_in_a_sweep_file_is_refused_at_once(tmp_path, capsys):
    """A sweep file whose grid is aliases of aliases (9^9 values once expanded): one sentence, exit 2, in well under a
    second, and no run folder nor lock."""
    import time

    from train.sweep import main as sweep_main

    lines = ["name: laughs", f"run: {{root: {tmp_path / 'runs'}}}", "sweep:", "  seed: &l0 [0, 0, 0, 0, 0, 0, 0, 0, 0]"]
    lines += [f"  k{i}: &l{i} [{', '.join([f'*l{i - 1}'] * 9)}]" for i in range(1, 9)]
    p = tmp_path / "laughs.yaml"
    p.write_text("\n".join(lines) + "\n")
    t0 = time.perf_counter()
    assert sweep_main([str(p), "--dry-run"]) == 2
    assert time.perf_counter() - t0 < 5
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err and "anchor '&l0' (line 4)" in err, err
    assert not (tmp_path / "runs").exists()
