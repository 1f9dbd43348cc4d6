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

Finishing. Devices may have launched different numbers of rounds when
training ends. Each round carries a *done* flag per device; in ``finish``
every device keeps completing and launching rounds with its flag set until a
round shows every flag set. All devices see the same round results, so they
stop on the same round, and the model of that round (no local progress left)
is the final one, identical everywhere.

Checkpoints hold ``ref``, the counters, the error-feedback memory and the
round in flight: ``state_dict`` waits for it to complete (bounded by
``--timeout``; every device checkpoints at the same step, so every device
has launched it) and keeps what ``_apply`` reads of it: the received sums or
payloads, the snapshot, the step it was launched at, its modelled time, and
of the launch clocks only their latest and whether every device was done
(so that a resume on another device count can apply it too). A resumed
device holds it as completed and applies it at the step the uninterrupted
one would have, so a resumed run equals an uninterrupted one where that step
does not depend on the host's timing: with ``async:1`` every round is
applied at the next step (tested), and with a larger bound whenever rounds
complete on the host before the device needs them.

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
from edgetrain.comm.compress.base import Compressor, Payload, unpack
from edgetrain.comm.emulation import LinkEmulator
from edgetrain.comm.exchange import start_exchange
from edgetrain.comm.params import average_buffers, flatten, unflatten
from edgetrain.comm.sync import SyncMode
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

    def __init__(self, model: nn.Module, world_size: int, rank: int, emulator: LinkEmulator, staleness: int,
                 compressor: Compressor, memory, group=None, clock_group=None, spec: str = "async",
                 compress: str = "none"):
        if staleness < 1:
            raise ValueError(f"staleness bound must be >= 1, got {staleness}")
        if not compressor.fixed_size:
            raise ValueError(f"{compressor.name} has a variable payload size; async mode needs a fixed one")
        super().__init__(model, world_size, emulator, clock_group, spec, compress)
        self.model = model
        self.rank = rank
        self.staleness = staleness
        self.compressor, self.memory = compressor, memory
        self.group = group
        self._start_together(model, group)
        self.ref = flatten(self.params)
        self.round: _Round | None = None
        self.steps = 0
        self.rounds = 0
        self.staleness_seen: list[int] = []
        self.blocking_waits = 0
        self.wait_real_s = 0.0
        self._watch(model)

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

    def _wait(self, r: _Round) -> float | None:
        """Block until round ``r`` is complete; return the virtual time it was (virtual mode)."""
        started = time.perf_counter()
        for w in r.works:
            wait(w, self.emulator.timeout_s, "asynchronous averaging round")
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

    def _apply(self, r: _Round, final: bool = False) -> bool:
        """Fold round ``r`` into the model; True if every device had finished training when it launched."""
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
        return bool((r.clocks[p:] > 0.5).all())

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
        self.emulator.start_step()
        clock = self.emulator.arrive()
        ready = None
        while True:
            if self.round is None:
                self._launch(max(clock, ready or 0.0), done=True)
            final_round = self.round
            ready = self._wait(final_round)
            if self._apply(final_round, final=self._all_done(final_round)):
                break
        average_buffers(self.model, self.emulator, self.world_size, self.group)
        self.emulator.finish_step(ready, count=False)

    def _all_done(self, r: _Round) -> bool:
        return bool((r.clocks[self.world_size:] > 0.5).all())

    def state_dict(self) -> dict:
        """The mode's state with the round in flight, completed first (see the module docstring)."""
        state = {**super().state_dict(), "codec": self._codec_state(self.compressor, self.memory),
                 "ref": self.ref.clone(), "steps": self.steps, "rounds": self.rounds,
                 "staleness_seen": list(self.staleness_seen), "blocking_waits": self.blocking_waits}
        r = self.round
        if r is not None:
            for work in r.works:
                wait(work, self.emulator.timeout_s, "asynchronous averaging round (checkpoint)")
            self._done_at(r)
            p = self.world_size
            state["round"] = {"buf": r.buf, "received": r.received, "snapshot": r.snapshot,
                              "numel": r.payload.numel, "ctx": r.payload.ctx, "launched_step": r.launched_step,
                              "modelled_s": r.modelled_s, "ready_clock_s": float(r.clocks[:p].max()),
                              "all_done": self._all_done(r)}
        return state

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        self._load_codec_state(self.compressor, self.memory, state["codec"])
        self.ref = state["ref"].clone()
        self.steps, self.rounds, self.blocking_waits = state["steps"], state["rounds"], state["blocking_waits"]
        self.staleness_seen = list(state["staleness_seen"])
        saved = state.get("round")
        if saved is not None:  # completed before it was saved: no collective left to wait for
            p = self.world_size
            clocks = torch.cat([torch.full((p,), saved["ready_clock_s"], dtype=torch.float64),
                                torch.full((p,), float(saved["all_done"]), dtype=torch.float64)])
            now = time.perf_counter()
            self.round = _Round([], saved["buf"], saved["received"], clocks, saved["snapshot"],
                                Payload((saved["buf"],), saved["numel"], self.segments, saved["ctx"]),
                                saved["launched_step"], saved["modelled_s"], now, done_at=now)

    def summary(self) -> dict:
        seen = self.staleness_seen
        return {**super().summary(), "staleness_bound": self.staleness, "rounds": self.rounds,
                "staleness_mean": sum(seen) / len(seen) if seen else None,
                "staleness_max": max(seen) if seen else None,
                "staleness_histogram": {str(k): seen.count(k) for k in sorted(set(seen))},
                "blocking_waits": self.blocking_waits}


def build(setup: SyncSetup) -> BoundedStaleness:
    """``--sync async:S``."""
    group = setup.averaging_group()
    compressor, memory = setup.compressor()
    return BoundedStaleness(setup.model, setup.world_size, setup.rank, setup.emulator, setup.spec.sync.staleness,
                            compressor, memory, group=group, **setup.common)
