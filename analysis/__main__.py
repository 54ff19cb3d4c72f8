"""``python -m analysis``: the analysis command line (analysis/frontends/cli.py)."""

from analysis.frontends.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
