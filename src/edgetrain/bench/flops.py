"""Training FLOPs per sample of a model, forward and backward, counted by PyTorch.

``torch.utils.flop_counter.FlopCounterMode`` intercepts every aten operator
during one real training step and sums the flops of the ones it has formulas
for: matrix products and convolutions (a multiply-add counts 2), which is
where almost all of a CNN's arithmetic is and exactly what a GEMM peak
measures. Element-wise work (BatchNorm, ReLU, the optimizer) is not counted:
it costs time, not flops, which is why achieved GFLOPS stay below the GEMM
peak. Backward is roughly twice forward (gradients for inputs and weights).

The count is taken at the input shape actually trained (a 416x416 tiled run
costs 169 times a 32x32 one) on the model actually trained (a registered one
or the user's own ``nn.Module``); every FLOP figure in edgetrain, the trainer's
``summary.json`` and ``bench batch`` alike, comes from
``training_flops_per_sample``. The counting step runs on a deep copy of the
model with the global RNG state saved and restored, so it changes neither the
weights, the BatchNorm statistics nor the random stream the run trains with.

Achieved GFLOPS = flops per sample x samples/s; dividing by the GEMM peak
measured with the same thread count gives the fraction of peak that training
reaches (the roofline view: Williams et al., CACM 2009). A fraction above 1
cannot be true of a correct count and peak: it means the peak was measured
low (a noisy or throttled measurement) and is flagged, never printed bare.

Which peak a device is rated against (``device_peak``): an emulated device
(throttled to its profile's speed) against its profile's rating, ``gflops``
as the profile declares it (nominal, not measured here) or, for a profile
that gives only ``speed``, speed x one host core's GEMM GFLOPS (modelled);
an unthrottled device against this host's measured GEMM peak, if there is one.
"""
from __future__ import annotations

import copy
from typing import Any, Sequence

import torch
from torch.utils.flop_counter import FlopCounterMode

from edgetrain.bench.workload import dataset_shape


def training_flops_per_sample(model: torch.nn.Module, dataset: str = "cifar10", batch_size: int = 2, *,
                              input_shape: Sequence[int] | None = None,
                              num_classes: int | None = None) -> dict[str, Any]:
    """Forward, backward and total flops of one training sample (counted on a ``batch_size`` batch).

    ``input_shape`` (channels, height, width) and ``num_classes`` override ``dataset``'s nominal ones:
    pass the run's real shape. ``model`` itself is left untouched (a deep copy is counted).
    """
    if input_shape is None or num_classes is None:
        nominal_shape, nominal_classes = dataset_shape(dataset)
        input_shape, num_classes = input_shape or nominal_shape, num_classes or nominal_classes
    shape = tuple(input_shape)
    counted = copy.deepcopy(model).train()
    loss_fn = torch.nn.CrossEntropyLoss()
    with torch.random.fork_rng(devices=[]):  # dropout and the fake batch must not move the run's RNG
        x = torch.randn(batch_size, *shape)
        y = torch.randint(0, num_classes, (batch_size,))
        with FlopCounterMode(display=False) as forward_counter:
            loss = loss_fn(counted(x), y)
        with FlopCounterMode(display=False) as backward_counter:
            loss.backward()
    fwd = forward_counter.get_total_flops() / batch_size
    bwd = backward_counter.get_total_flops() / batch_size
    return {"forward_flops": fwd, "backward_flops": bwd, "total_flops": fwd + bwd, "input_shape": list(shape),
            "model": type(model).__name__,
            "counted_ops": "matmul and convolution (multiply-add = 2 flops)",
            "counter": "torch.utils.flop_counter.FlopCounterMode"}


def achieved(flops_per_sample: float, samples_per_s: float, peak_gflops: float | None) -> dict[str, Any]:
    """Achieved GFLOPS and the fraction of ``peak_gflops``; ``above_peak`` flags a fraction over 1."""
    gflops = flops_per_sample * samples_per_s / 1e9
    fraction = gflops / peak_gflops if peak_gflops else None
    return {"achieved_gflops": gflops, "fraction_of_peak": fraction,
            "above_peak": fraction is not None and fraction > 1}


def device_peak(profile, speed: float | None, host_core_gflops=None) -> dict[str, Any] | None:
    """The peak an emulated device is rated against, from its profile, or None (rate it against the host's).

    ``speed`` is the device's emulated speed (None: it ran unthrottled, at host speed, so its profile's
    rating does not apply). ``host_core_gflops`` is called only for a profile that gives ``speed`` alone.
    """
    if speed is None:
        return None
    if profile.gflops is not None:
        return {"peak_gflops": float(profile.gflops), "peak_modelled": True,
                "peak_source": f"profile {profile.name}: {profile.gflops:g} GFLOPS as the profile declares it "
                               f"(nominal, not measured here)"}
    if host_core_gflops is None:
        from edgetrain.cluster.profiles import host_core_gflops
    core = host_core_gflops()
    return {"peak_gflops": speed * core, "peak_modelled": True,
            "peak_source": f"modelled: profile {profile.name}'s speed {speed:.3g} x one host core's "
                           f"{core:.1f} GEMM GFLOPS"}
