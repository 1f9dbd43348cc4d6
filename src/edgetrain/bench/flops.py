"""FLOPs achieved by training, and the peak a device is rated against.

The count itself is ``tasks.flops.count_training_flops`` (the one counter,
shared with the trainer and ``plan``: see there what it counts);
``training_flops_per_sample`` adds the nominal input shape of a dataset for
benches that name one. Every FLOP figure in edgetrain, the trainer's
``summary.json`` and ``bench batch`` alike, comes from that counter.

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

from typing import Any, Sequence

import torch

from edgetrain.bench.workload import dataset_shape
from edgetrain.tasks.flops import count_training_flops


def training_flops_per_sample(model: torch.nn.Module, dataset: str = "cifar10", batch_size: int = 2, *,
                              input_shape: Sequence[int] | None = None,
                              num_classes: int | None = None, task=None, example=None) -> dict[str, Any]:
    """Forward, backward and total flops of one training sample (``tasks.flops.count_training_flops``).

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
        from edgetrain.cluster.profiles import host_core_gflops
    core = host_core_gflops()
    return {"peak_gflops": speed * core, "peak_modelled": True,
            "peak_source": f"modelled: profile {profile.name}'s speed {speed:.3g} x one host core's "
                           f"{core:.1f} GEMM GFLOPS"}
