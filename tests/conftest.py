import os
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
# The tests mirror the packages (train/, interventions/, analysis/ with a folder per room of analysis/, studies/ for
# analysis/studies, e2e/ for the end-to-end runs); this folder (conftest's fixtures, fake_objective) and every
# subfolder are importable, so a test may reuse another's helpers (e.g. test_train's crash callback) by module name.
HERE = Path(__file__).resolve().parent
_DIRS = sorted(
    p for p in HERE.rglob("*") if p.is_dir() and not any(x.startswith((".", "_")) for x in p.relative_to(HERE).parts)
)
for _d in [HERE, *_DIRS]:
    if str(_d) not in sys.path:
        sys.path.insert(1, str(_d))
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

TINY = {
    "data": {"train_size": 512, "eval_size": 250, "probe_train_size": 100, "analysis_size": 64},
    "model": {"depth": 2, "embed_dim": 32, "num_heads": 2, "mlp_ratio": 2.0},
    "train": {
        "steps": 8,
        "batch_size": 32,
        "warmup_steps": 2,
        "eval_every": 4,
        "checkpoint_every": 4,
        "log_every": 1,
        "eval_batch_size": 64,
    },
}


def _merge(a, b):
    out = dict(a)
    for k, v in b.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


@pytest.fixture
def one_thread():
    """Tiny tensors: one intra-op thread is much faster than two contending ones on a busy 2-core machine
    (restored afterwards). Use with ``pytestmark = pytest.mark.usefixtures("one_thread")``."""
    import torch

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture
def write_recipe(tmp_path):
    """write_recipe(name, **sections) -> path of a tiny recipe YAML with run.root under tmp_path."""

    def make(name="tiny", base=TINY, **sections):
        data = _merge(base, sections)
        data = _merge(data, {"run": {"root": str(tmp_path / "runs")}})
        p = tmp_path / f"{name}.yaml"
        p.write_text(yaml.safe_dump(data))
        return p

    return make


@pytest.fixture(autouse=True)
def reset_accelerate():
    yield
    try:
        from accelerate.state import AcceleratorState, GradientState

        AcceleratorState._reset_state(reset_partial_state=True)
        GradientState._reset_state()
    except Exception:
        pass


def read_scalars(run_dir: Path) -> dict:
    """{tag: [(step, value), ...]} from a run's TensorBoard events (nothing sampled away)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    ea = EventAccumulator(str(run_dir), size_guidance={"scalars": 0, "images": 0, "tensors": 0})
    ea.Reload()
    return {tag: [(e.step, e.value) for e in ea.Scalars(tag)] for tag in ea.Tags()["scalars"]}


def shipped_recipes(include_paper: bool = True) -> list[Path]:
    """Every recipe YAML under recipes/ (study files, which list runs, are not recipes); recipes/paper/ needs
    ImageNet / CIFAR from the hub, so smoke runs here leave it out."""
    out = []
    for p in sorted((ROOT / "recipes").rglob("*.yaml")):
        if "study" in (yaml.safe_load(p.read_text()) or {}):
            continue
        if not include_paper and "paper" in p.relative_to(ROOT / "recipes").parts:
            continue
        out.append(p)
    return out


def two_process_launch(recipe_path, port: int, script: str | None = None) -> tuple[list[str], dict]:
    """(command, environment) that trains ``recipe_path`` on 2 CPU processes (gloo) through accelerate launch, as
    ``VITLAB_NPROC=2 ./launch.sh`` does (``-m train --recipe``; or ``script RECIPE``, a driver of the test's own);
    ``port`` keeps concurrent tests apart."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env["ACCELERATE_USE_CPU"] = "true"
    launch = [str(Path(sys.executable).parent / "accelerate"), "launch", "--multi_gpu", "--num_processes", "2"]
    launch += ["--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no"]
    target = ["-m", "train", "--recipe"] if script is None else [str(script)]
    return [*launch, "--main_process_port", str(port), *target, str(recipe_path), "--no-progress"], env


# ---------------------------------------------------------------- tiny models and labelled images for measure tests


def tiny_vit(class_token: bool = True, num_heads: int = 2, depth: int = 2, embed_dim: int = 32):
    """A ``depth``-block (2), ``embed_dim``-wide (32) timm ViT on 28x28x1 (7x7 tokens) with ``num_heads`` heads, seeded,
    in eval mode: the one tiny model of the measure tests."""
    import torch
    from timm.models.vision_transformer import VisionTransformer

    torch.manual_seed(0)
    kw = {} if class_token else {"class_token": False, "global_pool": "avg"}
    return VisionTransformer(
        img_size=28,
        patch_size=4,
        in_chans=1,
        num_classes=10,
        embed_dim=embed_dim,
        depth=depth,
        num_heads=num_heads,
        mlp_ratio=2.0,
        **kw,
    ).eval()


def tiny_resnet():
    """A 4-BasicBlock timm ResNet (8-16 channels) on 28x28x1, seeded, in eval mode."""
    import torch
    from timm.models.resnet import BasicBlock, ResNet

    torch.manual_seed(0)
    return ResNet(block=BasicBlock, layers=(1, 1, 1, 1), channels=(8, 8, 16, 16), in_chans=1, num_classes=10).eval()


def class_split(n: int, seed: int):
    """n labelled 28x28x1 uint8 images (labels i mod 10) whose class is a bright square at a class-dependent place
    on seeded noise, as a split namespace (.images, .labels): features of any model carry the label."""
    import types

    import torch

    g = torch.Generator().manual_seed(seed)
    y = torch.arange(n) % 10
    images = (torch.rand(n, 1, 28, 28, generator=g) * 20).to(torch.uint8)
    for c in range(10):
        images[y == c, :, 2 * c : 2 * c + 10, 2 * c : 2 * c + 10] = 250
    return types.SimpleNamespace(images=images, labels=y)


class TwoProcessReplay:
    """An Accelerator stand-in for two processes played one after the other (rank 1 first): rank 1 records what it
    reduces, rank 0 adds it, so a measure's finish() on rank 0 sees the two-process sums."""

    num_processes = 2
    device = "cpu"

    def __init__(self, rank, log):
        self.process_index, self.log = rank, log

    def reduce(self, t, reduction="sum"):
        assert reduction == "sum"
        if self.process_index == 1:
            self.log.append(t.clone())
            return t
        return t + self.log.pop(0)
