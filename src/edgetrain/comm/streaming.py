"""Streaming DiLoCo (``--sync streaming:H``): the model in fragments, each averaged at its own step, in the
background.

DiLoCo (``local_sgd.py``) sends the whole model's pseudo-gradient every ``H`` steps and waits for it.
Streaming DiLoCo (Douillard et al., "Streaming DiLoCo with overlapping communication", 2025) splits the
parameters into ``F`` fragments (``fragment_bounds``), sends each at its own step of the period in a
non-blocking collective, and applies it ``T`` steps later (``overlap``) with the fragment's outer optimiser,
keeping ``A`` (``mix``) of the local fragment. With ``F = 1``, ``T = 0`` and ``A = 0`` it is DiLoCo step for step.

Design: docs/design/strategies.md ("Streaming DiLoCo"): the clock, finishing, checkpoints.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn

from edgetrain.cluster.peers import wait
from edgetrain.comm.compress.base import Payload, unpack
from edgetrain.comm.emulation import LinkEmulator
from edgetrain.comm.exchange import average, compress, start_exchange
from edgetrain.comm.local_sgd import OuterStep, outer_optimizer, outer_step
from edgetrain.comm.mode import Averaging, SyncMode
from edgetrain.comm.params import average_buffers, flatten, unflatten
from edgetrain.kinds import named_by_kind

if TYPE_CHECKING:
    from edgetrain.comm.setup import SyncSetup


def fragment_bounds(segments: tuple[int, ...], fragments: int) -> list[tuple[int, int]]:
    """``fragments`` runs of whole parameters (their lengths ``segments``), in order, as equal in size as
    cutting at parameter boundaries allows: the (first, end) parameter indices of each. A fragment gets at
    least one parameter, so there are at most ``len(segments)`` of them."""
    if not 1 <= fragments <= len(segments):
        raise ValueError(f"{fragments} fragments of a model with {len(segments)} parameter tensors; "
                         f"use fragments=1 to {len(segments)}")
    total = sum(segments)
    bounds, first, done = [], 0, 0
    for p in range(fragments):
        if p == fragments - 1:
            end = len(segments)
        else:
            target = total * (p + 1) / fragments
            end = first + 1  # at least one parameter
            while end < len(segments) - (fragments - 1 - p) and done + sum(segments[first:end + 1]) <= target:
                end += 1
        bounds.append((first, end))
        done += sum(segments[first:end])
        first = end
    return bounds


@dataclass
class _Exchange:
    """One fragment's exchange in flight (``works`` not yet waited for) or completed (``mean`` set)."""

    fragment: int
    due_step: int          # the local step count at which it is applied
    ready_s: float | None  # virtual clock at which it has arrived (virtual mode; set once the clocks are in)
    modelled_s: float
    works: list
    buf: torch.Tensor | None = None
    received: list[torch.Tensor] | None = None
    clocks: torch.Tensor | None = None
    numel: int = 0
    ctx: object = None
    mean: torch.Tensor | None = None
    done_at: float | None = None  # perf_counter() when the real collective completed (enforced mode)


@dataclass(frozen=True)
class Fragments:
    """How Streaming DiLoCo splits its exchanges: ``count`` fragments of the model, each applied ``overlap``
    inner steps after its exchange starts, keeping ``mix`` of the local fragment."""

    count: int = 1
    overlap: int = 0
    mix: float = 0.0


