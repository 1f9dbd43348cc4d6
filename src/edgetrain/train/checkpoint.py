"""Checkpoints during a run, resuming from one, and stopping on SIGTERM with one.

Every device's state is gathered to rank 0 into one atomically written file; pooled strategies
(pipeline, fsdp) write each device's own part with torch.distributed.checkpoint instead.
``load_checkpoint`` reads either back whole in one process.

Design: docs/design/checkpoint.md
"""
from __future__ import annotations

import contextlib
import inspect
import io
import json
import os
import random
import re
import shutil
import signal
import sys
import threading
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from edgetrain.cluster.peers import all_gather_json
from edgetrain.comm.exchange import wait
from edgetrain.errors import EdgetrainError
from edgetrain.files import atomic_write, remove_stale_temps
from edgetrain.records import MembershipRecord
from edgetrain.spec import CheckpointSpec
from edgetrain.tasks.base import sum_totals

# Imported inside functions: torch.distributed.checkpoint and torch.distributed.tensor (about a second of a process's
# start; only pooled runs' checkpoints need them).

CHECKPOINT_DIR = "checkpoints"
FINAL_FILE = "checkpoint.pt"  # the final model of a run whose devices each hold all of it
FINAL_DIR = "checkpoint"      # the final model of a pooled run (pipeline, fsdp): every device's part
RUN_FILE = "run.pt"           # in a directory of parts: the run's state, written by rank 0 last
_NAME = re.compile(r"step-(\d+)(\.pt)?")
_PARTS_TEMPORARY = ".tmp"     # .step-<N>.tmp/, .checkpoint.tmp/: parts being written, renamed when all are there


def save_torch(path: str | os.PathLike, obj: Any) -> None:
    """``torch.save`` through ``files.atomic_write``: the old file or the new one, never half of one."""
    with atomic_write(path, "wb") as f:
        torch.save(obj, f)


def checkpoint_files(run_dir: str | Path) -> list[Path]:
    """The run's checkpoints, oldest first: ``step-<N>.pt`` files, or ``step-<N>/`` directories of the
    devices' parts (a pooled strategy's); the hidden temporaries of a killed write are not among them."""
    folder = Path(run_dir) / CHECKPOINT_DIR
    found = [(int(m.group(1)), p) for p in folder.glob("step-*")
             if (m := _NAME.fullmatch(p.name)) and bool(m.group(2)) != p.is_dir()]
    return [p for _, p in sorted(found)]


