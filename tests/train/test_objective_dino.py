"""train.objective: dino (Caron et al. 2021): the loss on a case with a known value and against DINO's own loop,
the teacher's EMA schedule, the multi-crop views, timm's dynamic_img_size at the native size, checkpoint parts,
a few-step run with the k-NN monitor and the analysis suite, exact resume, two processes, bad options."""

import json
import math
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from conftest import ROOT, read_scalars, two_process_launch
from safetensors.torch import load_file

from train.checkpoint import list_checkpoints
from train.cli import main
from train.models import build_model, build_vit
from train.objectives import build_objective
from train.objectives.dino import DINOHead, crop_boxes, dino_loss, random_resized_crops
from train.recipe import RecipeError, from_dict, load_recipe
from train.seeding import reseed_step, step_generator
from train.trainer import train as run_training

pytestmark = pytest.mark.usefixtures("one_thread")

DINO = {"out_dim": 64, "hidden_dim": 32, "bottleneck_dim": 16, "local_crops_number": 2, "local_crop_size": 12}
TINY_MODEL = {"depth": 2, "embed_dim": 32, "num_heads": 2, "mlp_ratio": 2.0}


def _recipe(steps: int = 10, **dino):
    return from_dict(
        {"model": TINY_MODEL, "train": {"objective": "dino", "steps": steps}, "objectives": {"dino": {**DINO, **dino}}}
    )


def _objective(steps: int = 10, **dino):
    r = _recipe(steps, **dino)
    torch.manual_seed(0)
    return r, build_objective(r, build_model(r, 0), 10)


def _entropy(q):
    return -(q * q.clamp_min(1e-30).log()).sum(-1)


# ---------------------------------------------------------------- the loss


def test_loss_with_identical_centred_outputs_and_equal_temperatures_is_the_teacher_entropy():
    """H(q, p) = H(q) + KL(q || p): when every student view's output equals the teacher's after centring and the two
    temperatures are equal, p = q and the loss is the teacher's entropy. Teacher logits 0 on 4 of 8 prototypes and
    -100 on the rest (x 1/0.1) make q uniform on 4 prototypes: the loss is log 4."""
    b, k, n_views, tau = 3, 8, 5, 0.1
    z = torch.full((b, k), -100.0)
    for i in range(b):
        z[i, torch.randperm(k)[:4]] = 0.0
    center = torch.randn(1, k)
    teacher = (z + center).repeat(2, 1)  # both global views
    student = z.repeat(n_views, 1)
    loss, q = dino_loss(student, teacher, center, tau, tau)
    assert loss.item() == pytest.approx(math.log(4), abs=1e-6)
    assert torch.allclose(q, F.softmax(z / tau, -1).repeat(2, 1))
    # any logits: the loss is the mean entropy of softmax(z / tau)
    z = torch.randn(b, k) * 3
    loss, _ = dino_loss(z.repeat(n_views, 1), (z + center).repeat(2, 1), center, 0.07, 0.07)
    assert loss.item() == pytest.approx(_entropy(F.softmax(z / 0.07, -1)).mean().item(), rel=1e-5)
    # and it is larger when the student differs (KL > 0)
    assert dino_loss(torch.randn(n_views * b, k), (z + center).repeat(2, 1), center, 0.07, 0.07)[0] > loss


def _dino_reference(student_output, teacher_output, center, temp, student_temp, ncrops):
    """main_dino.py DINOLoss.forward (without the centre update), as the authors wrote it."""
    student_out = (student_output / student_temp).chunk(ncrops)
    teacher_out = F.softmax((teacher_output - center) / temp, dim=-1).detach().chunk(2)
    total_loss, n_loss_terms = 0, 0
    for iq, q in enumerate(teacher_out):
        for v in range(len(student_out)):
            if v == iq:
                continue
            total_loss += torch.sum(-q * F.log_softmax(student_out[v], dim=-1), dim=-1).mean()
            n_loss_terms += 1
    return total_loss / n_loss_terms


