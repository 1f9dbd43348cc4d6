"""In-memory images and the split a run trains on: ``TensorImages`` and ``DataSplit``.

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
