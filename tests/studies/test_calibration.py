"""Issue 40: a similarity claim says whether its conclusion survives calibration against the permutation null and a
second measure (analysis/studies/calibration.py), beside its verdict. Simulated layers through the similarity measure's
own map (analysis/measures/similarity.py): structure that is pure null (raw biased CKA high and uniform on independent
layers, as at small n and large width) does not survive; shared structure does. Hand-made maps check each claim's
reading against numbers worked by hand, the "not measured" path, the lower-is-more-alike direction, and the JSON keys
each claim's record carries."""

import json

import numpy as np
import pytest
import torch

from analysis.measures.similarity import SimilarityOptions, similarity_map
from analysis.studies import calibration as CAL
from analysis.studies import claims as C
from analysis.studies import papers
from analysis.studies.raghu2021 import PAPER as RAGHU
from analysis.studies.raghu2021 import claims as RC
from analysis.studies.stats import Decision
from analysis.studies.walmer2023 import claims as WC

# rbf_cka is biased (HSIC_0): on independent layers of n = 24 images and 400 features it reads ~0.9 (pure null)
OPTS = SimilarityOptions(estimator="rbf_cka", second="mutual_knn", n_perm=60, k=3, images=24)


def _map(layers) -> dict:
    """A model's self-map and its null, as the measure computes them, with the measure's labels."""
    out = similarity_map([torch.as_tensor(x, dtype=torch.float32) for x in layers], None, OPTS)
    return {**out, "estimator": OPTS.estimator, "alpha": OPTS.alpha, "labels": [f"{i}.mlp" for i in range(len(layers))]}


def _independent(rng, n=24, d=400, layers=4):
    return [rng.standard_normal((n, d)) for _ in range(layers)]


def _shared(rng, n=24, d=400, layers=4, noise=0.3):
    """Every layer a noisy copy of one representation: the layers share their structure across images."""
    base = rng.standard_normal((n, d))
    return [base + noise * rng.standard_normal((n, d)) for _ in range(layers)]


def _staged(rng, n=24, d=400):
    """A ResNet-like map in two stages: layers 0-1 share one representation, layers 2-3 another."""
    a, b = rng.standard_normal((n, d)), rng.standard_normal((n, d))
    return [x + 0.3 * rng.standard_normal((n, d)) for x in (a, a, b, b)]


def test_pure_null_structure_looks_uniform_raw_and_does_not_survive_calibration():
    rng = np.random.default_rng(0)
    vit = [_map(_independent(rng)) for _ in range(2)]  # no shared structure at all
    resnet = [_map(_staged(rng, d=20)) for _ in range(2)]  # narrower: its null reads lower
    off = ~np.eye(4, dtype=bool)
    assert np.asarray(vit[0]["score"])[off].min() > 0.8  # raw: near-uniform and high, as a "uniform" ViT map looks
    res = CAL.assess(RC.uniformity_readings(vit, resnet))
    mean_offdiag = res["readings"][0]
    assert mean_offdiag["raw"] > 0  # raw: the ViT map is "more uniform" than the staged one ...
    assert mean_offdiag["significant_share"] == 0.0  # ... but none of its layer pairs is beyond chance
    assert abs(mean_offdiag["calibrated"] + np.mean([np.asarray(r["excess"])[off].mean() for r in resnet])) < 0.02
    assert res["survives"] is False and "does not survive calibration" in res["sentence"]
    second = CAL.assess(RC.uniformity_readings(vit, resnet), "second_")
    assert second["measure"] == "mutual_knn" and second["survives"] is False


def test_shared_structure_survives_calibration_and_the_second_measure():
    rng = np.random.default_rng(1)
    vit = [_map(_shared(rng)) for _ in range(2)]
    resnet = [_map(_staged(rng)) for _ in range(2)]
    res = CAL.assess(RC.uniformity_readings(vit, resnet))
    assert res["survives"] is True, res["sentence"]
    assert all(o["significant_share"] == 1.0 and o["calibrated"] > 0 for o in res["readings"])
    # the headline numbers are the first reading's, the contrast of the means over seeds (worked by hand here)
    off = ~np.eye(4, dtype=bool)
    want = np.mean([np.asarray(r["excess"])[off].mean() for r in vit]) - np.mean(
        [np.asarray(r["excess"])[off].mean() for r in resnet]
    )
    assert res["calibrated"] == pytest.approx(want, abs=1e-12)
    assert res["raw"] - res["readings"][0]["null_mean"] == pytest.approx(res["calibrated"], abs=1e-9)
    assert CAL.assess(RC.uniformity_readings(vit, resnet), "second_")["survives"] is True


