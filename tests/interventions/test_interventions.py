"""Interventions: no skip at block i, GAP head, head masks, data subsets, sweeps; every recipe trains."""

import json
import os
import subprocess

import pytest
import torch
from conftest import ROOT, shipped_recipes

from interventions.no_skip import block_classes
from train.data import build_data
from train.models import build_model
from train.recipe import from_dict, load_recipe
from train.trainer import train

SMALL = {"model": {"depth": 4, "embed_dim": 32, "num_heads": 4}}


def _model(**iv):
    r = from_dict({**SMALL, "interventions": iv} if iv else SMALL)
    torch.manual_seed(0)
    return build_model(r, 10).eval()


def _zero_branches(block):
    with torch.no_grad():
        for lin in (block.attn.proj, block.mlp.fc2):
            lin.weight.zero_()
            lin.bias.zero_()


def test_no_skip_block_drops_its_residual_and_leaves_others_untouched():
    _Block, NoSkipBlock = block_classes()
    plain, noskip = _model(), _model(no_skip={"blocks": [2], "where": "both"})
    assert [type(b) is NoSkipBlock for b in noskip.blocks] == [False, False, True, False]
    assert plain.state_dict().keys() == noskip.state_dict().keys()
    for a, b in zip(plain.state_dict().values(), noskip.state_dict().values()):
        assert torch.equal(a, b)  # same init: only the forward differs
    x = torch.randn(3, 17, 32)
    for i, blk in enumerate(noskip.blocks):
        _zero_branches(blk)
        y = blk(x)
        if i == 2:
            assert torch.allclose(y, torch.zeros_like(y)), (
                "no-skip block with zero branches outputs zero, not its input"
            )
        else:
            assert torch.equal(y, x), "a normal block with zero branches returns its input"


@pytest.mark.parametrize("where,attn_skip,mlp_skip", [("attn", False, True), ("mlp", True, False)])
def test_no_skip_where(where, attn_skip, mlp_skip):
    m = _model(no_skip={"blocks": [1], "where": where})
    blk = m.blocks[1]
    assert (blk.skip_attn, blk.skip_mlp) == (attn_skip, mlp_skip)
    x = torch.randn(2, 17, 32)
    with torch.no_grad():
        blk.mlp.fc2.weight.zero_()
        blk.mlp.fc2.bias.zero_()
        a = blk.attn(blk.norm1(x))
    y = blk(x)
    expected = (x + a) if attn_skip else a
    expected = expected if mlp_skip else torch.zeros_like(expected)
    assert torch.allclose(y, expected, atol=1e-6)


def _loss_falls(model):
    b = build_data(from_dict({"data": {"train_size": 64, "probe_train_size": 10, "analysis_size": 10}}))
    x, y = b.normalize(b.train.images), b.train.labels
    torch.manual_seed(0)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model.train()
    losses = []
    for _ in range(30):
        loss = torch.nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def test_no_skip_model_still_trains():
    losses = _loss_falls(_model(no_skip={"blocks": [2], "where": "both"}))
    assert losses[-1] < 0.8 * losses[0] and all(a > b for a, b in zip(losses[::5], losses[5::5]))


def test_gap_head_has_no_class_token_and_classifies_the_token_mean():
    r = from_dict({**SMALL, "model": {**SMALL["model"], "head": "gap"}})
    m = build_model(r, 10).eval()
    assert m.cls_token is None and m.num_prefix_tokens == 0 and m.global_pool == "avg"
    x = torch.randn(2, 1, 28, 28)
    seen = {}
    m.head.register_forward_pre_hook(lambda mod, args: seen.setdefault("head_in", args[0]))
    with torch.no_grad():
        feats = m.forward_features(x)
        assert feats.shape == (2, 49, 32)
        out = m(x)
        assert torch.allclose(seen["head_in"], m.fc_norm(feats.mean(1)), atol=1e-6)
        assert torch.allclose(out, m.head(m.fc_norm(feats.mean(1))), atol=1e-6)
    cls = build_model(from_dict(SMALL), 10)
    assert cls.num_prefix_tokens == 1 and cls.cls_token is not None


