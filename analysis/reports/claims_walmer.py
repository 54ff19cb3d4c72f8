"""Walmer et al. 2023 ("Teaching Matters") claims as rules on numbers the project computed (docs/teaching-matters.md,
docs/teaching-matters.json).

Walmer et al. compare ViTs taught by different objectives; a study here trains the same ViT on the same data once per
objective (``supervised``, ``dino``, ``mae``; recipes/studies/walmer2023.yaml) and once per seed. Each claim
(:data:`CLAIMS`) quotes the passage it tests with its figure, states the claim in the paper's direction and says the
rule; a rule function (``rule_*``) takes per-seed values keyed by objective (seed i of one objective is paired with
seed i of the other: same seed, same analysis images) and returns a :class:`~analysis.reports.claims.Verdict` with one
of the four outcomes of analysis/reports/claims.py (held / did not hold / inconclusive / not testable) and the noise
floor there: an effect counts when it exceeds ``NOISE_FACTOR`` times the largest seed-to-seed difference of the same
configuration (for a cross-model number, the configuration is the pair of objectives), and a top-1 difference also
``SE_FACTOR`` binomial standard errors. A claim of several parts holds when every part holds.

"Later half" is the blocks ``L // 2 .. L - 1`` (Walmer's "mid-to-late layers"), "first half" the others, as in
:func:`analysis.reports.claims.head_mix`. Everything is plain numpy on arrays from the measures (analysis/measures/).
"""

from __future__ import annotations

import numpy as np

from analysis.reports.claims import (
    HELD,
    INCONCLUSIVE,
    NOT_HELD,
    SE_FACTOR,
    Claim,
    Verdict,
    _finish,
    _one,
    _paired,
    _part,
    _seeds_problem,
    _untestable,
    binomial_se,
    combine,
    decide,
    offset_heads,
)

OBJECTIVES = ("supervised", "dino", "mae")  # the study's configuration names: how each ViT is taught
SOURCE = "Walmer et al. 2023"
# Walmer Table 1: best k-NN top-1 on ImageNet (CLS token, layer 12 for these), ViT-B/16; FS = fully supervised
TABLE1_KNN_TOP1 = {"supervised": 83.79, "dino": 76.06, "mae": 45.19, "random": 0.10}

