"""Evaluation on the test set: ``evaluate_task`` (a model whole on this device, or gathering its parts inside
forward), which ``Strategy.evaluate`` calls by default; a strategy that evaluates otherwise (a pipeline: the
test set through its stages, train/pipeline.py) overrides ``Strategy.evaluate``. Here, below both
``train.strategy`` and ``train.loop``, so that either can use it. The task (tasks/base.py) scores the outputs:
each device accumulates its shard in the task's ``Evaluator``, every device gathers every device's state and
merges them the same way (``gathered_metrics``)."""
from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, Subset

from edgetrain.data import shard_indices
from edgetrain.tasks.base import Evaluator, Task
from edgetrain.tasks.classification import ClassificationTask


@torch.no_grad()
def evaluate(model: nn.Module, dataset, rank: int, world: int, batch: int = 256,
             device: torch.device | None = None) -> tuple[float, float]:
    """(mean loss, accuracy) of a classifier over the whole test set, each device taking a shard."""
    metrics = evaluate_task(model, dataset, rank, world, ClassificationTask(), batch, device)
    return metrics["loss"], metrics["accuracy"]


@torch.no_grad()
def evaluate_task(model: nn.Module, dataset, rank: int, world: int, task: Task, batch: int = 256,
                  device: torch.device | None = None) -> dict[str, float]:
    """``{"loss": mean per sample, <metric>: value...}`` of ``task`` over the whole test set, each device taking
    a shard, the same on every device.

    Every device runs as many forward passes as the largest shard needs (an empty batch where its
    own shard is done): a sharded model (fsdp) gathers its parameters inside forward, a collective
    every device must join."""
    was_training = model.training
    model.eval()
    evaluator = task.evaluator()
    loader = DataLoader(Subset(dataset, shard_indices(len(dataset), rank, world)), batch_size=batch,
                        collate_fn=task.collate)
    passes = math.ceil(math.ceil(len(dataset) / world) / batch)  # the largest shard's
    for x, y in loader:
        x = x.to(device or x.device)
        evaluator.update(model(x), task.to_device(y, device or x.device))
    for _ in range(passes - len(loader)):  # a shorter shard joins the others' last pass with an empty batch
        model(dataset[0][0][None][:0].to(device or "cpu"))
    model.train(was_training)
    return gathered_metrics(evaluator, world)


def gathered_metrics(evaluator: Evaluator | None, world: int, group=None) -> dict[str, float]:
    """Every device's evaluator state (None: a device that scored nothing, e.g. a pipeline's inner stage),
    gathered on every device and merged by the evaluator's class: the same figures everywhere."""
    states = [evaluator.state() if evaluator is not None else None]
    if world > 1:
        states = [None] * dist.get_world_size(group)
        dist.all_gather_object(states, (type(evaluator), evaluator.state()) if evaluator is not None else None,
                               group=group)
        scored = [s for s in states if s is not None]
        return scored[0][0].merge([s for _, s in scored])
    return type(evaluator).merge(states)


def score(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """[loss summed over the samples, how many are right, how many] of logits ``out`` against labels ``y``."""
    evaluator = ClassificationTask().evaluator()
    evaluator.update(out, y)
    return evaluator.state()


def mean_loss_and_accuracy(totals: torch.Tensor) -> tuple[float, float]:
    """(mean loss, accuracy) from ``score``'s totals, summed over batches and devices."""
    return (totals[0] / totals[2]).item(), (totals[1] / totals[2]).item()
