"""train.objective: mae (train/objectives/mae.py, He et al. 2022): the loss on known cases, the masking, the encoder on
visible patches only, the checkpoint's backbone part, a few-step run with the k-NN monitor and the analysis suite,
exact resume, two processes, bad options."""

import json
import math
import subprocess
from pathlib import Path

import pytest
import torch
from conftest import ROOT, read_scalars, two_process_launch
from safetensors.torch import load_file

import train.objectives._mae as mae_training
import train.objectives.mae as mae
from train.checkpoint import list_checkpoints
from train.cli import main
from train.data import build_data
from train.knn import knn_monitor
from train.models import build_model
from train.objectives import build_objective
from train.recipe import RecipeError, load_recipe
from train.trainer import eval_loader, make_accelerator
from train.trainer import train as run_training

pytestmark = pytest.mark.usefixtures("one_thread")

TINY = ROOT / "recipes/tiny.yaml"
MAE = {"objective": "mae", "mixed_precision": "no"}
SUITE = [
    {
        "name": "analysis_suite",
        "measures": ["cka", "norm_ratio", "attention_distance", "fewshot_probe", "knn"],
        "batch_size": 32,
        "figures": False,
        "fewshot_probe": {"shots": 3},
    }
]


def _objective(head="cls", *sets):
    r = load_recipe(TINY, ["train.objective=mae", f"model.head={head}", *sets])
    torch.manual_seed(0)
    return build_objective(r, build_model(r, 0), 10), r


def _images(n=4, seed=1):
    return torch.randn(n, 1, 28, 28, generator=torch.Generator().manual_seed(seed))


# ---------------------------------------------------------------- the loss


@pytest.mark.parametrize("head", ["cls", "gap"])
@pytest.mark.parametrize("norm_pix", [True, False])
def test_loss_is_zero_for_a_decoder_that_copies_the_target_and_positive_otherwise(head, norm_pix, monkeypatch):
    obj, _ = _objective(head, f"objectives.mae.norm_pix_loss={norm_pix}")
    x = _images()
    loss, terms = obj(x, None, 0)
    assert loss.item() > 0.1 and torch.equal(terms["mae_loss"], loss.detach())
    # a decoder that returns the target on every hidden patch (and garbage on the visible ones, which do not count)
    seen = {}

    def copy(latent, ids_restore):
        mask = torch.ones(ids_restore.shape)
        mask[:, : obj.num_patches - obj.num_masked] = 0
        hidden = mask.gather(1, ids_restore).bool()
        seen["hidden"] = hidden
        return torch.where(hidden.unsqueeze(-1), obj.target(x), torch.full_like(obj.target(x), 7.0))

    monkeypatch.setattr(obj, "decode", copy)
    loss, _ = obj(x, None, 0)
    assert loss.item() == 0.0
    assert seen["hidden"].sum(1).tolist() == [37] * 4
    # one hidden pixel off by d: the loss is d^2 / (pixels per patch * hidden patches)
    d = 0.5

    def off_by_d(latent, ids_restore):
        out = copy(latent, ids_restore)
        b, i = 0, int(seen["hidden"][0].nonzero()[0])
        out[b, i, 0] += d
        return out

    monkeypatch.setattr(obj, "decode", off_by_d)
    loss, _ = obj(x, None, 0)
    assert loss.item() == pytest.approx(d * d / (16 * 37 * 4), rel=1e-5)


def test_norm_pix_targets_are_per_patch_standardised():
    obj, _ = _objective()
    x = _images()
    t = obj.target(x)
    raw = mae.patchify(x, 4)
    assert t.shape == raw.shape == (4, 49, 16)
    assert torch.allclose(t.mean(-1), torch.zeros(4, 49), atol=1e-5)
    assert torch.allclose(t.var(-1), torch.ones(4, 49), atol=1e-3)
    # patchify: patch (row 1, column 2) of image 0 is pixels [4:8, 8:12], flattened row-major
    assert torch.equal(raw[0, 1 * 7 + 2], x[0, 0, 4:8, 8:12].reshape(-1))
    obj.norm_pix_loss = False
    assert torch.equal(obj.target(x), raw)