@named_by_kind("sync", builder="build")
class StreamingDiLoCo(SyncMode):
    """DiLoCo over ``fragments`` of the model, each exchanged at its own step of the period in the background
    and applied ``overlap`` steps later, keeping ``mix`` of the local fragment."""

    def __init__(self, model: nn.Module, world_size: int, emulator: LinkEmulator, averaging: Averaging, period: int,
                 split: Fragments, outer: OuterStep | None = None, **common):
        fragments, overlap, mix = split.count, split.overlap, split.mix
        outer = outer or OuterStep()
        if not 0 <= overlap < period:
            raise ValueError(f"overlap must be in [0, {period}), got {overlap}")
        if not averaging.compressor.fixed_size:
            raise ValueError(f"{averaging.compressor.name} has a variable payload size; streaming exchanges need a "
                             "fixed one")
        super().__init__(model, world_size, emulator, averaging, **common)
        self.period, self.overlap, self.mix = period, overlap, mix
        self.bounds = fragment_bounds(self.segments, fragments)
        self.offsets = [p * period // fragments for p in range(fragments)]
        self.refs = [flatten(self.params[a:b]).requires_grad_(True) for a, b in self.bounds]
        self.outers = [outer_optimizer(ref, outer.lr, outer.momentum) for ref in self.refs]
        self.local_steps = 0
        self.exchanges = 0                           # exchanges applied
        self.applied_at = [0] * fragments            # the local step count of each fragment's last application
        self.inflight: dict[int, _Exchange] = {}
        self.link_free_s = 0.0                       # virtual clock at which the link finishes its queued exchanges
        self.wait_s = 0.0                            # real seconds spent waiting for exchanges at apply steps

    # -- fragments --------------------------------------------------------------------
    def _fragment(self, p: int) -> list[nn.Parameter]:
        a, b = self.bounds[p]
        return self.params[a:b]

    def _segments(self, p: int) -> tuple[int, ...]:
        a, b = self.bounds[p]
        return self.segments[a:b]

    def launches(self, steps: int) -> list[int]:
        """The fragments sent at the end of the ``steps``-th local step."""
        return [p for p, offset in enumerate(self.offsets) if (steps + offset) % self.period == 0]

    # -- exchanges ----------------------------------------------------------------------
    def _launch(self, p: int, clock_s: float) -> None:
        delta = self.refs[p].detach() - flatten(self._fragment(p))
        payload, _ = compress(delta, self.compressor, self.memory, f"fragment{p}", None, self._segments(p))
        buf, received, kind, sent, work = start_exchange(payload, self.compressor, self.group, self.world_size)
        clocks = torch.tensor([clock_s], dtype=torch.float64)
        clock_work = dist.all_reduce(clocks, op=dist.ReduceOp.MAX, group=self.group, async_op=True)
        started = self.stats.launched(sent)
        x = _Exchange(p, self.local_steps + self.overlap, None, self.emulator.model_time(kind, sent),
                      [work, clock_work], buf, received, clocks, payload.numel, payload.ctx)

        def completed(_) -> None:
            if x.done_at is None:
                x.done_at = time.perf_counter()
                self.stats.finished(started)

        clock_work.get_future().add_done_callback(completed)
        self.inflight[p] = x

    def _complete(self, x: _Exchange) -> None:
        """Wait for ``x``'s collectives (bounded) and decode the mean; the wait is blocked time."""
        if x.mean is not None:
            return
        started = time.perf_counter()
        for w in x.works:
            wait(w, self.emulator.timeout_s, f"streaming exchange of fragment {x.fragment}")
        if x.done_at is None:
            x.done_at = time.perf_counter()
        segments = self._segments(x.fragment)
        if x.received is None:
            x.mean = self.compressor.decode(Payload((x.buf,), x.numel, segments, x.ctx)).div_(self.world_size)
        else:
            layout = self.compressor.layout(x.numel, x.buf.numel(), segments)
            x.mean = self.compressor.combine([self.compressor.decode(unpack(b, layout, x.numel, segments))
                                              for b in x.received])
        start = max(float(x.clocks.item()), self.link_free_s)  # exchanges queue on the link
        x.ready_s = self.link_free_s = start + x.modelled_s
        x.works, x.buf, x.received = [], None, None
        waited = time.perf_counter() - started
        self.emulator.blocked(waited)
        self.wait_s += waited

    def _apply(self, x: _Exchange, mix: float) -> float | None:
        """Fold the completed exchange ``x`` into its fragment; the virtual clock at which it arrived."""
        self._complete(x)
        if self.emulator.emulated and not self.emulator.virtual:  # enforced: the link takes Tc after completion
            remaining = x.done_at + x.modelled_s - time.perf_counter()
            if remaining > 0:
                time.sleep(remaining)
                self.emulator.blocked(remaining)
        p = x.fragment
        outer_step(self.refs[p], x.mean, self.outers[p])
        with torch.no_grad():
            fragment = self._fragment(p)
            mixed = self.refs[p].detach() if mix == 0 else mix * flatten(fragment) + (1 - mix) * self.refs[p].detach()
            unflatten(mixed, fragment)
        self.applied_at[p] = self.local_steps
        self.exchanges += 1
        del self.inflight[p]
        return x.ready_s if self.emulator.virtual else None

    # -- interface ---------------------------------------------------------------------
    def after_step(self, step: int) -> None:
        self.local_steps += 1
        launches = self.launches(self.local_steps) if self.world_size > 1 else []
        if launches:
            clock = self.emulator.arrive()
            for p in launches:
                self._launch(p, clock)
        ready = [self._apply(x, self.mix) for x in list(self.inflight.values()) if x.due_step == self.local_steps]
        if self.world_size == 1:  # one device: the fragments are its model, nothing to exchange
            self.applied_at = [self.local_steps] * len(self.bounds)
        clocks = [r for r in ready if r is not None]
        self._close_step(max(clocks) if clocks else None)

    def _final_exchange(self) -> None:
        self.emulator.start_step()
        ready = [self._apply(x, mix=0.0) for x in sorted(self.inflight.values(), key=lambda x: x.due_step)]
        arrived = self._max_clock(self.emulator.arrive())
        for p in range(len(self.bounds)):
            if self.local_steps > self.applied_at[p] or self.mix > 0:  # trained or mixed since its last exchange
                delta = self.refs[p].detach() - flatten(self._fragment(p))
                mean = average(delta, self.channel, key=f"fragment{p}", segments=self._segments(p))
                outer_step(self.refs[p], mean, self.outers[p])
                self.exchanges += 1
            unflatten(self.refs[p].detach(), self._fragment(p))
        average_buffers(self.model, self.emulator, self.world_size, self.group)
        clocks = [r for r in ready if r is not None] + [arrived]
        self.emulator.finish_step(max(clocks), count=False)

    def state_dict(self) -> dict:
        """The mode's state with the exchanges in flight completed first (design: Checkpoints)."""
        for x in self.inflight.values():
            self._complete(x)
        return {**super().state_dict(), "codec": self._codec_state(self.compressor, self.memory),
                "refs": [ref.detach().clone() for ref in self.refs],
                "outers": [outer.state_dict() for outer in self.outers],
                "local_steps": self.local_steps, "exchanges": self.exchanges, "applied_at": list(self.applied_at),
                "link_free_s": self.link_free_s, "wait_s": self.wait_s,
                "inflight": [{"fragment": x.fragment, "due_step": x.due_step, "ready_s": x.ready_s,
                              "modelled_s": x.modelled_s, "mean": x.mean} for x in self.inflight.values()]}

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        self._load_codec_state(self.compressor, self.memory, state["codec"])
        with torch.no_grad():
            for ref, saved in zip(self.refs, state["refs"], strict=True):
                ref.copy_(saved)
        for outer, saved in zip(self.outers, state["outers"], strict=True):
            outer.load_state_dict(saved)
        self.local_steps, self.exchanges = state["local_steps"], state["exchanges"]
        self.applied_at, self.link_free_s = list(state["applied_at"]), state["link_free_s"]
        self.wait_s = state["wait_s"]
        now = time.perf_counter()
        self.inflight = {x["fragment"]: _Exchange(x["fragment"], x["due_step"], x["ready_s"], x["modelled_s"], [],
                                                  mean=x["mean"], done_at=now) for x in state["inflight"]}

    def summary(self) -> dict:
        return {**super().summary(), "exchanges": self.exchanges, "fragments": len(self.bounds),
                "fragment_params": [sum(self._segments(p)) for p in range(len(self.bounds))],
                "overlap_steps": self.overlap, "exchange_wait_s": self.wait_s,
                "staleness_max_steps": self.period - 1}


def build(setup: SyncSetup) -> StreamingDiLoCo:
    """``--sync streaming:H[:fragments=F][:overlap=T][:mix=A][:lr=][:momentum=]``."""
    sync = setup.spec.sync
    split, outer = Fragments(sync.fragments, sync.overlap, sync.mix), OuterStep(sync.outer_lr, sync.outer_momentum)
    return StreamingDiLoCo(setup.model, setup.world_size, setup.emulator, setup.averaging(), sync.period, split, outer,
                           **setup.common)
