"""Starting the devices of a run.

*Emulated*: ``launch_local`` spawns one process per device on this host, with
the same environment ``torchrun`` gives its workers (``RANK``, ``WORLD_SIZE``,
``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``), so the worker code is the
same in both cases. It then watches them: the first device to fail stops the
run, the others are stopped at once, and the error that caused it (not the
"connection closed" its peers saw next) is raised as one clear message.

*Real devices*: ``torchrun`` starts the worker on every node and
``edgetrain train`` sees ``RANK`` in its environment (``under_torchrun``).
"""
from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import queue
import signal
import socket
import time
import traceback
from pathlib import Path
from typing import Any, Callable

from edgetrain.errors import EdgetrainError

# Messages that are the echo of another device's failure rather than a cause.
_ECHOES = ("connection closed", "connection reset", "broken pipe", "peer", "timed out", "timeout",
           "terminated", "gloo", "socket")


def under_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _child(rank: int, world: int, port: int, target: Callable, args: tuple, results: Any, log_dir: str | None) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent handles Ctrl-C and stops us
    try:
        value = target(*args)
    except EdgetrainError as e:
        results.put(("error", rank, str(e), True))
        raise SystemExit(2)
    except BaseException as e:  # noqa: BLE001 - reported to the parent, which prints one line
        msg = f"{type(e).__name__}: {e}".strip().splitlines()[0]
        if log_dir:
            log = Path(log_dir) / f"device-{rank}.log"
            log.write_text(traceback.format_exc())
            msg += f" (traceback in {log})"
        else:
            traceback.print_exc()
        results.put(("error", rank, msg, False))
        raise SystemExit(1)
    results.put(("done", rank, value, True))


def _root_cause(failures: list[tuple[int, str, bool]]) -> tuple[int, str]:
    """The failure most likely to be the cause: a clean error or a death, before echoes of it."""
    def rank_key(f):
        rank, msg, clear = f
        echo = any(word in msg.lower() for word in _ECHOES)
        return (not clear, echo, rank)

    rank, msg, _ = min(failures, key=rank_key)
    return rank, msg


def launch_local(world: int, target: Callable, args: tuple, labels: list[str], log_dir: str | None = None,
                 grace_s: float = 1.0) -> list[Any]:
    """Run ``target(*args)`` in ``world`` spawned processes; return their results in rank order.

    A device that fails with an unexpected exception leaves its traceback in ``log_dir/device-<rank>.log``.
    """
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    try:
        pickle.dumps(args)
    except Exception as e:  # noqa: BLE001
        raise EdgetrainError(f"the model or config cannot be sent to the device processes ({e}); "
                             f"define your model class at module level of an importable file") from None
    procs = [ctx.Process(target=_child, args=(r, world, port, target, args, results, log_dir), name=f"edgetrain-device-{r}")
             for r in range(world)]
    for p in procs:
        p.start()
    done: dict[int, Any] = {}
    failures: list[tuple[int, str, bool]] = []
    first_failure: float | None = None
    try:
        while len(done) < world:
            try:
                kind, rank, value, clear = results.get(timeout=0.2)
                if kind == "done":
                    done[rank] = value
                else:
                    failures.append((rank, value, clear))
            except queue.Empty:
                pass
            for rank, p in enumerate(procs):
                if rank in done or p.exitcode in (None, 0) or any(f[0] == rank for f in failures):
                    continue
                # Give a dying process a moment to deliver its message.
                if first_failure is None or time.monotonic() - first_failure > 0.3:
                    how = (f"was killed by signal {signal.Signals(-p.exitcode).name}" if p.exitcode < 0
                           else f"exited with code {p.exitcode}")
                    failures.append((rank, f"its process {how}", True))
            if failures and first_failure is None:
                first_failure = time.monotonic()
            if first_failure is not None and time.monotonic() - first_failure > grace_s:
                break
            if all(p.exitcode is not None for p in procs) and len(done) < world and not failures:
                # Everyone exited but a result went missing (e.g. the queue's feeder died).
                missing = [r for r in range(world) if r not in done]
                failures.append((missing[0], "exited without reporting a result", True))
                first_failure = time.monotonic() - grace_s
    finally:
        for p in procs:
            if p.is_alive():
                p.terminate()
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
        results.close()
        results.join_thread()
    if failures:
        rank, msg = _root_cause(failures)
        raise EdgetrainError(f"{labels[rank]} failed: {msg}; the other devices were stopped")
    return [done[r] for r in range(world)]
