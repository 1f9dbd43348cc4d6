"""A training-aware cache for datasets on storage (``--cache-mb``): CoorDL's MinIO policy.

Design: docs/design/data.md ("The cache").
"""
from __future__ import annotations

import mmap
import os
import tempfile
from multiprocessing import context, reduction

import numpy as np

from edgetrain.errors import EdgetrainError


class MinioCache:
    def __init__(self, sizes: list[int], budget_mb: float, seed: int, directory: str = "/dev/shm",
                 drop_pages: bool = True):
        self.drop_pages = drop_pages
        budget = int(budget_mb * 1e6)
        self.slot = np.full(len(sizes), -1, dtype=np.int64)
        offsets, used = [], 0
        for index in np.random.default_rng(seed).permutation(len(sizes)):
            if used + sizes[index] > budget:
                continue
            self.slot[index] = len(offsets)
            offsets.append(used)
            used += sizes[index]
        self.offsets = np.asarray(offsets, dtype=np.int64)
        self.sizes = np.asarray(sizes, dtype=np.int64)
        self.items, self.bytes = len(offsets), used
        flags = len(offsets)
        total = max(used + flags, 1)
        self.flag_at = used
        try:
            fd, path = tempfile.mkstemp(prefix="edgetrain-cache-", dir=directory)
        except OSError as e:
            raise EdgetrainError(f"the --cache-mb cache cannot be made in {directory} ({e.strerror}); set "
                                 "--cache-dir to a writable folder") from None
        try:
            os.unlink(path)  # gone from the file system now: nothing to clean up, whatever ends the run
            os.posix_fallocate(fd, 0, total)
            self.map = mmap.mmap(fd, total, mmap.MAP_SHARED)
        except OSError as e:
            os.close(fd)
            raise EdgetrainError(f"the --cache-mb cache of {total / 1e6:.1f} MB does not fit in {directory} "
                                 f"({e.strerror}); lower --cache-mb or free space there (or set --cache-dir)") from None
        self.fd = fd  # kept open: the workers a device starts receive it (docs/design/data.md)

    def get(self, index: int) -> bytes | None:
        slot = int(self.slot[index])
        if slot < 0 or self.map[self.flag_at + slot] == 0:
            return None
        start = int(self.offsets[slot])
        return self.map[start:start + int(self.sizes[index])]

    def put(self, index: int, raw: bytes) -> None:
        slot = int(self.slot[index])
        if slot < 0 or len(raw) != self.sizes[index] or self.map[self.flag_at + slot]:
            return
        start = int(self.offsets[slot])
        self.map[start:start + len(raw)] = raw
        self.map[self.flag_at + slot] = 1

    def describe(self) -> str:
        return f"{self.items} items ({self.bytes / 1e6:.1f} MB) of {len(self.sizes)}"

    def __reduce__(self):
        if context.get_spawning_popen() is None:  # a copy anywhere else would be a second cache, or none
            raise TypeError("a MinioCache travels only to the processes multiprocessing starts (loader workers), "
                            "by its file descriptor")
        state = {k: v for k, v in self.__dict__.items() if k not in ("map", "fd")}
        return _attach, (reduction.DupFd(self.fd), len(self.map), state)


def _attach(fd, length: int, state: dict) -> MinioCache:
    """The cache in a loader worker: the device's file, by the descriptor multiprocessing passed, mapped shared."""
    cache = MinioCache.__new__(MinioCache)
    cache.__dict__.update(state)
    cache.fd = fd.detach()
    cache.map = mmap.mmap(cache.fd, length, mmap.MAP_SHARED)
    return cache


def attach_cache(dataset, budget_mb: float, seed: int, directory: str, drop_pages: bool = True) -> MinioCache | None:
    """Give a dataset on storage (``data/storage.StoredItems``) a MinIO cache of ``budget_mb``; None for any
    other dataset (in memory already)."""
    source = getattr(dataset, "source", None)
    if budget_mb <= 0 or source is None:
        return None
    try:
        sizes = [source.size(k) for k in range(len(source))]
    except OSError as e:
        raise EdgetrainError(f"the dataset's files cannot be sized for --cache-mb ({e}); check the storage") from None
    dataset.cache = MinioCache(sizes, budget_mb, seed, directory, drop_pages)
    return dataset.cache
