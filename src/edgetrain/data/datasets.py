"""The datasets edgetrain trains on, as in-memory tensors (``TensorImages`` / ``TensorSamples`` in a
``DataSplit``: images.py): built in, the user's files (``formats.py``) and registered factories.
"""
from __future__ import annotations

from typing import Any, Callable, Optional

import numpy as np
import torch

from edgetrain.data import detection
from edgetrain.data.cifar import MEAN, STD, load_cifar10
from edgetrain.data.formats import arrays_split, csv_values, image_folder, npz_arrays, npz_values
# their old home: imported from here by the package, the devices' data and tests
from edgetrain.data.images import (DataSplit, TensorImages, TensorSamples, feature_statistics,  # noqa: F401
                                   input_channels, random_crop_flip, split_indices, values_split)
from edgetrain.data.shards import shards_split
from edgetrain.data.storage import image_folder_on_storage, yolo_on_storage
from edgetrain.errors import EdgetrainError
from edgetrain.kinds import DEFAULT_TASK, TASK_KINDS, target_kind, task_targets

# Imported inside functions: sklearn (a second of CPU in every device process that imported it; the launcher loads its
# datasets once).


def digits(seed: int = 0) -> DataSplit:
    """scikit-learn's 8x8 handwritten digits (1797 images), 80/20 stratified split."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    bunch = load_digits()
    images = torch.tensor(bunch.images, dtype=torch.float32).unsqueeze(1)  # values 0..16
    labels = torch.tensor(bunch.target, dtype=torch.int64)
    tr, te = train_test_split(np.arange(len(labels)), test_size=0.2, stratify=bunch.target, random_state=0)
    mean, std = (images / 16).mean().item(), (images / 16).std().item()
    make = lambda idx: TensorImages(images[idx], labels[idx], (mean,), (std,), scale=16.0)  # noqa: E731
    return DataSplit(make(tr), make(te), 10, "digits")


def cifar10(root: str, augment: bool = True, seed: int = 0) -> DataSplit:
    (xtr, ytr), (xte, yte) = load_cifar10(root)
    return DataSplit(TensorImages(xtr, ytr, MEAN, STD, augment=augment, seed=seed),
                     TensorImages(xte, yte, MEAN, STD), 10, "cifar10")


def synthetic(samples: int = 2048, image_size: int = 32, channels: int = 3, classes: int = 10,
              seed: int = 0) -> DataSplit:
    """Generated images for speed runs: a fixed random pattern per class plus noise, so it is learnable."""
    g = torch.Generator().manual_seed(seed)
    templates = torch.rand(classes, channels, image_size, image_size, generator=g)

    def make(n: int) -> TensorImages:
        labels = torch.randint(0, classes, (n,), generator=g)
        images = (templates[labels] * 0.6 + torch.rand(n, channels, image_size, image_size, generator=g) * 0.4)
        return TensorImages(images, labels, (0.5,) * channels, (0.25,) * channels, scale=1.0)

    return DataSplit(make(samples), make(max(samples // 4, 1)), classes, "synthetic")


def diabetes(seed: int = 0) -> DataSplit:
    """scikit-learn's diabetes regression set (442 patients, 10 baseline features, one real target: disease
    progression a year later), a seeded 80/20 split; ships with scikit-learn, no download."""
    from sklearn.datasets import load_diabetes

    bunch = load_diabetes(scaled=False)
    return values_split(bunch.data, bunch.target, *split_indices(len(bunch.target), seed), name="diabetes")


LOADED_ONCE = ("digits", "diabetes")
BUILTIN = ("digits", "cifar10", "synthetic", "imagefolder", "npz", "csv", "diabetes", "shapes", "yolo",
           "coco", "shards")
DatasetFactory = Callable[[Optional[str], int], Any]
DATASETS: dict[str, DatasetFactory] = {}  # registered with register_dataset


def register_dataset(name: str, factory: DatasetFactory) -> None:
    """Make ``name`` usable as ``dataset:``. ``factory(data_dir, seed)`` returns a ``DataSplit`` or the arrays
    ``(x_train, y_train, x_test, y_test)``: images (N, C, H, W) uint8 or float and labels 0..K-1 for a
    classifier, inputs (N, ...) and real targets (N,) or (N, K) for regression (``--task regression``). Your
    own ``DataSplit`` may hold any target structure your task's ``collate`` understands. The factory travels to
    device processes by pickle, so define it at module level (not a lambda)."""
    if name in BUILTIN:
        raise EdgetrainError(f"dataset name '{name}' is built in; register yours under another name")
    DATASETS[name] = factory


def user_datasets() -> dict[str, DatasetFactory]:
    """Datasets registered in this process, to re-register in the device processes."""
    return dict(DATASETS)


def check_dataset(name: str) -> None:
    if name not in BUILTIN and name not in DATASETS:
        # the default task's datasets and yours, then each other task's (edgetrain.kinds)
        first = [d for d in TASK_KINDS[DEFAULT_TASK].implied_by if d in BUILTIN]
        others = [f"{', '.join(d for d in k.implied_by if d in BUILTIN)} ({k.name})" for k in TASK_KINDS.values()
                  if k.name != DEFAULT_TASK and any(d in BUILTIN for d in k.implied_by)]
        implied = {d for k in TASK_KINDS.values() for d in k.implied_by}
        anywhere = [f"{d} (any task)" for d in BUILTIN if d not in implied]
        known = ", ".join([*first, *sorted(DATASETS)])
        raise EdgetrainError(f"unknown dataset '{name}'; known datasets: {known} (register your own with "
                             f"edgetrain.register_dataset); for other tasks: {', '.join([*others, *anywhere])}")


def build_data(cfg, task: str | None = None) -> DataSplit:
    """The dataset a ``TrainConfig`` names, for ``task``: the run's, resolved (``RunSpec.task``; left out, the
    one ``cfg`` names or implies)."""
    check_dataset(cfg.dataset)
    targets = task_targets(task) if task else target_kind(cfg)
    values = targets == "values"  # real-valued targets (regression), else class labels
    if cfg.dataset == "digits":
        return digits(cfg.seed)
    if cfg.dataset == "cifar10":
        return cifar10(cfg.data_dir, augment=cfg.augment, seed=cfg.seed)
    if cfg.dataset == "synthetic":
        return synthetic(cfg.synthetic_samples, cfg.image_size, seed=cfg.seed)
    if cfg.dataset == "shards":  # on storage (data/shards.py)
        return shards_split(cfg.data_dir, cfg.seed, cfg.augment, detection=targets == "own")
    if cfg.dataset == "imagefolder":
        if cfg.from_storage:
            return image_folder_on_storage(cfg.data_dir, cfg.seed, cfg.augment)
        return image_folder(cfg.data_dir, cfg.seed)
    if cfg.dataset == "diabetes":
        return diabetes(cfg.seed)
    if cfg.dataset == "npz":
        return npz_values(cfg.data_dir, cfg.seed) if values else npz_arrays(cfg.data_dir, cfg.seed)
    if cfg.dataset == "csv":
        return csv_values(cfg.data_dir, cfg.seed, labels=not values)
    if cfg.dataset in ("shapes", "yolo", "coco"):
        if cfg.dataset == "shapes":
            return detection.shapes(cfg.synthetic_samples, cfg.image_size, cfg.seed)
        if cfg.dataset == "yolo" and cfg.from_storage:
            return yolo_on_storage(cfg.data_dir, cfg.image_size, cfg.seed, cfg.augment)
        reader = detection.yolo_folder if cfg.dataset == "yolo" else detection.coco_folder
        return reader(cfg.data_dir, cfg.image_size, cfg.seed)
    made = DATASETS[cfg.dataset](cfg.data_dir, cfg.seed)
    if isinstance(made, DataSplit):
        return made
    if not (isinstance(made, tuple) and len(made) == 4):
        raise EdgetrainError(f"dataset factory of '{cfg.dataset}' returned a {type(made).__name__}; return a "
                             "DataSplit or (x_train, y_train, x_test, y_test)")
    if values:
        return values_split(made[0], made[1], name=cfg.dataset, x_test=made[2], y_test=made[3])
    return arrays_split(*made, name=cfg.dataset)