def test_head_mask_zeroes_exactly_the_chosen_heads():
    m = _model(head_mask={"block": 1, "heads": [0, 2]})
    attn = m.blocks[1].attn
    hd = attn.head_dim
    seen = {}
    attn.proj.register_forward_pre_hook(lambda mod, args: seen.__setitem__("x", args[0]))  # runs after the mask
    x = torch.randn(2, 50, 32)
    with torch.no_grad():
        out = attn(x)
    heads = seen["x"].view(2, 50, 4, hd)
    assert (
        heads[:, :, [0, 2]].abs().max() == 0 and heads[:, :, 1].abs().min() >= 0 and heads[:, :, [1, 3]].abs().max() > 0
    )
    # a change to a masked head's value weights changes nothing; a change to a kept head's does
    with torch.no_grad():
        c = 32
        attn.qkv.weight[2 * c + 0 * hd : 2 * c + 1 * hd] += 1.0  # V of head 0 (masked)
        assert torch.allclose(attn(x), out, atol=1e-6)
        attn.qkv.weight[2 * c + 1 * hd : 2 * c + 2 * hd] += 1.0  # V of head 1 (kept)
        assert not torch.allclose(attn(x), out, atol=1e-3)
    # with fused attention too
    attn.fused_attn = not attn.fused_attn
    with torch.no_grad():
        attn(x)
    assert seen["x"].view(2, 50, 4, hd)[:, :, [0, 2]].abs().max() == 0


