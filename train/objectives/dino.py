"""``train.objective: dino``: self-distillation with no labels (Caron et al. 2021, "Emerging Properties in
Self-Supervised Vision Transformers", §3.1, Alg. 1; the authors' code is facebookresearch/dino, main_dino.py).

A student ``g_s`` (the backbone plus a projection head) and a teacher ``g_t`` of the same architecture see
different random views of each image. For the K-dimensional head outputs (``out_dim`` prototypes),

    P_t(x) = softmax((g_t(x) - c) / tau_t)          centring (c) and sharpening (tau_t, teacher_temp)
    P_s(x) = softmax(g_s(x) / tau_s)                 tau_s = student_temp
    loss   = mean over pairs (i, v), i a global view, v any view, v != i, of  H(P_t(x_i), P_s(x_v))
             with H(a, b) = -sum_k a_k log b_k, averaged over the batch

Multi-crop (§3.1): two global views (random resized crops of scale ``global_crops_scale`` at ``data.img_size``)
and ``local_crops_number`` local views (scale ``local_crops_scale`` at ``local_crop_size``); the teacher sees
only the global views, the student all of them. The ViT takes the smaller local views through timm's
``dynamic_img_size`` (the position embedding resampled to their grid). The teacher gets no gradient: after every
optimizer step it is an exponential moving average of the student, ``theta_t <- m theta_t + (1 - m) theta_s``,
with ``m`` rising from ``momentum_teacher`` to 1 on a cosine over ``train.steps`` (DINO's ``cosine_scheduler``):
the update after the optimizer step of 0-based index ``s`` uses

    m(s) = 1 - (1 - momentum_teacher) (cos(pi s / train.steps) + 1) / 2

The centre is an EMA of the batch mean of the teacher's outputs (all processes' batches), updated after the loss:
``c <- center_momentum c + (1 - center_momentum) mean_b g_t(x_b)``. The teacher temperature rises linearly from
``warmup_teacher_temp`` to ``teacher_temp`` over the first ``warmup_teacher_temp_steps`` steps (DINO's
``np.linspace`` over epochs, here over steps), then stays. The head (DINO's ``DINOHead``) is an MLP of ``nlayers``
linear layers (GELU between; ``hidden_dim`` wide) down to ``bottleneck_dim``, L2 normalisation, and a bias-free
weight-normalised linear layer to ``out_dim`` whose norm is fixed to 1 when ``norm_last_layer`` (torch's
``parametrizations.weight_norm``); it reads the backbone's pooled output (the CLS token, or the token mean of a
``head: gap`` ViT).

Logged every step (``train/<term>``): ``dino_loss``; ``teacher_entropy``, the mean entropy of P_t (nats);
``teacher_student_kl`` = dino_loss - teacher_entropy, the mean KL(P_t || P_s) over the pairs (each global view
pairs with the same number of student views, so the pair-mean of H(P_t) is teacher_entropy). §5.3 / Fig. 7 of the
paper decompose the loss into these two terms to show collapse: a collapsed teacher has the KL at 0 with the
entropy at log K (uniform collapse, sharpening too weak) or at 0 (one dimension dominates, centring too weak).
Also ``center_norm`` (after the step's update), ``teacher_momentum`` (the m the step's EMA uses) and
``teacher_temp``. :meth:`Objective.summary` diagnoses collapse from the last step's teacher outputs (all
processes): uniform when the mean entropy is at least ``UNIFORM_SHARE`` of log K, dominant-prototype when one
prototype holds at least ``DOMINANT_SHARE`` of the teacher's probability averaged over the global views (the
share of the top choice alone would flag an untrained network, whose outputs all lean the same small way).

Where this differs from the authors' code, and why:

* Views are cut from the device batch (already normalised and given the recipe's ``data.augment``): per image,
  torchvision's ``roi_align`` (bilinear, averaging ceil(box / output) samples per output pixel, so shrinking is
  mildly anti-aliased) on boxes drawn as torchvision's ``RandomResizedCrop.get_params`` draws them (ratio 3/4-4/3,
  ten tries, then the central crop), and a horizontal flip with probability 1/2. DINO crops PIL images with bicubic
  resampling and adds colour jitter, grayscale, Gaussian blur and solarisation: those need the raw RGB image and
  suit ImageNet photographs, not the normalised one-channel images of the CPU recipes, so they are left out.
  Randomness: :func:`train.seeding.step_generator` (seed, step, process), so a resumed run cuts the same views.
* The teacher is a deep copy of the student (same initial weights, as DINO's ``load_state_dict``) kept in eval
  mode: DINO builds its teacher without stochastic depth and without dropout, which eval mode gives whatever the
  student's ``model.drop_path`` / ``model.dropout`` are. EMA over parameters, as DINO.
* Not implemented: DINO's ``freeze_last_layer`` (last-layer gradients dropped during the first epoch), its cosine
  weight-decay schedule (0.04 -> 0.4; here ``train.weight_decay`` is constant) and its lr scaling by batch / 256
  (``train.lr`` is used as given). timm's optimizer exempts biases, norms and the position embedding / CLS token
  from weight decay; DINO exempts biases and norms only.
* Schedules are over optimizer steps (``train.steps``, resumable like ``train.lr``: after a resume with another
  ``train.steps`` the rest of the momentum schedule follows the new value), not epochs x iterations per epoch.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vitlab.plugins import deferred


def _range(lo=None, hi=None, lo_open=False):  # the recipe's range metadata (train.recipe imports this package)
    return {"lo": lo, "hi": hi, "lo_open": lo_open}


@dataclass
class Config:
    """DINO's options (main_dino.py names; defaults sized for a CPU: DINO's ImageNet values are out_dim 65536,
    hidden_dim 2048, bottleneck_dim 256, 8 local crops of 96 px for 224 px images)."""

    out_dim: int = field(default=1024, metadata=_range(2, 1 << 20))  # K, the number of prototypes
    hidden_dim: int = field(default=512, metadata=_range(1, 1 << 16))
    bottleneck_dim: int = field(default=128, metadata=_range(1, 1 << 16))
    nlayers: int = field(default=3, metadata=_range(1, 16))  # linear layers before the L2 normalisation
    norm_last_layer: bool = True  # the last layer's weight norm fixed to 1 (DINO's default)
    teacher_temp: float = field(default=0.04, metadata=_range(0.0, 10.0, lo_open=True))
    warmup_teacher_temp: float = field(default=0.04, metadata=_range(0.0, 10.0, lo_open=True))
    warmup_teacher_temp_steps: int = field(default=0, metadata=_range(0))
    student_temp: float = field(default=0.1, metadata=_range(0.0, 10.0, lo_open=True))
    center_momentum: float = field(default=0.9, metadata=_range(0.0, 1.0))
    momentum_teacher: float = field(default=0.996, metadata=_range(0.0, 1.0))  # rises to 1 on a cosine
    global_crops_scale: list[float] = field(default_factory=lambda: [0.4, 1.0])  # share of the image's area
    local_crops_number: int = field(default=4, metadata=_range(0, 64))
    local_crops_scale: list[float] = field(default_factory=lambda: [0.05, 0.4])
    local_crop_size: int = field(default=12, metadata=_range(1, 1024))  # pixels, a multiple of model.patch_size
    hflip: bool = True  # each view flipped horizontally with probability 1/2


def check(cfg: Config, recipe) -> str | None:
    m, d = recipe.model, recipe.data
    if m.arch != "vit":
        return (
            "train.objective 'dino' trains a ViT (its local crops of another size go through timm's "
            "dynamic_img_size), "
            f"not model.arch {m.arch!r}: set model.arch=vit."
        )
    for key in ("global_crops_scale", "local_crops_scale"):
        s = getattr(cfg, key)
        if len(s) != 2 or not 0.0 < s[0] <= s[1] <= 1.0:
            return f"key 'objectives.dino.{key}' must be two numbers lo, hi with 0 < lo <= hi <= 1, got {s}."
    if cfg.local_crops_number:
        if cfg.local_crop_size % m.patch_size or cfg.local_crop_size > d.img_size:
            return (
                f"key 'objectives.dino.local_crop_size' is {cfg.local_crop_size}: it must be a multiple of "
                "model.patch_size "
                f"({m.patch_size}) no larger than data.img_size ({d.img_size}), e.g. "
                f"{max(m.patch_size, (d.img_size * 3 // 7) // m.patch_size * m.patch_size)}."
            )
        if recipe.interventions.local_attention:
            return (
                "interventions.local_attention fixes the attention window to the token grid of data.img_size, which "
                "DINO's "
                "local crops do not have: set objectives.dino.local_crops_number=0 or remove the intervention."
            )
    return None


# the training code (DINOHead, the crops, the loss, Objective: torch, timm, torchvision) is train/objectives/_dino.py,
# imported when first asked for: reading the recipe schema imports this module and no torch
__getattr__ = deferred(__name__, "train.objectives._dino")