@pytest.mark.parametrize("ncrops", [2, 3, 6])
def test_loss_equals_the_authors_loop(ncrops):
    torch.manual_seed(1)
    b, k = 4, 16
    s, t, c = (
        torch.randn(ncrops * b, k, dtype=torch.float64),
        torch.randn(2 * b, k, dtype=torch.float64),
        torch.randn(1, k, dtype=torch.float64),
    )
    ours, _ = dino_loss(s, t, c, 0.04, 0.1)
    assert ours.item() == pytest.approx(_dino_reference(s, t, c, 0.04, 0.1, ncrops).item(), rel=1e-12)


def test_center_is_an_ema_of_the_teacher_batch_mean_and_terms_are_logged():
    _r, obj = _objective()
    x = torch.randn(4, 1, 28, 28)
    with torch.no_grad():
        glob, _ = obj.views(x, 0)
        t = obj.teacher_head(obj.teacher_backbone(glob))
    c0 = obj.center.clone()
    loss, terms = obj(x, None, 0)
    assert torch.allclose(obj.center, 0.9 * c0 + 0.1 * t.mean(0, keepdim=True), atol=1e-6)
    assert set(terms) == {
        "dino_loss",
        "teacher_entropy",
        "teacher_student_kl",
        "center_norm",
        "teacher_momentum",
        "teacher_temp",
    }
    assert terms["teacher_student_kl"].item() == pytest.approx(loss.item() - terms["teacher_entropy"].item(), abs=1e-6)
    assert terms["teacher_student_kl"].item() > 0
    assert terms["center_norm"].item() == pytest.approx(obj.center.norm().item())
    assert "center" in obj.state_dict()


def test_teacher_temperature_warms_up_linearly_as_dino():
    _, obj = _objective(warmup_teacher_temp=0.04, teacher_temp=0.07, warmup_teacher_temp_steps=4)
    want = np.concatenate((np.linspace(0.04, 0.07, 4), np.ones(6) * 0.07))  # DINO's teacher_temp_schedule
    assert [obj.teacher_temp(s) for s in range(10)] == pytest.approx(list(want), abs=1e-12)


# ---------------------------------------------------------------- the teacher


def test_teacher_is_an_ema_of_the_student_with_the_cosine_momentum_schedule():
    """after_step(s) (s optimizer steps done) sets theta_t <- m theta_t + (1 - m) theta_s with
    m = 1 - (1 - m0) (cos(pi (s - 1) / S) + 1) / 2: DINO's cosine_scheduler(m0, 1, ...)[s - 1]."""
    steps, m0 = 10, 0.9
    _, obj = _objective(steps, momentum_teacher=m0)
    dino_schedule = 1 + 0.5 * (m0 - 1) * (1 + np.cos(np.pi * np.arange(steps) / steps))  # utils.cosine_scheduler
    assert obj.teacher_momentum(0) == pytest.approx(m0) and obj.teacher_momentum(steps) == pytest.approx(1.0)
    student = [*obj.backbone.parameters(), *obj.head.parameters()]
    teacher = [*obj.teacher_backbone.parameters(), *obj.teacher_head.parameters()]
    assert all(torch.equal(a, b) for a, b in zip(student, teacher)), "the teacher starts as the student"
    assert all(not p.requires_grad for p in teacher) and all(p.requires_grad for p in obj.backbone.parameters())
    for s in range(1, steps + 1):
        with torch.no_grad():
            for p in student:
                p.add_(torch.randn_like(p) * 0.1)
        before = [p.clone() for p in teacher]
        obj.after_step(s)
        m = 1 - (1 - m0) * (math.cos(math.pi * (s - 1) / steps) + 1) / 2
        assert m == pytest.approx(dino_schedule[s - 1], abs=1e-12)
        for p_t, t0, p_s in zip(teacher, before, student):
            assert torch.allclose(p_t, m * t0 + (1 - m) * p_s, atol=1e-6), f"step {s}"
    assert not torch.equal(teacher[0], student[0])


