"""Diagnostic for issue 14: is a federated model's gap in its BatchNorm running statistics or in its weights?

A federated run averages the devices' running statistics once, at the end
(``comm/local_sgd.py``); on non-IID partitions each device's statistics
describe its own classes, and their mean misses the spread between devices.
This prints a saved model's test accuracy as saved, then after recomputing
every BatchNorm layer's running statistics over the whole (unaugmented)
training set with the weights fixed. If the federated model gains much more
than a centralized one, the averaged statistics are (part of) the gap.

Usage (from the repository root; a run directory's checkpoint.pt)::

    PYTHONPATH=src python benchmarks/bn_recalibration.py runs/fed1/checkpoint.pt [--data-dir DIR]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import DataLoader

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from edgetrain.data.datasets import cifar10  # noqa: E402
from edgetrain.models import build_model  # noqa: E402

DATA = ROOT.parent / "shared/data/cifar10-subset/cifar-10-batches-py"


def accuracy(model: nn.Module, dataset) -> float:
    model.eval()
    correct = 0
    with torch.no_grad():
        for x, y in DataLoader(dataset, batch_size=500):
            correct += int((model(x).argmax(1) == y).sum())
    return correct / len(dataset)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("checkpoint", type=Path)
    p.add_argument("--data-dir", type=Path, default=DATA)
    args = p.parse_args()
    if not args.checkpoint.is_file():
        p.error(f"no checkpoint at {args.checkpoint}")
    state = torch.load(args.checkpoint, weights_only=False)
    model = build_model(state["config"]["model"], 3, 10)
    model.load_state_dict(state["model"])
    data = cifar10(str(args.data_dir), augment=False)  # the test images are not augmented either
    print(f"as saved: test accuracy {accuracy(model, data.test):.2%}")
    norms = [m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    for m in norms:
        m.reset_running_stats()
        m.momentum = None  # a cumulative average over every batch, not an exponential one
    model.train()
    with torch.no_grad():
        for x, _ in DataLoader(data.train, batch_size=320):
            model(x)
    print(f"BatchNorm statistics recomputed on the training set ({len(norms)} layers): "
          f"test accuracy {accuracy(model, data.test):.2%}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
