"""``--strategy fsdp``: parameters, gradients and optimizer state sharded over the devices (FSDP2); with
``--fsdp-replicas R``, R such sharded replicas exchanging gradients or DiLoCo's pseudo-gradient.

PyTorch's ``fully_shard`` over gloo, with its collectives wrapped to count bytes and charge links;
each device materialises and checkpoints its own shards only.

Design: docs/design/fsdp.md
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
from edgetrain.comm.compress.spec import build_compressor
from edgetrain.comm.emulation import LinkEmulator
from edgetrain.errors import EdgetrainError
from edgetrain.kinds import named_by_kind
from edgetrain.models.init import initialised_layers, is_meta, materialise
from edgetrain.spec import get_link
from edgetrain.train.replicas import Channel, ReplicaExchange, load_replica_part, replica_part
from edgetrain.train.strategy import FLAT_OPTIMIZER, DataParallel, StepResult, Strategy



def sharding_units(model: nn.Module) -> list[nn.Module]:
    """The modules each sharded as one unit (the module docstring says which), in forward order."""
    units = []
    for child in model.children():
        inner = list(child.children()) if isinstance(child, (nn.Sequential, nn.ModuleList)) else [child]
        units += [m for m in inner if any(True for _ in m.parameters())]
    return units


def _charged(emulator: LinkEmulator, sent: int, collective, peers: list[int] | None) -> None:
    """Run FSDP's collective to the end, then count its bytes and charge its time (``LinkEmulator.end``) over
    ``peers``' links (None: every device's)."""
    started = emulator.begin()
    work = collective()
    if work is not None:
        work.wait()
    emulator.end(started, [("allgather", sent)], peers)  # p-1 ring rounds, for the reduce-scatter as well


class CountingAllGather(DefaultAllGather):
    """FSDP2's all-gather, blocking, with the bytes each device sends counted and its time charged
    (``peers``: the global ranks of the replica it runs in; None: every device)."""

    def __init__(self, emulator: LinkEmulator, peers: list[int] | None = None):
        self.emulator, self.peers = emulator, peers

    def __call__(self, output_tensor, input_tensor, group, async_op=False):
        payload = input_tensor.numel() * input_tensor.element_size()
        _charged(self.emulator, ring_allgather_bytes(payload, group.size()),
                 lambda: super(CountingAllGather, self).__call__(output_tensor, input_tensor, group), self.peers)
        return None


class CountingReduceScatter(DefaultReduceScatter):
    """FSDP2's reduce-scatter, blocking, with the bytes each device sends counted and its time charged."""

    def __init__(self, emulator: LinkEmulator, peers: list[int] | None = None):
        self.emulator, self.peers = emulator, peers

    def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
        payload = input_tensor.numel() * input_tensor.element_size()
        # a ring reduce-scatter is the first half of a ring all-reduce
        _charged(self.emulator, ring_allreduce_bytes(payload, group.size()) // 2,
                 lambda: super(CountingReduceScatter, self).__call__(output_tensor, input_tensor, group, op),
                 self.peers)
        return None


def _local(tensor):
    """A DTensor's local shard (the same storage), or the tensor itself."""
    return tensor._local_tensor if isinstance(tensor, DTensor) else tensor


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


