"""A training-aware cache for datasets on storage (``--cache-mb``): CoorDL's MinIO policy.

Mohan et al. (VLDB 2021, CoorDL) observe that training reads every item exactly once per epoch, in a new
random order, so a recency cache (Linux's page cache) keeps the items least likely to be read next and
thrashes once the dataset exceeds it. MinIO caches a fixed set of items and never evicts one: with a cache
of a fraction f of the dataset, every epoch after the first reads exactly f from the cache and 1 - f from
storage, the most any policy can do for that access pattern.

Here the set is chosen up front (items in a seeded order until their sizes fill the budget), so its slots
are fixed and need no lock: the file is preallocated (``posix_fallocate``: a full disk is one line before
training, not a SIGBUS half-way), opened once, unlinked at once (nothing is left behind, whatever ends the
run) and mapped shared. A slot is filled the first time its item is read, its flag byte set after its bytes;
two workers filling one slot write the same bytes.

Loader workers share the device's mapping. Forked workers inherit it; workers started from a fork server or
spawned (a device's own start method is the fork server's it was started from) receive the cache by its file
descriptor, which multiprocessing passes over a Unix socket (SCM_RIGHTS) while it starts them, as torch passes
shared-memory tensors, and map the same pages: every item a worker fills is there for the others and the
device. The workers are not forked instead (``multiprocessing_context="fork"``): a device runs gloo's and
OpenMP's threads, and a fork copies any lock one of them holds, the reason Python 3.14 stopped forking by
default. The file has no name to reopen by, by design, so its descriptor is the one way in.

With ``drop_pages`` (the default) an item read from storage leaves the page cache at once
(``posix_fadvise(DONTNEED)``), as CoorDL bypasses it: a cached item is held by this cache and a page-cache
copy would hold it twice; an uncached one will not be read again before the page cache's small remaining room
has cycled. docs/benchmarks/storage.md measures both.
"""
from __future__ import annotations

import mmap
import os
import tempfile

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
        self.fd = fd  # kept open: the workers a device starts receive it (module docstring)

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
        from multiprocessing import context, reduction

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
