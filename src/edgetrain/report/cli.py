"""``edgetrain report RUN_DIR [RUN_DIR ...] [-o report.html]``: one self-contained HTML page."""
from __future__ import annotations

import argparse
from pathlib import Path

from edgetrain.report.files import atomic_write


def register(subparsers) -> None:
    p = subparsers.add_parser("report", help="one self-contained HTML page for one or more run directories")
    p.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="bench or training run directories")
    p.add_argument("-o", "--output", default=None,
                   help="HTML file to write (default: RUN_DIR/report.html for one run, report.html otherwise)")
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    from edgetrain.report.html import render

    page = render(args.run_dirs)
    out = Path(args.output) if args.output else (
        Path(args.run_dirs[0]) / "report.html" if len(args.run_dirs) == 1 else Path("report.html"))
    with atomic_write(out) as f:
        f.write(page)
    print(f"wrote {out} ({len(page) / 1024:.0f} KiB, {page.count('<img')} images)")
    return 0
