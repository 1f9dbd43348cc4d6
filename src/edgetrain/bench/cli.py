"""``edgetrain bench <what>``: each bench module adds its own subcommand.

A bench module offers ``add_parser(subparsers)``, which sets ``bench_func``;
this file adds the options every bench shares (where results go) and turns a
bench into a command that exits 0. Options are checked when parsed (the
``edgetrain.arguments`` types) and the output directory, the model and the
CIFAR-10 directory before the bench makes its run directory.
"""
from __future__ import annotations

import argparse
import importlib

from edgetrain.arguments import OneLineParser
from edgetrain.config import check_output_dir

# Imported inside functions: edgetrain.data and edgetrain.models (torch), so that bench's flags and --help answer
# without it.

BENCHES = ("peak", "batch", "scaling", "stalls", "counters", "power", "variability")


def register(subparsers) -> None:
    parser = subparsers.add_parser("bench", help="characterise training on a device or cluster",
                                   description="Measure a device: each bench writes result.json and "
                                               "PNG plots into a new run directory.")
    sub = parser.add_subparsers(dest="bench", metavar="BENCH", required=True,
                                parser_class=OneLineParser)
    for name in BENCHES:
        module = importlib.import_module(f"edgetrain.bench.{name}")
        before = set(sub.choices)
        module.add_parser(sub)
        for added in set(sub.choices) - before:
            _common(sub.choices[added])


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--output", default="runs", help="directory that receives the run directory")
    p.add_argument("--name", default=None, help="run directory name (default: bench-<what>-<time>)")
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    from edgetrain.data.cifar import check_cifar10_dir
    from edgetrain.models import check_model

    check_output_dir(args.output, "--output")
    if getattr(args, "model", None) is not None:
        check_model(args.model)
    if getattr(args, "data_dir", None) is not None:
        check_cifar10_dir(args.data_dir)
    args.bench_func(args)
    return 0
