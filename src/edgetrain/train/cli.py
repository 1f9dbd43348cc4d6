"""``edgetrain train``: every TrainConfig field is a flag; ``--config`` reads a YAML file first."""
from __future__ import annotations

import argparse


from edgetrain.config import FIELDS, add_config_arguments
from edgetrain.train import train

# Imported inside functions: edgetrain.report.tables (rich), so that edgetrain --help and train's flags answer without
# it.


def register(sub) -> None:
    p = sub.add_parser("train", help="train a model on N emulated devices or, under torchrun, on real ones",
                       description="Data-parallel training with PyTorch DDP over gloo. Flags override the --config "
                                   "file; both are validated before any device starts.",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--config", metavar="FILE", help="YAML file of config keys (the flags' names with underscores)")
    add_config_arguments(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from edgetrain.report.tables import print_train_summary

    overrides = {k: v for k, v in vars(args).items() if k in FIELDS}
    summary = train(args.config, **overrides)
    if summary is not None:
        print_train_summary(summary)
    return 0