# ---------------------------------------------------------------- the masking


@pytest.mark.parametrize("ratio", [0.75, 0.5, 0.9, 0.1])
def test_masking_hides_round_ratio_n_patches_per_image_differently_per_image(ratio):
    obj, _ = _objective("cls", f"objectives.mae.mask_ratio={ratio}")
    ids_keep, mask, _ids_restore = obj.random_masking(64, 5, "cpu")
    m = round(ratio * 49)
    assert mask.sum(1).tolist() == [m] * 64
    assert ids_keep.shape == (64, 49 - m)
    assert torch.all(mask.gather(1, ids_keep) == 0), "the kept patches are the visible ones"
    assert len({tuple(r.tolist()) for r in mask}) == 64, "every image gets its own mask"
    _, terms = obj(_images(64), None, 5)
    assert terms["mask_ratio_actual"].item() == pytest.approx(m / 49)


def test_masks_are_a_function_of_seed_step_and_process(monkeypatch):
    obj, _ = _objective()
    first = obj.random_masking(8, 3, "cpu")[1]
    again, _ = _objective()
    assert torch.equal(again.random_masking(8, 3, "cpu")[1], first), "same (seed, step, rank): same masks"
    assert not torch.equal(again.random_masking(8, 4, "cpu")[1], first), "another step: other masks"
    assert not torch.equal(again.random_masking(8, 4, "cpu")[1], again.random_masking(8, 4, "cpu")[1]), (
        "micro-batches of one step continue its stream"
    )
    other_seed, _ = _objective("cls", "seed=1")
    assert not torch.equal(other_seed.random_masking(8, 3, "cpu")[1], first)
    monkeypatch.setattr(mae_training, "_rank", lambda: 1)  # the training code's own (train/objectives/_mae.py)
    rank1, _ = _objective()
    assert not torch.equal(rank1.random_masking(8, 3, "cpu")[1], first), "another process: other masks"


# ---------------------------------------------------------------- the encoder


@pytest.mark.parametrize("head, prefix", [("cls", 1), ("gap", 0)])
def test_encoder_sees_only_the_visible_patches(head, prefix):
    obj, _ = _objective(head)
    lengths = []
    obj.backbone.blocks[0].register_forward_hook(lambda mod, args, out: lengths.append(args[0].shape[1]))
    obj(_images(), None, 0)
    assert lengths == [prefix + 12]  # 49 patches, 37 hidden


@pytest.mark.parametrize("head", ["cls", "gap"])
def test_encoder_is_the_backbone_on_the_chosen_tokens(head):
    """With every patch kept in grid order the encoder is the backbone's forward_features; with a subset, its input
    tokens are the backbone's embedded tokens (position embedding included) at those patches."""
    obj, _ = _objective(head)
    obj.eval()
    x = _images()
    everything = torch.arange(49).expand(4, -1)
    full = obj.backbone.forward_features(x)
    enc = obj.encode(x, everything)
    if head == "cls":
        assert torch.allclose(enc, full, atol=1e-6)
    else:  # GAP: timm normalises the pooled mean (fc_norm); the MAE encoder normalises every token with it
        assert torch.allclose(enc, obj.backbone.fc_norm(full), atol=1e-6)
    seen = []
    obj.backbone.blocks[0].register_forward_hook(lambda mod, args, out: seen.append(args[0]))
    keep = torch.stack([torch.randperm(49, generator=torch.Generator().manual_seed(i))[:12] for i in range(4)])
    obj.encode(x, keep)
    tokens = obj.backbone._pos_embed(obj.backbone.patch_embed(x))
    p = 1 if head == "cls" else 0
    want = torch.cat([tokens[:, :p], tokens[:, p:].gather(1, keep.unsqueeze(-1).expand(-1, -1, 32))], 1)
    assert torch.allclose(seen[0], want)


@pytest.mark.parametrize("head", ["cls", "gap"])
def test_every_parameter_gets_a_gradient(head):
    """Multi-process training (DDP) needs every trained parameter used in every step."""
    obj, _ = _objective(head)
    obj(_images(), None, 0)[0].backward()
    assert [n for n, p in obj.named_parameters() if p.grad is None or not p.grad.abs().sum() > 0] == []


