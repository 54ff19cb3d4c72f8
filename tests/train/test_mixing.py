"""Mixup / CutMix (data.augment.mixup_alpha, cutmix_alpha, ...): recipe keys, soft targets and their loss, exact
resume with mixing on, the default recipe's hash."""

from pathlib import Path
from typing import ClassVar

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from conftest import ROOT, read_scalars
from safetensors.torch import load_file
from timm.loss import SoftTargetCrossEntropy

import train.augment
from train.augment import augment, make_mixer, mix_uint8
from train.callbacks import Callback, register_callback
from train.checkpoint import list_checkpoints
from train.cli import main
from train.recipe import AugmentConfig, RecipeError, load_recipe
from train.trainer import reseed_step
from train.trainer import train as run_training

pytestmark = pytest.mark.usefixtures("one_thread")

DEFAULT = ROOT / "recipes/default.yaml"


@pytest.mark.parametrize(
    "override, words",
    [
        ("data.augment.cutmix_alpha=-1", "'data.augment.cutmix_alpha' is -1.0, out of range: it must be >= 0.0"),
        ("data.augment.mixup_alpha=lots", "'data.augment.mixup_alpha' must be a number, got 'lots'"),
        ("data.augment.mix_prob=1.5", "'data.augment.mix_prob' is 1.5, out of range"),
        ("data.augment.switch_prob=-0.1", "'data.augment.switch_prob' is -0.1, out of range"),
        ("data.augment.mix_mode=image", "'data.augment.mix_mode' must be one of 'batch', 'pair', 'elem'"),
        (
            "data.augment.randaugment_magnitude=31",
            "'data.augment.randaugment_magnitude' is 31, out of range: it must be >= 0 and <= 30",
        ),
        ("data.augment.randaugment_ops=-1", "'data.augment.randaugment_ops' is -1, out of range"),
    ],
)
def test_bad_mixing_keys_are_one_sentence(override, words):
    with pytest.raises(RecipeError, match=words.replace("(", r"\(").replace(".", r"\.")) as e:
        load_recipe(DEFAULT, [override])
    assert str(e.value).count(". ") == 0 and str(e.value).endswith(".")


def test_bad_alpha_from_the_cli_exits_2_before_anything_is_written(tmp_path, capsys):
    assert main([str(DEFAULT), "--set", "data.augment.mixup_alpha=-0.5", f"run.root={tmp_path}", "--no-progress"]) == 2
    err = capsys.readouterr().err.strip()
    assert "data.augment.mixup_alpha" in err and "out of range" in err and len(err.splitlines()) == 1
    assert not any(tmp_path.iterdir())


def test_mixing_needs_an_even_batch():
    with pytest.raises(RecipeError, match=r"'train.batch_size' \(127\) must be even"):
        load_recipe(DEFAULT, ["data.augment.cutmix_alpha=1.0", "train.batch_size=127"])
    load_recipe(DEFAULT, ["train.batch_size=127"])  # no mixing: any batch size


def test_default_hash_unchanged_and_new_keys_hashed_only_when_used():
    r = load_recipe(DEFAULT)
    assert r.hash() == "82a396f18b71fd7d"
    spelled = [
        "data.augment.mixup_alpha=0.0",
        "data.augment.cutmix_alpha=0.0",
        "data.augment.mix_prob=1.0",
        "data.augment.switch_prob=0.5",
        "data.augment.mix_mode=batch",
        "data.augment.randaugment_ops=0",
        "data.augment.randaugment_magnitude=9",
    ]
    assert load_recipe(DEFAULT, spelled).hash() == r.hash()
    for o in (
        "data.augment.mixup_alpha=0.8",
        "data.augment.cutmix_alpha=1.0",
        "data.augment.mix_prob=0.5",
        "data.augment.switch_prob=0.3",
        "data.augment.mix_mode=elem",
        "data.augment.randaugment_ops=2",
        "data.augment.randaugment_magnitude=5",
    ):
        assert load_recipe(DEFAULT, [o]).hash() != r.hash(), o
    cutmix = load_recipe(ROOT / "recipes/vit_cutmix.yaml")
    assert cutmix.data.augment.cutmix_alpha > 0 and cutmix.data.augment.mixup_alpha > 0 and cutmix.hash() != r.hash()


def test_no_mixer_without_an_alpha():
    assert make_mixer(AugmentConfig(), 10) is None


