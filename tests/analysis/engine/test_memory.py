"""What an analysis keeps grows with the number of images only where a measure must keep per-image features (probes,
k-NN, clustering, token norms), and there by the documented N x D in float16; everything else streams.

Each measure runs alone on 32 and on 96 analysis images of the tiny ViT (the probe-train images fixed); the bytes of
every tensor and array it holds after the pass over the images (before finish) are counted. A measure that streams
holds the same bytes at both sizes; one that keeps features holds exactly its per-image row more per image: the rows
are worked out here by hand from the model's shape (2 blocks x 32 channels, 7 x 7 tokens and a class token)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import class_split, tiny_vit

from analysis.engine import suite as S
from analysis.engine.measure import registry

F16, F32, I64 = 2, 4, 8
BLOCKS, D, T = 2, 32, 50  # the tiny ViT: 2 blocks x 32 channels, 49 patch tokens and a class token
LABEL = I64
# bytes kept per analysis image, by hand: (layers x pools) rows of D float16, and the label
PER_IMAGE = {
    "knn": BLOCKS * 2 * D * F16 + LABEL,  # CLS and mean-spatial pools of every block output
    "clustering": BLOCKS * 2 * D * F16 + LABEL,
    "fewshot_probe": BLOCKS * 3 * D * F16 + LABEL,
    "token_norms": BLOCKS * T * F32 + LABEL,  # the norms (the position probe's sample is bounded: probe_images)
    # every block's 49 patch tokens (stride 1 on the 7 x 7 grid) and its CLS token, and each block's grid (2 int64)
    "token_probes": BLOCKS * (T * D * F16 + 2 * I64) + LABEL,
    "similarity": BLOCKS * D * F16,  # the mean of the spatial tokens of every block output, no label
}


def _held(obj, seen: set | None = None) -> int:
    """Bytes of every tensor and array reachable from ``obj`` (its attributes, containers), the model and the
    context excluded."""
    seen = set() if seen is None else seen
    if id(obj) in seen:
        return 0
    seen.add(id(obj))
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, np.ndarray):
        return obj.nbytes
    if isinstance(obj, dict):
        return sum(_held(k, seen) + _held(v, seen) for k, v in obj.items())
    if isinstance(obj, (list, tuple, set)):
        return sum(_held(v, seen) for v in obj)
    if hasattr(obj, "__dict__") and not isinstance(obj, (type, torch.nn.Module)):
        return sum(_held(v, seen) for k, v in vars(obj).items() if k != "ctx")
    return 0


def _data(n: int):
    from analysis.frontends.api import Data
    from train.splits import TensorBatches

    a, p = class_split(n, 1), class_split(400, 2)
    return Data(TensorBatches(a.images, a.labels), TensorBatches(p.images, p.labels), 10)


OPTIONS = {"erf": {"images": 2}, "token_norms": {"probe_images": 32}, "ablation": {"targets": ["skip"]}}


def _held_after_pass(model, name: str, n: int) -> int | None:
    data = _data(n)
    opts = S.suite_options([name], 32, {name: OPTIONS[name]} if name in OPTIONS else None)
    ctx = S.make_context(model, data, 32)
    ms = S.make_measures(ctx, opts)
    if not ms:
        return None
    (m,) = ms
    with torch.no_grad():
        if m.taps():
            S._pass(ctx, data.analysis, sorted(m.taps()), m.update)
        if m.probe_taps():
            S._pass(ctx, data.probe_train, sorted(m.probe_taps()), m.update_probe)
    return _held(m)


@pytest.mark.parametrize("name", sorted(registry()))
def test_memory_grows_only_by_the_documented_rows(name):
    model = tiny_vit()
    small, big = _held_after_pass(model, name, 32), _held_after_pass(model, name, 96)
    if small is None:
        pytest.skip(f"{name} does not apply to a ViT")
    per_image = (big - small) / 64
    assert per_image == pytest.approx(PER_IMAGE.get(name, 0), abs=1e-9), (name, small, big)


# ---------------------------------------------------------------- a minibatch forwarded in chunks within a budget


def test_plan_chunks_and_memory_sizes():
    mib = 2**20
    per = {"a.attn_probs": 3 * mib, "a.out": 1 * mib}  # one image's bytes per tap
    assert S.plan_chunks(per, ["a.out"], 8, 64 * mib) is None  # 8 x 4 MiB x 2 fits 64 MiB
    # CKA keeps a.out for all 8 images (8 MiB x 2); each chunk costs 4 MiB x 2: (40 - 16) // 8 = 3 images
    assert S.plan_chunks(per, ["a.out"], 8, 40 * mib) == 3
    with pytest.raises(S.MeasureError, match="smaller analysis batch size"):
        S.plan_chunks(per, ["a.out"], 8, 16 * mib)
    assert S.parse_memory("4GiB") == 4 * 2**30 == S.parse_memory("4g") and S.parse_memory("1.5GB") == 1_500_000_000
    assert S.parse_memory("512 MiB") == 512 * mib and S.parse_memory(1000) == 1000
    for bad in ("lots", "4 parsecs", "-1G", "0"):
        with pytest.raises(S.MeasureError, match="is not a size"):
            S.parse_memory(bad)


def test_chunked_minibatches_give_the_same_results():
    """Every measure that takes part in the one pass, with minibatches of 32 forwarded 9 images at a time within a
    budget of 6 MB (minibatch CKA gets the whole minibatch's taps, assembled), equals the unchunked suite to float
    rounding (1e-6 relative)."""
    model, data = tiny_vit(), _data(64)
    names = [n for n in sorted(registry()) if n not in ("erf", "ablation", "head_subsets")]
    opts = S.suite_options(names, 32)
    whole = S.run_suite(model, data, opts)
    stages = []
    opts.max_memory = 6_000_000
    chunked = S.run_suite(model, data, opts, on_stage=stages.append)
    assert any("images per forward to stay within" in s for s in stages), stages
    for n in names:
        for k, v in whole[n].items():
            w = chunked[n][k]
            if isinstance(v, np.ndarray) and v.dtype.kind == "f":
                np.testing.assert_allclose(w, v, rtol=1e-6, atol=1e-9, err_msg=f"{n}.{k}")
            elif isinstance(v, np.ndarray):
                np.testing.assert_array_equal(w, v, err_msg=f"{n}.{k}")
            else:
                assert w == v, (n, k)
