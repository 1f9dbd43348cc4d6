"""A device's own training data: the ``data`` path of its entry in the cluster file.

Design: docs/design/data.md ("Each device's data").
"""
from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch.utils.data import Dataset, Sampler

from edgetrain.data.datasets import DataSplit, TensorImages, build_data
from edgetrain.data.formats import image_folder_arrays, npz_file_arrays
from edgetrain.data.partition import PartitionReport, PartitionSampler, build_sampler
from edgetrain.errors import EdgetrainError
from edgetrain.kinds import strategy_kind
from edgetrain.spec import PartitionSpec, RunSpec

if TYPE_CHECKING:
    from edgetrain.cluster.profiles import DeviceSpec


def check_device_data(cfg, spec: RunSpec, devices: list[DeviceSpec], local_batches: list[int],
                      rank: int | None = None) -> None:
    """Before any device starts: the cluster file's ``data`` paths fit the run, and the files of every device
    (``rank`` None: emulated devices, all on this host) or of device ``rank`` (under torchrun) read."""
    given = [d for d in devices if d.data is not None]
    if not given:
        if spec.sync.kind.needs_partition and not spec.partition.local:
            raise EdgetrainError(f"--sync {spec.sync.text} trains each device on its own data, which needs a "
                                 "partition or data per device; add --partition iid, dirichlet:ALPHA or shards:K, "
                                 "or give each device 'data' in the cluster file")
        return
    if len(given) < len(devices):
        missing = next(d for d in devices if d.data is None)
        raise EdgetrainError(f"the cluster file gives 'data' for some devices but not {missing.label}: give it "
                             "for every device or none")
    for refused, what in ((spec.partition.local, f"--partition {spec.partition.text} splits the shared dataset"),
                          (not strategy_kind(spec.strategy).shards_batch,
                           f"strategy {spec.strategy} gives every device the whole global batch"),
                          (spec.dedup is not None, "--dedup filters the shared dataset")):
        if refused:
            raise EdgetrainError(f"{what}, but the cluster file gives each device its own data; drop that option "
                                 "or the devices' 'data' keys")
    shared = build_data(cfg, spec.task)
    for device in devices if rank is None else [devices[rank]]:
        own_training_set(device.data, device.label, shared, local_batches[device.rank])


def own_training_set(path: str, label: str, shared: DataSplit, local_batch: int) -> TensorImages:
    """The training images of the file at ``path`` (``label``'s own data), normalised as the run's dataset is."""
    file = Path(path)
    if not file.exists():
        raise EdgetrainError(f"{label}: its data {path} does not exist; put the device's image folder or .npz "
                             "there or fix its 'data' in the cluster file")
    if file.is_dir():
        images, labels, _ = image_folder_arrays(file)
    elif file.suffix.lower() == ".npz":
        images, labels, _ = npz_file_arrays(file)
    else:
        raise EdgetrainError(f"{label}: its data {path} is neither a folder nor a .npz file; give an image folder "
                             "(one subfolder per class) or a .npz of x and y")
    want = "x".join(map(str, shared.input_shape))
    if tuple(images.shape[1:]) != tuple(shared.input_shape):
        raise EdgetrainError(f"{label}: images in {path} are {'x'.join(map(str, images.shape[1:]))} (CxHxW) but the "
                             f"run's dataset {shared.name} has {want}; give the device {want} images or pick a "
                             "--dataset of their shape")
    classes = int(labels.max()) + 1
    if classes > shared.num_classes or (file.is_dir() and classes != shared.num_classes):
        raise EdgetrainError(f"{label}: {path} has {classes} classes but the run's dataset {shared.name} has "
                             f"{shared.num_classes}; the devices and the run must agree on the classes")
    if len(labels) < local_batch:
        raise EdgetrainError(f"{label}: {path} holds {len(labels)} training images, fewer than its local batch of "
                             f"{local_batch}; give it more images or lower --batch-size")
    return TensorImages(torch.as_tensor(images), torch.as_tensor(labels), shared.train.mean.flatten().tolist(),
                        shared.train.std.flatten().tolist(), scale=255.0 if images.dtype == np.uint8 else 1.0)


def class_labels(dataset: Dataset):
    """A training set's class labels for the sampler's partitions; a set without them (regression values, a
    task's own targets) as one class, so that it is split by counts only (``--partition iid``)."""
    labels = getattr(dataset, "labels", None)
    if isinstance(labels, torch.Tensor) and labels.dim() == 1 and not torch.is_floating_point(labels):
        return labels
    return np.zeros(len(dataset), dtype=np.int64)


def build_training_data(data: DataSplit, device: DeviceSpec, partition: PartitionSpec, local_batches: list[int],
                        rank: int, seed: int) -> tuple[Dataset, Sampler, PartitionReport | None]:
    """This device's training set and the loop's sampler over it: its own file where the cluster file gives one,
    else the run's dataset through ``build_sampler`` (its share of every global batch, or its partition)."""
    if device.data is None:
        return (data.train, *build_sampler(class_labels(data.train), partition, local_batches, rank, seed))
    own = own_training_set(device.data, device.label, data, local_batches[rank])
    print(f"{device.label} trains on its own data: {len(own)} images from {device.data}", flush=True)
    steps = len(data.train) // sum(local_batches)  # the same on every device: they step in lockstep
    return own, PartitionSampler(np.arange(len(own)), local_batches[rank], steps, rank, seed), None