def test_teacher_stays_in_eval_mode_and_gets_no_gradient():
    _, obj = _objective(local_crops_number=0)
    obj.train()
    assert obj.backbone.training and not obj.teacher_backbone.training and not obj.teacher_head.training
    loss, _ = obj(torch.randn(4, 1, 28, 28), None, 0)
    loss.backward()
    assert all(p.grad is None for p in [*obj.teacher_backbone.parameters(), *obj.teacher_head.parameters()])
    assert (
        obj.backbone.pos_embed.grad is not None
        and obj.head.last_layer.parametrizations.weight.original1.grad is not None
    )
    assert obj.head.last_layer.parametrizations.weight.original0.grad is None, "norm_last_layer: the norm is fixed at 1"


def test_head_last_layer_is_weight_normalised_to_one():
    head = DINOHead(8, 20, hidden_dim=16, bottleneck_dim=6)
    assert torch.allclose(head.last_layer.weight.norm(dim=1), torch.ones(20), atol=1e-6)
    free = DINOHead(8, 20, hidden_dim=16, bottleneck_dim=6, norm_last_layer=False)
    assert free.last_layer.parametrizations.weight.original0.requires_grad


# ---------------------------------------------------------------- the views


def test_views_have_the_stated_sizes_and_are_a_function_of_seed_and_step():
    _, obj = _objective(local_crops_number=3, local_crop_size=8)
    x = torch.randn(5, 1, 28, 28)
    glob, loc = obj.views(x, 7)
    assert glob.shape == (10, 1, 28, 28) and loc.shape == (15, 1, 8, 8)
    again = obj.views(x, 7)
    assert torch.equal(glob, again[0]) and torch.equal(loc, again[1])
    other = obj.views(x, 8)
    assert not torch.equal(glob, other[0]) and not torch.equal(loc, other[1])
    obj.seed = 1
    assert not torch.equal(glob, obj.views(x, 7)[0])


def test_crop_boxes_follow_random_resized_crop():
    g = torch.Generator().manual_seed(0)
    boxes = crop_boxes(4000, 28, 28, (0.05, 0.4), g, "cpu")
    w, h = boxes[:, 2] - boxes[:, 0], boxes[:, 3] - boxes[:, 1]
    assert (boxes[:, :2] >= 0).all() and (boxes[:, 2] <= 28).all() and (boxes[:, 3] <= 28).all()
    assert torch.equal(boxes, boxes.round())
    area = w * h / 784
    assert area.min() >= 0.03 and area.max() <= 0.45  # 0.05-0.4 up to the rounding of the sides to whole pixels
    assert area.mean().item() == pytest.approx(0.225, abs=0.01)
    ratio = w / h
    assert ratio.min() >= 0.6 and ratio.max() <= 1.6
    # a box that never fits (area > image in every try) falls back to the whole image
    whole = crop_boxes(50, 28, 28, (1.0, 1.0), torch.Generator().manual_seed(0), "cpu")
    assert torch.equal(whole, torch.tensor([[0.0, 0.0, 28.0, 28.0]]).expand(50, 4))


def test_a_whole_image_crop_is_the_image_and_flips_are_mirror_images():
    x = torch.randn(6, 2, 28, 28)
    g = torch.Generator().manual_seed(3)
    assert torch.allclose(random_resized_crops(x, 2, 28, (1.0, 1.0), g, hflip=False), x.repeat(2, 1, 1, 1), atol=1e-6)
    out = random_resized_crops(x, 4, 28, (1.0, 1.0), g, hflip=True)
    same = [torch.allclose(o, x[i % 6], atol=1e-6) for i, o in enumerate(out)]
    mirrored = [torch.allclose(o, x[i % 6].flip(-1), atol=1e-6) for i, o in enumerate(out)]
    assert all(a or b for a, b in zip(same, mirrored)) and any(same) and any(mirrored)


