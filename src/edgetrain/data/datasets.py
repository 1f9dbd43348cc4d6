"""The datasets edgetrain trains on, as in-memory tensors (``TensorImages`` in a ``DataSplit``: images.py).

Built in (digits, CIFAR-10, synthetic), the user's files (``formats.py``) and registered factories.
"""
from __future__ import annotations

from typing import Any, Callable, Optional

import numpy as np
import torch

from edgetrain.data.formats import arrays_split, image_folder, npz_arrays
from edgetrain.data.images import DataSplit, TensorImages, random_crop_flip  # noqa: F401  (their old home)
from edgetrain.errors import EdgetrainError


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
    from edgetrain.data.cifar import MEAN, STD, load_cifar10

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


BUILTIN = ("digits", "cifar10", "synthetic", "imagefolder", "npz")
DatasetFactory = Callable[[Optional[str], int], Any]
DATASETS: dict[str, DatasetFactory] = {}  # registered with register_dataset


def register_dataset(name: str, factory: DatasetFactory) -> None:
    """Make ``name`` usable as ``dataset:``. ``factory(data_dir, seed)`` returns a ``DataSplit`` or the arrays
    ``(x_train, y_train, x_test, y_test)``, images (N, C, H, W) uint8 or float, labels 0..K-1. The factory
    travels to device processes by pickle, so define it at module level (not a lambda)."""
    if name in BUILTIN:
        raise EdgetrainError(f"dataset name '{name}' is built in; register yours under another name")
    DATASETS[name] = factory


def user_datasets() -> dict[str, DatasetFactory]:
    """Datasets registered in this process, to re-register in the device processes."""
    return dict(DATASETS)


def check_dataset(name: str) -> None:
    if name not in BUILTIN and name not in DATASETS:
        known = ", ".join([*BUILTIN, *sorted(DATASETS)])
        raise EdgetrainError(f"unknown dataset '{name}'; known datasets: {known} (register your own with "
                             "edgetrain.register_dataset)")


def build_data(cfg) -> DataSplit:
    """The dataset a ``TrainConfig`` names."""
    check_dataset(cfg.dataset)
    if cfg.dataset == "digits":
        return digits(cfg.seed)
    if cfg.dataset == "cifar10":
        return cifar10(cfg.data_dir, augment=cfg.augment, seed=cfg.seed)
    if cfg.dataset == "synthetic":
        return synthetic(cfg.synthetic_samples, cfg.image_size, seed=cfg.seed)
    if cfg.dataset == "imagefolder":
        return image_folder(cfg.data_dir, cfg.seed)
    if cfg.dataset == "npz":
        return npz_arrays(cfg.data_dir, cfg.seed)
    made = DATASETS[cfg.dataset](cfg.data_dir, cfg.seed)
    if isinstance(made, DataSplit):
        return made
    if not (isinstance(made, tuple) and len(made) == 4):
        raise EdgetrainError(f"dataset factory of '{cfg.dataset}' returned a {type(made).__name__}; return a "
                             "DataSplit or (x_train, y_train, x_test, y_test)")
    return arrays_split(*made, name=cfg.dataset)