def device_file(rank: int) -> str:
    """In a directory of parts: device ``rank``'s own small state (``torch.save``, read with weights_only)."""
    return f"device-{rank}.pt"


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
    newest = checkpoint_files(run_dir)[-1]
    parts = newest.is_dir()  # a pooled strategy's: each device wrote its own part
    if not (partitioned or parts):
        return
    written_by = (_load(newest / RUN_FILE) if parts else _load(newest, mmap=True))["world"]
    if written_by != devices:
        held = "its own part of the model (pipeline or fsdp)" if parts else "its own partition of the data"
        raise EdgetrainError(f"the checkpoint in {run_dir} was written by {written_by} devices, each with {held}; "
                             f"resume it with --devices {written_by}")


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
    """One device's part in checkpoints, resuming and stopping on SIGTERM (docs/design/checkpoint.md)."""

    def __init__(self, spec: CheckpointSpec, run_dir: str | None, rank: int, world: int, timeout_s: float):
        self.spec, self.rank, self.world, self.timeout_s = spec, rank, world, timeout_s
        self.run_dir = Path(run_dir) if run_dir else None
        self.stop_requested = False   # this device got SIGTERM (or SIGINT)
        self.stop_signal = signal.SIGTERM  # which (a stop a peer asked for is said as SIGTERM)
        self._previous: dict = {}     # the handlers catch_sigterm replaced
        self.stopped = False          # the devices agreed to stop: the run ends at this step
        self.saved_step: int | None = None
        self._last_save = time.monotonic()
        self.departed_records: list[dict] = []  # step records of devices a resume with fewer left behind
        self._shared: Path | None = None  # pooled strategies: the run directory every device writes its part into

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
        """While checkpoints are on, SIGTERM (and SIGINT where this process does not ignore it: a device under
        torchrun; an emulated device leaves Ctrl-C to its launcher) asks for a stop at the next step instead of
        unwinding now (until ``release_sigterm``)."""
        self._previous = {}
        if self.spec.enabled and threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                if sig == signal.SIGTERM or signal.getsignal(sig) is not signal.SIG_IGN:
                    self._previous[sig] = signal.signal(sig, self._request_stop)

    def _request_stop(self, signum, frame) -> None:
        self.stop_requested = True
        self.stop_signal = signum

    def release_sigterm(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}

    def save(self, step: int, run_state: dict, device_state: dict, sharded: dict | None = None) -> None:
        """Every device: gather the devices' states on rank 0, which writes one file and prunes old ones; or,
        with ``sharded`` (a pooled strategy's ``sharded_state``), every device writes its own part."""
        self.saved_step, self._last_save = step, time.monotonic()
        if sharded is not None:
            self._save_parts(step, run_state, device_state, sharded)
            return
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
        self._prune()

    def _prune(self) -> None:
        for old in checkpoint_files(self.run_dir)[:-self.spec.keep]:
            _remove(old)

    def _save_parts(self, step: int, run_state: dict, device_state: dict, sharded: dict) -> None:
        """A pooled strategy's checkpoint: ``checkpoints/step-<step>/``, every device's part (docs/design/checkpoint.md)."""
        if self._shared is None:
            self._shared = shared_run_dir(self.run_dir, self.world)
        if self._shared is None:  # rank 0 has no run directory (a test's Checkpointer): nothing is written
            return
        tensors, rest = split_sharded(sharded)
        write_parts(self._shared / CHECKPOINT_DIR / f"step-{step:08d}", tensors, {**device_state, "sharded": rest},
                    {**run_state, "world": self.world, "departed_records": self.departed_records, "parts": True},
                    Writers(self.rank, self.world, self.timeout_s))
        if self.rank == 0:
            self._prune()

    def load_sharded(self, strategy, optimizer, mine: dict) -> None:
        """Every device of a resumed pooled run, after ``setup`` and with its optimizer built: this device's part
        of the model and optimizer read back from the checkpoint's directory (DCP, a collective) into place."""
        import torch.distributed.checkpoint as dcp

        template = strategy.sharded_state(optimizer)  # this device's tensors, as they are laid out now
        tensors, _ = split_sharded(template)
        _check_dcp()
        with _one_process():
            dcp.load(tensors, storage_reader=dcp.FileSystemReader(mine["parts_dir"]),
                     no_dist=not _distributed(self.world))
        strategy.load_sharded_state({part: {**tensors.get(part, {}), **mine["sharded"].get(part, {})}
                                     for part in template}, optimizer)

    def load(self) -> tuple[dict | None, dict | None]:
        """Every device, before training: (the run's state, this device's state) from the newest checkpoint of
        the resumed run, or (None, None) for a new one. While checkpoints are on this is a collective even for
        a new run: rank 0 alone decides (under torchrun only its node may hold the run directory) and sends
        the checkpoint's bytes, none for a new run."""
        if not (self.spec.enabled or self.spec.resume_dir):
            return None, None
        loading = time.perf_counter()
        data = torch.empty(0, dtype=torch.uint8)
        stood_since = None
        if self.rank == 0 and self.spec.resume_dir:
            stood_since = last_activity(self.spec.resume_dir)  # before this life writes anything there
            folder = Path(self.spec.resume_dir) / CHECKPOINT_DIR
            remove_stale_temps(folder)  # a write the kill interrupted
            remove_stale_parts(folder)
            newest = checkpoint_files(self.spec.resume_dir)[-1]
            if newest.is_dir():  # every device's part: rank 0 sends the run's state and where the parts are
                data = _to_bytes({**_load(newest / RUN_FILE), "parts_dir": str(newest.resolve())})
            else:
                data = torch.frombuffer(bytearray(newest.read_bytes()), dtype=torch.uint8)
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
        if state.get("parts"):
            mine = self._own_part(state)
        elif state["world"] == self.world:
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
            record_membership(self.run_dir, state, self.world, time.perf_counter() - loading,
                              None if stood_since is None else time.time() - stood_since)
        return state, mine

    def _own_part(self, state: dict) -> dict:
        """A pooled run's checkpoint: this device's own small state, read from the shared directory (the model
        and optimizer come later, ``load_sharded``)."""
        if state["world"] != self.world:  # train() refuses it before any device starts; a torchrun restart too
            raise EdgetrainError(f"the checkpoint of step {state['step']} was written by {state['world']} devices, "
                                 f"each with its own part of the model; resume it with --devices {state['world']}")
        parts = Path(state["parts_dir"])
        path = parts / device_file(self.rank)
        if not path.is_file():
            raise EdgetrainError(f"device {self.rank} cannot read its part of the checkpoint, {path}: every device "
                                 f"of a pipeline or fsdp run reads its own; put the run directory on a file system "
                                 f"every node shares, at the same path")
        return {**_load(path), "parts_dir": str(parts)}