CLAIMS: dict[str, Claim] = {
    c.id: c
    for c in [
        Claim(
            "offset_heads_every_objective",
            "Walmer Fig. 3, 14",
            "Every ViT learns offset local attention heads, whatever its objective",
            f"{SOURCE} §4.2",
            "We find instances of Offset Local Attention Heads in all the models examined, suggesting they are "
            "fundamentally necessary for ViTs.",
            "Precondition: some model of the study has a local head (aligned_attention local: at least half of the "
            "attention within one token of a point at most two tokens away) and every objective has two seeds. Per "
            "objective: held if every seed's model has an offset local head, did not hold if none has, inconclusive if "
            'only some seeds have; the claim holds when it holds for every objective. A "not testable" or "did not '
            'hold" rests on a detector with a positive control (tests/test_positive_control.py), which also finds offset local heads '
            "in the first half of a real pretrained DINOv2-style ViT-S/14 and none in its last blocks (docs/real-vit.md, "
            "tests/test_pretrained.py).",
            'location only (App. C.1: "Offset Local Attention Heads typically only occur in the first 3 to 6 layers" for '
            "supervised models)",
        ),
        Claim(
            "reconstruction_stays_local",
            "Walmer Fig. 4, 15",
            "Reconstruction (MAE) keeps attention local deep into the network: in the later layers its attention distance "
            "stays below the supervised and the contrastive (DINO) model's",
            f"{SOURCE} §4.3",
            "The behaviors diverge in the mid-to-late layers. For the models trained with explicit or contrastive "
            "supervision, the Attention Distance trends upward in the later layers. For the reconstruction-based methods, "
            "the Average Attention Distances stay lower.",
            "Mean attention distance (Walmer's unit square: the token grid embedded on a 1 x 1 square) over the heads and "
            "the later half of the blocks. One part per objective the study has besides mae: that objective's minus mae's "
            "must exceed the noise floor.",
        ),
        Claim(
            "reconstruction_cls_covers_more",
            "Walmer Fig. 2, 17",
            "In the later layers reconstruction (MAE) CLS attention covers more of the image than contrastive (DINO) CLS "
            "attention, which concentrates on centred blobs",
            f"{SOURCE} §4.1",
            "For the contrastive self-supervised methods, DINO and MoCo, the attention maps tend to be centered blobs. "
            "These heads tend to focus on salient foreground objects, so these blobs simply reflect object-centered "
            "photography bias. For the reconstruction-based methods, MAE and BEiT, we see a more diverse group of "
            "attention maps. This is likely because these methods must reconstruct all image regions, and thus their "
            "attention in the final layers must be more diverse and cover more of the image.",
            "Precondition: a CLS token. Entropy (nats) of the average CLS attention map over the spatial tokens "
            "(cls_attention map_entropy: the map Walmer draws, averaged over images), mean over the heads and the later "
            "half of the blocks: mae's minus dino's must exceed the noise floor. Walmer shows the maps and states no "
            "number; covering more of the image is read as a higher entropy of the average map.",
        ),
        Claim(
            "supervised_cls_sparse",
            "Walmer Fig. 2, 11",
            "In the later layers the supervised model's CLS attention falls on a few sparse positions (Sparse Repeating "
            "Patterns), more concentrated on one image than the contrastive (DINO) model's object blobs",
            f"{SOURCE} §4.1",
            "Finally, for the explicitly supervised methods, FS and CLIP, the mid-to-final layers do not focus on salient "
            "object regions and instead focus on Sparse Repeating Patterns with seemingly no spatial meaning.",
            "Precondition: a CLS token. Mean per-image entropy (nats) of the CLS attention over the spatial tokens "
            "(cls_attention entropy), mean over the heads and the later half of the blocks: dino's minus supervised's "
            'must exceed the noise floor. Walmer states no number; "sparse" (Fig. 11: "a small group of spatial token '
            'positions [...] have strong and consistent activations" on one image) is read as a lower per-image entropy.',
        ),
        Claim(
            "contrastive_beats_reconstruction",
            "Walmer Fig. 7, 9; Table 1",
            "Contrastive (DINO) CLS features at the last block are more semantic than reconstruction (MAE) ones: higher "
            "k-NN top-1 and cluster purity",
            f"{SOURCE} §5.2",
            "The contrastive methods, DINO and MoCo, achieve scores close to the explicitly supervised methods. The "
            "reconstruction-based methods, MAE and BEiT, have the lowest cluster purity",
            "CLS token at the last block. Two parts, dino minus mae per seed: k-NN top-1 (k = 20, analysis/measures/knn.py; "
            "must also exceed 2 binomial standard errors) and k-means cluster purity (analysis/measures/clustering.py); "
            "each must exceed the noise floor.",
            f"ImageNet k-NN top-1 (CLS, layer 12, Table 1): DINO {TABLE1_KNN_TOP1['dino']:.2f}, MAE {TABLE1_KNN_TOP1['mae']:.2f}",
        ),
        Claim(
            "supervised_most_semantic",
            "Walmer Fig. 7, 9; Table 1",
            "The supervised model's CLS features at the last block are the most semantic: higher k-NN top-1 and cluster "
            "purity than the contrastive (DINO) model's",
            f"{SOURCE} §5.2, §6.1",
            "Unsurprisingly, FS achieves the best cluster purity, followed by CLIP. […] As can be seen from Figure 9 "
            "(left), FS performs the best as it has been trained to classify the same dataset.",
            "CLS token at the last block. Two parts, supervised minus dino per seed: k-NN top-1 (also beyond 2 binomial "
            "standard errors) and cluster purity; each must exceed the noise floor. As in Walmer, the supervised model "
            "was trained on the labels of the same dataset the k-NN and the clustering score.",
            f"ImageNet k-NN top-1 (CLS, layer 12, Table 1): FS {TABLE1_KNN_TOP1['supervised']:.2f}, DINO {TABLE1_KNN_TOP1['dino']:.2f}",
        ),
        Claim(
            "reconstruction_cls_above_chance",
            "Walmer Fig. 7, 9; Table 1",
            "Reconstruction (MAE) CLS features are semantic although the CLS token has no objective: k-NN top-1 and "
            "cluster purity at the last block above random features",
            f"{SOURCE} §5.2, §6.1",
            "The reconstruction-based methods, MAE and BEiT, have the lowest cluster purity, but they are still above "
            "random chance, which again indicates that they do learn to encode some image-level semantic information in "
            "their CLS tokens. […] It is also interesting to see how MAE and BEiT, for which the CLS tokens have no "
            "explicit objective, do better than chance, although MAE is considerably better than BEiT.",
            "CLS token at the last block of mae. Two parts per seed: k-NN top-1 minus the same k-NN on random Gaussian "
            "features of the same shape (Walmer App. B.3; also beyond 2 binomial standard errors), and cluster purity "
            "minus the random features' purity; each must exceed the noise floor (the seed spread of the difference).",
            f"ImageNet k-NN top-1 (Table 1): MAE {TABLE1_KNN_TOP1['mae']:.2f}, random {TABLE1_KNN_TOP1['random']:.2f}",
        ),
        Claim(
            "contrastive_semantic_earlier",
            "Walmer Fig. 9 left, 7 left, 24",
            "Semantic information emerges earlier in the contrastive (DINO) model than in the supervised one: higher "
            "k-NN top-1 and cluster purity of the CLS token in the first half of the blocks",
            f"{SOURCE} §6.1",
            "DINO and MoCo follow a similar trend as Section 5.2 and better encode semantic information in the earlier "
            "layers.",
            "CLS token, mean over the first half of the blocks. Two parts, dino minus supervised per seed: k-NN top-1 "
            "(also beyond 2 binomial standard errors of the mean accuracy on the query images, an upper bound of the "
            "block mean's) and cluster purity; each must exceed the noise floor. Walmer adds (App. D.5) that the "
            'supervised models "catch up rapidly and overtake at the end": that is the last-block claim above.',
        ),
        Claim(
            "objectives_diverge_late",
            "Walmer Fig. 1, 2, 6",
            "Objectives agree early and diverge late: two ViTs taught differently are more alike at the first block than "
            "at the last (cross-model CKA of the same block)",
            f"{SOURCE} Fig. 2 caption",
            "Clear differences in attention emerge in the mid-to-late layers under different supervision methods.",
            "Walmer shows the late divergence in the attention maps (Fig. 1, 2) and compares features across objectives at "
            "the last layer only (Fig. 6); this rule carries the depth comparison to the features. For every pair of "
            "objectives, per seed (the two models of the same seed), linear CKA between the same block's outputs "
            "(analysis/offline.py cross_cka, the study's CKA options): the first block's minus the last block's must "
            "exceed the noise floor (one part per pair).",
        ),
        Claim(
            "cls_similar_by_supervision",
            "Walmer Fig. 6 left, 19",
            "At the last block the supervised model's CLS representation is closer to the contrastive (DINO) model's "
            "than to the reconstruction (MAE) model's",
            f"{SOURCE} §5.1",
            "Figure 6 (left) shows that the CLS token representations are usually similar for similar supervision "
            "strategies (explicit, contrastive, reconstruction). […] There is also an increased level of similarity "
            "between the explicitly supervised methods, FS and CLIP, and the contrastive methods.",
            "Precondition: a CLS token. Linear CKA of the last block's CLS token between two models of the same seed: "
            "CKA(supervised, dino) minus CKA(supervised, mae) must exceed the noise floor (the larger seed spread of the "
            "two pairs).",
        ),
        Claim(
            "residual_shift_supervised",
            "Walmer Fig. 23",
            "In the supervised model the attention sublayer's skip path stops resembling its branch in the later layers; "
            "in the contrastive (DINO) model it keeps resembling it",
            f"{SOURCE} App. D.4",
            "For CLIP and FS we can see a similar trend, initially the skip connection carries similar information as "
            "the normal path but after a certain point the information it carries becomes very different (dark regions). "
            "[…] For MoCo and DINO, this shift in behavior does not happen and as the depth increases the skip "
            "connections and normal pathways still have similar representations.",
            "CKA between the attention sublayer's skip input z and its branch f(z) in the same block "
            "(analysis/measures/residual_cka.py skip_branch, the diagonal of Walmer's Fig. 23). Two parts: supervised's "
            "first-half mean minus its later-half mean (the shift), and the later-half mean of dino minus supervised; "
            "each must exceed the noise floor.",
        ),
    ]
}


