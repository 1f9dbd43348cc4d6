"""Compression as a standard DDP communication hook.

Works on any ``DistributedDataParallel`` model, with or without edgetrain's
trainer::

    from edgetrain.comm.hook import CompressionState, compression_hook
    from edgetrain.comm.compress import TopK, ResidualMemory

    state = CompressionState(TopK(0.01), ResidualMemory())
    ddp_model.register_comm_hook(state, compression_hook)
    ...
    state.stats.bytes_sent          # bytes this device put on the wire

or from a spec string: ``state, hook = make_hook("topk:0.01")``.

Error-feedback memory is kept per parameter (named by its identity), not per
bucket: DDP reorders a bucket's parameters when it rebuilds its buckets after
the first step (see ``compress/memory.py``).

The hook averages the bucket through ``exchange.average`` and returns an
already completed future: the collective does not overlap the rest of the
backward pass (the link model assumes no overlap; see ``emulation.py``).
"""
# No "from __future__ import annotations": DDP checks the hook's annotations are the real types.

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from edgetrain.comm.accounting import CommStats
from edgetrain.comm.compress.base import Compressor
from edgetrain.comm.compress.memory import NoMemory
from edgetrain.comm.emulation import LinkEmulator
from edgetrain.comm.exchange import Channel, average


@dataclass
class CompressionState:
    """State of ``compression_hook``: what to compress with, what to remember, where to count.

    ``emulator`` charges each collective to an emulated link; the default (no
    link) only counts bytes and real time into ``stats``.
    """

    compressor: Compressor
    memory: object = field(default_factory=NoMemory)
    emulator: LinkEmulator | None = None
    group: object = None
    secure: object = None    # a ``secagg.SecureSum``: the bucket's sum masked (--secure-aggregation)

    def __post_init__(self) -> None:
        if self.emulator is None:
            rank = dist.get_rank() if dist.is_initialized() else 0
            self.emulator = LinkEmulator(None, rank)

    @property
    def stats(self) -> CommStats:
        return self.emulator.stats


def compression_hook(state: CompressionState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    buffer = bucket.buffer()
    segments = tuple(g.numel() for g in bucket.gradients())  # the bucket's parameters, end to end
    # Memory is kept per parameter: DDP reorders a bucket's parameters when it rebuilds its buckets.
    names = tuple(id(p) for p in bucket.parameters())
    if sum(segments) != buffer.numel():
        # No per-parameter layout: name the whole bucket by its parameters, so that a bucket
        # that changes starts afresh instead of inheriting another layout's memory.
        segments, names = None, (names,)
    channel = Channel(state.compressor, state.memory, state.emulator, state.group, secure=state.secure)
    mean = average(buffer, channel, key=bucket.index(), segments=segments, names=names)
    buffer.copy_(mean.view_as(buffer))
    fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    fut.set_result(buffer)
    return fut
