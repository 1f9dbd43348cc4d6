"""Evaluation on the test set: ``evaluate_task`` (a model whole on this device, or gathering its parts inside
forward), which ``Strategy.evaluate`` calls by default; a strategy that evaluates otherwise (a pipeline: the
test set through its stages, train/pipeline.py) overrides ``Strategy.evaluate``. Here, below both
``train.strategy`` and ``train.loop``, so that either can use it. The task (tasks/base.py) scores the outputs:
each device accumulates its shard in the task's ``Evaluator``, every device gathers every device's state and
merges them the same way (``gathered_metrics``)."""
from __future__ import annotations

import io
import math
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, Subset

from edgetrain.cluster.peers import wait
from edgetrain.data import shard_indices
from edgetrain.tasks.base import Evaluator, Task
from edgetrain.tasks.classification import ClassificationTask


@torch.no_grad()
def evaluate(model: nn.Module, dataset, rank: int, world: int, batch: int = 256,
             device: torch.device | None = None) -> tuple[float, float]:
    """(mean loss, accuracy) of a classifier over the whole test set, each device taking a shard."""
    metrics = evaluate_task(model, dataset, rank, world, ClassificationTask(), EvalPass(batch, device))
    return metrics["loss"], metrics["accuracy"]


@dataclass(frozen=True)
class EvalPass:
    """How a device runs its shard of an evaluation: ``batch`` samples at a time (a training step's, from
    ``Strategy.evaluate``: the test set is never read whole) on ``device``; ``timeout_s`` bounds the gather of
    the scores."""
    batch: int = 256
    device: torch.device | None = None
    timeout_s: float = 120.0


@torch.no_grad()
def evaluate_task(model: nn.Module, dataset, rank: int, world: int, task: Task,
                  how: EvalPass = EvalPass()) -> dict[str, float]:
    """``{"loss": mean per sample, <metric>: value...}`` of ``task`` over the whole test set, each device taking
    a shard, the same on every device.

    Every device runs as many forward passes as the largest shard needs (an empty batch where its
    own shard is done): a sharded model (fsdp) gathers its parameters inside forward, a collective
    every device must join."""
    batch, device = how.batch, how.device
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
    return gathered_metrics(evaluator, world, type(evaluator).merge, timeout_s=how.timeout_s)


def gathered_metrics(evaluator: Evaluator | None, world: int, merge, group=None,
                     timeout_s: float = 120.0) -> dict[str, float]:
    """Every device's evaluator state (None: a device that scored nothing, e.g. a pipeline's inner stage),
    gathered on every device and merged by ``merge`` (the task's ``Evaluator.merge``): the same figures
    everywhere."""
    if world == 1:
        return merge([evaluator.state()])
    states = [s for s in gather_states(evaluator.state() if evaluator is not None else None, group, timeout_s)
              if s is not None]
    return merge(states)


def gather_states(state, group=None, timeout_s: float = 120.0) -> list:
    """``state`` from every device of ``group``, in rank order. It travels as ``torch.save`` bytes read back
    with ``weights_only=True`` (tensors, numbers, strings and containers of them; numpy arrays travel as
    tensors and come back as arrays; tensors stay tensors): unlike ``all_gather_object`` a peer's bytes cannot run code here.
    A gather that outlasts ``timeout_s`` is one line naming it (``cluster.peers.wait``)."""
    buffer = io.BytesIO()
    torch.save(_numpy_to_tensors(state), buffer)
    mine = torch.frombuffer(bytearray(buffer.getvalue()), dtype=torch.uint8)
    world = dist.get_world_size(group)
    sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(world)]
    what = "evaluation's gather of the devices' scores"
    wait(dist.all_gather(sizes, torch.tensor([mine.numel()], dtype=torch.int64), group=group, async_op=True),
         timeout_s, what)
    longest = max(int(n) for n in sizes)
    received = [torch.empty(longest, dtype=torch.uint8) for _ in range(world)]
    wait(dist.all_gather(received, torch.cat([mine, mine.new_zeros(longest - mine.numel())]), group=group,
                         async_op=True), timeout_s, what)
    return [_tensors_to_numpy(torch.load(io.BytesIO(r[:int(n)].numpy().tobytes()), weights_only=True))
            for r, n in zip(received, sizes)]


_NDARRAY = "edgetrain.ndarray"  # marks a numpy array sent as a tensor


def _numpy_to_tensors(value):
    if isinstance(value, np.ndarray):
        return {_NDARRAY: torch.from_numpy(value)}
    if isinstance(value, (list, tuple)):
        return type(value)(_numpy_to_tensors(v) for v in value)
    if isinstance(value, dict):
        return {k: _numpy_to_tensors(v) for k, v in value.items()}
    return value


def _tensors_to_numpy(value):
    if isinstance(value, dict) and value.keys() == {_NDARRAY}:
        return value[_NDARRAY].numpy()
    if isinstance(value, (list, tuple)):
        return type(value)(_tensors_to_numpy(v) for v in value)
    if isinstance(value, dict):
        return {k: _tensors_to_numpy(v) for k, v in value.items()}
    return value


def score(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """[loss summed over the samples, how many are right, how many] of logits ``out`` against labels ``y``."""
    evaluator = ClassificationTask().evaluator()
    evaluator.update(out, y)
    return evaluator.state()


def mean_loss_and_accuracy(totals: torch.Tensor) -> tuple[float, float]:
    """(mean loss, accuracy) from ``score``'s totals, summed over batches and devices."""
    return (totals[0] / totals[2]).item(), (totals[1] / totals[2]).item()
