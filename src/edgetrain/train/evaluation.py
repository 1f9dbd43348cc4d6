"""Evaluation on the test set: ``evaluate`` (a model whole on this device, or gathering its parts inside
forward), which ``Strategy.evaluate`` calls by default; a strategy that evaluates otherwise (a pipeline: the
test set through its stages, train/pipeline.py) overrides ``Strategy.evaluate``. Here, below both
``train.strategy`` and ``train.loop``, so that either can use it."""
from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Subset

from edgetrain.data import shard_indices


@torch.no_grad()
def evaluate(model: nn.Module, dataset, rank: int, world: int, batch: int = 256,
             device: torch.device | None = None) -> tuple[float, float]:
    """(mean loss, accuracy) over the whole test set, each device taking a shard.

    Every device runs as many forward passes as the largest shard needs (an empty batch where its
    own shard is done): a sharded model (fsdp) gathers its parameters inside forward, a collective
    every device must join."""
    was_training = model.training
    model.eval()
    totals = torch.zeros(3, dtype=torch.float64)
    loader = DataLoader(Subset(dataset, shard_indices(len(dataset), rank, world)), batch_size=batch)
    passes = math.ceil(math.ceil(len(dataset) / world) / batch)  # the largest shard's
    for x, y in loader:
        x, y = x.to(device or x.device), y.to(device or y.device)
        out = model(x)
        totals += score(out, y)
    for _ in range(passes - len(loader)):  # a shorter shard joins the others' last pass with an empty batch
        model(dataset[0][0][None][:0].to(device or "cpu"))
    if world > 1:
        dist.all_reduce(totals)
    model.train(was_training)
    return mean_loss_and_accuracy(totals)


def score(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """[loss summed over the samples, how many are right, how many] of logits ``out`` against labels ``y``."""
    return torch.tensor([F.cross_entropy(out, y, reduction="sum").item(), (out.argmax(1) == y).sum().item(),
                         len(y)], dtype=torch.float64)


def mean_loss_and_accuracy(totals: torch.Tensor) -> tuple[float, float]:
    """(mean loss, accuracy) from ``score``'s totals, summed over batches and devices."""
    return (totals[0] / totals[2]).item(), (totals[1] / totals[2]).item()
