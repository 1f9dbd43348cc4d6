"""From a ``TrainConfig`` (the options of ``edgetrain train``) to the planner's inputs.

The planner reads the same configuration as training: the model and the data
give the input shape, ``devices`` x ``profile`` or ``cluster`` the devices
(``cluster.profiles.plan_devices``), ``batch_size`` / ``local_batch`` the
local batches (``split_batch``), ``link`` / ``sync`` / ``compress`` the
communication. Scaling to ``n`` devices repeats the cluster's devices in
order with their local batches (weak scaling: every device keeps its batch).

CIFAR-10 without ``data_dir`` is planned from its published size (50,000
training and 10,000 test images of 3x32x32 bytes, an int64 label each: the
tensors ``data.cifar`` loads), so planning needs no download; with
``data_dir`` the loaded tensors are measured as for the other data sets.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from edgetrain.cluster.profiles import DeviceSpec, plan_devices, split_batch
from edgetrain.config import TrainConfig, resolve
from edgetrain.data import build_data
from edgetrain.plan.costs import ModelCosts, count_costs, data_footprint, run_task_of
from edgetrain.plan.model import DEFAULT_EFFICIENCY, Prediction, PredictOptions, predict
from edgetrain.plan.exchanges import TrafficOptions, traffic
from edgetrain.spec import RunSpec


@dataclass
class PlanInputs:
    cfg: TrainConfig
    spec: RunSpec        # cfg's options, parsed once
    costs: ModelCosts
    devices: list[DeviceSpec]
    batches: list[int]


def plan_inputs(cfg: TrainConfig, costs: ModelCosts | None = None) -> PlanInputs:
    """Devices, local batches and counted model costs for ``cfg`` (validated: bad input is an ``EdgetrainError``)."""
    spec = resolve(cfg)
    devices = plan_devices(cfg)
    batches = split_batch(cfg, devices, spec.local_batch)
    if costs is None:
        shape, classes, dataset_bytes = cifar10_footprint() if cfg.dataset == "cifar10" and not cfg.data_dir \
            else data_footprint(cfg, spec.task)
        costs = count_costs(cfg.model, shape, classes, dataset_bytes=dataset_bytes, task=run_task_of(spec.task))
    return PlanInputs(cfg, spec, costs, devices, batches)


CIFAR10_TRAIN_IMAGES = 50_000
CIFAR10_IMAGES = CIFAR10_TRAIN_IMAGES + 10_000  # training + test images of the official release


def cifar10_footprint() -> tuple[tuple[int, int, int], int, int]:
    """(input shape, classes, bytes in memory) of CIFAR-10 as ``data.cifar`` loads it: uint8 images, int64 labels."""
    shape = (3, 32, 32)
    return shape, 10, CIFAR10_IMAGES * (shape[0] * shape[1] * shape[2] + 8)


def train_samples(cfg: TrainConfig) -> int:
    """Images in ``cfg``'s training set: counted without loading where the set's size is known."""
    if cfg.dataset == "synthetic":
        return cfg.synthetic_samples
    if cfg.dataset == "cifar10" and not cfg.data_dir:
        return CIFAR10_TRAIN_IMAGES
    return len(build_data(cfg).train)


def scaled(inputs: PlanInputs, n: int) -> tuple[list[DeviceSpec], list[int]]:
    """``n`` devices: the cluster's devices repeated in order, each with its local batch."""
    base, batches = inputs.devices, inputs.batches
    devices = [dataclasses.replace(base[i % len(base)], rank=i) for i in range(n)]
    return devices, [batches[i % len(batches)] for i in range(n)]


def predict_inputs(inputs: PlanInputs, n: int | None = None, efficiency: float = DEFAULT_EFFICIENCY,
                   overlap: float = 0.0, runtime_mb: float | None = None) -> Prediction:
    """The analytic prediction for the configured cluster, or for it scaled to ``n`` devices."""
    devices, batches = (inputs.devices, inputs.batches) if n is None else scaled(inputs, n)
    cfg, spec = inputs.cfg, inputs.spec
    # a round of fedavg:E is E passes over the training set: only then is its size needed (loading it)
    options = TrafficOptions(steps_per_epoch=train_samples(cfg) // cfg.batch_size if spec.sync.local_epochs else None,
                             server_opt=spec.server_opt, participation=spec.participation)
    return predict(inputs.costs, devices, batches, traffic(inputs.costs, len(devices), spec.sync, spec.compress,
                                                           options),
                   PredictOptions(efficiency=efficiency, overlap=overlap, optimizer=cfg.optimizer,
                                  momentum=cfg.momentum, runtime_mb=runtime_mb))
