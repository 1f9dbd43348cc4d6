"""Throughput and peak memory versus batch size, up to the device's memory limit.

On a Raspberry Pi 4, ResNet-18 training throughput rises with batch size
(fixed per-step costs are shared by more samples and GEMMs grow more
efficient) until activations no longer fit in 4 GB. Each batch size here runs
in a fresh process (``workload.measure_steps_isolated``) so its peak resident
memory is its own; the sweep doubles the batch until the profile's memory
limit is hit, which is recorded as a result, not a crash.

The achieved GFLOPS of each batch (model FLOPs per sample x samples/s, see
``flops.py``) are set against a GEMM peak measured in the same process right
after the steps, with the same thread count, so the fraction of peak is a
ratio of two numbers taken side by side; both use medians (of step times, of
GEMM repeats), which a shared machine's bursts of load disturb least. The
samples/s column is batch / the median step shown beside it; each batch's
steps are timed for at least ``min_time_s`` (1 s by default) as well as
``steps``, and a batch whose step times spread too much, or whose rate comes
out above the peak, is flagged in the table and the JSON (``noisy``,
``above_peak``), not printed bare.

A profile with a compute rate (``rpi4``: 15.5 GFLOPS) is emulated as the
trainer does it: the process is throttled to ``speed`` host cores
(``edgetrain.cluster.throttle``) and runs ``ceil(speed)`` threads; its peak is
``speed`` x one host core's GEMM rate.
"""
from __future__ import annotations

import math
import os
from typing import Any

from edgetrain.bench import workload
from edgetrain.arguments import non_negative_int, positive_float, positive_int
from edgetrain.bench.common import (ABOVE_PEAK_NOTE, NOISY_NOTE, percent_of_peak, print_table, save_result, say,
                                    spread_cell, start_run)
from edgetrain.cluster.profiles import device_speed, get_profile
from edgetrain.errors import EdgetrainError
from edgetrain.results import BatchResult
from edgetrain.spec import DATASET_SHAPES

# Imported inside functions: edgetrain.tasks (torch) and edgetrain.report.plots (matplotlib), so that bench's flags
# and --help answer without them.


def batch_sizes(start: int, max_batch: int) -> list[int]:
    sizes, b = [], start
    while b <= max_batch:
        sizes.append(b)
        b *= 2
    return sizes


def run(model: str = "resnet18", dataset: str = "cifar10", profile: str = "host", *,
        start_batch: int = 1, max_batch: int = 512, steps: int = 3, warmup: int = 1,
        threads: int | None = None, memory_limit_mb: float | None = None, throttle: bool = True,
        peak_size: int = 1024, output: str = "runs", name: str | None = None,
        timeout_s: float = 600, min_time_s: float = 1.0) -> BatchResult:
    if start_batch < 1 or max_batch < start_batch:
        raise EdgetrainError(f"need 1 <= --start-batch <= --max-batch, got {start_batch} and {max_batch}")
    prof = get_profile(profile)
    speed, threads, peak_source, notes = _device(prof, throttle, threads, peak_size)
    limit, limit_source = _memory_limit(prof, memory_limit_mb)
    from edgetrain.tasks import flops  # after the checks: bad input is answered without torch

    counted = flops.training_flops_per_sample(workload.build_model(model, dataset), dataset)
    rows, limit_hit = _sweep(counted, batch_sizes(start_batch, max_batch), dict(
        model=model, dataset=dataset, steps=steps, warmup=warmup, threads=threads, memory_limit_mb=limit,
        timeout_s=timeout_s, speed=speed, peak_n=peak_size, min_time_s=min_time_s))
    ok = [r for r in rows if r["status"] == "ok"]
    if not ok:
        raise EdgetrainError(f"batch {start_batch} does not fit the {limit:.0f} MB memory limit "
                             f"({rows[0]['status']}); try a smaller model or a larger limit")
    best = max(ok, key=lambda r: r["samples_per_s"])
    params = dict(model=model, dataset=dataset, profile=prof.name, threads=threads, steps=steps,
                  min_time_s=min_time_s, warmup=warmup, start_batch=start_batch, max_batch=max_batch,
                  data="synthetic tensors in memory (no loader; see bench stalls)")
    run_dir = start_run(output, name, "batch")
    result = save_result(run_dir, BatchResult(
        params=params,
        profile={"name": prof.name, "memory_limit_mb": limit, "limit_source": limit_source,
                 "cores": prof.cores, "nominal_gflops": prof.gflops, "emulated_speed": speed},
        flops_per_sample=counted, peak_source=peak_source,
        rows=rows, best=best["batch_size"], largest_fitting_batch=ok[-1]["batch_size"],
        limit_hit=limit_hit, notes=notes))
    from edgetrain.report import plots

    plots.plot_batch(result.to_dict(), run_dir / "batch.png")
    _print(result, f"bench batch: {model} on {prof.name} ({threads} threads) -> {run_dir}", limit_source)
    return result


