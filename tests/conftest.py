import os
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

TINY = {
    "data": {"train_size": 512, "eval_size": 250, "probe_train_size": 100, "analysis_size": 64},
    "model": {"depth": 2, "embed_dim": 32, "num_heads": 2, "mlp_ratio": 2.0},
    "train": {"steps": 8, "batch_size": 32, "warmup_steps": 2, "eval_every": 4, "checkpoint_every": 4,
              "log_every": 1, "eval_batch_size": 64},
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

    ea = EventAccumulator(str(Path(run_dir) / "tb"), size_guidance={"scalars": 0, "images": 0, "tensors": 0})
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
