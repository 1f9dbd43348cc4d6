"""The split planner: which layers each pipeline stage gets, balancing stage time under memory limits.

As Asteroid (MobiCom 2024) plans pipeline stages over heterogeneous edge
devices, by dynamic programming over per-layer costs, stage ``s`` (on device
``s``, in rank order) gets a contiguous run of layers, chosen so that the
slowest stage is as fast as it can be while every stage fits its device:

    time(s, i..j)   = sum of the layers' training FLOPs per sample x batch / device s's GFLOPS
    memory(s, i..j) = fixed + the layers' weights + gradients + optimizer state
                      + their saved activations x the samples in flight on stage s
    best[s][j]      = min over i of max(best[s-1][i], time(s, i..j)), memory(s, i..j) <= limit s

Every stage must hold a parameter (its optimizer would have nothing to
step otherwise). ``O(S L^2)`` for S stages and L layers. Samples in flight: GPipe holds every
micro-batch's activations at once (the global batch); 1F1B at most
``min(M, S - s)`` micro-batches on stage ``s``. ``fixed`` is what every device
holds whatever its layers (the runtime and the dataset; the caller gives it).

Per-layer costs (``layer_costs``) are counted on the real layers at batch 2,
as ``plan.costs`` counts the whole model: FLOPs with ``FlopCounterMode`` (a
layer's forward, then its backward from a gradient of ones), saved
activations with ``saved_tensors_hooks``, parameter and buffer bytes. Stage
times are modelled (counted FLOPs over the profile's rated GFLOPS, the same
efficiency for every device, so it does not change the split); the link time
of the activations between stages is not part of the objective.

When no split fits, the error says why: a layer that alone needs more than
the largest device is named; otherwise the memory the model needs pooled
over the stages against what the devices have in all.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

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


@dataclass(frozen=True)
class StageDevice:
    """What the planner needs of a device: a name, its rated GFLOPS and memory (None: no limit)."""

    name: str
    gflops: float
    memory_mb: float | None = None


def layer_costs(layers: list[tuple[str, nn.Module]], input_shape: tuple[int, ...], batch: int = 2) -> list[LayerCost]:
    """Each layer's counted costs (see the module docstring); the layers' parameters are not changed."""
    activation = torch.randn(batch, *input_shape, generator=torch.Generator().manual_seed(0))
    costs = []
    # A tensor two layers save (a ReLU's output, the next conv's input) is one storage, counted for the
    # first; every saved tensor is kept alive until the end so that no two storages share an address.
    counted: set[int] = set()
    kept: list[torch.Tensor] = []
    for index, (name, layer) in enumerate(layers):
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
        with FlopCounterMode(display=False) as counter, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            output = layer(inputs)
            if output.requires_grad:
                output.backward(torch.ones_like(output))
        layer.load_state_dict(state)
        layer.zero_grad(set_to_none=True)
        costs.append(LayerCost(
            name=name, train_flops=counter.get_total_flops() / batch,
            param_bytes=sum(p.numel() * p.element_size() for p in layer.parameters() if p.requires_grad),
            buffer_bytes=sum(b.numel() * b.element_size() for b in layer.buffers()),
            activation_bytes=sum(saved.values()) / batch, output_bytes=output.numel() * output.element_size() / batch))
        counted.update(saved)
        activation = output.detach()
    return costs


@dataclass
class SplitPlan:
    """A split: ``bounds[s] = (first layer, end)`` of stage ``s``, with its modelled time and memory."""

    layers: list[LayerCost]
    devices: list[StageDevice]
    bounds: list[tuple[int, int]]
    stage_s: list[float]          # modelled compute seconds per step
    memory_mb: list[float]        # modelled peak memory
    even_step_s: float | None     # the bottleneck of an even split by layer count (None: it does not fit)

    @property
    def step_s(self) -> float:
        return max(self.stage_s)

    @property
    def starts(self) -> tuple[int, ...]:
        return tuple(first for first, _ in self.bounds[1:])

    def explain(self) -> list[str]:
        """Why this split, one line per stage and one for the balance."""
        lines = []
        for s, ((first, end), device) in enumerate(zip(self.bounds, self.devices)):
            limit = "no limit" if device.memory_mb is None else f"limit {device.memory_mb:,.0f} MiB"
            lines.append(f"stage {s} on {device.name} ({device.gflops:g} GFLOPS, {limit}): layers {first}-{end - 1} "
                         f"({self.layers[first].name} .. {self.layers[end - 1].name}), {_ms(self.stage_s[s])}/step, "
                         f"{self.memory_mb[s]:,.0f} MiB")
        slowest = self.stage_s.index(self.step_s)
        even = ("an even split does not fit the memory limits" if self.even_step_s is None else
                f"an even split by layer count would take {_ms(self.even_step_s)} "
                f"({self.even_step_s / self.step_s:.2f}x)")
        lines.append(f"bottleneck stage {slowest}: {_ms(self.step_s)} per step (modelled: counted FLOPs / rated "
                     f"GFLOPS); {even}")
        return lines


def _ms(seconds: float) -> str:
    return f"{seconds:,.2f} s" if seconds >= 1 else f"{seconds * 1e3:.3g} ms"


def _prefix(values: list[float]) -> list[float]:
    sums = [0.0]
    for v in values:
        sums.append(sums[-1] + v)
    return sums


def plan_split(layers: list[LayerCost], devices: list[StageDevice], batch: int, microbatches: int,
               schedule: str = "gpipe", optimizer_copies: int = 1, fixed_mb: float = 0.0,
               what: str = "the model") -> SplitPlan:
    """The split whose slowest stage is fastest with every stage within its device's memory (module docstring).

    ``optimizer_copies``: optimizer state per parameter (0 plain SGD, 1 momentum, 2 Adam).
    """
    stages, n = len(devices), len(layers)
    if stages > n:
        raise EdgetrainError(f"{what} has {n} layers, too few for {stages} pipeline stages; use at most {n} devices")
    flops = _prefix([layer.train_flops for layer in layers])
    trainable = _prefix([layer.param_bytes for layer in layers])
    weights = _prefix([layer.param_bytes * (2 + optimizer_copies) + layer.buffer_bytes for layer in layers])
    activations = _prefix([layer.activation_bytes for layer in layers])

    def in_flight(s: int) -> float:
        return batch if schedule == "gpipe" else min(microbatches, stages - s) * batch / microbatches

    def memory(s: int, i: int, j: int) -> float:
        return fixed_mb + (weights[j] - weights[i] + (activations[j] - activations[i]) * in_flight(s)) / MIB

    def seconds(s: int, i: int, j: int) -> float:
        return (flops[j] - flops[i]) * batch / (devices[s].gflops * 1e9)

    def fits(s: int, i: int, j: int) -> bool:  # a stage trains something and fits its device
        limit = devices[s].memory_mb
        return trainable[j] > trainable[i] and (limit is None or memory(s, i, j) <= limit)

    # best[s][j]: the least bottleneck time of stages 0..s over layers 0..j-1; choice[s][j]: where stage s starts
    best = [[math.inf] * (n + 1) for _ in range(stages)]
    choice = [[0] * (n + 1) for _ in range(stages)]
    for j in range(1, n + 1):
        if fits(0, 0, j):
            best[0][j] = seconds(0, 0, j)
    for s in range(1, stages):
        for j in range(s + 1, n + 1):
            for i in range(s, j):
                if best[s - 1][i] < math.inf and fits(s, i, j):
                    candidate = max(best[s - 1][i], seconds(s, i, j))
                    if candidate < best[s][j]:
                        best[s][j], choice[s][j] = candidate, i
    if best[-1][n] == math.inf:
        _refuse(layers, devices, memory, fixed_mb, what)
    ends = [n]
    for s in range(stages - 1, 0, -1):
        ends.append(choice[s][ends[-1]])
    cuts = [0, *reversed(ends)]
    bounds = list(zip(cuts[:-1], cuts[1:]))
    per, extra = divmod(n, stages)
    even_cuts = [0, *(s * per + min(s, extra) for s in range(1, stages)), n]
    even = list(zip(even_cuts[:-1], even_cuts[1:]))
    even_step_s = (max(seconds(s, i, j) for s, (i, j) in enumerate(even))
                   if all(fits(s, i, j) for s, (i, j) in enumerate(even)) else None)
    return SplitPlan(layers, devices, bounds, [seconds(s, i, j) for s, (i, j) in enumerate(bounds)],
                     [memory(s, i, j) for s, (i, j) in enumerate(bounds)], even_step_s)


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