@named_by_kind("strategy")
class FullyShardedDataParallel(Strategy):
    """Data parallel over the batch, with the model's state sharded over the devices (FSDP2)."""


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
        mesh = self._shard_mesh()
        peers = None if self.replicas == 1 else [self.replica * self.shards + s for s in range(self.shards)]
        for module in [*sharding_units(model), model]:
            fully_shard(module, mesh=mesh)
            module.set_custom_all_gather(CountingAllGather(self.clock.emulator, peers))
            module.set_custom_reduce_scatter(CountingReduceScatter(self.clock.emulator, peers))
        if on_meta:
            model.to_empty(device=c.device)  # this device's shards only
            _initialise_shards(model, whole, c.spec.seed, c.device)
        self.model = model
        self.between = self._replica_exchange() if self.replicas > 1 else None
        self.finished = False

    def _shard_mesh(self):
        """The devices this device's replica is sharded over. Layout (as a hybrid pipeline's): device ``rank`` is
        shard ``rank % S`` of replica ``rank // S``; the mesh's other dimension, the devices of one shard
        position across the replicas, carries the exchange between replicas (``_replica_exchange``)."""
        c = self.context
        self.replicas = c.spec.fsdp_replicas
        if c.world % self.replicas:
            raise EdgetrainError(f"the run has {c.world} devices, not a multiple of fsdp_replicas {self.replicas} "
                                 f"(devices = shards x replicas); use a multiple of {self.replicas} devices")
        self.shards = c.world // self.replicas
        self.replica, self.position = divmod(c.rank, self.shards)
        # the run's device type, not the default mesh's (CUDA wherever torch sees a GPU, --accelerator cpu too)
        if self.replicas == 1:
            return init_device_mesh(c.device.type, (c.world,))
        self.mesh = init_device_mesh(c.device.type, (self.replicas, self.shards), mesh_dim_names=("replica", "shard"))
        return self.mesh["shard"]

    def _replica_exchange(self) -> ReplicaExchange:
        c = self.context
        link = get_link(c.link) if c.link is not None else c.spec.link
        # error feedback per parameter name; a shared seed: random-k draws the same indices in every replica
        compressor, memory = build_compressor(c.spec.compress, link, c.spec.seed, c.rank)
        names = tuple(name for name, _ in self.model.named_parameters())
        peers = [r * self.shards + self.position for r in range(self.replicas)]
        return ReplicaExchange(list(self.model.parameters()), _local, names, c.spec.sync,
                               Channel(compressor, memory, self.clock.emulator, self.mesh.get_group("replica"), peers))

    def train_step(self, x, y, optimizer) -> StepResult:
        c = self.context
        busy_before = c.stats.snapshot()["comm_s"]
        self.clock.emulator.start_step()
        optimizer.zero_grad(set_to_none=True)
        out = self.model(x)
        loss_sum = c.task.loss(out, y)
        # the reduce-scatter averages over the replica's S devices, and the exchange between replicas (if every
        # step) over the R replicas: the mean loss's gradient over the replica's B / R, then the global batch's
        (loss_sum * (c.world / c.cfg.batch_size)).backward()
        sent_before = self.between.sent if self.between else 0
        if self.between:
            self.between.after_backward()
        optimizer.step()
        if self.between:
            self.between.after_step()
        # every collective ran blocking: the time in them is the time compute waited on them
        comm_s = c.stats.snapshot()["comm_s"] - busy_before
        self.clock.after_step(0)  # the clock: the latest device's compute, then the step's collectives
        metrics = self.clock.step_metrics()
        if self.between:
            metrics["replica_bytes_sent"] = self.between.sent - sent_before
        return StepResult(loss_sum.item(), c.task.train_counts(out.detach(), y), c.task.batch_size(y), comm_s,
                          metrics)

    def finish(self) -> None:
        if self.finished:
            return
        self.finished = True
        if self.between:
            self.clock.emulator.start_step()
            self.between.finish()  # the replicas end with the same model
            self.clock.emulator.finish_step(count=False)
        self.clock.finish()
        for buffer in self.model.buffers():  # rank 0's BatchNorm statistics: the final model's
            dist.broadcast(buffer.data, src=0)
        # nothing is gathered: every device writes its own shards (sharded_state)

    def sharded_state(self, optimizer, final: bool = False) -> dict:
        # DTensor shards, as FSDP2 holds them; the optimizer's state flattened by parameter name
        model, optim = get_state_dict(self.model, optimizer, options=FLAT_OPTIMIZER)
        if not final:  # during the run each device's own BatchNorm statistics: in state_dict, its own file
            model = {key: value for key, value in model.items() if isinstance(value, DTensor)}
        return {"model": model, "optimizer": optim, **replica_part(self.between, optimizer, final)}

    def load_sharded_state(self, state: dict, optimizer) -> None:
        set_state_dict(self.model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"],
                       options=dataclasses.replace(FLAT_OPTIMIZER, strict=False))
        load_replica_part(self.between, state, optimizer)

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
        replicas = {} if self.between is None else {
            "replicas": self.replicas, "shards": self.shards, "layout": "device rank = replica x shards + shard",
            "sync": self.context.spec.sync.text, "compress": self.context.spec.compress.text,
            **self.between.summary()}
        return {**clock_summary(self.clock), "sync": "fsdp",
                "fsdp": {"units": len(units) + 1, "shard_parameters": shard, **replicas}}


def clock_summary(clock) -> dict:
    """The clock's and tally's summary, less its yardstick against data parallelism's fp32 all-reduce."""
    summary = clock.summary()
    for key in ("compress", "fp32_allreduce_bytes_per_step", "compression_ratio"):
        summary.pop(key)
    return summary

