"""The per-image reads the real-ViT claims decide over: one forward per minibatch through the project's taps, per-image
statistics of each measure the claims need, and the heads chosen on the probe-train crops (:func:`image_context`)."""

from __future__ import annotations

import numpy as np
import torch

from analysis.engine import suite as S
from analysis.engine.taps import Taps, block_names, grid_of, num_prefix_tokens
from analysis.measures.aligned_attention import MAX_OFFSET, MIN_MASS, WINDOW, offset_local_heads
from analysis.measures.attention_distance import grid_distances
from analysis.studies.locality import uniform_distance
from analysis.studies.real_vit.claims import ImageContext, halves, photo_split


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
                             attention, averaged over spatial queries, on the keys within ``WINDOW`` tokens of
                             query + (dr, dc) (aligned_attention's window mass, per image)."""
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
        d, gaps, cls_in = _batch_reads(cap.captures, blocks, p, dist)
        wm = _window_reads(cap.captures, blocks, p, keys, masks)
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


def _batch_reads(c: dict, blocks: list, p: int, dist: torch.Tensor) -> tuple[list, list, list]:
    """One minibatch's captures -> per block: each head's attention distance [B, H], the CLS-minus-spatial log norm
    ratio gaps [B, 2] and the CLS token's skip inputs [B, 2, D]."""
    d, gaps, cls_in = [], [], []
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
    return d, gaps, cls_in


def _window_reads(c: dict, blocks: list, p: int, keys: list, masks: list) -> list:
    """One minibatch's attention mass [B] in each window of ``keys``."""
    wm = []
    for (blk, head, _off), m in zip(keys, masks):
        a = c[f"{blocks[blk]}.attn_probs"][:, head, p:, p:].float()
        a = a / a.sum(-1, keepdim=True).clamp_min(1e-12)
        wm.append((a * m).sum(-1).mean(-1))
    return wm


def _window_masks(grid, keys) -> list[torch.Tensor]:
    """[Q, K] float masks: key k within WINDOW tokens (Chebyshev) of query q + (dr, dc)."""
    gh, gw = grid
    rc = torch.stack(torch.meshgrid(torch.arange(gh), torch.arange(gw), indexing="ij"), -1).reshape(-1, 2)
    rel = rc[None, :, :] - rc[:, None, :]  # [Q, K, 2]: key minus query
    return [((rel - torch.tensor(off)).abs().amax(-1) <= WINDOW).float() for (_b, _h, off) in keys]


def offset_windows(probe_mass: np.ndarray, offset: np.ndarray, peaks: np.ndarray) -> dict:
    """The windows to test, chosen on the probe crops' aligned_attention: per half of the blocks, the offset-local head
    with the most mass in its window (first half), and the head of the second half with the most mass in an offset
    window at most MAX_OFFSET away (whether or not it passes)."""
    L = probe_mass.shape[0]
    lo, hi = halves(L)
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


def probe_windows(model, data, rows=None) -> dict:
    """The offset windows chosen (:func:`offset_windows`) on aligned_attention over ``data``'s probe-train crops, only
    the crops ``rows`` [M] bool when given (the selection photos')."""
    from train.splits import TensorBatches

    probe = data.probe_train
    if rows is not None:
        keep = torch.from_numpy(np.flatnonzero(rows))
        probe = TensorBatches(probe.images[keep], probe.labels[keep])
    probe_data = type(data)(probe, probe, data.num_classes, data.class_names, data.mean, data.std)
    aligned = S.run_suite(model, probe_data, S.suite_options(["aligned_attention"], 32))["aligned_attention"]
    pcls = offset_local_heads(aligned["mass_maps"], MAX_OFFSET, MIN_MASS, WINDOW)
    return offset_windows(pcls["peak_mass"], pcls["offset_local"], pcls["peak_offset"])


def image_context(model, data, batch: int = 16) -> ImageContext:
    """The claims' per-image statistics of ``model`` on ``data``: heads chosen on the probe-train crops (their own
    attention distances, and the offset windows from aligned_attention on them), tested on the analysis views; with the
    analysis views' independent units (``data.groups``: for the bundled photos, each view's photo), the population
    they stand for and what the heads were chosen on (for the bundled photos: other crops of the same photos). When
    the probe crops are crops of the analysis photos (``data.probe_groups``), the offset windows are also chosen on
    the selection photos' probe crops alone (``chosen_split``, :func:`~.claims.photo_split`), and the analysis views'
    window mass is read for both choices."""
    grid, patch = tuple(grid_of(model)), int(model.patch_embed.patch_size[0])
    probe = per_image(model, data.probe_train, data.normalize, batch)
    chosen = probe_windows(model, data)
    groups, probe_groups = getattr(data, "groups", None), getattr(data, "probe_groups", None)
    photos = groups if groups is not None and probe_groups is not None else None
    chosen_split = {}
    if photos is not None:
        chosen_split = probe_windows(model, data, np.isin(probe_groups, photo_split(photos)[0]))
    windows = list(dict.fromkeys([*chosen.values(), *chosen_split.values()]))
    pi = per_image(model, data.analysis, data.normalize, batch, windows=windows)
    return ImageContext(
        distance=pi["distance"],
        probe_distance=probe["distance"],
        uniform=uniform_distance(grid[0], patch),
        log_gap=pi["log_gap"],
        cls_input_spread=pi["cls_input_spread"],
        window_mass=pi["window_mass"],
        windows=pi["windows"],
        chosen=chosen,
        groups=groups,
        probe_groups=probe_groups,
        population=getattr(data, "population", "") or f"these {len(data.analysis)} images",
        chosen_on=getattr(data, "meta", {}).get("probe", "the probe-train images"),
        photos=photos,
        chosen_split=chosen_split,
    )