def device_state_for(saved: list[dict], rank: int, world: int) -> tuple[dict, list[str]]:
    """Device ``rank``'s state, of ``world`` devices, from a checkpoint written by ``len(saved)`` devices,
    and what was dropped (the module docstring's "Another number of devices")."""
    first, own = saved[0], saved[rank] if rank < len(saved) else None
    strategy, residuals = _without_error_feedback(first["strategy"])
    dropped = ["error-feedback residuals"] if residuals else []
    gone = range(world, len(saved))
    if len(gone):
        dropped.append(f"the RNG state of device(s) {', '.join(map(str, gone))}")
    totals = [0.0, 0.0, 0.0]  # the epoch's running totals (loss, train counts, samples): all of them on rank 0
    if rank == 0:
        parts = [d["epoch_totals"] for d in saved]
        totals = list(sum_totals(parts))
        if not any(isinstance(p[1], dict) for p in parts):  # a classifier's right answers, as a number
            totals[1] = sum(p[1] for p in parts)
    return {**first, "strategy": strategy, "rng": own["rng"] if own else None,
            "records": own["records"] if own else [], "epoch_totals": totals,
            "throttle": (own or first)["throttle"]}, dropped


def _without_error_feedback(state: Any) -> tuple[Any, bool]:
    """``state`` with every error-feedback store emptied (whether any held something). Every sync mode keeps
    its residuals under ``codec`` -> ``memory`` (comm/mode.py ``_codec_state``), PowerSGD under ``powersgd``
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


def _distributed(world: int) -> bool:
    return world > 1 and dist.is_available() and dist.is_initialized()


@contextlib.contextmanager
def _one_process():
    """DCP without a process group (one device, or reading offline) warns that it assumes one process: it is."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "torch.distributed is disabled, unavailable or uninitialized")
        yield


def _barrier(world: int, timeout_s: float, what: str) -> None:
    if _distributed(world):
        wait(dist.barrier(async_op=True), timeout_s, what)


def _remove(path: Path) -> None:
    if path.is_dir():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def remove_stale_parts(folder: str | Path) -> list[Path]:
    """Delete the hidden directories of parts a killed write left (``.step-<N>.tmp/``); return them. Called
    by rank 0 when a run resumes (no device of it writes then) and before each write of the same name."""
    removed = [p for p in Path(folder).glob(f".*{_PARTS_TEMPORARY}") if p.is_dir()]
    for p in removed:
        shutil.rmtree(p, ignore_errors=True)
    return removed


def shared_run_dir(run_dir: str | Path | None, world: int) -> Path | None:
    """Rank 0's run directory, on every device (a collective): pooled strategies write every device's part
    there, so under torchrun, where only rank 0 is given it, it must be on a file system the nodes share."""
    names = all_gather_json(str(run_dir) if run_dir else None) if _distributed(world) else [
        str(run_dir) if run_dir else None]
    return Path(names[0]) if names[0] else None


def split_sharded(state: dict) -> tuple[dict, dict]:
    """(its tensors, the rest) of a strategy's ``sharded_state`` (``{"model": {...}, "optimizer": {...}}``, keyed
    by the whole model's names): the tensors go to DCP, the rest (the optimizer's hyper-parameters per
    parameter) to the device's own file, so that DCP holds tensors only and no value it would deduplicate."""
    tensors: dict = {}
    rest: dict = {}
    for part, values in state.items():
        tensors[part], rest[part] = {}, {}
        for key, value in values.items():
            (tensors if isinstance(value, torch.Tensor) else rest)[part][key] = value
    return tensors, rest


@dataclass(frozen=True)
class Writers:
    """The devices writing a checkpoint's parts together: this one's ``rank`` of ``world``; ``timeout_s`` bounds
    every barrier between them and DCP's collectives."""
    rank: int
    world: int
    timeout_s: float


