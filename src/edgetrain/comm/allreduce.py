"""Overlapping DDP communication hook: a summable payload all-reduced asynchronously, with accounting.

``allreduce_hook`` encodes the bucket with a summable compressor (default
``NoCompression``: PyTorch's ``default_hooks.allreduce_hook``; ``HalfCast``:
its ``fp16_compress_hook`` / ``bf16_compress_hook``), launches the all-reduce
and returns the collective's own future, decoded and averaged in ``then``.
DDP waits on that future only at the end of backward, so the all-reduce of
one bucket runs while the gradients of the next are computed. Register it on
any DDP model::

    state = AllReduceState(stats=CommStats())            # or compressor=HalfCast()
    ddp_model.register_comm_hook(state, allreduce_hook)

Bytes are counted at launch from the encoded payload (ring all-reduce
traffic, ``accounting.py``); ``stats.comm_s`` is launch to completion of each
collective, which may overlap compute.

Limits, and why ``build_hook`` picks it only for a summable compressor without
error-feedback memory on an unemulated link: a link emulator charges each
collective when it completes, which needs the blocking path of ``hook.py``;
compressors that gather variable-length payloads must exchange the lengths
first. (Memory would work, as it is updated before the launch, but it lives in
``exchange.average``, which is kept as the one place that applies it.)
"""
# No "from __future__ import annotations": DDP checks the hook's annotations are the real types.

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from edgetrain.comm.accounting import CommStats, ring_allreduce_bytes
from edgetrain.comm.compress.base import Compressor, Payload
from edgetrain.comm.compress.fp32 import NoCompression


@dataclass
class AllReduceState:
    """State of ``allreduce_hook``: the process group (None = default), where to count, what to send."""

    group: object = None
    stats: CommStats = field(default_factory=CommStats)
    compressor: Compressor = field(default_factory=NoCompression)

    def __post_init__(self) -> None:
        if not self.compressor.summable:
            raise ValueError(f"allreduce_hook sums payloads; {self.compressor.name} is not summable")


def allreduce_hook(state: AllReduceState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    world = dist.get_world_size(state.group)
    buffer = bucket.buffer()
    segments = tuple(g.numel() for g in bucket.gradients())  # the bucket's parameters, end to end
    payload = state.compressor.encode(buffer, bucket.index(), segments if sum(segments) == buffer.numel() else None)
    (wire,) = payload.tensors  # summable: one tensor (for fp32, the bucket itself)
    started = state.stats.launched(ring_allreduce_bytes(wire.numel() * wire.element_size(), world))
    fut = dist.all_reduce(wire, group=state.group, async_op=True).get_future()

    def averaged(f: torch.futures.Future) -> torch.Tensor:
        state.stats.finished(started)
        total = state.compressor.decode(Payload((f.value()[0],), payload.numel, payload.segments, payload.ctx))
        if total.data_ptr() != buffer.data_ptr():
            buffer.copy_(total.view_as(buffer))
        return buffer.div_(world)

    return fut.then(averaged)
