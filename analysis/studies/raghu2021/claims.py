"""Raghu et al. 2021's claims (and Walmer et al. 2023's offset heads), each declared once: its text, the numbers it
reads and its rule, together. The order here is the order of the report.

Every rule is a set of parts decided by the one statistical rule (analysis/studies/claims.py, stats.py): ViT against
ResNet is Welch's t (their seed-to-seed SDs differ); configurations of the ViT family (the default ViT with one factor
changed: a skip removed, the head, the data size) share a seed SD pooled over the family's configurations; a statistic
of one configuration is a one-sample t. Preconditions make a claim "not testable" when the model is not yet the kind the
paper describes (no local head, a statistic still moving, too few blocks per half), with their numbers.

Configurations with the same seed start from the same initial weights (the trainer seeds torch before building the
model): that pairing helps the accuracy comparisons (Fig. 8's drop), and it flatters same-index CKA between
configurations, which is why Fig. 12 is read against a cross-seed ceiling (two full-data runs of different seeds).
"""

from __future__ import annotations

import numpy as np

from analysis.engine.measure import as_list, load_result
from analysis.frontends.compare import compare
from analysis.reports import cross as XC
from analysis.results import storage
from analysis.studies import calibration as CAL
from analysis.studies.claims import (
    CONVERGED,
    MIN_SEEDS,
    Claims,
    Result,
    compare_part,
    converged,
    judge,
    one_part,
    seeds,
    slope_part,
)
from analysis.studies.locality import LOCAL_FRACTION, LOCALITY_PRECONDITION, locality_precondition, uniform_of
from analysis.studies.raghu2021 import numbers as N
from analysis.studies.raghu2021.floors import floors_section, identity_mask, resnet_blocks
from analysis.studies.raghu2021.pilots import LOCALITY
from analysis.studies.raghu2021.preregistered import MIN_BLOCKS_PER_HALF, PREREGISTERED
from analysis.studies.stats import HELD, INCONCLUSIVE, NOT_HELD, NOT_TESTABLE, Decision, Precondition, magnitude
from train.checkpoint import read_meta

CLAIMS = Claims("raghu2021", PREREGISTERED)  # every threshold a verdict reads: preregistered.py
SOURCE = "Raghu et al. 2021"
DEMO_POSITIVE_CONTROL = (
    'A "not testable" or "did not hold" here rests on detectors with a positive control: heads forced local / offset '
    "by interventions.local_attention are found by attention distance, aligned attention and head subsets "
    "(tests/interventions/test_positive_control.py, recipes/positive_control.yaml), and the same detectors find local "
    "heads in the "
    "lower blocks of a real pretrained ViT-S/14 and none in its last blocks (docs/real-vit.md)."
)


def _family(ctx, stat) -> dict:
    """{configuration: [stat(run) per seed]} over the ViT family: the default ViT with one factor changed."""
    names = [c for c in ctx.configs if c in ("vit_cls", "vit_gap") or c.startswith(("noskip_b", "subset_"))]
    return {c: [stat(r) for r in ctx.configs[c]] for c in names}


def _locality_runs(ctx) -> tuple[str, list]:
    loc = ctx.shared.get("locality")
    if loc is None:
        return "vit_cls", ctx.configs["vit_cls"]
    return loc["config"], loc["runs"]


def _local_precondition(name: str, smallest: float, uniform: float) -> Precondition:
    return locality_precondition(smallest, uniform, name)


# ------------------------------------------------------------------------------------------------ Fig. 1, 2


@CLAIMS.claim(
    "uniformity",
    figure="Raghu Fig. 1, 2",
    claim="ViT layer representations are more uniform than a ResNet's: lower and higher layers are more similar",
    source=f"{SOURCE} §4",
    passage="We observe clear differences between the internal representation structure between the two model "
    "architectures: (1) ViTs show a much more uniform similarity structure, with a clear grid like structure (2) "
    "lower and higher layers in ViT show much greater similarity than in the ResNet, where similarity is divided "
    "into different (lower/higher) stages.",
    rule="Precondition: the ResNet has identity shortcuts (the paper's ResNets do). Two parts, ViT minus ResNet "
    "(Welch): mean off-diagonal self-CKA, and the CKA of the first and the last layer. The same numbers of a randomly "
    "initialised model of each architecture are shown beside the maps (the floor the architecture alone gives). "
    "Calibration readings (the similarity measure's self-maps): the mean off-diagonal similarity and the first-last "
    f"cell, ViT minus ResNet, resting on the ViT's off-diagonal cells and its first-last cell. {CAL.RULE}",
    paper_value="not stated as a number (Fig. 1: ViT maps near-uniform, ResNet maps in stages)",
    needs=("vit_cls", "resnet"),
)
def uniformity(ctx) -> Result:
    vit_runs, res_runs = ctx.configs["vit_cls"], ctx.configs["resnet"]
    blocks = resnet_blocks(res_runs[0])
    ident = int(identity_mask(res_runs[0], blocks).sum())
    uv = [N.uniformity(ctx.last(r, "cka")["matrix"]) for r in vit_runs]
    ur = [N.uniformity(ctx.last(r, "cka")["matrix"]) for r in res_runs]
    shortcut = Precondition(
        "identity shortcuts",
        ident > 0,
        f"the ResNet has identity shortcuts in {ident} of its {len(blocks)} blocks"
        if ident
        else f"the ResNet has no identity shortcut (0 of its {len(blocks)} blocks): every shortcut is a projection, "
        "unlike the paper's ResNets",
        {"identity_blocks": ident, "blocks": len(blocks)},
    )
    d = judge(
        [
            compare_part(k, [u[k] for u in uv], [u[k] for u in ur])
            for k in ("mean_offdiag", "first_last")  # ViT - ResNet
        ],
        [shortcut, seeds({"vit_cls": uv, "resnet": ur})],
    )
    cls, resnet = vit_runs[0], res_runs[0]
    arch = [cls] + ([ctx.configs["vit_gap"][0]] if "vit_gap" in ctx.configs else []) + [resnet]
    root = ctx.study.root
    for r, rr in zip(vit_runs, res_runs):
        XC.against(r, rr, max(rr.checkpoints), opts=ctx.opts, progress=False)
    compare(arch, out=root / "compare-arch", opts=ctx.opts, progress=False)
    fig_dir = storage.against_dir(cls.path, max(cls.checkpoints), resnet.name, max(resnet.checkpoints), "figures")
    sub = _SubDoc()
    floors_section(sub, arch, ctx.opts, root)
    res = Result(
        d,
        measured={"vit": uv, "resnet": ur},
        lines=sub.lines,
        figures=[
            (
                root / "compare-arch" / "cka_grid.png",
                "cka_arch",
                "CKA between layers: " + ", ".join(r.name for r in arch),
            ),
            (fig_dir / "cross_cka.png", "cka_vit_vs_resnet", "Cross-model CKA, ViT (x) vs ResNet (y) (Raghu Fig. 2)"),
            *sub.figures,
        ],
    )
    return CAL.attach(
        res, uniformity_readings([CAL.self_map(ctx, r) for r in vit_runs], [CAL.self_map(ctx, r) for r in res_runs])
    )


