"""The ablation measure against independent references: plain forwards of the whole model with the intervention made
another way (a training-time head mask, a block built without its skip, zeroed value weights, explicit hooks that
substitute means or another image's activation), read out by plain code (argmax, cross-entropy, train.knn, the
MinibatchCKA of analysis.estimators.similarity)."""

import copy

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from conftest import class_split, tiny_vit

from analysis.engine.measure import load_result, save_result
from analysis.engine.reduce import Minibatches
from analysis.estimators.similarity import MinibatchCKA
from analysis.frontends.api import analyze
from analysis.measures.ablation import Ablation, resample_permutation
from interventions import head_mask
from interventions.no_skip import block_classes
from train.knn import knn_accuracy

pytestmark = pytest.mark.usefixtures("one_thread")

BS = 16


def lively(model, std=0.3):
    """Re-draw the weights of every Linear (and ResNet conv / BN affine) layer with a larger scale, seeded, so that
    heads, branches and skips matter to the read-outs of a tiny random model."""
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, torch.nn.Linear):
                m.weight.copy_(torch.randn(m.weight.shape, generator=g) * std)
                if m.bias is not None:
                    m.bias.copy_(torch.randn(m.bias.shape, generator=g) * 0.1)
            elif isinstance(m, torch.nn.Conv2d):
                m.weight.copy_(torch.randn(m.weight.shape, generator=g) * (2.0 / m.weight[0].numel()) ** 0.5)
            elif isinstance(m, torch.nn.BatchNorm2d):
                m.weight.copy_(1 + 0.3 * torch.randn(m.weight.shape, generator=g))
                m.bias.copy_(0.1 * torch.randn(m.bias.shape, generator=g))
                m.running_mean.copy_(0.1 * torch.randn(m.running_mean.shape, generator=g))
    return model


def data():
    return class_split(48, 0), class_split(60, 1)


def measure(model, targets, replace="zero", **opts):
    a, p = data()
    res = analyze(
        model,
        a.images,
        a.labels,
        probe_images=p.images,
        probe_labels=p.labels,
        measures=["ablation"],
        options={"ablation": {"targets": targets, "replace": replace, **opts}},
        batch_size=BS,
        figures=False,
    )
    r = res["results"]["ablation"]
    return {name: n for n, name in enumerate(r["targets"])}, r


def _x(images):
    return images.float() / 255.0


@torch.no_grad()
def reference(model, blocks, intervene=None, changed=None):
    """Read-outs of the intervened model -- ``changed`` (a modified copy of ``model``), or ``model`` with
    ``intervene(model, j, x) -> [hook handles]`` active on minibatch j -- by full forwards of the whole model, one
    minibatch at a time: top1, mean loss, k-NN top-1 against ``model``'s probe-train bank, and per block the
    minibatch CKA of the intervened output with ``model``'s."""
    a, p = data()

    def run(net, x, handles=()):
        got, outs = {}, {}
        hs = [net.get_classifier().register_forward_pre_hook(lambda m, args: got.__setitem__("f", args[0]))]
        hs += [
            net.get_submodule(b).register_forward_hook(lambda m, args, out, i=i: outs.__setitem__(i, out.clone()))
            for i, b in enumerate(blocks)
        ]
        try:
            logits = net(x)
        finally:
            for h in list(handles) + hs:
                h.remove()
        return logits, got["f"], outs

    bank = torch.cat([run(model, _x(p.images[j : j + BS]))[1] for j in range(0, len(p.images), BS)])
    correct, loss, feats, ys, ckas = 0, 0.0, [], [], [MinibatchCKA() for _ in blocks]
    mb = Minibatches(len(a.images), BS)  # the suite's minibatches: runs of a seeded permutation
    for j in range(len(mb)):
        x, y = _x(mb.take(a.images, j)), mb.take(a.labels, j)
        ys.append(y)
        _, _, plain = run(model, x)
        net = changed if changed is not None else model
        logits, f, outs = run(net, x, intervene(net, j, x) if intervene else ())
        correct += int((logits.argmax(1) == y).sum())
        loss += float(F.cross_entropy(logits, y, reduction="sum"))
        feats.append(f)
        for i, c in enumerate(ckas):
            c.update([outs[i].reshape(BS, -1)], [plain[i].reshape(BS, -1)])
    n = len(a.images)
    knn = knn_accuracy(bank, p.labels, torch.cat(feats), torch.cat(ys), 20, 0.07, 10)
    return {
        "top1": correct / n,
        "loss": loss / n,
        "knn_top1": knn,
        "cka": np.array([float(c.compute()[0, 0]) for c in ckas]),
    }


