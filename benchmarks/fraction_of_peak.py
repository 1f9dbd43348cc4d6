"""Fraction of the one-core GEMM peak that ResNet-18 (CIFAR) training reaches.

    PYTHONPATH=src python benchmarks/fraction_of_peak.py [--batches 32,64] [--rounds 6]

One thread. FLOPs per training sample are counted by FlopCounterMode
(forward + backward); each round times one real training step and then a
float32 GEMM (n=1024, 0.3 s of repeats) in the same process, so the two sides
of the ratio see the same load on a shared machine. Printed: achieved GFLOPS
and the fraction of peak as best/best (each side's fastest) and
median/median. Target (issue 5): >= 60% of the GEMM peak.
"""
from __future__ import annotations

import argparse
import statistics

import torch

from edgetrain.bench import peak, workload
from edgetrain.tasks import flops


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="resnet18")
    ap.add_argument("--batches", default="32,64")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--gemm-n", type=int, default=1024)
    args = ap.parse_args()
    torch.set_num_threads(1)
    model = workload.build_model(args.model, "cifar10")
    per_sample = flops.training_flops_per_sample(model, "cifar10")["total_flops"]
    print(f"{args.model}: {per_sample / 1e9:.3f} GFLOP per training sample (forward + backward), 1 thread")
    print(f"{'batch':>5} {'step s best':>11} {'step s med':>10} {'GEMM best':>9} {'GEMM med':>9} "
          f"{'achieved best':>13} {'achieved med':>12} {'best/best':>9} {'med/med':>8}")
    for b in (int(v) for v in args.batches.split(",")):
        workload.time_steps(model, b, 0, 1, "cifar10", threads=1)  # warm-up
        steps, gemms = [], []
        for _ in range(args.rounds):
            steps.append(workload.time_steps(model, b, 1, 0, "cifar10", threads=1)["step_s"][0])
            gemms.append(peak.gemm(args.gemm_n, 1, min_time_s=0.3)["gflops_best"])
        best = per_sample * b / min(steps) / 1e9
        med = per_sample * b / statistics.median(steps) / 1e9
        print(f"{b:>5} {min(steps):>11.3f} {statistics.median(steps):>10.3f} {max(gemms):>9.1f} "
              f"{statistics.median(gemms):>9.1f} {best:>13.1f} {med:>12.1f} {best / max(gemms):>9.1%} "
              f"{med / statistics.median(gemms):>8.1%}")


if __name__ == "__main__":
    main()