def _first_last(r: dict) -> np.ndarray:
    mask = np.zeros(np.shape(r["score"]), dtype=bool)
    mask[0, -1] = True
    return mask


def uniformity_readings(vit: list, resnet: list) -> list:
    """Raghu Fig. 1-2 on the similarity measure's self-maps (per seed): ViT minus ResNet, mean off-diagonal and the
    first-last cell (analysis/studies/calibration.py)."""
    return [
        CAL.Reading(
            "mean off-diagonal similarity, ViT - ResNet",
            vit,
            resnet,
            CAL.mean_over(CAL.off_diagonal),
            CAL.off_diagonal,
            "mean_offdiag",
        ),
        CAL.Reading(
            "first vs last layer, ViT - ResNet", vit, resnet, CAL.mean_over(_first_last), _first_last, "first_last"
        ),
    ]


class _SubDoc:
    """Collects a section's lines and figures so that they appear under their claim."""

    def __init__(self):
        self.lines: list[str] = []
        self.figures: list[tuple] = []

    def add(self, *lines: str) -> None:
        self.lines += list(lines)

    def figure(self, path, name: str, caption: str) -> None:
        self.figures.append((path, name, caption))


# ------------------------------------------------------------------------------------------------ Fig. 8


PAPER_NOSKIP_DROP = 0.04  # Fig. 8's caption: "a performance drop of 4%" for middle blocks, read as 4 points of top-1


@CLAIMS.claim(
    "noskip_partition",
    figure="Raghu Fig. 8",
    claim="Removing the skip connections of block i partitions the representations before and after block i, and "
    "costs accuracy (4% for middle blocks)",
    source=f"{SOURCE} §6, Fig. 8 caption",
    passage="The results, in Figure 8, illustrate that removing the skip connections in a block partitions the layer "
    "representations on either side. (We note a performance drop of 4% when […] removing skip connections from "
    "middle blocks.)",
    rule="Per no-skip block i: the mean CKA between layers before block i and layers from block i on, normal ViT "
    "minus no-skip ViT; for blocks in the middle third of the network also the top-1 drop (the top-1 the trainer "
    "recorded on the test split at the last checkpoint, as Raghu's drop is; the skip-removal sanity check reads the "
    "same drop on the analysis images instead, to pair it with the test-time cost there). Each part is a t on the "
    "seed SD pooled over the normal and every no-skip configuration (same architecture and recipe). Calibration "
    "readings (the similarity measure's self-maps): per no-skip block i, the mean similarity across the partition, "
    f"normal minus no-skip, resting on the normal ViT's cells across it. {CAL.RULE}",
    paper_value='4% top-1 drop for middle blocks (Fig. 8 caption: "For middle blocks without skip connections, we '
    'observe a performance drop of 4%.")',
    needs=("vit_cls",),
)
def noskip_partition(ctx) -> Result:
    base = ctx.configs["vit_cls"]
    ns = {int(k.rsplit("b", 1)[1]): v for k, v in ctx.configs.items() if k.startswith("noskip_b")}
    if not ns:
        return _absent("noskip_b<i>")
    depth = base[0].recipe.model.depth
    mats = {}

    def across(r, b):
        if r.name not in mats:
            res = ctx.last(r, "cka")
            mats[r.name] = (res["matrix"], [str(s) for s in res["labels"]])
        return N.partition(*mats[r.name], b)["across"]

    parts, ours = [], []
    top1 = {
        "vit_cls": [ctx.top1(r) for r in base],
        **{f"noskip_b{b}": [ctx.top1(r) for r in rs] for b, rs in ns.items()},
    }
    for b in sorted(ns):
        fam = {
            "vit_cls": [across(r, b) for r in base],
            **{f"noskip_b{k}": [across(r, b) for r in v] for k, v in ns.items()},
        }
        parts.append(
            compare_part(f"block {b} CKA across (normal - no skip)", fam["vit_cls"], fam[f"noskip_b{b}"], family=fam)
        )
        if depth / 3 <= b < 2 * depth / 3:  # the middle third: the paper's 4% is for middle blocks
            parts.append(compare_part(f"block {b} top-1 drop", top1["vit_cls"], top1[f"noskip_b{b}"], family=top1))
            drop = 100 * (np.mean(top1["vit_cls"]) - np.mean(top1[f"noskip_b{b}"]))
            ours.append(f"block {b}: {drop:.2f} points top-1 drop (the trainer's test top-1)")
    d = judge(parts, [seeds({"vit_cls": base, **{f"noskip_b{b}": v for b, v in ns.items()}})])
    # the caption's 4% read as 4 points of top-1, tested against each middle block's drop (beside the verdict)
    sizes = [magnitude(p, PAPER_NOSKIP_DROP, " points", 100) for p in d.parts if p.name.endswith("top-1 drop")]
    root = ctx.study.root
    compare([base[0]] + [ns[k][0] for k in sorted(ns)], out=root / "compare-noskip", opts=ctx.opts, progress=False)
    res = Result(
        d,
        ours=("; ".join(ours) + "; " + d.ours) if ours and d.parts else None,
        magnitudes=sizes,
        measured={"top1": top1},
        figures=[
            (
                root / "compare-noskip" / "cka_grid.png",
                "cka_noskip",
                "CKA maps: normal ViT, then no skip at blocks " + ", ".join(str(k) for k in sorted(ns)),
            )
        ],
    )
    normal = [CAL.self_map(ctx, r) for r in base]
    return CAL.attach(res, partition_readings(normal, {b: [CAL.self_map(ctx, r) for r in ns[b]] for b in sorted(ns)}))


def partition_readings(normal: list, noskip: dict) -> list:
    """Raghu Fig. 8 on the similarity measure's self-maps (per seed): for each no-skip block b, the mean similarity
    across the partition at b, normal minus no-skip (analysis/studies/calibration.py)."""

    def across(b):
        def mask(r):
            side = N.after(as_list(r["labels"]), b)
            return np.outer(~side, side)

        return mask

    return [
        CAL.Reading(
            f"block {b} similarity across (normal - no skip)",
            normal,
            maps,
            CAL.mean_over(across(b)),
            across(b),
            f"block {b} CKA across (normal - no skip)",
        )
        for b, maps in noskip.items()
    ]


