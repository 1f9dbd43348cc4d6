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

Links (``--link``, or each device's link in the cluster file): every
collective is charged to the device's clock (``comm.device_clock``, the
``LinkEmulator`` data parallelism uses) as ``p-1`` ring rounds over the
slowest link taking part, each ``latency + bytes per round / bandwidth``
(``cluster/links.py``), the reduce-scatter too. The model has no overlap,
because the run has none: each collective blocks compute, so in virtual
mode a step costs ``max over devices (clock + measured compute)`` plus the
sum of its collectives' modelled times, exactly as ``edgetrain plan
--strategy fsdp`` predicts it (``plan/strategies.py``); a runtime that
prefetched the next unit's all-gather behind compute would hide up to the
compute time of the unit. Enforced mode sleeps each collective's modelled
time after it. The step's ``virtual_*`` fields and the summary's clock
totals are data parallelism's (``comm/sync.py``).

BatchNorm: ``--batchnorm local`` normalises with each device's statistics
(as DDP) and broadcasts rank 0's running statistics once, at ``finish``;
``sync`` converts to ``CrossDeviceBatchNorm2d`` as data parallelism does.

Building: the model arrives on the meta device (models/init.py, no
storage); ``fully_shard`` shards it there, ``to_empty`` gives each device
storage for its shards only, and then each layer in turn is materialised
whole, initialised from its per-layer seed, copied into this device's shard
(``distribute_tensor`` with ``src_data_rank=None``: every device computed
the same full tensor, so no communication) and freed. A device therefore
never holds more than its shards plus one whole layer, and starts from the
same weights as one device or DDP. A model passed built
(``train(config, model=...)``) is sharded from device 0's weights instead.
The throttle's reference pass is skipped (``calibration_batch`` None): it
would need the whole model.

Checkpoints (train/checkpoint.py, "Pooled strategies"): every device writes
its own shards with ``torch.distributed.checkpoint`` (DCP), nothing is
gathered. ``sharded_state`` is ``get_state_dict`` of the sharded model and
optimizer (``DTensor`` shards, the optimizer's state flattened per parameter
name), into ``checkpoints/step-<N>/`` during the run, where each device's
BatchNorm statistics (plain tensors, its own with ``--batchnorm local``) go
to its own small file instead (``state_dict``: DCP would keep one device's);
and at the end, after ``finish`` broadcast rank 0's statistics, with them
into ``RUN_DIR/checkpoint/``, which ``edgetrain.load_checkpoint`` reads
back whole (DCP joins the shards) in one process. Resuming, each device
reads its own shards back into place with the same number of devices (the
checkpoint says how many wrote it; another count is refused), and the
resumed run ends as the uninterrupted one
(tests/train/test_sharded_checkpoint.py).

Limits:

- steps hold a shard plus the largest gathered unit (and its gradient); the
  final checkpoint adds, per device, at most one tensor's copy at a time (DCP
  copies a shard that is a view of a larger buffer before writing it);
- ``--compress`` and ``--sync`` other than ``sync`` are refused
  (``config.resolve``): FSDP's all-gathers and reduce-scatters do not go
  through edgetrain's compressors.
"""
from __future__ import annotations

import copy
import dataclasses

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultAllGather, DefaultReduceScatter

from edgetrain.comm import device_clock
from edgetrain.comm.accounting import ring_allgather_bytes, ring_allreduce_bytes
from edgetrain.comm.emulation import LinkEmulator
from edgetrain.models.init import initialised_layers, is_meta, materialise
from edgetrain.train.strategy import FLAT_OPTIMIZER, STRATEGIES, DataParallel, StepResult, Strategy



def sharding_units(model: nn.Module) -> list[nn.Module]:
    """The modules each sharded as one unit (the module docstring says which), in forward order."""
    units = []
    for child in model.children():
        inner = list(child.children()) if isinstance(child, (nn.Sequential, nn.ModuleList)) else [child]
        units += [m for m in inner if any(True for _ in m.parameters())]
    return units


def _charged(emulator: LinkEmulator, sent: int, collective) -> None:
    """Run FSDP's collective to the end, then count its bytes and charge its time (``LinkEmulator.end``)."""
    started = emulator.begin()
    work = collective()
    if work is not None:
        work.wait()
    emulator.end(started, [("allgather", sent)])  # p-1 ring rounds, for the reduce-scatter as well


class CountingAllGather(DefaultAllGather):
    """FSDP2's all-gather, blocking, with the bytes each device sends counted and its time charged."""

    def __init__(self, emulator: LinkEmulator):
        self.emulator = emulator

    def __call__(self, output_tensor, input_tensor, group, async_op=False):
        payload = input_tensor.numel() * input_tensor.element_size()
        _charged(self.emulator, ring_allgather_bytes(payload, group.size()),
                 lambda: super(CountingAllGather, self).__call__(output_tensor, input_tensor, group))
        return None


class CountingReduceScatter(DefaultReduceScatter):
    """FSDP2's reduce-scatter, blocking, with the bytes each device sends counted and its time charged."""

    def __init__(self, emulator: LinkEmulator):
        self.emulator = emulator

    def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
        payload = input_tensor.numel() * input_tensor.element_size()
        # a ring reduce-scatter is the first half of a ring all-reduce
        _charged(self.emulator, ring_allreduce_bytes(payload, group.size()) // 2,
                 lambda: super(CountingReduceScatter, self).__call__(output_tensor, input_tensor, group, op))
        return None