# ------------------------------------------------------------------------------------------------ numbers per model


def halves(per_block) -> dict:
    """``per_block`` [L] or [L, H] (heads averaged): ``first`` / ``later`` the mean over blocks ``< L // 2`` / ``>= L // 2``
    (the first block counts as "first" when L = 1), ``first_block`` / ``last_block`` the first and last block's value."""
    v = np.asarray(per_block, dtype=float)
    v = v.reshape(len(v), -1).mean(1)
    h = len(v) // 2
    return {
        "first": float(v[: max(h, 1)].mean()),
        "later": float(v[h:].mean()),
        "first_block": float(v[0]),
        "last_block": float(v[-1]),
    }


def pair_name(a: str, b: str) -> str:
    return f"{a} vs {b}"


# ------------------------------------------------------------------------------------------------ preconditions


def _absent(values: dict, need, what: str) -> str | None:
    """A sentence when an objective in ``need`` has no values (the study lacks it, or the measure gave nothing)."""
    missing = [o for o in need if not values.get(o)]
    if missing:
        return (
            f"no {what} for {', '.join(missing)} (the study has no such configuration, its model lacks what the "
            "measure needs, or the measure was not run at its last checkpoint)"
        )
    return None


def _present(values: dict, need, what: str) -> tuple[str | None, str | None]:
    """(why the rule cannot run at all, why its outcome cannot be judged): a missing objective, then fewer than two
    seeds of one (the effects are still measured and shown)."""
    absent = _absent(values, need, what)
    return absent, None if absent else _seeds_problem({o: values[o] for o in need})