def test_data_subsets_balanced_seeded_nested_and_recorded():
    sizes, sets = {}, {}
    for f in (0.03, 0.1, 0.3):
        r = from_dict(
            {
                "data": {"probe_train_size": 10, "analysis_size": 10},
                "interventions": {"data_subset": {"fraction": f, "seed": 5}},
            }
        )
        b = build_data(r)
        sizes[f] = b.meta["data_subset"]["size"]
        assert b.train.labels.bincount().tolist() == [sizes[f] // 10] * 10
        sets[f] = {bytes(img.numpy()) for img in b.train.images[:: max(1, sizes[f] // 50)]}
        assert len(b.meta["data_subset"]["hash"]) == 16
    assert sizes == {0.03: 1800, 0.1: 6000, 0.3: 18000}
    assert sets[0.03] <= {
        bytes(i.numpy())
        for i in build_data(
            from_dict(
                {
                    "data": {"probe_train_size": 10, "analysis_size": 10},
                    "interventions": {"data_subset": {"fraction": 0.1, "seed": 5}},
                }
            )
        ).train.images
    }
    other = build_data(
        from_dict(
            {
                "data": {"probe_train_size": 10, "analysis_size": 10},
                "interventions": {"data_subset": {"count": 1800, "seed": 6}},
            }
        )
    )
    assert other.meta["data_subset"]["size"] == 1800
    assert (
        other.meta["data_subset"]["hash"]
        != build_data(
            from_dict(
                {
                    "data": {"probe_train_size": 10, "analysis_size": 10},
                    "interventions": {"data_subset": {"count": 1800, "seed": 5}},
                }
            )
        ).meta["data_subset"]["hash"]
    )


TINY_SET = [
    "train.steps=2",
    "train.batch_size=16",
    "train.warmup_steps=1",
    "train.eval_every=0",
    "train.checkpoint_every=0",
    "data.train_size=640",
    "data.eval_size=64",
    "data.probe_train_size=200",
    "data.analysis_size=32",
]


@pytest.mark.parametrize("path", [p.relative_to(ROOT) for p in shipped_recipes(include_paper=False)], ids=str)
def test_every_recipe_trains_a_few_steps(path, tmp_path):
    r = load_recipe(ROOT / path, [*TINY_SET, f"run.root={tmp_path}"])
    if r.interventions.data_subset is not None and r.interventions.data_subset.count:
        r.interventions.data_subset.count = min(r.interventions.data_subset.count, 64)
    out = train(r, progress=False)
    assert out["step"] == 2 and 0.0 <= out["top1"] <= 1.0


@pytest.mark.slow  # about 45 s: the sweep's planning and one-sentence errors are tested on their own
def test_sweep_runs_each_point_once_and_rerun_starts_nothing(write_recipe, tmp_path):
    p = write_recipe(train={"steps": 2, "checkpoint_every": 0, "eval_every": 0})
    cmd = [
        str(ROOT / "launch.sh"),
        "sweep",
        str(p),
        "--grid",
        "interventions.no_skip.blocks=[0],[1]",
        "--set",
        "train.lr=0.002",
    ]
    env = {**os.environ, "VITLAB_NPROC": "1"}
    first = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert first.returncode == 0, first.stdout[-2000:] + first.stderr[-2000:]
    runs = sorted(d.name for d in (tmp_path / "runs").iterdir())
    assert runs == ["tiny-interventions.no_skip.blocks__0_", "tiny-interventions.no_skip.blocks__1_"]
    assert "2 started" in first.stdout
    second = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert second.returncode == 0 and "2 already finished, 0 started" in second.stdout
    meta = json.loads((tmp_path / "runs" / runs[1] / "checkpoints" / "step_0000002" / "meta.json").read_text())
    assert meta["interventions"]["no_skip"] == {"blocks": [1], "where": "both"}


def test_sweep_bad_grid_is_one_sentence(write_recipe, tmp_path, capsys):
    from train.sweep import main

    p = write_recipe()
    assert main([str(p), "--grid", "interventions.no_skip.blocks=[0],[7]"]) == 2
    err = capsys.readouterr().err
    assert "interventions.no_skip.blocks" in err and "out of range" in err
    assert not (tmp_path / "runs").exists()


def test_two_head_masks_on_one_block_merge_and_every_mask_follows_the_model():
    """Two head_mask entries naming one block mask the union of their heads through one hook, and every mask's
    buffer is the model's (so .to(device / dtype) moves it): a second entry used to orphan the first's buffer."""
    from interventions.head_mask import HeadMask

    m = _model(head_mask=[{"block": 1, "heads": [0]}, {"block": 1, "heads": [2]}, {"block": 3, "heads": [1]}])
    hooks = [h for blk in m.blocks for h in blk.attn.proj._forward_pre_hooks.values() if isinstance(h, HeadMask)]
    owned = [mod for mod in m.modules() if isinstance(mod, HeadMask)]
    assert len(hooks) == 2 and {id(h) for h in hooks} == {id(h) for h in owned}
    m.to(torch.float64)
    assert all(h.mask.dtype == torch.float64 for h in hooks), "a mask buffer stopped following the model"
    attn, seen = m.blocks[1].attn, {}
    attn.proj.register_forward_pre_hook(lambda mod, args: seen.__setitem__("x", args[0]))
    with torch.no_grad():
        attn(torch.randn(2, 50, 32, dtype=torch.float64))
    heads = seen["x"].view(2, 50, 4, attn.head_dim)
    assert heads[:, :, [0, 2]].abs().max() == 0 and heads[:, :, 1].abs().min() > 0 and heads[:, :, 3].abs().min() > 0


def test_interventions_are_found_by_file_name_and_are_a_leaf_package():
    """Adding an intervention is adding one file: the recipe section's keys are the package's modules, and the
    package imports nothing from train/ or analysis/."""
    import ast
    import dataclasses

    import interventions
    from train.recipe import InterventionsConfig, Recipe

    files = sorted(p.stem for p in (ROOT / "interventions").glob("*.py") if not p.stem.startswith("_"))
    assert sorted(interventions.REGISTRY) == files == sorted(f.name for f in dataclasses.fields(InterventionsConfig))
    for p in (ROOT / "interventions").glob("*.py"):
        for node in ast.walk(ast.parse(p.read_text())):
            names = (
                [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else [node.module or ""]
                if isinstance(node, ast.ImportFrom)
                else []
            )
            assert not any(n.split(".")[0] in ("train", "analysis") for n in names), (p.name, names)
    assert Recipe().interventions == InterventionsConfig()
