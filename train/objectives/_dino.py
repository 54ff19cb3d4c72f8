"""The training code of ``train.objective: dino`` (train/objectives/dino.py holds its options and describes it): apart,
so that reading the recipe schema imports no torch."""

from __future__ import annotations

import copy
import math
from typing import TYPE_CHECKING, ClassVar

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from timm.layers import trunc_normal_
from torch import Tensor
from torch.nn.utils.parametrizations import weight_norm
from torchvision.ops import roi_align

from train.objectives import step_generator
from train.objectives._base import Objective as _Base

if TYPE_CHECKING:
    from train.objectives.dino import Config

RATIO = (3 / 4, 4 / 3)  # RandomResizedCrop's aspect ratios, as DINO uses them
UNIFORM_SHARE = 0.95  # uniform collapse: the teacher's mean entropy is at least this share of log(out_dim)
DOMINANT_SHARE = 0.9  # dominant-prototype collapse: one prototype holds this share of the teacher's mean probability


class DINOHead(nn.Module):
    """DINO's projection head (vision_transformer.py ``DINOHead``, no batch norm): MLP, L2 normalisation, and a
    bias-free weight-normalised linear layer to ``out_dim`` (its norm fixed to 1 when ``norm_last_layer``)."""

    def __init__(
        self,
        in_dim: int,
        out_dim: int,
        nlayers: int = 3,
        hidden_dim: int = 2048,
        bottleneck_dim: int = 256,
        norm_last_layer: bool = True,
    ):
        super().__init__()
        if nlayers == 1:
            self.mlp = nn.Linear(in_dim, bottleneck_dim)
        else:
            layers = [nn.Linear(in_dim, hidden_dim), nn.GELU()]
            for _ in range(nlayers - 2):
                layers += [nn.Linear(hidden_dim, hidden_dim), nn.GELU()]
            layers.append(nn.Linear(hidden_dim, bottleneck_dim))
            self.mlp = nn.Sequential(*layers)
        self.apply(self._init_weights)
        self.last_layer = weight_norm(nn.Linear(bottleneck_dim, out_dim, bias=False))
        g = self.last_layer.parametrizations.weight.original0  # the norm of each output row
        with torch.no_grad():
            g.fill_(1.0)
        g.requires_grad_(not norm_last_layer)

    @staticmethod
    def _init_weights(m: nn.Module) -> None:
        if isinstance(m, nn.Linear):
            trunc_normal_(m.weight, std=0.02)
            if m.bias is not None:
                nn.init.zeros_(m.bias)

    def forward(self, x: Tensor) -> Tensor:
        return self.last_layer(F.normalize(self.mlp(x), dim=-1, p=2))


