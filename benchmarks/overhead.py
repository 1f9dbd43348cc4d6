"""edgetrain's training step against a plain hand-written PyTorch loop.

ResNet-18 (CIFAR), batch 64, one device on one core, synthetic 32x32 data,
both pinned to the same core with one torch thread. The two run back to back,
alternating, and the ratio is taken within each round, so drift on a shared
host cancels. Target: edgetrain >= 0.95x plain PyTorch.

    python benchmarks/overhead.py [--steps 8] [--rounds 3]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

import edgetrain
from edgetrain.data import synthetic
from edgetrain.models import build_model


def plain_pytorch(steps: int, batch: int, core: int) -> float:
    """samples/s of the loop everyone writes first, timed after one warm-up step."""
    os.sched_setaffinity(0, [core])
    torch.set_num_threads(1)
    torch.manual_seed(0)
    data = synthetic(samples=batch * (steps + 1), image_size=32)
    x = torch.stack([data.train[i][0] for i in range(len(data.train))])
    loader = DataLoader(TensorDataset(x, data.train.labels), batch_size=batch, shuffle=True, drop_last=True)
    model = build_model("resnet18")
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=5e-4)
    times = []
    for xb, yb in loader:
        t0 = time.perf_counter()
        loss = F.cross_entropy(model(xb), yb)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        times.append(time.perf_counter() - t0)
    return batch * len(times[1:]) / sum(times[1:])


def edgetrain_run(steps: int, batch: int, out: str) -> float:
    summary = edgetrain.train(dict(model="resnet18", dataset="synthetic", image_size=32,
                                   synthetic_samples=batch * (steps + 1), batch_size=batch, steps=steps + 1,
                                   devices=1, threads=1, eval=False, progress=False, output=out))
    return summary["throughput_samples_per_s"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--batch", type=int, default=64)
    args = ap.parse_args()
    # Both sides run on one core: the spawned edgetrain device inherits this affinity.
    core = sorted(os.sched_getaffinity(0))[0]
    os.sched_setaffinity(0, [core])
    rows = []
    with tempfile.TemporaryDirectory() as out:
        for r in range(args.rounds):
            et = edgetrain_run(args.steps, args.batch, out)
            plain = plain_pytorch(args.steps, args.batch, core)
            rows.append({"round": r, "plain_samples_per_s": plain, "edgetrain_samples_per_s": et, "ratio": et / plain})
            print(f"round {r}: plain {plain:6.1f} samples/s   edgetrain {et:6.1f} samples/s   ratio {et / plain:.3f}")
    ratio = statistics.median(row["ratio"] for row in rows)
    print(f"median ratio edgetrain / plain PyTorch: {ratio:.3f}  (target >= 0.95)")
    result = {"benchmark": "overhead", "model": "resnet18", "batch": args.batch, "steps_timed": args.steps,
              "rounds": rows, "median_ratio": ratio, "target": 0.95, "met": ratio >= 0.95}
    path = Path(__file__).parent / "results" / "overhead.json"
    path.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
