"""Rules on the ablation measure's results (analysis/measures/ablation.py) for the reproduction study, beside Raghu
Fig. 8, with the verdict machinery of analysis/reports/claims.py (the same outcomes, noise floors and factors).

Not yet wired into the study report (analysis/reports/study_report.py): the report would read, for every seed, the
``ablation`` result of ``vit_cls``'s last checkpoint (run with its default options: heads mean-ablated, skip paths
removed) and one result of each ``noskip_b{i}`` run on the same analysis images (any options: only its unablated
top-1 is read), and call :func:`rule_skip_test_time` and :func:`important_heads`.

1. :data:`SKIP_TEST_TIME` -- the cost of removing block i's skip paths AT TEST TIME from the normally trained ViT
   (target ``blocks.i.skip`` with ``skip: remove``: x = f(norm(x)) at both sublayers, the weights as trained) against
   the cost of TRAINING without them (interventions.no_skip, Raghu Fig. 8), both as top-1 on the same analysis
   images:

       test-time cost  c_test(i)  = top1(vit_cls) - top1(vit_cls with block i's skips removed)
       training cost   c_train(i) = top1(vit_cls) - top1(noskip_b{i})

   seed s of vit_cls paired with seed s of noskip_b{i}. The effect is mean_s (c_test - c_train) = mean_s (top1(
   noskip_b{i}) - top1(vit_cls ablated)); it must exceed NOISE_FACTOR x the largest seed-to-seed spread of either cost
   and SE_FACTOR binomial standard errors of that difference (the two top-1s on n images).
2. :func:`important_heads` -- per block, the number of heads whose mean ablation costs more top-1 than the seed
   noise floor: NOISE_FACTOR x the seed-to-seed spread of the unablated model's top-1 on the same images (what
   retraining with another seed changes anyway), counted per seed.
"""

from __future__ import annotations

import numpy as np

from analysis.measure import as_list
from analysis.reports import claims as C

SKIP_TEST_TIME = C.Claim(
    "skip_test_time",
    "beside Raghu Fig. 8",
    "A ViT trained with skip connections depends on block i's skip paths more than training needs them: removing them at "
    "test time costs more top-1 than training the ViT without them",
    "Raghu et al. 2021 §6, Fig. 8 caption (the training-time cost; the test-time removal is this study's counterpart)",
    "The results, in Figure 8, illustrate that removing the skip connections in a block partitions the layer "
    "representations on either side. (We note a performance drop of 4% when […] removing skip connections from middle "
    "blocks.)",
    "Per no-skip block i, on the same analysis images, seeds paired: test-time cost (vit_cls's top-1 minus its top-1 with "
    "block i's skip paths removed at test time, x = f(norm(x)), ablation target blocks.i.skip) minus training-time cost "
    "(vit_cls's top-1 minus noskip_b{i}'s) must exceed the noise floor (2x the largest seed-to-seed spread of either "
    "cost) and 2 binomial standard errors.",
    "4% top-1 drop for middle blocks trained without their skip (Fig. 8 caption); no test-time number",
)


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
                    f"({int(np.asarray(b['n_images']))} vs {int(np.asarray(r['n_images']))}): analyse both on the same images."
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


def rule_skip_test_time(base: list[dict], noskip: dict[int, list[dict]]) -> C.Verdict:
    """:data:`SKIP_TEST_TIME`'s verdict from the ablation results (arguments as :func:`skip_costs`)."""
    if not noskip:
        return C._untestable("the study has no run trained without a block's skip paths (noskip_b{i})")
    try:
        costs = skip_costs(base, noskip)
    except ValueError as e:
        return C._untestable(str(e).rstrip("."))
    p = C._seeds_problem({"vit_cls": base, **{f"noskip_b{b}": r for b, r in noskip.items()}})
    v, parts, ours = C.Verdict(C.INCONCLUSIVE), [], []
    for b, c in costs.items():
        name = f"block {b}: test-time minus training-time top-1 cost"
        C._part(name, c["test"], c["train"], v)
        k, n = len(c["test"]), c["n"]
        se = float(
            np.sqrt(
                sum(
                    C.binomial_se(t, n) ** 2 + C.binomial_se(a, n) ** 2
                    for t, a in zip(c["noskip_top1"], c["ablated_top1"])
                )
            )
        ) / max(k, 1)
        thr = max(v.noise_floor[name]["threshold"], C.SE_FACTOR * se)
        v.noise_floor[name].update(binomial_se=se, threshold=thr)
        v.measured[name].update(test_cost=c["test"], training_cost=c["train"])
        eff = v.measured[name]["effect"]
        parts.append(C.decide(eff, thr))
        v.why += f"{name} with {C.SE_FACTOR:g} SE: threshold {thr:.4f} ({parts[-1]}); "
        ours.append(
            f"block {b}: test time {100 * np.mean(c['test']):.1f}, training {100 * np.mean(c['train']):.1f} points"
        )
    v.ours = "; ".join(ours)
    return C._finish(v, parts, p)


def important_heads(results: list[dict]) -> dict:
    """Per block, how many heads cost more top-1 when mean-ablated than the seed noise floor. ``results``: per seed the
    normal ViT's ablation result (``replace: mean``, with the heads family). The floor is the seed-to-seed spread
    (max - min) of the unablated top-1 on these images, the threshold NOISE_FACTOR x it; a head counts when its
    top-1 drop exceeds the threshold. Returns ``{"counts": [[per block] per seed], "mean": [per block], "heads": H,
    "threshold": ..., "seed_spread": ..., "why": one sentence}``; ValueError (one sentence) for results that do not fit."""
    if len(results) < 2:
        raise ValueError(f"{len(results)} seed(s): the noise floor needs at least two seeds of the same configuration.")
    for r in results:
        if str(np.asarray(r["replace"])) != "mean":
            raise ValueError(
                f"an ablation result replaced by '{np.asarray(r['replace'])!s}': the count is of mean ablations (replace: mean)."
            )
    clean = [float(np.asarray(r["clean_top1"])) for r in results]
    floor = C.spread(clean)
    thr = C.NOISE_FACTOR * floor
    counts = []
    for r in results:
        kinds, heads, blocks = as_list(r["kinds"]), as_list(r["heads"]), np.asarray(r["target_block"])
        drop = np.asarray(r["top1_drop"], dtype=float)
        nb, nh = len(as_list(r["blocks"])), int(np.asarray(r["num_heads"]))
        rows = [n for n, k in enumerate(kinds) if k == "head" and "+" not in heads[n]]
        if len(rows) != nb * nh:
            raise ValueError(
                f"the ablation result holds {len(rows)} single-head targets, not all {nb} x {nh}: run it with the heads family."
            )
        c = np.zeros(nb, dtype=int)
        for n in rows:
            c[int(blocks[n])] += bool(drop[n] > thr)
        counts.append(c.tolist())
    mean = np.mean(counts, axis=0)
    why = (
        f"a head counts when mean-ablating it costs more than {100 * thr:.2f} top-1 points ({C.NOISE_FACTOR:g} x the "
        f"seed-to-seed spread {100 * floor:.2f} of the unablated top-1); per block, mean over {len(results)} seeds: "
        + ", ".join(f"block {b} {m:g} of {nh}" for b, m in enumerate(mean))
        + "."
    )
    return {"counts": counts, "mean": mean.tolist(), "heads": nh, "threshold": thr, "seed_spread": floor, "why": why}
