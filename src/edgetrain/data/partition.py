"""Each device's own part of the training set (``--partition``), and the sampler that reads only it.

Design: docs/design/data.md ("Partitions").
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

import numpy as np
from torch.utils.data import Sampler

from edgetrain.data.sampler import EpochSampler, GlobalBatchSampler
from edgetrain.errors import EdgetrainError
from edgetrain.spec import PartitionSpec

DIRICHLET_DRAWS = 100


def split_dataset(labels: np.ndarray, spec: PartitionSpec, min_sizes: list[int], seed: int = 0) -> list[np.ndarray]:
    """The sorted sample indices of every device's partition (``len(min_sizes)`` devices), disjoint and
    covering ``labels``; device ``d`` gets at least ``min_sizes[d]`` samples or the spec is refused."""
    labels = np.asarray(labels)
    devices = len(min_sizes)
    rng = np.random.default_rng(seed)
    if spec.kind == "iid":
        parts = np.array_split(rng.permutation(len(labels)), devices)
    elif spec.kind == "shards":
        parts = _shards(labels, devices, spec.shards, rng)
    elif spec.kind == "dirichlet":
        parts = _dirichlet(labels, min_sizes, spec, rng)
    else:
        raise ValueError(f"partition {spec.kind!r} gives no per-device split")
    parts = [np.sort(p) for p in parts]
    small = [d for d, (p, need) in enumerate(zip(parts, min_sizes)) if len(p) < need]
    if small:
        d = small[0]
        raise EdgetrainError(f"--partition {spec.text} gives device {d} {len(parts[d])} training samples, fewer than "
                             f"its local batch of {min_sizes[d]}; lower --devices or --batch-size, or use more shards")
    return parts


def _shards(labels: np.ndarray, devices: int, per_device: int, rng: np.random.Generator) -> list[np.ndarray]:
    # shuffle first, then a stable sort by label: each class's samples come in a random order
    order = rng.permutation(len(labels))
    order = order[np.argsort(labels[order], kind="stable")]
    shards = np.array_split(order, devices * per_device)
    owner = rng.permutation(devices * per_device)
    return [np.concatenate([shards[s] for s in owner[d * per_device:(d + 1) * per_device]]) for d in range(devices)]


def _dirichlet(labels: np.ndarray, min_sizes: list[int], spec: PartitionSpec,
               rng: np.random.Generator) -> list[np.ndarray]:
    devices = len(min_sizes)
    for _ in range(DIRICHLET_DRAWS):
        parts: list[list[np.ndarray]] = [[] for _ in range(devices)]
        for c in np.unique(labels):
            members = rng.permutation(np.flatnonzero(labels == c))
            cuts = (np.cumsum(rng.dirichlet([spec.alpha] * devices))[:-1] * len(members)).astype(int)
            for d, piece in enumerate(np.split(members, cuts)):
                parts[d].append(piece)
        result = [np.concatenate(p) for p in parts]
        if all(len(p) >= need for p, need in zip(result, min_sizes)):
            return result
    raise EdgetrainError(f"--partition {spec.text} left a device fewer samples than its local batch in "
                         f"{DIRICHLET_DRAWS} draws; raise alpha, or lower --devices or --batch-size")


@dataclass(frozen=True)
class PartitionReport:
    """What ``split_dataset`` gave each device: sizes, label counts, label entropy (bits)."""

    spec: str
    sizes: list[int]
    label_counts: list[list[int]]
    label_entropy_bits: list[float]

    @classmethod
    def of(cls, labels: np.ndarray, parts: list[np.ndarray], spec: PartitionSpec) -> "PartitionReport":
        classes = int(np.max(labels)) + 1 if len(labels) else 0
        counts = [np.bincount(labels[p], minlength=classes) for p in parts]
        return cls(spec.text, [len(p) for p in parts], [c.tolist() for c in counts],
                   [round(label_entropy(c), 4) for c in counts])

    def describe(self) -> str:
        entropy = ", ".join(f"{e:.2f}" for e in self.label_entropy_bits)
        return (f"partition {self.spec}: {len(self.sizes)} devices hold {', '.join(map(str, self.sizes))} training "
                f"samples; label entropy {entropy} bits")

    def to_dict(self) -> dict:
        return {"spec": self.spec, "sizes": self.sizes, "label_counts": self.label_counts,
                "label_entropy_bits": self.label_entropy_bits}


def label_entropy(counts: np.ndarray) -> float:
    """Shannon entropy in bits of a label histogram (log2 of the class count for a uniform one)."""
    p = np.asarray(counts, dtype=np.float64)
    p = p[p > 0] / p.sum()
    return float(-(p * np.log2(p)).sum()) if len(p) else 0.0


class PartitionSampler(EpochSampler):
    """This device's batches, drawn only from ``indices`` (its partition), as ``(index, epoch)`` pairs."""

    def __init__(self, indices: np.ndarray, local_batch: int, steps_per_epoch: int, rank: int, seed: int = 0):
        self.indices, self.local_batch, self.steps = np.asarray(indices), local_batch, steps_per_epoch
        self.rank, self.seed = rank, seed

    def __len__(self) -> int:
        return self.steps

    def __iter__(self) -> Iterator[list[tuple[int, int]]]:
        # One stream over all epochs: shuffle p of the partition, walked to its end before shuffle p + 1. Where a
        # batch starts follows from the epoch and the step alone (every epoch has self.steps batches), so a
        # resumed run (resume_at) continues the stream exactly, with no state of its own to checkpoint.
        n, first = len(self.indices), self.first_batch()
        position = (self.epoch * self.steps + first) * self.local_batch
        shuffle, order = -1, self.indices
        for _ in range(first, self.steps):
            batch = []
            while len(batch) < self.local_batch:
                if position // n != shuffle:
                    shuffle = position // n
                    order = np.random.default_rng((self.seed, self.rank, shuffle)).permutation(self.indices)
                take = min(self.local_batch - len(batch), n - position % n)
                batch += [(int(i), self.epoch) for i in order[position % n:position % n + take]]
                position += take
            yield batch


def build_sampler(labels, partition: PartitionSpec, local_batches: list[int], rank: int,
                  seed: int) -> tuple[Sampler, PartitionReport | None]:
    """The loop's sampler for this device: its share of every global batch of one shared dataset
    (``GlobalBatchSampler``), or, with a partition, batches of its own partition only."""
    size = len(labels)
    if not partition.local:
        return GlobalBatchSampler(size, local_batches, rank, seed), None
    labels = np.asarray(labels)
    parts = split_dataset(labels, partition, local_batches, seed)
    sampler = PartitionSampler(parts[rank], local_batches[rank], size // sum(local_batches), rank, seed)
    return sampler, PartitionReport.of(labels, parts, partition)
