"""Timed training steps of one model on one device: the workload most benches measure.

A *step* is forward, loss, backward and an SGD update on a batch held in
memory, so nothing but compute is timed (``bench stalls`` adds the loader).
``measure_steps_isolated`` runs the steps in a fresh Python process so that
its peak resident memory (``ru_maxrss``) belongs to that batch size alone,
and a watchdog thread in that process stops it the moment its resident memory
passes the device profile's limit: the limit hit comes back as a result
instead of taking the machine down.

Steps are timed until both ``steps`` of them and ``min_time_s`` seconds have
passed, so a fast step is not judged on a handful of timer readings. The
result's ``samples_per_s`` is batch / median step (``common.timing_summary``);
``samples_per_s_mean`` (all samples over all timed seconds) is kept for what
is metered over the whole loop, such as energy.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import psutil

from edgetrain.bench.common import timing_summary
from edgetrain.bench.peak import gemm
from edgetrain.errors import EdgetrainError
from edgetrain.spec import dataset_shape

# Imported inside functions: torch, edgetrain.models, edgetrain.tasks and edgetrain.cluster.throttle (torch), so that
# bench's flags and --help answer without it.

MEMORY_LIMIT_EXIT = 3
_POLL_S = 0.005


def host_memory_cap_mb(fraction: float = 0.8) -> float:
    """What one measurement may use of this host: a share of the memory available now."""
    return psutil.virtual_memory().available / 2**20 * fraction


def build_model(name: str, dataset: str = "cifar10"):
    """A model from ``edgetrain.models`` sized for ``dataset``."""
    from edgetrain.models import build_model as build_registered

    (channels, _, _), classes = dataset_shape(dataset)
    return build_registered(name, in_channels=channels, num_classes=classes)


def time_steps(model, batch_size: int, steps: int, warmup: int, dataset: str = "cifar10",
               threads: int | None = None, seed: int = 0, min_time_s: float = 0.0, task=None) -> dict[str, Any]:
    """Time at least ``steps`` training steps (and ``min_time_s`` seconds of them, if ``steps``) after
    ``warmup`` untimed ones; return per-step seconds and the median-based rate. The loss is ``task``'s
    (default: a classifier's) as a mean over the batch, on random inputs and random labels (a classifier's)
    or the task's ``example_target``."""
    import torch

    from edgetrain.tasks.classification import ClassificationTask

    if threads:
        torch.set_num_threads(threads)
    torch.manual_seed(seed)
    shape, classes = dataset_shape(dataset)
    x = torch.randn(batch_size, *shape)
    if task is None:
        task, y = ClassificationTask(), torch.randint(0, classes, (batch_size,))
    else:
        with torch.no_grad():
            y = task.example_target(model.eval()(x))
    model.train()
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)

    def step() -> float:
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss = task.loss(model(x), y) / batch_size
        loss.backward()
        opt.step()
        return time.perf_counter() - t0

    for _ in range(warmup):
        step()
    step_s: list[float] = []
    start = time.perf_counter()
    while len(step_s) < steps or (steps and time.perf_counter() - start < min_time_s):
        step_s.append(step())
    return {
        "batch_size": batch_size,
        "steps": len(step_s),
        "warmup": warmup,
        "threads": torch.get_num_threads(),
        "step_s": step_s,
        **(timing_summary(step_s, batch_size) if step_s else {"samples_per_s": None}),
        "samples_per_s_mean": batch_size * len(step_s) / sum(step_s) if step_s else None,
    }


def rss_mb() -> float:
    return psutil.Process().memory_info().rss / 2**20


def _start_memory_watchdog(limit_mb: float) -> None:
    """Exit with ``MEMORY_LIMIT_EXIT`` as soon as resident memory passes ``limit_mb``."""

    def watch() -> None:
        while True:
            rss = rss_mb()
            if rss > limit_mb:
                sys.stdout.write(json.dumps({"status": "memory_limit", "rss_mb": rss,
                                             "limit_mb": limit_mb}) + "\n")
                sys.stdout.flush()
                os._exit(MEMORY_LIMIT_EXIT)
            time.sleep(_POLL_S)

    threading.Thread(target=watch, daemon=True, name="memory-watchdog").start()


