"""Short training runs through ``edgetrain.train.train``, read back step by step.

``scaling`` and multi-device ``variability`` measure the real trainer (its
data loading, all-reduce and waiting included), not a stand-in. A run's
``metrics.jsonl`` has one line per step and device with ``data_s``,
``compute_s``, ``comm_s`` and ``step_s``; what a step spends outside those
three is *waiting* (for the slowest device, for the barrier).
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


def split_per_step(records: list[dict[str, Any]], skip: int = 1) -> dict[str, float]:
    """Mean seconds per step over devices: data, compute, comm, and wait (the rest of the step)."""
    first = {}
    for r in records:
        first[r["rank"]] = min(first.get(r["rank"], r["step"]), r["step"])
    kept = [r for r in records if "step_s" in r and r["step"] >= first[r["rank"]] + skip] or \
        [r for r in records if "step_s" in r]
    if not kept:
        raise EdgetrainError("metrics.jsonl has no step records")
    parts = {k: statistics.fmean(float(r.get(f"{k}_s", 0.0)) for r in kept) for k in ("data", "compute", "comm")}
    step = statistics.fmean(float(r["step_s"]) for r in kept)
    parts["wait"] = max(0.0, step - sum(parts.values()))
    parts["step"] = step
    return parts
