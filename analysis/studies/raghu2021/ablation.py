"""Beside Raghu Fig. 8: removing block i's skip paths at test time from the normally trained ViT, against training
without them, from the ablation measure (analysis/measures/ablation.py); and how many heads matter per block.

The test-time removal is a sanity check of the study, not a claim of the paper (Raghu's passage is about training
without skips, and cutting a trained ViT's skips at test time drops top-1 to near chance): it is declared with
``sanity=True``, shown in the report and marked ``"sanity": true`` in the JSON, and left out of the tally.

The claim reads, for every seed, the ``ablation`` result of ``vit_cls``'s last checkpoint (its default options: heads
mean-ablated, skip paths removed, x = f(norm(x)) at both sublayers) and one result of each ``noskip_b{i}`` run on the
same analysis images (only its unablated top-1 is read):

    test-time cost  c_test(i)  = top1(vit_cls) - top1(vit_cls with block i's skips removed)
    training cost   c_train(i) = top1(vit_cls) - top1(noskip_b{i})

seed s of vit_cls paired with seed s of noskip_b{i} (same seed, same images): the part is the paired t of
c_test - c_train = top1(noskip_b{i}) - top1(vit_cls ablated).
"""

from __future__ import annotations

import numpy as np
from scipy.special import stdtrit

from analysis.engine.measure import as_list
from analysis.studies.claims import Result, judge, seeds
from analysis.studies.raghu2021.claims import CLAIMS, SOURCE, _absent
from analysis.studies.stats import paired_part


def _index(result: dict) -> dict[str, int]:
    return {t: n for n, t in enumerate(as_list(result["targets"]))}


def skip_costs(base: list[dict], noskip: dict[int, list[dict]]) -> dict:
    """The numbers of :data:`SKIP_TEST_TIME` from ablation results: ``base`` per seed the normal ViT's result (with
    targets ``blocks.{i}.skip`` and ``skip: remove``), ``noskip[i]`` per seed a result of the ViT trained without block
    i's skips (its ``clean_top1`` is read). Returns ``{i: {"test": [per seed], "train": [per seed], "noskip_top1":
    [...], "ablated_top1": [...], "n": images}}`` (seeds paired by position, as many as both have), or raises
    ValueError (one sentence) when the results do not fit: a skip not removed, a block not ablated, other images."""
    out = {}
    for r in base:
        if str(np.asarray(r["skip"])) != "remove":
            raise ValueError(
                "the normal ViT's ablation result replaced its skip paths (skip: replace); the rule compares "
                "removing them (skip: remove, the default)."
            )
    for i, runs in sorted(noskip.items()):
        k = min(len(base), len(runs))
        name = f"blocks.{i}.skip"
        test, train, ns, ab, ns_n = [], [], [], [], set()
        for b, r in zip(base[:k], runs[:k]):
            idx = _index(b)
            if name not in idx:
                raise ValueError(
                    f"the normal ViT's ablation result has no target {name}: run the measure with the skip family."
                )
            if int(np.asarray(b["n_images"])) != int(np.asarray(r["n_images"])):
                raise ValueError(
                    f"the normal ViT and noskip_b{i} were ablated on different numbers of images "
                    f"({int(np.asarray(b['n_images']))} vs {int(np.asarray(r['n_images']))}): analyse both on the "
                    "same images."
                )
            clean, ablated, cut = (
                float(np.asarray(b["clean_top1"])),
                float(np.asarray(b["top1"])[idx[name]]),
                float(np.asarray(r["clean_top1"])),
            )
            test.append(clean - ablated)
            train.append(clean - cut)
            ns.append(cut)
            ab.append(ablated)
            ns_n.add(int(np.asarray(b["n_images"])))
        out[i] = {"test": test, "train": train, "noskip_top1": ns, "ablated_top1": ab, "n": ns_n.pop() if ns_n else 0}
    return out


@CLAIMS.claim(
    "skip_test_time",
    figure="beside Raghu Fig. 8",
    claim="A ViT trained with skip connections depends on block i's skip paths more than training needs them: "
    "removing them at test time costs more top-1 than training the ViT without them",
    source=f"{SOURCE} §6, Fig. 8 caption (the training-time cost; the test-time removal is this study's counterpart)",
    passage="The results, in Figure 8, illustrate that removing the skip connections in a block partitions the layer "
    "representations on either side. (We note a performance drop of 4% when […] removing skip connections from "
    "middle blocks.)",
    rule="Per no-skip block i, on the same analysis images, seeds paired: test-time cost (vit_cls's top-1 minus its "
    "top-1 with block i's skip paths removed at test time, ablation target blocks.i.skip) minus training-time cost "
    "(vit_cls's top-1 minus noskip_b<i>'s, both on the analysis images: not the trainer's test top-1 that the "
    "claim on Raghu Fig. 8 reads); a paired t over seeds per block.",
    paper_value="4% top-1 drop for middle blocks trained without their skip (Fig. 8 caption); no test-time number",
    needs=("vit_cls",),
    sanity=True,  # not a claim of the paper (its passage is about training without skips), and trivially true
)
def skip_test_time(ctx) -> Result:
    ns = {int(k.rsplit("b", 1)[1]): v for k, v in ctx.configs.items() if k.startswith("noskip_b")}
    if not ns:
        return _absent("noskip_b<i>")
    base = [ctx.last(r, "ablation") for r in ctx.configs["vit_cls"]]
    return rule_skip_test_time(base, {b: [ctx.last(r, "ablation") for r in rs] for b, rs in ns.items()})