def _child_main(spec: dict) -> dict:
    if spec.get("memory_limit_mb"):
        _start_memory_watchdog(spec["memory_limit_mb"])
    import torch

    from edgetrain.cluster.throttle import peak_rss_mb

    torch.set_num_threads(spec["threads"])
    model = build_model(spec["model"], spec["dataset"])
    if spec.get("speed"):  # emulate a slower device the way the trainer does
        from edgetrain.cluster.throttle import Throttle

        Throttle(spec["speed"]).attach(model)
    baseline = rss_mb()
    out = time_steps(model, spec["batch_size"], spec["steps"], spec["warmup"], spec["dataset"],
                     threads=spec["threads"], seed=spec.get("seed", 0), min_time_s=spec.get("min_time_s", 0.0))
    out.update(status="ok", baseline_rss_mb=baseline, peak_rss_mb=peak_rss_mb())
    if spec.get("peak_n"):
        # The GEMM peak the steps are set against, measured in the same process right after them, so that
        # a shared machine's load drifts as little as possible between the two numbers of the ratio.
        g = gemm(spec["peak_n"], 1 if spec.get("speed") else spec["threads"], min_time_s=0.5)
        scale = spec.get("speed") or 1.0  # a throttled device's peak: its share of one host core
        out.update(peak_gflops_best=scale * g["gflops_best"], peak_gflops_median=scale * g["gflops_median"])
    return out


def child_env(threads: int | None) -> dict[str, str]:
    """Environment for a child process: finds this package; uses exactly ``threads`` threads if given."""
    env = dict(os.environ)
    src = str(Path(__file__).resolve().parents[2])  # src/edgetrain/bench/workload.py -> src
    env["PYTHONPATH"] = src + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    if threads is not None:
        env["OMP_NUM_THREADS"] = str(threads)
        env["MKL_NUM_THREADS"] = str(threads)
    return env


def measure_steps_isolated(model: str, batch_size: int, *, dataset: str = "cifar10", steps: int = 5,
                           warmup: int = 2, threads: int = 1, memory_limit_mb: float | None = None,
                           timeout_s: float = 600, seed: int = 0, speed: float | None = None,
                           peak_n: int | None = None, min_time_s: float = 0.0) -> dict[str, Any]:
    """``time_steps`` in a fresh process; ``status`` is ``ok``, ``memory_limit``, ``killed`` or ``timeout``.

    ``speed`` (relative to one host core) throttles the process as ``edgetrain.cluster.throttle`` does;
    ``peak_n`` also measures the GEMM peak (of that size) in the same process, after the steps.
    """
    spec = dict(model=model, batch_size=batch_size, dataset=dataset, steps=steps, warmup=warmup,
                threads=threads, memory_limit_mb=memory_limit_mb, seed=seed, speed=speed, peak_n=peak_n,
                min_time_s=min_time_s)
    cmd = [sys.executable, "-m", "edgetrain.bench.workload", json.dumps(spec)]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s,
                              env=child_env(threads))
    except subprocess.TimeoutExpired:
        return {"batch_size": batch_size, "status": "timeout", "timeout_s": timeout_s}
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode == MEMORY_LIMIT_EXIT and lines:
        return {"batch_size": batch_size, **json.loads(lines[-1])}
    if proc.returncode < 0:  # a signal: the kernel's OOM killer sends SIGKILL
        return {"batch_size": batch_size, "status": "killed", "signal": -proc.returncode,
                "stderr": proc.stderr[-2000:]}
    if proc.returncode != 0 or not lines:
        tail = proc.stderr.strip().splitlines()[-1:] or ["no output"]
        if "EdgetrainError" in proc.stderr:
            raise EdgetrainError(tail[0].split("EdgetrainError:", 1)[-1].strip())
        raise RuntimeError(f"measuring batch {batch_size} failed (exit {proc.returncode}): "
                           f"{proc.stderr[-3000:]}")
    return json.loads(lines[-1])


if __name__ == "__main__":
    print(json.dumps(_child_main(json.loads(sys.argv[1]))))
