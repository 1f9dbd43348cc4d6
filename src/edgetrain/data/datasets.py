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


class TensorSamples(Dataset):
    """Samples of any shape (N, ...) float and their targets (N,) or (N, K) (regression: real values),
    each feature standardised on access with the training set's statistics (``feature_statistics``).

    Indexed like ``TensorImages`` (``(index, epoch)`` pairs or plain ints); no augmentation."""

    def __init__(self, x: torch.Tensor, targets: torch.Tensor, mean: torch.Tensor, std: torch.Tensor):
        self.x = x if torch.is_floating_point(x) else x.float()  # float64 stays float64 (exactness tests)
        self.labels = targets
        self.mean, self.std = mean.to(self.x.dtype), std.to(self.x.dtype)

    def __len__(self) -> int:
        return len(self.labels)

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.x.shape[1:])

    def __getitem__(self, key):
        index = key[0] if isinstance(key, tuple) else key
        return (self.x[index] - self.mean) / self.std, self.labels[index]


def feature_statistics(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean and standard deviation of a training set's inputs per feature: per channel (the last dim) of a
    series (N, T, C), per channel (dim 1) of images (N, C, H, W), per feature of vectors (N, F); shaped to
    broadcast against one sample."""
    x = x.double()
    if x.dim() == 4:
        dims, shape = (0, 2, 3), (x.shape[1], 1, 1)
    else:
        dims, shape = tuple(range(x.dim() - 1)), (x.shape[-1],)
    mean, std = x.mean(dims), x.std(dims) if len(x) > 1 else torch.ones(shape)
    return mean.reshape(shape), std.clamp_min(1e-6).reshape(shape)


@dataclass
class DataSplit:
    train: TensorImages | TensorSamples
    test: TensorImages | TensorSamples
    num_classes: int    # the model's output width: classes, or a regression's K targets
    name: str
    details: dict = field(default_factory=dict)  # what was done to it, for the summary (e.g. dedup)

    @property
    def input_shape(self) -> tuple[int, ...]:
        return self.train.shape

    @property
    def in_channels(self) -> int:
        """What a model factory's ``in_channels`` is for these inputs: an image's channels (C, H, W), a
        series' channels (T, C), a vector's features (F,)."""
        return input_channels(self.input_shape)


def input_channels(shape) -> int:
    """A model factory's ``in_channels`` for inputs of ``shape`` (one sample's): an image's channels (C, H, W), a
    series' channels (T, C), a vector's features (F,)."""
    return shape[0] if len(shape) == 3 else shape[-1]


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


def diabetes(seed: int = 0) -> DataSplit:
    """scikit-learn's diabetes regression set (442 patients, 10 baseline features, one real target: disease
    progression a year later), a seeded 80/20 split; ships with scikit-learn, no download."""
    from sklearn.datasets import load_diabetes

    bunch = load_diabetes(scaled=False)
    return values_split(bunch.data, bunch.target, *split_indices(len(bunch.target), seed), name="diabetes")


def split_indices(n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """A seeded 80/20 split of ``n`` samples: (train positions, test positions)."""
    order = np.random.default_rng(seed).permutation(n)
    cut = int(round(n * 0.8))
    return np.sort(order[:cut]), np.sort(order[cut:])


def values_split(x, y, train: np.ndarray | None = None, test: np.ndarray | None = None, name: str = "",
                 x_test=None, y_test=None) -> DataSplit:
    """A regression ``DataSplit``: inputs (N, ...) and real targets (N,) or (N, K), split by positions or given
    as a test set; inputs standardised with the training set's statistics. ``num_classes`` is K (the model's
    output width); ``details`` keep the training targets' mean and standard deviation per target, which
    ``RegressionTask.for_data`` learns in (a model predicts standardised targets)."""
    x, y = torch.as_tensor(np.asarray(x, dtype=np.float64)), torch.as_tensor(np.asarray(y, dtype=np.float64))
    if x_test is None:
        x, y, x_test, y_test = x[train], y[train], x[test], y[test]
    else:
        x_test, y_test = (torch.as_tensor(np.asarray(a, dtype=np.float64)) for a in (x_test, y_test))
    mean, std = feature_statistics(x)
    targets = y.reshape(len(y), -1)
    y_mean = targets.mean(0)
    y_std = targets.std(0).clamp_min(1e-12) if len(targets) > 1 else torch.ones(targets.shape[1])
    details = {"target_mean": y_mean.tolist(), "target_std": y_std.tolist()}
    return DataSplit(TensorSamples(x.float(), y.float(), mean, std), TensorSamples(x_test.float(), y_test.float(),
                     mean, std), targets.shape[1], name, details)


# Loaders that import scikit-learn (a second of CPU in every device process): the launcher loads them once and
# hands the data to its emulated devices.
LOADED_ONCE = ("digits", "diabetes")
BUILTIN = ("digits", "cifar10", "synthetic", "imagefolder", "npz", "csv", "diabetes", "shapes", "yolo",
           "coco")
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
        from edgetrain.task_kinds import DEFAULT_TASK, TASK_KINDS

        # the default task's datasets and yours, then each other task's (edgetrain.task_kinds)
        first = [d for d in TASK_KINDS[DEFAULT_TASK].implied_by if d in BUILTIN]
        others = [f"{', '.join(d for d in k.implied_by if d in BUILTIN)} ({k.name})" for k in TASK_KINDS.values()
                  if k.name != DEFAULT_TASK and any(d in BUILTIN for d in k.implied_by)]
        implied = {d for k in TASK_KINDS.values() for d in k.implied_by}
        anywhere = [f"{d} (any task)" for d in BUILTIN if d not in implied]
        known = ", ".join([*first, *sorted(DATASETS)])
        raise EdgetrainError(f"unknown dataset '{name}'; known datasets: {known} (register your own with "
                             f"edgetrain.register_dataset); for other tasks: {', '.join([*others, *anywhere])}")


def build_data(cfg) -> DataSplit:
    """The dataset a ``TrainConfig`` names."""
    from edgetrain.data.formats import arrays_split, csv_values, image_folder, npz_arrays, npz_values
    from edgetrain.task_kinds import target_kind

    check_dataset(cfg.dataset)
    values = target_kind(cfg) == "values"  # real-valued targets (regression), else class labels
    if cfg.dataset == "digits":
        return digits(cfg.seed)
    if cfg.dataset == "cifar10":
        return cifar10(cfg.data_dir, augment=cfg.augment, seed=cfg.seed)
    if cfg.dataset == "synthetic":
        return synthetic(cfg.synthetic_samples, cfg.image_size, seed=cfg.seed)
    if cfg.dataset == "imagefolder":
        return image_folder(cfg.data_dir, cfg.seed)
    if cfg.dataset == "diabetes":
        return diabetes(cfg.seed)
    if cfg.dataset == "npz":
        return npz_values(cfg.data_dir, cfg.seed) if values else npz_arrays(cfg.data_dir, cfg.seed)
    if cfg.dataset == "csv":
        return csv_values(cfg.data_dir, cfg.seed, labels=not values)
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
    if values:
        return values_split(made[0], made[1], name=cfg.dataset, x_test=made[2], y_test=made[3])
    return arrays_split(*made, name=cfg.dataset)
