"""FLOPs of training: one counter (PyTorch's ``FlopCounterMode`` over one real training step, forward and
backward), what a device achieved, and the peak it is rated against. Every FLOP figure in edgetrain comes from
here; what is counted and why: docs/design/flops.md."""
from __future__ import annotations

import copy
from typing import Any, Sequence

import torch
from torch.utils.flop_counter import FlopCounterMode

from edgetrain.cluster import profiles
from edgetrain.spec import dataset_shape
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


def training_flops_per_sample(model: torch.nn.Module, dataset: str = "cifar10", batch_size: int = 2, *,
                              input_shape: Sequence[int] | None = None,
                              num_classes: int | None = None, task=None, example=None) -> dict[str, Any]:
    """Forward, backward and total flops of one training sample (``count_training_flops``).

    ``input_shape`` (channels, height, width) and ``num_classes`` override ``dataset``'s nominal ones:
    pass the run's real shape. ``model`` itself is left untouched (a deep copy is counted).
    """
    if input_shape is None or num_classes is None:
        nominal_shape, nominal_classes = dataset_shape(dataset)
        input_shape, num_classes = input_shape or nominal_shape, num_classes or nominal_classes
    return count_training_flops(model, input_shape, num_classes, batch_size, task=task, example=example)


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
        host_core_gflops = profiles.host_core_gflops
    core = host_core_gflops()
    return {"peak_gflops": speed * core, "peak_modelled": True,
            "peak_source": f"modelled: profile {profile.name}'s speed {speed:.3g} x one host core's "
                           f"{core:.1f} GEMM GFLOPS"}
