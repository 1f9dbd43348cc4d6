"""``TiledTraining``: what the trainer's ``Tiled`` strategy (train/strategy.py) drives for ``--strategy tiled``.

One training step on every device (no central server):

1. every device receives the same global batch and runs the tiled section on
   its tile (``tiled.section_forward``): fused groups, halo exchanges between
   them, BatchNorm with whole-map statistics;
2. an all-to-all hands each device whole feature maps for its share of the
   batch (``tiled.hand_off``), and the rest of the network (the weight-heavy
   tail) runs data-parallel on that share; tail BatchNorm layers become
   ``CrossDeviceBatchNorm2d`` so their statistics are over the global batch;
3. ``backward()`` retraces all of it through the adjoint exchanges, and one
   all-reduce sums every parameter's gradient share over devices.

Each device's loss is ``task.loss(its share) / batch`` (the task's loss is a
sum over samples, tasks/base.py), so the shares of the gradient sum to the
gradient of the mean loss over the global batch, exactly what one device would
compute. The share of a target batch is ``task.take``: targets of any structure
(a detection image's boxes) are cut as the feature maps are.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from edgetrain.cluster.memory import SavedTensorMeter
from edgetrain.cluster.peers import wait
from edgetrain.errors import EdgetrainError
from edgetrain.models.batchnorm import convert_batchnorm
from edgetrain.spec import TilingSpec
from edgetrain.tasks.base import Task
from edgetrain.tasks.classification import ClassificationTask
from edgetrain.tiling.grouping import Machine, choose_groups, grouping_cost, measure_machine
from edgetrain.tiling.layers import Unit, check_sequence, describe, model_layers
from edgetrain.tiling.plan import SectionPlan
from edgetrain.tiling.tiled import Comm, batch_bounds, hand_off, section_forward


@dataclass(frozen=True)
class GivenMachine:
    """The cost model's numbers of a device and its link given instead of measured on the first step (None:
    measured, ``grouping.measure_machine``)."""
    device_flops: float | None = None
    bandwidth_bytes_s: float | None = None
    latency_s: float | None = None


class TiledTraining:
    """Spatially tiled training of the first layers, data-parallel for the rest.

    ``tiling.groups`` is ``None`` (auto) or the group ends as layer indices
    into the model's layer sequence (``layers`` in the report): ``(4, 8)`` fuses
    layers 0-3, exchanges halos, fuses 4-7, and hands off to the data-parallel
    tail at layer 8. With ``None`` the tiled section ends where the model says
    (``tiled_section_default``; stem and ``layer1`` for ResNet; else the longest
    tileable prefix) and ``grouping.choose_groups`` places the exchanges on the
    first step, when the batch size is known. Every collective waits at most
    ``timeout_s`` (the run's ``--timeout``).
    """

    shard_data = False  # every device receives the same global batch

    def __init__(self, model: nn.Module, tiling: TilingSpec, input_shape: tuple[int, int, int],
                 given: GivenMachine = GivenMachine(), group=None, timeout_s: float = 300.0,
                 task: Task | None = None):
        self.grid = tiling.grid
        self.task = task or ClassificationTask()
        self.comm = Comm(group, timeout_s)
        self.model = model
        self.input_shape = tuple(int(v) for v in input_shape)
        if len(self.input_shape) != 3:
            raise EdgetrainError(f"input_shape {input_shape} must be (channels, height, width)")
        layers, end, self.plan = plan_section(model, tiling, self.input_shape)
        self.groups_given = tiling.groups is not None
        self.layer_names = [n for n, _ in layers]
        rows, cols = self.grid
        if self.comm.world != rows * cols:
            raise EdgetrainError(f"grid {rows}x{cols} needs {rows * cols} devices but {self.comm.world} are running; "
                                 f"start {rows * cols} devices or choose a grid with {self.comm.world} tiles")
        self.ends: list[int] | None = list(tiling.groups) if tiling.groups is not None else None
        self.groups_why = "groups given by the user" if self.groups_given else "chosen on the first step"
        self.machine_args = (given.device_flops, given.bandwidth_bytes_s, given.latency_s)
        self.machine: Machine | None = None
        if self.comm.world > 1:
            _cross_device_batchnorm(model, [m for _, m in layers[end:]], group)
        # Their all-reduces (lead's CrossDeviceBatchNorm2d) bypass Comm: count their payload here.
        self._tail_bn_bytes = 0 if self.comm.world == 1 else sum(
            2 * (2 * m.num_features + 1) * next(iter(m.state_dict().values()), torch.zeros(1)).element_size()
            for _, t in layers[end:] for m in t.modules() if isinstance(m, nn.BatchNorm2d))
        self.tail = nn.Sequential(*[model.get_submodule(n) if _is_submodule(model, n) else m
                                    for n, m in layers[end:]])
        self._params = list(model.parameters())
        self._sync_from_device0()
        self.steps = 0
        self.totals = {"step_s": 0.0, "exchange_s": 0.0}
        self.last: dict = {}

    def parameters(self):
        """The model's parameters (tail BatchNorm converted), for the optimizer; the same on every device."""
        return iter(self._params)

    def _sync_from_device0(self) -> None:
        if self.comm.world == 1:
            return
        tensors = [t.data for t in self._params] + [b for b in self.model.buffers() if b.is_floating_point()]
        flat = torch.cat([t.reshape(-1).to(torch.float64) for t in tensors])
        wait(dist.broadcast(flat, src=self.comm._global(0), group=self.comm.group, async_op=True), self.comm.timeout_s,
             "tiled training: initial model broadcast")
        offset = 0
        for t in tensors:
            t.copy_(flat[offset:offset + t.numel()].view_as(t))
            offset += t.numel()

    @property
    def groups(self) -> list[tuple[int, int]]:
        return list(zip([0] + self.ends[:-1], self.ends))

    def _choose(self, batch: int, itemsize: int) -> None:
        self.machine = measure_machine(self.comm, *self.machine_args)
        if self.ends is None:
            self.ends, self.groups_why = choose_groups(self.plan, batch, itemsize, self.machine)
            if self.comm.rank == 0:
                print(self.groups_why, flush=True)

    def forward_backward(self, x: torch.Tensor, y, loss_fn=None) -> tuple[float, int, int]:
        """One step's forward and backward; returns (mean loss over the global batch, right answers where the
        task counts them (``correct``), samples); ``last["local"]`` holds this device's share of the accounting.

        ``y``: the task's target batch. ``loss_fn``: a loss that AVERAGES over its batch (``F.cross_entropy``)
        to use instead of the task's summed one.

        Afterwards every parameter's ``.grad`` (added to what it held before) is
        the gradient of the mean loss over the global batch, on every device.
        """
        start = time.perf_counter()
        n = x.shape[0]
        if tuple(x.shape[1:]) != self.input_shape:
            raise EdgetrainError(f"batch of shape {tuple(x.shape[1:])} does not match input_shape {self.input_shape}")
        if n < self.comm.world:
            raise EdgetrainError(f"a batch of {n} samples cannot be shared by {self.comm.world} devices; "
                                 f"use a batch size of at least {self.comm.world}")
        if self.machine is None:
            self._choose(n, x.element_size())
        self.comm.reset()
        before = [p.grad for p in self._params]
        for p in self._params:
            p.grad = None
        meter = SavedTensorMeter(self._params + [x])
        with meter:
            tile = section_forward(x, self.plan, self.groups, self.comm)
        peak = meter.bytes + tile.numel() * tile.element_size()
        share = hand_off(tile, self.plan, self.comm)
        del tile
        bounds = batch_bounds(n, self.comm.world)
        lo, hi = bounds[self.comm.rank], bounds[self.comm.rank + 1]
        out = self.tail(share)
        y_share = self.task.take(y, slice(lo, hi))
        loss = self.task.loss(out, y_share) / n if loss_fn is None else loss_fn(out, y_share) * ((hi - lo) / n)
        loss.backward()
        counts = self.task.train_counts(out.detach(), y_share)
        correct = int(counts.get("correct", 0))
        self._sum_gradients(before)
        metrics = torch.zeros(2 + 2 * self.comm.world, dtype=torch.float64)
        metrics[0], metrics[1] = loss.detach().item(), correct
        local = {"loss_sum": metrics[0].item() * n, "counts": counts, "samples": hi - lo}
        metrics[2 + self.comm.rank] = peak
        metrics[2 + self.comm.world + self.comm.rank] = meter.bytes
        if self._tail_bn_bytes and self.tail.training:
            self.comm.bytes_sent["tail_batchnorm"] += self._tail_bn_bytes
        self.comm.all_reduce(metrics, "metrics")
        step_s = time.perf_counter() - start
        exchange_s = sum(self.comm.seconds.values())
        self.steps += 1
        self.totals["step_s"] += step_s
        self.totals["exchange_s"] += exchange_s
        w = self.comm.world
        self.last = {
            "peak": [int(v) for v in metrics[2:2 + w]], "saved": [int(v) for v in metrics[2 + w:]],
            "bytes": dict(self.comm.bytes_sent), "seconds": dict(self.comm.seconds),
            "step_s": step_s, "exchange_s": exchange_s, "batch": n, "local": local,
            "bytes_recv": self.comm.bytes_recv,
        }
        return float(metrics[0]), int(metrics[1]), n

    def _sum_gradients(self, before: list[torch.Tensor | None]) -> None:
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self._params]
        if self.comm.world > 1:
            flat = torch.cat([g.reshape(-1) for g in grads])
            self.comm.all_reduce(flat, "gradients")
            grads = list(flat.split([g.numel() for g in grads]))
        for p, g, old in zip(self._params, grads, before):
            g = g.view_as(p)
            p.grad = g if old is None else old + g

    def report(self) -> dict:
        """What the last step cost on this device; JSON-able. No communication (safe on one device alone)."""
        batch = self.last.get("batch", 1)
        itemsize = self._params[0].element_size() if self._params else 4
        totals = grouping_cost(self.plan, self.ends, batch, itemsize, self.machine) \
            if self.ends and self.machine else {}
        bytes_sent = self.last.get("bytes", {})
        steps = max(self.steps, 1)
        return {
            "strategy": "tiled",
            "grid": f"{self.grid[0]}x{self.grid[1]}",
            "devices": self.comm.world,
            "rank": self.comm.rank,
            "layers": [f"{i}:{n}" for i, n in enumerate(self.layer_names)],
            "tiled_section_end": self.plan.end,
            "groups": [list(g) for g in self.groups] if self.ends else None,
            "groups_given": self.groups_given,
            "groups_why": self.groups_why,
            "batch": batch,
            "peak_memory_bytes_tiled_section": self.last.get("peak"),
            "saved_for_backward_bytes_tiled_section": self.last.get("saved"),
            "memory_note": "per device, measured on the last step: bytes of activations autograd saved for backward "
                           "in the tiled section (torch.autograd.graph.saved_tensors_hooks, once per storage; "
                           "weights and the input batch excluded) plus the section's output tile; the memory the "
                           "section holds when its forward ends",
            "bytes_exchanged_per_step": sum(v for k, v in bytes_sent.items() if k != "metrics"),
            "bytes_exchanged_by_kind": bytes_sent,
            "bytes_note": "payload bytes this device sent on the last step (all-reduce payload counted once)",
            "seconds_by_kind": self.last.get("seconds", {}),
            "recompute_overhead_pct": totals.get("recompute_overhead_pct"),
            "recompute_note": "extra forward FLOPs of the tiled section from overlaps, counted from region sizes",
            "time_split_s": {
                "step": self.totals["step_s"] / steps,
                "exchange": self.totals["exchange_s"] / steps,
                "compute": (self.totals["step_s"] - self.totals["exchange_s"]) / steps,
                "note": "mean per step on this device; exchange is wall time in halo, hand-off, tiled BatchNorm, "
                        "gradient and metric communication, waiting included; the tail's BatchNorm all-reduces "
                        "are counted in compute",
            },
            "machine": None if self.machine is None else {
                "device_flops": self.machine.device_flops, "bandwidth_bytes_s": self.machine.bandwidth_bytes_s,
                "latency_s": self.machine.latency_s, "source": self.machine.source},
            "modelled_grouping_cost": totals,
        }


