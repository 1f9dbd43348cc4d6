"""A device's peak: GEMM and LINPACK GFLOPS at a few sizes and thread counts.

GEMM (``torch.mm``, float32, the training dtype) counts ``2 n^3`` flops: the
ceiling that convolution and linear layers can approach. LINPACK solves
``A x = b`` by dense LU with partial pivoting (``torch.linalg.solve``, float64
as in HPL) and counts ``2/3 n^3 + 2 n^2`` flops, the convention of the
LINPACK/HPL benchmark (Dongarra et al., "The LINPACK Benchmark: past, present
and future", 2003) that the Raspberry Pi cluster study quotes (15.5 GFLOPS on
one Pi 4, 47 on four). A solve only counts if it is right: HPL's scaled
residual ``||Ax - b||_inf / (eps (||A||_inf ||x||_inf + ||b||_inf) n)`` must be
below 16, otherwise ``ResidualCheckError`` is raised.

For a cluster, every device runs the same measurement at the same moment
(a barrier before each) and the aggregate is the sum: shared memory bandwidth,
heat and power limits show up there and not in N times one device. Under
``torchrun`` the devices are the ranks; ``--devices N`` emulates N devices as
processes on this host.

Each row also carries the spread of its repeats (interquartile range over
the median, ``common.relative_spread``) and ``noisy`` when that is above
``common.NOISY_SPREAD``: a peak measured on a busy machine comes out low, and
every "% of peak" set against it comes out high.
"""
from __future__ import annotations

import argparse
import os
import statistics
import time
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Callable

from edgetrain.arguments import non_negative_float, positive_int
from edgetrain.bench.common import (NOISY_NOTE, NOISY_SPREAD, print_table, relative_spread, save_result, spread_cell,
                                    start_run)
from edgetrain.cluster.launch import run_group
from edgetrain.errors import EdgetrainError
from edgetrain.results import PeakResult

# Imported inside functions: torch, edgetrain.cluster.peers (torch) and edgetrain.report.plots (matplotlib), so that
# ``edgetrain bench``'s flags and --help answer without them.
if TYPE_CHECKING:
    import torch

RESIDUAL_THRESHOLD = 16.0  # HPL's acceptance bound on the scaled residual


class ResidualCheckError(EdgetrainError):
    """A LINPACK solve returned a wrong answer: its GFLOPS mean nothing."""


def gemm_flops(n: int) -> float:
    return 2.0 * n**3


def linpack_flops(n: int) -> float:
    return 2.0 / 3.0 * n**3 + 2.0 * n**2


def _repeat(fn: Callable[[], Any], min_time_s: float, min_repeats: int) -> list[float]:
    """Call ``fn`` (after one warm-up) until both ``min_repeats`` calls and ``min_time_s`` have passed."""
    fn()
    times: list[float] = []
    start = time.perf_counter()
    while len(times) < min_repeats or time.perf_counter() - start < min_time_s:
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return times


def _rates(flops: float, times: list[float]) -> dict[str, Any]:
    spread = relative_spread(times)
    return {
        "repeats": len(times),
        "best_s": min(times),
        "median_s": statistics.median(times),
        "gflops_best": flops / min(times) / 1e9,
        "gflops_median": flops / statistics.median(times) / 1e9,
        "spread": spread,
        "noisy": spread is not None and spread > NOISY_SPREAD,
    }


def gemm(n: int, threads: int, min_time_s: float = 0.3, min_repeats: int = 3) -> dict[str, Any]:
    """float32 ``n x n`` matrix product GFLOPS with ``threads`` threads."""
    import torch

    torch.set_num_threads(threads)
    g = torch.Generator().manual_seed(n)
    a = torch.randn(n, n, generator=g)
    b = torch.randn(n, n, generator=g)
    out = torch.empty(n, n)
    times = _repeat(lambda: torch.mm(a, b, out=out), min_time_s, min_repeats)
    return {"kind": "gemm", "n": n, "threads": threads, "dtype": "float32",
            "flops": gemm_flops(n), **_rates(gemm_flops(n), times)}