def _absent(what: str) -> Result:
    return Result(
        Decision(
            NOT_TESTABLE,
            f"This study has no runs of {what}, which the claim compares.",
            (),
            (),
            (Precondition("configurations", False, f"no runs of {what}"),),
        )
    )


# ------------------------------------------------------------------------------------------------ Fig. 7


def _ratio_converged(ctx, runs, stat, name) -> Precondition:
    prev = [ctx.previous(r, "norm_ratio") for r in runs]
    if any(p is None for p in prev):
        return converged(name, [0.0], None)
    return converged(name, [stat(ctx.last(r, "norm_ratio")) for r in runs], [stat(p) for p in prev])


@CLAIMS.claim(
    "skip_dominance",
    figure="Raghu Fig. 7 right",
    claim="Skip connections are much more influential in ViT than in a ResNet: much higher norm ratios ‖z‖ / ‖f(z)‖",
    source=f"{SOURCE} §6",
    passage="The right pane, which has line plots of these norm ratios across ResNet50, the ViT CLS token and the ViT "
    "spatial tokens additionally demonstrates that skip connection is much more influential in ViT compared to "
    "ResNet: we observe much higher norm ratios for ViT throughout, along with the phase transition from CLS to "
    "spatial token propagation (shown for the MLP and self-attention layers.)",
    rule=f"Precondition: the ResNet has identity shortcuts; the median ratios changed by "
    f"less than {100 * CONVERGED:.0f}% between the "
    "last two checkpoints. Parts (Welch): log of the ViT's median norm ratio (all sublayers, blocks, tokens) minus "
    "log of the ResNet's (identity-shortcut blocks only: a projection shortcut is not a skip connection); and, for "
    '"throughout", one part per ViT block: its log median ratio minus that of the ResNet identity block nearest in '
    "normalised depth (b + 0.5) / L.",
    paper_value="not stated as a number (Fig. 7 right: ViT ratios above ResNet-50's in every block)",
    needs=("vit_cls", "resnet"),
)
def skip_dominance(ctx) -> Result:
    vit_runs, res_runs = ctx.configs["vit_cls"], ctx.configs["resnet"]
    nr = ctx.last(res_runs[0], "norm_ratio")
    mask = identity_mask(res_runs[0], [str(b) for b in nr["blocks"]])
    vit = [np.log(N.skip_dominance(ctx.last(r, "norm_ratio")["ratio"])) for r in vit_runs]
    res = [np.log(N.skip_dominance(ctx.last(r, "norm_ratio")["ratio"], mask)) for r in res_runs] if mask.any() else []
    conds = [
        Precondition(
            "identity shortcuts",
            bool(mask.any()),
            f"the ResNet has identity shortcuts in {int(mask.sum())} of its {len(mask)} blocks"
            if mask.any()
            else f"the ResNet has no identity shortcut (0 of its {len(mask)} blocks): its skip path is a 1x1 "
            "projection everywhere, so there is no skip connection to compare",
            {"identity_blocks": int(mask.sum()), "blocks": len(mask)},
        ),
        seeds({"vit_cls": vit_runs, "resnet": res_runs}),
        _ratio_converged(ctx, vit_runs, lambda x: N.skip_dominance(x["ratio"]), "the ViT's median norm ratio"),
    ]
    parts = [compare_part("log median norm ratio, ViT - ResNet identity blocks", vit, res)]
    if mask.any():  # "much higher norm ratios for ViT throughout": every ViT block against the ResNet at its depth
        vb = [np.log(N.block_ratios(ctx.last(r, "norm_ratio")["ratio"])) for r in vit_runs]
        rb = [np.log(N.block_ratios(ctx.last(r, "norm_ratio")["ratio"])) for r in res_runs]
        match = N.matched_blocks(len(vb[0]), mask)
        parts += [
            compare_part(f"block {b}: log median ratio, ViT - ResNet block {j}", [v[b] for v in vb], [x[j] for x in rb])
            for b, j in enumerate(match)
        ]
    d = judge(parts, conds)
    ours = f"median ratio ViT {np.exp(np.mean(vit)):.3g}" + (f", ResNet {np.exp(np.mean(res)):.3g}" if res else "")
    arch = [vit_runs[0]] + ([ctx.configs["vit_gap"][0]] if "vit_gap" in ctx.configs else []) + [res_runs[0]]
    fig = (
        ctx.study.root / "compare-arch" / "norm_ratio.png",
        "norm_ratio_arch",
        "Norm ratios per block: " + ", ".join(r.name for r in arch),
    )
    return Result(d, ours=ours, figures=[fig])


@CLAIMS.claim(
    "cls_phase",
    figure="Raghu Fig. 7",
    claim="In the first half of the network the CLS token's norm ratio is higher than the spatial tokens' (it is "
    "carried by the skip path); in the second half this is reversed",
    source=f"{SOURCE} §6",
    passage="We observe a striking phase transition: in the first half of the network, the CLS token (token 0) "
    "representation is primarily propagated by the skip connection branch (high norm ratio), while the spatial "
    "token representations have a large contribution coming from the long branch (lower norm ratio). Strikingly, "
    "in the second half of the network, this is reversed.",
    rule="On log norm ratios, gap = log(CLS ratio) - mean log(spatial ratio) per block. Block 0 is left out: its CLS "
    "input (cls_token + pos_embed[0]) is the same vector for every image. Preconditions: a CLS token; at least "
    f"{MIN_BLOCKS_PER_HALF} kept blocks in each half; the gaps changed by "
    f"less than {100 * CONVERGED:.0f}% between the last two "
    "checkpoints. Four parts (one-sample t over seeds), for the attention and the MLP sublayer: the first half's "
    "mean gap above 0, the second half's below 0.",
    paper_value="not stated as a number (Fig. 7 left: the reversal at about the middle block)",
    needs=("vit_cls",),
)
def cls_phase(ctx) -> Result:
    runs = ctx.configs["vit_cls"]
    nv = ctx.last(runs[0], "norm_ratio")
    prefix = int(nv["num_prefix_tokens"])
    subl = [str(s) for s in nv["sublayers"]]
    if prefix < 1:
        return Result(
            Decision(
                NOT_TESTABLE,
                "The model has no CLS token (num_prefix_tokens 0).",
                (),
                (),
                (Precondition("cls token", False, "the model has no CLS token"),),
            )
        )
    parts, conds = [], [seeds({"vit_cls": runs})]
    ph0 = N.cls_phase(nv["ratio"], 0, prefix)
    if min(ph0["blocks_first"], ph0["blocks_second"]) < MIN_BLOCKS_PER_HALF:
        conds.append(
            Precondition(
                "blocks per half",
                False,
                f"the ViT has {len(nv['ratio'][0])} blocks: leaving out block 0 (its CLS input is the same for every "
                f"image), its halves keep {ph0['blocks_first']} and {ph0['blocks_second']} blocks, and the rule needs "
                f"at least {MIN_BLOCKS_PER_HALF} in each to call a phase transition (the paper's ViT-B/32 has 12 "
                "blocks)",
                {"blocks_first": ph0["blocks_first"], "blocks_second": ph0["blocks_second"]},
            )
        )
    for s, name in enumerate(subl):
        ph = [N.cls_phase(ctx.last(r, "norm_ratio")["ratio"], s, prefix) for r in runs]
        parts.append(one_part(f"{name}: first-half log(CLS / spatial)", [x["gap_first"] for x in ph], sign=+1))
        parts.append(one_part(f"{name}: second-half log(spatial / CLS)", [x["gap_second"] for x in ph], sign=-1))
        conds.append(
            _ratio_converged(ctx, runs, lambda x, s=s: N.cls_phase(x["ratio"], s, prefix)["gap_first"], f"{name} gap")
        )
    return Result(judge(parts, conds))