def check(r, n, ref, block, tol=1e-5):
    assert r["top1"][n] == pytest.approx(ref["top1"], abs=1e-12)
    assert r["loss"][n] == pytest.approx(ref["loss"], abs=tol)
    assert r["knn_top1"][n] == pytest.approx(ref["knn_top1"], abs=1e-12)
    np.testing.assert_allclose(r["cka"][n, block:], ref["cka"][block:], atol=tol)
    assert np.isnan(r["cka"][n, :block]).all()


def vit():
    return lively(tiny_vit())


BLOCKS = ["blocks.0", "blocks.1"]


def test_a_head_masked_in_training_changes_nothing_and_another_head_does():
    model = vit()
    head_mask.apply_model([head_mask.Config(block=1, heads=[0])], model)
    for replace in ("zero", "mean", "resample"):
        idx, r = measure(model, ["blocks.1.head0", "blocks.1.head1"], replace)
        masked, kept = idx["blocks.1.head0"], idx["blocks.1.head1"]
        assert r["top1"][masked] == r["clean_top1"] and r["knn_top1"][masked] == r["clean_knn_top1"]
        assert abs(r["loss_increase"][masked]) < 1e-6 and abs(r["cka"][masked, 1] - 1) < 1e-6
        assert abs(r["loss_increase"][kept]) > 1e-3 and r["cka"][kept, 1] < 1 - 1e-4, replace


def test_zero_ablating_a_head_equals_the_training_time_head_mask():
    model = vit()
    idx, r = measure(model, ["blocks.0.head1"])
    masked = copy.deepcopy(model)
    head_mask.apply_model([head_mask.Config(block=0, heads=[1])], masked)
    check(r, idx["blocks.0.head1"], reference(model, BLOCKS, changed=masked), 0)


def test_zero_ablating_every_head_equals_zero_values_and_without_proj_bias_the_removed_branch():
    model = vit()
    idx, r = measure(model, ["blocks.1.head0+1", "blocks.1.attn"])
    novalue = copy.deepcopy(model)
    c = novalue.blocks[1].attn.qkv
    with torch.no_grad():  # V = 0: every head's output A_h V_h is exactly 0
        c.weight[64:].zero_()
        c.bias[64:].zero_()
    check(r, idx["blocks.1.head0+1"], reference(model, BLOCKS, changed=novalue), 1)
    # with a zero output-projection bias, all heads zeroed IS the attention branch removed
    with torch.no_grad():
        model.blocks[1].attn.proj.bias.zero_()
    idx, r = measure(model, ["blocks.1.head0+1", "blocks.1.attn"])
    a, b = idx["blocks.1.head0+1"], idx["blocks.1.attn"]
    for key in ("top1", "loss", "knn_top1"):
        assert r[key][a] == pytest.approx(r[key][b], abs=1e-6)
    np.testing.assert_allclose(r["cka"][a], r["cka"][b], atol=1e-6)


@pytest.mark.parametrize("where", ["attn", "mlp", "both"])
def test_removing_a_skip_path_equals_the_block_built_without_it(where):
    model = vit()
    name = {"attn": "blocks.0.skip_attn", "mlp": "blocks.0.skip_mlp", "both": "blocks.0.skip"}[where]
    idx, r = measure(model, [name], "mean")  # skip: remove, whatever replace says
    cut = copy.deepcopy(model)
    _, NoSkip = block_classes()
    blk = cut.blocks[0]
    blk.__class__ = NoSkip
    blk.skip_attn, blk.skip_mlp = where == "mlp", where == "attn"
    check(r, idx[name], reference(model, BLOCKS, changed=cut), 0)
    assert r["top1_drop"][idx[name]] != 0 or abs(r["loss_increase"][idx[name]]) > 1e-3


def _replacing(module_of, value_of, output=True):
    """An ``intervene`` that replaces a module's output (or first input) on minibatch j by ``value_of(j, tensor)``."""

    def intervene(model, j, x):
        mod = module_of(model)
        if output:
            return [mod.register_forward_hook(lambda m, args, out: value_of(j, out))]
        return [mod.register_forward_pre_hook(lambda m, args: (value_of(j, args[0]), *tuple(args[1:])))]

    return intervene


@torch.no_grad()
def _clean_activation(model, module_of, output=True):
    """The module's output (or input) on every analysis image, one plain forward of all of them."""
    a, _ = data()
    got = {}
    mod = module_of(model)
    h = (
        mod.register_forward_hook(lambda m, args, out: got.__setitem__("a", out.clone()))
        if output
        else mod.register_forward_pre_hook(lambda m, args: got.__setitem__("a", args[0].clone()))
    )
    model(_x(a.images))
    h.remove()
    return got["a"]