def _onehot_smoothed(y, k, eps):
    return torch.full((len(y), k), eps / k).scatter_(1, y[:, None], 1 - eps + eps / k)


def test_mixup_batch_soft_targets_and_loss_by_hand():
    """mode batch, mixup only: x = lam x + (1 - lam) x.flip(0), targets likewise over smoothed one-hots, rows sum
    to 1; SoftTargetCrossEntropy = mean over the batch of -sum_k t_k log softmax(z)_k."""
    k, eps = 3, 0.1
    x = torch.tensor([[[[0.0, 1.0]]], [[[2.0, 4.0]]]])  # 2 images, 1 x 1 x 2
    y = torch.tensor([0, 2])
    mixer = make_mixer(AugmentConfig(mixup_alpha=1.0), k, eps)
    np.random.seed(5)
    np.random.rand()  # mix_prob draw, as timm's _params_per_batch makes it
    lam = float(np.random.beta(1.0, 1.0))
    np.random.seed(5)
    mixed, t = mixer(x.clone(), y)
    assert 0 < lam < 1
    assert torch.allclose(mixed, lam * x + (1 - lam) * x.flip(0))
    want_t = lam * _onehot_smoothed(y, k, eps) + (1 - lam) * _onehot_smoothed(y.flip(0), k, eps)
    assert torch.allclose(t, want_t) and torch.allclose(t.sum(1), torch.ones(2))
    logits = torch.tensor([[2.0, 0.0, -1.0], [0.5, 0.5, 3.0]])
    by_hand = 0.0
    for i in range(2):
        logz = torch.logsumexp(logits[i], 0)
        by_hand += -sum(float(t[i, c]) * float(logits[i, c] - logz) for c in range(k)) / 2
    assert float(SoftTargetCrossEntropy()(logits, t)) == pytest.approx(by_hand, rel=1e-6)
    # no mixing drawn (mix_prob 0): the soft-target loss is the hard-label loss with the same smoothing
    plain = make_mixer(AugmentConfig(cutmix_alpha=1.0, mix_prob=0.0), k, eps)
    same, t0 = plain(x.clone(), y)
    assert torch.equal(same, x)
    assert float(SoftTargetCrossEntropy()(logits, t0)) == pytest.approx(
        float(F.cross_entropy(logits, y, label_smoothing=eps)), rel=1e-6
    )


def test_cutmix_elem_pastes_a_box_and_weighs_targets_by_area():
    """mode elem, CutMix only: image i gets a box of image B-1-i; its target weight on its own label is the share
    of its pixels it kept. Every row of the targets sums to 1."""
    b, k = 8, 10
    x = torch.arange(b, dtype=torch.float32).view(b, 1, 1, 1).expand(b, 1, 16, 16).clone()
    y = torch.arange(b)
    mixer = make_mixer(AugmentConfig(cutmix_alpha=1.0, mix_mode="elem"), k, 0.0)
    np.random.seed(0)
    mixed, t = mixer(x.clone(), y)
    assert torch.allclose(t.sum(1), torch.ones(b))
    for i in range(b):
        own = float((mixed[i] == i).float().mean())
        other = float((mixed[i] == b - 1 - i).float().mean())
        assert own + other == pytest.approx(1.0)
        assert float(t[i, i]) == pytest.approx(own, abs=1e-6) and float(t[i, b - 1 - i]) == pytest.approx(
            other, abs=1e-6
        )
    assert any(0 < float(t[i, i]) < 1 for i in range(b))  # some box was pasted


def test_mixer_draws_are_a_function_of_the_step_seed():
    mixer = make_mixer(AugmentConfig(mixup_alpha=0.8, cutmix_alpha=1.0, mix_mode="elem"), 10, 0.1)
    x, y = torch.rand(16, 1, 8, 8), torch.arange(16) % 10
    outs = []
    for _ in range(2):
        reseed_step(123, 10**9, 3)  # step seed past 2**32: numpy takes it as 32-bit words
        np.random.rand(7)  # whatever ran before (a callback) does not matter
        reseed_step(123, 10**9, 3)
        outs.append(mixer(x.clone(), y))
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])
    reseed_step(123, 10**9 + 1, 3)
    assert not torch.equal(mixer(x.clone(), y)[1], outs[0][1])