def _device(prof, throttle: bool, threads: int | None, peak_size: int
            ) -> tuple[float | None, int, str, list[str]]:
    """(emulated speed, threads, where the peak comes from, notes) of the profile on this host."""
    host_cores = os.cpu_count() or 1
    speed = device_speed(prof) if throttle else None
    if threads is None:
        # A throttled device computes at `speed` host cores: more threads than that only spin.
        threads = min(math.ceil(speed), host_cores) if speed else min(prof.cores or host_cores, host_cores)
    notes = []
    if speed is None:
        peak_source = f"float32 GEMM n={peak_size} at {threads} thread(s), measured in each batch's process"
    else:
        peak_source = (f"emulated: speed {speed:.3f} x one host core's GEMM n={peak_size}, measured in each "
                       f"batch's process (profile {prof.name}: nominal {prof.gflops} GFLOPS)")
        notes.append(f"profile {prof.name} emulated by throttling to {speed:.3f} of one host core "
                     "(edgetrain.cluster.throttle); pass --no-throttle for host speed with the profile's memory limit")
    if speed is None and prof.gflops is not None:
        notes.append(f"--no-throttle: throughput is this host's at {threads} thread(s), with profile "
                     f"{prof.name}'s memory limit")
    return speed, threads, peak_source, notes


def _memory_limit(prof, memory_limit_mb: float | None) -> tuple[float, str]:
    """The memory limit (MB) the batches are held to and where it comes from; above what the host has: one line."""
    host_cap = workload.host_memory_cap_mb()
    if memory_limit_mb is not None:
        limit, limit_source = memory_limit_mb, "--memory-limit-mb"
    elif prof.memory_mb is not None:
        limit, limit_source = float(prof.memory_mb), f"profile {prof.name}"
    else:
        limit, limit_source = host_cap, "80% of this host's available memory"
    if limit > host_cap:
        raise EdgetrainError(f"memory limit {limit:.0f} MB is more than this host can give now "
                             f"({host_cap:.0f} MB available); pass a smaller --memory-limit-mb")
    return limit, limit_source


def _sweep(counted: dict, sizes: list[int], measure: dict[str, Any]) -> tuple[list[dict[str, Any]], dict | None]:
    """Each batch size in its own process (``workload.measure_steps_isolated`` with ``measure``), up to the first
    that does not fit: (rows, that batch's row or None)."""
    from edgetrain.tasks import flops

    rows: list[dict[str, Any]] = []
    for b in sizes:
        r = workload.measure_steps_isolated(batch_size=b, **measure)
        if r["status"] == "ok":
            # Typical step against typical GEMM (medians): robust to a shared machine's bursts of load.
            r.update(flops.achieved(counted["total_flops"], r["samples_per_s"], r["peak_gflops_median"]))
        rows.append(r)
        say(f"  batch {b}: " + (f"{r['samples_per_s']:.1f} samples/s, peak {r['peak_rss_mb']:.0f} MB"
                                 if r["status"] == "ok" else r["status"]), style="dim")
        if r["status"] != "ok":
            return rows, {"batch_size": b, **{k: v for k, v in r.items() if k != "batch_size"}}
    return rows, None


