"""Checkpoints during a run, resuming from one, and stopping on SIGTERM with one.

What a checkpoint holds (``--checkpoint-every N`` steps and/or
``--checkpoint-every-s S`` seconds): at the start of every N-th step (or of
the first step after S seconds of rank 0's clock), before the batch is
taken, each device's

- ``Strategy.state_dict()``: the model and what the strategy keeps beside it
  (for data parallelism the sync mode's state: error-feedback residuals per
  parameter, compressor counters, local SGD's reference model and outer
  momentum, the device clock and byte counters; comm/sync.py);
- optimizer and learning-rate scheduler state;
- RNG states: torch (and the GPU's where the device has one), numpy, Python;
- the throttle's calibration (a resumed device does not measure again);
- its step records so far and the epoch's running totals;

and, once for the run, the step, the epoch and the batch within it (the
sampler's position: ``GlobalBatchSampler.resume_at``), the evaluations, the
wall time so far and the config.

Protocol. Every device serialises its state with ``torch.save`` into bytes;
rank 0 gathers them (a gloo all-gather of the lengths, then a gather of the
bytes padded to the longest) and writes one file,
``RUN_DIR/checkpoints/step-<step>.pt``, through ``report.files.save_torch``:
temporary file beside it, fsync, rename. A write killed half-way leaves the
previous checkpoints and at most a hidden temporary, never a partial
checkpoint. Then all but the newest ``--keep-checkpoints`` are removed.
Resuming, rank 0 reads the newest file and broadcasts its bytes; each device
takes its own entry (``torch.load(weights_only=True)``: tensors, numbers and
strings only), after removing the temporaries of writes a kill interrupted.
Rank 0 alone decides whether the run resumes: while checkpoints are on,
every device takes part in that broadcast, which carries no bytes for a new
run. With ``--resume`` under torchrun every node reads the run's
``config.yaml`` (so every node needs the run directory, e.g. on a shared file
system), and rank 0 alone reads the checkpoint.

Another number of devices. A checkpoint written by N devices resumes on M
(``--resume RUN_DIR --devices M``, or a torchrun restart with another node
count): every device takes device 0's model, strategy state, optimizer,
scheduler and step; the global batch stays what it was and is split again
over the M devices (``split_batch``), so the learning rate is unchanged and
the sampler's position, global samples seen / global batch, is the same
batch index of the same epoch's order. What belongs to one device and cannot
be mapped is dropped, in one line on rank 0: error-feedback residuals (each
is one device's unsent gradient; PowerSGD's too) and the RNG state of a
device that is gone (an added device keeps its fresh seeded one). The
epoch's running loss totals of all N go to rank 0, the step records of the
devices that are gone stay in ``metrics.jsonl`` (the checkpoint carries them
on as ``departed_records``), an added device takes device 0's throttle
calibration. At every resume rank 0 appends a line to ``membership.jsonl``
(step, wall time, devices before and after, torchrun's restart count). Refused before
any device starts: another count with ``--partition`` (each device's data is
its own). Exact where the devices computed the same as one would (with
``--batchnorm sync`` and no compression a run of 2 devices resumed on 1 ends
with the uninterrupted run's parameters, tested); otherwise a resumed run
differs from an uninterrupted one by what was dropped and by local
BatchNorm statistics over another split.

torchrun restarts. torchrun's elastic agent (``--max-restarts``, ``--nnodes
MIN:MAX``) stops and restarts every worker when a worker fails or a node
joins or leaves. Under torchrun with a rendezvous id (``TORCHELASTIC_RUN_ID``,
torchrun's ``--rdzv-id``; not its default ``none``) the run directory is
``OUTPUT/train-<run id>`` (or ``--run-name``), the same for every restart of
that job, and rank 0 continues it from its newest checkpoint whenever that
directory holds one (``elastic_run_dir``). A checkpoint present is the test,
not ``TORCHELASTIC_RESTART_COUNT > 0``: a node that joins later starts with
count 0, and the agent restarts workers for a membership change without
counting it. Only rank 0's node needs the directory (its ``resume`` is a
node-local key of the config check, cluster/peers.py); nodes that may become
rank 0 after a restart need the same ``--output`` on a shared file system,
else the new rank 0 starts a new run there. A run id names one run: the same
id later continues that run. Without checkpoints, or before the first, a
restart starts a new run in ``train-<run id>-2`` and so on, as before.

Exactness. Restoring all of the above at the same point of the loop makes a
resumed run compute what the uninterrupted one would have, step for step, in
a deterministic setting (CPU; augmentation is keyed by seed, epoch and
sample, data/datasets.py, so loader workers change nothing): the tests compare final
parameters for sync with top-k and error feedback and for local SGD.
An asynchronous round in flight at the checkpoint is completed and kept
(comm/asynchronous.py; tested with ``async:1``). PowerSGD's state (PyTorch's
``PowerSGDState``: P, Q, residuals, iteration, RNG) is kept by parameter, not
by DDP bucket, since the resumed run's first step runs on another bucket
layout (comm/compress/powersgd.py); tested. Not exact, by design or not yet: DDP lays its gradient buckets out anew after the first step (in the
order gradients became ready) and a resumed run's first step runs with the
initial layout, so with 3 or more devices gloo's ring all-reduce sums some
entries in another order in that step (float rounding; measured, 4 devices,
resumed at step 10 of 20: parameters within 6e-8 on digits and 1.3e-6 on
CIFAR-10 of the uninterrupted run's; with 2 devices the sum of two is
exact), and a compressor that selects across a whole bucket may pick
differently in that step.

SIGTERM. While checkpoints are on, SIGTERM no longer unwinds a device at
once: it sets a flag, and at the start of every step the devices all-reduce
their flags (8 bytes with rank 0's "S seconds have passed", outside the
counted traffic). At the first step where
any device has one, every device stops there together, a checkpoint is
written, then the summary, and the run ends with one line saying how to
resume (``resume_hint``). The all-reduce is what makes the devices agree on
the step; it keeps asynchronous devices within a step of each other.
"""
from __future__ import annotations

