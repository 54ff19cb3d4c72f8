"""``python -m analysis RUN_DIR`` (also ``./launch.sh analyze RUN_DIR``): the analysis suite on a run's saved
checkpoints, cached, with figures, TensorBoard and report.md.

    python -m analysis runs/default                          every checkpoint, the core four measures
    python -m analysis runs/default --steps 600,1800 --measures all
    python -m analysis runs/default --measures knn,clustering --opt knn.k=10 --opt fewshot_probe.shots=5
    python -m analysis runs/vit --against runs/resnet        cross-model CKA (Raghu Fig. 2) at the last checkpoints
    python -m analysis runs/subset --against runs/full:1800  + per-layer CKA of same-index layers (Fig. 12)
    python -m analysis --model timm:vit_tiny_patch16_224 --weights vit.safetensors --recipe recipes/my_data.yaml
    python -m analysis runs/dino --part teacher              DINO's EMA teacher (results in analysis/teacher/)
    python -m analysis runs/dino --part teacher --against runs/dino   teacher vs student, layer by layer
    python -m analysis --model timm:vit_small_patch16_224.dino --weights dino_vits16.safetensors \
        --set data.img_size=224 data.in_chans=3               a public DINO ViT-S/16 (a hub model.safetensors)
    python -m analysis --model timm:vit_small_patch14_dinov2 --weights FILE --images photos
                                                              a published ViT on the bundled photos (or --images DIR)

Exit codes: 0 done; 2 bad input (one sentence on stderr naming the problem; nothing is written).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import warnings
from pathlib import Path

from analysis import offline as O
from analysis import suite as S
from analysis.measure import MeasureError, options_dict, registry
from analysis.reports.run_report import write_run_report


def options(args) -> S.SuiteOptions:
    """SuiteOptions from the command line (MeasureError, one sentence, for an unknown measure or option)."""
    names = [m.strip() for m in args.measures.split(",")] if args.measures is not None else None
    if names is not None and "" in names:
        raise MeasureError(
            f"--measures '{args.measures}' has an empty name: list names separated by single commas, e.g. cka,knn."
        )
    return S.suite_options(names, args.batch_size, S.parse_opt_args(args.opt))


def without_unlabelled(run, opts: S.SuiteOptions, asked: str | None) -> S.SuiteOptions:
    """``opts`` without the measures that need labels the images lack: skipped with one line when they came with
    ``--measures all``, refused (one sentence) when named."""
    missing = S.missing_labels(O.load_data(run), opts)
    if not missing:
        return opts
    how = (
        "put the images in one subfolder per class (DIR/<class>/...) and give probe-train images the same way "
        "(--probe-images DIR2)"
    )
    if (asked or "").strip() != "all":
        raise O.AnalysisError(
            f"measures {', '.join(missing)} read class labels, which these images do not have: {how}, or "
            "leave those measures out."
        )
    print(
        f"skipped {', '.join(missing)}: they read class labels, which these images do not have ({how}).",
        file=sys.stderr,
    )
    return dataclasses.replace(opts, measures=tuple(m for m in opts.measures if m not in missing))


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m analysis",
        description=__doc__.split("\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="\n".join(__doc__.split("\n")[2:]),
    )
    p.add_argument("run", nargs="?", help="run folder (runs/<name>)")
    p.add_argument("--steps", help="comma-separated checkpoint steps, or 'last' (default: every checkpoint)")
    p.add_argument(
        "--measures",
        help="comma-separated measure names, or 'all' (default: cka,norm_ratio,attention_distance,fewshot_probe)",
    )
    p.add_argument(
        "--part",
        help="the network of a self-supervised checkpoint to analyse: student (default; the backbone) "
        "or another part its objective saves, e.g. teacher (DINO); results go to analysis/<part>/, labelled",
    )
    p.add_argument(
        "--against",
        action="append",
        default=[],
        metavar="OTHER_RUN[:STEP]",
        help="cross-run CKA against another run's checkpoint (default its last); repeatable",
    )
    p.add_argument("--model", help="analyse a model not trained here: timm:<architecture>")
    p.add_argument("--weights", help="with --model: a .safetensors file ('pretrained' downloads timm's weights)")
    p.add_argument(
        "--recipe",
        default=None,
        help="with --model: the recipe whose data section to use (default: the project's "
        "recipes/default.yaml; with --images only its run root is used)",
    )
    p.add_argument(
        "--set",
        dest="overrides",
        action="extend",
        nargs="+",
        default=[],
        metavar="KEY=VALUE",
        help="with --model: recipe overrides, e.g. data.img_size=224 data.in_chans=3",
    )
    p.add_argument(
        "--images",
        help="with --model: analyse these images instead of a recipe's: a folder (one subfolder per class "
        "for labels; a flat folder is unlabelled) or 'photos' (19 photos that ship with scikit-image and scikit-learn, "
        "as seeded crops), prepared by the model's own timm preprocessing",
    )
    p.add_argument(
        "--probe-images", help="with --images DIR: a folder with the same class subfolders to train probes and k-NN on"
    )
    p.add_argument(
        "--preprocessing",
        choices=("model", "recipe"),
        default="model",
        help="with --model and a recipe's data: normalise by the model's pretrained mean/std (model, default) or the "
        "data's own (recipe: as a run trained here, to compare the two with --against)",
    )
    p.add_argument("--out", help="with --model: the output folder (default runs/external-<architecture>)")
    p.add_argument("--batch-size", type=int, default=256, help="analysis minibatch (also the CKA minibatch, >= 4)")
    p.add_argument(
        "--opt",
        action="append",
        default=[],
        metavar="MEASURE.OPTION=VALUE",
        help="a measure's option, e.g. --opt knn.k=10 --opt cka.repr=cls (python -m analysis --list shows them); repeatable",
    )
    p.add_argument("--force", action="store_true", help="recompute even when cached results exist")
    p.add_argument("--no-tensorboard", action="store_true")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--list", action="store_true", help="list the measures and exit")
    return p


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    if args.list:
        for name, cls in sorted(registry().items()):
            opts = ", ".join(f"{k}={v!r}" for k, v in options_dict(cls.Options()).items()) or "no options"
            print(f"{name:20s} {(cls.__doc__ or '').strip().splitlines()[0]}\n{'':20s} options: {opts}")
        return 0
    warnings.filterwarnings("ignore", message=".*pin_memory.*")
    try:
        try:
            opts = options(args)
        except MeasureError as e:
            raise O.AnalysisError(str(e)) from None
        if args.model:
            if not args.weights:
                raise O.AnalysisError(
                    "--model needs --weights FILE.safetensors (or --weights pretrained with a network)."
                )
            recipe = args.recipe or str(Path(__file__).resolve().parents[1] / "recipes" / "default.yaml")
            run = O.external_run(
                args.model,
                args.weights,
                recipe,
                args.overrides,
                args.out,
                args.images,
                args.probe_images,
                args.preprocessing,
            )
        elif args.images or args.probe_images:
            raise O.AnalysisError(
                "--images analyses a model from elsewhere: pass it with --model timm:<arch> --weights FILE."
            )
        elif args.run:
            run = O.open_run(args.run)
        else:
            raise O.AnalysisError(
                "no run given: pass a run folder (python -m analysis runs/default) or --model timm:<arch> --weights FILE."
            )
        O.select_part(run, args.part)
        steps = [s.strip() for s in args.steps.split(",")] if args.steps is not None else None
        if steps is not None and "" in steps:
            raise O.AnalysisError(
                f"--steps '{args.steps}' has an empty step: list steps separated by single commas, e.g. 600,1800."
            )
        if steps:
            [run.step(s) for s in steps]  # check them all before any work
        others = [O.parse_against(a) for a in args.against]
        for other, _ in others:
            O.check_same_images(run, other)
        opts = without_unlabelled(run, opts, args.measures)
        problem = S.problem(O.load_data(run), opts)
        if problem:
            raise O.AnalysisError(problem)
        if run.external:  # check that the weights fit before anything is written
            O.load_model(run, 0, O.load_data(run))
        stats = O.analyze_run(
            run, steps, opts, force=args.force, tensorboard=not args.no_tensorboard, progress=not args.no_progress
        )
        for other, ostep in others:
            a = O.against(
                run, other, ostep, steps[-1:] if steps else None, opts, force=args.force, progress=not args.no_progress
            )
            for step, res in a["results"].items():
                line = f"{run.label}@{step} vs {other.label}@{ostep}: mean CKA {res['matrix'].mean():.3f}"
                if "same_index" in res:
                    line += ", same-index layers " + " ".join(f"{v:.2f}" for v in res["same_index"])
                print(line)
    except O.AnalysisError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except OSError as e:  # a write refused midway (a full disk, a sub-folder not writable): the results written stay
        print(
            f"error: cannot write {e.filename or 'the results'} ({e.strerror or e}): free space or make it writable, then run "
            "this again (what was written is reused).",
            file=sys.stderr,
        )
        return 2
    if stats["not_applicable"]:
        print(
            f"{run.label}: {', '.join(stats['not_applicable'])}: not applicable to this model ({stats['model']}), nothing computed"
        )
    if stats["skipped"]:
        print(
            f"{run.label}: skipped step(s) {', '.join(map(str, stats['skipped']))}: deleted while being analysed (a trainer "
            "still running keeps only its last train.keep_last checkpoints)"
        )
    report = write_run_report(run)  # the report shows the default part; another part's results are in its own folder
    where = (
        f"results in {O.step_dir(run, stats['steps'][-1]).parent}"
        if run.part != O.DEFAULT_PART
        else f"report: {report}"
    )
    print(
        f"{run.label}: {len(stats['computed'])} results computed, {len(stats['reused'])} reused from cache "
        f"(steps {', '.join(map(str, stats['steps']))}); {where}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
