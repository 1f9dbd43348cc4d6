"""What ``config.validate`` cannot see in the values, checked before a run starts.

The output directory can be written, the model is registered, the CIFAR-10
files are there, a tiling grid fits the feature maps
(``tiling.strategy.plan_section`` on the model, built here once). ``train``
calls ``check_before_launch`` before it makes the run directory and before any
device starts, so bad input leaves nothing behind. It needs the models, the
data and the tiler (so torch): it sits above ``config``, which stays free of them.
"""
from __future__ import annotations

from typing import Any

from edgetrain.bench.workload import dataset_shape
from edgetrain.config import TrainConfig, check_output_dir
from edgetrain.data.cifar import check_cifar10_dir
from edgetrain.errors import EdgetrainError
from edgetrain.models import build_model, check_model
from edgetrain.spec import RunSpec
from edgetrain.tiling.strategy import plan_section


def check_before_launch(cfg: TrainConfig, spec: RunSpec, model: Any = None) -> None:
    """What ``validate`` cannot see in the values: checked before the run directory and the devices.

    ``spec`` is ``resolve(cfg)``, the options already parsed; ``model`` is the ``nn.Module`` given to
    ``train`` instead of ``cfg.model``, if any.
    """
    check_output_dir(cfg.output, "config key 'output'")
    if model is None:
        check_model(cfg.model)
    check_data(cfg)
    tiling = spec.tiling
    if tiling is not None:
        (channels, height, width), classes = dataset_shape(cfg.dataset)
        if cfg.dataset == "synthetic":
            height = width = cfg.image_size
        plan_section(model if model is not None else build_model(cfg.model, channels, classes), tiling,
                     (channels, height, width))


def check_data(cfg: TrainConfig) -> None:
    """The dataset's files are there (CIFAR-10's batches); also used by ``edgetrain data``."""
    if cfg.dataset == "cifar10":
        if not cfg.data_dir:
            raise EdgetrainError("config key 'data_dir' is required with dataset cifar10; "
                                 "point it at cifar-10-batches-py")
        check_cifar10_dir(cfg.data_dir)
