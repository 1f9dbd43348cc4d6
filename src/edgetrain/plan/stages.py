"""Pipeline stages: a model as a sequence of layers, and where that sequence is cut.

A pipeline stage is a contiguous run of layers on one device; the only
tensor that crosses a cut is the activation the layer before it returns
(and its gradient, backwards). So a model can be cut only where its
forward *is* its layers called in order: ``pipeline_layers`` takes the
model's children in order, with each ``nn.Sequential`` / ``nn.ModuleList``
child replaced by its own children, and ``check_sequential`` runs the model
and that sequence on one example batch and refuses the model, naming its
layers, if they differ (a forward that applies functions between its
children, as ResNet's ``F.relu`` after ``bn1``, or skips, as a residual).

``--stages even`` gives each of S devices ``ceil`` or ``floor`` of
``layers / S`` layers, in order; ``--stages 4,8`` gives the layer indices
at which stages 1, 2, ... start (``spec.PipelineSpec``).
"""
from __future__ import annotations

import copy

import torch
from torch import nn

from edgetrain.errors import EdgetrainError
from edgetrain.spec import PipelineSpec


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