def test_step_generator_does_not_repeat_the_augmentations_draws():
    """The trainer seeds torch's global RNG with step_seed(seed, step, rank) for the augmentation: a generator with
    the same seed would repeat its draws (a crop's first uniforms would be the flip's)."""
    reseed_step(0, 5, 0)
    aug = torch.rand(100)
    ours = torch.rand(100, generator=step_generator(0, 5, 0, "cpu"))
    assert abs(np.corrcoef(aug.numpy(), ours.numpy())[0, 1]) < 0.4
    assert torch.equal(ours, torch.rand(100, generator=step_generator(0, 5, 0, "cpu")))
    assert not torch.equal(ours, torch.rand(100, generator=step_generator(0, 5, 1, "cpu")))


# ---------------------------------------------------------------- the model


def test_dynamic_img_size_changes_nothing_at_the_native_size():
    r = _recipe()
    torch.manual_seed(0)
    plain = build_vit(r.model, 28, 1, 0)
    torch.manual_seed(0)
    dynamic = build_model(r, 0)
    assert dynamic.dynamic_img_size and not plain.dynamic_img_size
    assert plain.state_dict().keys() == dynamic.state_dict().keys()
    assert all(torch.equal(v, dynamic.state_dict()[k]) for k, v in plain.state_dict().items())
    plain.eval(), dynamic.eval()
    x = torch.randn(3, 1, 28, 28)
    with torch.no_grad():
        assert torch.equal(plain.forward_features(x), dynamic.forward_features(x))
        assert dynamic(torch.randn(3, 1, 12, 12)).shape == (3, 32)
    sup = from_dict({"model": TINY_MODEL})
    assert not build_model(sup, 10).dynamic_img_size, "only dino builds a dynamic ViT"


def test_every_part_loads_into_a_fresh_backbone():
    r, obj = _objective()
    with torch.no_grad():  # the teacher differs from the student
        for p in obj.backbone.parameters():
            p.add_(torch.randn_like(p))
    obj.after_step(1)
    state = obj.state_dict()
    x = torch.randn(2, 1, 28, 28)
    for name, prefix in obj.parts.items():
        fresh = build_model(r, 0)
        fresh.load_state_dict({k[len(prefix) :]: v for k, v in state.items() if k.startswith(prefix)}, strict=True)
        net = obj.backbone if name == "student" else obj.teacher_backbone
        fresh.eval(), net.eval()
        with torch.no_grad():
            assert torch.equal(fresh(x), net(x)), name


def test_a_gap_vit_with_hooked_interventions_has_a_teacher_of_its_own():
    """The teacher is a deep copy: a hook an intervention put on the student's block is the teacher's own copy on
    the teacher's block (head_mask), so the teacher computes what the student's architecture computes."""
    r = from_dict(
        {
            "model": {**TINY_MODEL, "head": "gap"},
            "train": {"objective": "dino"},
            "objectives": {"dino": DINO},
            "interventions": {"head_mask": {"block": 0, "heads": [1]}},
        }
    )
    obj = build_objective(r, build_model(r, 0), 10)
    t_attn, s_attn = obj.teacher_backbone.blocks[0].attn, obj.backbone.blocks[0].attn
    (hook,) = t_attn.proj._forward_pre_hooks.values()
    assert hook is t_attn.head_mask and hook is not s_attn.head_mask
    loss, _ = obj(torch.randn(3, 1, 28, 28), None, 0)
    assert torch.isfinite(loss)


# ---------------------------------------------------------------- through the trainer


def _dino_recipe(write_recipe, name, callbacks=()):
    return write_recipe(
        name,
        train={"objective": "dino", "steps": 6, "checkpoint_every": 3, "eval_every": 3},
        objectives={"dino": DINO},
        callbacks=list(callbacks),
    )


