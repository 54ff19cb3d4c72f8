"""The positive control of the outlier detector, on the study's own trained models.

"No outliers at this budget" is a claim about the models only if the detector finds outliers where there are some.
So each register-free run's last checkpoint is analysed once more with one spatial token made an outlier by hand: a
forward hook rescales the middle block's output at the grid's centre token to ``factor`` times its image's median
spatial-token norm, in every image (10x: the norm ratio of Darcet et al.'s outliers; 5x: just above token_norms'
k = 4), and token_norms runs on the same analysis images with the study's options (its position probe off: the control
needs the counts and the map only).
The detector passes when it finds that token in every image at that block, at that place (the outliers per image
are shown beside: 1 where the untouched block has none).
The numbers are cached in the study folder like the other report-stage analyses.
"""

from __future__ import annotations

import numpy as np

from analysis.engine import suite as S
from analysis.engine.measure import options_dict
from analysis.results import storage
from analysis.sources import models as MS

FACTORS = (10.0, 5.0)  # Darcet's outliers are ~10x the other tokens; 5x sits just above token_norms' k = 4


def planted(run, study) -> dict:
    """token_norms of ``run``'s last checkpoint with the middle block's centre token rescaled to each of
    :data:`FACTORS` times its image's median spatial-token norm: ``{"block": b, "position": [row, col], "grid":
    [gh, gw], "clean": {...}, "10": {...}, ...}`` where each entry holds, at block b, the share of images with an
    outlier, the outliers per image and the share of images whose outlier is at the planted position."""
    step = max(run.checkpoints)
    base = study.suite_options(["token_norms"])
    tn = {**options_dict(base.of("token_norms")), "probe_images": 0}
    opts = S.suite_options(["token_norms"], base.batch_size, {"token_norms": tn})
    key = storage.cache_key(
        f"{MS.weights_key(run, step)}:planted-outlier:{FACTORS}",
        MS.fingerprint(run),
        opts.settings("token_norms"),
        "registers_control",
    )
    return storage.json_cached(study.root / "registers_control.json", key, lambda: _plant(run, step, opts))


def _plant(run, step: int, opts) -> dict:
    """What :func:`planted` caches: the untouched and the planted token_norms at the middle block."""
    data = MS.load_data(run)
    model = MS.load_model(run, step, data).eval()
    gh, gw = model.patch_embed.grid_size
    b, row, col = len(model.blocks) // 2, gh // 2, gw // 2
    index = model.num_prefix_tokens + row * gw + col
    out = {"block": b, "position": [row, col], "grid": [gh, gw], "step": step}

    def at(res) -> dict:
        r = res["token_norms"]
        return {
            "share_images": float(r["share_images"][b]),
            "count": float(r["count"][b]),
            "at_position": float(np.asarray(r["outlier_map"])[b][row, col]),
        }

    out["clean"] = at(S.run_suite(model, data, opts))
    for factor in FACTORS:

        def hook(mod, args, y, factor=factor):
            y = y.clone()
            norms = y[:, model.num_prefix_tokens :].norm(dim=-1)  # [B, N] the spatial tokens
            target = factor * norms.median(dim=1).values  # the rule's reference: the image's median
            y[:, index] *= (target / y[:, index].norm(dim=-1)).unsqueeze(-1)
            return y

        h = model.blocks[b].register_forward_hook(hook)
        try:
            out[f"{factor:g}"] = at(S.run_suite(model, data, opts))
        finally:
            h.remove()
    return out


def passed(entry: dict) -> bool:
    """The planted token is found in every image, at its place."""
    return entry["share_images"] == 1.0 and entry["at_position"] == 1.0


def control_section(ctx) -> None:
    """The report's table of the positive control (every register-free run), and its outcome in ``ctx.doc.data``."""
    runs = ctx.configs.get("vit_reg0") or []
    if not runs:
        return
    rows = {r.name: planted(r, ctx.study) for r in runs}
    first = next(iter(rows.values()))
    gh, gw = first["grid"]
    ctx.doc.add(
        "## Positive control: does the detector find an outlier that is there?",
        "",
        f"Each register-free run's last checkpoint once more, with one token made an outlier by hand: the output of "
        f"block {first['block']} at grid position {tuple(first['position'])} of the {gh}x{gw} grid rescaled to "
        f"{' or '.join(f'{x:g}' for x in FACTORS)} times its image's median token norm, in every image (10x is the "
        "norm ratio of Darcet et al.'s outliers; "
        "token_norms calls a token an outlier above 4x its image's median). The detector passes when it finds that "
        "token in every image, at its place.",
        "",
        "| run | block | untouched: share of images with an outlier | "
        + " | ".join(f"{x:g}x planted: share / outliers per image / at its place" for x in FACTORS)
        + " | passed |",
        "| --- | --- | --- | " + " | ".join("---" for _ in FACTORS) + " | --- |",
    )
    ok = True
    for name, e in rows.items():
        planted_ = [e[f"{x:g}"] for x in FACTORS]
        cells = [f"{p['share_images']:.3f} / {p['count']:.2f} / {p['at_position']:.3f}" for p in planted_]
        good = all(passed(p) for p in planted_)
        ok &= good
        ctx.doc.add(
            f"| {name} | {e['block']} | {e['clean']['share_images']:.3f} | "
            + " | ".join(cells)
            + f" | {'yes' if good else 'no'} |"
        )
    ctx.doc.add("")
    ctx.doc.data["positive_control"] = {"passed": ok, "runs": rows}
    ctx.shared["control_passed"] = ok
