"""``python -m analysis.studies.real_vit``: the real-ViT report, by default ``runs/real-vit/real-vit.md`` beside its
cached analysis; ``--out docs/real-vit.md`` rewrites the committed one (see the package's docstring)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import analysis.studies.real_vit as package

ROOT = Path(__file__).resolve().parents[3]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m analysis.studies.real_vit", description=package.__doc__.split("\n")[0])
    ap.add_argument(
        "--root", default=str(ROOT / "runs" / "real-vit"), help="where the analysis is cached (default runs/real-vit)"
    )
    ap.add_argument(
        "--out",
        help="the report (.json beside it, figures in figures/real-vit/ beside it); default ROOT/real-vit.md: the "
        "committed docs/real-vit.md is rewritten only when named here",
    )
    ap.add_argument("--views", type=int, default=16, help="analysis views per photo (default 16: 304 views)")
    ap.add_argument("--probe-views", type=int, default=24, help="probe-train crops per photo (default 24: 456 crops)")
    ap.add_argument(
        "--erf", action="store_true", help="also the effective receptive fields (hours on a CPU at this width)"
    )
    ap.add_argument("--no-progress", action="store_true")
    ap.add_argument(
        "--from-bundle",
        nargs="?",
        const="",
        default=None,
        metavar="DIR",
        help="regenerate the report from its results bundle alone, no weights or photos loaded (default: beside the "
        "report, else docs/bundles/real-vit/; read by itself when ROOT holds no analysis)",
    )
    args = ap.parse_args(argv)
    from analysis.results.folders import AnalysisError  # the heavy imports after the options are read
    from analysis.sources.pretrained import ConversionError
    from analysis.studies.bundle import BundleError
    from analysis.studies.real_vit.report import build

    out = Path(args.out) if args.out else Path(args.root) / "real-vit.md"  # report.md there is the run's own
    try:
        s = build(
            Path(args.root),
            out,
            out.parent / "figures" / "real-vit",
            views=args.views,
            probe_views=args.probe_views,
            progress=not args.no_progress,
            erf=args.erf,
            from_bundle=args.from_bundle,
        )
    except (AnalysisError, ConversionError, BundleError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"{out}: " + ", ".join(f"{k} {c['verdict']}" for k, c in s["claims"].items()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
