"""train.decode._fit: array features resized in chunks give exactly what resizing the whole batch at once gave."""

import pytest
import torch
import torch.nn.functional as F

from train import decode
from train.sources import DataError


def _whole_batch(x: torch.Tensor, c: int, s: int) -> torch.Tensor:
    """The former one-shot conversion: channels first, then the whole batch resized in float."""
    if x.shape[1] != c:
        x = x.expand(-1, c, -1, -1).contiguous() if x.shape[1] == 1 else x[:, :3].float().mean(1, keepdim=True)
        x = x.round().to(torch.uint8)
    if x.shape[-1] != s:
        x = F.interpolate(x.float(), size=(s, s), mode="bilinear", antialias=True, align_corners=False)
        x = x.round().clamp(0, 255).to(torch.uint8)
    return x


@pytest.mark.parametrize(("have", "c", "s"), [(1, 1, 20), (1, 3, 20), (3, 1, 20), (4, 1, 9), (3, 3, 5), (1, 3, 12)])
def test_chunked_fit_equals_the_whole_batch_at_once(monkeypatch, have, c, s):
    monkeypatch.setattr(decode, "FIT_CHUNK", 7)  # 30 images: 5 chunks, the last one short
    x = torch.randint(0, 256, (30, have, 12, 12), dtype=torch.uint8, generator=torch.Generator().manual_seed(have))
    out = decode._fit(x, c, s)
    assert out.dtype == torch.uint8 and out.shape == (30, c, s, s)
    assert torch.equal(out, _whole_batch(x, c, s))


def test_fit_returns_the_batch_itself_when_nothing_changes():
    x = torch.zeros(3, 1, 8, 8, dtype=torch.uint8)
    assert decode._fit(x, 1, 8) is x


def test_fit_refuses_channels_it_cannot_convert():
    with pytest.raises(DataError, match="data.in_chans to 3"):
        decode._fit(torch.zeros(2, 3, 8, 8, dtype=torch.uint8), 4, 8)