import io
import json
import os
import random
import re
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from edgetrain.comm.exchange import wait
from edgetrain.errors import EdgetrainError
from edgetrain.records import MembershipRecord
from edgetrain.report.files import remove_stale_temps, save_torch
from edgetrain.spec import CheckpointSpec

CHECKPOINT_DIR = "checkpoints"
_NAME = re.compile(r"step-(\d+)\.pt")


def checkpoint_files(run_dir: str | Path) -> list[Path]:
    """The run's checkpoints, oldest first (hidden temporaries of a killed write are not among them)."""
    folder = Path(run_dir) / CHECKPOINT_DIR
    found = [(int(m.group(1)), p) for p in folder.glob("step-*.pt") if (m := _NAME.fullmatch(p.name))]
    return [p for _, p in sorted(found)]


def checkpoint_step(path: Path) -> int:
    return int(_NAME.fullmatch(path.name).group(1))


def resume_hint(run_dir: str | Path) -> str:
    """The end of the line a stopped run prints: where its newest checkpoint is and how to continue."""
    files = checkpoint_files(run_dir)
    if not files:
        return f"no checkpoint was written; start it again (edgetrain train --config {run_dir}/config.yaml)"
    return f"checkpoint of step {checkpoint_step(files[-1])} written; resume with: edgetrain train --resume {run_dir}"


def check_resumable(run_dir: str | Path) -> None:
    """One line if ``run_dir`` has no checkpoint to continue from (before any device starts)."""
    if not checkpoint_files(run_dir):
        raise EdgetrainError(f"run {run_dir} has no checkpoint to resume from (it ran without --checkpoint-every, "
                             f"or stopped before its first); start it again with --checkpoint-every N")


def elastic_run_dir(output: str, run_name: str | None) -> Path | None:
    """Under torchrun with a rendezvous id: the run directory every restart of that torchrun job shares
    (``--run-name``, else ``train-<run id>``); None outside torchrun or with its default id ``none``."""
    run_id = os.environ.get("TORCHELASTIC_RUN_ID", "")
    if run_id in ("", "none"):
        return None
    return Path(output) / (run_name or "train-" + re.sub(r"[^A-Za-z0-9._-]", "_", run_id))


def check_resume_devices(run_dir: str | Path, devices: int, partitioned: bool) -> None:
    """One line if the run cannot go on with ``devices`` devices: with ``--partition`` each device's data
    is its own, so another device count would train on other data (before any device starts)."""
    if not partitioned:
        return
    written_by = _load(checkpoint_files(run_dir)[-1], mmap=True)["world"]
    if written_by != devices:
        raise EdgetrainError(f"the checkpoint in {run_dir} was written by {written_by} devices, each with its own "
                             f"partition of the data; resume it with --devices {written_by}")


def rng_state(device: torch.device) -> dict:
    state = np.random.get_state(legacy=False)
    out = {"torch": torch.get_rng_state(), "python": random.getstate(),
           "numpy": {"key": torch.from_numpy(state["state"]["key"].astype(np.int64)), "pos": state["state"]["pos"],
                     "has_gauss": state["has_gauss"], "gauss": state["gauss"]}}
    if device.type == "cuda":
        out["cuda"] = torch.cuda.get_rng_state(device)
    return out


def set_rng_state(state: dict | None, device: torch.device) -> None:
    if state is None:  # a device a resume with more devices added: it keeps its fresh seeded RNG
        return
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    n = state["numpy"]
    np.random.set_state({"bit_generator": "MT19937", "state": {"key": n["key"].numpy().astype(np.uint32),
                                                               "pos": n["pos"]},
                         "has_gauss": n["has_gauss"], "gauss": n["gauss"]})
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"], device)


