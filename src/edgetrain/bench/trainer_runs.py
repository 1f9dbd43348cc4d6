"""Short training runs of the real trainer, each in its own process, read back step by step.

``scaling`` and multi-device ``variability`` measure the real trainer (its
data loading, all-reduce and waiting included), not a stand-in. Bench sits
beside ``train`` in the layering and never imports it: ``train_in_subprocess``
writes the run's config as YAML and runs ``python -m edgetrain train
--config`` on it, as a user would, then reads the run directory through the
typed records (``records.RunSummary`` from ``summary.json``, one
``records.StepRecord`` per line of ``metrics.jsonl``). Each run also gets a
fresh process, so no state of one run leaks into the next.

The cluster's step time is the slowest device's (synchronous training moves
on when the last device finishes), and a run's throughput is its samples per
step over the median of those step times (``cluster_timing``), with the
spread beside it, as ``common.timing_summary`` defines them.
"""
from __future__ import annotations

import functools
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any, Callable

from edgetrain.bench.common import timing_summary
from edgetrain.bench.workload import child_env
from edgetrain.cluster.launch import _die_with_parent
from edgetrain.errors import EdgetrainError
from edgetrain.files import write_yaml
from edgetrain.records import RunSummary, StepRecord

# A trainer: a config dict (TrainConfig keys, with ``output`` and ``run_name``) -> the run's summary.
TrainFn = Callable[[dict], RunSummary]
STOP_TIMEOUT_S = 30  # a trainer told to stop: its launcher gives its devices a few seconds, then kills them


def train_in_subprocess(config: dict[str, Any]) -> RunSummary:
    """Run ``edgetrain train --config`` on ``config`` in a child process; its summary, or its one-line error.

    The child dies with this process (``PR_SET_PDEATHSIG``, as devices die with their launcher), and an
    exception here (Ctrl-C, SIGTERM, which the CLI raises as ``Terminated``) stops it with SIGTERM first, so
    that it stops its own devices, and kills it if it has not stopped within ``STOP_TIMEOUT_S``.
    """
    run_dir = Path(config["output"]) / config["run_name"]
    config_path = run_dir.with_name(f"{run_dir.name}.yaml")
    write_yaml(config_path, config)
    # The child's own table goes nowhere (the bench prints its own); its error line is kept for ours.
    with subprocess.Popen([sys.executable, "-m", "edgetrain", "train", "--config", str(config_path)],
                          stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=child_env(None),
                          preexec_fn=functools.partial(_die_with_parent, os.getpid())) as proc:
        try:
            _, stderr = proc.communicate()
        except BaseException:
            proc.terminate()
            try:
                proc.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                proc.kill()
            raise
    if proc.returncode != 0:
        last = (stderr.strip().splitlines() or [f"exit code {proc.returncode}"])[-1]
        raise EdgetrainError(f"training run {run_dir} failed: {last.removeprefix('edgetrain: error: ')}")
    return read_summary(run_dir)


def read_summary(run_dir: str | Path) -> RunSummary:
    path = Path(run_dir) / "summary.json"
    if not path.is_file():
        raise EdgetrainError(f"training run {run_dir} wrote no summary.json")
    return RunSummary.from_dict(json.loads(path.read_text()), str(path))


def read_metrics(run_dir: str | Path) -> list[StepRecord]:
    path = Path(run_dir) / "metrics.jsonl"
    if not path.exists():
        raise EdgetrainError(f"training run {run_dir} wrote no metrics.jsonl")
    return [StepRecord.from_dict(json.loads(line), f"{path} line {i}")
            for i, line in enumerate(path.read_text().splitlines(), 1) if line.strip()]


def step_times_by_rank(records: list[StepRecord], skip: int = 1) -> dict[int, list[float]]:
    """Step seconds per device, dropping each device's first ``skip`` steps (start-up)."""
    by_rank: dict[int, list[tuple[int, float]]] = {}
    for r in records:
        by_rank.setdefault(r.rank, []).append((r.step, r.step_s))
    return {rank: [s for _, s in sorted(steps)[skip:]] for rank, steps in sorted(by_rank.items())}


def records_by_step(records: list[StepRecord], skip: int = 1) -> list[list[StepRecord]]:
    """The devices' records of each step in step order, the first ``skip`` steps dropped (if any are left)."""
    by_step: dict[int, list[StepRecord]] = {}
    for r in records:
        by_step.setdefault(r.step, []).append(r)
    steps = sorted(by_step)[skip:] or sorted(by_step)
    if not steps:
        raise EdgetrainError("metrics.jsonl has no step records")
    return [by_step[s] for s in steps]


def cluster_timing(records: list[StepRecord], skip: int = 1) -> dict[str, Any]:
    """Median cluster step (slowest device per step), samples/s from it, and its spread; first ``skip`` steps dropped."""
    steps = records_by_step(records, skip)
    samples = statistics.median(sum(r.samples for r in recs) for recs in steps)
    return {"steps": len(steps), **timing_summary([max(r.step_s for r in recs) for recs in steps], samples)}


def split_per_step(records: list[StepRecord], skip: int = 1) -> dict[str, float]:
    """Mean seconds per step over devices: data, compute, comm (transfer) and wait.

    The trainer counts as ``comm_s`` all the time a step is blocked on a
    collective, which includes waiting for the slowest device to arrive. In
    each step the device that arrives last waits for no one, so the smallest
    ``comm_s`` over devices is the transfer itself and each device's excess
    over it is waiting (for one device, nothing is waiting).
    """
    rows = []
    for recs in records_by_step(records, skip):
        transfer = min(r.comm_s for r in recs)
        for r in recs:
            rows.append({"data": r.data_s, "compute": r.compute_s, "comm": transfer, "wait": r.comm_s - transfer,
                         "step": r.step_s})
    return {k: statistics.fmean(row[k] for row in rows) for k in ("data", "compute", "comm", "wait", "step")}
