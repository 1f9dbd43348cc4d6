"""What one training sample costs a model, counted on the real model at the real input shape.

Nothing here is estimated from layer formulas: every number comes from
running the model once.

* **FLOPs per sample** (forward + backward): the trainer's own counter,
  ``tasks.flops.count_training_flops`` (``FlopCounterMode``) around a forward, the cross-entropy loss and ``backward()`` at batch 2, divided by 2.
  PyTorch counts matrix products and convolutions (2 FLOPs per multiply-add,
  backward convolutions only for the gradients autograd really computes);
  element-wise work (BatchNorm, ReLU, the optimizer step) is not counted.
  That uncounted work is one reason a device reaches only a fraction of its
  GEMM rate, which ``edgetrain.plan.model`` calls the efficiency.
* **Activation bytes per sample**: the tensors autograd saves for backward
  during one forward (with the loss) at batch 2, measured by the one
  activation meter ``cluster.memory.SavedTensorMeter`` (each storage once),
  parameters and buffers excluded (they are counted as weights), divided by 2.
* **Parameter bytes** and the **DDP gradient buckets**, which set how many
  all-reduces a synchronous step makes: PyTorch's own bucket assignment
  (``torch.distributed._compute_bucket_assignment_by_size``, as DDP calls it)
  over the parameters in reverse order, with edgetrain's 25 MiB bucket cap.
* **Dataset bytes**: edgetrain holds the whole dataset in memory on every
  device; counted from the tensors the data module builds (synthetic images
  from their shape, without building them).

Nothing is cached on disk; ``count_costs`` takes about a second for ResNet-18.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist
from torch import nn

from edgetrain.cluster.memory import SavedTensorMeter
from edgetrain.data import build_data
from edgetrain.data.datasets import input_channels
from edgetrain.errors import EdgetrainError
from edgetrain.models import build_model
from edgetrain.tasks import build_task
from edgetrain.tasks.flops import count_training_flops
from edgetrain.tasks.base import Task
from edgetrain.tasks.classification import ClassificationTask

DDP_BUCKET_CAP_MB = 25.0  # edgetrain.comm.sync.Synchronous passes this to DDP


@dataclass(frozen=True)
class ModelCosts:
    """Counted costs of one model at one input shape. Byte counts are exact; FLOPs as PyTorch counts them."""

    model: str
    input_shape: tuple[int, ...]          # one sample, (C, H, W)
    num_classes: int
    params: int                           # trainable parameters
    param_bytes: int
    buffer_bytes: int                     # BatchNorm running statistics and the like
    train_flops_per_sample: float         # forward + backward
    forward_flops_per_sample: float
    activation_bytes_per_sample: float    # saved for backward
    param_shapes: tuple[tuple[int, ...], ...]   # trainable parameters, definition order
    buckets: tuple[tuple[int, ...], ...]        # DDP buckets: indices into param_shapes
    dataset_bytes: int = 0

    @property
    def bucket_numels(self) -> list[int]:
        return [sum(_numel(self.param_shapes[i]) for i in b) for b in self.buckets]

    def to_dict(self) -> dict:
        d = asdict(self)
        d.pop("param_shapes")
        d["buckets"] = self.bucket_numels
        return d


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def count_flops(model: nn.Module, input_shape: tuple[int, ...], num_classes: int, batch: int = 2,
                task: Task | None = None) -> tuple[float, float]:
    """(train, forward) FLOPs per sample: ``tasks.flops.count_training_flops``, the trainer's own counter."""
    counted = count_training_flops(model, input_shape, num_classes, batch, task=task)
    return counted["total_flops"], counted["forward_flops"]


def count_activation_bytes(model: nn.Module, input_shape: tuple[int, ...], num_classes: int, batch: int = 2,
                           task: Task | None = None) -> float:
    """Bytes autograd saves for backward per sample: distinct storages, parameters and buffers excluded; the
    loss is ``task``'s (default: a classifier's, on random labels; else on the task's ``example_target``)."""
    x, y = _batch(input_shape, num_classes, batch)
    task = task or ClassificationTask()
    model.train()
    with SavedTensorMeter([*model.parameters(), *model.buffers()]) as meter:
        out = model(x)
        loss = task.loss(out, task.example_target(out)) / batch
    del loss
    return meter.bytes / batch


