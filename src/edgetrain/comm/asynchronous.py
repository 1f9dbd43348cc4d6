"""Bounded-staleness asynchronous training: average in the background, wait only when too stale.

There is no parameter server: the devices average their models with
non-blocking collectives (``async_op=True``) while they keep training. One
averaging *round* is in flight per device at a time:

1. launch: snapshot the model ``s_i``, send ``s_i - ref`` (compressed, with
   error feedback) in a non-blocking all-reduce or all-gather, and go on
   training. ``ref`` is the result of the last round, identical on every
   device;
2. at every later step, if the round has completed, apply it::

       ref_new = ref + mean_j decode(s_j - ref)
       x       = x + (ref_new - s_i)      # the average, plus local progress since s_i

   and launch the next round at once;
3. a device whose round is ``s`` steps old (launched ``s`` steps ago) blocks
   until it completes (with a timeout). So a device never trains on
   information older than ``s`` steps, and never waits for a fresher one:
   a fast device runs up to ``s`` steps ahead of the slowest (stale
   synchronous parallel, Ho et al., NeurIPS 2013), and a slow link delays
   averages without stalling compute until the bound is hit.

Staleness statistics (steps between a round's launch and its application)
go into the summary.

Completion per mode. The real collective completes once every device has
launched the round. ``enforced``: the round is complete ``Tc`` (the link
model's time) after that, in wall time. ``virtual``: it is complete when the
device's clock reaches ``max(launch clocks) + Tc``; the launch clocks ride
along in a small float64 all-reduce (emulation bookkeeping, not counted as
traffic). A round that has not completed on the host yet counts as not
complete, so host scheduling can only delay an application, never skip
the bound.

Settling. Devices may have launched different numbers of rounds at any
moment: a device that applied round ``k`` launches ``k + 1`` at once, and
its peer may not have looked at ``k`` yet. So a device must never enter
another collective (evaluation's gathers, a checkpoint) with a round in
flight: it could wait there for a peer that waits, at its staleness bound,
for the round this device will never launch (a fast and a slow device did,
every time). Before evaluation and checkpoints, and in ``finish``, every
device calls ``settle``: it keeps completing and launching rounds with an
*arrived* flag set until a round shows every flag set. All devices see the
same round results, so they stop on the same round, with nothing in flight;
as no device trained since that round's launch, every device then holds its
average, the same model everywhere. ``finish`` also takes that model as final.

Checkpoints hold ``ref``, the counters and the error-feedback memory, taken
after settling (every device checkpoints at the same step), so there is no
round in flight to keep, and a resumed run equals an uninterrupted one with
the same checkpoints (tested with ``async:1``).

Compressors: any with a fixed payload size (all but ``threshold``, whose
length varies and would need a second, chained collective); PowerSGD and DGC
are gradient hooks and do not apply.
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
        self._settled_at: int | None = None  # the step count at the last settle (module docstring)

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
        checkpoint): the rounds in flight completed and applied, none left (module docstring, Settling)."""
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