def _with_se(name: str, v: Verdict, se: float) -> str:
    """Re-decide part ``name`` (already measured by _part / _one) against max(noise floor, SE_FACTOR x ``se``)."""
    thr = max(v.noise_floor[name]["threshold"], SE_FACTOR * se)
    v.noise_floor[name].update(binomial_se=se, threshold=thr)
    out = decide(v.measured[name]["effect"], thr)
    v.why += f"{name} with {SE_FACTOR:g} SE: threshold {thr:.4f} ({out}); "
    return out


def _diff_se(a: list[dict], b: list[dict]) -> float:
    """Binomial standard error of the mean over paired seeds of a top-1 difference (``top1`` on ``n`` images each)."""
    k = _paired(a, b)
    return float(
        np.sqrt(
            sum(binomial_se(x["top1"], x["n"]) ** 2 + binomial_se(y["top1"], y["n"]) ** 2 for x, y in zip(a[:k], b[:k]))
        )
        / k
    )


# ------------------------------------------------------------------------------------------------ rules


def rule_offset_heads(runs: dict[str, list[dict]]) -> Verdict:
    """``runs``: objective -> per seed {"local": [L, H] bool, "offset_local": [L, H] bool} (aligned_attention)."""
    local = {o: [int(np.asarray(r["local"], dtype=bool).sum()) for r in rs] for o, rs in runs.items()}
    counts = {o: [offset_heads(r["offset_local"]) for r in rs] for o, rs in runs.items()}
    heads = sum(int(np.asarray(r["local"]).size) for rs in runs.values() for r in rs)
    measured = {
        "local_heads": local,
        "offset_local_heads": {o: [c["count"] for c in cs] for o, cs in counts.items()},
        "where": {o: [c["where"][:4] for c in cs] for o, cs in counts.items()},
    }
    n_runs = sum(len(rs) for rs in runs.values())
    absent = _absent(runs, runs, "aligned_attention result")
    if absent:
        return _untestable(absent, **measured)
    if len(runs) < 2:
        return _untestable(
            f"{len(runs)} objective(s) with an aligned_attention result ({', '.join(runs) or 'none'}): "
            "the claim is about models taught differently",
            **measured,
        )
    if sum(map(sum, local.values())) == 0:
        return _untestable(
            f"no model of the study has a local head (0 of {heads} heads in {n_runs} runs of "
            f"{', '.join(runs)}), so offset local heads cannot appear",
            ours=f"0 of {heads} heads local" if heads else None,
            **measured,
        )
    p = _seeds_problem(runs)
    if p:
        return _untestable(p, **measured)
    parts, why, ours = [], [], []
    for o, cs in counts.items():
        have = [c["count"] > 0 for c in cs]
        parts.append(HELD if all(have) else NOT_HELD if not any(have) else INCONCLUSIVE)
        why.append(
            f"{o}: {sum(have)} of {len(have)} seeds have one ({', '.join(str(c['count']) for c in cs)} offset local "
            f"of {', '.join(str(n) for n in local[o])} local heads, by seed; {parts[-1]})"
        )
        ours.append(f"{o} {sum(have)} of {len(have)} seeds")
    return Verdict(
        combine(parts),
        measured=measured,
        noise_floor={o: f"{sum(c['count'] > 0 for c in cs)} of {len(cs)} seeds" for o, cs in counts.items()},
        why="; ".join(why) + ".",
        ours="; ".join(ours),
    )


