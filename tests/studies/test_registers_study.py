"""The register study's claims (analysis/studies/registers/) on synthetic token_norms and k-NN results with known
answers: outliers without registers and none with them (held), no outliers at all (the register claims not
testable at this budget, with the numbers), and the equivalence test of "registers cost nothing"."""

import numpy as np
from test_claims import FakeRun

from analysis.studies import claims as C
from analysis.studies.registers import PAPER

rng = np.random.default_rng(0)


def _tn(share: float, blocks: int = 6) -> dict:
    s = np.full(blocks, 0.0)
    s[3] = share  # the outliers live in block 3
    return {
        "share_images": s,
        "max_over_median": np.where(s > 0, 9.0, 1.5),
        "attn_cls_on_outliers": np.full(blocks, 0.4 + rng.uniform(0, 0.05)),
        "attn_uniform_on_outliers": np.full(blocks, 0.02),
        "probe_acc_normal": np.full(blocks, 0.9),
        "probe_acc_outlier": np.full(blocks, 0.1 + rng.uniform(0, 0.05)),
    }


def _knn(top1: float) -> dict:
    return {"pools": ["cls", "mean_spatial"], "acc": np.array([[0.5, top1], [0.4, 0.5]])}


class Ctx:
    def __init__(self, tmp, reg0: list, reg4: list, knn0=None, knn4=None, size=(6, 96)):
        self.configs, self.results, self.shared = {}, {}, {}  # shared: as the report's Context
        for c, tns, kn in (("vit_reg0", reg0, knn0), ("vit_reg4", reg4, knn4)):
            self.configs[c] = []
            for i, t in enumerate(tns):
                r = FakeRun(f"{c}_s{i}", tmp, depth=size[0], width=size[1])
                self.configs[c].append(r)
                self.results[(r.name, "token_norms")] = t
                if kn is not None:
                    self.results[(r.name, "knn")] = _knn(kn[i])

    def last(self, run, measure, step=None, optional=False):
        res = self.results.get((run.name, measure))
        if res is None and not optional:
            raise C.MissingResult(f"{measure} was not measured on {run.name}")
        return res


def _run(ctx) -> dict:
    return {c.id: r for c, r in C.run_claims(PAPER, ctx)}


def test_outliers_without_registers_and_none_with_them(tmp_path):
    out = _run(
        Ctx(
            tmp_path,
            [_tn(0.30 + e) for e in (0.0, 0.02, -0.02)],
            [_tn(0.0) for _ in range(3)],
            knn0=[0.800, 0.805, 0.798],
            knn4=[0.801, 0.803, 0.799],
            size=(24, 1024),  # ViT-L: Darcet's regime
        )
    )
    for cid in ("outliers_appear", "registers_remove_outliers", "outliers_absorb_attention", "outliers_lose_position"):
        assert out[cid].outcome == C.HELD, (cid, out[cid].why)
    assert out["registers_cost_nothing"].outcome == C.HELD  # within +-1 point: equivalent
    assert out["registers_cost_nothing"].decision.parts[0].test.startswith("TOST")


def test_no_outliers_at_this_budget_is_said_with_the_numbers(tmp_path):
    out = _run(Ctx(tmp_path, [_tn(0.0) for _ in range(3)], [_tn(0.0) for _ in range(3)], [0.8] * 3, [0.7, 0.71, 0.69]))
    appear = out["outliers_appear"]  # a 6 x 96 ViT: outside Darcet et al.'s regime, said with its numbers
    assert "6 blocks x 96" in appear.outside_regime
    assert "0.000, 0.000, 0.000" in appear.outside_regime and "1.50" in appear.outside_regime  # measured
    # no outliers on any seed: no seed-to-seed variation to test (stats.DEGENERATE, never p = 0)
    assert appear.outcome == C.NOT_TESTABLE and "No seed-to-seed variation in" in appear.why, appear.why
    same = _run(  # the same numbers on a ViT-L-sized model: the same verdict, inside the paper's regime
        Ctx(tmp_path, [_tn(0.0) for _ in range(3)], [_tn(0.0) for _ in range(3)], [0.8] * 3, [0.8] * 3, (24, 1024))
    )
    assert same["outliers_appear"].outcome == C.NOT_TESTABLE and same["outliers_appear"].outside_regime is None
    assert "No seed-to-seed variation in" in same["outliers_appear"].why
    claims = PAPER.claims
    table = "\n".join(C.glance([(claims[k], out[k]) for k in out]))
    assert "(outside the paper's regime)" in table and "1 of them judged outside the paper's regime" in table
    rec = C.record(claims["outliers_appear"], appear)
    assert "6 blocks x 96" in rec["outside_regime"] and rec["preregistered"]["fixed_after_data"] is False
    removed = out["registers_remove_outliers"]
    assert removed.outcome == C.NOT_TESTABLE and "No outliers at this budget" in removed.why and "1.50" in removed.why
    assert out["outliers_lose_position"].outcome == C.NOT_TESTABLE
    assert out["registers_cost_nothing"].outcome == C.NOT_HELD  # 10 points lost: beyond the margin


def test_positive_control_finds_a_token_planted_in_a_trained_model(tmp_path, monkeypatch):
    """The detector's positive control (control.py) on a trained tiny ViT: the centre token of the middle block,
    rescaled to 5x and 10x its image's median norm, is found in every image at its place; the untouched model has no
    outlier there; a second report reads the numbers from the study folder's cache."""
    import types

    import yaml
    from conftest import TINY, _merge

    from analysis.engine import suite as S
    from analysis.results import runs as RF
    from analysis.studies.registers import control as K
    from train.recipe import load_recipe
    from train.trainer import train

    p = tmp_path / "tiny.yaml"
    p.write_text(yaml.safe_dump(_merge(TINY, {"callbacks": [], "run": {"root": str(tmp_path / "runs")}})))
    run = RF.open_run(train(load_recipe(p), progress=False)["run_dir"])
    study = types.SimpleNamespace(root=tmp_path, suite_options=lambda ms: S.suite_options(ms, 32))
    e = K.planted(run, study)
    assert e["block"] == 1 and e["position"] == [3, 3] and e["grid"] == [7, 7]  # depth 2; the 7x7 grid's centre
    assert e["clean"]["share_images"] == 0.0
    for f in ("10", "5"):
        assert K.passed(e[f]) and e[f]["count"] == 1.0, e[f]
    monkeypatch.setattr(S, "run_suite", lambda *a, **k: (_ for _ in ()).throw(AssertionError("recomputed")))
    assert K.planted(run, study) == e