def test_a_few_steps_train_log_the_terms_and_the_knn_monitor_and_run_the_suite(write_recipe):
    suite = [
        {
            "name": "analysis_suite",
            "measures": ["cka", "norm_ratio", "attention_distance", "fewshot_probe", "knn"],
            "fewshot_probe": {"shots": 2},
        }
    ]
    out = run_training(load_recipe(_dino_recipe(write_recipe, "dino", callbacks=suite)), progress=False)
    run = Path(out["run_dir"])
    s = read_scalars(run)
    assert [st for st, _ in s["train/teacher_entropy"]] == list(range(1, 7))
    assert all(math.isfinite(v) for _, v in s["train/loss"] + s["train/dino_loss"])
    assert s["train/loss"] == s["train/dino_loss"]
    assert all(0 < v <= math.log(64) for _, v in s["train/teacher_entropy"])
    assert [st for st, _ in s["eval/knn_top1"]] == [3, 6] and 0.0 <= s["eval/knn_top1"][-1][1] <= 1.0
    assert s["train/teacher_momentum"][0][1] == pytest.approx(0.996, abs=1e-6)
    for t in ("center_norm", "teacher_temp", "teacher_student_kl"):
        assert f"train/{t}" in s
    result = json.loads((run / "result.json").read_text())
    assert result["objective"]["name"] == "dino" and "collapsed" in result["objective"]
    assert result["top1"] == pytest.approx(s["eval/knn_top1"][-1][1], abs=1e-6)  # TensorBoard keeps float32
    meta = json.loads((list_checkpoints(run / "checkpoints")[-1] / "meta.json").read_text())
    assert meta["objective"]["parts"] == {"student": "backbone.", "teacher": "teacher_backbone."}
    summary = json.loads((run / "analysis" / "step_0000006" / "summary.json").read_text())
    assert {"cka", "norm_ratio", "attention_distance", "fewshot_probe", "knn"} <= set(summary), sorted(summary)
    # the saved teacher loads into the recipe's backbone
    w = load_file(str(list_checkpoints(run / "checkpoints")[-1] / "model.safetensors"))
    fresh = build_model(load_recipe(run / "recipe.yaml"), 0)
    fresh.load_state_dict({k[len("teacher_backbone.") :]: v for k, v in w.items() if k.startswith("teacher_backbone.")})
    assert "center" in w and any(k.startswith("teacher_head.") for k in w)


def test_resume_is_exact_teacher_and_center_included(write_recipe):
    from test_train import Crash  # registers test_crash_at

    straight = run_training(load_recipe(_dino_recipe(write_recipe, "straight")), progress=False)
    p = _dino_recipe(write_recipe, "resumed", callbacks=[{"name": "test_crash_at", "step": 3}])
    with pytest.raises(Crash):
        run_training(load_recipe(p), progress=False)
    resumed = run_training(load_recipe(p), resume=True, progress=False)
    assert resumed["step"] == straight["step"] == 6
    a, b = read_scalars(Path(straight["run_dir"])), read_scalars(Path(resumed["run_dir"]))
    for tag in ("train/loss", "train/teacher_entropy", "train/center_norm", "eval/knn_top1"):
        assert a[tag] == b[tag], tag
    wa = load_file(str(list_checkpoints(Path(straight["run_dir"]) / "checkpoints")[-1] / "model.safetensors"))
    wb = load_file(str(list_checkpoints(Path(resumed["run_dir"]) / "checkpoints")[-1] / "model.safetensors"))
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    assert "center" in wa and wa["center"].abs().sum() > 0