def scaled_residual(a: torch.Tensor, x: torch.Tensor, b: torch.Tensor) -> float:
    """HPL's scaled residual of a solution ``x`` of ``a x = b``; O(1) for a correct solve."""
    import torch

    eps = torch.finfo(a.dtype).eps
    r = torch.linalg.vector_norm(a @ x - b, float("inf"))
    scale = eps * (torch.linalg.matrix_norm(a, float("inf")) * torch.linalg.vector_norm(x, float("inf"))
                   + torch.linalg.vector_norm(b, float("inf"))) * a.shape[0]
    return float(r / scale)


def check_residual(a: torch.Tensor, x: torch.Tensor, b: torch.Tensor) -> float:
    """The scaled residual; raise ``ResidualCheckError`` if the solve is wrong."""
    res = scaled_residual(a, x, b)
    if not res < RESIDUAL_THRESHOLD:  # also catches NaN
        raise ResidualCheckError(
            f"LINPACK residual check failed for n={a.shape[0]}: scaled residual {res:.3g} >= "
            f"{RESIDUAL_THRESHOLD:g}, the solver returned a wrong answer; the BLAS/LAPACK library "
            f"or the hardware is faulty, and no GFLOPS figure is reported")
    return res


def linpack(n: int, threads: int, min_time_s: float = 0.3, min_repeats: int = 3,
            solve: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None) -> dict[str, Any]:
    """float64 dense LU solve GFLOPS with ``threads`` threads (``solve``: ``torch.linalg.solve``); every solve
    is residual-checked."""
    import torch

    solve = solve or torch.linalg.solve
    torch.set_num_threads(threads)
    g = torch.Generator().manual_seed(n)
    a = torch.rand(n, n, generator=g, dtype=torch.float64) - 0.5
    b = torch.rand(n, 1, generator=g, dtype=torch.float64) - 0.5
    # The check sits outside the timed region: time the solve alone, then check it.
    times: list[float] = []
    residuals = [check_residual(a, solve(a, b), b)]  # the warm-up is checked too
    start = time.perf_counter()
    while len(times) < min_repeats or time.perf_counter() - start < min_time_s:
        t0 = time.perf_counter()
        x = solve(a, b)
        times.append(time.perf_counter() - t0)
        residuals.append(check_residual(a, x, b))
    return {"kind": "linpack", "n": n, "threads": threads, "dtype": "float64",
            "flops": linpack_flops(n), "max_scaled_residual": max(residuals),
            **_rates(linpack_flops(n), times)}


def sweep(gemm_sizes: list[int], linpack_sizes: list[int], threads: list[int],
          min_time_s: float = 0.3, barrier: Callable[[], None] = lambda: None) -> list[dict[str, Any]]:
    """Every (kind, size, threads) measurement; ``barrier`` lines up devices before each."""
    rows = []
    for t in threads:
        for n in gemm_sizes:
            barrier()
            rows.append(gemm(n, t, min_time_s))
        for n in linpack_sizes:
            barrier()
            rows.append(linpack(n, t, min_time_s))
    return rows