def test_mean_ablation_of_a_branch_and_of_the_cls_path():
    model = vit()
    idx, r = measure(model, ["blocks.0.attn", "blocks.1.mlp", "blocks.1.cls"], "mean")
    mean0 = _clean_activation(model, lambda m: m.blocks[0].drop_path1).mean(0)
    ref = reference(
        model, BLOCKS, _replacing(lambda m: m.blocks[0].drop_path1, lambda j, out: mean0.expand_as(out).clone())
    )
    check(r, idx["blocks.0.attn"], ref, 0)
    mean1 = _clean_activation(model, lambda m: m.blocks[1].drop_path2).mean(0)
    ref = reference(
        model, BLOCKS, _replacing(lambda m: m.blocks[1].drop_path2, lambda j, out: mean1.expand_as(out).clone())
    )
    check(r, idx["blocks.1.mlp"], ref, 1)
    cls_mean = _clean_activation(model, lambda m: m.blocks[1], output=False)[:, 0].mean(0)

    def cls(j, z):
        z = z.clone()
        z[:, 0] = cls_mean
        return z

    check(r, idx["blocks.1.cls"], reference(model, BLOCKS, _replacing(lambda m: m.blocks[1], cls, output=False)), 1)


def test_resample_takes_another_images_activation_with_a_seeded_cyclic_permutation():
    for n, j in ((4, 0), (16, 3), (17, 5)):
        p = resample_permutation(n, 7, j)
        assert sorted(p.tolist()) == list(range(n)) and (p != torch.arange(n)).all()
        m, seen = 0, set()  # a single cycle through every image
        while m not in seen:
            seen.add(m)
            m = int(p[m])
        assert len(seen) == n
        assert torch.equal(p, resample_permutation(n, 7, j)) and not torch.equal(p, resample_permutation(n, 8, j))
    model = vit()
    idx, r = measure(model, ["blocks.0.mlp", "blocks.0.spatial"], "resample", seed=3)
    _a, _ = data()
    branch = _clean_activation(model, lambda m: m.blocks[0].drop_path2)
    z0 = _clean_activation(model, lambda m: m.blocks[0], output=False)

    def other(full):
        mb = Minibatches(len(full), BS)  # the suite's minibatch j: runs of a seeded permutation of the images
        return lambda j, out: mb.take(full, j)[resample_permutation(BS, 3, j)].clone()

    check(
        r, idx["blocks.0.mlp"], reference(model, BLOCKS, _replacing(lambda m: m.blocks[0].drop_path2, other(branch))), 0
    )

    def spatial(j, z):
        z = z.clone()
        z[:, 1:] = other(z0)(j, z)[:, 1:]
        return z

    check(
        r,
        idx["blocks.0.spatial"],
        reference(model, BLOCKS, _replacing(lambda m: m.blocks[0], spatial, output=False)),
        0,
    )


def test_heads_starting_at_the_projection_equal_whole_block_copies_and_batching_changes_nothing(monkeypatch):
    model = vit()
    targets = ["heads", "branches", "skip", "tokens"]
    _, fast = measure(model, targets, "resample")
    _, one = measure(model, targets, "resample", forward_images=1)  # one ablation per forward
    monkeypatch.setattr(Ablation, "_heads_mode", lambda self, i: False)
    _, slow = measure(model, targets, "resample")
    assert list(fast["targets"]) == list(slow["targets"]) and len(fast["targets"]) == 2 * (2 + 2 + 3 + 2)
    for other in (slow, one):
        for key in ("top1", "knn_top1"):
            np.testing.assert_array_equal(fast[key], other[key])
        np.testing.assert_allclose(fast["loss"], other["loss"], atol=1e-6)
        np.testing.assert_allclose(fast["cka"], other["cka"], atol=1e-6)


def test_the_model_is_left_exactly_as_it_was():
    model = vit()
    head_mask.apply_model([head_mask.Config(block=0, heads=[1])], model)
    model.blocks[1].attn.fused_attn = False
    model.train()
    x = _x(data()[0].images)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    hooks = [(n, len(m._forward_hooks), len(m._forward_pre_hooks)) for n, m in model.named_modules()]
    with torch.no_grad():
        before = model.eval()(x)
    model.train()
    for replace in ("zero", "mean", "resample"):
        measure(model, ["heads", "branches", "skip", "tokens"], replace)
    assert model.training and [b.attn.fused_attn for b in model.blocks] == [True, False]
    assert [(n, len(m._forward_hooks), len(m._forward_pre_hooks)) for n, m in model.named_modules()] == hooks
    assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())
    with torch.no_grad():
        assert torch.equal(model.eval()(x), before)


