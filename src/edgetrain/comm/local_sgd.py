"""Local SGD (``--sync local:H``) and DiLoCo (``diloco:H``): every device trains alone for ``H`` steps, then the
devices average their models.

Every device keeps ``ref``, the model of the last average (the same on all devices); at an averaging step it
sends its pseudo-gradient ``ref - x`` through ``--compress`` (with error feedback), and the devices step
``ref`` with the mean: plain local SGD subtracts it (the mean of the models), DiLoCo takes an outer SGD step
with Nesterov momentum (``outer_step``). Every device then continues from ``ref``.

The ``H`` steps between two averages are a round; its members are every device, unless a round deadline
(``deadline.py``) leaves a late one out or federated rounds (``federated.py``) sample only some. A device that
is no member trains no step of the round (``trains``), and receives the members' mean.

Design: docs/design/strategies.md ("Local SGD, DiLoCo and rounds")
"""
from __future__ import annotations

import datetime as dt
import math
import time
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn

from edgetrain.cluster.peers import all_gather_json, wait
from edgetrain.comm.deadline import RoundDeadline, RoundReport, projected_round_time
from edgetrain.comm.emulation import LinkEmulator
from edgetrain.comm.exchange import average
from edgetrain.comm.mode import Averaging, SyncMode
from edgetrain.comm.params import average_buffers, flatten, unflatten
from edgetrain.kinds import named_by_kind
from edgetrain.spec import DeadlineSpec

if TYPE_CHECKING:
    from edgetrain.comm.setup import SyncSetup

ROUND_STATUSES = ("joined", "missed_deadline", "not_sampled")
# a round's only member under secure aggregation: the aggregate would be its own update, so the round is dropped
ALONE = "dropped_alone"


@torch.no_grad()
def outer_step(ref: torch.Tensor, pseudo_grad: torch.Tensor, outer: torch.optim.Optimizer | None) -> None:
    """DiLoCo's outer step on the flat reference ``ref``: plain local SGD subtracts the mean pseudo-gradient; with
    an outer optimiser (over ``[ref]``) it is that optimiser's step."""
    if outer is None:
        ref -= pseudo_grad
    else:
        ref.grad = pseudo_grad.to(ref.dtype)
        outer.step()
        ref.grad = None


@dataclass(frozen=True)
class OuterStep:
    """DiLoCo's outer optimiser (``outer_optimizer``): its learning rate and Nesterov momentum
    (``--sync diloco:H:lr=..:momentum=..``)."""

    lr: float = 0.7
    momentum: float = 0.9


def outer_optimizer(ref: torch.Tensor, lr: float, momentum: float) -> torch.optim.Optimizer:
    """DiLoCo's outer optimiser over the flat reference ``ref`` (which requires grad): SGD with Nesterov momentum;
    momentum 0 is a plain outer SGD step (torch refuses Nesterov without momentum)."""
    return torch.optim.SGD([ref], lr=lr, momentum=momentum, nesterov=momentum > 0)


