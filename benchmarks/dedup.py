"""Near-duplicate filtering on the CIFAR-10 subset with planted duplicates, and what it saves in training.

Planting: a seeded ``--planted`` fraction of the training images each gets
one near copy placed right after it, as consecutive video frames would be:
at random a one-pixel shift (up, down, left or right, the edge repeated),
brightness x0.95 or x1.05, Gaussian noise (sigma 4 of 255) or a JPEG round
trip at quality 75 (Pillow). The planted set is written as CIFAR-10 batch
files under ``--work`` so that ``edgetrain train --dataset cifar10`` reads it.

Measured, all on this host:

1. ``data.dedup.find_near_duplicates`` at the default threshold: recall
   (planted copies removed / planted), precision (planted among removed),
   distinct images removed, samples and bytes removed, seconds hashing and
   grouping;
2. three training runs per seed of ``--seeds``, same settings (``--devices``
   emulated ``--profile`` devices): the clean subset, the planted set, the
   planted set with ``--dedup on``. Per run: training seconds per epoch (the
   sum of the steps' times over devices' mean, ``summary.json`` ``steps x
   step_s / epochs``; start-up and evaluation not included), test accuracy
   after the last epoch, and what dedup removed (``summary.json``);
3. the issue's accuracy target, paired by seed: planted-dedup against clean
   (a seed draws the initial model and the batches of both runs), read as
   non-inferiority: the one-sided 95% lower bound of the mean difference
   above -0.5 pp (``accuracy_target``). One run's accuracy moves by a point or
   two from seed to seed, so the target needs several seeds; on ``host``
   devices (unthrottled: the accuracy does not depend on the profile) a run
   is about a minute.

    python benchmarks/dedup.py --epochs 5 --out /tmp/dedup.json   # about 25 minutes on a 2-core host
    python benchmarks/dedup.py --profile host --seeds 1,2,3,4 --runs clean,planted-dedup --out /tmp/a.json
    python benchmarks/dedup.py --from-json /tmp/a.json /tmp/b.json   # the target over several invocations
"""
from __future__ import annotations

import argparse
import io
import json
import pickle
import sys
import time
from pathlib import Path

import numpy as np
from PIL import Image

from edgetrain import train
from edgetrain.data.cifar import TEST_FILE, TRAIN_FILES, load_cifar10
from edgetrain.data.dedup import find_near_duplicates
from edgetrain.spec import DEDUP_DEFAULT_THRESHOLD
from paired import lower_bound  # benchmarks/paired.py

REPO = Path(__file__).resolve().parents[1]
CIFAR = REPO.parent / "shared" / "data" / "cifar10-subset" / "cifar-10-batches-py"
KINDS = ("shift", "brightness", "noise", "jpeg")


