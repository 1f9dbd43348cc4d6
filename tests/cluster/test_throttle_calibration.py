"""The throttle's reference pass measures a device's own compute: a model whose BatchNorm spans the devices
(--batchnorm sync) is calibrated without its all-reduces, one device at a time, as the others wait."""
from types import SimpleNamespace

import torch
from torch import nn

from edgetrain.cluster.launch import run_group
from edgetrain.cluster.throttle import Throttle
from edgetrain.models.batchnorm import CrossDeviceBatchNorm2d, convert_batchnorm


def calibrate_with_cross_device_batchnorm(rank: int, world: int) -> float:
    from edgetrain.train.loop import calibrate_throttle

    torch.manual_seed(0)
    model = convert_batchnorm(nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.Flatten(), nn.Linear(144, 2)))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    at = SimpleNamespace(local_rank=rank, local_world=world, world=world, returning=False)
    throttle = Throttle(0.5)
    calibrate_throttle(throttle, model, torch.randn(4, 3, 8, 8), at)
    assert isinstance(model[1], CrossDeviceBatchNorm2d)  # the model trained is untouched
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    return throttle.reference_cpu


def test_batchnorm_sync_devices_calibrate_in_turn_without_a_collective():
    # before: device 0's reference pass all-reduced its BatchNorm statistics while device 1 waited at the turn's
    # barrier, and both hung until the collective timeout
    costs = run_group(calibrate_with_cross_device_batchnorm, 2, timeout_s=15, deadline_s=60,
                      deadline_fix="the reference pass waited for a collective")
    assert all(c > 0 for c in costs)
