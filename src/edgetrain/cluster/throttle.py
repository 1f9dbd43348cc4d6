"""Emulating a slow device on a fast host.

Three knobs make one host process behave like an edge device:

1. **Cores.** The process is pinned (``os.sched_setaffinity``) to its own
   subset of host cores and told to use that many torch threads, so devices
   sharing a host do not fight over every core.
2. **Speed by duty cycling.** A device of speed ``s`` (relative to one host
   core) should take ``1/s`` times as long as the host for the same work. The
   ``Throttle`` measures the CPU time the process really used since its last
   checkpoint and sleeps until ``cpu / s`` wall seconds have passed. Sleeping
   hands the core to the other devices pinned there, so several slow devices
   share one core at their intended speeds as long as their speeds add up to
   at most 1 per core. Checkpoints fire after every leaf module's forward and
   during backward, so a throttled device also launches its gradient
   communication late, as a real slow device would.
3. **Memory.** The peak resident set (``ru_maxrss``) is compared with the
   profile's memory after every step; exceeding it stops the run with a clear
   message, as an out-of-memory kill would on the device.

Limits, stated plainly: CPU time counts every thread of the process, so the
communication library's own CPU work is stretched too; the host's caches,
memory bandwidth and SIMD width are not the device's, so the emulated speed is
right on average (GFLOPS) but not layer by layer; waiting (for data or peers)
earns no credit, and sleeps shorter than ``quantum`` are batched.
"""
from __future__ import annotations

import os
import resource
import time

from torch import nn


def assign_cores(rank_on_host: int, devices_on_host: int, host_cores: list[int] | None = None) -> list[int]:
    """Cores of this host that the ``rank_on_host``-th local device may run on."""
    cores = sorted(host_cores if host_cores is not None else os.sched_getaffinity(0))
    if devices_on_host >= len(cores):
        return [cores[rank_on_host % len(cores)]]
    share = len(cores) // devices_on_host
    return cores[rank_on_host * share:(rank_on_host + 1) * share]


def pin(cores: list[int]) -> None:
    try:
        os.sched_setaffinity(0, cores)
    except (AttributeError, OSError):  # macOS has no affinity; emulation then shares all cores
        pass


class Throttle:
    """Stretches this process's compute by ``1/speed`` through sleeps at checkpoints."""

    def __init__(self, speed: float, quantum: float = 0.002):
        self.speed = speed
        self.quantum = quantum
        self.slept = 0.0
        self._debt = 0.0
        self.reset()

    def reset(self) -> None:
        """Forget time spent outside compute (waiting for data or peers earns no credit)."""
        self._cpu = time.process_time()
        self._wall = time.perf_counter()
        self._debt = min(self._debt, 0.0)

    def checkpoint(self, *_args) -> None:
        cpu, wall = time.process_time(), time.perf_counter()
        self._debt += (cpu - self._cpu) / self.speed - (wall - self._wall)
        # Never bank credit beyond one quantum: waiting is not computing.
        self._debt = max(self._debt, -self.quantum)
        self._cpu, self._wall = cpu, wall
        if self._debt > self.quantum:
            time.sleep(self._debt)
            self.slept += self._debt

    def attach(self, model: nn.Module) -> None:
        """Checkpoint after each leaf module's forward and when its output's gradient arrives."""

        def on_forward(_module, _inputs, output):
            self.checkpoint()
            if hasattr(output, "requires_grad") and output.requires_grad:
                output.register_hook(lambda grad: (self.checkpoint(), None)[1])

        for module in model.modules():
            if not any(True for _ in module.children()):
                module.register_forward_hook(on_forward)


def peak_rss_mb() -> float:
    """Peak resident set size of this process in MiB (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0
