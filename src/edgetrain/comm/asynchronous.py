"""Bounded-staleness asynchronous training (``--sync async:S``): average in the background, wait only when
too stale.

No parameter server: each device averages its model with the others' in non-blocking collectives while it
trains on, one round in flight at a time, and folds a completed round into its model (the average plus its
local progress since the round's launch). A device whose round is ``S`` steps old waits for it, so no device
trains on information older than ``S`` steps (stale synchronous parallel, Ho et al., NeurIPS 2013).
``settle`` ends the rounds in flight on every device before evaluation, a checkpoint and the end.

Design: docs/design/strategies.md ("Bounded staleness"): completion per link mode, settling, checkpoints.
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn

from edgetrain.cluster.peers import wait
from edgetrain.comm.compress.base import Payload, unpack
from edgetrain.comm.emulation import LinkEmulator
from edgetrain.comm.exchange import start_exchange
from edgetrain.comm.mode import Averaging, SyncMode
from edgetrain.comm.params import average_buffers, flatten, unflatten
from edgetrain.kinds import named_by_kind

if TYPE_CHECKING:
    from edgetrain.comm.setup import SyncSetup


@dataclass
class _Round:
    works: list
    buf: torch.Tensor
    received: list[torch.Tensor] | None
    clocks: torch.Tensor
    snapshot: torch.Tensor
    payload: Payload
    launched_step: int
    modelled_s: float
    started: float
    done_at: float | None = None
    lock: threading.Lock = field(default_factory=threading.Lock)


@named_by_kind("sync", builder="build")
class BoundedStaleness(SyncMode):
    """Averaging rounds in the background, one in flight per device; a device waits for its round only once
    it is ``staleness`` steps old."""

    def __init__(self, model: nn.Module, world_size: int, emulator: LinkEmulator, averaging: Averaging,
                 staleness: int, **common):
        if staleness < 1:
            raise ValueError(f"staleness bound must be >= 1, got {staleness}")
        if not averaging.compressor.fixed_size:
            raise ValueError(f"{averaging.compressor.name} has a variable payload size; async mode needs a fixed one")
        super().__init__(model, world_size, emulator, averaging, **common)
        self.staleness = staleness
        self.ref = flatten(self.params)
        self.round: _Round | None = None
        self.steps = 0
        self.rounds = 0
        self.staleness_seen: list[int] = []
        self.blocking_waits = 0
        self.wait_real_s = 0.0
        self._settled_at: int | None = None  # the step count at the last settle (design: Settling)

    # -- rounds ---------------------------------------------------------------------
    def _launch(self, clock_s: float, done: bool) -> None:
        p = self.world_size
        snapshot = flatten(self.params)
        compensated = self.memory.compensate(snapshot - self.ref, "params")
        payload = self.compressor.encode(compensated, "params", self.segments)
        self.memory.update(compensated, self.compressor.decode(payload), "params")
        clocks = torch.zeros(2 * p, dtype=torch.float64)
        clocks[self.rank] = clock_s
        clocks[p + self.rank] = 1.0 if done else 0.0
        buf, received, kind, sent, work = start_exchange(payload, self.compressor, self.group, p)
        clock_work = dist.all_reduce(clocks, group=self.group, async_op=True)
        started = self.stats.launched(sent)
        modelled = self.emulator.model_time(kind, sent)
        r = _Round([work, clock_work], buf, received, clocks, snapshot, payload, self.steps, modelled, started)

        def completed(_) -> None:
            with r.lock:
                if r.done_at is None:
                    r.done_at = time.perf_counter()
                    self.stats.finished(started)

        clock_work.get_future().add_done_callback(completed)
        self.round = r
        self.rounds += 1

    def _really_done(self, r: _Round) -> bool:
        return r.done_at is not None or all(w.is_completed() for w in r.works)

    def _ready_virtual_s(self, r: _Round) -> float:
        return float(r.clocks[:self.world_size].max()) + r.modelled_s

    def _complete_now(self, r: _Round, clock_s: float) -> bool:
        if not self._really_done(r):
            return False
        if self.emulator.virtual:
            return clock_s >= self._ready_virtual_s(r)
        if self.emulator.emulated:  # enforced: the link takes modelled_s after everyone launched
            return time.perf_counter() >= self._done_at(r) + r.modelled_s
        return True

    def _done_at(self, r: _Round) -> float:
        with r.lock:
            if r.done_at is None:  # completed, but its callback has not run yet
                r.done_at = time.perf_counter()
                self.stats.finished(r.started)
            return r.done_at

    def _wait(self, r: _Round, why: str = "averaging round at the staleness bound") -> float | None:
        """Block until round ``r`` is complete; return the virtual time it was (virtual mode)."""
        started = time.perf_counter()
        for w in r.works:
            wait(w, self.emulator.timeout_s, f"--sync async: {why}")
        if self.emulator.emulated and not self.emulator.virtual:
            remaining = self._done_at(r) + r.modelled_s - time.perf_counter()
            if remaining > 0:
                time.sleep(remaining)
        self._done_at(r)
        waited = time.perf_counter() - started
        self.emulator.blocked(waited)
        self.wait_real_s += waited
        self.blocking_waits += 1
        return self._ready_virtual_s(r) if self.emulator.virtual else None

    def _apply(self, r: _Round, final: bool = False) -> None:
        """Fold round ``r`` into the model (``final``: the model becomes the average, no local progress)."""
        p = self.world_size
        if r.received is None:
            mean_delta = self.compressor.decode(Payload((r.buf,), r.payload.numel, self.segments,
                                                        r.payload.ctx)).div_(p)
        else:
            layout = self.compressor.layout(r.payload.numel, r.buf.numel(), self.segments)
            mean_delta = self.compressor.combine(
                [self.compressor.decode(unpack(b, layout, r.payload.numel, self.segments)) for b in r.received])
        new_ref = self.ref + mean_delta
        if final:
            unflatten(new_ref, self.params)
        else:
            unflatten(flatten(self.params) + (new_ref - r.snapshot), self.params)
        self.ref = new_ref
        self.staleness_seen.append(self.steps - r.launched_step)
        self.round = None

    # -- interface -----------------------------------------------------------------
    def after_step(self, step: int) -> None:
        self.steps += 1
        if self.world_size == 1:
            self._close_step(None)
            return
        clock = self.emulator.arrive()
        ready = None
        staleness = None
        r = self.round
        if r is not None:
            age = self.steps - r.launched_step
            if self._complete_now(r, clock):
                self._apply(r)
                staleness = age
            elif age >= self.staleness:
                ready = self._wait(r)
                self._apply(r)
                staleness = age
        if self.round is None:
            self._launch(max(clock, ready or 0.0), done=False)
        self._close_step(ready, staleness=staleness)

    def _final_exchange(self) -> None:
        ready = self._rounds_until_every_device_arrives(final=True, why="final averaging round")
        average_buffers(self.model, self.emulator, self.world_size, self.group)
        self.emulator.finish_step(ready, count=False)

    def settle(self, before: str) -> None:
        """Every device, before a collective outside this mode's rounds (``before``: evaluation, a
        checkpoint): the rounds in flight completed and applied, none left (docs/design/strategies.md,
        "Bounded staleness": Settling)."""
        # alone, finished, or settled at this step already (every device alike: the same step count)
        if self.world_size == 1 or self._devices is not None or self._settled_at == self.steps:
            return
        ready = self._rounds_until_every_device_arrives(final=False, why=f"averaging round before {before}")
        self.emulator.finish_step(ready, count=False)
        self._settled_at = self.steps

    def _rounds_until_every_device_arrives(self, final: bool, why: str) -> float | None:
        """Complete, apply and launch rounds flagged *arrived* until one shows every device's flag (the
        same round on every device: they all see its flags); the virtual time that round was ready."""
        self.emulator.start_step()
        clock = self.emulator.arrive()
        ready = None
        while True:
            if self.round is None:
                self._launch(max(clock, ready or 0.0), done=True)
            last = self.round
            ready = self._wait(last, why)
            arrived = self._all_done(last)
            self._apply(last, final=final and arrived)
            if arrived:
                return ready

    def _all_done(self, r: _Round) -> bool:
        return bool((r.clocks[self.world_size:] > 0.5).all())

    def state_dict(self) -> dict:
        """The mode's state, with no round in flight: every device settles first (every device checkpoints at
        the same step)."""
        self.settle("checkpoint")
        return {**super().state_dict(), "codec": self._codec_state(self.compressor, self.memory),
                "ref": self.ref.clone(), "steps": self.steps, "rounds": self.rounds,
                "staleness_seen": list(self.staleness_seen), "blocking_waits": self.blocking_waits}

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        self._load_codec_state(self.compressor, self.memory, state["codec"])
        self.ref = state["ref"].clone()
        self.steps, self.rounds, self.blocking_waits = state["steps"], state["rounds"], state["blocking_waits"]
        self.staleness_seen = list(state["staleness_seen"])

    def summary(self) -> dict:
        seen = self.staleness_seen
        return {**super().summary(), "staleness_bound": self.staleness, "rounds": self.rounds,
                "staleness_mean": sum(seen) / len(seen) if seen else None,
                "staleness_max": max(seen) if seen else None,
                "staleness_histogram": {str(k): seen.count(k) for k in sorted(set(seen))},
                "blocking_waits": self.blocking_waits}


def build(setup: SyncSetup) -> BoundedStaleness:
    """``--sync async:S``."""
    return BoundedStaleness(setup.model, setup.world_size, setup.emulator, setup.averaging(),
                            setup.spec.sync.staleness, **setup.common)