def resnet():
    from timm.models.resnet import BasicBlock, ResNet

    torch.manual_seed(0)  # layer1.1 has an identity shortcut, the other blocks a projection
    return lively(
        ResNet(block=BasicBlock, layers=(2, 1, 1, 1), channels=(8, 16, 16, 16), in_chans=1, num_classes=10).eval()
    )


RBLOCKS = ["layer1.0", "layer1.1", "layer2.0", "layer3.0", "layer4.0"]


def test_resnet_branches_and_shortcuts():
    model = resnet()
    names = ["layer1.1.branch", "layer1.1.shortcut", "layer2.0.shortcut"]
    idx, r = measure(model, names)
    no_branch = copy.deepcopy(model)
    with torch.no_grad():  # the branch's last BN outputs exactly 0
        no_branch.layer1[1].bn2.weight.zero_()
        no_branch.layer1[1].bn2.bias.zero_()
    check(r, idx["layer1.1.branch"], reference(model, RBLOCKS, changed=no_branch), 1)
    no_identity = copy.deepcopy(model)
    blk = no_identity.layer1[1]
    blk.forward = lambda x: blk.act2(blk.bn2(blk.conv2(blk.act1(blk.bn1(blk.conv1(x))))))  # act(branch), no shortcut
    check(r, idx["layer1.1.shortcut"], reference(model, RBLOCKS, changed=no_identity), 1)
    no_projection = copy.deepcopy(model)
    with torch.no_grad():
        no_projection.layer2[0].downsample[1].weight.zero_()
        no_projection.layer2[0].downsample[1].bias.zero_()
    check(r, idx["layer2.0.shortcut"], reference(model, RBLOCKS, changed=no_projection), 2)
    _, fam = measure(model, ["branches", "skip"])
    assert list(fam["targets"]) == [f"{b}.{k}" for b in RBLOCKS for k in ("branch", "shortcut")]


def test_results_read_back_give_the_same_key_numbers_and_figures(tmp_path):
    import matplotlib.pyplot as plt

    model = vit()
    _, r = measure(model, ["heads", "branches", "skip", "tokens"], "mean")
    save_result(r, tmp_path / "ablation.npz")
    back = load_result(tmp_path / "ablation.npz")
    assert Ablation.summary(back) == Ablation.summary(r)
    assert Ablation.scalars(back) == Ablation.scalars(r)
    s = Ablation.summary(r)
    assert s["readout"] == "top1_drop" and len(s["heads_drop"]) == 2 and len(s["heads_drop"][0]) == 2
    assert set(s) >= {"attn_drop", "mlp_drop", "skip_drop", "cls_drop", "spatial_drop", "most_important_head"}
    figs = Ablation.figures(back, step=5)
    assert set(figs) == {"ablation/heads", "ablation/sublayers", "ablation/skip_cka"}
    assert (
        "Head importance" in figs["ablation/heads"].axes[0].get_title()
        and "(step 5)" in figs["ablation/heads"].axes[0].get_title()
    )
    assert "Raghu Fig. 8" in figs["ablation/skip_cka"].axes[0].get_title()
    for f in figs.values():
        plt.close(f)


def test_a_model_without_classifier_is_read_out_by_knn():
    model = vit()
    model.reset_classifier(0)
    _idx, r = measure(model, ["blocks.1.attn"])
    assert np.isnan(r["top1"]).all() and np.isnan(r["clean_top1"]) and np.isfinite(r["knn_top1"]).all()
    assert Ablation.summary(r)["readout"] == "knn_drop"
    ref = reference(model, BLOCKS, _replacing(lambda m: m.blocks[1].drop_path1, lambda j, out: torch.zeros_like(out)))
    assert r["knn_top1"][0] == pytest.approx(ref["knn_top1"], abs=1e-12)


def test_bad_targets_are_one_sentence():
    model = vit()
    with pytest.raises(ValueError, match="neither a family"):
        measure(model, ["blocks.0.nothing"])
    with pytest.raises(ValueError, match="no block 'blocks.7'"):
        measure(model, ["blocks.7.attn"])
    with pytest.raises(ValueError, match="heads 0..1"):
        measure(model, ["blocks.0.head5"])
    gap = lively(tiny_vit(class_token=False))
    with pytest.raises(ValueError, match="no cls"):
        measure(gap, ["blocks.0.cls"])
    from conftest import tiny_resnet

    with pytest.raises(ValueError, match="name nothing this resnet has"):
        measure(tiny_resnet(), ["heads", "tokens"])