def ddp_buckets(model: nn.Module, cap_mb: float = DDP_BUCKET_CAP_MB) -> tuple[tuple[int, ...], ...]:
    """DDP's gradient buckets (parameter indices in definition order), from PyTorch's own assignment."""
    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        return ()
    reversed_params = list(reversed(params))
    indices, _ = dist._compute_bucket_assignment_by_size(reversed_params, [int(cap_mb * 2**20)])
    last = len(params) - 1
    return tuple(tuple(sorted(last - i for i in bucket)) for bucket in indices)


def count_costs(model: nn.Module | str, input_shape: tuple[int, ...], num_classes: int = 10,
                dataset_bytes: int = 0, name: str | None = None, task: Task | None = None) -> ModelCosts:
    """Count a model's training costs at ``input_shape`` (one sample, without the batch dimension)."""
    if isinstance(model, str):
        name = name or model
        model = build_model(model, input_channels(input_shape), num_classes)
    name = name or type(model).__name__
    state = {k: v.clone() for k, v in model.state_dict().items()}  # counting must not change the model
    try:
        train_flops, forward_flops = count_flops(model, input_shape, num_classes, task=task)
        activations = count_activation_bytes(model, input_shape, num_classes, task=task)
    except RuntimeError as e:
        raise EdgetrainError(f"model {name} does not run on inputs of shape {tuple(input_shape)} "
                             f"({str(e).splitlines()[0]}); check dataset / image_size") from None
    finally:
        model.load_state_dict(state)
    trainable = [p for p in model.parameters() if p.requires_grad]
    return ModelCosts(
        model=name, input_shape=tuple(input_shape), num_classes=num_classes,
        params=sum(p.numel() for p in trainable),
        param_bytes=sum(p.numel() * p.element_size() for p in trainable),
        buffer_bytes=sum(b.numel() * b.element_size() for b in model.buffers()),
        train_flops_per_sample=train_flops, forward_flops_per_sample=forward_flops,
        activation_bytes_per_sample=activations,
        param_shapes=tuple(tuple(p.shape) for p in trainable),
        buckets=ddp_buckets(model), dataset_bytes=dataset_bytes,
    )


def _batch(input_shape: tuple[int, ...], num_classes: int, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return torch.randn(batch, *input_shape, generator=g), torch.randint(0, num_classes, (batch,), generator=g)


def data_footprint(cfg, task: str | None = None) -> tuple[tuple[int, int, int], int, int]:
    """(input shape, classes, bytes the dataset holds in memory) for a ``TrainConfig`` (``task``: its resolved one).

    Synthetic images (float32, ``synthetic_samples`` train + a quarter test, int64
    labels; see ``edgetrain.data.datasets.synthetic``) are sized without being
    built; digits and CIFAR-10 are loaded and their tensors measured.
    """
    if cfg.dataset == "synthetic":
        n = cfg.synthetic_samples + max(cfg.synthetic_samples // 4, 1)
        shape = (3, cfg.image_size, cfg.image_size)
        return shape, 10, n * (_numel(shape) * 4 + 8)
    data = build_data(cfg, task)
    return data.input_shape, data.num_classes, held_bytes(data.train) + held_bytes(data.test)


def held_bytes(dataset) -> int:
    """Bytes of the tensors a dataset holds (inputs and targets; not its normalisation statistics)."""
    return sum(v.numel() * v.element_size() for k, v in vars(dataset).items()
               if isinstance(v, torch.Tensor) and k not in ("mean", "std"))


def run_task_of(task: str, data=None) -> Task:
    """The resolved task of a run (``RunSpec.task``), for the cost counts."""
    return build_task(task, data)
