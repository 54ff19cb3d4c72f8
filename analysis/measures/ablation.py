"""Interventions at analysis time: each part of a trained model is replaced in turn, the analysis images are run
again, and the change of the model's read-outs is reported (ablations; cf. Michel et al. 2019 for heads, Raghu et
al. 2021 §6 / Fig. 8 for skip connections, where the model is TRAINED without them: interventions.no_skip).

Targets (option ``targets``: families, or single targets by name; every target is ablated on its own, the rest of
the model as trained). ViT block i (``blocks.i``):

    blocks.i.head{h}      head h's output: channels h*dh:(h+1)*dh of the input of ``attn.proj`` (the heads' A_h V_h
                          concatenated, after ``attn.norm`` and after any training-time head mask -- the place
                          interventions.head_mask zeroes; tap ``proj_in``). ``head0+2`` ablates heads 0 and 2 at once
    blocks.i.attn         the attention branch as the block adds it to the residual stream (after ls1 / drop_path1)
    blocks.i.mlp          the MLP branch likewise (after ls2 / drop_path2)
    blocks.i.skip_attn    the skip path of the attention sublayer: z + f(z) becomes r + f(z)
    blocks.i.skip_mlp     the skip path of the MLP sublayer likewise
    blocks.i.skip         both skip paths; with r = 0, x = f(norm(x)) at both sublayers: what interventions.no_skip
                          {where: both} trains, here at test time on the normally trained weights
    blocks.i.cls          the prefix (CLS / register) tokens of block i's input: the path carrying them into block i
    blocks.i.spatial      the spatial tokens of block i's input

families: ``heads`` (every single head), ``branches`` (attn, mlp), ``skip`` (skip_attn, skip_mlp, skip), ``tokens``
(cls where the model has prefix tokens, spatial). ResNet block ``layer{s}.{j}`` (Raghu §6's comparison made causal):
``.branch`` the residual branch (the output of its last module, tap ``branch``; family ``branches``) and ``.shortcut``
the shortcut (the block input for an identity shortcut, the downsample's output otherwise; family ``skip``). A skip
target of a sublayer trained without its skip (interventions.no_skip) does not exist and is left out.

Replacement (option ``replace``) of an activation a(x) of image x, position by position (token / feature-map
position), always from the UNABLATED model's activations:

    zero      r = 0
    mean      r = mean of a over the analysis images (per position): "mean ablation"; the means come from a first
              pass (the suite's pass over the analysis images), summed over processes
    resample  r = a(x') with x' another image of the same analysis minibatch: image order[m] takes order[m + 1]'s
              (cyclically) for a permutation ``order`` drawn from seed (option ``seed``, minibatch index): every
              image gets another image's activation and each image gives exactly one ("resample ablation")

Skip paths (option ``skip``): ``remove`` (default) sets the skip term to 0 whatever ``replace`` says -- the test-time
counterpart of interventions.no_skip, x = f(norm(x)); ``replace`` gives the skip term the ``replace`` treatment.

Read-outs of the ablated model on the analysis images (labels y, N images):

    top1       fraction of images whose argmax logit is y          (models with a classifier; NaN otherwise)
    loss       mean cross-entropy of the logits                   (likewise)
    knn_top1   weighted k-NN top-1 (train/knn.py: cosine, k = 20, T = 0.07, DINO's protocol) of the classifier's
               input -- the final pooled representation, for any model, self-supervised ones included -- against
               a bank of the UNABLATED model's probe-train representations. The bank stays fixed as the linear head
               does: the read-out is what a k-NN classifier built on the trained model loses (and it costs no pass
               over the probe-train images per ablation). NaN without probe-train images.
    cka[j]     linear CKA (unbiased minibatch HSIC, analysis.estimators.similarity, as the ``cka`` measure; each image's
               representation = all tokens / positions flattened) between block j's output in the ablated model
               and in the unablated one, for blocks j at or after the target's; NaN before it.

beside the unablated model's top1, loss and knn_top1; ``top1_drop`` = clean - ablated, ``loss_increase`` = ablated -
clean, ``knn_drop`` = clean - ablated (positive: the target mattered).

How the work is batched (the cost). Each ablation changes the model from its target's block on only, so nothing before
that block is recomputed: per analysis minibatch one unablated forward captures every block's input
(:class:`analysis.engine.taps.Taps`), and each ablation forward runs the model's own ``forward`` on ONE image with a
forward pre-hook on the target's block that replaces that block's input by the captured one. Ablations of the same block
run together, k per forward by repeating the minibatch k times (k = ``forward_images`` // minibatch size, copy c
carrying ablation c). Heads do not even recompute their block's attention: their forward starts at ``attn.proj`` from
the heads' output captured in the unablated forward (tap ``proj_in``) -- a pre-hook on ``attn`` gives the attention one
image of the minibatch to work on, and the pre-hook on ``attn.proj`` replaces its input by the captured one, [k, B, T,
C] with copy c's head(s) replaced; the rest of the block is token-wise (proj, LayerScale, the residual add broadcasts,
MLP), and a forward hook on the block flattens the copies to [k * B, T, C] for the blocks after it. Everything is
forward hooks on timm's own modules, removed after each forward; nothing of the model is changed.

A skip path is removed by a forward hook on the branch's last module returning f(z) + r - z, which the block adds to
z: the result is r + f(z) up to float32 rounding of z (about 1e-7 of ||z||; the test against a model built with
interventions.no_skip allows 1e-5).

Processes: minibatch j is done by process j mod world (as the suite's pass); the means (first pass), the k-NN bank
(gathered in minibatch order) and the read-out sums (one float64 all-reduce) are the same on 1 and N processes.

Result (N targets, L blocks): ``targets`` [N] names, ``kinds`` [N], ``target_block`` [N] (block index), ``heads`` [N]
("0+2", "" for other kinds), ``top1``, ``loss``, ``knn_top1``, ``top1_drop``, ``loss_increase``, ``knn_drop`` [N],
``cka`` [N, L], ``clean_top1``, ``clean_loss``, ``clean_knn_top1``, ``blocks`` [L], ``num_heads`` (0 for a ResNet),
``replace``, ``skip``, ``n_images``, ``n_bank``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import ClassVar, Literal

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from timm.models.vision_transformer import Attention, Block

from analysis.engine.figures import finish_block_axes, subplots, wrap
from analysis.engine.measure import Context, Measure, MeasureError, as_list, register
from analysis.engine.reduce import all_reduce_tree, collect
from analysis.engine.taps import Taps
from analysis.estimators.features import block_tag
from analysis.estimators.similarity import hsic_gram
from analysis.families.timm_resnet import branch_end
from analysis.measures.erf import unwrap
from train.knn import TEMPERATURE, K, knn_predict

FAMILIES = {
    "vit": {
        "heads": ("head",),
        "branches": ("attn", "mlp"),
        "skip": ("skip_attn", "skip_mlp", "skip"),
        "tokens": ("cls", "spatial"),
    },
    "resnet": {"heads": (), "branches": ("branch",), "skip": ("shortcut",), "tokens": ()},
}
KINDS = {
    "vit": ("head", "attn", "mlp", "skip_attn", "skip_mlp", "skip", "cls", "spatial"),
    "resnet": ("branch", "shortcut"),
}
SKIP_KINDS = ("skip_attn", "skip_mlp", "skip", "shortcut")
# the activations (tap kinds, analysis/engine/taps.py) whose unablated values a kind's replacement is made of
SITES = {
    "head": ("proj_in",),
    "attn": ("attn_branch",),
    "mlp": ("mlp_branch",),
    "skip_attn": ("in",),
    "skip_mlp": ("attn_out",),
    "skip": ("in", "attn_out"),
    "cls": ("in",),
    "spatial": ("in",),
    "branch": ("branch",),
    "shortcut": ("shortcut",),
}
_NAME = re.compile(
    r"^(?P<block>.+)\.(?P<kind>head(?P<heads>\d+(\+\d+)*)|attn|mlp|skip_attn|skip_mlp|skip|cls|spatial|branch|shortcut)$"
)
_SEED_STRIDE = 1_000_003  # resample seed of minibatch j: seed * stride + j


@dataclass(frozen=True)
class AblationOptions:
    replace: Literal["zero", "mean", "resample"] = "mean"  # what an ablated activation becomes
    skip: Literal["remove", "replace"] = "remove"  # skip paths: set to 0 (no_skip at test time), or as `replace` says
    targets: tuple[str, ...] = ("heads", "branches", "skip", "tokens")  # families, or names like blocks.3.head0+1
    seed: int = 0  # resample: the permutation of each minibatch
    forward_images: int = 256  # images per ablation forward (copies x minibatch); more on a GPU, fewer for big models
    cka: bool = True  # CKA of every later block's output to the unablated model's
    knn: bool = True  # k-NN top-1 of the final representation (needs probe-train images: one pass over them)

    def check(self):
        if self.forward_images < 1:
            return f"forward_images must be >= 1, not {self.forward_images}."
        if not self.targets:
            return "targets is empty: name families (heads, branches, skip, tokens) or targets such as blocks.3.head0."
        for t in self.targets:
            if t not in FAMILIES["vit"] and not _NAME.match(str(t)):
                return (
                    f"target '{t}' is neither a family (heads, branches, skip, tokens) nor a target name such as "
                    "blocks.3.head0, blocks.3.head0+1, blocks.3.attn, blocks.3.skip or layer2.0.shortcut."
                )
        return None


@dataclass(frozen=True)
class Target:
    """One ablation: a kind (see the module docstring) at block ``block`` (index into the block list); ``heads`` for
    kind ``head``."""

    block: int
    kind: str
    heads: tuple[int, ...] = ()

    def name(self, blocks) -> str:
        kind = "head" + "+".join(map(str, self.heads)) if self.kind == "head" else self.kind
        return f"{blocks[self.block]}.{kind}"


def resample_permutation(n: int, seed: int, j: int) -> torch.Tensor:
    """perm [n]: image m of minibatch j takes image perm[m]'s activation; a random cyclic permutation (a single cycle,
    so perm[m] != m and every image is taken once), drawn from (seed, j) the same way on every process."""
    g = torch.Generator().manual_seed(seed * _SEED_STRIDE + j)
    order = torch.randperm(n, generator=g)
    perm = torch.empty(n, dtype=torch.long)
    perm[order] = order.roll(-1)
    return perm


def _skips(blk: nn.Module) -> tuple[bool, bool]:
    """Whether a ViT block has its attention / MLP skip path (interventions.no_skip blocks may lack them)."""
    return bool(getattr(blk, "skip_attn", True)), bool(getattr(blk, "skip_mlp", True))


def parse_targets(spec, arch: str, blocks: list[str], modules: list[nn.Module], prefix: int) -> list[Target]:
    """The targets that ``spec`` (families and/or names, see the module docstring) names on this model, in order:
    each family block by block (within a block: heads, attn, mlp, skip_attn, skip_mlp, skip, cls, spatial), named
    targets where they are listed; duplicates once. MeasureError (one sentence) for a name the model does not have."""
    fams = FAMILIES[arch]

    def exists(b: int, kind: str) -> bool:
        if arch == "resnet":
            return True
        sa, sm = _skips(modules[b])
        return {"skip_attn": sa, "skip_mlp": sm, "skip": sa and sm, "cls": prefix > 0}.get(kind, True)

    wanted = [str(s) for s in spec]
    by_family = [k for f in wanted if f in fams for k in fams[f]]
    out: list[Target] = []
    for b in range(len(blocks)):
        for kind in KINDS[arch]:
            if kind not in by_family or not exists(b, kind):
                continue
            if kind == "head":
                out += [Target(b, "head", (h,)) for h in range(modules[b].attn.num_heads)]
            else:
                out.append(Target(b, kind))
    for s in wanted:
        if s in fams:
            continue
        m = _NAME.match(s)
        block, kind = m["block"], ("head" if m["heads"] else m["kind"])
        if block not in blocks:
            raise MeasureError(
                f"ablation target '{s}': the model has no block '{block}' (its blocks are {blocks[0]} ... "
                f"{blocks[-1]})."
            )
        b = blocks.index(block)
        if kind not in KINDS[arch] or not exists(b, kind):
            raise MeasureError(
                f"ablation target '{s}': block {block} of this {arch} has no {kind} to ablate "
                f"(kinds: {', '.join(k for k in KINDS[arch] if exists(b, k))})."
            )
        heads = tuple(sorted({int(h) for h in m["heads"].split("+")})) if m["heads"] else ()
        if heads and max(heads) >= modules[b].attn.num_heads:
            raise MeasureError(f"ablation target '{s}': block {block} has heads 0..{modules[b].attn.num_heads - 1}.")
        out.append(Target(b, kind, heads))
    return list(dict.fromkeys(out))


class _Hooks:
    """Forward (pre-)hooks for one forward pass, always removed at exit."""

    def __init__(self):
        self.handles: list = []

    def pre(self, module: nn.Module, fn) -> None:
        self.handles.append(module.register_forward_pre_hook(fn))

    def post(self, module: nn.Module, fn) -> None:
        self.handles.append(module.register_forward_hook(fn))

    def __enter__(self) -> _Hooks:
        return self

    def __exit__(self, *exc) -> None:
        for h in self.handles:
            h.remove()
        self.handles.clear()


def _replace_args(value):
    """A forward pre-hook giving the module ``value`` as its first argument (the model runs on a dummy image up to
    it)."""
    return lambda mod, args: (value, *tuple(args[1:]))


@register
class Ablation(Measure):
    """What each head, branch, skip path and token path is worth: replaced in turn at test time, read-outs compared.

    Every head, attention / MLP branch, skip path and token path of a ViT (ResNet: every block's branch and
    shortcut) replaced in turn by zero, its mean over the analysis images or another image's value; the change of
    top-1, loss, k-NN top-1 of the final representation and CKA of later blocks to the unablated model (definitions
    in the module docstring)."""

    name: ClassVar[str] = "ablation"
    chunkable: ClassVar[bool] = True  # per-image sums / rows: a minibatch may come in chunks
    Options = AblationOptions

    @classmethod
    def applies(cls, ctx: Context) -> bool:
        return ctx.arch in ("vit", "resnet")

    @classmethod
    def cost(cls, ctx: Context, opts, n_images: int) -> dict[str, float]:
        """Per analysis image: one unablated forward, and for each target a forward from its block on (the blocks
        before it are not recomputed): (L - block) / L of a whole forward. The means and the k-NN bank come from the
        suite's shared passes."""
        model = unwrap(ctx.model)
        blocks = list(ctx.blocks)
        targets = parse_targets(opts.targets, ctx.arch, blocks, [model.get_submodule(b) for b in blocks], ctx.prefix)
        L = max(len(blocks), 1)
        return {"forwards": n_images * (1 + sum((L - t.block) / L for t in targets)), "backwards": 0.0}

    def __init__(self, ctx: Context, opts=None):
        super().__init__(ctx, opts)
        self.model = unwrap(ctx.model)
        self.blocks = list(ctx.blocks)
        self.mods = [self.model.get_submodule(b) for b in self.blocks]
        self.targets = parse_targets(self.opts.targets, ctx.arch, self.blocks, self.mods, ctx.prefix)
        if not self.targets:
            raise MeasureError(
                f"ablation targets {', '.join(map(str, self.opts.targets))} name nothing this {ctx.arch} has "
                f"(a {ctx.arch} has {', '.join(f for f, k in FAMILIES[ctx.arch].items() if k)})."
            )
        self.classifier = self.model.get_classifier()
        self.sites = self._sites()
        self.sums: dict[str, torch.Tensor] = {}
        self.count = 0
        self.bank_parts: list = []

    # ------------------------------------------------------------------ which activations are replaced by what

    def _replaces(self, t: Target) -> bool:
        """Whether target ``t`` needs unablated values (not zero: ``replace`` is not zero, and a skip is not
        removed)."""
        return self.opts.replace != "zero" and not (t.kind in SKIP_KINDS and self.opts.skip == "remove")

    def _sites(self) -> list[tuple[int, str]]:
        """(block index, tap kind) of every activation whose unablated values some target is replaced with."""
        return sorted({(t.block, s) for t in self.targets if self._replaces(t) for s in SITES[t.kind]})

    def _tap(self, b: int, site: str) -> str:
        return f"{self.blocks[b]}.{site}"

    # ------------------------------------------------------------------ the first pass: means; the bank

    def taps(self) -> set[str]:
        return {self._tap(b, s) for b, s in self.sites} if self.opts.replace == "mean" else set()

    def update(self, j, cap, x, y) -> None:
        if self.opts.replace != "mean":  # the suite calls every measure on its pass
            return
        for b, s in self.sites:
            part = cap[self._tap(b, s)].sum(0, dtype=torch.float64).cpu()  # beside the CPU count in one all-reduce
            key = f"{b}|{s}"
            self.sums[key] = self.sums[key] + part if key in self.sums else part
        self.count += x.shape[0]

    def _use_knn(self) -> bool:
        probe = getattr(self.ctx.data, "probe_train", None)
        return bool(self.opts.knn and probe is not None and len(probe) > 0 and bool((probe.labels >= 0).all()))

    def probe_taps(self) -> set[str]:
        return {f"{self.blocks[-1]}.out"} if self._use_knn() else set()

    def update_probe(self, j, cap, x, y) -> None:
        feats = self._final_features(cap[f"{self.blocks[-1]}.out"], x[:1])
        self.bank_parts.append((int(j), {"f": feats.float().cpu()}, y.detach().cpu().long()))

    def _final_features(self, last_out: torch.Tensor, dummy: torch.Tensor) -> torch.Tensor:
        """The classifier's input (the final pooled representation) for the last block's output ``last_out``: the
        model's own forward on one dummy image with the last block's output replaced (a forward hook)."""
        got = {}
        with _Hooks() as h:
            h.post(self.mods[-1], lambda mod, args, out: last_out)
            h.pre(self.classifier, lambda mod, args: got.__setitem__("f", args[0]))
            self.model(dummy)
        return got["f"]

    def _means(self) -> dict[tuple[int, str], torch.Tensor]:
        if self.opts.replace != "mean" or not self.sites:
            return {}
        state = (
            {"sums": self.sums, "count": torch.tensor([float(self.count)], dtype=torch.float64)} if self.count else None
        )
        state = all_reduce_tree(state, self.ctx.accelerator)
        if state is None or float(state["count"][0]) == 0:
            raise RuntimeError(
                "ablation: mean replacement without a pass over the analysis images (run it through the suite)."
            )
        n = float(state["count"][0])
        return {
            (int(k.split("|")[0]), k.split("|")[1]): (v / n).float().to(self.ctx.device)
            for k, v in state["sums"].items()
        }

    # ------------------------------------------------------------------ the ablation passes

    def finish(self) -> dict:
        with torch.no_grad():
            return self._finish()

    def _finish(self) -> dict:
        ctx, acc = self.ctx, self.ctx.accelerator
        self.means = self._means()
        bank = None
        if self._use_knn():
            feats, bank_y = collect(self.bank_parts, acc)
            bank = (feats["f"].to(ctx.device), bank_y.to(ctx.device))
        split = ctx.data.analysis
        labels = split.labels
        nc = int(getattr(ctx.data, "num_classes", 0) or (int(labels.max()) + 1 if len(labels) else 1))
        self.logit_readout = (
            (getattr(self.model, "num_classes", 0) or 0) > 0
            and bool((labels >= 0).all())
            and int(labels.max()) < int(self.model.num_classes)
        )
        self.bank, self.nc = bank, max(nc, int(bank[1].max()) + 1 if bank is not None else 0)
        n_t, n_l = len(self.targets), len(self.blocks)
        z = lambda *s: torch.zeros(*s, dtype=torch.float64)  # noqa: E731
        st = {
            "correct": z(n_t),
            "loss": z(n_t),
            "knn": z(n_t),
            "xy": z(n_t, n_l),
            "xx": z(n_t, n_l),
            "yy": z(n_t, n_l),
            "clean": z(4),
        }  # clean: correct, loss, knn correct, images
        mb = ctx.minibatches  # the suite's minibatches: the CKA read-out is a minibatch estimator
        mine = list(mb.mine(acc))
        plans = [self._plan(len(mb.rows(j))) for j in mine]
        # one tick per target and minibatch (the front end's bar, analysis.engine.measure.Context.bar)
        total = sum(len(members) for plan in plans for _, _, members in plan)
        bar = ctx.bar(total, f"ablation: {len(self.targets)} targets x {len(mine)} minibatches", "target")
        try:
            for j, plan in zip(mine, plans):
                x = ctx.data.normalize(mb.take(split.images, j).to(ctx.device))
                y = mb.take(labels, j).to(ctx.device)
                self._minibatch(j, x, y, plan, st, bar)
        finally:
            bar.close()
        st = all_reduce_tree(st, acc)
        return self._result(st)

    def _plan(self, b: int) -> list[tuple[int, bool, list[int]]]:
        """The forwards of one minibatch of ``b`` images: (block index, heads mode, target indices), at most
        ``forward_images`` // b targets each; heads mode: the copies start at ``attn.proj`` (module docstring)."""
        k = max(1, self.opts.forward_images // b)
        out = []
        for i in sorted({t.block for t in self.targets}):
            idx = [n for n, t in enumerate(self.targets) if t.block == i]
            heads = [n for n in idx if self.targets[n].kind == "head"]
            fast = self._heads_mode(i)
            groups = [(True, heads), (False, [n for n in idx if n not in heads])] if fast else [(False, idx)]
            for mode, members in groups:
                out += [(i, mode, members[s : s + k]) for s in range(0, len(members), k)]
        return out

    def _heads_mode(self, i: int) -> bool:
        """Whether head copies of block i may start at attn.proj: timm's Block and Attention, whose code after the
        heads' concatenation is token-wise and broadcasts over a leading copy dimension."""
        blk = self.mods[i]
        return self.ctx.arch == "vit" and isinstance(blk, Block) and type(blk.attn) is Attention

    def _minibatch(self, j: int, x: torch.Tensor, y: torch.Tensor, plan, st: dict, bar) -> None:
        model, L = self.model, len(self.blocks)
        first = min(t.block for t in self.targets)
        names = {f"{self.blocks[i]}.in" for i in {t.block for t in self.targets}}
        names |= {f"{self.blocks[i]}.proj_in" for i, heads_mode, _ in plan if heads_mode}
        if self.opts.cka:
            names |= {f"{self.blocks[i]}.out" for i in range(first, L)}
        if self.opts.replace == "resample":
            names |= {self._tap(b, s) for b, s in self.sites}
        got = {}
        with _Hooks() as h, Taps(model, sorted(names)) as cap:
            h.pre(self.classifier, lambda mod, args: got.__setitem__("f", args[0]))
            logits = model(x)
        clean = cap.captures
        self.perm = (
            resample_permutation(x.shape[0], self.opts.seed, j).to(x.device)
            if self.opts.replace == "resample"
            else None
        )
        self.ref = (
            {i: hsic_gram(clean[f"{self.blocks[i]}.out"].float()) for i in range(first, L)} if self.opts.cka else {}
        )
        for i in list(self.ref):
            clean.pop(f"{self.blocks[i]}.out", None)
        c = self._readouts(logits, got["f"], y, 1)
        st["clean"] += torch.tensor(
            [float(c[0][0]), float(c[1][0]), float(c[2][0]), float(x.shape[0])], dtype=torch.float64
        )
        for i, heads_mode, members in plan:
            logits, feats, outs = self._forward(x, i, heads_mode, [self.targets[n] for n in members], clean)
            correct, loss, knn = self._readouts(logits, feats, y, len(members))
            for c_, n in enumerate(members):
                st["correct"][n] += float(correct[c_])
                st["loss"][n] += float(loss[c_])
                st["knn"][n] += float(knn[c_])
            for jj, out in outs.items():
                g_ref, s = self.ref[jj]
                rep = out.reshape(len(members), x.shape[0], -1)
                for c_, n in enumerate(members):
                    g, _ = hsic_gram(rep[c_].float())
                    st["xy"][n, jj] += s * float((g * g_ref).sum())
                    st["xx"][n, jj] += s * float((g * g).sum())
                    st["yy"][n, jj] += s * float((g_ref * g_ref).sum())
            bar.update(len(members))

    def _value(self, i: int, site: str, like: torch.Tensor, clean: dict, skip: bool = False) -> torch.Tensor:
        """The replacement of activation ``site`` of block i for one copy, shaped like ``like`` [B, ...]: zero, the
        analysis-image mean, or another image's unablated value; 0 for a skip path that is removed."""
        if self.opts.replace == "zero" or (skip and self.opts.skip == "remove"):
            return torch.zeros_like(like)
        if self.opts.replace == "mean":
            return self.means[(i, site)].expand_as(like)
        return clean[self._tap(i, site)][self.perm]

    def _forward(self, x, i: int, heads_mode: bool, copies: list[Target], clean: dict):
        """One forward with ``copies`` ablated, copy c = target c: (logits [k B, ...], the classifier's input
        [k B, D], {block index: output [k B, ...] of every block from i on})."""
        k, blk = len(copies), self.mods[i]
        X = clean[f"{self.blocks[i]}.in"]
        B = X.shape[0]

        def view(t):
            return t.view(k, B, *t.shape[1:])

        got = {}
        with _Hooks() as h:
            if heads_mode:  # block i's attention runs on one image: proj gets the captured heads' output
                h.pre(blk, _replace_args(X))
                h.pre(blk.attn, lambda mod, args: (args[0][:1], *tuple(args[1:])))
                h.pre(blk.attn.proj, self._head_hook(i, copies, clean, B, expand=True))
                h.post(blk, lambda mod, args, out: out.reshape(k * B, *out.shape[2:]))
            else:
                start = X.repeat(k, *([1] * (X.ndim - 1)))
                for c, t in enumerate(copies):
                    if t.kind in ("cls", "spatial"):
                        p = self.ctx.prefix
                        sl = slice(0, p) if t.kind == "cls" else slice(p, None)
                        view(start)[c][:, sl] = self._value(i, "in", X, clean)[:, sl]
                h.pre(blk, _replace_args(start))
                kinds = {t.kind for t in copies}
                if "head" in kinds:
                    h.pre(blk.attn.proj, self._head_hook(i, copies, clean, B, expand=False))
                if self.ctx.arch == "vit":
                    self._vit_hooks(h, i, copies, kinds, clean, start, view)
                else:
                    self._resnet_hooks(h, i, copies, kinds, clean, start, view)
            h.pre(self.classifier, lambda mod, args: got.__setitem__("f", args[0]))
            outs = [f"{self.blocks[jj]}.out" for jj in range(i, len(self.blocks))] if self.opts.cka else []
            with Taps(self.model, outs) as cap:
                logits = self.model(x[:1])  # a dummy image: block i's input is replaced by the pre-hook
        return logits, got["f"], {self.blocks.index(n.rsplit(".", 1)[0]): v for n, v in cap.captures.items()}

    def _head_hook(self, i: int, copies: list[Target], clean: dict, B: int, expand: bool):
        """Pre-hook of attn.proj: copy c's heads replaced. ``expand`` (heads mode): the input is ignored and the
        unablated heads' output captured for the minibatch, [B, T, C], becomes [k, B, T, C]; else the input is
        already [k B, T, C]."""
        k, H = len(copies), self.mods[i].attn.num_heads

        def hook(mod, args):
            p = clean[self._tap(i, "proj_in")] if expand else args[0]
            out = p.unsqueeze(0).repeat(k, 1, 1, 1) if expand else p.clone().view(k, B, *p.shape[1:])
            v = out.view(k, B, out.shape[2], H, -1)
            for c, t in enumerate(copies):
                if t.kind == "head":
                    r = self._value(i, "proj_in", p if expand else p[c * B : (c + 1) * B], clean)
                    hs = list(t.heads)
                    v[c][:, :, hs] = r.reshape(B, r.shape[1], H, -1)[:, :, hs]
            return (out if expand else out.view(k * B, *p.shape[1:]), *tuple(args[1:]))

        return hook

    def _vit_hooks(self, h: _Hooks, i: int, copies, kinds, clean, start, view) -> None:
        blk = self.mods[i]
        if kinds & {"attn", "skip_attn", "skip"}:

            def dp1(mod, args, out):
                out = out.clone()
                v, s = view(out), view(start)
                for c, t in enumerate(copies):
                    if t.kind == "attn":
                        v[c] = self._value(i, "attn_branch", v[c], clean)
                    elif t.kind in ("skip_attn", "skip"):  # z + (f + r - z) = r + f
                        v[c] = v[c] + self._value(i, "in", v[c], clean, skip=True) - s[c]
                return out

            h.post(blk.drop_path1, dp1)
        if kinds & {"mlp", "skip_mlp", "skip"}:
            stream = {}
            h.pre(blk.norm2, lambda mod, args: stream.__setitem__("z", args[0]))

            def dp2(mod, args, out):
                out = out.clone()
                v, s = view(out), view(stream["z"])
                for c, t in enumerate(copies):
                    if t.kind == "mlp":
                        v[c] = self._value(i, "mlp_branch", v[c], clean)
                    elif t.kind in ("skip_mlp", "skip"):
                        v[c] = v[c] + self._value(i, "attn_out", v[c], clean, skip=True) - s[c]
                return out

            h.post(blk.drop_path2, dp2)

    def _resnet_hooks(self, h: _Hooks, i: int, copies, kinds, clean, start, view) -> None:
        blk = self.mods[i]
        identity = blk.downsample is None

        def branch(mod, args, out):
            out = out.clone()  # a new tensor: the block adds the shortcut to it in place
            v, s = view(out), view(start)
            for c, t in enumerate(copies):
                if t.kind == "branch":
                    v[c] = self._value(i, "branch", v[c], clean)
                elif t.kind == "shortcut" and identity:  # f + r - z, to which the block adds z
                    v[c] = v[c] + self._value(i, "shortcut", v[c], clean, skip=True) - s[c]
            return out

        h.post(branch_end(blk), branch)
        if "shortcut" in kinds and not identity:

            def shortcut(mod, args, out):
                out = out.clone()
                v = view(out)
                for c, t in enumerate(copies):
                    if t.kind == "shortcut":
                        v[c] = self._value(i, "shortcut", v[c], clean, skip=True)
                return out

            h.post(blk.downsample, shortcut)

    def _readouts(self, logits, feats, y, k: int):
        """Per copy: (correct, summed cross-entropy, k-NN correct), each [k] float64 on CPU (0 where undefined)."""
        B = y.shape[0]
        zeros = torch.zeros(k, dtype=torch.float64)
        correct, loss, knn = zeros, zeros.clone(), zeros.clone()
        if self.logit_readout:
            lg = logits.float().reshape(k, B, -1)
            correct = (lg.argmax(-1) == y).sum(-1).double().cpu()
            loss = (
                F.cross_entropy(lg.reshape(k * B, -1), y.repeat(k), reduction="none")
                .reshape(k, B)
                .double()
                .sum(-1)
                .cpu()
            )
        if self.bank is not None:
            pred = knn_predict(self.bank[0], self.bank[1], feats.reshape(k * B, -1), K, TEMPERATURE, self.nc)
            knn = (pred.reshape(k, B) == y).sum(-1).double().cpu()
        return correct, loss, knn

    def _result(self, st: dict) -> dict:
        n = float(st["clean"][3])
        nan = float("nan")
        cls_ok, knn_ok = self.logit_readout, self.bank is not None
        top1 = (st["correct"] / n).numpy() if cls_ok else np.full(len(self.targets), nan)
        loss = (st["loss"] / n).numpy() if cls_ok else np.full(len(self.targets), nan)
        knn = (st["knn"] / n).numpy() if knn_ok else np.full(len(self.targets), nan)
        c_top1 = float(st["clean"][0]) / n if cls_ok else nan
        c_loss = float(st["clean"][1]) / n if cls_ok else nan
        c_knn = float(st["clean"][2]) / n if knn_ok else nan
        cka = np.full((len(self.targets), len(self.blocks)), nan)
        if self.opts.cka:
            xy, xx, yy = st["xy"].numpy(), st["xx"].numpy(), st["yy"].numpy()
            with np.errstate(
                invalid="ignore", divide="ignore"
            ):  # a constant representation (everything replaced) has none
                for n_, t in enumerate(self.targets):
                    j = slice(t.block, None)
                    cka[n_, j] = xy[n_, j] / np.sqrt(xx[n_, j] * yy[n_, j])
        return {
            "targets": [t.name(self.blocks) for t in self.targets],
            "kinds": [t.kind for t in self.targets],
            "target_block": np.array([t.block for t in self.targets], dtype=np.int64),
            "heads": ["+".join(map(str, t.heads)) for t in self.targets],
            "top1": top1,
            "loss": loss,
            "knn_top1": knn,
            "top1_drop": c_top1 - top1,
            "loss_increase": loss - c_loss,
            "knn_drop": c_knn - knn,
            "cka": cka,
            "clean_top1": c_top1,
            "clean_loss": c_loss,
            "clean_knn_top1": c_knn,
            "blocks": list(self.blocks),
            "num_heads": int(self.mods[0].attn.num_heads) if self.ctx.arch == "vit" else 0,
            "replace": self.opts.replace,
            "skip": self.opts.skip,
            "n_images": int(n),
            "n_bank": len(self.bank[1]) if knn_ok else 0,
        }

    # ------------------------------------------------------------------ key numbers, scalars, figures

    @staticmethod
    def summary(r: dict) -> dict:
        metric, label = readout(r)
        out = {
            "replace": str(np.asarray(r["replace"])),
            "skip": str(np.asarray(r["skip"])),
            "readout": label,
            "clean": {"top1": _f(r["clean_top1"]), "loss": _f(r["clean_loss"]), "knn_top1": _f(r["clean_knn_top1"])},
        }
        hm = head_map(r, metric)
        if hm is not None and np.isfinite(hm).any():
            b, h = np.unravel_index(np.nanargmax(hm), hm.shape)
            out["heads_drop"] = [[_f(v) for v in row] for row in hm]
            out["most_important_head"] = {"block": int(b), "head": int(h), "drop": _f(hm[b, h])}
        for kind, v in per_block(r, metric).items():
            out[f"{kind}_drop"] = [_f(a) for a in v]
        return out

    @staticmethod
    def scalars(r: dict) -> dict[str, float]:
        metric, label = readout(r)
        out = {
            f"ablation/clean/{k}": _f(r[f"clean_{k}"])
            for k in ("top1", "loss", "knn_top1")
            if np.isfinite(_f(r[f"clean_{k}"]))
        }
        for kind, v in per_block(r, metric).items():
            out.update({f"ablation/{label}/{kind}/{block_tag(b)}": _f(a) for b, a in enumerate(v) if np.isfinite(a)})
        hm = head_map(r, metric)
        if hm is not None:
            out.update(
                {
                    f"ablation/{label}/head_max/{block_tag(b)}": _f(np.nanmax(row))
                    for b, row in enumerate(hm)
                    if np.isfinite(row).any()
                }
            )
        return out

    @staticmethod
    def figures(r: dict, step: int | None = None) -> dict:
        sfx = "" if step is None else f" (step {step})"
        metric, label = readout(r)
        figs = {}
        hm = head_map(r, metric)
        if hm is not None and np.isfinite(hm).any():
            figs["ablation/heads"] = head_importance_map(
                hm, r, label, f"Head importance: {_NAMES[label]} when one head is {_how(r)}-ablated{sfx}"
            )
        if per_block(r, metric):
            figs["ablation/sublayers"] = sublayer_plot(
                r,
                metric,
                label,
                "Sublayer, skip-path and token-path importance per block, "
                f"removed at test time (cf. Raghu Fig. 7, 8){sfx}",
            )
        cka_fig = skip_cka_map(r, sfx)
        if cka_fig is not None:
            figs["ablation/skip_cka"] = cka_fig
        return figs


# ---------------------------------------------------------------------------------------------------- read-outs


def _f(v) -> float:
    return float(np.asarray(v))


def _how(r: dict) -> str:
    return str(np.asarray(r["replace"]))


def readout(r: dict) -> tuple[np.ndarray, str]:
    """The read-out the importance figures and key numbers use: top-1 drop where the model has a classifier (and the
    images labels), else the k-NN top-1 drop, else the loss increase; (values [N], its name)."""
    for key in ("top1_drop", "knn_drop", "loss_increase"):
        v = np.asarray(r[key], dtype=float)
        if np.isfinite(v).any():
            return v, key
    return np.asarray(r["top1_drop"], dtype=float), "top1_drop"


def head_map(r: dict, metric: np.ndarray) -> np.ndarray | None:
    """[L, H] of ``metric`` for the single-head targets (NaN where a head was not ablated), or None without heads."""
    kinds, heads, blocks = as_list(r["kinds"]), as_list(r["heads"]), np.asarray(r["target_block"])
    nh = int(np.asarray(r["num_heads"]))
    rows = [n for n, k in enumerate(kinds) if k == "head" and "+" not in heads[n]]
    if not rows or nh == 0:
        return None
    m = np.full((len(as_list(r["blocks"])), nh), np.nan)
    for n in rows:
        m[int(blocks[n]), int(heads[n])] = metric[n]
    return m


def per_block(r: dict, metric: np.ndarray) -> dict[str, np.ndarray]:
    """{kind: [L] values per block} of every kind but heads (NaN where a block has no such target)."""
    kinds, blocks = as_list(r["kinds"]), np.asarray(r["target_block"])
    out = {}
    for kind in dict.fromkeys(k for k in kinds if k != "head"):
        v = np.full(len(as_list(r["blocks"])), np.nan)
        for n, k in enumerate(kinds):
            if k == kind:
                v[int(blocks[n])] = metric[n]
        out[kind] = v
    return out


# ---------------------------------------------------------------------------------------------------- figures

_LABELS = {
    "attn": "attention branch",
    "mlp": "MLP branch",
    "skip": "skip paths removed (x = f(norm(x)))",
    "skip_attn": "attention skip path",
    "skip_mlp": "MLP skip path",
    "cls": "CLS (prefix) tokens at block input",
    "spatial": "spatial tokens at block input",
    "branch": "residual branch",
    "shortcut": "shortcut (skip path)",
}
_UNITS = {
    "top1_drop": "top-1 drop (fraction of images)",
    "knn_drop": "k-NN top-1 drop (fraction of images)",
    "loss_increase": "loss increase (nats)",
}
_NAMES = {"top1_drop": "top-1 drop", "knn_drop": "k-NN top-1 drop", "loss_increase": "loss increase"}


def _scale(label: str) -> float:
    """Drawn as stored: top-1 as a fraction (as every accuracy in the summaries and reports), loss in nats."""
    return 1.0


def head_importance_map(hm: np.ndarray, r: dict, label: str, title: str):
    """Blocks (rows, block 0 at the top) x heads (columns): the read-out's drop when that head alone is ablated,
    each cell annotated; a diverging colour scale centred on 0 (red: the model gets worse)."""
    m = hm * _scale(label)
    nb, nh = m.shape
    fig, ax = subplots(figsize=(max(4.2, 1.0 + 0.6 * nh + 1.4), 1.6 + 0.4 * nb), layout="constrained")
    lim = float(np.nanmax(np.abs(m))) if np.isfinite(m).any() else 1.0
    im = ax.imshow(m, cmap="RdBu_r", vmin=-lim or -1, vmax=lim or 1, aspect="auto")
    cb = fig.colorbar(im, ax=ax, fraction=0.046)
    cb.set_label(_UNITS[label])
    for b in range(nb):
        for hh in range(nh):
            if np.isfinite(m[b, hh]):
                ax.text(
                    hh,
                    b,
                    f"{m[b, hh]:.3f}",
                    ha="center",
                    va="center",
                    fontsize=6,
                    color="white" if abs(m[b, hh]) > 0.6 * (lim or 1) else "black",  # readable on the dark ends
                )
    ax.set_xticks(range(nh))
    ax.set_yticks(range(nb), [f"block {b}" for b in range(nb)], fontsize=7)
    ax.set_xlabel("head")
    ax.set_ylabel("block")
    clean = (
        _f(r["clean_top1"])
        if label == "top1_drop"
        else _f(r["clean_knn_top1"])
        if label == "knn_drop"
        else _f(r["clean_loss"])
    )
    chars = int(0.65 * fig.get_figwidth() * 72 / (8 * 0.55))  # 8-pt characters across the axes (not the colourbar)
    ax.set_title(
        wrap(title, chars) + f"\n(unablated {'loss' if label == 'loss_increase' else 'top-1'} "
        f"{clean:.3f}{' nats' if label == 'loss_increase' else ''}, {int(np.asarray(r['n_images']))} images)",
        fontsize=8,
    )
    return fig


def sublayer_plot(r: dict, metric: np.ndarray, label: str, title: str):
    """Left: the read-out's drop per block for each branch, skip-path and token-path target (cf. Raghu Fig. 7's
    skip-vs-branch norm ratios and Fig. 8's no-skip blocks, here as test-time removals); right: CKA of the LAST
    block's output with the unablated model's after each of those ablations."""
    blocks = as_list(r["blocks"])
    fig, axes = subplots(1, 2, figsize=(10, 4.4), layout="constrained")
    curves = per_block(r, metric)
    cka_last = per_block(r, np.asarray(r["cka"], dtype=float)[:, -1])
    for kind, v in curves.items():
        ls = "--" if kind.startswith("skip") or kind == "shortcut" else ":" if kind in ("cls", "spatial") else "-"
        (line,) = axes[0].plot(range(len(v)), v * _scale(label), marker="o", ms=3, ls=ls, label=_LABELS.get(kind, kind))
        axes[1].plot(
            range(len(v)),
            cka_last[kind],
            marker="o",
            ms=3,
            ls=ls,
            color=line.get_color(),
            label=_LABELS.get(kind, kind),
        )
    axes[0].axhline(0, color="grey", lw=0.6)
    finish_block_axes(
        fig,
        axes[0],
        blocks,
        _UNITS[label],
        f"{_how(r)}-ablation (skip paths: {np.asarray(r['skip'])!s}): {_NAMES[label]}",
        legend=False,
    )
    finish_block_axes(
        fig,
        axes[1],
        blocks,
        "CKA(last block, unablated last block)",
        "representation kept at the last block",
        ylim=(-0.05, 1.05),
        legend=False,
    )
    # one legend for both panels, below them, where it covers no line
    fig.legend(*axes[0].get_legend_handles_labels(), loc="outside lower center", ncols=4, fontsize=7, frameon=False)
    fig.suptitle(title, fontsize=9)
    return fig


def skip_cka_map(r: dict, sfx: str = ""):
    """Rows: the block whose skip paths were removed (ViT ``skip``, ResNet ``shortcut``); columns: every block's
    output; colour: its CKA with the unablated model's same block (NaN, blank, before the removal). The test-time
    counterpart of Raghu Fig. 8's partition of the representations at a no-skip block."""
    kinds = as_list(r["kinds"])
    kind = "skip" if "skip" in kinds else "shortcut" if "shortcut" in kinds else None
    if kind is None:
        return None
    rows = [n for n, k in enumerate(kinds) if k == kind]
    blocks = as_list(r["blocks"])
    m = np.asarray(r["cka"], dtype=float)[rows]
    fig, ax = subplots(figsize=(5.2, 4.2))
    im = ax.imshow(m, vmin=0, vmax=1, cmap="magma", aspect="auto")
    cb = fig.colorbar(im, ax=ax, fraction=0.046)
    cb.set_label("CKA to the unablated model")
    step = max(1, len(blocks) // 12)
    ax.set_xticks(range(0, len(blocks), step), blocks[::step], rotation=90, fontsize=6)
    ax.set_yticks(range(len(rows)), [blocks[int(np.asarray(r["target_block"])[n])] for n in rows], fontsize=6)
    ax.set_xlabel("output of block")
    ax.set_ylabel("skip path removed at block" if kind == "skip" else "shortcut ablated at block")
    ax.set_title(
        f"CKA to the unablated model after removing one block's skip path{sfx}\n(test-time counterpart of Raghu Fig. "
        "8)",
        fontsize=8,
    )
    fig.tight_layout()
    return fig