# ------------------------------------------------------------------------------------------------ Fig. 3, 4, 5


@CLAIMS.claim(
    "head_mix",
    figure="Raghu Fig. 3; ViT App. D.6",
    claim="Lower layers mix local and global heads; higher layers attend globally",
    source=f"{SOURCE} §5",
    passage="In agreement with Dosovitskiy et al. [14], we observe that even in the lowest layers of ViT, "
    "self-attention layers have a mix of local heads (small distances) and global heads (large distances). This is in "
    "contrast to CNNs, which are hardcoded to attend only locally in the lower layers. At higher layers, all "
    "self-attention heads are global.",
    rule="Read on the locality configuration (vit_local when the study has it trained, else vit_cls; see the pilot "
    f"runs). Preconditions: some head below {LOCALITY_PRECONDITION:g} x uniform attention's distance on the same "
    f"grid; the statistics changed by "
    f"less than {100 * CONVERGED:.0f}% between the last two checkpoints. Two parts (one-sample t over "
    "seeds): the spread of head distances (max - min over heads, mean over blocks) in the lower half of the blocks "
    "minus the upper half's, and the mean distance of the upper half minus the lower half's. " + DEMO_POSITIVE_CONTROL,
    paper_value="not stated as a number (Fig. 3: lowest blocks span near-zero to near-image-size distances, highest "
    "blocks all large)",
    needs=("vit_cls",),
)
def head_mix(ctx) -> Result:
    name, runs = _locality_runs(ctx)
    uniform = uniform_of(runs[0])[1]
    hm = [N.head_mix(ctx.last(r, "attention_distance")["pixels"]) for r in runs]
    smallest = min(h["min"] for h in hm)
    conds = [_local_precondition(name, smallest, uniform), seeds({name: runs})]
    prev = [ctx.previous(r, "attention_distance") for r in runs]
    if all(p is not None for p in prev):
        hp = [N.head_mix(p["pixels"]) for p in prev]
        conds.append(
            converged(
                "the lower-half head spread",
                [h["spread_lower"] for h in hm],
                [h["spread_lower"] for h in hp],
                scale=0.1 * uniform,
            )
        )
    d = judge(
        [
            one_part("head spread, lower - upper half (px)", [h["spread_lower"] - h["spread_upper"] for h in hm]),
            one_part("mean distance, upper - lower half (px)", [h["mean_upper"] - h["mean_lower"] for h in hm]),
        ],
        conds,
    )
    arch = [ctx.configs["vit_cls"][0]] + ([ctx.configs["vit_gap"][0]] if "vit_gap" in ctx.configs else [])
    return Result(
        d,
        ours=f"smallest head {smallest:.2f} px = {smallest / uniform:.2f} x uniform; " + (d.ours if d.parts else ""),
        measured={"configuration": name, "uniform_px": uniform, "smallest_px": smallest},
        figures=[
            (
                ctx.study.root / "compare-arch" / "attention_distance.png",
                "attention_distance",
                "Mean attention distance per head and block: " + ", ".join(r.name for r in arch),
            )
        ],
    )


