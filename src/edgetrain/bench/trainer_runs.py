"""Short training runs through ``edgetrain.train.train``, read back step by step.

``scaling`` and multi-device ``variability`` measure the real trainer (its
data loading, all-reduce and waiting included), not a stand-in. A run's
``metrics.jsonl`` has one line per step and device with ``data_s``,
``compute_s``, ``comm_s`` and ``step_s``.

The cluster's step time is the slowest device's (synchronous training moves
on when the last device finishes), and a run's throughput is its samples per
step over the median of those step times (``cluster_timing``), with the
spread beside it, as ``common.timing_summary`` defines them.
"""
from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any, Callable

from edgetrain.errors import EdgetrainError

TrainFn = Callable[[dict], dict]


def default_train_fn() -> TrainFn:
    try:
        from edgetrain.train import train
    except ImportError as e:
        raise EdgetrainError(f"this bench needs the trainer (edgetrain.train.train), which is missing: {e}") from None
    return train


def read_metrics(run_dir: str | Path) -> list[dict[str, Any]]:
    path = Path(run_dir) / "metrics.jsonl"
    if not path.exists():
        raise EdgetrainError(f"training run {run_dir} wrote no metrics.jsonl")
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def step_times_by_rank(records: list[dict[str, Any]], skip: int = 1) -> dict[int, list[float]]:
    """Step seconds per device, dropping each device's first ``skip`` steps (start-up)."""
    by_rank: dict[int, list[tuple[int, float]]] = {}
    for r in records:
        if "step_s" in r and "rank" in r:
            by_rank.setdefault(int(r["rank"]), []).append((int(r["step"]), float(r["step_s"])))
    return {rank: [s for _, s in sorted(steps)[skip:]] for rank, steps in sorted(by_rank.items())}


def records_by_step(records: list[dict[str, Any]], skip: int = 1) -> list[list[dict[str, Any]]]:
    """The devices' records of each step in step order, the first ``skip`` steps dropped (if any are left)."""
    by_step: dict[int, list[dict[str, Any]]] = {}
    for r in records:
        if "step_s" in r:
            by_step.setdefault(int(r["step"]), []).append(r)
    steps = sorted(by_step)[skip:] or sorted(by_step)
    if not steps:
        raise EdgetrainError("metrics.jsonl has no step records")
    return [by_step[s] for s in steps]


def cluster_timing(records: list[dict[str, Any]], skip: int = 1) -> dict[str, Any]:
    """Median cluster step (slowest device per step), samples/s from it, and its spread; first ``skip`` steps dropped."""
    from edgetrain.bench.common import timing_summary

    steps = records_by_step(records, skip)
    samples = statistics.median(sum(int(r.get("samples", 0)) for r in recs) for recs in steps)
    return {"steps": len(steps), **timing_summary([max(float(r["step_s"]) for r in recs) for recs in steps], samples)}


def split_per_step(records: list[dict[str, Any]], skip: int = 1) -> dict[str, float]:
    """Mean seconds per step over devices: data, compute, comm (transfer) and wait.

    The trainer counts as ``comm_s`` all the time a step is blocked on a
    collective, which includes waiting for the slowest device to arrive. In
    each step the device that arrives last waits for no one, so the smallest
    ``comm_s`` over devices is the transfer itself and each device's excess
    over it is waiting (for one device, nothing is waiting).
    """
    rows = []
    for recs in records_by_step(records, skip):
        transfer = min(float(r.get("comm_s", 0.0)) for r in recs)
        for r in recs:
            rows.append({"data": float(r.get("data_s", 0.0)), "compute": float(r.get("compute_s", 0.0)),
                         "comm": transfer, "wait": float(r.get("comm_s", 0.0)) - transfer,
                         "step": float(r["step_s"])})
    return {k: statistics.fmean(row[k] for row in rows) for k in ("data", "compute", "comm", "wait", "step")}
