"""Run a function on N emulated devices (spawned processes, gloo) and collect what each returns."""
from __future__ import annotations

import datetime
import os
import socket
import traceback

import torch.multiprocessing as mp


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, world: int, port: int, fn, args, queue) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=60))
        try:
            queue.put((rank, "ok", fn(rank, world, *args)))
        finally:
            dist.destroy_process_group()
    except BaseException:
        queue.put((rank, "error", traceback.format_exc()))


def run_devices(fn, world: int, *args, timeout: float = 120.0) -> list:
    """``fn(rank, world, *args)`` on ``world`` processes; returns the results by rank, raises on any failure."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_entry, args=(r, world, port, fn, args, queue)) for r in range(world)]
    for p in procs:
        p.start()
    results: dict[int, object] = {}
    try:
        for _ in range(world):
            rank, status, value = queue.get(timeout=timeout)
            if status != "ok":
                raise AssertionError(f"device {rank} failed:\n{value}")
            results[rank] = value
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    return [results[r] for r in range(world)]
