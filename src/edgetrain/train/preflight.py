"""What ``config.validate`` cannot see in the values, checked before a run starts.

The output directory can be written, the model and the dataset are
registered, the CIFAR-10 files are there, an image folder or ``.npz`` reads
(every file; on storage, every header), a tiling grid fits the feature maps of the data's own shape
(``tiling.strategy.plan_section`` on the model, built here once), a pipeline
can cut the model where ``--stages`` says (``pipelining.stages``), this torch has what the strategy needs (FSDP2 for fsdp and
pipeline: refused in one line on an older torch) and, for a task whose descriptor
asks it (or one passed from Python), fits the data and the model's output on
one batch (``Task.check_data``, ``Task.check``). ``train``
calls ``check_before_launch`` before it makes the run directory and before any
device starts, so bad input leaves nothing behind. It needs the models, the
data, the tiler and the strategies (so torch): it sits with the run it checks, above ``config``, which stays
free of them.
"""
from __future__ import annotations

import copy
from typing import Any

import torch

from edgetrain.config import TrainConfig, check_output_dir
from edgetrain.data import build_data
from edgetrain.data.cifar import check_cifar10_dir
from edgetrain.data.datasets import check_dataset
from edgetrain.errors import EdgetrainError
from edgetrain.models import build_model, check_model
from edgetrain.pipelining.stages import check_sequential, pipeline_layers, stage_bounds
from edgetrain.privacy.dp import batchnorm_refusal
from edgetrain.spec import DATASET_SHAPES, RunSpec, dataset_shape
from edgetrain.kinds import task_kind
from edgetrain.tasks import build_task
from edgetrain.tiling.strategy import plan_section
from edgetrain.train.checkpoint import check_resumable
from edgetrain.train.strategy import registered_strategy


def check_before_launch(cfg: TrainConfig, spec: RunSpec, model: Any = None, task: Any = None):
    """What ``validate`` cannot see in the values: checked before the run directory and the devices.

    ``spec`` is ``resolve(cfg)``, the options already parsed; ``model`` is the ``nn.Module`` given to
    ``train`` instead of ``cfg.model``, if any; ``task`` the ``Task`` given instead of ``cfg.task``, if any.
    Returns the dataset where the task's check built it (the launcher may hand it on), else None.
    """
    check_output_dir(cfg.output, "config key 'output'")
    if spec.checkpoint.resume_dir:
        check_resumable(spec.checkpoint.resume_dir)
    if model is None:
        check_model(cfg.model)
    registered_strategy(spec.strategy)  # a torch without what it needs: one line now, not from every device
    check_dataset(cfg.dataset)
    built = check_data(cfg, spec.task)
    name = spec.task  # resolved, its strategy checked (kinds.TaskKind's checks)
    kind = None if task is not None else task_kind(name)  # a task of an earlier run passed from Python: one line
    if kind is not None:
        if spec.partition.by_label and kind.targets != "labels":
            raise EdgetrainError(f"--partition {spec.partition.text} skews class labels, which task {kind.name} "
                                 f"does not have; use --partition iid")
    data = check_task(cfg, model, task, name) if kind is None or kind.check_batch else built
    if spec.dp is not None:
        check_private(cfg, model)
    if spec.tiling is None and spec.pipeline is None:
        return data
    if data is None and cfg.dataset not in DATASET_SHAPES:  # the user's data: its shape is its own
        data = build_data(cfg)
    if data is not None:  # the shape the data itself gives (a user's folder, a detection set's resolution)
        shape, channels, classes = tuple(data.input_shape), data.in_channels, data.num_classes
    else:  # a built-in set, whose shape is known without reading it (CIFAR-10 is read once, by the devices)
        (channels, height, width), classes = dataset_shape(cfg.dataset)
        if cfg.dataset == "synthetic":
            height = width = cfg.image_size
        shape = (channels, height, width)
    model = model if model is not None else build_model(cfg.model, channels, classes)
    if spec.tiling is not None:
        plan_section(model, spec.tiling, shape)
    if spec.pipeline is not None:
        check_sequential(model, torch.randn(2, *shape), f"model {cfg.model}")
        if not cfg.cluster and not spec.torchrun:  # else the devices check it, knowing their number
            stage_bounds(spec.pipeline, pipeline_layers(model), cfg.devices // spec.pipeline.replicas)
    return data


def check_private(cfg: TrainConfig, model: Any) -> None:
    """``--dp``: a model whose per-sample gradients Opacus can compute (no BatchNorm), built on the meta device."""
    name = cfg.model if model is None else type(model).__name__
    if model is None:
        with torch.device("meta"):
            model = build_model(cfg.model)
    refusal = batchnorm_refusal(model, name)
    if refusal:
        raise EdgetrainError(refusal)


def check_task(cfg: TrainConfig, model: Any, task: Any, name: str):
    """The task fits the data (``Task.check_data``: every target) and the model's output for two samples
    (``Task.check``), on copies, the model in eval mode; returns the data built for it."""
    data = build_data(cfg, name)
    task = task if task is not None else build_task(name, data)
    task.check_data(data)
    if len(data.train) == 0:
        raise EdgetrainError(f"dataset {cfg.dataset} has no training samples; give it some")
    model = copy.deepcopy(model) if model is not None else build_model(cfg.model, data.in_channels,
                                                                         data.num_classes)
    model.eval()
    x, y = task.collate([data.train[i] for i in range(min(2, len(data.train)))])
    with torch.no_grad():
        try:
            out = model(x)
        except RuntimeError as e:
            raise EdgetrainError(f"model {cfg.model} cannot take the {cfg.dataset} inputs of shape "
                                 f"{tuple(x.shape[1:])} ({str(e).splitlines()[0]}); choose a model for that "
                                 f"shape") from None
    task.check(out, y)
    return data


def check_data(cfg: TrainConfig, task: str | None = None):
    """The dataset's files are there and read (CIFAR-10's batches, an image folder, a ``.npz``); also used by
    ``edgetrain data``. Returns the data where it was built (the user's files), else None."""
    if cfg.dataset == "cifar10":
        if not cfg.data_dir:
            raise EdgetrainError("config key 'data_dir' is required with dataset cifar10; "
                                 "point it at cifar-10-batches-py")
        check_cifar10_dir(cfg.data_dir)
    if cfg.dataset in ("imagefolder", "npz", "shards"):
        if not cfg.data_dir:
            what = {"imagefolder": "the image folder", "npz": "the .npz file",
                    "shards": "the folder edgetrain data pack wrote"}[cfg.dataset]
            raise EdgetrainError(f"config key 'data_dir' is required with dataset {cfg.dataset}; point it at {what}")
        return build_data(cfg, task)  # reads every file (on storage: every header) here: a bad one is one line now
    return None
