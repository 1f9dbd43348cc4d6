"""Emulating a slow device on a fast host: pinned cores, speed by calibrated duty cycling, a memory
limit, and freed memory kept for reuse.

Design: docs/design/throttle.md
"""
from __future__ import annotations

import copy
import ctypes
import os
import resource
import statistics
import time

import torch
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
        self.reference_cpu: float | None = None  # CPU s of one warm, unthrottled forward + backward
        self.reference_batch: int | None = None
        self.reference_gradients = 0            # gradient checkpoints in one pass
        self.inflation = 1.0                     # throttled pass CPU / reference_cpu (smoothed)
        self.inflations: list[float] = []        # every measured ratio, for the run summary
        self._pass: dict | None = None           # the training pass being timed
        self._debt = 0.0
        self._credit = 0.0
        self.reset()

    def calibrate(self, model: nn.Module, example: torch.Tensor, passes: int = 8, budget_s: float = 1.0) -> float:
        """Time forward + backward passes of a copy of ``model`` back to back, by CPU time.

        A pass is timed as in training (``attach``): from the start of the forward to the last
        gradient reaching a leaf module's output. After one warm-up pass, passes run until
        ``passes`` are timed or they took ``budget_s`` of CPU (at least 2); the reference is
        their median (this VM's CPU time for identical passes spread by +-15%). The copy leaves
        the model's weights, gradients and BatchNorm statistics untouched. Call before ``attach``.
        """
        clone = copy.deepcopy(model).train()
        marks = {"start": 0.0, "last": 0.0, "gradients": 0}

        def start(*_args) -> None:
            marks.update(start=time.process_time(), gradients=0)

        def gradient_arrived() -> None:
            marks["last"] = time.process_time()
            marks["gradients"] += 1

        _hook(clone, start, lambda: None, gradient_arrived)
        costs: list[float] = []
        with torch.enable_grad():
            _scalar(clone(example)).backward()  # warm-up: allocations, first-call costs
            while len(costs) < passes and (len(costs) < 2 or sum(costs) < budget_s):
                _scalar(clone(example)).backward()
                costs.append(marks["last"] - marks["start"])
        self.reference_cpu = statistics.median(costs)
        self.reference_batch = example.shape[0]
        self.reference_gradients = marks["gradients"]
        self.reset()
        return self.reference_cpu

    def reset(self) -> None:
        """Forget time spent outside compute (waiting for data or peers earns no credit)."""
        self._cpu = time.process_time()
        self._wall = time.perf_counter()
        self._debt = min(self._debt, 0.0)

    def checkpoint(self, *_args) -> None:
        cpu, wall = time.process_time(), time.perf_counter()
        self._debt += (cpu - self._cpu) / (self.speed * self.inflation) - (wall - self._wall)
        # Never bank credit beyond one quantum: waiting is not computing.
        self._debt = max(self._debt, -self.quantum)
        self._cpu, self._wall = cpu, wall
        self._pay()

    def _pay(self) -> None:
        if self._credit and self._debt > 0:  # a pass that slept more than its reference asked
            repaid = min(self._credit, self._debt)
            self._debt -= repaid
            self._credit -= repaid
        if self._debt > self.quantum:
            time.sleep(self._debt)
            self.slept += self._debt
            now = time.perf_counter()
            self._debt -= now - self._wall
            self._wall = now

    def _pass_starts(self, module: nn.Module, args) -> None:
        timed = (self.reference_cpu and module.training and torch.is_grad_enabled() and args
                 and getattr(args[0], "shape", (None,))[0] == self.reference_batch)
        self._pass = {"cpu": time.process_time(), "slept": self.slept, "gradients": 0} if timed else None

    def _gradient_arrived(self) -> None:
        self.checkpoint()
        p = self._pass
        if p is None:
            return
        p["gradients"] += 1
        if p["gradients"] < self.reference_gradients:
            return
        # The pass's last gradient (the count is known from calibration), before DDP sends any.
        # Its CPU time was charged at the inflation estimated before it; settle the difference
        # now, so that a training pass takes reference / speed, whatever its CPU time was.
        self._pass = None
        used = time.process_time() - p["cpu"]
        settle = (self.reference_cpu - used / self.inflation) / self.speed
        if settle > 0:
            self._debt += settle
        elif self.inflations:  # over-charged: give back what was really slept for it, no more.
            # Not after the first pass, which was charged with no estimate and pays one-off costs.
            self._credit += min(-settle, self.slept - p["slept"], 0.25 * self.reference_cpu / self.speed)
        self._pay()
        ratio = used / self.reference_cpu
        self.inflations.append(ratio)
        # Bounded and then smoothed, so that one pass disturbed by the host cannot swing the speed.
        ratio = min(max(ratio, 0.5), 3.0)
        self.inflation = ratio if len(self.inflations) == 1 else 0.7 * self.inflation + 0.3 * ratio

    def attach(self, model: nn.Module) -> None:
        """Checkpoint after each leaf module's forward and when its output's gradient arrives."""
        _hook(model, self._pass_starts, self.checkpoint, self._gradient_arrived)


def _hook(model: nn.Module, on_start, on_leaf_forward, on_leaf_gradient) -> None:
    """Call ``on_start`` before each forward of ``model``, the others at each leaf module's output."""
    model.register_forward_pre_hook(on_start)

    def on_forward(_module, _inputs, output):
        on_leaf_forward()
        if getattr(output, "requires_grad", False):
            output.register_hook(lambda grad: (on_leaf_gradient(), None)[1])

    for module in model.modules():
        if not any(True for _ in module.children()):
            module.register_forward_hook(on_forward)


def _scalar(output) -> torch.Tensor:
    """A scalar to call ``backward`` on, from a tensor or a (nested) tuple, list or dict of them."""
    if isinstance(output, torch.Tensor):
        return output.float().sum()
    items = output.values() if isinstance(output, dict) else output
    return sum(_scalar(o) for o in items if isinstance(o, (torch.Tensor, tuple, list, dict)))


def keep_freed_memory() -> bool:
    """Fix glibc malloc's thresholds so freed activations are reused, not returned to the kernel (knob 4 above).

    False where the C library has no ``mallopt`` (musl, macOS): nothing changes there.
    """
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    m_trim_threshold, m_mmap_threshold = -1, -3  # glibc's <malloc.h>
    return bool(mallopt(m_mmap_threshold, 32 << 20)) and bool(mallopt(m_trim_threshold, 1 << 30))


def page_faults() -> int:
    """Page faults of this process so far (minor + major)."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_minflt + usage.ru_majflt


def peak_rss_mb() -> float:
    """Peak resident set size of this process in MiB: the kernel's high-water mark of its memory (``VmHWM``).

    Not ``getrusage``'s ``ru_maxrss`` where ``/proc`` has it: Linux carries ``ru_maxrss`` over ``exec``, so a
    spawned device would report at least the RSS its launcher had when it started it (measured: a launcher
    that had built the model for its pre-launch check made every device "peak" at that)."""
    try:
        with open("/proc/self/status", encoding="ascii") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024.0  # KiB
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0
