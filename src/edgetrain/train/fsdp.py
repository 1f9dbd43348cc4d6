"""``--strategy fsdp``: parameters, gradients and optimizer state sharded over the devices (FSDP2).

PyTorch's own engine does the work: ``torch.distributed.fsdp.fully_shard``
(FSDP2, ZeRO-3 style) over gloo, on CPU as on a GPU. Each device keeps
``1/world`` of every parameter (a ``DTensor`` shard), the gradient of that
shard and the optimizer state built over it. Per unit (see
``sharding_units``), a step runs:

- forward: all-gather the unit's parameters, compute, free the gathered copy;
- backward: all-gather them again, compute the gradients, reduce-scatter the
  gradients so that each device keeps the average over devices of its shard;
- the optimizer updates each device's shard only.

The root module's parameters stay gathered between forward and backward
(FSDP2's default for the root), so they are gathered once per step.

Loss scaling is ``DataParallel``'s: device ``r`` back-propagates
``sum(losses_r) * world / B`` and the reduce-scatter averages over devices,
so each shard receives the gradient of the mean loss over the global batch,
and fsdp gives DDP's parameters step for step (tests/train/test_fsdp.py).

Units: every direct child of the model, and in place of a container
(``nn.Sequential``, ``nn.ModuleList``) each of its children; then the root
(whatever parameters are left). A unit's parameters are gathered together,
so the largest unit bounds the memory of the gathered copy.

Bytes: FSDP2's collectives are replaced (``set_custom_all_gather``,
``set_custom_reduce_scatter``, its public API) by ones that call the same
``torch.distributed`` functions and count what each device sends into
``CommStats``: a ring all-gather of ``n`` bytes per device sends ``(p-1) n``,
a ring reduce-scatter of ``N`` bytes sends ``(p-1)/p N`` (half a ring
all-reduce). They run blocking, so ``comm_s`` of a step is the time spent in
them; FSDP's prefetch of the next unit's all-gather behind compute is given
up for that honest accounting (on a GPU it would overlap on a side stream).

BatchNorm: ``--batchnorm local`` normalises with each device's statistics
(as DDP) and broadcasts rank 0's running statistics once, at ``finish``;
``sync`` converts to ``CrossDeviceBatchNorm2d`` as data parallelism does.

Limits:

- every device first builds the whole model, which FSDP then shards, so the
  peak resident memory (``peak_rss_mb``) includes the whole model once at
  start-up; the steps after that hold a shard plus the largest gathered unit;
- ``finish`` gathers the whole model and optimizer state on rank 0 for the
  checkpoint (plain tensors, ``torch.load(weights_only=True)`` reads it);
- ``--link``, ``--compress`` and ``--sync`` other than ``sync`` are refused
  (``config.resolve``): FSDP's all-gathers and reduce-scatters do not go
  through the link emulation or edgetrain's compressors yet.
"""
from __future__ import annotations

import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict
from torch.distributed.fsdp import fully_shard
from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultAllGather, DefaultReduceScatter

from edgetrain.comm.accounting import CommStats, ring_allgather_bytes, ring_allreduce_bytes
from edgetrain.train.strategy import STRATEGIES, DataParallel, StepResult, Strategy


def sharding_units(model: nn.Module) -> list[nn.Module]:
    """The modules each sharded as one unit (the module docstring says which), in forward order."""
    units = []
    for child in model.children():
        inner = list(child.children()) if isinstance(child, (nn.Sequential, nn.ModuleList)) else [child]
        units += [m for m in inner if any(True for _ in m.parameters())]
    return units


def _blocking(work, started: float, stats: CommStats):
    if work is not None:
        work.wait()
    stats.finished(started)


class CountingAllGather(DefaultAllGather):
    """FSDP2's all-gather, blocking, with the bytes each device sends counted."""

    def __init__(self, stats: CommStats):
        self.stats = stats

    def __call__(self, output_tensor, input_tensor, group, async_op=False):
        payload = input_tensor.numel() * input_tensor.element_size()
        started = self.stats.launched(ring_allgather_bytes(payload, group.size()))
        _blocking(super().__call__(output_tensor, input_tensor, group, async_op=False), started, self.stats)
        return None


class CountingReduceScatter(DefaultReduceScatter):
    """FSDP2's reduce-scatter, blocking, with the bytes each device sends counted."""

    def __init__(self, stats: CommStats):
        self.stats = stats

    def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
        payload = input_tensor.numel() * input_tensor.element_size()
        # a ring reduce-scatter is the first half of a ring all-reduce
        started = self.stats.launched(ring_allreduce_bytes(payload, group.size()) // 2)
        _blocking(super().__call__(output_tensor, input_tensor, group, op, async_op=False), started, self.stats)
        return None


class FullyShardedDataParallel(Strategy):
    """Data parallel over the batch, with the model's state sharded over the devices (FSDP2)."""

    name = "fsdp"

    adapt = DataParallel.adapt  # --batchnorm sync: CrossDeviceBatchNorm2d, as in data parallelism

    def setup(self, model: nn.Module) -> None:
        stats = self.context.stats
        # every device starts from device 0's weights, as DDP's constructor does
        for tensor in [*model.parameters(), *model.buffers()]:
            dist.broadcast(tensor.data, src=0)
        for module in [*sharding_units(model), model]:
            fully_shard(module)
            module.set_custom_all_gather(CountingAllGather(stats))
            module.set_custom_reduce_scatter(CountingReduceScatter(stats))
        self.model = model
        self.optimizer: torch.optim.Optimizer | None = None  # the loop's, seen at the first step
        self.checkpoint: dict | None = None
        self.final_gather_s: float | None = None

    def train_step(self, x, y, optimizer) -> StepResult:
        c = self.context
        busy_before = c.stats.snapshot()["comm_s"]
        self.optimizer = optimizer
        optimizer.zero_grad(set_to_none=True)
        out = self.model(x)
        loss_sum = F.cross_entropy(out, y, reduction="sum")
        (loss_sum * (c.world / c.cfg.batch_size)).backward()
        optimizer.step()
        # every collective ran blocking: the time in them is the time compute waited on them
        comm_s = c.stats.snapshot()["comm_s"] - busy_before
        return StepResult(loss_sum.item(), int((out.detach().argmax(1) == y).sum()), len(y), comm_s)

    def finish(self) -> None:
        if self.checkpoint is not None:
            return
        for buffer in self.model.buffers():
            dist.broadcast(buffer.data, src=0)
        # collective: every device sends its shards, rank 0 keeps the whole state (on CPU) for the checkpoint
        started = time.perf_counter()
        model_state, optimizer_state = get_state_dict(
            self.model, self.optimizer or [], options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        self.checkpoint = {"model": model_state, "optimizer": optimizer_state}
        self.final_gather_s = time.perf_counter() - started

    def checkpoint_state(self, optimizer) -> dict:
        return self.checkpoint

    @property
    def eval_model(self) -> nn.Module:
        return self.model

    def summary(self) -> dict:
        units = sharding_units(self.model)
        return {"sync": "fsdp", "fsdp": {"units": len(units) + 1, "final_gather_s": self.final_gather_s,
                                         "shard_parameters": sum(p.to_local().numel() for p in self.model.parameters())}}


STRATEGIES[FullyShardedDataParallel.name] = FullyShardedDataParallel
