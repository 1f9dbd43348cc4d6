"""The split planner: which layers each pipeline stage gets, balancing stage time under memory limits.

Design: docs/design/pipeline.md ("The split planner").
"""
from __future__ import annotations

import copy

import math
from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.flop_counter import FlopCounterMode

from edgetrain.cluster.links import Link, collective_time
from edgetrain.errors import EdgetrainError

MIB = 2**20


@dataclass(frozen=True)
class LayerCost:
    """One layer's costs: FLOPs and activation bytes per sample, weights in bytes."""

    name: str
    train_flops: float          # forward + backward, per sample
    param_bytes: int            # trainable parameters
    buffer_bytes: int           # BatchNorm statistics and the like
    activation_bytes: float     # saved for backward, per sample
    output_bytes: float         # what the next stage receives, per sample
    traffic_bytes: float = 0.0       # memory read and written, forward + backward, per sample
    pass_traffic_bytes: float = 0.0  # memory read and written per micro-batch pass whatever its size (weights)


@dataclass(frozen=True)
class StageDevice:
    """What the planner needs of a device: a name, its rated GFLOPS, memory (None: no limit) and memory
    bandwidth in GB/s (None: compute-only)."""

    name: str
    gflops: float
    memory_mb: float | None = None
    memory_gbps: float | None = None


class _TrafficCounter(TorchDispatchMode):
    """Bytes every non-view aten op reads and writes: per sample (first dimension ``batch``) and per pass."""

    def __init__(self, batch: int):
        super().__init__()
        self.batch, self.per_sample, self.per_pass = batch, 0, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if not func.is_view:
            for t in tree_leaves((args, kwargs, out)):
                if isinstance(t, torch.Tensor):
                    nbytes = t.numel() * t.element_size()
                    if t.dim() and t.shape[0] == self.batch:
                        self.per_sample += nbytes
                    else:
                        self.per_pass += nbytes
        return out


def layer_costs(layers: list[tuple[str, nn.Module]], input_shape: tuple[int, ...], batch: int = 2) -> list[LayerCost]:
    """Each layer's counted costs (docs/design/pipeline.md); the layers' parameters are not changed."""
    activation = torch.randn(batch, *input_shape, generator=torch.Generator().manual_seed(0))
    costs = []
    # A tensor two layers save (a ReLU's output, the next conv's input) is one storage, counted for the
    # first; every saved tensor is kept alive until the end so that no two storages share an address.
    counted: set[int] = set()
    kept: list[torch.Tensor] = []
    for index, (name, layer) in enumerate(layers):
        if any(t.is_meta for t in [*layer.parameters(), *layer.buffers()]):
            # a layer built on the meta device (models/init.py): a copy with storage, one layer at a time
            layer = copy.deepcopy(layer).to_empty(device="cpu")
        layer.train()
        inputs = activation.detach().requires_grad_(index > 0)  # the first layer's input is the data
        weights = {t.untyped_storage().data_ptr() for t in [*layer.parameters(), *layer.buffers()]}
        saved: dict[int, int] = {}

        def pack(t: torch.Tensor) -> torch.Tensor:
            storage = t.untyped_storage()
            if storage.data_ptr() not in weights and storage.data_ptr() not in counted:  # weights count as such
                saved[storage.data_ptr()] = storage.nbytes()
                kept.append(t)
            return t

        state = {k: v.clone() for k, v in layer.state_dict().items()}  # BatchNorm statistics stay as they were
        traffic = _TrafficCounter(batch)
        with FlopCounterMode(display=False) as counter, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            with traffic:
                output = layer(inputs)
            if output.requires_grad:
                seed = torch.ones_like(output)  # the next layer writes this gradient: its traffic, not this layer's
                with traffic:
                    output.backward(seed)
        layer.load_state_dict(state)
        layer.zero_grad(set_to_none=True)
        costs.append(LayerCost(
            name=name, train_flops=counter.get_total_flops() / batch,
            param_bytes=sum(p.numel() * p.element_size() for p in layer.parameters() if p.requires_grad),
            buffer_bytes=sum(b.numel() * b.element_size() for b in layer.buffers()),
            activation_bytes=sum(saved.values()) / batch, output_bytes=output.numel() * output.element_size() / batch,
            traffic_bytes=traffic.per_sample / batch, pass_traffic_bytes=traffic.per_pass))
        counted.update(saved)
        activation = output.detach()
    return costs


