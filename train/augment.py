"""Augmentation: random-resized crop, random shift, horizontal flip, RandAugment; mixup / CutMix.

On the device, on whole uint8 batches, from torch's global RNG (the trainer reseeds it every step, so a resumed
run draws the same): :func:`augment`, :func:`batch_rrc`, :func:`rand_augment`. Per image in the DataLoader
workers for a lazy train split, from a generator seeded by (seed, epoch, index): :func:`rrc_box`, :func:`crop_rng`.
Mixup / CutMix of the normalised batch with soft targets: timm's ``Mixup`` (:func:`make_mixer`), which draws from
numpy's global RNG (the trainer reseeds it every step alongside torch's).
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from timm.data import Mixup
from torchvision.transforms import v2

RRC_SCALE, RRC_RATIO = (0.08, 1.0), (3 / 4, 4 / 3)


def rrc_box(w: int, h: int, rng: np.random.Generator) -> tuple[int, int, int, int]:
    """Inception-style random-resized-crop box (left, top, right, bottom) of a w x h image: area a uniform
    fraction of RRC_SCALE, aspect ratio log-uniform in RRC_RATIO, 10 tries, then the central crop at the nearest
    allowed ratio (torchvision's RandomResizedCrop.get_params, drawn from ``rng``)."""
    area = w * h
    lo, hi = np.log(RRC_RATIO[0]), np.log(RRC_RATIO[1])
    for _ in range(10):
        target = area * rng.uniform(*RRC_SCALE)
        ratio = float(np.exp(rng.uniform(lo, hi)))
        cw, ch = int(round(np.sqrt(target * ratio))), int(round(np.sqrt(target / ratio)))
        if 0 < cw <= w and 0 < ch <= h:
            x0, y0 = int(rng.integers(0, w - cw + 1)), int(rng.integers(0, h - ch + 1))
            return x0, y0, x0 + cw, y0 + ch
    r = w / h
    if r < RRC_RATIO[0]:
        cw, ch = w, int(round(w / RRC_RATIO[0]))
    elif r > RRC_RATIO[1]:
        cw, ch = int(round(h * RRC_RATIO[1])), h
    else:
        cw, ch = w, h
    x0, y0 = (w - cw) // 2, (h - ch) // 2
    return x0, y0, x0 + cw, y0 + ch


def crop_rng(seed: int, epoch: int, index: int) -> np.random.Generator:
    """The generator of one image's crop: a function of (seed, epoch, index in the train split) only, so any
    worker, batch order or resumed run draws the same crop for it."""
    return np.random.default_rng([int(seed), int(epoch), int(index)])


def augment(
    x: torch.Tensor, shift: int, hflip: bool, rrc: bool = False, ra_ops: int = 0, ra_magnitude: int = 9
) -> torch.Tensor:
    """Per-image random-resized crop (``rrc``, see :func:`batch_rrc`), random translation by up to +-shift pixels
    (zero padding), random horizontal flip and RandAugment (``ra_ops`` > 0), in that order.

    Draws from torch's global RNG on x's device (the trainer reseeds it every step for exact resume).
    """
    if rrc:
        x = batch_rrc(x)
    b, c, h, w = x.shape
    if shift > 0:
        p = F.pad(x, (shift, shift, shift, shift))
        dy = torch.randint(0, 2 * shift + 1, (b,), device=x.device)
        dx = torch.randint(0, 2 * shift + 1, (b,), device=x.device)
        rows = (dy[:, None] + torch.arange(h, device=x.device))[:, None, :, None]
        cols = (dx[:, None] + torch.arange(w, device=x.device))[:, None, None, :]
        bi = torch.arange(b, device=x.device)[:, None, None, None]
        ci = torch.arange(c, device=x.device)[None, :, None, None]
        x = p[bi, ci, rows, cols]
    if hflip:
        flip = torch.rand(b, device=x.device) < 0.5
        x = torch.where(flip[:, None, None, None], x.flip(-1), x)
    if ra_ops > 0:
        x = rand_augment(x, ra_ops, ra_magnitude)
    return x


def rand_augment(x: torch.Tensor, num_ops: int, magnitude: int) -> torch.Tensor:
    """torchvision's RandAugment on a uint8 batch [B, C, H, W], image by image (called on the whole batch it would
    apply the same ops to every image): ``num_ops`` ops, each of its 14 kinds equally likely, at ``magnitude``
    (of 0-30), a random sign for the signed ones. Torch's global RNG. A Python loop over the batch: 0.25-0.7 ms
    an image of 28x28 on a 2-core CPU (5-15% of a default-recipe step)."""
    ra = v2.RandAugment(num_ops=num_ops, magnitude=magnitude)
    return torch.stack([ra(im) for im in x])


def batch_rrc(x: torch.Tensor) -> torch.Tensor:
    """Inception-style random-resized crop of every image of a uint8 batch [B, C, H, W] on its device: box area a
    uniform fraction of RRC_SCALE of the image, aspect ratio log-uniform in RRC_RATIO (first of 10 tries that fits,
    else the whole image), resampled bilinearly back to H x W. Torch's global RNG (reseeded every step)."""
    b, c, h, w = x.shape
    dev, tries = x.device, 10
    area = torch.empty(b, tries, device=dev).uniform_(*RRC_SCALE) * (h * w)
    ratio = torch.exp(
        torch.empty(b, tries, device=dev).uniform_(float(np.log(RRC_RATIO[0])), float(np.log(RRC_RATIO[1])))
    )
    cw, ch = torch.sqrt(area * ratio).round(), torch.sqrt(area / ratio).round()
    ok = (cw >= 1) & (cw <= w) & (ch >= 1) & (ch <= h)
    first = torch.where(ok.any(1), ok.float().argmax(1), torch.full((b,), -1, device=dev))
    pick = first.clamp_min(0)[:, None]
    cw = torch.where(first >= 0, cw.gather(1, pick)[:, 0], torch.full((b,), float(w), device=dev))
    ch = torch.where(first >= 0, ch.gather(1, pick)[:, 0], torch.full((b,), float(h), device=dev))
    x0 = torch.floor(torch.rand(b, device=dev) * (w - cw + 1))
    y0 = torch.floor(torch.rand(b, device=dev) * (h - ch + 1))
    theta = torch.zeros(b, 2, 3, device=dev)
    theta[:, 0, 0], theta[:, 0, 2] = cw / w, (2 * x0 + cw) / w - 1
    theta[:, 1, 1], theta[:, 1, 2] = ch / h, (2 * y0 + ch) / h - 1
    grid = F.affine_grid(theta, (b, c, h, w), align_corners=False)
    out = F.grid_sample(x.float(), grid, mode="bilinear", padding_mode="border", align_corners=False)
    return out.round().clamp(0, 255).to(torch.uint8)


def make_mixer(aug, num_classes: int, label_smoothing: float = 0.0) -> Mixup | None:
    """timm's ``Mixup`` configured from ``data.augment`` (None when both alphas are 0): called as
    ``x, soft_targets = mixer(x, y)`` on a float batch of even size (x mixed in place), its targets rows of
    ``num_classes`` that sum to 1, smoothed by ``label_smoothing`` as timm does; train with timm's
    ``SoftTargetCrossEntropy``. Draws from numpy's global RNG."""
    if aug.mixup_alpha <= 0 and aug.cutmix_alpha <= 0:
        return None
    return Mixup(
        mixup_alpha=aug.mixup_alpha,
        cutmix_alpha=aug.cutmix_alpha,
        prob=aug.mix_prob,
        switch_prob=aug.switch_prob,
        mode=aug.mix_mode,
        label_smoothing=label_smoothing,
        num_classes=num_classes,
    )


def mix_uint8(x: torch.Tensor, mixer: Mixup) -> torch.Tensor:
    """A uint8 batch [B, C, H, W] mixed by ``mixer`` (an odd last image left as it is), for showing it."""
    n = len(x) - len(x) % 2
    if n == 0:
        return x
    mixed, _ = mixer(x[:n].float(), torch.zeros(n, dtype=torch.long, device=x.device))
    return torch.cat([mixed.round().clamp(0, 255).to(torch.uint8), x[n:]])
