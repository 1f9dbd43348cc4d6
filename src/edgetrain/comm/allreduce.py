"""The default DDP communication hook: fp32 all-reduce, averaged, with accounting.

Behaves like PyTorch's ``default_hooks.allreduce_hook`` and additionally
records bytes and time in a ``CommStats``. Register it on any DDP model::

    state = AllReduceState(stats=CommStats())
    ddp_model.register_comm_hook(state, allreduce_hook)
"""
# No "from __future__ import annotations": DDP checks the hook's annotations are the real types.

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from edgetrain.comm.accounting import CommStats, ring_allreduce_bytes


@dataclass
class AllReduceState:
    """State of ``allreduce_hook``: the process group (None = default) and where to count."""

    group: object = None
    stats: CommStats = field(default_factory=CommStats)


def allreduce_hook(state: AllReduceState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    world = dist.get_world_size(state.group)
    tensor = bucket.buffer().div_(world)
    payload = tensor.numel() * tensor.element_size()
    started = state.stats.launched(ring_allreduce_bytes(payload, world))
    fut = dist.all_reduce(tensor, group=state.group, async_op=True).get_future()

    def done(f: torch.futures.Future) -> torch.Tensor:
        state.stats.finished(started)
        return f.value()[0]

    return fut.then(done)