@dataclass
class SplitPlan:
    """A split: ``bounds[s] = (first layer, end)`` of stage ``s``, with its modelled time and memory."""

    layers: list[LayerCost]
    devices: list[StageDevice]
    bounds: list[tuple[int, int]]
    stage_s: list[float]          # modelled compute seconds per step (roofline)
    memory_mb: list[float]        # modelled peak memory
    even_step_s: float | None     # the bottleneck of an even split by layer count (None: it does not fit)
    cut_s: list[float] = field(default_factory=list)  # modelled link seconds per step of the cut before stage s+1

    @property
    def step_s(self) -> float:
        return max(self.stage_s + self.cut_s)

    @property
    def starts(self) -> tuple[int, ...]:
        return tuple(first for first, _ in self.bounds[1:])

    def explain(self) -> list[str]:
        """Why this split, one line per stage and one for the balance."""
        lines = []
        for s, ((first, end), device) in enumerate(zip(self.bounds, self.devices)):
            limit = "no limit" if device.memory_mb is None else f"limit {device.memory_mb:,.0f} MiB"
            bandwidth = "" if device.memory_gbps is None else f", {device.memory_gbps:g} GB/s"
            link = f", link to the next {_ms(self.cut_s[s])}/step" if s < len(self.cut_s) and self.cut_s[s] else ""
            lines.append(f"stage {s} on {device.name} ({device.gflops:g} GFLOPS{bandwidth}, {limit}): "
                         f"layers {first}-{end - 1} "
                         f"({self.layers[first].name} .. {self.layers[end - 1].name}), {_ms(self.stage_s[s])}/step, "
                         f"{self.memory_mb[s]:,.0f} MiB{link}")
        slowest = (f"stage {self.stage_s.index(self.step_s)}" if self.step_s in self.stage_s
                   else f"the link after stage {self.cut_s.index(self.step_s)}")
        even = ("an even split does not fit the memory limits" if self.even_step_s is None else
                f"an even split by layer count would take {_ms(self.even_step_s)} "
                f"({self.even_step_s / self.step_s:.2f}x)")
        lines.append(f"bottleneck {slowest}: {_ms(self.step_s)} per step (modelled: per layer the slower of "
                     f"counted FLOPs / rated GFLOPS and counted bytes / memory GB/s; cuts over the link); {even}")
        return lines


def p2p_seconds(links: list[Link | None], a: int, b: int, nbytes: float) -> float:
    """Modelled seconds to send ``nbytes`` once between devices ``a`` and ``b``: one point-to-point round over
    the slower of their links (none: free)."""
    pair = [link for link in (links[a], links[b]) if link is not None]
    return collective_time(pair, "p2p", nbytes) if nbytes else 0.0


def _ms(seconds: float) -> str:
    return f"{seconds:,.2f} s" if seconds >= 1 else f"{seconds * 1e3:.3g} ms"


def _prefix(values: list[float]) -> list[float]:
    sums = [0.0]
    for v in values:
        sums.append(sums[-1] + v)
    return sums


def optimizer_copies(optimizer: str, momentum: float) -> int:
    """Model-sized optimizer buffers: Adam 2, SGD with momentum 1, plain SGD 0."""
    return 2 if optimizer == "adam" else int(momentum > 0)


@dataclass(frozen=True)
class PipelineStep:
    """The pipeline's training step: ``batch`` samples in ``microbatches`` under ``schedule`` (gpipe holds every
    micro-batch's activations at once), ``optimizer_copies`` of optimizer state per parameter (0 plain SGD, 1
    momentum, 2 Adam), ``fixed_mb`` MiB on every device besides."""
    batch: int
    microbatches: int
    schedule: str = "gpipe"
    optimizer_copies: int = 1
    fixed_mb: float = 0.0