@torch.no_grad()
def _initialise_shards(model: nn.Module, whole: nn.Module, seed: int, device: torch.device) -> None:
    """Each layer of ``whole`` (its meta twin) materialised and initialised alone (models/init.py); ``model``
    keeps this device's shard of each parameter, then the full layer is freed before the next."""
    for name, layer in initialised_layers(whole, seed, device):
        target = model.get_submodule(name)
        for key, full in [*layer.named_parameters(recurse=False), *layer.named_buffers(recurse=False)]:
            mine = getattr(target, key)
            if isinstance(mine, DTensor):  # no communication: every device computed the same full tensor
                full = distribute_tensor(full, mine.device_mesh, mine.placements, src_data_rank=None)
                mine = mine.to_local()
                full = full.to_local()
            mine.copy_(full)
        layer.to_empty(device="meta", recurse=False)


class FullyShardedDataParallel(Strategy):
    """Data parallel over the batch, with the model's state sharded over the devices (FSDP2)."""

    name = "fsdp"
    pooled = True

    adapt = DataParallel.adapt  # --batchnorm sync: CrossDeviceBatchNorm2d, as in data parallelism

    @property
    def calibration_batch(self) -> None:
        return None  # no device holds the whole model the throttle's reference pass would run

    def materialise(self, model: nn.Module) -> nn.Module:
        # stays on meta (a model built for real is moved): setup shards it, then materialises the shards
        return materialise(model, self.context.spec.seed, self.context.device, keep=lambda name: False)

    def setup(self, model: nn.Module) -> None:
        c = self.context
        on_meta = any(is_meta(m) for m in model.modules())
        whole = copy.deepcopy(model) if on_meta else None  # plain meta tensors: each layer's full initial value
        if not on_meta:  # a model passed built: every device starts from device 0's weights, as DDP's constructor
            # does; whole tensors, before sharding, so that each device then keeps its own shard of device 0's
            for tensor in [*model.parameters(), *model.buffers()]:
                dist.broadcast(tensor.data, src=0)
        self.clock = device_clock(model, c.spec, c.rank, c.world, c.stats, c.link, "fsdp")
        # the run's device type, not the default mesh's (CUDA wherever torch sees a GPU, --accelerator cpu too)
        mesh = init_device_mesh(c.device.type, (c.world,))
        for module in [*sharding_units(model), model]:
            fully_shard(module, mesh=mesh)
            module.set_custom_all_gather(CountingAllGather(self.clock.emulator))
            module.set_custom_reduce_scatter(CountingReduceScatter(self.clock.emulator))
        if on_meta:
            model.to_empty(device=c.device)  # this device's shards only
            _initialise_shards(model, whole, c.spec.seed, c.device)
        self.model = model
        self.finished = False

    def train_step(self, x, y, optimizer) -> StepResult:
        c = self.context
        busy_before = c.stats.snapshot()["comm_s"]
        self.clock.emulator.start_step()
        optimizer.zero_grad(set_to_none=True)
        out = self.model(x)
        loss_sum = c.task.loss(out, y)
        (loss_sum * (c.world / c.cfg.batch_size)).backward()
        optimizer.step()
        # every collective ran blocking: the time in them is the time compute waited on them
        comm_s = c.stats.snapshot()["comm_s"] - busy_before
        self.clock.after_step(0)  # the clock: the latest device's compute, then the step's collectives
        return StepResult(loss_sum.item(), c.task.train_counts(out.detach(), y), c.task.batch_size(y), comm_s,
                          self.clock.step_metrics())

    def finish(self) -> None:
        if self.finished:
            return
        self.finished = True
        self.clock.finish()
        for buffer in self.model.buffers():  # rank 0's BatchNorm statistics: the final model's
            dist.broadcast(buffer.data, src=0)
        # nothing is gathered: every device writes its own shards (sharded_state)

    def sharded_state(self, optimizer, final: bool = False) -> dict:
        # DTensor shards, as FSDP2 holds them; the optimizer's state flattened by parameter name
        model, optim = get_state_dict(self.model, optimizer, options=FLAT_OPTIMIZER)
        if not final:  # during the run each device's own BatchNorm statistics: in state_dict, its own file
            model = {key: value for key, value in model.items() if isinstance(value, DTensor)}
        return {"model": model, "optimizer": optim}

    def load_sharded_state(self, state: dict, optimizer) -> None:
        set_state_dict(self.model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"],
                       options=dataclasses.replace(FLAT_OPTIMIZER, strict=False))

    def state_dict(self) -> dict:
        """This device's buffers (BatchNorm statistics: each device's own, as with DDP's local BatchNorm);
        its shards and optimizer state are its part of the checkpoint (``sharded_state``)."""
        return {"buffers": {name: b.detach().clone() for name, b in self.model.named_buffers()}}

    @torch.no_grad()
    def load_state_dict(self, state: dict) -> None:
        for name, buffer in self.model.named_buffers():
            buffer.copy_(state["buffers"][name])

    @property
    def eval_model(self) -> nn.Module:
        return self.model

    def summary(self) -> dict:
        units = sharding_units(self.model)
        shard = sum(p.to_local().numel() for p in self.model.parameters())
        return {**clock_summary(self.clock), "sync": "fsdp",
                "fsdp": {"units": len(units) + 1, "shard_parameters": shard}}


def clock_summary(clock) -> dict:
    """The clock's and tally's summary, less its yardstick against data parallelism's fp32 all-reduce."""
    summary = clock.summary()
    for key in ("compress", "fp32_allreduce_bytes_per_step", "compression_ratio"):
        summary.pop(key)
    return summary


STRATEGIES[FullyShardedDataParallel.name] = FullyShardedDataParallel