def _hand(score, null_mean, p_fwer, null_sd=0.1, lower=0, second=True) -> dict:
    """A hand-made similarity result: every array from the three given, as the measure defines them."""
    s, m = np.asarray(score, dtype=float), np.asarray(null_mean, dtype=float)
    r = {
        "score": s,
        "null_mean": m,
        "null_sd": np.full(s.shape, null_sd),
        "excess": s - m,
        "z": (s - m) / null_sd,
        "p_fwer": np.asarray(p_fwer, dtype=float),
        "lower": lower,
        "estimator": "procrustes" if lower else "cka",
        "alpha": 0.05,
        "n_perm": 200,
        "n_images": 1000,
        "labels": ["0.mlp", "1.mlp", "2.mlp", "3.mlp"][: s.shape[0]],
    }
    if second:
        r.update({f"second_{k}": r[k] for k in ("score", "null_mean", "null_sd", "excess", "z", "p_fwer", "n_perm")})
        r.update(second_lower=0, second_estimator="mutual_knn", second_n_images=1000)
    return r


def test_partition_reading_is_the_across_mean_worked_by_hand():
    m = np.full((4, 4), 0.8)
    p = np.full((4, 4), 0.001)
    normal = [_hand(m, np.full((4, 4), 0.3), p)]
    cut = np.full((4, 4), 0.8)
    cut[:2, 2:] = cut[2:, :2] = 0.35  # no skip at block 2: across the partition barely above the null
    noskip = {2: [_hand(cut, np.full((4, 4), 0.3), np.full((4, 4), 0.5))]}
    o = CAL.read(RC.partition_readings(normal, noskip)[0])
    assert o["raw"] == pytest.approx(0.8 - 0.35) and o["calibrated"] == pytest.approx(0.5 - 0.05)
    assert o["null_mean"] == pytest.approx(0.0) and o["z"] == pytest.approx(4.5)
    assert o["p_fwer"] == [pytest.approx(0.001)] and o["significant_share"] == 1.0 and o["survives"]
    # the same maps where the normal ViT's across cells are at chance: the partition does not survive
    normal[0]["p_fwer"] = np.where(np.outer([1, 1, 0, 0], [0, 0, 1, 1]).astype(bool), 0.4, 0.001)
    assert not CAL.read(RC.partition_readings(normal, noskip)[0])["survives"]


def test_drift_reading_subtracts_the_ceiling_and_rests_on_the_lower_half():
    sub = np.diag([0.9, 0.8, 0.4, 0.3])
    ceil = np.diag([0.9, 0.9, 0.7, 0.7])
    null = np.full((4, 4), 0.1)
    smallest = [_hand(sub, null, np.diag([0.001, 0.002, 0.3, 0.5]) + (1 - np.eye(4)))]
    ceiling = [_hand(ceil, null, np.full((4, 4), 0.001))]
    o = CAL.read(RC.drift_readings(smallest, ceiling, 0.03)[0])
    assert o["raw"] == pytest.approx((0.85 - 0.35) - (0.9 - 0.7))  # gap minus the ceiling's gap
    assert o["calibrated"] == pytest.approx(o["raw"])  # a constant null cancels in a gap
    assert o["significant_share"] == 1.0 and o["survives"]  # the two lower-half diagonal cells
    assert "minus the ceiling" in o["name"]
    alone = CAL.read(RC.drift_readings(smallest, None, 0.03)[0])
    assert alone["raw"] == pytest.approx(0.5)


def test_a_distance_survives_when_smaller_means_more_alike():
    near = [_hand([[0.2]], [[0.9]], [[0.001]], lower=1)]  # Procrustes distance: supervised vs dino well below null
    far = [_hand([[0.8]], [[0.9]], [[0.3]], lower=1)]
    o = CAL.read(WC.cls_readings(near, far)[0])
    assert o["calibrated"] == pytest.approx(-0.6) and o["lower"] and o["survives"]
    assert not CAL.read(WC.cls_readings(far, near)[0])["survives"]


def test_absent_maps_are_not_measured_and_a_missing_second_estimator_is_said_so():
    readings = RC.uniformity_readings([None, None], [None])
    cal = CAL.assess(readings)
    assert cal["survives"] is None and cal["raw"] is None and cal["readings"] == []
    assert "not measured (add similarity to the study's measures)" in cal["sentence"]
    maps = [_hand(np.eye(2) * 0.5 + 0.4, np.full((2, 2), 0.3), np.full((2, 2), 0.01), second=False)]
    second = CAL.assess(WC.cls_readings(maps, maps), "second_")
    assert second["survives"] is None and "set the similarity option second" in second["sentence"]


