"""Activation memory: the bytes of the tensors autograd saves for backward, measured on the real model.

``SavedTensorMeter`` is the one activation meter: ``plan`` counts a model's
activations per sample with it (``plan/costs.py``), the tiled strategy
reports each device's tiled-section memory with it (``tiling/strategy.py``)
and ``benchmarks/tiling.py`` compares grids with it.

How: ``torch.autograd.graph.saved_tensors_hooks`` sees every tensor an
operator saves for backward while the ``with`` block runs (PyTorch's own
mechanism, the one activation checkpointing and offloading are built on).
The meter counts each *storage* once, so views and a tensor saved by two
operators (a ReLU's output that the next layer also saves as its input) are
not counted twice; the tensors it is told to exclude (weights, and where the
caller says so the input batch) are left out by storage too. Storages are told
apart by address: the graph keeps every saved tensor alive until backward, so
no two of them share one.

Limits: it counts what autograd saves, not the allocator's peak (temporaries
freed inside a layer, the allocator's caching and fragmentation are not seen);
a device's whole footprint is its resident set, ``cluster.throttle.peak_rss_mb``.
"""
from __future__ import annotations

import torch


class SavedTensorMeter:
    """Bytes of the tensors autograd saves for backward inside a ``with`` block, each storage once.

    ``exclude``: tensors whose storages are not counted (parameters, buffers, the input batch).
    """

    def __init__(self, exclude: list[torch.Tensor]):
        self.exclude = {t.untyped_storage().data_ptr() for t in exclude}
        self.storages: dict[int, int] = {}

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in self.exclude:
            self.storages[storage.data_ptr()] = storage.nbytes()
        return t  # kept as it is: the meter only looks

    def __enter__(self) -> SavedTensorMeter:
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._hooks.__exit__(*exc)

    @property
    def bytes(self) -> int:
        return sum(self.storages.values())
