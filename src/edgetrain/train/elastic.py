"""Elastic membership of emulated devices, the devices' side (``--min-devices K``).

At each step boundary the members agree on the launcher's membership counter; on a change they
re-form the gloo group, rebuild the strategy and load the start-of-step state from a live peer.

Design: docs/design/elastic.md
"""
from __future__ import annotations

import io
import json
import os
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from edgetrain.cluster.membership import (CHANGES_KEY, JOIN_ENV, LOST_KEY, admitted_key, group_prefix, join_key,
                                          members_key, request_key)
from edgetrain.cluster.peers import broadcast_bytes, check_rank_environment, cut_connections, wait
from edgetrain.cluster.profiles import DeviceSpec
from edgetrain.errors import EdgetrainError
from edgetrain.records import EvalRecord, MembershipRecord, StepRecord
from edgetrain.spec import RunSpec
from edgetrain.train.checkpoint import MEMBERSHIP_FILE, append_membership

_OWN_COUNTERS = ("clock", "tally")  # sync mode state each device keeps for itself (its bytes, its clock)
_WATCH_EVERY_S = 0.2  # how often the watcher reads the launcher's count of lost devices


class MembershipChanged(Exception):
    """The members agreed at a step boundary that the device set changes (a device joins or left)."""


class Elastic:
    """One device's part in an elastic run; the protocol is in docs/design/elastic.md."""

    failures = (RuntimeError, EdgetrainError, MembershipChanged)
    reports_anywhere = True  # rank 0 may leave: every device counts the FLOPs the summary needs

    def __init__(self, spec: RunSpec, devices: list[DeviceSpec], local_batches: list[int], run_dir: str | None):
        self.spec, self.devices, self.run_dir = spec, devices, run_dir
        self.device_id, world = check_rank_environment()
        self.members = list(range(world))
        self.joined: list[int] = []
        self.generation = self.seen = 0
        self.lost_seen = 0  # the launcher's count of lost devices when this generation was decided
        self._forming = threading.Lock()  # held by reform; the watcher never cuts a group being formed
        self.joining = os.environ.get(JOIN_ENV) == "1"
        self.joined_at = 0  # a returning device: the step it received the state at
        self.local_batches = list(local_batches)
        self.snapshot = b""
        self.strategy = None  # the loop's objects, from ``start``
        self.store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                                   timeout=timedelta(seconds=spec.timeout_s))

    @property
    def rank(self) -> int:
        return self.members.index(self.device_id)

    @property
    def world(self) -> int:
        return len(self.members)

    @property
    def faults(self):
        """The run's injected faults; a returning device skips those up to the step it rejoined at."""
        return tuple(f for f in self.spec.faults if not self.joining or f.step > self.joined_at)

    # -- a returning device -------------------------------------------------------------
    def join(self) -> tuple[int, int]:
        """Announce this device and wait to be admitted at the members' next step; (rank, world)."""
        self.store.set(join_key(self.device_id), "1")
        self.store.add(CHANGES_KEY, 1)
        self._await(admitted_key(self.device_id), 2 * self.spec.timeout_s + 60,
                    "was not admitted back by the devices that went on")
        self._decided(int(self.store.get(admitted_key(self.device_id))))
        self._connect()
        return self.rank, self.world

    def start(self, run) -> None:
        """Before the first step of ``run`` (train/loop.py's ``DeviceRun``): what a change needs from the loop
        (its strategy, optimizer, scheduler, sampler, loader); a returning device also receives the current
        state here (step, epoch, evaluations, into ``run.state``)."""
        self.strategy, self.optimizer, self.scheduler, self.sampler, self.loader = (
            run.strategy, run.optimizer, run.scheduler, run.sampler, run.loader)
        threading.Thread(target=self._watch, name="edgetrain-elastic-watcher", daemon=True).start()
        if not self.joining:
            return
        state = self._receive(self._own_counters())
        self.joined_at = state["step"]
        self.sampler.resume_at(state["epoch"], state["step"] - state["epoch"] * len(self.sampler))
        run.state.step, run.state.epoch = state["step"], state["epoch"]
        run.state.evals = [EvalRecord.from_dict(e) for e in state["evals"]]

    # -- every step -----------------------------------------------------------------------
    def boundary(self, step: int, epoch: int, evals: list[EvalRecord]) -> None:
        """Keep the snapshot of the start of ``step`` (first: a failure in the check below restores it too),
        then agree on the change counter and raise ``MembershipChanged`` if it moved."""
        buffer = io.BytesIO()
        torch.save({"strategy": self.strategy.state_dict(), "optimizer": self.optimizer.state_dict(),
                    "scheduler": self.scheduler.state_dict(), "step": step, "epoch": epoch,
                    "evals": [e.to_dict() for e in evals]}, buffer)
        self.snapshot = buffer.getvalue()
        changes = torch.tensor([self.store.add(CHANGES_KEY, 0)], dtype=torch.int64)
        if self.world > 1:
            wait(dist.all_reduce(changes, op=dist.ReduceOp.MAX, async_op=True), self.spec.timeout_s,
                 "membership check")
        if int(changes.item()) > self.seen:
            raise MembershipChanged()

    def reform(self, error: BaseException, epoch: int):
        """A new generation after ``error``; the sender's state of the start of its step restored on all.
        Returns the loop's new (rank, world, local batches, batch iterator, step)."""
        with self._forming:
            return self._reform(error, epoch)

    def _reform(self, error: BaseException, epoch: int):
        noticed = time.perf_counter()
        before = list(self.members)
        own = self._own_counters()
        while True:
            if dist.is_initialized():
                dist.destroy_process_group()
            self.store.set(request_key(self.generation + 1, self.device_id), "1")
            self._await(members_key(self.generation + 1), 2 * self.spec.timeout_s,
                        "got no answer from the launcher about the devices that go on")
            self._decided(self.generation + 1)
            try:
                self._connect()
                state = self._receive(own)
                break
            except self.failures:  # lost another device while forming this one: the next generation
                continue
        if self.members == before and not (self.left or self.joined) and not isinstance(error, MembershipChanged):
            # nobody left or came: not a departure but an error of its own (a device that left and is back
            # within one generation, noticed late, leaves the list unchanged but is a change)
            raise error
        step = state["step"]  # the same as this device's unless it finished the step before a peer noticed
        if state["epoch"] != epoch:
            raise EdgetrainError(f"{self.devices[self.device_id].label} was at epoch {epoch + 1} when device(s) "
                                 f"{self.left} left, its peers at epoch {state['epoch'] + 1}; start the run again")
        self.sampler.reshard(self.local_batches, self.rank)
        self.sampler.resume_at(epoch, step - epoch * len(self.sampler))
        self._record(step, time.perf_counter() - noticed)
        return self.rank, self.world, self.local_batches, iter(self.loader), step

    # -- the end ---------------------------------------------------------------------------
    def all_records(self, gathered: list[list[dict]] | None = None) -> list[StepRecord]:
        """Every device's step records, departed ones and earlier lives of returning ones included (from the
        run directory's per-device files, which each device flushes every step; not ``gathered``)."""
        files = [Path(self.run_dir) / f"metrics-{d}.jsonl" for d in range(len(self.devices))]
        return [StepRecord.from_dict(json.loads(line)) for f in files if f.exists()
                for line in f.read_text().splitlines() if line.strip()]

    def history(self) -> list[MembershipRecord]:
        path = Path(self.run_dir) / MEMBERSHIP_FILE
        lines = path.read_text().splitlines() if path.exists() else []
        return [MembershipRecord.from_dict(json.loads(line)) for line in lines if line.strip()]

    # -- inside --------------------------------------------------------------------------
    def _await(self, key: str, timeout_s: float, what: str) -> None:
        try:
            self.store.wait([key], timedelta(seconds=timeout_s))
        except (RuntimeError, dist.DistStoreError) as e:
            raise EdgetrainError(f"{self.devices[self.device_id].label} {what} within {timeout_s:g} s "
                                 f"({str(e).splitlines()[0]}); raise --timeout if the devices are slow") from None

    def _watch(self) -> None:
        """The watcher thread: cut this device's gloo connections when the launcher reports a member lost
        after this generation was decided (docs/design/elastic.md). Ends with the run's store."""
        port = int(os.environ["MASTER_PORT"])
        store = dist.TCPStore(os.environ["MASTER_ADDR"], port, is_master=False,
                              timeout=timedelta(seconds=self.spec.timeout_s))  # its own client: not thread-safe
        cut_for = 0
        while True:
            time.sleep(_WATCH_EVERY_S)
            try:
                lost = int(store.add(LOST_KEY, 0))
            except (RuntimeError, dist.DistStoreError):  # the launcher closed the store: the run is over
                return
            with self._forming:
                if lost > max(self.lost_seen, cut_for):
                    cut_for = lost
                    cut_connections(keep_port=port)

    def _decided(self, generation: int) -> None:
        """The launcher's member list for ``generation`` (this device must be on it) and the new split."""
        decided = json.loads(self.store.get(members_key(generation)))
        self.generation, self.members = generation, decided["members"]
        self.left, self.joined, self.seen = decided["left"], decided["joined"], decided["changes"]
        self.lost_seen = decided["lost"]
        if self.device_id not in self.members:
            raise EdgetrainError(f"{self.devices[self.device_id].label} was left out of the devices that go on")
        self.local_batches = decided["local_batches"]

    def _connect(self) -> None:
        """Form the generation's group; the strategy is set up on it again (a returning device sets its own up)."""
        dist.init_process_group("gloo", store=dist.PrefixStore(group_prefix(self.generation), self.store),
                                rank=self.rank, world_size=self.world, timeout=timedelta(seconds=self.spec.timeout_s))
        if self.strategy is not None:
            self.strategy.rebuild(self.rank, self.world, self.local_batches[self.rank])

    def _source(self) -> int:
        """The rank that sends the state: the first member that was already training."""
        return next(r for r, d in enumerate(self.members) if d not in self.joined)

    def _receive(self, own: dict) -> dict:
        """The sender's snapshot, loaded by every member (keeping each device's own counters)."""
        payload = broadcast_bytes(self.snapshot, self._source(), self.spec.timeout_s, "state from a peer")
        state = torch.load(io.BytesIO(payload), weights_only=True)
        state["strategy"].get("sync", {}).update(own)
        self.strategy.load_state_dict(state["strategy"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        return state

    def _own_counters(self) -> dict:
        sync = self.strategy.state_dict().get("sync", {})
        return {k: sync[k] for k in _OWN_COUNTERS if k in sync}

    def _record(self, step: int, took_s: float) -> None:
        """The sender's record and line for each kind of change (one change may bring both)."""
        if self.rank != self._source():
            return
        for kind, which in (("leave", self.left), ("join", self.joined)):
            if not which:
                continue
            record = MembershipRecord(wall_s=time.time(), step=step, kind=kind, devices=which, world=self.world,
                                      state_from="peer", took_s=took_s)
            if self.run_dir:
                append_membership(self.run_dir, record)
            names = ", ".join(f"device {d} ({self.devices[d].profile.name})" for d in which)
            verb, goes = ("left", "go on") if kind == "leave" else ("joined", "train")
            print(f"edgetrain: {names} {verb} at step {step}; {self.world} of {len(self.devices)} devices {goes} "
                  f"(min {self.spec.min_devices}); re-formed in {took_s:.1f} s", file=sys.stderr, flush=True)


class FailStop:
    """The membership of a run without ``--min-devices``: the devices it started with, to its end. A lost
    device stops the run (the launcher does), so nothing changes here: the loop calls it as it calls
    ``Elastic``, and every call is a no-op."""

    failures: tuple[type[BaseException], ...] = ()   # nothing is re-formed: ``except ()`` catches nothing
    joining = False
    reports_anywhere = False   # rank 0 stays rank 0 (an elastic run's rank 0 may move: every device counts FLOPs)

    def __init__(self, spec: RunSpec, local_batches: list[int]):
        self.faults, self.local_batches = spec.faults, list(local_batches)
        self.timeout_s = spec.timeout_s

    def start(self, run) -> None:
        """Every device starts its first step at the same moment. Each is ready at its own time (on a slow link
        the initial model reaches the devices one after another, seconds apart), and without a link to emulate
        a device's clock is its own steps' wall time: the first device ready would count its wait for the last
        at their first exchange as training time, which the virtual clock (every device from 0) does not.
        (``Elastic`` needs no barrier: its check before every step is a collective.)"""
        if dist.is_initialized() and dist.get_world_size() > 1:
            wait(dist.barrier(async_op=True), self.timeout_s, "start of training")

    def boundary(self, step: int, epoch: int, evals: list[EvalRecord]) -> None:
        """Every device starts every step: nothing to agree on."""

    def all_records(self, gathered: list[list[dict]]) -> list[StepRecord]:
        """Every device's step records: ``gathered`` from the devices (and the departed ones of a resume)."""
        return [StepRecord.from_dict(r) for records in gathered for r in records]

    def history(self) -> list[MembershipRecord]:
        return []
