"""Decentralized gossip: every device averages its model with its ring neighbours only.

Decentralized parallel SGD (Lian et al., NeurIPS 2017): no server and no
global collective. Devices sit on a ring; every ``H`` steps each one sends
its fp32 parameters to its two neighbours with point-to-point ``isend`` /
``irecv`` and replaces its model by the mean of the three (two with two
devices). The mixing matrix is doubly stochastic, so the devices' average
evolves as in SGD while the individual models drift apart by a bounded
amount; ``finish`` closes with one exact all-reduce so that every device ends
with the same model.

Link time: one point-to-point round in which the device sends one copy per
neighbour over its link; the round is bottlenecked by the slowest link among
the device and its neighbours. Virtual clock: a device starts exchanging when
it and both neighbours have arrived (their clocks travel with the
parameters, as emulation bookkeeping), not when the whole ring has.

Compression: only ``none``. Compressed gossip needs the model-difference
error feedback of CHOCO-SGD (Koloskova et al., ICML 2019), not implemented.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn

from edgetrain.cluster.peers import wait
from edgetrain.comm.accounting import ring_allreduce_bytes
from edgetrain.comm.emulation import LinkEmulator
from edgetrain.comm.mode import Averaging, SyncMode
from edgetrain.comm.params import average_buffers, flatten, unflatten
from edgetrain.kinds import named_by_kind

if TYPE_CHECKING:
    from edgetrain.comm.setup import SyncSetup


def ring_neighbours(rank: int, world_size: int) -> list[int]:
    """The distinct ring neighbours of ``rank`` (one with two devices, none alone)."""
    return sorted({(rank - 1) % world_size, (rank + 1) % world_size} - {rank})


@named_by_kind("sync", builder="build")
class Gossip(SyncMode):

    def __init__(self, model: nn.Module, world_size: int, emulator: LinkEmulator, averaging: Averaging,
                 period: int = 1, **common):
        if period < 1:
            raise ValueError(f"gossip period must be >= 1, got {period}")
        super().__init__(model, world_size, emulator, averaging, **common)
        self.period = period
        self.neighbours = ring_neighbours(self.rank, world_size)
        self.steps = 0
        self.exchanges = 0

    def after_step(self, step: int) -> None:
        self.steps += 1
        if self.world_size == 1 or self.steps % self.period != 0:
            self._close_step(None)
            return
        ready = self._exchange(self.emulator.arrive())
        self._close_step(ready)

    def _exchange(self, clock_s: float) -> float | None:
        mine = flatten(self.params)
        wire = mine.cpu()  # gloo sends only CPU tensors point to point (a CUDA one fails: "Bad address")
        my_clock = torch.tensor([clock_s], dtype=torch.float64)
        theirs = [torch.empty_like(wire) for _ in self.neighbours]
        their_clocks = [torch.empty_like(my_clock) for _ in self.neighbours]
        ops = []
        for peer, buf, clk in zip(self.neighbours, theirs, their_clocks):
            other = self._global_rank(peer)
            ops += [dist.P2POp(dist.isend, wire, other, self.group), dist.P2POp(dist.irecv, buf, other, self.group),
                    dist.P2POp(dist.isend, my_clock, other, self.group), dist.P2POp(dist.irecv, clk, other, self.group)]

        def collective() -> None:
            for work in dist.batch_isend_irecv(ops):
                wait(work, self.emulator.timeout_s, f"gossip exchange with devices {self.neighbours}")

        sent = len(self.neighbours) * mine.numel() * 4
        self.emulator.run("p2p", sent, collective, peers=[self.rank, *self.neighbours])
        unflatten(torch.stack([mine, *(t.to(mine.device) for t in theirs)]).mean(0), self.params)
        self.exchanges += 1
        return max(float(c.item()) for c in [my_clock, *their_clocks])

    def _final_exchange(self) -> None:
        self.emulator.start_step()
        ready = self._max_clock(self.emulator.arrive())
        flat = flatten(self.params)

        def collective() -> None:
            wait(dist.all_reduce(flat, group=self.group, async_op=True), self.emulator.timeout_s,
                 "final gossip all-reduce")

        self.emulator.run("allreduce", ring_allreduce_bytes(flat.numel() * 4, self.world_size), collective)
        unflatten(flat / self.world_size, self.params)
        average_buffers(self.model, self.emulator, self.world_size, self.group)
        self.emulator.finish_step(ready, count=False)

    def state_dict(self) -> dict:
        return {**super().state_dict(), "steps": self.steps, "exchanges": self.exchanges}

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        self.steps, self.exchanges = state["steps"], state["exchanges"]

    def summary(self) -> dict:
        return {**super().summary(), "exchanges": self.exchanges, "neighbours": self.neighbours}


def build(setup: SyncSetup) -> Gossip:
    """``--sync gossip[:H]``."""
    return Gossip(setup.model, setup.world_size, setup.emulator, setup.averaging(), setup.spec.sync.period,
                  **setup.common)