def near_copy(image: np.ndarray, kind: str, rng: np.random.Generator) -> np.ndarray:
    """One near copy of a (3, H, W) uint8 image."""
    if kind == "shift":
        axis, step = [(1, 1), (1, -1), (2, 1), (2, -1)][rng.integers(4)]
        return np.roll(image, step, axis=axis)
    if kind == "brightness":
        return np.clip(np.rint(image * rng.choice([0.95, 1.05])), 0, 255).astype(np.uint8)
    if kind == "noise":
        return np.clip(np.rint(image + rng.normal(0, 4, image.shape)), 0, 255).astype(np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(image.transpose(1, 2, 0)).save(buffer, "JPEG", quality=75)
    return np.asarray(Image.open(buffer)).transpose(2, 0, 1)


def plant(images: np.ndarray, labels: np.ndarray, fraction: float, seed: int):
    """(images, labels, is_planted, kinds): each chosen original followed by its near copy."""
    rng = np.random.default_rng(seed)
    chosen = set(rng.choice(len(images), int(round(fraction * len(images))), replace=False).tolist())
    out, out_labels, planted, kinds = [], [], [], []
    for i, (image, label) in enumerate(zip(images, labels)):
        out.append(image), out_labels.append(label), planted.append(False), kinds.append("")
        if i in chosen:
            kind = KINDS[rng.integers(len(KINDS))]
            out.append(near_copy(image, kind, rng)), out_labels.append(label), planted.append(True)
            kinds.append(kind)
    return np.stack(out), np.asarray(out_labels), np.asarray(planted), np.asarray(kinds)


def write_cifar(root: Path, images: np.ndarray, labels: np.ndarray, test: tuple[np.ndarray, np.ndarray]) -> None:
    """The official python format (what ``data.cifar.read_batch`` reads): five training batches and the test batch."""
    root.mkdir(parents=True, exist_ok=True)
    parts = zip(TRAIN_FILES, np.array_split(images, len(TRAIN_FILES)), np.array_split(labels, len(TRAIN_FILES)))
    for name, x, y in (*parts, (TEST_FILE, *test)):
        with open(root / name, "wb") as f:
            pickle.dump({"data": x.reshape(len(x), -1), "labels": y.tolist()}, f)


def filtering(images, planted, kinds) -> dict:
    report = find_near_duplicates(images, DEDUP_DEFAULT_THRESHOLD)
    removed = report.duplicate_of >= 0
    hits = int((removed & planted).sum())
    return {"images": report.samples, "planted": int(planted.sum()), "removed": report.removed,
            "planted_removed": hits, "distinct_removed": int((removed & ~planted).sum()),
            "recall": hits / max(int(planted.sum()), 1), "precision": hits / max(report.removed, 1),
            "recall_by_kind": {k: float(removed[kinds == k].mean()) for k in KINDS},
            "bytes_removed": report.bytes_removed, "bytes_total": report.bytes_total,
            "hash_s": report.hash_s, "group_s": report.group_s, "threshold": report.threshold,
            "hash_bits": report.hash_bits}


def training(name: str, data_dir: Path, dedup: str, seed: int, args) -> dict:
    started = time.perf_counter()
    s = train(dict(dataset="cifar10", data_dir=str(data_dir), model=args.model, devices=args.devices,
                   profile=args.profile, epochs=args.epochs, batch_size=args.batch_size, seed=seed, dedup=dedup,
                   progress=False, output=str(args.work / "runs"), run_name=f"{name}-seed{seed}"))
    return {"run": name, "seed": seed, "dedup": dedup, "steps": s["steps"], "step_s": s["step_s"],
            "train_s_per_epoch": s["steps"] * s["step_s"] / args.epochs, "test_accuracy": s["test_accuracy"],
            "dedup_removed": s.get("dedup", {}).get("removed", 0), "wall_s": time.perf_counter() - started}


def accuracy_target(runs: list[dict]) -> str:
    """Issue 14's target: training on the deduplicated planted set within 0.5 pp of the clean subset, paired by
    seed. Read as non-inferiority, the concern behind it (dedup must not cost accuracy): the one-sided 95%
    lower bound of the mean difference (Student's t) is above -0.5 pp. The literal reading (the mean within
    0.5 pp either way), the mean and its standard error are printed too: the runs are few and one run's
    accuracy moves by a point or two with the seed."""
    by = {(r["run"], r["seed"]): r["test_accuracy"] for r in runs}
    seeds = sorted(seed for run, seed in by if run == "clean" and ("planted-dedup", seed) in by)
    if len(seeds) < 2:
        return "accuracy target: needs the clean and planted-dedup runs on two or more common seeds"
    diffs = np.array([by["planted-dedup", s] - by["clean", s] for s in seeds]) * 100
    error = diffs.std(ddof=1) / np.sqrt(len(diffs))
    bound = lower_bound(diffs)
    clean = np.mean([by["clean", s] for s in seeds]) * 100
    dedup = np.mean([by["planted-dedup", s] for s in seeds]) * 100
    return (f"accuracy, planted-dedup against clean over seeds {seeds}: {dedup:.2f}% against {clean:.2f}%, "
            f"{diffs.mean():+.2f} pp (standard error {error:.2f}; per seed {', '.join(f'{d:+.2f}' for d in diffs)}); "
            f"95% lower bound {bound:+.2f} pp; target no more than 0.5 pp below clean: "
            f"{'met' if bound >= -0.5 else 'not met'}; mean within 0.5 pp either way: "
            f"{'yes' if abs(diffs.mean()) <= 0.5 else 'no'}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--planted", type=float, default=0.3, help="fraction of images given a near copy")
    ap.add_argument("--epochs", type=int, default=5)
    ap.add_argument("--devices", type=int, default=2)
    ap.add_argument("--profile", default="rpi4", help="emulated device profile")
    ap.add_argument("--model", default="small_cnn")
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--seeds", default="0", help="comma-separated; every training run once per seed")
    ap.add_argument("--no-training", action="store_true", help="only the filtering measurements")
    ap.add_argument("--runs", default="clean,planted,planted-dedup", help="which training runs, in order")
    ap.add_argument("--work", type=Path, default=Path("/tmp/edgetrain-dedup-bench"), help="planted data and runs")
    ap.add_argument("--out", type=Path, default=None, help="also write the results as JSON here")
    ap.add_argument("--from-json", type=Path, nargs="+", default=None,
                    help="run nothing: the accuracy target over the training runs in these --out files")
    args = ap.parse_args()
    if args.from_json:
        print(accuracy_target([r for path in args.from_json for r in json.loads(path.read_text())["training"]]))
        return 0

    (x, y), (xt, yt) = load_cifar10(CIFAR)
    images, labels, planted, kinds = plant(x.numpy(), y.numpy(), args.planted, seed=0)
    result = {"filtering": filtering(images, planted, kinds)}
    print(json.dumps(result["filtering"]), flush=True)
    if not args.no_training:
        planted_dir = args.work / "cifar-planted"
        write_cifar(planted_dir, images, labels, (xt.numpy(), yt.numpy()))
        runs = {"clean": (CIFAR, "off"), "planted": (planted_dir, "off"), "planted-dedup": (planted_dir, "on")}
        result["training"] = []
        for seed in [int(s) for s in args.seeds.split(",")]:
            for name in args.runs.split(","):
                result["training"].append(training(name, *runs[name], seed, args))
                print(json.dumps(result["training"][-1]), flush=True)
        print(accuracy_target(result["training"]), flush=True)
    result["settings"] = {k: str(v) for k, v in vars(args).items()}
    if args.out:
        args.out.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