def test_every_similarity_claim_records_calibration_and_second_measure(tmp_path):
    maps = [_hand(np.full((4, 4), 0.8), np.full((4, 4), 0.2), np.full((4, 4), 0.001)) for _ in range(2)]
    low = [_hand(np.full((4, 4), 0.4), np.full((4, 4), 0.2), np.full((4, 4), 0.001)) for _ in range(2)]
    r = CAL.attach(C.Result(Decision(C.HELD, "held.", (), ())), RC.uniformity_readings(maps, low))
    assert r.outcome == C.HELD  # beside the verdict: unchanged
    rec = C.record(RAGHU.claims["uniformity"], r)
    json.dumps(rec)
    for key in ("calibration", "second_measure"):
        assert set(rec[key]) == {"survives", "measure", "readings", "raw", "calibrated", "z", "p_fwer", "sentence"}
        assert rec[key]["survives"] is True
        assert set(rec[key]["readings"][0]) >= {"name", "raw", "null_mean", "calibrated", "z", "p_fwer", "survives"}
    assert rec["second_measure"]["measure"] == "mutual_knn"
    text = "\n".join(r.lines)
    assert "| mean off-diagonal similarity, ViT - ResNet | cka | +0.4 |" in text
    assert "The conclusion survives calibration" in text and "The conclusion survives a second measure" in text
    # a claim that reads no similarity carries both keys, null
    other = C.record(RAGHU.claims["erf"], C.Result(Decision(C.HELD, "held.", (), ())))
    assert other["calibration"] is None and other["second_measure"] is None


def test_the_similarity_claims_state_the_rule_and_the_threshold_is_preregistered_beside_the_verdicts():
    walmer = papers()["walmer2023"]
    for paper, ids in (
        (RAGHU, ("uniformity", "noskip_partition", "data_drift")),
        (walmer, ("cls_similar_by_supervision",)),
    ):
        pre = paper.preregistered
        assert pre["calibrated_share"] is CAL.SURVIVE_SHARE and CAL.SURVIVE_SHARE.kind == "beside"
        assert not any("calibrated_share" in g for g in pre.gates.values())  # no verdict reads it
        for cid in ids:
            assert CAL.RULE in paper.claims[cid].rule, cid


def test_the_second_estimator_is_the_same_map_as_computing_it_alone():
    rng = np.random.default_rng(2)
    xs = [torch.as_tensor(x, dtype=torch.float32) for x in _shared(rng, n=16, d=30, layers=3)]
    both = similarity_map(xs, None, OPTS)
    alone = similarity_map(xs, None, SimilarityOptions(estimator="mutual_knn", n_perm=60, k=3, images=24))
    for k in ("score", "null_mean", "z", "p_fwer"):
        np.testing.assert_allclose(both[f"second_{k}"], alone[k], atol=1e-12)
    assert both["second_estimator"] == "mutual_knn" and "second_second_score" not in both
    assert "another estimator" in SimilarityOptions(estimator="cka", second="cka").check()


def test_a_reading_whose_raw_contrast_points_against_its_claim_part_is_said_to_read_another_representation():
    """The similarity maps (block outputs, mean spatial token) may read a contrast the claim's own maps (the paper's
    layer set) do not: when a reading's raw contrast and the effect of the part it stands beside (``Reading.part``)
    have opposite signs, the report says the two differ before any calibration, and the record lists them."""
    from analysis.studies import stats as S

    maps = [_hand(np.full((4, 4), 0.8), np.full((4, 4), 0.2), np.full((4, 4), 0.001)) for _ in range(2)]
    low = [_hand(np.full((4, 4), 0.4), np.full((4, 4), 0.2), np.full((4, 4), 0.001)) for _ in range(2)]
    readings = RC.uniformity_readings(maps, low)
    assert [rd.part for rd in readings] == ["mean_offdiag", "first_last"]
    against = S.two_sample_part("mean_offdiag", [0.50, 0.52, 0.51], [0.60, 0.61, 0.62])  # ViT - ResNet < 0
    along = S.two_sample_part("first_last", [0.70, 0.72, 0.71], [0.60, 0.61, 0.62])
    r = CAL.attach(C.Result(S.decide([against, along])), readings)
    (d,) = r.calibration["representation_differs"]
    assert d["reading"] == "mean off-diagonal similarity, ViT - ResNet" and d["part"] == "mean_offdiag"
    assert d["raw"] == pytest.approx(0.4) and d["effect"] == pytest.approx(-0.1)
    text = "\n".join(r.lines)
    assert "already points the other way (mean off-diagonal similarity, ViT - ResNet +0.4 raw, against " in text
    assert "mean_offdiag -0.1;" in text and "first_last" not in text.split("already points the other way")[1]
    json.dumps(C.record(RAGHU.claims["uniformity"], r))
    # both in the paper's direction: nothing to say
    r = CAL.attach(C.Result(S.decide([along])), readings)
    assert "representation_differs" not in r.calibration and "already points the other way" not in "\n".join(r.lines)
    # every similarity claim's readings name the claim part they stand beside
    assert RC.partition_readings(maps, {3: low})[0].part == "block 3 CKA across (normal - no skip)"
    assert (
        RC.drift_readings(maps, maps, 0.03)[0].part == "subset 0.03: lower - upper half, minus the cross-seed ceiling's"
    )
    assert WC.cls_readings(maps, low)[0].part == "last-block CLS CKA, (supervised vs dino) - (supervised vs mae)"
