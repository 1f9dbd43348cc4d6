"""``edgetrain report RUN_DIR [RUN_DIR ...] [-o report.html]``: one self-contained HTML page.

The output file's directory is checked before the runs are read, and every
run's file before anything is drawn (``html.load_run``).
"""
from __future__ import annotations

import argparse
from pathlib import Path

from edgetrain.config import check_output_dir
from edgetrain.errors import EdgetrainError
from edgetrain.files import atomic_write

# Imported inside functions: edgetrain.report.html (rich), so that edgetrain --help answers without it.


def register(subparsers) -> None:
    p = subparsers.add_parser("report", help="one self-contained HTML page for one or more run directories")
    p.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="bench or training run directories")
    p.add_argument("-o", "--output", default=None,
                   help="HTML file to write (default: RUN_DIR/report.html for one run, report.html otherwise)")
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    from edgetrain.report.html import render

    out = Path(args.output) if args.output else (
        Path(args.run_dirs[0]) / "report.html" if len(args.run_dirs) == 1 else Path("report.html"))
    if out.is_dir():
        raise EdgetrainError(f"--output {out} is a directory; give the HTML file to write, e.g. {out / 'report.html'}")
    check_output_dir(out.parent, f"--output {out}: directory")
    page = render(args.run_dirs)
    with atomic_write(out) as f:
        f.write(page)
    print(f"wrote {out} ({len(page) / 1024:.0f} KiB, {page.count('<img')} images)")
    return 0
