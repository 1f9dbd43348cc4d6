"""What differential privacy costs in accuracy: DP-SGD at epsilon 1, 3 and 8 against the same run without it.

The compression benchmark's setting (``benchmarks/compression.py``): its EdgeCNN (no BatchNorm, so Opacus can
compute per-sample gradients), the CIFAR-10 subset (5,120 training and 1,024 test images), global batch 128,
SGD with momentum 0.9, cosine schedule, no augmentation; here 2 emulated devices with ``--sync sync`` (DP-SGD's
noise added once per step to the global batch's clipped sum) and no emulated link. Each DP run takes
``--dp clip=C,epsilon=E`` (delta 1e-5), the noise multiplier derived for the run's steps by Opacus's RDP
accountant; every configuration runs with each seed (the seed sets the initial model, the data order and the
noise). Prints one line per run as it ends, then the table (mean and standard deviation over seeds), and
writes ``results.json`` into ``--out``.

Usage (from the repository root)::

    PYTHONPATH=src python benchmarks/dp_accuracy.py --epochs 4 --seeds 0,1,2 --out benchmarks/results/dp_accuracy
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "benchmarks"))

from compression import EdgeCNN  # noqa: E402
from edgetrain import train  # noqa: E402

DATA = ROOT.parent / "shared/data/cifar10-subset/cifar-10-batches-py"


def run(label: str, dp: str, args, seed: int) -> dict:
    cfg = dict(dataset="cifar10", data_dir=str(args.data_dir), augment=False, devices=args.devices,
               epochs=args.epochs, batch_size=args.batch_size, lr=args.lr, schedule="cosine", seed=seed, dp=dp,
               output=str(args.out / "runs"), run_name=f"{label}-seed{seed}", progress=False, timeout=args.timeout)
    started = time.perf_counter()
    torch.manual_seed(seed)  # the same initial model for every configuration with this seed
    summary = train(cfg, model=EdgeCNN())
    privacy = summary.get("privacy") or {}
    row = {"label": label, "dp": dp, "seed": seed, "accuracy": summary["test_accuracy"],
           "epsilon": privacy.get("epsilon"), "noise_multiplier": privacy.get("noise_multiplier"),
           "sample_rate": privacy.get("sample_rate"), "steps": summary["steps"],
           "wall_s": round(time.perf_counter() - started, 1)}
    print(json.dumps(row), flush=True)
    return row


def table(rows: list[dict], labels: list[str]) -> str:
    base = statistics.mean(r["accuracy"] for r in rows if r["label"] == "no-dp") if any(
        r["label"] == "no-dp" for r in rows) else None
    lines = ["| run | --dp | epsilon (delta 1e-5) | noise multiplier | seeds | test accuracy (mean) | sd | vs no DP |",
             "|---|---|---|---|---|---|---|---|"]
    for label in labels:
        mine = [r for r in rows if r["label"] == label]
        if not mine:
            continue
        acc = [r["accuracy"] for r in mine]
        sd = statistics.stdev(acc) if len(acc) > 1 else 0.0
        eps = mine[0]["epsilon"]
        noise = mine[0]["noise_multiplier"]
        vs = "-" if base is None or label == "no-dp" else f"{100 * (statistics.mean(acc) - base):+.2f} pp"
        lines.append(f"| {label} | {mine[0]['dp']} | {'-' if eps is None else f'{eps:.2f}'} | "
                     f"{'-' if noise is None else f'{noise:.3f}'} | {len(acc)} | {100 * statistics.mean(acc):.2f}% | "
                     f"{100 * sd:.2f} | {vs} |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--epsilons", default="8,3,1", help="target epsilons, each a run per seed beside no DP")
    p.add_argument("--clip", type=float, default=1.0)
    p.add_argument("--epochs", type=int, default=4)
    p.add_argument("--devices", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=128, help="global batch")
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--timeout", type=float, default=600.0, help="--timeout of each run (a loaded host stalls)")
    p.add_argument("--data-dir", type=Path, default=DATA)
    p.add_argument("--out", type=Path, default=ROOT / "runs" / "bench-dp")
    p.add_argument("--no-baseline", action="store_true", help="leave out the run without DP")
    p.add_argument("--table-from", nargs="*", type=Path,
                   help="train nothing: the table of the JSON lines earlier runs of this script printed")
    args = p.parse_args()
    configs = [] if args.no_baseline else [("no-dp", "off")]
    configs += [(f"eps-{e}", f"clip={args.clip:g},epsilon={e}") for e in args.epsilons.split(",")]
    if args.table_from:
        printed = {}  # one row per (configuration, seed): a rerun of a seed gives the same run
        for line in (line for path in args.table_from for line in path.read_text().splitlines()):
            if line.startswith('{"label"'):
                row = json.loads(line)
                printed.setdefault((row["label"], row["seed"]), row)
        print(table(list(printed.values()), ["no-dp"] + [f"eps-{e}" for e in args.epsilons.split(",")]))
        return
    rows = []
    for seed in (int(s) for s in args.seeds.split(",")):
        for label, dp in configs:
            rows.append(run(label, dp, args, seed))
    print()
    print(table(rows, [label for label, _ in configs]))
    args.out.mkdir(parents=True, exist_ok=True)
    meta = {"command": " ".join(sys.argv), "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
            "loadavg": os.getloadavg(), "epochs": args.epochs, "devices": args.devices,
            "batch_size": args.batch_size, "lr": args.lr, "clip": args.clip, "rows": rows}
    (args.out / "results.json").write_text(json.dumps(meta, indent=1) + "\n")


if __name__ == "__main__":
    main()
