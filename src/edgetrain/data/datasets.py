"""The datasets edgetrain trains on, as in-memory tensors.

Images are normalised float tensors (C, H, W). Augmentation is per sample and
keyed by (seed, epoch, index), not by a process's random state, so a sample
is augmented the same way whichever device, loader worker or process count
handles it: that is what makes N-device runs reproduce 1-device runs.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import numpy as np
import torch
import torch.nn.functional as F
from torch.utils.data import Dataset

from edgetrain.errors import EdgetrainError


class TensorImages(Dataset):
    """Images (N, C, H, W) uint8 or float and int64 labels, normalised on access.

    Indexed by ``(index, epoch)`` pairs from ``GlobalBatchSampler`` (or plain ints: epoch 0).
    """

    def __init__(self, images: torch.Tensor, labels: torch.Tensor, mean, std, augment: bool = False,
                 seed: int = 0, scale: float = 255.0):
        self.images, self.labels = images, labels
        self.mean = torch.tensor(mean, dtype=torch.float32).view(-1, 1, 1)
        self.std = torch.tensor(std, dtype=torch.float32).view(-1, 1, 1)
        self.augment, self.seed, self.scale = augment, seed, scale

    def __len__(self) -> int:
        return len(self.labels)

    @property
    def shape(self) -> tuple[int, int, int]:
        return tuple(self.images.shape[1:])  # type: ignore[return-value]

    def __getitem__(self, key):
        index, epoch = key if isinstance(key, tuple) else (key, 0)
        x = self.images[index].float() / self.scale  # not in place: index gives a view of the data
        if self.augment:
            x = random_crop_flip(x, np.random.default_rng((self.seed, epoch, index)))
        return (x - self.mean) / self.std, self.labels[index]


def random_crop_flip(x: torch.Tensor, rng: np.random.Generator, pad: int = 4) -> torch.Tensor:
    """The standard CIFAR augmentation: pad by 4, crop back at random, flip half the time."""
    _, h, w = x.shape
    top, left = rng.integers(0, 2 * pad + 1, size=2)
    x = F.pad(x, (pad, pad, pad, pad))[:, top:top + h, left:left + w]
    if rng.random() < 0.5:
        x = x.flip(-1)
    return x


@dataclass
class DataSplit:
    train: TensorImages
    test: TensorImages
    num_classes: int
    name: str
    details: dict = field(default_factory=dict)  # what was done to it, for the summary (e.g. dedup)

    @property
    def input_shape(self) -> tuple[int, int, int]:
        return self.train.shape


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


BUILTIN = ("digits", "cifar10", "synthetic", "imagefolder", "npz", "shapes", "yolo", "coco")
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
    from edgetrain.data.formats import arrays_split, image_folder, npz_arrays

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
    if cfg.dataset in ("shapes", "yolo", "coco"):
        from edgetrain.data import detection

        if cfg.dataset == "shapes":
            return detection.shapes(cfg.synthetic_samples, cfg.image_size, cfg.seed)
        reader = detection.yolo_folder if cfg.dataset == "yolo" else detection.coco_folder
        return reader(cfg.data_dir, cfg.image_size, cfg.seed)
    made = DATASETS[cfg.dataset](cfg.data_dir, cfg.seed)
    if isinstance(made, DataSplit):
        return made
    if not (isinstance(made, tuple) and len(made) == 4):
        raise EdgetrainError(f"dataset factory of '{cfg.dataset}' returned a {type(made).__name__}; return a "
                             "DataSplit or (x_train, y_train, x_test, y_test)")
    return arrays_split(*made, name=cfg.dataset)
