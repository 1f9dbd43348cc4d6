"""Pooling memory (issue 13), first part: the split planner's uneven split against an even one, measured.

    PYTHONPATH=src python benchmarks/pooling.py [--steps 20] [--rounds 2] [--cluster FILE]

A heterogeneous cluster (default: 2 ``rpi5`` and 2 ``rpi-zero-2w``, emulated
with their profiles' speeds by the throttle) trains a deep MLP (no
BatchNorm: its FLOPs are matrix products, which the planner counts) on
digits with ``--strategy pipeline``, GPipe, global batch 256 in 8
micro-batches, once with ``--stages auto`` (the planner) and once with
``--stages even`` (the same number of layers per device), alternating for
``--rounds`` rounds because the host is shared and its load drifts.
Throughput is measured (samples per second of the last stage, after the
first step); the planner's own figures, printed first, are modelled.

Not here yet (issue 13's other benchmark parts): ddp against pipeline and
fsdp on a model over a device's memory limit, pipeline against fsdp on
``wifi-20m``, and the largest model 4 pooled devices train.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from pathlib import Path

import torch
from torch import nn

from edgetrain import train


class DeepMlp(nn.Module):
    """Flatten, then ``depth + 2`` linear layers with ReLU between them: 64 inputs (digits), 10 classes."""

    def __init__(self, width: int = 512, depth: int = 8):
        super().__init__()
        layers = [nn.Flatten(), nn.Linear(64, width), nn.ReLU()]
        for _ in range(depth):
            layers += [nn.Linear(width, width), nn.ReLU()]
        self.body = nn.Sequential(*layers, nn.Linear(width, 10))

    def forward(self, x):
        return self.body(x)


DEFAULT_CLUSTER = "devices:\n  - {profile: rpi5, count: 2}\n  - {profile: rpi-zero-2w, count: 2}\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--cluster", help="cluster file (default: 2 rpi5 + 2 rpi-zero-2w)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="pooling-") as scratch:
        cluster = args.cluster
        if cluster is None:
            cluster = os.path.join(scratch, "cluster.yaml")
            Path(cluster).write_text(DEFAULT_CLUSTER)
        cfg = dict(dataset="digits", steps=args.steps, batch_size=256, microbatches=8, lr=0.05, cluster=cluster,
                   strategy="pipeline", output=scratch, eval=False, progress=False, timeout=120)
        print(f"host load average at start: {', '.join(f'{v:.1f}' for v in os.getloadavg())}", flush=True)
        throughput: dict[str, list[float]] = {"auto": [], "even": []}
        for round_ in range(args.rounds):
            for stages in throughput:
                torch.manual_seed(0)
                summary = train(cfg, model=DeepMlp(), stages=stages)
                throughput[stages].append(summary["throughput_samples_per_s"])
                print(f"round {round_} stages {stages}: {throughput[stages][-1]:.1f} samples/s (measured), "
                      f"{', '.join(summary['pipeline']['stages'])}", flush=True)
        ratios = [a / e for a, e in zip(throughput["auto"], throughput["even"])]
        verdict = "MET" if statistics.median(ratios) >= 1.3 else "MISSED"
        print(f"planned / even throughput per round: {', '.join(f'{r:.2f}' for r in ratios)}; median "
              f"{statistics.median(ratios):.2f} (target >= 1.3) {verdict}")
        print(f"host load average at end: {', '.join(f'{v:.1f}' for v in os.getloadavg())}")


if __name__ == "__main__":
    sys.exit(main())