def write_parts(target: Path, tensors: dict, own: dict, run: dict, writers: Writers) -> None:
    """Every device (a collective): write this device's part of a checkpoint directory ``target`` atomically.

    Rank 0 makes the hidden ``.<name>.tmp/`` beside ``target`` (removing one a killed write left); after a
    barrier every device writes its tensors there with ``torch.distributed.checkpoint.save`` (its own
    ``__<rank>_0.distcp``; rank 0 adds DCP's ``.metadata`` once every device's data is written and synced) and its
    ``own`` small state as ``device-<rank>.pt``; after a second barrier rank 0 writes ``run`` as ``run.pt`` and
    renames the directory to ``target``. Every barrier and DCP's collectives are bounded by the run's timeout."""
    import torch.distributed.checkpoint as dcp

    rank, world, timeout_s = writers.rank, writers.world, writers.timeout_s
    temporary = target.parent / f".{target.name}{_PARTS_TEMPORARY}"
    if rank == 0:
        shutil.rmtree(temporary, ignore_errors=True)
        temporary.mkdir(parents=True)
    _barrier(world, timeout_s, "checkpoint directory barrier")
    if not temporary.is_dir():
        raise EdgetrainError(f"device {rank} cannot see the checkpoint directory {temporary} that device 0 made: "
                             f"every device of a pipeline or fsdp run writes its own part there; put the run "
                             f"directory (--output) on a file system every node shares, at the same path")
    _check_dcp()
    with _one_process():
        dcp.save(tensors, storage_writer=dcp.FileSystemWriter(temporary), no_dist=not _distributed(world))
    save_torch(temporary / device_file(rank), own)
    _barrier(world, timeout_s, "checkpoint parts barrier")  # every part is on disk
    if rank == 0:
        save_torch(temporary / RUN_FILE, run)
        if target.exists():  # the same step written again (a timed checkpoint at the step a run resumed from)
            old = target.parent / f".{target.name}.old{_PARTS_TEMPORARY}"
            shutil.rmtree(old, ignore_errors=True)
            os.replace(target, old)
            os.replace(temporary, target)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(temporary, target)


def save_final_parts(run_dir: str | Path | None, sharded: dict, step: int, config: dict, writers: Writers,
                     planned_steps: int | None = None) -> None:
    """Every device of a pooled run, at its end: the final model and optimizer as ``RUN_DIR/checkpoint/``, each
    device writing its own part (``write_parts``); ``load_checkpoint`` reads it back whole in one process."""
    directory = shared_run_dir(run_dir, writers.world)
    if directory is None:
        return
    tensors, rest = split_sharded(sharded)
    write_parts(directory / FINAL_DIR, tensors, {"sharded": rest},
                {"step": step, "planned_steps": planned_steps, "config": config, "world": writers.world, "parts": True},
                writers)


def load_checkpoint(path: str | Path) -> dict:
    """A run's final model, whole, in this process: ``{"model", "optimizer", "step", "config"}``.

    ``path``: a run directory, its ``checkpoint.pt`` or its ``checkpoint/`` directory (a pipeline's or fsdp's
    run: every device's part), or an in-run ``checkpoints/step-<N>/`` directory of one. ``model`` maps each
    parameter's and buffer's name in the whole model to its tensor; ``optimizer`` is keyed by those names
    for a pooled run (``{"state": {name: {...}}, "param_groups": [{..., "params": [names]}]}``, as
    ``torch.distributed.checkpoint.state_dict.get_state_dict`` gives it) and as ``optimizer.state_dict()``
    otherwise. Tensors are read with ``weights_only``; a directory's ``.metadata`` is DCP's own pickle, so
    read only checkpoints you trust.

    ``partial`` is True for the model of a run that stopped before its end (SIGTERM, or its launcher killed:
    the devices then write the model of the step they reached), or of an in-run checkpoint: ``step`` is
    below ``planned_steps``, the steps the run was to take; a warning line on stderr says so too. A checkpoint
    written before the planned count was recorded has ``planned_steps`` None and ``partial`` False."""
    path = Path(path)
    if path.is_dir() and (path / FINAL_FILE).is_file():
        path = path / FINAL_FILE
    elif path.is_dir() and (path / FINAL_DIR / RUN_FILE).is_file():
        path = path / FINAL_DIR
    if path.is_file():
        return _said_if_partial(path, _load(path))
    if (path / RUN_FILE).is_file():
        return _said_if_partial(path, _read_parts(path))
    raise EdgetrainError(f"{path} holds no final checkpoint ({FINAL_FILE}, or {FINAL_DIR}/ for a pipeline or fsdp "
                         f"run): the run did not finish; resume it with edgetrain train --resume RUN_DIR, or give "
                         f"a run directory that finished")


