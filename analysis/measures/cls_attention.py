"""``cls_attention`` -- average CLS attention maps (Walmer Fig. 2 / 17), ViTs with a class token only.
For image b, head h, the CLS query's row over the SPATIAL keys, prefix columns dropped and the row renormalised:

    c[b, h, k] = A[b, h, 0, p + k] / sum_{k'} A[b, h, 0, p + k'],   k = 0 .. N-1

reshaped to the token grid. ``maps`` [L, H, gh, gw] is the mean of c over images. Walmer's code
(vit_analysis, ``AvgAttentionOnToken(mode='cls')`` + ``token_plot``) averages the raw row A[b, h, 0, :] and drops
the CLS entry only when drawing, WITHOUT renormalising; that version is kept as ``maps_raw`` (mean of
A[b, h, 0, p + k]) together with ``prefix_mass`` (mean of the CLS row's mass on prefix tokens, 1 - sum(maps_raw)).
The two differ by the per-image factor 1 / (1 - prefix mass). Entropies (nats, 0 log 0 = 0):
``entropy`` [L, H] = mean over images of H(c[b, h]) (how peaked one image's CLS attention is);
``map_entropy`` [L, H] = H(maps[l, h]) (how spread the AVERAGE map is; low for a head that looks at the same
place in every image, e.g. the "sparse repeating patterns" of Walmer §4.1). Both are at most log N
(``max_entropy``). An image whose CLS row has no spatial mass (only with hand-built attention) is left out.
"""

from __future__ import annotations

import math

import numpy as np
import torch
from torch import Tensor

from analysis.engine.measure import Context, as_list, register
from analysis.estimators.attention_maps import BlockSums, block_label, check, entropy, map_grid, renormalise
from analysis.estimators.features import has_class_token


def cls_attention_sums(attn: Tensor, num_prefix_tokens: int) -> dict[str, Tensor]:
    """Per-head sums over the images of ``attn`` [B, H, T, T] (float64, on attn's device): ``rows`` [H, N] of the
    renormalised CLS row over spatial keys, ``raw`` [H, N] of the raw row, ``prefix`` [H] of the CLS row's prefix mass,
    ``entropy`` [H] of the per-image entropies, ``count`` [H] of images with spatial mass (``raw``/``prefix`` count
    every image: ``images``)."""
    p = num_prefix_tokens
    if p < 1:
        raise ValueError("CLS attention needs a class token (num_prefix_tokens >= 1)")
    raw = attn[:, :, 0, :].double()  # [B, H, T]
    rows, valid = renormalise(raw[..., p:])
    return {
        "rows": rows.sum(0),
        "raw": raw[..., p:].sum(0),
        "prefix": raw[..., :p].sum((0, 2)),
        "entropy": torch.where(valid, entropy(rows), torch.zeros_like(valid, dtype=torch.float64)).sum(0),
        "count": valid.sum(0).double(),
        "images": torch.full((attn.shape[1],), float(attn.shape[0]), dtype=torch.float64, device=attn.device),
    }


def cls_attention_maps(attn: Tensor, grid: tuple[int, int], num_prefix_tokens: int = 1) -> dict[str, Tensor]:
    """The definition on one set of images (module docstring): ``maps`` [H, gh, gw], ``maps_raw`` [H, gh, gw],
    ``prefix_mass`` [H], ``entropy`` [H] (mean per-image entropy), ``map_entropy`` [H] (entropy of ``maps``)."""
    check(attn, grid, num_prefix_tokens)
    s = cls_attention_sums(attn.detach(), num_prefix_tokens)
    return {k: v[0] for k, v in _cls_finish({k: v[None] for k, v in s.items()}, grid).items()}


def _cls_finish(s: dict[str, Tensor], grid: tuple[int, int]) -> dict[str, Tensor]:
    """Sums with a leading block axis [L, H, ...] -> means."""
    count, images = s["count"], s["images"]
    maps = s["rows"] / count[..., None]
    lead = maps.shape[:-1]
    return {
        "maps": maps.reshape(*lead, *grid),
        "maps_raw": (s["raw"] / images[..., None]).reshape(*lead, *grid),
        "prefix_mass": s["prefix"] / images,
        "entropy": s["entropy"] / count,
        "map_entropy": entropy(maps),
    }


@register
class ClsAttention(BlockSums):
    """Where the class token looks: the average CLS attention map of every head of every block.
    Walmer et al. 2023 §4.1, Fig. 2 and 17.

    ``maps`` [L, H, gh, gw]: mean over images of the CLS query's attention over the spatial keys, prefix (CLS,
    register) columns dropped and the row renormalised to sum to 1 (Walmer does not renormalise: his version is
    ``maps_raw``). Also ``maps_raw`` [L, H, gh, gw], ``prefix_mass`` [L, H], ``entropy`` [L, H] (mean per-image entropy
    of the renormalised row, nats), ``map_entropy`` [L, H] (entropy of the average map), ``max_entropy`` (log N),
    ``blocks`` [L], ``grid`` [2], ``n_images``. Only for ViTs with a class token. Exact definitions: module docstring.
    """

    name = "cls_attention"

    @classmethod
    def applies(cls, ctx: Context) -> bool:
        return ctx.arch == "vit" and ctx.prefix >= 1 and ctx.grid is not None and has_class_token(ctx.model, ctx.prefix)

    def _sums(self, attn: Tensor) -> dict[str, Tensor]:
        return cls_attention_sums(attn, self.prefix)

    def finish(self) -> dict:
        out = self._reduced()
        res = _cls_finish(out, self.grid)
        r = {k: v.numpy() for k, v in res.items()}
        r.update(
            max_entropy=float(math.log(self.grid[0] * self.grid[1])),
            blocks=list(self.blocks),
            grid=np.array(self.grid),
            n_images=int(out["images"][0, 0].item()),
        )
        return r

    @staticmethod
    def summary(r: dict) -> dict:
        blocks = as_list(r["blocks"])
        ent, ment = np.asarray(r["entropy"]), np.asarray(r["map_entropy"])
        return {
            "max_entropy": float(r["max_entropy"]),
            "n_images": int(r["n_images"]),
            "entropy_per_block": {block_label(b, i): float(ent[i].mean()) for i, b in enumerate(blocks)},
            "map_entropy_per_block": {block_label(b, i): float(ment[i].mean()) for i, b in enumerate(blocks)},
            "prefix_mass_per_block": {
                block_label(b, i): float(np.asarray(r["prefix_mass"])[i].mean()) for i, b in enumerate(blocks)
            },
        }

    @staticmethod
    def scalars(r: dict) -> dict[str, float]:
        blocks = as_list(r["blocks"])
        ent, ment = np.asarray(r["entropy"]), np.asarray(r["map_entropy"])
        out = {}
        for i, b in enumerate(blocks):
            lab = block_label(b, i)
            out[f"cls_attention/entropy/{lab}"] = float(ent[i].mean())
            out[f"cls_attention/map_entropy/{lab}"] = float(ment[i].mean())
        return out

    @staticmethod
    def figures(r: dict, step: int | None = None) -> dict:
        title = "average CLS attention (renormalised over spatial keys)" + (
            f", step {step}" if step is not None else ""
        )
        m = np.asarray(r["maps"])  # [L, H, gh, gw], each map sums to 1 over the spatial keys
        title += "; dotted on the scale: uniform attention"
        maps = map_grid(
            m, as_list(r["blocks"]), title, scale_label="CLS attention weight", uniform=1.0 / (m.shape[2] * m.shape[3])
        )
        return {"cls_attention/maps": maps}
