"""Per-strategy predictions: ddp, fsdp and pipeline on the same cluster, side by side, and which one to use.

Design: docs/design/planner.md ("Strategies side by side").
"""
from __future__ import annotations

import math

import torch

from edgetrain.comm.accounting import ring_allgather_bytes, ring_allreduce_bytes
from edgetrain.data.datasets import input_channels
from edgetrain.errors import EdgetrainError
from edgetrain.kinds import STRATEGY_KINDS, strategy_kind
from edgetrain.models import build_model
from edgetrain.plan.config import PlanInputs
from edgetrain.plan.model import MIB, Prediction, exchange_seconds
from edgetrain.pipelining.split import (PipelineStep, StageDevice, layer_costs, optimizer_copies, p2p_seconds,
                                        plan_split)
from edgetrain.pipelining.stages import FORWARD, check_sequential, pipeline_layers, pipeline_timeline, schedule_order
from edgetrain.plan.exchanges import Traffic
from edgetrain.results import PlanComparison, PlanStrategy, PlanStrategyDevice

# the preference among equally fast strategies: their order of declaration (edgetrain.kinds)
STRATEGY_ORDER = tuple(name for name, kind in STRATEGY_KINDS.items() if kind.planner is not None)


def _build(inputs: PlanInputs) -> torch.nn.Module:
    costs = inputs.costs
    return build_model(inputs.cfg.model, input_channels(costs.input_shape), costs.num_classes)