@pytest.mark.multiprocess
def test_two_processes_share_the_center_and_the_knn_monitor_counts_every_image(write_recipe, tmp_path):
    """2 processes (gloo): the centre is all-reduced (the same on both, while each sees its own images: the
    per-process sums of the unfinished log window in the step-2 checkpoint), and the k-NN top-1 of the 2-process
    run equals a 1-process k-NN of the saved student."""
    from train.data import build_data
    from train.knn import knn_monitor
    from train.trainer import eval_loader, make_accelerator

    p = write_recipe(
        train={
            "objective": "dino",
            "mixed_precision": "no",
            "steps": 3,
            "checkpoint_every": 2,
            "eval_every": 3,
            "log_every": 10,
            "eval_batch_size": 64,
        },
        objectives={"dino": DINO},
    )
    cmd, env = two_process_launch(p, 29561)
    out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    ckpts = list_checkpoints(tmp_path / "runs" / "tiny" / "checkpoints")
    assert ckpts and ckpts[-1].name == "step_0000003", out.stderr[-3000:]
    window = json.loads((ckpts[0] / "meta.json").read_text())["log_window"]["terms"]
    assert window["center_norm"][0] == window["center_norm"][1] > 0
    assert window["teacher_entropy"][0] != window["teacher_entropy"][1], "each process sees its own images"
    meta = json.loads((ckpts[-1] / "meta.json").read_text())
    assert meta["num_processes"] == 2 and meta["eval"]["n"] == 250
    recipe = load_recipe(p)
    acc = make_accelerator(recipe)
    data = build_data(recipe)
    model = build_model(recipe, 0)
    w = load_file(str(ckpts[-1] / "model.safetensors"))
    model.load_state_dict({k[len("backbone.") :]: v for k, v in w.items() if k.startswith("backbone.")})
    bank, query = acc.prepare(eval_loader(data.probe_train, 64), eval_loader(data.eval, 64))
    one = knn_monitor(acc, model, bank, query, data.normalize, data.num_classes)
    assert one["n"] == 250 and one["top1"] == meta["eval"]["top1"]


# ---------------------------------------------------------------- bad options


@pytest.mark.parametrize(
    "override, words",
    [
        ("objectives.dino.local_crop_size=13", "must be a multiple of model.patch_size (4)"),
        ("objectives.dino.local_crop_size=32", "no larger than data.img_size (28)"),
        ("model.arch=resnet", "not model.arch 'resnet'"),
        ("objectives.dino.local_crops_scale=[0.5, 0.1]", "0 < lo <= hi <= 1"),
        ("objectives.dino.teacher_temp=0", "out of range"),
        ("objectives.dino.momentum_teacher=1.5", "out of range"),
        ("data.augment.mixup_alpha=0.8", "set both to 0"),
    ],
)
def test_bad_options_are_one_sentence(override, words):
    with pytest.raises(RecipeError) as e:
        load_recipe(ROOT / "recipes/dino.yaml", [override])
    msg = str(e.value)
    assert words in msg and msg.endswith(".") and "\n" not in msg


def test_local_attention_with_local_crops_is_refused():
    with pytest.raises(RecipeError, match="local_crops_number=0"):
        load_recipe(ROOT / "recipes/dino.yaml", ["interventions.local_attention={blocks: [0], heads: [0], radius: 1}"])
    load_recipe(
        ROOT / "recipes/dino.yaml",
        ["interventions.local_attention={blocks: [0], heads: [0], radius: 1}", "objectives.dino.local_crops_number=0"],
    )


def test_bad_option_from_the_cli_exits_2_before_anything_is_written(tmp_path, capsys):
    assert (
        main(
            [
                str(ROOT / "recipes/dino.yaml"),
                "--set",
                "objectives.dino.local_crop_size=10",
                f"run.root={tmp_path}",
                "--no-progress",
            ]
        )
        == 2
    )
    err = capsys.readouterr().err.strip()
    assert "objectives.dino.local_crop_size" in err and len(err.splitlines()) == 1
    assert not any(tmp_path.iterdir())


def test_the_loss_is_float32_under_bf16_autocast():
    torch.manual_seed(0)
    s, t, c = torch.randn(8, 64), torch.randn(4, 64), torch.randn(1, 64)
    want, _ = dino_loss(s, t, c, 0.04, 0.1)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got, q = dino_loss(s, t, c, 0.04, 0.1)
    assert got.dtype == q.dtype == torch.float32 and got.item() == pytest.approx(want.item(), rel=1e-6)