def plan_split(layers: list[LayerCost], devices: list[StageDevice], step: PipelineStep, what: str = "the model",
               transfer_s: Callable[[int, float], float] | None = None) -> SplitPlan:
    """The split whose slowest stage or cut is fastest with every stage within its device's memory
    (docs/design/pipeline.md). ``transfer_s(s, nbytes)``: seconds to send ``nbytes`` once between stages
    ``s - 1`` and ``s`` (None: no link time)."""
    stages, n = len(devices), len(layers)
    if stages > n:
        raise EdgetrainError(f"{what} has {n} layers, too few for {stages} pipeline stages; use at most {n} devices")
    costs = _StageCosts(layers, devices, step, transfer_s)
    bottleneck, choice = costs.solve(costs.cut, math.inf)
    if bottleneck == math.inf:
        _refuse(layers, devices, costs.memory, step.fixed_mb, what)
    if transfer_s is not None:
        # When a link bounds the step, many splits tie; among those, the one whose slowest stage is fastest
        # (its cuts no slower than that bottleneck), so compute stays balanced behind the link.
        _, choice = costs.solve(lambda s, i: 0.0, bottleneck)
    ends = [n]
    for s in range(stages - 1, 0, -1):
        ends.append(choice[s][ends[-1]])
    cuts = [0, *reversed(ends)]
    bounds = list(zip(cuts[:-1], cuts[1:]))
    return SplitPlan(layers, devices, bounds, [costs.seconds(s, i, j) for s, (i, j) in enumerate(bounds)],
                     [costs.memory(s, i, j) for s, (i, j) in enumerate(bounds)], costs.even_step_s(),
                     [costs.cut(s, i) for s, (i, _) in enumerate(bounds) if s])


