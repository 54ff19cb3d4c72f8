"""Training-time analysis callbacks (names for a recipe's ``callbacks:`` list).

``analysis_suite`` runs CKA, norm ratios, attention distances and few-shot probes in one pass over the
analysis split at each checkpoint (or every N steps); ``measures: [...]`` picks any registered measures instead
(``python -m analysis --list`` names them); ``cka``, ``norm_ratio``, ``attention_distance`` and
``fewshot_probe`` run one measurement each. Options: ``batch_size`` (analysis minibatch, >= 4), ``cka_repr``
(flatten | cls | mean_spatial), ``shots``, ``seeds``. Results go to TensorBoard and to
``runs/<name>/analysis/step_XXXXXXX/`` (npz arrays, summary.json) and ``runs/<name>/figures/step_XXXXXXX/`` (PNG); offline analysis
(``python -m analysis``) calls the same :func:`analysis.suite.run_suite`.
"""
from __future__ import annotations

from train.callbacks import Callback


class AnalysisSuiteCallback(Callback):
    name = "analysis_suite"
    measures: tuple = ("cka", "norm_ratio", "attention_distance", "fewshot_probe")

    def __init__(self, every: int | None = None, batch_size: int = 256, cka_repr: str = "flatten", shots: int = 10,
                 seeds: list | tuple = (0, 1, 2), figures: bool = True, measures: list | tuple | None = None):
        super().__init__(every)
        from analysis.suite import SuiteOptions, check_measures

        if batch_size < 4:
            raise TypeError("batch_size must be >= 4 for minibatch CKA")
        if measures is not None:
            try:
                check_measures(measures)
            except ValueError as e:
                raise TypeError(str(e)) from None
            self.measures = tuple(measures)
        self.opts = SuiteOptions(measures=self.measures, batch_size=batch_size, cka_repr=cka_repr, probe_shots=shots,
                                 probe_seeds=tuple(seeds))
        self.figures = figures
        self._fingerprint: str | None = None

    def validate(self, recipe, data) -> None:
        from analysis.suite import batch_problem
        from train.recipe import RecipeError

        problem = batch_problem(len(data.analysis), self.opts.batch_size)
        if problem:
            raise RecipeError(f"callback '{self.name}': {problem}")
        if {"fewshot_probe", "token_probes"} & set(self.measures):
            from analysis.probes import probe_split_problem

            problem = probe_split_problem(data, self.opts.probe_shots)
            if problem:
                raise RecipeError(f"callback '{self.name}': {problem}")

    def _run(self, ctx) -> None:
        from analysis.suite import cache_key, data_fingerprint, publish, run_suite, weights_id

        res = run_suite(ctx.model, ctx.data, self.opts, ctx.accelerator)
        if ctx.accelerator.is_main_process:
            # at a checkpoint the results are keyed by its weights, so offline analysis reuses them
            wid = weights_id(ctx.checkpoint_dir) if ctx.checkpoint_dir is not None else None
            keys = None
            if wid:
                if self._fingerprint is None:  # the analysis images do not change during a run: hash them once
                    self._fingerprint = data_fingerprint(ctx.data)
                fp = self._fingerprint
                keys = {n: cache_key(wid, fp, self.opts, n) for n in res if n != "meta"}
            d = f"step_{ctx.step:07d}"
            publish(res, ctx.run_dir / "analysis" / d, ctx.writer, ctx.step, figures=self.figures, keys=keys,
                    figure_dir=ctx.run_dir / "figures" / d)

    def on_checkpoint(self, ctx) -> None:
        self._run(ctx)

    def on_step_end(self, ctx) -> None:
        self._run(ctx)


class CKACallback(AnalysisSuiteCallback):
    name = "cka"
    measures = ("cka",)


class NormRatioCallback(AnalysisSuiteCallback):
    name = "norm_ratio"
    measures = ("norm_ratio",)


class AttentionDistanceCallback(AnalysisSuiteCallback):
    name = "attention_distance"
    measures = ("attention_distance",)


class FewShotProbeCallback(AnalysisSuiteCallback):
    name = "fewshot_probe"
    measures = ("fewshot_probe",)