def best_by_threads(rows: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """``{"gemm": {"1": best GFLOPS over sizes, ...}, "linpack": {...}}``."""
    best: dict[str, dict[str, float]] = {}
    for r in rows:
        by_t = best.setdefault(r["kind"], {})
        key = str(r["threads"])
        by_t[key] = max(by_t.get(key, 0.0), r["gflops_best"])
    return best


def aggregate(per_device: list[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """Sum the devices' concurrent GFLOPS for each (kind, n, threads)."""
    out = []
    for i, first in enumerate(per_device[0]):
        same = [dev[i] for dev in per_device]
        out.append({"kind": first["kind"], "n": first["n"], "threads_per_device": first["threads"],
                    "devices": len(per_device),
                    "gflops_best_sum": sum(r["gflops_best"] for r in same),
                    "gflops_median_sum": sum(r["gflops_median"] for r in same),
                    "per_device_gflops_median": [r["gflops_median"] for r in same]})
    return out


def _device_sweep(rank: int, world: int, kwargs: dict) -> list[dict[str, Any]]:
    import torch.distributed as dist

    return sweep(**kwargs, barrier=dist.barrier)


def concurrent_sweep(devices: int, timeout_s: float = 600, **kwargs: Any) -> list[list[dict[str, Any]]]:
    """``sweep`` on ``devices`` emulated devices (processes) at once; one row list per device."""
    return run_group(_device_sweep, devices, kwargs, threads=None, deadline_s=timeout_s,
                     deadline_fix="use smaller --gemm-sizes/--linpack-sizes")


def distributed_sweep(**kwargs: Any) -> list[list[dict[str, Any]]] | None:
    """Under ``torchrun``: measure on every rank at once; rank 0 gets all rows, the others ``None``."""
    import torch.distributed as dist

    from edgetrain.cluster.peers import gather_json

    dist.init_process_group("gloo", timeout=timedelta(seconds=300))
    try:
        rows = sweep(**kwargs, barrier=dist.barrier)
        return gather_json(rows, dst=0)  # JSON, not pickles: see cluster/peers
    finally:
        dist.destroy_process_group()


def _ints(text: str) -> list[int]:
    """argparse type for ``1,2,4``: argparse turns the error into one line and exit status 2."""
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def run(gemm_sizes: list[int], linpack_sizes: list[int], threads: list[int], devices: int = 1,
        min_time_s: float = 0.3, output: str = "runs", name: str | None = None) -> PeakResult | None:
    kwargs = dict(gemm_sizes=gemm_sizes, linpack_sizes=linpack_sizes, threads=threads, min_time_s=min_time_s)
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        per_device = distributed_sweep(**kwargs)
        if per_device is None:  # not rank 0: rank 0 writes the result
            return None
        mode = "torchrun"
    elif devices > 1:
        per_device = concurrent_sweep(devices, **kwargs)
        mode = "emulated"
    else:
        per_device = [sweep(**kwargs)]
        mode = "single"
    rows = per_device[0]
    agg = aggregate(per_device) if len(per_device) > 1 else []
    params = dict(kwargs, devices=len(per_device), mode=mode)
    run_dir = start_run(output, name, "peak")
    result = save_result(run_dir, PeakResult(params=params, rows=rows, best=best_by_threads(rows),
                                             per_device=per_device if len(per_device) > 1 else None, aggregate=agg))
    from edgetrain.report import plots

    plots.plot_peak(result.to_dict(), run_dir / "peak.png")
    note = ("rows are device 0's, measured while every device ran the same; "
            "'all devices' sums their medians") if agg else "best = fastest repeat, median over repeats"
    notes = [note, "spread = interquartile range / median of the repeats' times"]
    notes += [NOISY_NOTE] if any(r["noisy"] for r in rows) else []
    print_table(
        f"bench peak -> {run_dir}",
        ["kind", "n", "threads", "GFLOPS best", "GFLOPS median", "repeats", "spread", "scaled residual"]
        + (["all devices GFLOPS"] if agg else []),
        [(r["kind"], r["n"], r["threads"], r["gflops_best"], r["gflops_median"], r["repeats"],
          spread_cell(r["spread"], r["noisy"]), r.get("max_scaled_residual"))
         + ((a["gflops_median_sum"],) if agg else ()) for r, a in zip(rows, agg or [{}] * len(rows))],
        notes)
    return result


def add_parser(sub) -> None:
    p = sub.add_parser("peak", help="GEMM and LINPACK GFLOPS at a few sizes and thread counts")
    p.add_argument("--gemm-sizes", type=_ints, default=[256, 512, 1024, 2048], metavar="N,N,...")
    p.add_argument("--linpack-sizes", type=_ints, default=[500, 1000, 2000], metavar="N,N,...")
    p.add_argument("--threads", type=_ints, default=None, metavar="T,T,...",
                   help="thread counts (default: 1 and all cores)")
    p.add_argument("--devices", type=positive_int, default=1,
                   help="emulate N devices as processes running at once (under torchrun: the ranks)")
    p.add_argument("--min-time", type=non_negative_float, default=0.3, help="seconds to repeat each measurement")
    p.set_defaults(bench_func=lambda a: run(
        a.gemm_sizes, a.linpack_sizes, a.threads or sorted({1, os.cpu_count() or 1}), a.devices,
        a.min_time, a.output, a.name))
