"""Near-duplicate images: a perceptual hash per image, pairs within a Hamming distance, the first by index kept.

Design: docs/design/data.md ("Near duplicates").
"""
from __future__ import annotations

import copy
import dataclasses
import math
import time
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

from edgetrain.errors import EdgetrainError
from edgetrain.spec import DEDUP_HASH_BITS, DedupSpec

# Imported inside functions: scipy.fft (0.36 s of every device's start, for runs that never dedup).

HASH_SIDE = math.isqrt(DEDUP_HASH_BITS)  # 12: the 12x12 lowest frequencies
RESIZED = 32          # side of the grey image the DCT runs on (pHash's 32x32)
HASH_CHUNK = 4096     # images hashed at once: bounds the float copies
BLOCK = 1024          # rows of one pairwise-distance product
LUMA = (0.299, 0.587, 0.114)


def perceptual_hashes(images) -> np.ndarray:
    """(N, 144) bool pHash bits of images (N, C, H, W) or (N, H, W), uint8 or float, 1 or 3 channels."""
    images = torch.as_tensor(np.asarray(images)) if not isinstance(images, torch.Tensor) else images
    if images.ndim == 3:
        images = images.unsqueeze(1)
    if images.ndim != 4 or images.shape[1] not in (1, 3) or len(images) == 0:
        raise EdgetrainError(f"dedup needs images (N, C, H, W) with 1 or 3 channels, got shape {tuple(images.shape)}")
    bits = [_hash_chunk(images[start:start + HASH_CHUNK]) for start in range(0, len(images), HASH_CHUNK)]
    return np.concatenate(bits)


def _hash_chunk(images: torch.Tensor) -> np.ndarray:
    grey = images.float()
    if grey.shape[1] == 3:
        grey = (grey * torch.tensor(LUMA).view(1, 3, 1, 1)).sum(1, keepdim=True)
    grey = F.interpolate(grey, size=(RESIZED, RESIZED), mode="bilinear", antialias=True, align_corners=False)
    import scipy.fft

    coefficients = scipy.fft.dctn(grey[:, 0].numpy(), type=2, axes=(1, 2), norm="ortho")
    low = coefficients[:, :HASH_SIDE, :HASH_SIDE].reshape(len(grey), -1)
    return low > np.median(low, axis=1, keepdims=True)


def duplicate_of(hashes: np.ndarray, threshold: int) -> np.ndarray:
    """For every image, the index of the earlier kept image it duplicates, or -1 if it is kept (docs/design/data.md)."""
    n, bits = hashes.shape
    signs = torch.from_numpy(hashes.astype(np.float32) * 2 - 1)
    original = np.full(n, -1, dtype=np.int64)
    kept = np.ones(n, dtype=bool)
    for start in range(0, n, BLOCK):
        stop = min(start + BLOCK, n)
        distance = (bits - signs[start:stop] @ signs[:stop].T) / 2  # rows: this block; columns: every earlier image
        near = (distance <= threshold).numpy()
        near[:, start:] &= np.tri(stop - start, stop - start, -1, dtype=bool)  # only earlier images in the block
        for row in np.flatnonzero(near.any(axis=1)):  # the images with an earlier near one: usually few
            earlier = np.flatnonzero(near[row] & kept[:stop])
            if len(earlier):
                original[start + row] = earlier[0]
                kept[start + row] = False
    return original


@dataclass(frozen=True)
class DedupReport:
    """What near-duplicate filtering found in one set of images, and how long it took (measured)."""

    samples: int
    removed: int
    bytes_total: int
    bytes_removed: int
    threshold: int
    hash_s: float
    group_s: float
    hash_bits: int = DEDUP_HASH_BITS
    duplicate_of: np.ndarray = field(default=None, repr=False, compare=False)  # per image, -1: kept

    @property
    def kept(self) -> np.ndarray:
        return np.flatnonzero(self.duplicate_of < 0)

    @property
    def seconds(self) -> float:
        return self.hash_s + self.group_s

    def to_dict(self) -> dict:
        """The counts and times (not the per-image arrays), for summary.json."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "duplicate_of"}

    def describe(self) -> str:
        share = self.removed / self.samples if self.samples else 0.0
        return (f"dedup: {self.removed:,} of {self.samples:,} images removed as near duplicates ({share:.1%}), "
                f"{self.bytes_removed / 1e6:,.2f} of {self.bytes_total / 1e6:,.2f} MB; kept {len(self.kept):,}; "
                f"pHash within {self.threshold} of {self.hash_bits} bits; {self.seconds:.2f} s "
                f"(hashing {self.hash_s:.2f} s, grouping {self.group_s:.2f} s)")


def find_near_duplicates(images, threshold: int) -> DedupReport:
    """Hash ``images`` and group them; the report says which go and how long each part took."""
    started = time.perf_counter()
    hashes = perceptual_hashes(images)
    hashed = time.perf_counter()
    original = duplicate_of(hashes, threshold)
    grouped = time.perf_counter()
    n = len(original)
    per_image = _stored_bytes(images) // n
    removed = int((original >= 0).sum())
    return DedupReport(samples=n, removed=removed, bytes_total=per_image * n, bytes_removed=per_image * removed,
                       threshold=threshold, hash_s=hashed - started, group_s=grouped - hashed, duplicate_of=original)


def _stored_bytes(images) -> int:
    if isinstance(images, torch.Tensor):
        return images.numel() * images.element_size()
    return np.asarray(images).nbytes


def images_of(dataset):
    """The images of a dataset object that exposes them as ``images`` (N, C, H, W) (``TensorImages`` does)."""
    if not hasattr(dataset, "images"):
        raise EdgetrainError(f"dedup needs a dataset exposing its images as .images (N, C, H, W); "
                             f"{type(dataset).__name__} has none")
    return dataset.images


def without(dataset, kept: np.ndarray):
    """A shallow copy of ``dataset`` holding only the samples ``kept`` (its ``images`` and ``labels``); a dataset
    holding more per sample (a detection set's boxes) gives its own ``subset``."""
    index = torch.as_tensor(kept, dtype=torch.long)
    if hasattr(dataset, "subset"):
        return dataset.subset(index)
    smaller = copy.copy(dataset)
    smaller.images, smaller.labels = dataset.images[index], dataset.labels[index]
    return smaller


def drop_near_duplicates(data, spec: DedupSpec):
    """(``data`` with the near duplicates gone from its training set, the report); the new ``DataSplit``
    carries the report's counts in ``details["dedup"]``. The test set is left whole, so accuracies stay
    comparable with a run without dedup."""
    report = find_near_duplicates(images_of(data.train), spec.threshold)
    return dataclasses.replace(data, train=without(data.train, report.kept),
                               details={**data.details, "dedup": report.to_dict()}), report
