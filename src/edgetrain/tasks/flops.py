"""The one FLOP counter: training FLOPs per sample of a model, forward and backward, counted by PyTorch.

``torch.utils.flop_counter.FlopCounterMode`` intercepts every aten operator
during one real training step and sums the flops of the ones it has formulas
for: matrix products and convolutions (a multiply-add counts 2), which is
where almost all of a CNN's arithmetic is and exactly what a GEMM peak
measures. Element-wise work (BatchNorm, ReLU, the optimizer) is not counted:
it costs time, not flops. Backward is roughly twice forward (gradients for
inputs and weights).

Every FLOP figure in edgetrain comes from here: the trainer's
``summary.json``, ``bench batch`` (through ``bench.flops``, which adds the
peaks a count is rated against) and ``plan``'s model costs. It lives with
the tasks, whose loss a training step takes, so that all three can use it without importing one another.

The count is taken at the input shape given (a 416x416 tiled run costs 169
times a 32x32 one) on a deep copy of the model, with the global RNG state
saved and restored, so it changes neither the weights, the BatchNorm
statistics, the gradients nor the random stream of the run that asks.
A model on the meta device (models/init.py) is counted there: the formulas
need shapes only, so the count is the same and nothing is allocated.
"""
from __future__ import annotations

import copy
from typing import Any, Sequence

import torch
from torch.utils.flop_counter import FlopCounterMode

from edgetrain.tasks.base import Task
from edgetrain.tasks.classification import ClassificationTask


def count_training_flops(model: torch.nn.Module, input_shape: Sequence[int], num_classes: int,
                         batch_size: int = 2, task: Task | None = None, example: tuple | None = None
                         ) -> dict[str, Any]:
    """Forward, backward and total flops of one training sample (counted on a ``batch_size`` batch), the loss
    being ``task``'s (default: a classifier's) on ``example``'s targets (a real batch ``(x, target)``, whose
    inputs set the batch size) or on a target the task makes up (``Task.example_target``)."""
    task = task or ClassificationTask()
    shape = tuple(input_shape)
    counted = copy.deepcopy(model).train()
    counted.zero_grad(set_to_none=True)
    with torch.random.fork_rng(devices=[]):  # dropout and the fake batch must not move the run's RNG
        # on the model's device: a model built on the meta device (models/init.py) is counted without storage
        first = next(iter(counted.parameters()), torch.empty(0))
        dtype = first.dtype if first.is_floating_point() else None  # the model's precision (a float64 model)
        if example is not None:
            x, target = example[0].to(first.device, dtype), task.to_device(example[1], first.device)
            batch_size = len(x)
        else:
            x, target = torch.randn(batch_size, *shape, device=first.device, dtype=dtype), None
        with FlopCounterMode(display=False) as forward_counter:
            out = counted(x)
            loss = task.loss(out, task.example_target(out) if target is None else target) / batch_size
        with FlopCounterMode(display=False) as backward_counter:
            loss.backward()
    fwd = forward_counter.get_total_flops() / batch_size
    bwd = backward_counter.get_total_flops() / batch_size
    return {"forward_flops": fwd, "backward_flops": bwd, "total_flops": fwd + bwd, "input_shape": list(shape),
            "model": type(model).__name__,
            "counted_ops": "matmul and convolution (multiply-add = 2 flops)",
            "counter": "torch.utils.flop_counter.FlopCounterMode"}