def rule_skip_test_time(base: list[dict], noskip: dict[int, list[dict]]) -> Result:
    """The claim's decision from the ablation results (arguments as :func:`skip_costs`)."""
    if not noskip:
        return _absent("noskip_b<i>")
    try:
        costs = skip_costs(base, noskip)
    except ValueError as e:
        return _absent_because(str(e))
    parts, ours = [], []
    for b, c in costs.items():
        parts.append(
            lambda c=c, b=b: paired_part(
                f"block {b}: test-time minus training-time top-1 cost", c["noskip_top1"], c["ablated_top1"]
            )
        )
        ours.append(
            f"block {b}: test time {100 * np.mean(c['test']):.1f}, training {100 * np.mean(c['train']):.1f} points"
        )
    n = next(iter(costs.values()))["n"] if costs else 0
    d = judge(parts, [seeds({"vit_cls": base, **{f"noskip_b{b}": r for b, r in noskip.items()}})])
    lines = [
        f"Both costs are top-1 on the {n} analysis images (the ablation measure's), seed for seed, so that they pair; "
        "the top-1 drop of the claim on Raghu Fig. 8 (noskip_partition) is the same training cost read on the test "
        "split by the trainer: another estimate on other images, which is why the two numbers differ.",
        "",
    ]
    return Result(
        d,
        ours="; ".join(ours) + f" (top-1 on the {n} analysis images)",
        measured={f"block {b}": c for b, c in costs.items()},
        lines=lines,
    )


def _absent_because(sentence: str) -> Result:
    from analysis.studies.stats import NOT_TESTABLE, Decision, Precondition

    s = sentence.rstrip(".")
    return Result(Decision(NOT_TESTABLE, s[0].upper() + s[1:] + ".", (), (), (Precondition("results", False, s),)))


def important_heads(results: list[dict]) -> dict:
    """Per block, how many heads cost more top-1 when mean-ablated than retraining with another seed moves it.
    ``results``: per seed the normal ViT's ablation result (``replace: mean``, with the heads family). The threshold is
    the half-width of the 95% prediction interval of one more seed's unablated top-1 on these images,
    t_{0.975, n-1} x s x sqrt(1 + 1/n) (s: the seed SD of the unablated top-1); a head counts when its top-1 drop
    exceeds it. Returns ``{"counts": [[per block] per seed], "mean": [per block], "heads": H,
    "threshold": ..., "seed_spread": ..., "why": one sentence}``; ValueError (one sentence) for results that do not
    fit."""
    if len(results) < 2:
        raise ValueError(f"{len(results)} seed(s): the noise floor needs at least two seeds of the same configuration.")
    for r in results:
        if str(np.asarray(r["replace"])) != "mean":
            raise ValueError(
                f"an ablation result replaced by '{np.asarray(r['replace'])!s}': the count is of mean ablations "
                "(replace: mean)."
            )
    clean = [float(np.asarray(r["clean_top1"])) for r in results]
    floor = float(np.std(clean, ddof=1))
    thr = float(stdtrit(len(clean) - 1, 0.975)) * floor * float(np.sqrt(1 + 1 / len(clean)))
    counts = []
    for r in results:
        kinds, heads, blocks = as_list(r["kinds"]), as_list(r["heads"]), np.asarray(r["target_block"])
        drop = np.asarray(r["top1_drop"], dtype=float)
        nb, nh = len(as_list(r["blocks"])), int(np.asarray(r["num_heads"]))
        rows = [n for n, k in enumerate(kinds) if k == "head" and "+" not in heads[n]]
        if len(rows) != nb * nh:
            raise ValueError(
                f"the ablation result holds {len(rows)} single-head targets, not all {nb} x {nh}: run it with the "
                "heads family."
            )
        c = np.zeros(nb, dtype=int)
        for n in rows:
            c[int(blocks[n])] += bool(drop[n] > thr)
        counts.append(c.tolist())
    mean = np.mean(counts, axis=0)
    why = (
        f"a head counts when mean-ablating it costs more than {100 * thr:.2f} top-1 points (the 95% prediction "
        "interval "
        f"of another seed's unablated top-1, seed SD {100 * floor:.2f}); per block, mean over {len(results)} seeds: "
        + ", ".join(f"block {b} {m:g} of {nh}" for b, m in enumerate(mean))
        + "."
    )
    return {"counts": counts, "mean": mean.tolist(), "heads": nh, "threshold": thr, "seed_sd": floor, "why": why}