def _to_bytes(obj: Any) -> torch.Tensor:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return torch.frombuffer(bytearray(buffer.getvalue()), dtype=torch.uint8)


def _from_bytes(data: torch.Tensor) -> Any:
    return _load(io.BytesIO(data.numpy().tobytes()))


class Checkpointer:
    """One device's part in checkpoints, resuming and stopping on SIGTERM (see the module docstring)."""

    def __init__(self, spec: CheckpointSpec, run_dir: str | None, rank: int, world: int, timeout_s: float):
        self.spec, self.rank, self.world, self.timeout_s = spec, rank, world, timeout_s
        self.run_dir = Path(run_dir) if run_dir else None
        self.stop_requested = False   # this device got SIGTERM
        self.stopped = False          # the devices agreed to stop: the run ends at this step
        self.saved_step: int | None = None
        self._last_save = time.monotonic()
        self.departed_records: list[dict] = []  # step records of devices a resume with fewer left behind

    def due(self, step: int, start_step: int) -> bool:
        """Whether a checkpoint is written before ``step`` (every device calls this at every step)."""
        if not self.spec.enabled:
            return False
        self.stopped, time_due = self._agree()
        every = self.spec.every_steps
        due = self.stopped or time_due or (every is not None and step > start_step and step % every == 0)
        return due and step != self.saved_step  # asked again at an epoch's end: that step is saved already

    def _agree(self) -> tuple[bool, bool]:
        """(stop, a timed checkpoint is due), the same on every device: any device's SIGTERM, rank 0's clock."""
        time_due = (self.rank == 0 and self.spec.every_s is not None
                    and time.monotonic() - self._last_save >= self.spec.every_s)
        flags = torch.tensor([int(self.stop_requested), int(time_due)], dtype=torch.int32)
        if self.world > 1:
            wait(dist.all_reduce(flags, op=dist.ReduceOp.MAX, async_op=True), self.timeout_s,
                 "checkpoint-flag all-reduce")
        return bool(flags[0]), bool(flags[1])

    def catch_sigterm(self) -> None:
        """While checkpoints are on, SIGTERM asks for a stop at the next step instead of unwinding now
        (until ``release_sigterm``)."""
        self._previous = None
        if self.spec.enabled and threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGTERM, self._request_stop)

    def _request_stop(self, signum, frame) -> None:
        self.stop_requested = True

    def release_sigterm(self) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)
            self._previous = None

    def save(self, step: int, run_state: dict, device_state: dict) -> None:
        """Every device: gather the devices' states on rank 0, which writes one file and prunes old ones."""
        self.saved_step, self._last_save = step, time.monotonic()
        mine = _to_bytes(device_state)
        states = [mine]
        if self.world > 1:
            size = torch.tensor([mine.numel()], dtype=torch.int64)
            sizes = [torch.empty_like(size) for _ in range(self.world)]
            wait(dist.all_gather(sizes, size, async_op=True), self.timeout_s, "checkpoint size all-gather")
            longest = int(max(s.item() for s in sizes))
            padded = torch.cat([mine, mine.new_zeros(longest - mine.numel())])
            received = [torch.empty_like(padded) for _ in range(self.world)] if self.rank == 0 else None
            wait(dist.gather(padded, received, dst=0, async_op=True), self.timeout_s, "checkpoint gather")
            states = [r[:int(n.item())] for r, n in zip(received, sizes)] if self.rank == 0 else []
        if self.rank != 0 or self.run_dir is None:
            return
        save_torch(self.run_dir / CHECKPOINT_DIR / f"step-{step:08d}.pt",
                   {**run_state, "world": self.world, "devices": [_from_bytes(s) for s in states],
                    "departed_records": self.departed_records})
        for old in checkpoint_files(self.run_dir)[:-self.spec.keep]:
            old.unlink(missing_ok=True)

    def load(self) -> tuple[dict | None, dict | None]:
        """Every device, before training: (the run's state, this device's state) from the newest checkpoint of
        the resumed run, or (None, None) for a new one. While checkpoints are on this is a collective even for
        a new run: rank 0 alone decides (under torchrun only its node may hold the run directory) and sends
        the checkpoint's bytes, none for a new run."""
        if not (self.spec.enabled or self.spec.resume_dir):
            return None, None
        loading = time.perf_counter()
        data = torch.empty(0, dtype=torch.uint8)
        if self.rank == 0 and self.spec.resume_dir:
            remove_stale_temps(Path(self.spec.resume_dir) / CHECKPOINT_DIR)  # a write the kill interrupted
            data = torch.frombuffer(bytearray(checkpoint_files(self.spec.resume_dir)[-1].read_bytes()),
                                    dtype=torch.uint8)
        if self.world > 1:
            size = torch.tensor([data.numel()], dtype=torch.int64)
            wait(dist.broadcast(size, src=0, async_op=True), self.timeout_s, "checkpoint size broadcast")
            if self.rank != 0:
                data = torch.empty(int(size.item()), dtype=torch.uint8)
            if data.numel():
                wait(dist.broadcast(data, src=0, async_op=True), self.timeout_s, "checkpoint broadcast")
        if not data.numel():
            return None, None
        state = _from_bytes(data)
        self.departed_records = list(state.get("departed_records", []))
        if state["world"] == self.world:
            mine = state["devices"][self.rank]
        else:
            mine, dropped = device_state_for(state["devices"], self.rank, self.world)
            self.departed_records += [r for d in state["devices"][self.world:] for r in d["records"]]
            if self.rank == 0:
                kept = "; dropped, as they belong to one device: " + ", ".join(dropped) if dropped else ""
                print(f"edgetrain: the checkpoint of step {state['step']} was written by {state['world']} devices, "
                      f"this run has {self.world}: every device starts from device 0's model, optimizer and "
                      f"scheduler, the global batch is re-split over {self.world} (learning rate unchanged){kept}",
                      file=sys.stderr, flush=True)
        if self.rank == 0 and self.run_dir is not None:
            record_membership(self.run_dir, state, self.world, time.perf_counter() - loading)
        return state, mine


