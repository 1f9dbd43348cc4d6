"""Pipeline stages: a model as a sequence of layers, and where that sequence is cut.

Design: docs/design/pipeline.md ("A model's layers and cuts").
"""
from __future__ import annotations

import copy

import torch
from torch import nn

from edgetrain.errors import EdgetrainError
from edgetrain.spec import PipelineSpec

FORWARD, BACKWARD = 0, 1


def pipeline_layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The model's layers in the order a pipeline runs them, with their qualified names."""
    layers = []
    for name, child in model.named_children():
        if isinstance(child, (nn.Sequential, nn.ModuleList)):
            layers += [(f"{name}.{inner}", module) for inner, module in child.named_children()]
        else:
            layers.append((name, child))
    return layers


@torch.no_grad()
def check_sequential(model: nn.Module, example: torch.Tensor, what: str = "the model") -> None:
    """Refuse, in one line, a model whose forward is not ``pipeline_layers`` called in order."""
    probe = copy.deepcopy(model).eval()  # eval: BatchNorm's running statistics stay as they are
    layers = pipeline_layers(probe)
    expected = probe(example)
    out = example
    try:
        for _, layer in layers:
            out = layer(out)
        same = out.shape == expected.shape and torch.allclose(out, expected, rtol=1e-4, atol=1e-5)
    except (RuntimeError, TypeError):  # shapes that do not chain: the forward does more than its layers
        same = False
    if not same:
        names = ", ".join(name for name, _ in layers)
        raise EdgetrainError(f"{what} cannot be cut into pipeline stages: its forward is not its layers called in "
                             f"order ({names}), so no cut between them carries one tensor; use a model whose "
                             f"forward runs its children in sequence (such as small_cnn), or --strategy fsdp")


def stage_bounds(pipeline: PipelineSpec, layers: list[tuple[str, nn.Module]], stages: int) -> list[tuple[int, int]]:
    """``[(first layer, end)]`` of each stage; one line naming the layer if a stage would be empty or cut past the end."""
    n = len(layers)
    if stages > n:
        raise EdgetrainError(f"the model has {n} layers, too few for {stages} pipeline stages; use at most "
                             f"{n} devices")
    if pipeline.starts is None:
        per, extra = divmod(n, stages)
        starts = [s * per + min(s, extra) for s in range(1, stages)]
    else:
        starts = list(pipeline.starts)
        if len(starts) + 1 != stages:
            raise EdgetrainError(f"stages {','.join(map(str, starts))} make {len(starts) + 1} pipeline stages but "
                                 f"the run has {stages} devices; give {stages - 1} start indices")
        if starts and starts[-1] >= n:
            raise EdgetrainError(f"stage {len(starts)} cannot start at layer {starts[-1]}: the model has layers 0 to "
                                 f"{n - 1} (the last is {layers[-1][0]}); give start indices below {n}")
    ends = [0, *starts, n]
    bounds = list(zip(ends[:-1], ends[1:]))
    for s, (first, end) in enumerate(bounds):
        if not any(p.requires_grad for _, layer in layers[first:end] for p in layer.parameters()):
            raise EdgetrainError(f"pipeline stage {s} (layers {first}-{end - 1}: "
                                 f"{', '.join(name for name, _ in layers[first:end])}) has no parameters to train; "
                                 f"move the stage starts (--stages) so that every stage holds a layer with weights")
    return bounds


def describe_stages(layers: list[tuple[str, nn.Module]], bounds: list[tuple[int, int]]) -> list[str]:
    """One line per stage: its layers, by index and name."""
    return [f"stage {s}: layers {a}-{b - 1} ({layers[a][0]} .. {layers[b - 1][0]})" for s, (a, b) in enumerate(bounds)]


def schedule_order(schedule: str, stage: int, stages: int, microbatches: int) -> list[tuple[int, int]]:
    """``(FORWARD or BACKWARD, micro-batch)`` in the order PyTorch's schedule runs them on ``stage``:
    GPipe every forward then every backward; 1F1B ``min(M, S - s)`` forwards, then one backward and one
    forward in turn, then the backwards left."""
    if schedule == "gpipe":
        return [(FORWARD, i) for i in range(microbatches)] + [(BACKWARD, i) for i in range(microbatches)]
    warmup = min(microbatches, stages - stage)
    order, forwards = [(FORWARD, i) for i in range(warmup)], warmup
    for backward in range(microbatches):
        order.append((BACKWARD, backward))
        if forwards < microbatches:
            order.append((FORWARD, forwards))
            forwards += 1
    return order


def pipeline_timeline(starts: list[float], actions: list[list[tuple[int, int, float]]],
                      transfer_s) -> tuple[list[float], list[float]]:
    """When each stage ends its step, and how long its link carried transfers (docs/design/pipeline.md).

    ``starts[s]``: stage ``s``'s clock at the start of the step; ``actions[s]``: its ``(FORWARD or BACKWARD,
    micro-batch, seconds)`` in the order it ran them; ``transfer_s(kind, sender, receiver)``: the modelled
    seconds of one micro-batch's activation (kind FORWARD) or gradient (BACKWARD) between adjacent stages.
    """
    stages = len(actions)
    free, uplink, link_s = list(starts), list(starts), [0.0] * stages
    arrived: dict[tuple[int, int, int], float] = {}  # (kind, receiving stage, micro-batch) -> arrival
    done = [0] * stages
    while any(done[s] < len(actions[s]) for s in range(stages)):
        progressed = False
        for s in range(stages):
            while done[s] < len(actions[s]):
                kind, chunk, seconds = actions[s][done[s]]
                receiver = s + 1 if kind == FORWARD else s - 1
                waits_for_input = (kind == FORWARD and s > 0) or (kind == BACKWARD and s < stages - 1)
                if waits_for_input and (kind, s, chunk) not in arrived:
                    break
                free[s] = max(free[s], arrived.get((kind, s, chunk), free[s])) + seconds
                if 0 <= receiver < stages:
                    seconds_on_link = transfer_s(kind, s, receiver)
                    uplink[s] = max(free[s], uplink[s]) + seconds_on_link
                    arrived[(kind, receiver, int(chunk))] = uplink[s]
                    link_s[s] += seconds_on_link
                    link_s[receiver] += seconds_on_link
                done[s] += 1
                progressed = True
        if not progressed:
            raise RuntimeError("pipeline timeline: every stage waits for an input no stage sends "
                               "(actions out of the schedule's order)")
    return free, link_s