class _StageCosts:
    """What a stage ``s`` over layers ``i..j-1`` costs (``seconds``, ``memory``), what the cut before layer ``i``
    costs (``cut``), whether it ``fits``; prefix sums over the layers, so that each is O(1)."""

    def __init__(self, layers: list[LayerCost], devices: list[StageDevice], step: PipelineStep,
                 transfer_s: Callable[[int, float], float] | None):
        self.layers, self.devices, self.transfer_s = layers, devices, transfer_s
        self.batch, self.microbatches, self.schedule, self.fixed_mb = (step.batch, step.microbatches, step.schedule,
                                                                       step.fixed_mb)
        optimizer_copies = step.optimizer_copies
        self.stages, n = len(devices), len(layers)
        self.layer_seconds = [_prefix([self._layer_s(device, layer) for layer in layers]) for device in devices]
        self.trainable = _prefix([layer.param_bytes for layer in layers])
        self.weights = _prefix([layer.param_bytes * (2 + optimizer_copies) + layer.buffer_bytes for layer in layers])
        self.activations = _prefix([layer.activation_bytes for layer in layers])
        # the largest parameter bytes of a layer in i..j-1: the gradient being accumulated (docs/design/pipeline.md)
        self.largest = [[0.0] * (n + 1) for _ in range(n + 1)]
        for i in range(n):
            for j in range(i + 1, n + 1):
                self.largest[i][j] = max(self.largest[i][j - 1], layers[j - 1].param_bytes)
        self.accumulating = step.microbatches > 1

    def _layer_s(self, device: StageDevice, layer: LayerCost) -> float:
        compute = layer.train_flops * self.batch / (device.gflops * 1e9)
        if device.memory_gbps is None:
            return compute
        traffic = layer.traffic_bytes * self.batch + layer.pass_traffic_bytes * self.microbatches
        return max(compute, traffic / (device.memory_gbps * 1e9))

    def in_flight(self, s: int) -> float:
        if self.schedule == "gpipe":
            return self.batch
        return min(self.microbatches, self.stages - s) * self.batch / self.microbatches

    def memory(self, s: int, i: int, j: int) -> float:
        return self.fixed_mb + (self.weights[j] - self.weights[i]
                                + (self.activations[j] - self.activations[i]) * self.in_flight(s)
                                + (self.largest[i][j] if self.accumulating else 0.0)) / MIB

    def seconds(self, s: int, i: int, j: int) -> float:
        return self.layer_seconds[s][j] - self.layer_seconds[s][i]

    def cut(self, s: int, i: int) -> float:  # the link between stages s-1 and s, cut before layer i
        if self.transfer_s is None:
            return 0.0
        return self.microbatches * 2 * self.transfer_s(s, self.layers[i - 1].output_bytes * self.batch
                                                       / self.microbatches)

    def fits(self, s: int, i: int, j: int) -> bool:  # a stage trains something and fits its device
        limit = self.devices[s].memory_mb
        return self.trainable[j] > self.trainable[i] and (limit is None or self.memory(s, i, j) <= limit)

    def solve(self, link_cost: Callable[[int, int], float], cap: float) -> tuple[float, list[list[int]]]:
        """(least bottleneck, choice) over stages and the cuts ``link_cost`` charges, with every cut under
        ``cap``. best[s][j]: the least bottleneck of stages 0..s over layers 0..j-1; choice[s][j]: where
        stage s starts."""
        stages, n = self.stages, len(self.layers)
        best = [[math.inf] * (n + 1) for _ in range(stages)]
        choice = [[0] * (n + 1) for _ in range(stages)]
        for j in range(1, n + 1):
            if self.fits(0, 0, j):
                best[0][j] = self.seconds(0, 0, j)
        for s in range(1, stages):
            for j in range(s + 1, n + 1):
                for i in range(s, j):
                    if best[s - 1][i] < math.inf and self.cut(s, i) <= cap and self.fits(s, i, j):
                        candidate = max(best[s - 1][i], link_cost(s, i), self.seconds(s, i, j))
                        if candidate < best[s][j]:
                            best[s][j], choice[s][j] = candidate, i
        return best[-1][n], choice

    def even_step_s(self) -> float | None:
        """The step of the even split (as many layers per stage), None where a stage of it does not fit."""
        stages, n = self.stages, len(self.layers)
        per, extra = divmod(n, stages)
        even_cuts = [0, *(s * per + min(s, extra) for s in range(1, stages)), n]
        even = list(zip(even_cuts[:-1], even_cuts[1:]))
        if not all(self.fits(s, i, j) for s, (i, j) in enumerate(even)):
            return None
        return max(max(self.seconds(s, i, j), self.cut(s, i) if s else 0.0) for s, (i, j) in enumerate(even))


def _refuse(layers, devices, memory, fixed_mb: float, what: str) -> None:
    limits = [d.memory_mb for d in devices if d.memory_mb is not None]
    largest = max(limits)  # not empty: without limits every split fits
    for index, layer in enumerate(layers):
        alone = min(memory(s, index, index + 1) for s in range(len(devices)))
        if alone > largest:
            raise EdgetrainError(f"layer {index} ({layer.name}) of {what} alone needs {alone:,.0f} MiB on a stage, more "
                                 f"than the largest device's {largest:,.0f} MiB; a pipeline cannot cut inside a "
                                 f"layer: use devices with more memory or a smaller batch")
    need = fixed_mb * len(devices) + min(memory(s, 0, len(layers)) - fixed_mb for s in range(len(devices)))
    raise EdgetrainError(f"{what} does not fit these {len(devices)} devices even pooled: its stages need about "
                         f"{need:,.0f} MiB in all ({fixed_mb:,.0f} MiB fixed per device included) and the devices "
                         f"have {sum(limits):,.0f} MiB ({', '.join(f'{d.name} {d.memory_mb or math.inf:,.0f}' for d in devices)}); "
                         f"add devices, use ones with more memory or lower the batch")