def test_mix_uint8_for_the_sample_grid():
    x = torch.stack([torch.zeros(1, 8, 8), torch.full((1, 8, 8), 200.0), torch.full((1, 8, 8), 100.0)]).to(torch.uint8)
    np.random.seed(1)
    out = mix_uint8(x, make_mixer(AugmentConfig(cutmix_alpha=1.0, mix_mode="elem"), 10))
    assert out.dtype == torch.uint8 and out.shape == x.shape and torch.equal(out[2], x[2])
    assert set(out[:2].unique().tolist()) == {0, 200} and not torch.equal(out[:2], x[:2])


@register_callback("test_numpy_draw")
class NumpyDraw(Callback):
    """A user's callback that draws from numpy's global RNG at checkpoints (not at train start)."""

    def on_checkpoint(self, ctx):
        np.random.rand(3)


def test_randaugment_differs_image_by_image_and_follows_torch_seed():
    """Called on a whole batch, torchvision's RandAugment applies one op to every image; rand_augment draws each
    image's own ops: 64 copies of one image come out different. The same torch seed gives the same batch."""
    img = torch.randint(0, 256, (1, 1, 28, 28), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    x = img.expand(64, 1, 28, 28).clone()
    torch.manual_seed(7)
    a = augment(x, 0, False, ra_ops=2, ra_magnitude=9)
    torch.manual_seed(7)
    b = augment(x, 0, False, ra_ops=2, ra_magnitude=9)
    assert a.dtype == torch.uint8 and a.shape == x.shape and torch.equal(a, b)
    distinct = {bytes(im.flatten().tolist()) for im in a}
    assert len(distinct) >= 10, len(distinct)
    assert torch.equal(augment(x, 0, False, ra_ops=0), x)


class CountingMixer:
    """Wraps a mixer to count the batches it mixed, by batch size (training batches vs sample_images' grid)."""

    calls: ClassVar[dict] = {}

    def __init__(self, inner):
        self.inner = inner

    def __call__(self, x, y):
        CountingMixer.calls[len(x)] = CountingMixer.calls.get(len(x), 0) + 1
        return self.inner(x, y)


def _final_weights(run: Path) -> dict:
    return load_file(str(list_checkpoints(run / "checkpoints")[-1] / "model.safetensors"))


def test_resume_is_exact_with_cutmix_and_mixup(write_recipe, monkeypatch):
    """8 steps straight == 4 steps, crash, resume 4 more, with CutMix + mixup per image and RandAugment (and the
    mixed sample grid): same loss curve, same final weights. timm's Mixup draws from numpy's global RNG; a checkpoint
    keeps that RNG's
    state, but a callback that draws from it after the save (test_numpy_draw) shifts every later draw of the
    straight run and not of the resumed one, unless numpy is reseeded from (seed, step, rank) like torch."""
    real = train.augment.make_mixer
    monkeypatch.setattr(train.augment, "make_mixer", lambda *a, **kw: CountingMixer(real(*a, **kw)))
    aug = {
        "augment": {
            "shift": 2,
            "hflip": True,
            "mixup_alpha": 0.8,
            "cutmix_alpha": 1.0,
            "mix_mode": "elem",
            "randaugment_ops": 2,
        }
    }
    CountingMixer.calls = {}
    samples = [{"name": "sample_images", "n": 8}, {"name": "test_numpy_draw"}]
    straight = run_training(load_recipe(write_recipe("straight", data=aug, callbacks=samples)), progress=False)
    assert CountingMixer.calls == {32: 8, 8: 3}  # every training batch mixed; the grid at start, steps 4 and 8
    from test_train import Crash  # registers test_crash_at

    p = write_recipe("resumed", data=aug, callbacks=[*samples, {"name": "test_crash_at", "step": 4}])
    with pytest.raises(Crash):
        run_training(load_recipe(p), progress=False)
    resumed = run_training(load_recipe(p), resume=True, progress=False)
    assert resumed["step"] == straight["step"] == 8
    a, b = read_scalars(Path(straight["run_dir"])), read_scalars(Path(resumed["run_dir"]))
    assert [s for s, _ in b["train/loss"]] == list(range(1, 9))
    assert a["train/loss"] == b["train/loss"] and a["eval/top1"] == b["eval/top1"]
    wa, wb = _final_weights(Path(straight["run_dir"])), _final_weights(Path(resumed["run_dir"]))
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
