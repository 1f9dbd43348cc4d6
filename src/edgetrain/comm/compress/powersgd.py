"""PowerSGD (Vogels et al., NeurIPS 2019), as PyTorch implements it, with bytes and link time counted.

``powersgd_hook`` calls PyTorch's own ``powerSGD_hook`` unchanged and waits
for it (``cluster.peers.wait``, bounded by ``--timeout``). Bytes come from
PyTorch's own tally: the hook adds the numbers of values it all-reduces
(uncompressed vectors, then ``P``, then ``Q``) to
``total_numel_after_compression``; during its first ``start_powerSGD_iter``
iterations it all-reduces the whole bucket. Each all-reduce is charged as a
ring all-reduce: three per bucket once compression starts, so PowerSGD pays
three times the latency of one all-reduce, which on edge links matters.

Error bound: rank-``r`` approximation of each gradient matrix after one power
iteration (warm-started from the last step), with error feedback; no
per-element bound.
"""
# No "from __future__ import annotations": DDP checks the hook's annotations are the real types.

from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import PowerSGDState, powerSGD_hook

from edgetrain.cluster.peers import wait
from edgetrain.comm.accounting import ring_allreduce_bytes
from edgetrain.comm.emulation import LinkEmulator


@dataclass
class PowerSGDHookState:
    """PyTorch's ``PowerSGDState`` plus the device's ``LinkEmulator``."""

    rank: int = 2
    start_iter: int = 10
    emulator: LinkEmulator | None = None
    group: object = None
    psgd: PowerSGDState = field(init=False)

    def __post_init__(self) -> None:
        if self.emulator is None:
            self.emulator = LinkEmulator(None, dist.get_rank() if dist.is_initialized() else 0)
        # PyTorch requires start_powerSGD_iter > 1 with error feedback / warm start (DDP rebuilds
        # its buckets after the first iteration).
        self.psgd = PowerSGDState(process_group=self.group, matrix_approximation_rank=self.rank,
                                  start_powerSGD_iter=max(2, self.start_iter), use_error_feedback=True,
                                  warm_start=True, random_seed=0)

    @property
    def stats(self):
        return self.emulator.stats


def powersgd_hook(state: PowerSGDHookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    psgd, emulator = state.psgd, state.emulator
    world = dist.get_world_size(state.group)
    element = bucket.buffer().element_size()
    vanilla = psgd.iter < psgd.start_powerSGD_iter
    before = psgd.total_numel_after_compression
    started = emulator.begin()
    fut = powerSGD_hook(psgd, bucket)
    result = wait(fut, emulator.timeout_s, "PowerSGD all-reduce")
    if vanilla:
        parts = [bucket.buffer().numel()]
    else:
        p = psgd.p_memory_dict[bucket.index()].numel()
        q = psgd.q_memory_dict[bucket.index()].numel()
        uncompressed = psgd.total_numel_after_compression - before - p - q
        parts = [uncompressed, p, q]
    emulator.end(started, [("allreduce", ring_allreduce_bytes(n * element, world)) for n in parts])
    out: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    out.set_result(result)
    return out
