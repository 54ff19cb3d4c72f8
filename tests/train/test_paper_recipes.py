"""Full-scale recipes (recipes/paper/): they validate and build their models (nothing downloaded), ResNet-50,
dropout, and recipe hashes that stay put for runs trained before the new fields existed."""

import pytest
import torch
from conftest import ROOT

from train.cli import main
from train.models import build_model
from train.recipe import ADDED_FIELDS, load_recipe

PAPER = sorted((ROOT / "recipes/paper").glob("*.yaml"))


def test_default_recipe_hash_is_unchanged_by_the_new_fields():
    r = load_recipe(ROOT / "recipes/default.yaml")
    assert r.hash() == "82a396f18b71fd7d"
    spelled = load_recipe(
        ROOT / "recipes/default.yaml",
        [
            "data.in_memory=auto",
            "data.augment.random_resized_crop=false",
            "model.resnet_block=basic",
            "model.dropout=0.0",
            "model.mixer_token_ratio=0.5",
            "train.objective=supervised",
            "data.val_size=0",
            "model.reg_tokens=0",
            "train.compile=false",
        ],
    )
    assert spelled.hash() == r.hash()  # written out at their defaults: still the old hash
    for o in (
        "data.in_memory=false",
        "data.augment.random_resized_crop=true",
        "model.resnet_block=bottleneck",
        "model.dropout=0.1",
        "model.mixer_token_ratio=0.25",
        "model.reg_tokens=4",
        "model.init_seed=7",
        "train.compile=true",
    ):
        assert load_recipe(ROOT / "recipes/default.yaml", [o]).hash() != r.hash(), o
    assert {k[-1] for k in ADDED_FIELDS} == {
        "in_memory",
        "random_resized_crop",
        "resnet_block",
        "dropout",
        "mixer_token_ratio",
        "mixup_alpha",
        "cutmix_alpha",
        "mix_prob",
        "switch_prob",
        "mix_mode",
        "randaugment_ops",
        "randaugment_magnitude",
        "val_size",
        "objective",
        "init_from",
        "init_part",
        "freeze_backbone",
        "reg_tokens",
        "init_seed",
        "compile",
    }


def test_paper_recipes_are_the_papers_hyper_parameters():
    names = {p.stem for p in PAPER}
    assert names == {"vit_b32_imagenet", "vit_b32_gap_imagenet", "resnet50_imagenet", "cifar10_vit", "cifar10_resnet"}
    vit = load_recipe(ROOT / "recipes/paper/vit_b32_imagenet.yaml")
    m, t, d = vit.model, vit.train, vit.data
    assert (m.patch_size, m.depth, m.embed_dim, m.num_heads, m.mlp_ratio, m.dropout) == (32, 12, 768, 12, 4.0, 0.1)
    assert (t.lr, t.warmup_steps, t.schedule, t.weight_decay, t.grad_clip, t.betas) == (
        3e-3,
        10000,
        "cosine",
        0.3,
        1.0,
        [0.9, 0.999],
    )
    assert (
        t.batch_size * t.grad_accum * 8 == 4096 and t.steps == -(-300 * 1281167 // 4096) and t.mixed_precision == "bf16"
    )
    assert (d.name, d.img_size, d.augment.random_resized_crop, d.augment.hflip) == ("imagenet-1k", 224, True, True)
    gap = load_recipe(ROOT / "recipes/paper/vit_b32_gap_imagenet.yaml")
    assert gap.model.head == "gap" and gap.train.lr == pytest.approx(3e-3 * 3e-4 / 8e-4)
    rn = load_recipe(ROOT / "recipes/paper/resnet50_imagenet.yaml")
    assert (rn.model.resnet_block, rn.model.resnet_layers, rn.train.steps, rn.data.name) == (
        "bottleneck",
        [3, 4, 6, 3],
        t.steps,
        "imagenet-1k",
    )


@pytest.mark.parametrize("path", PAPER, ids=[p.stem for p in PAPER])
def test_paper_recipe_validates_and_builds(path):
    r = load_recipe(path)
    assert r.name == path.stem
    classes = 1000 if r.data.name == "imagenet-1k" else 10
    model = build_model(r, classes)
    n = sum(p.numel() for p in model.parameters())
    if r.data.img_size <= 32:  # the small ones: one forward pass on random input
        model.eval()
        with torch.no_grad():
            out = model(torch.randn(2, r.data.in_chans, r.data.img_size, r.data.img_size))
        assert out.shape == (2, classes)
    if path.stem.startswith("vit_b32"):
        assert 87e6 < n < 89e6  # ViT-B/32: 88.2M
        assert any(isinstance(mod, torch.nn.Dropout) and mod.p == 0.1 for mod in model.modules())


def test_resnet50_bottleneck_has_25_6m_parameters_and_runs_at_224():
    r = load_recipe(ROOT / "recipes/paper/resnet50_imagenet.yaml")
    model = build_model(r, 1000).eval()
    n = sum(p.numel() for p in model.parameters())
    assert abs(n - 25.557e6) < 0.01e6, n  # torchvision / timm resnet50: 25,557,032
    with torch.no_grad():
        assert model(torch.randn(1, 3, 224, 224)).shape == (1, 1000)


BAD = [
    ("data.in_memory=maybe", ["data.in_memory", "'auto'", "'true'", "'false'"]),
    ("data.augment.random_resized_crop=3", ["data.augment.random_resized_crop", "true or false"]),
    ("model.resnet_block=wide", ["model.resnet_block", "'basic'", "'bottleneck'"]),
    ("model.dropout=1.5", ["model.dropout", "out of range", "<= 1.0"]),
    ("model.arch=resnet model.dropout=0.1", ["model.dropout", "vit and mixer"]),
]


@pytest.mark.parametrize("override,words", BAD, ids=[b[0] for b in BAD])
def test_bad_values_are_one_sentence(tmp_path, capsys, override, words):
    root = tmp_path / "runs"
    code = main([str(ROOT / "recipes/default.yaml"), "--set", f"run.root={root}", *override.split()])
    err = capsys.readouterr().err.strip()
    assert code == 2 and err.startswith("error: ") and "\n" not in err, err
    for w in words:
        assert w in err, (w, err)
    assert not root.exists()


def test_in_memory_yaml_booleans_read_as_choices():
    assert load_recipe(ROOT / "recipes/default.yaml", ["data.in_memory=true"]).data.in_memory == "true"
    assert load_recipe(ROOT / "recipes/default.yaml", ["data.in_memory=no"]).data.in_memory == "false"