@CLAIMS.claim(
    "data_locality",
    figure="Raghu Fig. 4, §5",
    claim="With less training data, lower attention layers do not learn to attend locally",
    source=f"{SOURCE} §5",
    passage="Comparing to Figure 3, we see that with not enough data, ViT *does not learn to attend locally* in "
    "earlier layers.",
    rule="Per seed, the distance of the most local head of the lower half of the blocks (as a share of uniform "
    "attention's) at each data fraction (the subset runs at their chosen checkpoints and the full-data vit_cls), "
    "regressed on log10 of the fraction; one part, the slopes below 0 (one-sample t: more data, more local). "
    f"Precondition: at some fraction a head is below {LOCALITY_PRECONDITION:g} x uniform; where every fraction is at "
    "uniform attention the trend is shown as exploratory and not judged.",
    paper_value="not stated as a number (Fig. 4 vs Fig. 3: ImageNet-only ViTs have no local lower-layer head)",
    needs=("vit_cls",),
)
def data_locality(ctx) -> Result:
    fr = _fractions(ctx)
    if len(fr) < 2:
        return _absent("subset_<fraction> (at least one data subset beside the full data)")
    uniform = uniform_of(ctx.configs["vit_cls"][0])[1]
    per_seed, smallest = [], np.inf
    n_seeds = min(len(rs) for _, rs, _ in fr)
    for i in range(n_seeds):
        row = []
        for _, rs, steps in fr:
            d = np.asarray(ctx.last(rs[i], "attention_distance", steps[i])["pixels"], dtype=float)
            m = float(d[: max(1, len(d) // 2)].min())
            smallest = min(smallest, m)
            row.append(m / uniform)
        per_seed.append(row)
    x = [np.log10(f) for f, _, _ in fr]
    d = judge(
        [slope_part("slope of the most local lower-half head (x uniform) per decade of data", x, per_seed, sign=-1)],
        [_local_precondition("any data fraction", smallest, uniform), seeds({"seeds": list(range(n_seeds))})],
    )
    table = ["| data fraction | " + " | ".join(f"{f:g}" for f, _, _ in fr) + " |", "| --- |" + " --- |" * len(fr)]
    for i, row in enumerate(per_seed):
        table.append(
            f"| seed {i}: most local lower-half head, x uniform | " + " | ".join(f"{v:.3f}" for v in row) + " |"
        )
    return Result(d, measured={"fractions": [f for f, _, _ in fr], "per_seed": per_seed}, lines=[*table, ""])


def _fractions(ctx) -> list[tuple[float, list, list]]:
    """[(data fraction, runs in seed order, the step each is read at)] for the subset runs (their chosen checkpoints)
    and the full-data vit_cls (its last), in increasing fraction."""
    out = []
    for name, rs in ctx.configs.items():
        if not name.startswith("subset_"):
            continue
        ds = rs[0].recipe.interventions.data_subset
        if ds.fraction is None:
            continue
        steps = [N.select_checkpoint({s: read_meta(p) for s, p in r.checkpoints.items()})[0] for r in rs]
        out.append((float(ds.fraction), rs, steps))
    if out:
        full = ctx.configs["vit_cls"]
        out.append((1.0, full, [max(r.checkpoints) for r in full]))
    return sorted(out, key=lambda t: t[0])


@CLAIMS.claim(
    "head_subsets",
    figure="Raghu Fig. 5",
    claim="The first block's local heads are the most similar to the ResNet's lower layers; similarity falls as the "
    "heads get more global",
    source=f"{SOURCE} §5",
    passage="The results, shown in Figure 5, which plot the mean distance for each subset against CKA similarity, "
    "clearly show a monotonic decrease in similarity as mean attention distance grows, demonstrating that access to "
    "more global information also leads to quantitatively different features than computed by the local receptive "
    "fields in the lower layers of the ResNet.",
    rule="Read on the locality configuration, each seed against the ResNet of the same seed. Precondition: a head of "
    f"the first block below {LOCALITY_PRECONDITION:g} x uniform attention's distance. One part (one-sample t over "
    "seeds): the CKA of the most local window of heads (windows of half the heads, sorted by distance) minus that of "
    "the most global window, averaged over the ResNet's first two stages; the rank correlation of window distance and "
    'CKA (the paper\'s "monotonic") is shown beside it.',
    paper_value="not stated as a number (Fig. 5: CKA falls monotonically from the most local to the most global "
    "subset)",
    needs=("vit_cls", "resnet"),
)
def head_subsets(ctx) -> Result:
    name, runs = _locality_runs(ctx)
    res_runs = ctx.configs["resnet"]
    uniform = uniform_of(runs[0])[1]
    results = []
    for r, rr in zip(runs, res_runs):
        XC.against(r, rr, max(rr.checkpoints), opts=ctx.opts, progress=False)
        results.append(
            load_result(
                storage.against_dir(r.path, max(r.checkpoints), rr.name, max(rr.checkpoints)) / "head_subsets.npz"
            )
        )
    hs = [N.head_subsets(x) for x in results]
    smallest = min(h["min_head"] for h in hs)
    d = judge(
        [
            one_part(
                "CKA to ResNet lower layers, most local - most global window", [h["local_minus_global"] for h in hs]
            )
        ],
        [_local_precondition(f"{name}'s first block", smallest, uniform), seeds({name: runs})],
    )
    sub_fig = storage.against_dir(
        runs[0].path, max(runs[0].checkpoints), res_runs[0].name, max(res_runs[0].checkpoints), "figures"
    )
    return Result(
        d,
        measured={"configuration": name, "rank_corr": [h["rank_corr"] for h in hs], "smallest_block0_px": smallest},
        figures=[
            (
                sub_fig / "head_subsets.png",
                "head_subsets",
                f"{runs[0].name}: block-0 heads from local to global: CKA of windows of consecutive heads (lines) and "
                "of "
                "single heads (circles) to the ResNet's lower layers (Raghu Fig. 5)",
            )
        ],
    )


# ------------------------------------------------------------------------------------------------ Fig. 9-11


def _cls_vs_gap(ctx, name: str, stat, sign: int) -> Result:
    fam = {c: [stat(r) for r in ctx.configs[c]] for c in ("vit_cls", "vit_gap")}
    a, b = (fam["vit_cls"], fam["vit_gap"]) if sign > 0 else (fam["vit_gap"], fam["vit_cls"])
    return Result(judge([compare_part(name, a, b, family=fam)], [seeds(fam)]))


@CLAIMS.claim(
    "cls_localization",
    figure="Raghu Fig. 9, 10",
    claim="CLS-token ViTs keep spatial location in higher layers better than GAP ViTs",
    source=f"{SOURCE} §7",
    passage="The results, shown in Figure 10, demonstrate that global average pooling does indeed reduce localization "
    "in the higher layers.",
    rule="Last block's localization own_share (share of tokens most similar to their own input patch), CLS minus GAP; "
    "a t on the seed SD pooled over the two configurations.",
    paper_value="not stated as a number (Fig. 9, 10: heatmaps)",
    needs=("vit_cls", "vit_gap"),
)
def cls_localization(ctx) -> Result:
    r = _cls_vs_gap(
        ctx, "last-block own_share, CLS - GAP", lambda x: N.last_layer(ctx.last(x, "localization")["own_share"]), +1
    )
    for run, tag in ((ctx.configs["vit_cls"][0], "cls"), (ctx.configs["vit_gap"][0], "gap")):
        d = storage.step_dir(run.path, max(run.checkpoints), "figures")
        r.figures.append(
            (d / "localization_score.png", f"localization_{tag}", f"Localization scores per block, {tag.upper()} ViT")
        )
    return r


@CLAIMS.claim(
    "gap_token_probes",
    figure="Raghu Fig. 11 left",
    claim="Single spatial tokens of GAP ViTs probe better in higher layers than those of CLS ViTs",
    source=f"{SOURCE} §7",
    passage="The left pane shows average accuracy of classifiers trained on individual tokens, where we see that "
    "ResNet50 and ViT with GAP model tokens perform well at higher layers, while in the standard ViT trained with a "
    "CLS token the spatial tokens do poorly – likely because their representations remain spatially localized at "
    "higher layers, which makes global classification challenging.",
    rule="Last block's mean 10-shot accuracy of single spatial tokens, GAP minus CLS (a t on the seed SD pooled over "
    'the two configurations); and, for the CLS tokens that "do poorly" where the ResNet\'s "perform well", the '
    "ResNet's last-block token probe minus the CLS ViT's (Welch), when the study has the ResNet's token probes.",
    paper_value="not stated as a number (Fig. 11 left, App. Fig. D.4: per-token accuracies in plots only)",
    needs=("vit_cls", "vit_gap"),
)
def gap_token_probes(ctx) -> Result:
    def probe(x):
        return N.last_layer(ctx.last(x, "token_probes")["mean_over_tokens"])

    fam = {c: [probe(r) for r in ctx.configs[c]] for c in ("vit_cls", "vit_gap")}
    parts = [
        compare_part("last-block mean token-probe accuracy, GAP - CLS", fam["vit_gap"], fam["vit_cls"], family=fam)
    ]
    if "resnet" in ctx.configs:  # "ResNet50 [...] tokens perform well [...] the spatial tokens do poorly"
        res = [ctx.last(r, "token_probes", optional=True) for r in ctx.configs["resnet"]]
        if all(x is not None for x in res):
            res = [N.last_layer(x["mean_over_tokens"]) for x in res]
            parts.append(
                compare_part("CLS ViT's tokens do poorly: last-block token probe, ResNet - CLS", res, fam["vit_cls"])
            )
            fam["resnet"] = res
    r = Result(judge(parts, [seeds(fam)]), measured={"last_block_token_probe": fam})
    for run, tag in ((ctx.configs["vit_cls"][0], "cls"), (ctx.configs["vit_gap"][0], "gap")):
        d = storage.step_dir(run.path, max(run.checkpoints), "figures")
        r.figures.append(
            (d / "token_probes_mean.png", f"token_probes_{tag}", f"Per-token 10-shot probes, {tag.upper()} ViT")
        )
    return r


# ------------------------------------------------------------------------------------------------ Fig. 6


@CLAIMS.claim(
    "erf",
    figure="Raghu Fig. 6, C.1, C.2",
    claim="ViT's lower-layer effective receptive fields are larger than a ResNet's, and ViT's become much more global "
    "midway through the network while the ResNet's grow gradually",
    source=f"{SOURCE} §5",
    passage="We observe that lower layer effective receptive fields for ViT are indeed larger than in ResNets, and "
    "while ResNet effective receptive fields grow gradually, ViT receptive fields become much more global midway "
    "through the network.",
    rule="The ERF's mean distance (pixels) from the centre location's input window after the residual connection "
    "(analysis/measures/erf.py: |gradient| of the centre location, averaged over channels and 32 images), per block. "
    "Two parts (Welch, ViT minus ResNet): the lowest block's ERF distance; and the shape of the growth -- the largest "
    "increase between two consecutive blocks as a share of the whole increase from the first block to the last "
    "(growing gradually spreads it over many steps, becoming global midway concentrates it in one). A third part, "
    '"midway" (one-sample t over the ViT seeds): the share of the ViT\'s whole ERF increase made by the steps into '
    "the middle third of its blocks, minus the share an even growth would give them.",
    paper_value="not stated as a number (Fig. 6: ERF maps)",
    needs=("vit_cls", "resnet"),
)
def erf(ctx) -> Result:
    vit_runs, res_runs = ctx.configs["vit_cls"], ctx.configs["resnet"]
    if any(ctx.last(r, "erf", optional=True) is None for r in vit_runs + res_runs):
        return Result(
            Decision(
                NOT_TESTABLE,
                "The effective receptive field was not measured on every seed (erf is not in the study's measures).",
                (),
                (),
                (Precondition("measured", False, "erf not measured on every seed"),),
            )
        )
    vit = [np.asarray(ctx.last(r, "erf")["mean_distance"])[:, 0] for r in vit_runs]
    res = [np.asarray(ctx.last(r, "erf")["mean_distance"])[:, 0] for r in res_runs]
    d = judge(
        [
            compare_part("lowest block ERF mean distance, ViT - ResNet (px)", [c[0] for c in vit], [c[0] for c in res]),
            compare_part(
                "ERF growth concentration (largest one-block share), ViT - ResNet",
                [N.erf_concentration(c) for c in vit],
                [N.erf_concentration(c) for c in res],
            ),
            one_part(
                "ViT: share of the ERF growth in the middle third of the blocks, above even growth's",
                [N.erf_midway(c) for c in vit],
            ),
        ],
        [seeds({"vit_cls": vit, "resnet": res})],
    )
    figs = [
        (
            storage.step_dir(r.path, max(r.checkpoints), "figures") / "erf_maps.png",
            f"erf_{tag}",
            f"Effective receptive fields by block, {r.name} (Raghu Fig. 6, C.1, C.2)",
        )
        for r, tag in ((vit_runs[0], "vit"), (res_runs[0], "resnet"))
    ]
    return Result(d, figures=figs)


# ------------------------------------------------------------------------------------------------ Fig. 12, 13


def _mean_pool(ctx, r) -> np.ndarray:
    fp = ctx.last(r, "fewshot_probe")
    return np.asarray(fp["mean"], dtype=float)[as_list(fp["pools"]).index("mean")]


@CLAIMS.claim(
    "intermediate_probes",
    figure="Raghu Fig. 13 right",
    claim="ViT's intermediate layers are stronger 10-shot linear-probe features than the ResNet's",
    source=f"{SOURCE} §8",
    passage="This conclusion is further supported by the results of the right pane of Figure 13, which shows linear "
    "probes on different ResNet and ViT models, all pretrained on JFT-300M. We again see the larger ViT models learn "
    "much stronger intermediate representations than the ResNets.",
    rule="10-shot closed-form probe accuracy of the spatial mean of each block's output (both models aggregated the "
    "same way), averaged over the middle half of each network's blocks (normalised depth (l + 1) / L in (0.25, "
    "0.75]); ViT minus ResNet (Welch). What differs from the paper's setting: its ViTs are large, pretrained on "
    "JFT-300M and probed under transfer to ImageNet; here both models are small, trained 4 epochs on Fashion-MNIST "
    "and probed in distribution, where the ResNet is the better classifier (see the runs' top-1), so this tests the "
    "architecture's intermediate features without the scale the paper credits.",
    paper_value="not stated as a number (Fig. 13 right: curves only)",
    needs=("vit_cls", "resnet"),
)
def intermediate_probes(ctx) -> Result:
    vit_runs, res_runs = ctx.configs["vit_cls"], ctx.configs["resnet"]
    if any(ctx.last(r, "fewshot_probe", optional=True) is None for r in vit_runs + res_runs):
        return _absent("fewshot_probe results on every seed")
    vit = [N.middle_mean(_mean_pool(ctx, r)) for r in vit_runs]
    res = [N.middle_mean(_mean_pool(ctx, r)) for r in res_runs]
    top = {n: float(np.mean([ctx.top1(r) for r in ctx.configs[n]])) for n in ("vit_cls", "resnet")}
    d = judge(
        [compare_part("middle-half 10-shot accuracy, ViT - ResNet", vit, res)], [seeds({"vit_cls": vit, "resnet": res})]
    )
    return Result(
        d,
        ours=f"{d.ours if d.parts else ''}; top-1 ViT {top['vit_cls']:.4f}, ResNet {top['resnet']:.4f}",
        measured={"top1": top},
    )


@CLAIMS.claim(
    "data_probes",
    figure="Raghu Fig. 13 left",
    claim="With more pretraining data, intermediate layers give much better linear-probe features",
    source=f"{SOURCE} §8",
    passage="We observe the JFT-300M pretrained models achieve much higher accuracies even with middle layer "
    "representations, with a 30% gap in absolute accuracy to the models pretrained only on ImageNet.",
    rule="Per seed, the middle-half mean 10-shot accuracy (as in Fig. 13 right) of the subset runs (their last "
    "checkpoint: the probe is measured there) and the full-data vit_cls, regressed on log10 of the data fraction; one "
    "part, the slopes above 0 (one-sample t). The paper compares 300M with 1.3M images; here the fractions are of "
    "55,000 Fashion-MNIST images.",
    paper_value="30 points of absolute accuracy in the middle layers, JFT-300M vs ImageNet pretraining",
    needs=("vit_cls",),
)
def data_probes(ctx) -> Result:
    fr = _fractions(ctx)
    if len(fr) < 2:
        return _absent("subset_<fraction> (at least one data subset beside the full data)")
    if any(ctx.last(r, "fewshot_probe", optional=True) is None for _, rs, _ in fr for r in rs):
        return _absent("fewshot_probe results on every subset run")
    n = min(len(rs) for _, rs, _ in fr)
    per_seed = [[N.middle_mean(_mean_pool(ctx, rs[i])) for _, rs, _ in fr] for i in range(n)]
    x = [np.log10(f) for f, _, _ in fr]
    d = judge([slope_part("middle-half 10-shot accuracy per decade of data", x, per_seed, sign=+1)], [])
    gap = 100 * float(np.mean([row[-1] - row[0] for row in per_seed]))
    return Result(
        d,
        ours=f"{gap:.1f} points between {fr[0][0]:g} and all of the data; " + (d.ours if d.parts else ""),
        measured={"fractions": [f for f, _, _ in fr], "per_seed": per_seed},
    )


@CLAIMS.claim(
    "data_drift",
    figure="Raghu Fig. 12",
    claim="With less pretraining data lower layers stay similar to the full-data model while higher layers drift away",
    source=f"{SOURCE} §8",
    passage="Even with 3% of the entire dataset, lower layer representations are very similar to the model trained on "
    "the whole dataset, but higher layers require larger amounts of pretraining data to learn the same "
    "representations as at large data scale, especially with the large model size.",
    rule="Same-index CKA of each block to the full-data model of the same seed, each subset run read at its chosen "
    "checkpoint (best held-out validation top-1). Control: the same-index CKA between two full-data runs of "
    "different seeds (every pair, each read on the earlier seed's analysis images), the ceiling that a different "
    "initialisation and data order alone leave (every subset run has initial weights of its own, like a different "
    "seed), since two seeds also agree less in higher layers. Two parts: the smallest subset's lower-half mean minus "
    "its upper-half mean, minus the same gap of the ceiling (Welch's t; the ceiling's pairs share runs, so their "
    "spread is if anything understated; with one full-data seed, no ceiling: a one-sample t of the gap against 0); "
    "and the upper half's mean of the largest subset minus the smallest subset's (a t on the seed SD pooled over the "
    "subsets). Per layer in the table. Calibration readings (the similarity measure's cross-model maps, the same "
    "pairs and images): the smallest subset's same-index lower-half mean minus its upper-half mean, minus the same gap "
    f"of the cross-seed ceiling, resting on the smallest subset's lower-half same-index cells. {CAL.RULE}",
    paper_value="not stated as a number (Fig. 12: lower layers near 1 even at 3%)",
    needs=("vit_cls",),
)
def data_drift(ctx) -> Result:
    subs = [t for t in _fractions(ctx) if t[0] < 1.0]
    if not subs:
        return _absent("subset_<fraction>")
    full = ctx.configs["vit_cls"]
    curves, chosen, labels = {}, [], []
    for frac, rs, steps in subs:
        curves[frac] = []
        for r, ref, step in zip(rs, full, steps):
            chosen.append(f"{r.name}: step {step}")
            res = XC.against(r, ref, max(ref.checkpoints), [step], opts=ctx.opts, progress=False)["results"][step]
            curves[frac].append(np.asarray(res["same_index"], dtype=float))
            labels = as_list(res["labels_a"])
    # the control: two full-data runs of different seeds (every pair), each read on the earlier seed's images
    ceilings = [
        np.asarray(
            XC.against(
                full[j],
                full[i],
                max(full[i].checkpoints),
                [max(full[j].checkpoints)],
                opts=ctx.opts,
                progress=False,
                on_other_images=True,
            )["results"][max(full[j].checkpoints)]["same_index"],
            dtype=float,
        )
        for i in range(len(full))
        for j in range(i + 1, len(full))
    ]
    ceiling = np.mean(ceilings, 0) if ceilings else None
    small, large = min(curves), max(curves)

    def gap(c) -> float:
        d = N.drift(c)
        return d["lower"] - d["upper"]

    first, gaps = f"subset {small:g}: lower - upper half", [gap(c) for c in curves[small]]
    parts = [
        compare_part(f"{first}, minus the cross-seed ceiling's", gaps, [gap(c) for c in ceilings])
        if ceilings
        else one_part(first, gaps)
    ]
    fam = {f: [N.drift(c)["upper"] for c in cs] for f, cs in curves.items()}
    if large != small:
        parts.append(
            compare_part(f"upper half: subset {large:g} - subset {small:g}", fam[large], fam[small], family=fam)
        )
    table = [
        "| layer | " + " | ".join(f"subset {f:g}" for f in sorted(curves)) + " | cross-seed ceiling |",
        "| --- |" + " --- |" * (len(curves) + 1),
    ]
    for b in range(len(curves[small][0])):
        cells = [f"{np.mean([c[b] for c in curves[f]]):.3f}" for f in sorted(curves)]
        last = f"{ceiling[b]:.3f}" if ceiling is not None else "-"
        table.append(f"| {labels[b]} | " + " | ".join(cells) + f" | {last} |")
    d = judge(parts, [seeds({f"subset {f:g}": c for f, c in curves.items()})])
    lines = [
        "Same-index CKA to the full-data model, mean over seeds, per layer (the cross-seed ceiling: mean over the "
        f"{len(ceilings)} pairs of full-data seeds):",
        "",
        *table,
        "",
        "Checkpoints read: " + "; ".join(chosen) + ".",
        "",
    ]
    full0 = full[0]
    compare(
        [rs[0] for _, rs, _ in subs],
        reference=(full0, max(full0.checkpoints)),
        out=ctx.study.root / "compare-subsets",
        opts=ctx.opts,
        progress=False,
    )
    res = Result(
        d,
        measured={"ceiling": ceiling, "per_block": {f: np.mean(c, 0) for f, c in curves.items()}},
        lines=lines,
        figures=[
            (
                ctx.study.root / "compare-subsets" / "similarity_to_reference.png",
                "subsets",
                "CKA of each layer to the same layer of the 100% model",
            )
        ],
    )
    _, rs, steps = next(t for t in subs if t[0] == small)
    smallest = [CAL.cross_map(ctx, r, ref, step) for r, ref, step in zip(rs, full, steps)]
    pairs = [(full[j], full[i]) for i in range(len(full)) for j in range(i + 1, len(full))]
    ceiling_maps = [CAL.cross_map(ctx, a, b, on_other_images=True) for a, b in pairs] or None
    return CAL.attach(res, drift_readings(smallest, ceiling_maps, small))


def _lower_diagonal(r: dict) -> np.ndarray:
    n = min(np.shape(r["score"]))
    mask = np.zeros(np.shape(r["score"]), dtype=bool)
    mask[np.arange(n // 2), np.arange(n // 2)] = True
    return mask


def _diagonal_gap(m: np.ndarray, r: dict) -> float:
    d = N.drift(np.diag(m))
    return d["lower"] - d["upper"]


def drift_readings(smallest: list, ceiling: list | None, fraction: float) -> list:
    """Raghu Fig. 12 on the similarity measure's cross-model maps (per seed): the smallest subset's same-index
    lower-half minus upper-half mean against the full-data model, minus the same of the cross-seed ceiling (None: the
    gap alone) (analysis/studies/calibration.py)."""
    name = f"subset {fraction:g}: same-index lower - upper half" + (", minus the ceiling's" if ceiling else "")
    part = f"subset {fraction:g}: lower - upper half" + (", minus the cross-seed ceiling's" if ceiling else "")
    return [CAL.Reading(name, smallest, ceiling, _diagonal_gap, _lower_diagonal, part)]


# ------------------------------------------------------------------------------------------------ Walmer offset heads


@CLAIMS.claim(
    "offset_heads",
    figure="Walmer Fig. 3, 14",
    claim="Every ViT learns offset local attention heads",
    source="Walmer et al. 2023 §4.2",
    passage="We find instances of Offset Local Attention Heads in all the models examined, suggesting they are "
    "fundamentally necessary for ViTs.",
    rule="Read on every seed of the locality configuration (vit_local when the study has it trained, else the "
    "standard ViTs vit_cls and vit_gap). Precondition: one of those runs has a local head (aligned_attention local) "
    "and at least two runs. A count, not a test: held if every run has an offset local head, did not hold if none "
    "has, inconclusive if only some have. " + DEMO_POSITIVE_CONTROL,
    paper_value='location only (App. C.1: "Offset Local Attention Heads typically only occur in the first 3 to 6 '
    'layers" for supervised models)',
    needs=("vit_cls",),
)
def offset_heads(ctx) -> Result:
    name, lruns = _locality_runs(ctx)
    runs = lruns if name == LOCALITY else [r for k in ("vit_cls", "vit_gap") for r in ctx.configs.get(k, [])]
    al = {r.name: ctx.last(r, "aligned_attention", optional=True) for r in runs}
    al = {k: v for k, v in al.items() if v is not None}
    n_local = {k: int(np.asarray(v["local"], dtype=bool).sum()) for k, v in al.items()}
    counts = {k: N.offset_heads(v["offset_local"]) for k, v in al.items()}
    heads = sum(int(np.asarray(v["local"]).size) for v in al.values())
    measured = {
        "configuration": name,
        "local_heads": n_local,
        "offset_local_heads": {k: c["count"] for k, c in counts.items()},
        "where": {k: c["where"][:4] for k, c in counts.items()},
    }
    conds = (
        Precondition(
            "local head",
            sum(n_local.values()) > 0,
            f"{sum(n_local.values())} of {heads} heads in {len(al)} runs are local"
            if sum(n_local.values())
            else f"no ViT of the study has a local head (0 of {heads} heads in {len(al)} runs), so offset local heads "
            "cannot appear",
            {"heads": heads},
        ),
        Precondition(
            "runs",
            len(al) >= MIN_SEEDS,
            f"{len(al)} ViT runs measured (the rule needs {MIN_SEEDS})",
            {"runs": len(al)},
        ),
    )
    have = [c["count"] > 0 for c in counts.values()]
    counted = (
        Decision(
            HELD if all(have) else NOT_HELD if not any(have) else INCONCLUSIVE,
            f"{sum(have)} of {len(have)} ViT runs have an offset local head.",
            (),
            (),
        )
        if have
        else Decision(NOT_TESTABLE, "No ViT run has an aligned_attention result to count.", (), ())
    )
    if not all(c.passed for c in conds):
        failed = "; ".join(c.sentence for c in conds if not c.passed)
        d = Decision(NOT_TESTABLE, failed[0].upper() + failed[1:] + ".", (), (), conds)
    else:
        d = Decision(counted.outcome, counted.why, (), (), conds)
    d_fig = storage.step_dir(lruns[0].path, max(lruns[0].checkpoints), "figures")
    return Result(
        d,
        ours=f"{sum(have)} of {len(have)} runs with an offset local head; {sum(n_local.values())} of {heads} heads "
        "local",
        measured=measured,
        ungated=counted,
        figures=[
            (
                d_fig / "aligned_attention_maps.png",
                "aligned_attention",
                f"{lruns[0].name}: per offset, the mean attention over the queries that have that offset. Uniform "
                "attention is flat here, so a peak is a preference; in Walmer's aligned aggregated maps (next figure: "
                "each offset's share of all attention) uniform attention on a 7x7 grid already looks like a centred "
                "peak, because central offsets have the most queries",
            ),
            (
                d_fig / "aligned_attention_mass_maps.png",
                "aligned_attention_mass",
                f"Aligned aggregated attention maps (Walmer §4.2), {lruns[0].name}",
            ),
        ],
    )


assert LOCAL_FRACTION < LOCALITY_PRECONDITION  # a local head always passes the locality precondition
