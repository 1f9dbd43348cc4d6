"""Sharding a global batch across devices of unequal batch sizes.

Each epoch the training set is shuffled with a seed every device shares, cut
into global batches, and device ``r`` takes the slice
``[offset_r, offset_r + batch_r)`` of every global batch. The union over
devices is exactly the batch one device would see, so N devices compute the
gradient of the same global batch as one (``DistributedSampler`` gives the
same guarantee only for equal batches). The last incomplete global batch is
dropped, as every device must take part in every step.

A resumed run (train/checkpoint.py) continues mid-epoch with ``resume_at``:
the next iteration starts at that batch of that epoch's order, without
loading the batches before it.
"""
from __future__ import annotations

from typing import Iterator

import torch
from torch.utils.data import Sampler


class EpochSampler(Sampler[list[tuple[int, int]]]):
    """What the loop's samplers share: the epoch whose order they yield next, and the batch a resumed run
    starts that epoch at (``resume_at``; later epochs start at 0)."""

    epoch = 0
    start_batch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def resume_at(self, epoch: int, batch: int) -> None:
        """The next iteration yields epoch ``epoch``'s batches from ``batch`` on; later ones start at 0."""
        self.epoch, self.start_batch = epoch, batch

    def first_batch(self) -> int:
        """Where this iteration starts: ``resume_at``'s batch once, then 0."""
        first, self.start_batch = self.start_batch, 0
        return first


class GlobalBatchSampler(EpochSampler):
    """Yields this device's share of each global batch as ``(index, epoch)`` pairs."""

    def __init__(self, size: int, local_batches: list[int], rank: int, seed: int = 0, shuffle: bool = True):
        self.size, self.seed, self.shuffle = size, seed, shuffle
        self.reshard(local_batches, rank)

    def reshard(self, local_batches: list[int], rank: int) -> None:
        """This device's share of the same global batches over another set of devices (elastic membership)."""
        self.rank = rank
        self.global_batch = sum(local_batches)
        self.offset = sum(local_batches[:rank])
        self.local_batch = local_batches[rank]

    def __len__(self) -> int:
        return self.size // self.global_batch

    def __iter__(self) -> Iterator[list[tuple[int, int]]]:
        if self.shuffle:
            order = torch.randperm(self.size, generator=torch.Generator().manual_seed(self.seed * 100003 + self.epoch))
        else:
            order = torch.arange(self.size)
        for b in range(self.first_batch(), len(self)):
            start = b * self.global_batch + self.offset
            yield [(int(i), self.epoch) for i in order[start:start + self.local_batch]]


def shard_indices(size: int, rank: int, world: int) -> list[int]:
    """Evaluation shard: every sample exactly once over all devices."""
    return list(range(rank, size, world))
