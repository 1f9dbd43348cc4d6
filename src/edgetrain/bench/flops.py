"""Training FLOPs per sample of a model, forward and backward, counted by PyTorch.

``torch.utils.flop_counter.FlopCounterMode`` intercepts every aten operator
during one real training step and sums the flops of the ones it has formulas
for: matrix products and convolutions (a multiply-add counts 2), which is
where almost all of a CNN's arithmetic is and exactly what a GEMM peak
measures. Element-wise work (BatchNorm, ReLU, the optimizer) is not counted:
it costs time, not flops, which is why achieved GFLOPS stay below the GEMM
peak. Backward is roughly twice forward (gradients for inputs and weights).

Achieved GFLOPS = flops per sample x samples/s; dividing by the GEMM peak
measured with the same thread count gives the fraction of peak that training
reaches (the roofline view: Williams et al., CACM 2009).
"""
from __future__ import annotations

from typing import Any

import torch
from torch.utils.flop_counter import FlopCounterMode

from edgetrain.bench.workload import dataset_shape


def training_flops_per_sample(model: torch.nn.Module, dataset: str = "cifar10",
                              batch_size: int = 2) -> dict[str, Any]:
    """Forward, backward and total flops of one training sample (counted on a ``batch_size`` batch)."""
    shape, classes = dataset_shape(dataset)
    x = torch.randn(batch_size, *shape)
    y = torch.randint(0, classes, (batch_size,))
    model.train()
    loss_fn = torch.nn.CrossEntropyLoss()
    with FlopCounterMode(display=False) as forward_counter:
        loss = loss_fn(model(x), y)
    with FlopCounterMode(display=False) as backward_counter:
        loss.backward()
    model.zero_grad(set_to_none=True)
    fwd = forward_counter.get_total_flops() / batch_size
    bwd = backward_counter.get_total_flops() / batch_size
    return {"forward_flops": fwd, "backward_flops": bwd, "total_flops": fwd + bwd,
            "counted_ops": "matmul and convolution (multiply-add = 2 flops)",
            "counter": "torch.utils.flop_counter.FlopCounterMode"}


def achieved(flops_per_sample: float, samples_per_s: float, peak_gflops: float | None) -> dict[str, Any]:
    gflops = flops_per_sample * samples_per_s / 1e9
    return {"achieved_gflops": gflops,
            "fraction_of_peak": gflops / peak_gflops if peak_gflops else None}