def rule_reconstruction_local(distances: dict[str, list]) -> Verdict:
    """``distances``: objective -> per seed attention distances [L, H] (unit square)."""
    others = [o for o in ("supervised", "dino") if distances.get(o)]
    if not others:
        return _untestable("no attention distance for supervised or dino: the claim compares mae with them")
    absent, p = _present(distances, ("mae", *others), "attention distance")
    if absent:
        return _untestable(absent)
    later = {o: [halves(d)["later"] for d in distances[o]] for o in ("mae", *others)}
    v = Verdict(INCONCLUSIVE)
    parts = [_part(f"later-half attention distance, {o} - mae", later[o], later["mae"], v) for o in others]
    return _finish(v, parts, p)


def _later_half_difference(values: dict[str, list], a: str, b: str, name: str) -> Verdict:
    """Later-half mean of per seed [L, H] ``values``, objective ``a`` minus ``b``, against the noise floor."""
    absent, p = _present(values, (a, b), "CLS attention map")
    if absent:
        return _untestable(absent)
    later = {o: [halves(e)["later"] for e in values[o]] for o in (a, b)}
    v = Verdict(INCONCLUSIVE)
    return _finish(v, [_part(name, later[a], later[b], v)], p)


def rule_cls_covers_more(map_entropy: dict[str, list]) -> Verdict:
    """``map_entropy``: objective -> per seed cls_attention map_entropy [L, H] (absent for a model without CLS)."""
    return _later_half_difference(
        map_entropy, "mae", "dino", "later-half entropy of the average CLS map, mae - dino (nats)"
    )


def rule_cls_sparse(entropy: dict[str, list]) -> Verdict:
    """``entropy``: objective -> per seed cls_attention entropy [L, H] (mean per-image entropy)."""
    return _later_half_difference(
        entropy, "dino", "supervised", "later-half per-image CLS attention entropy, dino - supervised (nats)"
    )


def rule_more_semantic(knn: dict[str, list[dict]], purity: dict[str, list[float]], better: str, worse: str) -> Verdict:
    """``knn``: objective -> per seed {"top1", "n"} (last block, CLS); ``purity``: objective -> per seed cluster purity
    (last block, CLS). ``better`` minus ``worse`` in both."""
    need = (better, worse)
    absent, p = _present(knn, need, "k-NN result on a CLS token")
    absent = absent or _absent(purity, need, "clustering result on a CLS token")
    if absent:
        return _untestable(absent)
    v = Verdict(INCONCLUSIVE)
    name = f"last-block k-NN top-1, {better} - {worse}"
    _part(name, [r["top1"] for r in knn[better]], [r["top1"] for r in knn[worse]], v)
    parts = [
        _with_se(name, v, _diff_se(knn[better], knn[worse])),
        _part(f"last-block cluster purity, {better} - {worse}", purity[better], purity[worse], v),
    ]
    mean = {o: float(np.mean([r["top1"] for r in knn[o]])) for o in need}
    v.ours = (
        f"k-NN top-1 {better} {100 * mean[better]:.2f}, {worse} {100 * mean[worse]:.2f}; cluster purity "
        f"{better} {np.mean(purity[better]):.3f}, {worse} {np.mean(purity[worse]):.3f}"
    )
    return _finish(v, parts, p)


def rule_above_chance(knn: list[dict], purity: list[dict]) -> Verdict:
    """``knn``: per seed {"top1", "n", "baseline"}; ``purity``: per seed {"value", "baseline"} (mae, last block, CLS)."""
    absent, p = _present({"mae": knn if purity else []}, ("mae",), "k-NN and clustering result on a CLS token")
    if absent:
        return _untestable(absent)
    v = Verdict(INCONCLUSIVE)
    name = "last-block k-NN top-1, mae - random features"
    _one(name, [r["top1"] - r["baseline"] for r in knn], v)
    se = float(
        np.sqrt(sum(binomial_se(r["top1"], r["n"]) ** 2 + binomial_se(r["baseline"], r["n"]) ** 2 for r in knn))
    ) / len(knn)
    parts = [
        _with_se(name, v, se),
        _one("last-block cluster purity, mae - random features", [r["value"] - r["baseline"] for r in purity], v),
    ]
    v.ours = (
        f"k-NN top-1 MAE {100 * np.mean([r['top1'] for r in knn]):.2f}, random "
        f"{100 * np.mean([r['baseline'] for r in knn]):.2f}"
    )
    return _finish(v, parts, p)