def _shard_bytes(params: list[torch.Tensor], p: int) -> int:
    """Bytes of one device's FSDP2 shard of ``params``: dim 0 cut into ``p`` chunks of ceil(dim0 / p) rows."""
    total = 0
    for t in params:
        rows = t.shape[0] if t.dim() else 1
        total += math.ceil(rows / p) * (t.numel() // max(rows, 1)) * t.element_size()
    return total


def fsdp_gathered_bytes(shards: list[int], p: int) -> tuple[int, int]:
    """(gathered parameters, unit buffers) at FSDP2's peak, from each unit's shard bytes, the root's last.

    The root stays gathered; the unit in flight holds its gathered parameters and one more ``p x s`` buffer
    (all-gather output, unsharded gradients or reduce-scatter input; docs/design/planner.md).
    """
    root, largest = p * shards[-1], p * max(shards[:-1], default=0)
    peak = max(root + 2 * largest, 2 * root)
    return root + largest, peak - root - largest


def fsdp_units(model: torch.nn.Module) -> list[list[torch.Tensor]]:
    """The trainable parameters of each FSDP unit in forward order, the root's (what is left) last."""
    units = [[t for t in layer.parameters() if t.requires_grad] for _, layer in pipeline_layers(model)]
    units = [u for u in units if u]
    seen = {id(t) for u in units for t in u}
    return [*units, [t for t in model.parameters() if t.requires_grad and id(t) not in seen]]


def ddp_strategy(inputs: PlanInputs, pred: Prediction, microbatches: int = 0, schedule: str = "") -> PlanStrategy:
    """``model.predict``'s data-parallel prediction as a strategy row."""
    sent = round(pred.traffic.bytes_per_exchange / pred.traffic.period)
    devices = [PlanStrategyDevice(rank=d.rank, profile=d.profile, role=f"batch {d.batch}", compute_s=d.compute_s,
                                  comm_s=d.comm_s + d.wait_s, step_s=d.step_s, memory_mb=d.memory_mb,
                                  memory_total_mb=d.memory_total_mb, memory_limit_mb=d.memory_limit_mb,
                                  over_limit=d.over_limit, sent_bytes_per_step=sent) for d in pred.devices]
    return _strategy("ddp", devices, pred.step_s, pred.throughput,
                     [f"{pred.traffic.sync}, compress {pred.traffic.compress}: all-reduce of the gradients"])


def fsdp_strategy(inputs: PlanInputs, pred: Prediction, microbatches: int = 0, schedule: str = "") -> PlanStrategy:
    """FSDP2's shards, gathered units and collectives (docs/design/planner.md)."""
    p, costs = len(pred.devices), inputs.costs
    units = fsdp_units(_build(inputs))
    shards = [_shard_bytes(u, p) for u in units]
    collectives = []
    for index, shard in enumerate(shards):
        if not shard:
            continue
        gathers = 1 if index == len(units) - 1 else 2  # the root stays gathered from forward to backward
        collectives += [("allgather", ring_allgather_bytes(shard, p))] * gathers
        collectives.append(("allgather", ring_allreduce_bytes(p * shard, p) // 2))  # reduce-scatter: p-1 rounds
    sent = sum(b for _, b in collectives)
    traffic = Traffic("sync", 1, tuple(collectives), sent, 3 * costs.param_bytes, False, 0.0, sync="fsdp")
    comm = exchange_seconds(traffic, pred.links) if p > 1 and collectives else 0.0  # type: ignore[arg-type]
    copies = optimizer_copies(inputs.cfg.optimizer, inputs.cfg.momentum)
    shard_total = sum(shards)
    gathered, buffers = fsdp_gathered_bytes(shards, p)
    c_max = max(d.compute_s for d in pred.devices)
    devices = []
    for d in pred.devices:
        memory = {"weights": (shard_total + costs.buffer_bytes) / MIB, "gradients": shard_total / MIB,
                  "optimizer": copies * shard_total / MIB,
                  "gathered_unit": gathered / MIB, "unit_buffers": buffers / MIB,
                  "activations": d.memory_mb["activations"], "dataset": d.memory_mb["dataset"],
                  "runtime": d.memory_mb["runtime"]}
        total = sum(memory.values())
        devices.append(PlanStrategyDevice(
            rank=d.rank, profile=d.profile, role=f"batch {d.batch}, 1/{p} of every unit", compute_s=d.compute_s,
            comm_s=c_max - d.compute_s + comm, step_s=c_max + comm, memory_mb=memory, memory_total_mb=total,
            memory_limit_mb=d.memory_limit_mb, over_limit=d.memory_limit_mb is not None and total > d.memory_limit_mb,
            sent_bytes_per_step=sent))
    step = c_max + comm
    return _strategy("fsdp", devices, step, inputs.cfg.batch_size / step,
                     [f"{len([s for s in shards if s])} units; per step {sent / 1e6:,.3f} MB sent per device "
                      f"({sent / costs.param_bytes:.3f}x the parameter bytes; 3(p-1)/p = {3 * (p - 1) / p:.3f})"])


def pipeline_strategy(inputs: PlanInputs, pred: Prediction, microbatches: int, schedule: str) -> PlanStrategy:
    """``split.plan_split``'s stages, micro-batched (docs/design/planner.md). Raises ``EdgetrainError`` if it cannot run."""
    cfg, costs = inputs.cfg, inputs.costs
    model = _build(inputs)
    what = f"model {cfg.model}"
    # random, not zeros: a residual x + f(x) equals f(x) at x = 0 and would pass as a sequence
    check_sequential(model, torch.randn(2, *costs.input_shape, generator=torch.Generator().manual_seed(0)), what)
    layers = layer_costs(pipeline_layers(model), costs.input_shape)
    rows, links = pred.devices, pred.links
    stage_devices = [StageDevice(f"device {d.rank} ({d.profile})", d.gflops * pred.efficiency,
                                 spec.profile.memory_mb, spec.profile.memory_gbps)
                     for d, spec in zip(rows, inputs.devices)]
    fixed = costs.dataset_bytes / MIB + pred.runtime_mb
    copies = optimizer_copies(cfg.optimizer, cfg.momentum)
    batch, stages = cfg.batch_size, len(rows)
    split = plan_split(layers, stage_devices, PipelineStep(batch, microbatches, schedule, copies, fixed), what=what,
                       transfer_s=lambda s, nbytes: p2p_seconds(links, s - 1, s, nbytes))

    sent, memory, actions = [], [], []
    cut_bytes = [layers[end - 1].output_bytes * batch / microbatches for _, end in split.bounds]  # one micro-batch
    for s, (first, end) in enumerate(split.bounds):
        out_bytes = layers[end - 1].output_bytes if s < stages - 1 else 0.0   # activation to stage s+1
        in_bytes = layers[first - 1].output_bytes if s > 0 else 0.0           # its gradient back to stage s-1
        sent.append(round((out_bytes + in_bytes) * batch))
        per_microbatch = split.stage_s[s] / microbatches
        actions.append([(kind, chunk, per_microbatch * (1 / 3 if kind == FORWARD else 2 / 3))
                        for kind, chunk in schedule_order(schedule, s, stages, microbatches)])
        in_flight = batch if schedule == "gpipe" else min(microbatches, stages - s) * batch / microbatches
        params = sum(layer.param_bytes for layer in layers[first:end])
        memory.append({"weights": (params + sum(layer.buffer_bytes for layer in layers[first:end])) / MIB,
                       "gradients": (params + (max(layer.param_bytes for layer in layers[first:end])
                                               if microbatches > 1 else 0.0)) / MIB,  # + accumulation (pipelining/split.py)
                       "optimizer": copies * params / MIB,
                       "activations": sum(layer.activation_bytes for layer in layers[first:end]) * in_flight / MIB,
                       "dataset": costs.dataset_bytes / MIB, "runtime": pred.runtime_mb})
    ends, _ = pipeline_timeline([0.0] * stages, actions,
                                lambda kind, a, b: p2p_seconds(links, a, b, cut_bytes[min(a, b)]))
    step = max(ends)
    devices = []
    for s, (d, (first, end)) in enumerate(zip(rows, split.bounds)):
        total, limit = sum(memory[s].values()), stage_devices[s].memory_mb
        devices.append(PlanStrategyDevice(
            rank=d.rank, profile=d.profile, role=f"stage {s}: layers {first}-{end - 1} ({layers[first].name} .. "
                                                 f"{layers[end - 1].name})",
            compute_s=split.stage_s[s], comm_s=step - split.stage_s[s], step_s=step, memory_mb=memory[s],
            memory_total_mb=total, memory_limit_mb=limit, over_limit=limit is not None and total > limit,
            sent_bytes_per_step=sent[s]))
    bubble = (stages - 1) / (microbatches + stages - 1)
    result = _strategy("pipeline", devices, step, batch / step,
                       [f"{schedule}, {microbatches} micro-batches of {batch // microbatches}, {stages} stages: "
                        f"bubble (S-1)/(M+S-1) = {bubble:.1%}", *split.explain(),
                        "each device builds only its stage's layers, and evaluates through the stages without "
                        "gathering the others (train/pipeline.py)"])
    result.bubble_fraction = bubble
    return result


def _strategy(name: str, devices: list[PlanStrategyDevice], step_s: float, throughput: float,
              notes: list[str]) -> PlanStrategy:
    over = [d for d in devices if d.over_limit]
    refused = None
    if over:
        worst = max(over, key=lambda d: d.memory_total_mb - (d.memory_limit_mb or 0))
        refused = (f"{name} does not fit: device {worst.rank} ({worst.profile}) needs {worst.memory_total_mb:,.0f} MiB "
                   f"of its {worst.memory_limit_mb:,.0f} MiB ({len(over)} of {len(devices)} devices over their limit)")
    return PlanStrategy(strategy=name, fits=not over, refused=refused, step_s=step_s,
                        throughput_samples_per_s=throughput,
                        memory_total_mb_max=max(d.memory_total_mb for d in devices),
                        sent_bytes_per_step_max=max(d.sent_bytes_per_step for d in devices), devices=devices,
                        notes=notes)


def compare(inputs: PlanInputs, pred: Prediction, strategies: tuple[str, ...], microbatches: int,
            schedule: str) -> PlanComparison:
    """The ``strategies`` predicted side by side; with more than one, the recommendation (docs/design/planner.md)."""
    rows = []
    for name in strategies:
        try:  # each strategy's own model (its kind's ``planner``); one without, or an unknown one, is refused
            rows.append(strategy_kind(name).load_planner()(inputs, pred, microbatches, schedule))
        except EdgetrainError as e:
            if len(strategies) == 1:
                raise
            rows.append(PlanStrategy(strategy=name, fits=False, refused=str(e)))
    link = pred.devices[0].link
    if len(rows) == 1:
        return PlanComparison(link=link, strategies=rows)
    recommended, reason = recommend(rows, link)
    return PlanComparison(link=link, strategies=rows, recommended=recommended, reason=reason)


def recommend(rows: list[PlanStrategy], link: str) -> tuple[str | None, str]:
    """(the strategy to use, why in one line): the fastest modelled step among those that fit."""
    fitting = sorted((r for r in rows if r.fits and r.step_s is not None),
                     key=lambda r: (r.step_s, STRATEGY_ORDER.index(r.strategy)))
    if not fitting:
        return None, ("no strategy fits: " + "; ".join(r.refused or r.strategy for r in rows)
                      + "; add devices, lower the batch or use devices with more memory")
    best = fitting[0]
    others = ", ".join(f"{r.strategy} {r.step_s:,.3f} s" for r in fitting[1:])
    refused = [r.strategy for r in rows if not r.fits]
    why = (f"it fits every device ({best.memory_total_mb_max:,.0f} MiB at most)"
           + (f" and {', '.join(refused)} do{'es' if len(refused) == 1 else ''} not" if refused else ""))
    return best.strategy, (f"{best.strategy}: {why}; fastest modelled step on link {link}: {best.step_s:,.3f} s, "
                           f"{best.sent_bytes_per_step_max / 1e6:,.3f} MB sent per device per step"
                           + (f" (vs {others})" if others else ""))