def crop_boxes(n: int, h: int, w: int, scale, g: torch.Generator, device) -> Tensor:
    """``n`` random-resized-crop boxes [n, 4] (x0, y0, x1, y1, whole pixels) in an h x w image, drawn as torchvision's
    ``RandomResizedCrop.get_params`` draws them: area a uniform share ``scale`` of the image, aspect ratio
    log-uniform in RATIO, the first of ten tries that fits, else the central crop at the nearest allowed ratio."""
    tries = 10
    area = (scale[0] + (scale[1] - scale[0]) * torch.rand(n, tries, generator=g, device=device)) * (h * w)
    lo, hi = math.log(RATIO[0]), math.log(RATIO[1])
    ratio = torch.exp(lo + (hi - lo) * torch.rand(n, tries, generator=g, device=device))
    cw, ch = torch.sqrt(area * ratio).round(), torch.sqrt(area / ratio).round()
    ok = (cw > 0) & (cw <= w) & (ch > 0) & (ch <= h)
    first = ok.float().argmax(1, keepdim=True)  # the first try that fits (0 when none does: replaced below)
    cw, ch = cw.gather(1, first)[:, 0], ch.gather(1, first)[:, 0]
    u = torch.rand(n, 2, generator=g, device=device)
    x0, y0 = torch.floor(u[:, 0] * (w - cw + 1)), torch.floor(u[:, 1] * (h - ch + 1))
    r = w / h  # the fallback: the central crop at the nearest allowed ratio
    fw, fh = (w, round(w / RATIO[0])) if r < RATIO[0] else ((round(h * RATIO[1]), h) if r > RATIO[1] else (w, h))
    none = ~ok.any(1)
    cw, ch = torch.where(none, float(fw), cw), torch.where(none, float(fh), ch)
    x0, y0 = torch.where(none, float((w - fw) // 2), x0), torch.where(none, float((h - fh) // 2), y0)
    return torch.stack([x0, y0, x0 + cw, y0 + ch], 1)


def random_resized_crops(x: Tensor, n: int, size: int, scale, g: torch.Generator, hflip: bool = True) -> Tensor:
    """``n`` random resized crops of every image of ``x`` [B, C, H, W] at ``size`` x ``size``, view-major
    [n * B, C, size, size] (view v of image b at v * B + b, DINO's order), each flipped horizontally with
    probability 1/2 when ``hflip``; all draws from ``g``."""
    b, _, h, w = x.shape
    boxes = crop_boxes(n * b, h, w, scale, g, x.device)
    index = torch.arange(b, device=x.device, dtype=boxes.dtype).repeat(n)
    # aligned=True: box edges at pixel edges, so a whole-image box at the image's size returns the image itself
    out = roi_align(
        x,
        torch.cat([index[:, None], boxes], 1).to(x.dtype),
        output_size=size,
        spatial_scale=1.0,
        sampling_ratio=-1,
        aligned=True,
    )
    if hflip:
        flip = torch.rand(n * b, generator=g, device=x.device) < 0.5
        out = torch.where(flip[:, None, None, None], out.flip(-1), out)
    return out


def dino_loss(
    student_out: Tensor,
    teacher_out: Tensor,
    center: Tensor,
    teacher_temp: float,
    student_temp: float,
    n_global: int = 2,
) -> tuple[Tensor, Tensor]:
    """DINO's loss (main_dino.py ``DINOLoss.forward``, without its centre update) and the teacher's probabilities.

    ``student_out`` [V * B, K] holds V views view-major, ``teacher_out`` [n_global * B, K] the teacher's global
    views in the same order (student view i is teacher view i for i < n_global). Returns (the mean over pairs
    (i, v != i) of the batch-mean cross-entropy between softmax((teacher_i - center) / teacher_temp) and
    softmax(student_v / student_temp), the teacher probabilities [n_global * B, K])."""
    n_views = student_out.shape[0] * n_global // teacher_out.shape[0]
    b = teacher_out.shape[0] // n_global
    dt = torch.promote_types(student_out.dtype, torch.float32)  # at least float32 (float64 stays)
    with torch.autocast(student_out.device.type, enabled=False):  # autocast would run the einsum in bf16
        student_out, teacher_out, center = student_out.to(dt), teacher_out.to(dt), center.to(dt)
        q = F.softmax((teacher_out - center) / teacher_temp, dim=-1)
        log_p = F.log_softmax(student_out / student_temp, dim=-1)
        # ce[i, v] = batch mean of H(q_i, p_v): one contraction over (batch, prototypes) for every pair
        ce = -torch.einsum("ibk,vbk->iv", q.view(n_global, b, -1), log_p.view(n_views, b, -1)) / b
        keep = ~torch.eye(n_global, n_views, dtype=torch.bool, device=ce.device)  # skip a view paired with itself
        return ce[keep].sum() / keep.sum(), q


def _rank_world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


class Objective(_Base):
    name = "dino"
    uses_labels = False
    wraps = True
    parts: ClassVar[dict[str, str]] = {"student": "backbone.", "teacher": "teacher_backbone."}

    def __init__(self, backbone: nn.Module, cfg: Config, recipe, num_classes: int):
        super().__init__(backbone, cfg, recipe, num_classes)
        self.img_size = recipe.data.img_size
        self.head = DINOHead(
            backbone.num_features, cfg.out_dim, cfg.nlayers, cfg.hidden_dim, cfg.bottleneck_dim, cfg.norm_last_layer
        )
        self.teacher_backbone = copy.deepcopy(backbone)  # the same initial weights as the student
        self.teacher_head = copy.deepcopy(self.head)
        for p in [*self.teacher_backbone.parameters(), *self.teacher_head.parameters()]:
            p.requires_grad_(False)
        assert all(a == b for a, b in self._pairs(named=True)), "teacher and student parameters must correspond"
        self.register_buffer("center", torch.zeros(1, cfg.out_dim))
        self.last: dict = {}  # the last step's teacher statistics (all processes), for summary()
        self.train()

    def _pairs(self, named: bool = False):
        """(student, teacher) parameter pairs (or their names)."""
        s = [*self.backbone.named_parameters(), *self.head.named_parameters()]
        t = [*self.teacher_backbone.named_parameters(), *self.teacher_head.named_parameters()]
        return [((ns, nt) if named else (ps, pt)) for (ns, ps), (nt, pt) in zip(s, t, strict=True)]

    def train(self, mode: bool = True):
        """The teacher stays in eval mode: no stochastic depth, no dropout (DINO's teacher has neither)."""
        super().train(mode)
        self.teacher_backbone.eval()
        self.teacher_head.eval()
        return self

    # ---------------------------------------------------------------- schedules (functions of the step: exact resume)

    def teacher_momentum(self, step: int) -> float:
        """m of the EMA after the optimizer step of 0-based index ``step`` (DINO's ``cosine_scheduler(m0, 1)``)."""
        m0 = self.cfg.momentum_teacher
        return 1.0 - (1.0 - m0) * (math.cos(math.pi * step / self.total_steps) + 1.0) / 2.0

    def teacher_temp(self, step: int) -> float:
        """tau_t of the optimizer step of 0-based index ``step``: ``np.linspace(warmup_teacher_temp, teacher_temp,
        warmup_teacher_temp_steps)[step]`` during the warm-up, then ``teacher_temp`` (DINO's schedule, in steps)."""
        c, n = self.cfg, self.cfg.warmup_teacher_temp_steps
        if step >= n:
            return c.teacher_temp
        return c.warmup_teacher_temp + (c.teacher_temp - c.warmup_teacher_temp) * (step / (n - 1) if n > 1 else 0.0)

    # ---------------------------------------------------------------- one step

    def views(self, x: Tensor, step: int) -> tuple[Tensor, Tensor | None]:
        """(2 global views [2B, C, H, W], local views [nB, C, s, s] or None), view-major, from (seed, step, process)."""
        c = self.cfg
        g = step_generator(self.seed, step, _rank_world()[0], x.device)
        glob = random_resized_crops(x, 2, self.img_size, c.global_crops_scale, g, c.hflip)
        loc = (
            random_resized_crops(x, c.local_crops_number, c.local_crop_size, c.local_crops_scale, g, c.hflip)
            if c.local_crops_number
            else None
        )
        return glob, loc

    def forward(self, x: Tensor, y: Tensor, step: int) -> tuple[Tensor, dict[str, Tensor]]:
        glob, loc = self.views(x, step)
        feats = [self.backbone(glob)] + ([self.backbone(loc)] if loc is not None else [])  # one pass per resolution
        student = self.head(torch.cat(feats)).float()
        with torch.no_grad():
            teacher = self.teacher_head(self.teacher_backbone(glob)).float()
        temp = self.teacher_temp(step)
        loss, q = dino_loss(student, teacher, self.center, temp, self.cfg.student_temp)
        with torch.no_grad():
            entropy = -(q * torch.log(q.clamp_min(1e-30))).sum(-1)
            self._update_center_and_stats(teacher, q, entropy)
            dev, h = loss.device, entropy.mean()
            terms = {
                "dino_loss": loss.detach(),
                "teacher_entropy": h,
                "teacher_student_kl": loss.detach() - h,
                "center_norm": self.center.norm(),
                "teacher_momentum": torch.tensor(self.teacher_momentum(step), device=dev),
                "teacher_temp": torch.tensor(temp, device=dev),
            }
        return loss, terms

    def _update_center_and_stats(self, teacher: Tensor, q: Tensor, entropy: Tensor) -> None:
        """The centre's EMA of the batch mean of the teacher's outputs over all processes (DINO's ``update_center``),
        and, from the same all-reduce, the statistics summary() reads."""
        k = teacher.shape[1]
        packed = torch.cat(
            [
                teacher.sum(0),
                q.sum(0),
                entropy.sum().reshape(1),
                torch.tensor([float(len(teacher))], device=teacher.device),
            ]
        )
        _, world = _rank_world()
        if world > 1:
            dist.all_reduce(packed)
        n = packed[-1]
        cm = self.cfg.center_momentum
        self.center.mul_(cm).add_((packed[:k] / n).unsqueeze(0), alpha=1.0 - cm)
        marginal = packed[k : 2 * k] / n  # the teacher's probabilities averaged over the views
        share, proto = marginal.max(0)
        self.last = {
            "teacher_entropy": packed[2 * k] / n,
            "marginal_entropy": -(marginal * torch.log(marginal.clamp_min(1e-30))).sum(),
            "top_share": share,
            "top_prototype": proto,
            "views": n,
            "center_norm": self.center.norm(),
        }

    @torch.no_grad()
    def after_step(self, step: int) -> None:
        """EMA of the student into the teacher with the momentum of the step just taken (0-based index step - 1)."""
        m = self.teacher_momentum(step - 1)
        s, t = zip(*self._pairs())
        torch._foreach_mul_(t, m)
        torch._foreach_add_(t, [p.detach() for p in s], alpha=1.0 - m)

    def summary(self) -> dict:
        """Collapse diagnosis from the last step's teacher outputs (see the module docstring)."""
        if not self.last:
            return {}
        st = {k: float(v) for k, v in self.last.items()}
        k, h = self.cfg.out_dim, st["teacher_entropy"]
        log_k = math.log(k)
        collapsed = None
        if h >= UNIFORM_SHARE * log_k:
            collapsed = (
                f"DINO collapsed to the uniform distribution: the teacher's mean entropy is {h:.3f} nats, "
                f"{h / log_k:.0%} of log(out_dim) = {log_k:.3f}, so its outputs no longer tell images apart (sharpen "
                "more: "
                f"a lower objectives.dino.teacher_temp)."
            )
        elif st["top_share"] >= DOMINANT_SHARE:
            collapsed = (
                f"DINO collapsed to one prototype: prototype {int(st['top_prototype'])} holds {st['top_share']:.0%} of "
                "the "
                f"teacher's probability over the last step's {int(st['views'])} global views (teacher entropy {h:.3f} "
                "nats "
                f"of log(out_dim) = {log_k:.3f}; try a lower objectives.dino.center_momentum or a higher teacher_temp)."
            )
        return {
            "collapsed": collapsed,
            "warning": collapsed,
            "teacher_entropy": h,
            "log_out_dim": log_k,
            "teacher_marginal_entropy": st["marginal_entropy"],
            "top_prototype_share": st["top_share"],
            "center_norm": st["center_norm"],
        }
