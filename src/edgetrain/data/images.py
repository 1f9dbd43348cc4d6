"""In-memory samples and the split a run trains on: ``TensorImages``, ``TensorSamples`` and ``DataSplit``.

Images are normalised float tensors (C, H, W). Augmentation is per sample and
keyed by (seed, epoch, index), not by a process's random state, so a sample
is augmented the same way whichever device, loader worker or process count
handles it: that is what makes N-device runs reproduce 1-device runs. The
datasets themselves are built in ``datasets.py`` (built in and registered) and
``formats.py`` (the user's files), which both import these.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F
from torch.utils.data import Dataset


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
        return normalise(self.images[index], self.scale, self.mean, self.std, self.augment,
                         (self.seed, epoch, index)), self.labels[index]


def normalise(x: torch.Tensor, scale: float, mean: torch.Tensor, std: torch.Tensor, augment: bool,
              key: tuple[int, int, int]) -> torch.Tensor:
    """An image's ``(x / scale - mean) / std`` in float32, with the CIFAR recipe keyed by ``key`` (seed, epoch,
    index) where ``augment``. One float copy of ``x`` (which may be a view of the data) is made and the rest is
    done in place on it: the same values, operation by operation, as the out-of-place form, which allocated
    (and page-faulted) a new image for each of its four operations (docs/benchmarks/storage.md)."""
    y = x.to(torch.float32, copy=True)
    y.div_(scale)
    if augment:
        y = random_crop_flip(y, np.random.default_rng(key)) - mean  # the crop is a view of the padded copy
        return y.div_(std)
    return y.sub_(mean).div_(std)


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
