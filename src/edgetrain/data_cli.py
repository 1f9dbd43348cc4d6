"""``edgetrain data dedup``: which images of a dataset are near duplicates, before training or distribution.

The dataset options are ``edgetrain train``'s own (``config.add_config_arguments``)
and are checked by ``config.load_config`` and ``preflight``'s CIFAR-10 check,
so a bad dataset or directory is the same one line as in training; the
threshold is checked when parsed. With ``--output DIR`` the kept indices and,
for each removed image, the index of the kept image it duplicates go to
``DIR/dedup-<dataset>-<split>.json`` (what to load or ship instead of the whole set).
"""
from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

from edgetrain.arguments import OneLineParser
from edgetrain.config import TrainConfig, add_config_arguments, check_output_dir, load_config
from edgetrain.errors import EdgetrainError
from edgetrain.files import write_json
from edgetrain.kinds import target_kind
from edgetrain.spec import DEDUP_DEFAULT_THRESHOLD, DEDUP_HASH_BITS, DEDUP_MAX_THRESHOLD

# Imported inside functions: edgetrain.data and edgetrain.train.preflight (torch), so that edgetrain --help and bad
# options answer without it.

DATASET_OPTIONS = ("dataset", "data_dir", "synthetic_samples", "image_size", "seed")


def register(subparsers) -> None:
    parser = subparsers.add_parser("data", help="inspect and reduce datasets before training or distribution",
                                   description="Dataset tools.")
    sub = parser.add_subparsers(dest="data_command", metavar="COMMAND", required=True, parser_class=OneLineParser)
    p = sub.add_parser("dedup", help="find near-duplicate images (perceptual hash) and report what they cost",
                       description="Hash every image (pHash, 144 bits) and count the images within --threshold bits "
                                   "of an earlier kept one: how many, how many bytes, how long it took.",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_config_arguments(p, DATASET_OPTIONS)
    p.add_argument("--threshold", type=_threshold, default=DEDUP_DEFAULT_THRESHOLD,
                   help=f"near duplicates differ in at most this many of the {DEDUP_HASH_BITS} hash bits "
                        f"(0..{DEDUP_MAX_THRESHOLD}); higher removes more")
    p.add_argument("--split", choices=("train", "test"), default="train", help="which part of the dataset")
    p.add_argument("--output", metavar="DIR", default=None,
                   help="also write the kept indices and each removed image's original to DIR (default: print only)")
    p.set_defaults(func=run)
    k = sub.add_parser("pack", help="write a dataset as WebDataset-style tar shards, to train from storage",
                       description="Pack a dataset's training and test sets into tar shards (dataset shards): the "
                                   "files as they are (image folders, YOLO folders) or arrays as .npy (in-memory "
                                   "sets), with their targets and a metadata file.",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_config_arguments(k, PACK_OPTIONS)
    k.add_argument("--output", metavar="DIR", required=True, help="an empty or new folder for the shards")
    k.add_argument("--shard-mb", type=_positive_float, default=64.0, help="start a new shard past this size")
    k.set_defaults(func=run_pack)


PACK_OPTIONS = (*DATASET_OPTIONS, "task")


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value > 0:
        raise argparse.ArgumentTypeError(f"expected a size in MB > 0, got {text!r}")
    return value


def run_pack(args: argparse.Namespace) -> int:
    from edgetrain.data import build_data
    from edgetrain.data.shards import pack
    from edgetrain.train.preflight import check_data

    given = {k: v for k, v in vars(args).items() if k in PACK_OPTIONS}
    # Folders are packed file by file, as they are on disk: read them from storage, never whole into memory.
    cfg = load_config(TrainConfig(), **given, from_storage=True, augment=False)
    if cfg.dataset == "shards":
        raise EdgetrainError("dataset shards is packed already; give the dataset to pack (imagefolder, yolo, ...)")
    checked = check_data(cfg)
    kind = target_kind(cfg)
    if kind == "values":
        raise EdgetrainError("edgetrain data pack packs image datasets (classification or detection); a regression "
                             "set is small enough to train from memory")
    data = checked or build_data(cfg)  # a folder's headers and statistics read once
    meta = pack(data, args.output, args.shard_mb, detection=kind == "own")
    for part, split in meta["splits"].items():
        print(f"{data.name} {part}: {split['items']} samples in {len(split['shards'])} shard(s)")
    print(f"train from them with: edgetrain train --dataset shards --data-dir {args.output}"
          + (" --task detection" if kind == "own" else ""))
    return 0


def _threshold(text: str) -> int:
    if not text.strip().isdigit() or int(text) > DEDUP_MAX_THRESHOLD:
        raise argparse.ArgumentTypeError(f"expected a number of bits 0..{DEDUP_MAX_THRESHOLD}, got {text!r}")
    return int(text)


def run(args: argparse.Namespace) -> int:
    from edgetrain.data import build_data
    from edgetrain.data.dedup import find_near_duplicates, images_of
    from edgetrain.train.preflight import check_data

    cfg = load_config(TrainConfig(), **{k: v for k, v in vars(args).items() if k in DATASET_OPTIONS})
    checked = check_data(cfg)
    if args.output is not None:
        check_output_dir(args.output, "--output")
    data = checked or build_data(cfg)
    report = find_near_duplicates(images_of(getattr(data, args.split)), args.threshold)
    print(f"{data.name} {args.split}: {report.describe()}")
    if args.output is not None:
        path = Path(args.output) / f"dedup-{data.name}-{args.split}.json"
        removed = {int(i): int(report.duplicate_of[i]) for i in np.flatnonzero(report.duplicate_of >= 0)}
        write_json(path, {**report.to_dict(), "dataset": data.name, "split": args.split,
                          "kept": report.kept.tolist(), "duplicate_of": removed})
        print(f"kept indices and duplicates written to {path}")
    return 0