def _print(result: BatchResult, title: str, limit_source: str) -> None:
    """The table, and the result's notes with what it found (the limit, the best batch) added to them."""
    rows, notes, limit_hit = result.rows, result.notes, result.limit_hit
    limit, max_batch = result.profile["memory_limit_mb"], result.params["max_batch"]
    ok = [r for r in rows if r["status"] == "ok"]
    best = next(r for r in ok if r["batch_size"] == result.best)
    table = [(r["batch_size"], r["status"], r.get("samples_per_s"), r.get("step_s_median"),
              spread_cell(r.get("spread"), r.get("noisy", False)), r.get("peak_rss_mb") or r.get("rss_mb"),
              r.get("achieved_gflops"), r.get("peak_gflops_median"), percent_of_peak(r.get("fraction_of_peak")))
             for r in rows]
    if limit_hit:
        notes.append(f"memory limit {limit:.0f} MB ({limit_source}) hit at batch {limit_hit['batch_size']}: "
                     f"{limit_hit['status']}; largest batch that fits: {ok[-1]['batch_size']}")
    else:
        notes.append(f"no batch up to {max_batch} reached the {limit:.0f} MB limit ({limit_source})")
    notes.append(f"best batch {best['batch_size']}: {best['samples_per_s']:.1f} samples/s, "
                 f"{percent_of_peak(best['fraction_of_peak'])} of the {best['peak_gflops_median']:.1f} GFLOPS "
                 f"peak; {result.flops_per_sample['total_flops'] / 1e9:.3f} GFLOP per training sample "
                 f"(FlopCounterMode)")
    notes.append("samples/s = batch / median step s; spread = interquartile range / median of the step times; "
                 f"% of peak = FLOPs/sample x samples/s over the median GEMM rate; peak: {result.peak_source}")
    printed_notes = list(notes)
    printed_notes += [NOISY_NOTE] if any(r.get("noisy") for r in ok) else []
    printed_notes += [ABOVE_PEAK_NOTE] if any(r.get("above_peak") for r in ok) else []
    print_table(title, ["batch", "status", "samples/s", "median step s", "spread", "peak RSS MB", "GFLOPS",
                        "peak GFLOPS", "% of peak"], table, printed_notes)


def add_parser(sub) -> None:
    p = sub.add_parser("batch", help="throughput and peak memory versus batch size, up to the memory limit")
    p.add_argument("--model", default="resnet18")
    p.add_argument("--dataset", default="cifar10", choices=sorted(DATASET_SHAPES), help="input shape to feed (synthetic data)")
    p.add_argument("--profile", default="host", help="device profile: host, rpi4, jetson-nano")
    p.add_argument("--start-batch", type=positive_int, default=1)
    p.add_argument("--max-batch", type=positive_int, default=512)
    p.add_argument("--steps", type=positive_int, default=3, help="timed steps per batch size")
    p.add_argument("--warmup", type=non_negative_int, default=1)
    p.add_argument("--threads", type=positive_int, default=None, help="default: the profile's cores, at most this host's")
    p.add_argument("--memory-limit-mb", type=positive_float, default=None, help="override the profile's limit")
    p.add_argument("--no-throttle", dest="throttle", action="store_false",
                   help="run at host speed (keep the profile's memory limit)")
    p.add_argument("--peak-size", type=positive_int, default=1024, help="GEMM size for the peak the fraction refers to")
    p.set_defaults(bench_func=lambda a: run(
        a.model, a.dataset, a.profile, start_batch=a.start_batch, max_batch=a.max_batch, steps=a.steps,
        warmup=a.warmup, threads=a.threads, memory_limit_mb=a.memory_limit_mb, throttle=a.throttle, peak_size=a.peak_size,
        output=a.output, name=a.name))