def test_backbone_part_loads_into_a_fresh_backbone():
    obj, r = _objective()
    state = {
        k[len("backbone.") :]: v for k, v in obj.state_dict().items() if k.startswith(mae.Objective.parts["student"])
    }
    fresh = build_model(r, 0)
    assert fresh.load_state_dict(state, strict=True) is not None
    assert all(torch.equal(fresh.state_dict()[k], v) for k, v in state.items())
    other = {k for k in obj.state_dict() if not k.startswith("backbone.")}
    assert other and all(k.startswith(("decoder_", "mask_token")) for k in other)
    assert "decoder_pos_embed" not in other  # fixed: a function of grid and width, not saved


# ---------------------------------------------------------------- training


def _final_weights(run: Path) -> dict:
    return load_file(str(list_checkpoints(run / "checkpoints")[-1] / "model.safetensors"))


def test_few_step_run_logs_mae_terms_and_knn_and_resumes_exactly(write_recipe):
    """6 steps straight (checkpoint at 3, the analysis suite with k-NN on the num_classes=0 backbone) == 3 steps,
    crash, resume 3 more: same loss curve and masks (mask_ratio_actual), same final weights."""
    train_cfg = {
        **MAE,
        "steps": 6,
        "checkpoint_every": 3,
        "eval_every": 3,
        "log_every": 1,
        "warmup_steps": 1,
        "lr": 0.002,
    }
    straight = run_training(load_recipe(write_recipe("straight", train=train_cfg, callbacks=SUITE)), progress=False)
    run = Path(straight["run_dir"])
    s = read_scalars(run)
    losses = [v for _, v in s["train/mae_loss"]]
    assert [k for k, _ in s["train/mae_loss"]] == list(range(1, 7))
    assert all(math.isfinite(v) for v in losses) and losses[-1] < losses[0]
    assert s["train/loss"] == s["train/mae_loss"]
    assert all(v == pytest.approx(37 / 49) for _, v in s["train/mask_ratio_actual"])
    assert [k for k, _ in s["eval/knn_top1"]] == [3, 6] and all(0.0 <= v <= 1.0 for _, v in s["eval/knn_top1"])
    assert "eval/top1" not in s
    summary = json.loads((run / "analysis/step_0000006/summary.json").read_text())
    assert {"cka", "norm_ratio", "attention_distance", "fewshot_probe", "knn"} <= set(summary)
    meta = json.loads((list_checkpoints(run / "checkpoints")[-1] / "meta.json").read_text())
    assert meta["objective"]["name"] == "mae" and meta["objective"]["parts"] == {"student": "backbone."}
    assert meta["eval"]["knn_top1"] == straight["top1"]
    # the checkpoint's backbone part loads into the recipe's ViT without a head
    w = _final_weights(run)
    fresh = build_model(load_recipe(run / "recipe.yaml"), 0)
    fresh.load_state_dict({k[len("backbone.") :]: v for k, v in w.items() if k.startswith("backbone.")}, strict=True)

    from test_train import Crash  # registers test_crash_at

    p = write_recipe("resumed", train=train_cfg, callbacks=[*SUITE, {"name": "test_crash_at", "step": 3}])
    with pytest.raises(Crash):
        run_training(load_recipe(p), progress=False)
    resumed = run_training(load_recipe(p), resume=True, progress=False)
    assert resumed["step"] == 6
    b = read_scalars(Path(resumed["run_dir"]))
    assert b["train/mae_loss"] == s["train/mae_loss"] and b["eval/knn_top1"] == s["eval/knn_top1"]
    wb = _final_weights(Path(resumed["run_dir"]))
    assert w.keys() == wb.keys() and all(torch.equal(w[k], wb[k]) for k in w)