def rule_semantic_earlier(knn: dict[str, list[dict]], purity: dict[str, list]) -> Verdict:
    """``knn``: objective -> per seed {"curve": k-NN top-1 by block [L], "n"}; ``purity``: objective -> per seed cluster
    purity by block [L] (CLS token). First-half means, dino minus supervised."""
    need = ("dino", "supervised")
    absent, p = _present(knn, need, "k-NN result on a CLS token")
    absent = absent or _absent(purity, need, "clustering result on a CLS token")
    if absent:
        return _untestable(absent)
    first = {o: [{"top1": halves(r["curve"])["first"], "n": r["n"]} for r in knn[o]] for o in need}
    v = Verdict(INCONCLUSIVE)
    name = "first-half k-NN top-1, dino - supervised"
    _part(name, [r["top1"] for r in first["dino"]], [r["top1"] for r in first["supervised"]], v)
    parts = [
        _with_se(name, v, _diff_se(first["dino"], first["supervised"])),
        _part(
            "first-half cluster purity, dino - supervised",
            [halves(c)["first"] for c in purity["dino"]],
            [halves(c)["first"] for c in purity["supervised"]],
            v,
        ),
    ]
    return _finish(v, parts, p)


def rule_diverge_late(same_index: dict[str, list]) -> Verdict:
    """``same_index``: "a vs b" -> per seed cross-model CKA of the same block's output [L] (first to last block)."""
    if not same_index:
        return _untestable("no pair of objectives with a cross-model CKA (the study needs two objectives)")
    if any(len(c[0]) < 2 for c in same_index.values() if c):
        return _untestable("a model with one block has no first and last block to compare")
    p = _seeds_problem(same_index)
    v = Verdict(INCONCLUSIVE)
    parts = []
    for pair, curves in same_index.items():
        h = [halves(c) for c in curves]
        parts.append(_one(f"{pair}: first block - last block CKA", [x["first_block"] - x["last_block"] for x in h], v))
        v.measured[f"{pair}: first, last block CKA"] = [[x["first_block"], x["last_block"]] for x in h]
    return _finish(v, parts, p)


def rule_cls_groups(last_cls: dict[str, list[float]]) -> Verdict:
    """``last_cls``: "a vs b" -> per seed CKA of the last block's CLS token between the two models."""
    near, far = pair_name("supervised", "dino"), pair_name("supervised", "mae")
    absent, p = _present(last_cls, (near, far), "last-block CLS CKA")
    if absent:
        return _untestable(absent)
    v = Verdict(INCONCLUSIVE)
    parts = [_part(f"last-block CLS CKA, ({near}) - ({far})", last_cls[near], last_cls[far], v)]
    v.ours = f"CKA {near} {np.mean(last_cls[near]):.3f}, {far} {np.mean(last_cls[far]):.3f}"
    return _finish(v, parts, p)


def rule_residual_shift(skip_branch: dict[str, list]) -> Verdict:
    """``skip_branch``: objective -> per seed residual_cka skip_branch of the attention sublayer [L]."""
    absent, p = _present(skip_branch, ("supervised", "dino"), "residual CKA")
    if absent:
        return _untestable(absent)
    if len(skip_branch["supervised"][0]) < 2:
        return _untestable("a model with one block has no first and later half to compare")
    hs, hd = [halves(s) for s in skip_branch["supervised"]], [halves(s) for s in skip_branch["dino"]]
    v = Verdict(INCONCLUSIVE)
    parts = [
        _one("supervised: first-half - later-half skip/branch CKA", [h["first"] - h["later"] for h in hs], v),
        _part("later-half skip/branch CKA, dino - supervised", [h["later"] for h in hd], [h["later"] for h in hs], v),
    ]
    return _finish(v, parts, p)
