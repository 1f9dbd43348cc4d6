"""The fleet runs' accuracy against rounds and against the modelled clock, as one PNG (the chart ``edgetrain
report`` draws for fleet runs: ``report.fleet``), for the docs.

Usage::

    PYTHONPATH=src python benchmarks/fleet_plot.py RUN_DIR [RUN_DIR ...] --out docs/images/fleet-algorithms.png
"""
from __future__ import annotations

import argparse
from pathlib import Path

from edgetrain.report import plots
from edgetrain.report.fleet import load_fleet


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run_dirs", nargs="+", type=Path)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    runs = [(d.name, load_fleet(d)) for d in args.run_dirs]
    plots.save(plots.plot_fleet_rounds([(name, f.rounds, f.accuracy()[1]) for name, f in runs]), args.out)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