@named_by_kind("sync", builder="build")
class LocalSGD(SyncMode):
    """Local SGD and DiLoCo (``outer``: the outer optimiser) in rounds of ``period`` steps, whose members
    (``sampled_ranks``, minus those past the deadline) average their pseudo-gradients ``ref - x``."""

    def __init__(self, model: nn.Module, world_size: int, emulator: LinkEmulator, averaging: Averaging, period: int,
                 outer: OuterStep | None = None, deadline: DeadlineSpec | None = None, **common):
        if period < 1:
            raise ValueError(f"local SGD period must be >= 1, got {period}")
        super().__init__(model, world_size, emulator, averaging, **common)
        self.period = period
        self.ref = flatten(self.params)
        self.outer = outer_optimizer(self.ref.requires_grad_(True), outer.lr, outer.momentum) if outer else None
        self.local_steps = 0
        self.averages = 0
        self.deadline = RoundDeadline(deadline) if deadline is not None else None
        self.round_start_s = self.emulator.virtual_s   # this device's clock when the current round began
        self.round_trained = 0                          # steps it trained in the current round
        self.stopped_early = False                      # it stopped for the deadline in the current round
        self.last_step_s = 0.0                          # compute time of its last trained step
        self.round_counts = dict.fromkeys(ROUND_STATUSES, 0)
        self._round_counts_all: list[dict] | None = None
        self._member_groups: dict[tuple[int, ...], object] = {}
        self._sitting_out = False

    # -- rounds ---------------------------------------------------------------------
    def sampled_ranks(self) -> list[int]:
        """The devices asked to train in the current round (federated rounds sample; local SGD asks all)."""
        return list(range(self.world_size))

    def trains(self, step: int) -> bool:
        """Whether this device trains this step: it is sampled for the round and not past its deadline."""
        train = self.rank in self.sampled_ranks() and not self.stopped_early
        if train and self.deadline is not None:
            elapsed = self.emulator.virtual_s - self.round_start_s
            self.stopped_early = elapsed + self.last_step_s > self.deadline.seconds  # would not finish in time
            train = not self.stopped_early
        self._sitting_out = not train
        return train

    def after_step(self, step: int) -> None:
        trained, self._sitting_out = not self._sitting_out, False
        self.local_steps += 1
        self.round_trained += trained
        if self.local_steps % self.period != 0:
            self._close_step(None, local_steps=self.local_steps % self.period)
        else:
            status, ready = self._end_round(self.period)
            self._close_step(ready, local_steps=0, round_status=status)
            self.round_start_s = self.emulator.virtual_s
        if trained:
            self.last_step_s = self.emulator.last_step["compute_s"]

    def _end_round(self, length: int) -> tuple[str, float]:
        """Agree on the round's members, average their updates; (this device's round status, ready clock)."""
        sampled = self.sampled_ranks()
        arrived = self.emulator.arrive()
        if self.deadline is None:
            members, ready = sampled, self._max_clock(arrived)
        else:
            mine = (projected_round_time(arrived - self.round_start_s, self.round_trained, length, self.last_step_s)
                    if self.rank in sampled else 0.0)
            report = self._report(arrived, self.rank in sampled and not self.stopped_early, mine)
            members = [r for r in sampled if report.on_time[r]]
            self.deadline.observe([report.round_times[r] for r in sampled])
            ready = max(report.clocks)
        alone = self.secure is not None and len(members) == 1
        self._average([] if alone else members)
        status = (ALONE if alone and self.rank in members else "joined" if self.rank in members
                  else "missed_deadline" if self.rank in sampled else "not_sampled")
        self.round_counts[status] = self.round_counts.get(status, 0) + 1
        self.round_trained, self.stopped_early = 0, False
        return status, ready

    def _report(self, clock_s: float, on_time: bool, round_time_s: float) -> RoundReport:
        """Every device's clock, whether it made the deadline and its round time (see deadline.py)."""
        vector = RoundReport.mine(self.rank, self.world_size, clock_s, on_time, round_time_s)
        if self.world_size > 1:
            started = time.perf_counter()
            wait(dist.all_reduce(vector, group=self.clock_group, async_op=True), self.emulator.timeout_s,
                 "round report all-reduce")
            self.emulator.blocked(time.perf_counter() - started)
        return RoundReport.from_vector(vector, self.world_size)

    def _members_group(self, members: list[int]):
        """The process group of a round's members; every device calls this, in the same round order."""
        if len(members) == self.world_size:
            return self.group
        key = tuple(members)
        if key not in self._member_groups:
            self._member_groups[key] = dist.new_group(list(key), backend="gloo",
                                                      timeout=dt.timedelta(seconds=self.emulator.timeout_s))
        return self._member_groups[key]

    def _members_mean(self, x: torch.Tensor, members: list[int], key: str) -> torch.Tensor | None:
        """The mean of the members' ``x`` on every device (None if the round has no member); see
        docs/design/strategies.md ("Rounds and their members")."""
        if not members:
            return None
        group = self._members_group(members)
        mean = None
        if self.rank in members:
            peers = None if group is self.group else members
            mean = average(x, replace(self.channel, group=group, peers=peers), key=key, segments=self.segments)
        others = [r for r in range(self.world_size) if r not in members]
        if not others:
            return mean
        if self.rank == members[0]:
            started = time.perf_counter()
            for r in others:
                wait(dist.isend(mean, self._global_rank(r), group=self.group), self.emulator.timeout_s,
                     f"sending the round's mean to device {r}")
            self.emulator.blocked(time.perf_counter() - started)
        elif mean is None:
            mean = torch.empty_like(x, dtype=torch.float32)
            started = self.emulator.begin()
            wait(dist.irecv(mean, self._global_rank(members[0]), group=self.group), self.emulator.timeout_s,
                 f"the round's mean from device {members[0]}")
            nbytes = mean.numel() * mean.element_size()
            self.emulator.end(started, [("p2p", nbytes)], peers=[self.rank], bytes_recv=nbytes,
                              download=True)
        return mean

    def _average(self, members: list[int]) -> None:
        pseudo_grad = self._members_mean(self.ref.detach() - flatten(self.params), members, "params")
        if pseudo_grad is not None:
            outer_step(self.ref, pseudo_grad, self.outer)
        unflatten(self.ref.detach(), self.params)
        self.averages += 1

    def _final_exchange(self) -> None:
        self.emulator.start_step()
        leftover = self.local_steps % self.period  # steps since the last average: one more round
        ready = self._end_round(leftover)[1] if leftover else self._max_clock(self.emulator.arrive())
        average_buffers(self.model, self.emulator, self.world_size, self.group, self.secure)
        self.emulator.finish_step(ready, count=False)
        self._round_counts_all = (all_gather_json(self.round_counts, group=self.clock_group)
                                  if self.world_size > 1 else [self.round_counts])

    def state_dict(self) -> dict:
        return {**super().state_dict(), "codec": self._codec_state(self.compressor, self.memory),
                "ref": self.ref.detach().clone(), "outer": self.outer.state_dict() if self.outer else None,
                "local_steps": self.local_steps, "averages": self.averages,
                "round": {"start_s": self.round_start_s, "trained": self.round_trained,
                          "stopped_early": self.stopped_early, "last_step_s": self.last_step_s,
                          "counts": dict(self.round_counts),
                          "deadline": self.deadline.state_dict() if self.deadline else None}}

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        self._load_codec_state(self.compressor, self.memory, state["codec"])
        with torch.no_grad():
            self.ref.copy_(state["ref"])
        if self.outer is not None:
            self.outer.load_state_dict(state["outer"])
        self.local_steps, self.averages = state["local_steps"], state["averages"]
        rounds = state["round"]
        self.round_start_s, self.round_trained = rounds["start_s"], rounds["trained"]
        self.stopped_early, self.last_step_s = rounds["stopped_early"], rounds["last_step_s"]
        self.round_counts = dict(rounds["counts"])
        if self.deadline is not None:
            self.deadline.load_state_dict(rounds["deadline"])

    def summary(self) -> dict:
        out = {**super().summary(), "averages": self.averages, "staleness_max_steps": self.period - 1,
               "round_deadline": self.deadline.spec.text if self.deadline else None}
        if self.deadline is not None and self.deadline.spec.seconds is None:
            out["round_deadline_last_s"] = self.deadline.seconds if math.isfinite(self.deadline.seconds) else None
        if self._round_counts_all is not None:
            out["round_participation"] = self._round_counts_all  # per device: rounds joined / missed / not sampled
        return out


def build(setup: SyncSetup) -> LocalSGD:
    """``--sync local:H[:nesterov...]``."""
    sync = setup.spec.sync
    outer = OuterStep(sync.outer_lr, sync.outer_momentum) if sync.nesterov else None
    return LocalSGD(setup.model, setup.world_size, setup.emulator, setup.averaging(masked=True), sync.period, outer,
                    deadline=setup.spec.round_deadline, **setup.common)