def _said_if_partial(path: Path, state: dict) -> dict:
    """``state`` with ``planned_steps`` and ``partial`` (``load_checkpoint``); a partial one named on stderr."""
    planned = state.setdefault("planned_steps", None)
    state["partial"] = planned is not None and state["step"] < planned
    if state["partial"]:
        print(f"edgetrain: warning: {path} is a partial run's model: step {state['step']} of the {planned} "
              f"planned (the run stopped before its end); continue it with edgetrain train --resume RUN_DIR",
              file=sys.stderr, flush=True)
    return state


def _read_parts(folder: Path) -> dict:
    """Every device's part of ``folder`` (``write_parts``) joined into one whole state (``load_checkpoint``)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    reader = dcp.FileSystemReader(folder)
    metadata = reader.read_metadata()
    flat = {key: torch.empty(entry.size, dtype=entry.properties.dtype)
            for key, entry in metadata.state_dict_metadata.items() if isinstance(entry, TensorStorageMetadata)}
    _check_dcp()
    with _one_process():
        dcp.load(flat, storage_reader=reader, no_dist=True)  # DCP joins the shards of every device
    parts: dict = {"model": {}, "optimizer": {}}
    for key, tensor in flat.items():
        part, name = metadata.planner_data[key]
        parts[part][name] = tensor
    hyper: dict = {}
    for own in sorted(folder.glob("device-*.pt")):
        hyper.update(_load(own)["sharded"].get("optimizer", {}))
    state: dict = {}
    for key, tensor in parts["optimizer"].items():  # state.<parameter name>.<its state's key>
        name, item = key[len("state."):].rsplit(".", 1)
        state.setdefault(name, {})[item] = tensor
    groups: list[dict] = []
    by_name: dict = {}
    for key, value in hyper.items():  # param_groups.<parameter name>.<hyper-parameter>
        name, item = key[len("param_groups."):].rsplit(".", 1)
        by_name.setdefault(name, {})[item] = value
    for name in [n for n in parts["model"] if n in by_name] + [n for n in by_name if n not in parts["model"]]:
        settings = by_name[name]
        if not groups or {k: v for k, v in groups[-1].items() if k != "params"} != settings:
            groups.append({**settings, "params": []})
        groups[-1]["params"].append(name)
    return {**_load(folder / RUN_FILE), "model": parts["model"],
            "optimizer": {"state": state, "param_groups": groups}}


MEMBERSHIP_FILE = "membership.jsonl"


def last_activity(run_dir: str | Path) -> float | None:
    """Wall-clock time (``time.time``) of the last thing a run wrote before it stopped: the newest of its live
    step files (``metrics-<rank>.jsonl``, flushed every step) and its checkpoints; None if it wrote neither."""
    folder = Path(run_dir)
    files = [*folder.glob("metrics-*.jsonl"), *(folder / CHECKPOINT_DIR).glob("*")]
    times = []
    for f in files:
        try:
            times.append(f.stat().st_mtime)
        except OSError:  # a temporary removed meanwhile
            continue
    return max(times, default=None)


def record_membership(run_dir: Path, state: dict, world: int, took_s: float, outage_s: float | None = None) -> None:
    """A ``MembershipRecord`` in ``membership.jsonl`` per resume (``--resume`` or a torchrun restart): the step
    the run goes on from, its wall time, which devices left or joined (by rank), how long the load took
    (``took_s``) and how long training stood still (``outage_s``: from ``last_activity`` to now)."""
    before = state["world"]
    kind = "leave" if world < before else "join" if world > before else "restart"
    record = MembershipRecord(wall_s=state["wall_s"], step=state["step"], kind=kind,
                              devices=list(range(min(world, before), max(world, before))), world=world,
                              state_from="checkpoint", took_s=round(took_s, 3),
                              outage_s=None if outage_s is None else round(outage_s, 3),
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


def _check_dcp() -> None:
    """One line where this torch's distributed checkpoint cannot write or read a pooled run's parts in one
    process (``no_dist``: torch 2.4 has no such argument)."""
    import torch.distributed.checkpoint as dcp

    if "no_dist" not in inspect.signature(dcp.save).parameters:
        raise EdgetrainError(f"the pipeline and fsdp strategies write their model in parts with "
                             f"torch.distributed.checkpoint, whose save in this torch {torch.__version__} has no "
                             f"no_dist; use --strategy ddp, or install a newer torch (2.13 is tested)")