def test_gap_model_trains_with_the_suite(write_recipe):
    p = write_recipe(
        "gap", model={"head": "gap"}, train={**MAE, "steps": 2, "checkpoint_every": 2, "eval_every": 2}, callbacks=SUITE
    )
    out = run_training(load_recipe(p), progress=False)
    assert out["step"] == 2 and 0.0 <= out["top1"] <= 1.0
    s = read_scalars(Path(out["run_dir"]))
    assert all(math.isfinite(v) for _, v in s["train/mae_loss"])
    assert (Path(out["run_dir"]) / "analysis/step_0000002/summary.json").is_file()


def test_shipped_recipe_is_the_default_model_with_mae():
    r = load_recipe(ROOT / "recipes/mae.yaml")
    d = load_recipe(ROOT / "recipes/default.yaml")
    assert r.train.objective == "mae" and r.model == d.model and r.data == d.data
    assert (r.train.steps, r.train.batch_size) == (d.train.steps, d.train.batch_size)
    assert r.objectives.mae.mask_ratio == 0.75 and r.objectives.mae.norm_pix_loss
    assert "knn" in r.callbacks[0].options["measures"]


@pytest.mark.multiprocess
def test_two_process_knn_top1_equals_one_process(write_recipe, tmp_path):
    """2 processes (gloo): the run trains (DDP over the objective: backbone + decoder), its k-NN top-1 counts every
    eval image once and equals one process's k-NN on the saved backbone."""
    p = write_recipe(train={**MAE, "steps": 2, "checkpoint_every": 2, "eval_every": 2, "eval_batch_size": 64})
    cmd, env = two_process_launch(p, 29541)
    out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    ckpts = list_checkpoints(tmp_path / "runs/tiny/checkpoints")
    assert ckpts and ckpts[-1].name == "step_0000002", out.stderr[-3000:]
    meta = json.loads((ckpts[-1] / "meta.json").read_text())
    assert meta["num_processes"] == 2 and meta["eval"]["n"] == 250 and meta["eval"]["n_bank"] == 100

    recipe = load_recipe(p)
    acc = make_accelerator(recipe)
    data = build_data(recipe)
    backbone = build_model(recipe, 0)
    w = load_file(str(ckpts[-1] / "model.safetensors"))
    backbone.load_state_dict({k[len("backbone.") :]: v for k, v in w.items() if k.startswith("backbone.")}, strict=True)
    bank, queries = acc.prepare(eval_loader(data.probe_train, 64)), acc.prepare(eval_loader(data.eval, 64))
    one = knn_monitor(acc, backbone, bank, queries, data.normalize, data.num_classes)
    assert one["n"] == 250 and one["top1"] == meta["eval"]["top1"]


# ---------------------------------------------------------------- bad options


@pytest.mark.parametrize(
    "sets, words",
    [
        (["model.arch=resnet"], "needs a ViT (model.arch: vit, not resnet)"),
        (["objectives.mae.mask_ratio=0.995"], "hides every patch of the 49-patch grid"),
        (["objectives.mae.mask_ratio=0.005"], "hides no patch of the 49-patch grid"),
        (["objectives.mae.mask_ratio=1.5"], "'objectives.mae.mask_ratio' is 1.5, out of range"),
        (["objectives.mae.decoder_dim=30"], "'objectives.mae.decoder_dim' (30) must be a multiple of 4"),
        (["objectives.mae.decoder_heads=3"], "must be a multiple of 4 (the 2-D sin-cos position embedding) and of"),
        (
            ["interventions.local_attention={blocks: [0], heads: [0]}"],
            "interventions.local_attention fixes the token grid",
        ),
        (["data.augment.mixup_alpha=0.8"], "mix labels, which train.objective 'mae' does not use"),
    ],
)
def test_bad_options_are_one_sentence_exit_2_before_anything_is_written(sets, words, tmp_path, capsys):
    assert main([str(TINY), "--set", "train.objective=mae", *sets, f"run.root={tmp_path}", "--no-progress"]) == 2
    err = capsys.readouterr().err.strip()
    assert words in err and len(err.splitlines()) == 1 and err.endswith(".") and err.count(". ") == 0, err
    assert not any(tmp_path.iterdir())
    with pytest.raises(RecipeError):
        load_recipe(TINY, ["train.objective=mae", *sets])