def plan_section(model: nn.Module, tiling: TilingSpec, input_shape: tuple[int, int, int]
                 ) -> tuple[list[tuple[str, nn.Module]], int, SectionPlan]:
    """(layers, end of the tiled section, its ``SectionPlan``) of ``model`` on ``tiling.grid``.

    Needs no process group: ``train`` calls it before any device starts. An
    ``EdgetrainError`` if the layers cannot be tiled or the grid is finer
    than a feature map (counted from layer shapes; the model runs once on one
    sample, in ``check_sequence``).
    """
    layers, default_end = model_layers(model)
    check_sequence(model, layers, input_shape)
    ends = tiling.groups
    end = ends[-1] if ends is not None else (default_end or _tileable_prefix(layers, input_shape[0]))
    if end > len(layers):
        raise EdgetrainError(f"groups {list(ends)} end past the model's {len(layers)} layers; layers are "
                             + ", ".join(f"{i}:{n}" for i, (n, _) in enumerate(layers)))
    units: list[Unit] = []
    channels = input_shape[0]
    for name, module in layers[:end]:
        units.append(describe(name, module, channels))
        channels = units[-1].out_channels
    return layers, end, SectionPlan(units, input_shape[1:], tiling.grid, input_shape[0])


def _tileable_prefix(layers: list[tuple[str, nn.Module]], channels: int) -> int:
    count = 0
    for name, module in layers:
        try:
            channels = describe(name, module, channels).out_channels
        except EdgetrainError:
            break
        count += 1
    if count == 0:
        name, module = layers[0]
        describe(name, module, channels)  # raises the error naming the first layer
    return count


def _cross_device_batchnorm(model: nn.Module, tail: list[nn.Module], group) -> None:
    """Make every BatchNorm2d of the tail a CrossDeviceBatchNorm2d (same state and dtype), in ``model``."""
    inside = {id(m) for t in tail for m in t.modules()}
    for name, module in list(model.named_modules()):
        if id(module) in inside and type(module) is nn.BatchNorm2d:
            new = convert_batchnorm(module, group)
            new.to(next(iter(module.state_dict().values())).dtype).load_state_dict(module.state_dict())
            parent_name, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent_name) if parent_name else model, child, new)


def _is_submodule(model: nn.Module, name: str) -> bool:
    try:
        model.get_submodule(name)
        return True
    except AttributeError:
        return False