def device_state_for(saved: list[dict], rank: int, world: int) -> tuple[dict, list[str]]:
    """Device ``rank``'s state, of ``world`` devices, from a checkpoint written by ``len(saved)`` devices,
    and what was dropped (the module docstring's "Another number of devices")."""
    first, own = saved[0], saved[rank] if rank < len(saved) else None
    strategy, residuals = _without_error_feedback(first["strategy"])
    dropped = ["error-feedback residuals"] if residuals else []
    gone = range(world, len(saved))
    if len(gone):
        dropped.append(f"the RNG state of device(s) {', '.join(map(str, gone))}")
    totals = [sum(d["epoch_totals"][i] for d in saved) for i in range(3)] if rank == 0 else [0.0, 0.0, 0.0]
    return {**first, "strategy": strategy, "rng": own["rng"] if own else None,
            "records": own["records"] if own else [], "epoch_totals": totals,
            "throttle": (own or first)["throttle"]}, dropped


def _without_error_feedback(state: Any) -> tuple[Any, bool]:
    """``state`` with every error-feedback store emptied (whether any held something). Every sync mode keeps
    its residuals under ``codec`` -> ``memory`` (comm/sync.py ``_codec_state``), PowerSGD under ``powersgd``
    -> ``errors`` (comm/compress/powersgd.py): residuals are one device's unsent gradient."""
    if not isinstance(state, dict):
        return state, False
    out, found = {}, False
    for key, value in state.items():
        if key == "codec" and isinstance(value, dict) and "memory" in value:
            found |= any(bool(store) for store in value["memory"].values())
            value = {**value, "memory": {store: {} for store in value["memory"]}}
        elif key == "powersgd" and isinstance(value, dict) and "errors" in value:
            found |= bool(value["errors"])
            value = {**value, "errors": {}}
        else:
            value, inner = _without_error_feedback(value)
            found |= inner
        out[key] = value
    return out, found


MEMBERSHIP_FILE = "membership.jsonl"


def record_membership(run_dir: Path, state: dict, world: int, took_s: float) -> None:
    """A ``MembershipRecord`` in ``membership.jsonl`` per resume (``--resume`` or a torchrun restart): the step
    the run goes on from, its wall time, which devices left or joined (by rank), how long the load took."""
    before = state["world"]
    kind = "leave" if world < before else "join" if world > before else "restart"
    record = MembershipRecord(wall_s=state["wall_s"], step=state["step"], kind=kind,
                              devices=list(range(min(world, before), max(world, before))), world=world,
                              state_from="checkpoint", took_s=round(took_s, 3),
                              cause="torchrun restart" if os.environ.get("TORCHELASTIC_RUN_ID") else "resume")
    append_membership(run_dir, record)


def append_membership(run_dir: str | Path, record: MembershipRecord) -> None:
    """One line of ``membership.jsonl``: every membership change, from a peer (train/elastic.py) or a resume."""
    with open(Path(run_dir) / MEMBERSHIP_FILE, "a", encoding="utf-8") as f:
        f.write(json.dumps(record.to_dict()) + "\n")


def _load(source, **options):
    """``torch.load(weights_only=True)`` of a checkpoint; an fsdp one holds DTensor shards, whose class the
    loader must know: imported here (0.6 s), not at every device's start (train/strategy.py imports fsdp lazily)."""
    import torch.distributed.tensor  # noqa: F401
    return torch.load(source, weights_only=True, **options)
