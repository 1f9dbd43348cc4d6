"""The training part of the report: curves, the per-device charts and the parameter table of a training run.

Design: docs/design/report.md ("A training run's pages").
"""
from __future__ import annotations

import json
import math
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from edgetrain.config import read_yaml_mapping
from edgetrain.errors import EdgetrainError
from edgetrain.records import CLASSIFICATION, EvalRecord, RunSummary, StepRecord

# Imported inside functions: edgetrain.report.plots (matplotlib), which only drawing a figure needs.


def read_records(path: Path, record: type) -> list:
    """Every line of a JSON-lines file as ``record``; one error naming the file and line otherwise."""
    out = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        try:
            data = json.loads(line)
        except json.JSONDecodeError as e:
            raise EdgetrainError(f"{path} line {number} is not valid JSON ({e}); was the run interrupted? "
                                 f"re-run it or give another run directory") from None
        out.append(record.from_dict(data, f"{path} line {number}"))
    return out


@dataclass(frozen=True)
class TrainingFiles:
    """A finished training run's step records, evaluations and config (each may be empty: older runs)."""
    steps: list[StepRecord]
    evals: list[EvalRecord]
    config: dict[str, Any]


def load_training(run_dir: Path, summary: RunSummary) -> TrainingFiles:
    metrics, evals, config = run_dir / "metrics.jsonl", run_dir / "evals.jsonl", run_dir / "config.yaml"
    return TrainingFiles(
        steps=read_records(metrics, StepRecord) if metrics.is_file() else [],
        evals=summary.evals or (read_records(evals, EvalRecord) if evals.is_file() else []),
        config=read_yaml_mapping(config, "run config") if config.is_file() else {},
    )


def curves(name: str, summary: RunSummary, steps: list[StepRecord], evals: list[EvalRecord]):
    """A run's loss and accuracy series (see docs/design/report.md for what each point is)."""
    from edgetrain.report.plots import RunCurves

    by_step: dict[int, list[StepRecord]] = defaultdict(list)
    for r in steps:
        by_step[r.step].append(r)
    done, loss, host, modelled = [], [], [], []
    elapsed = 0.0
    virtual = summary.details.get("link_mode") == "virtual"
    for step in sorted(by_step):
        records = by_step[step]
        samples = sum(r.samples for r in records)
        elapsed += max(r.step_s for r in records)
        done.append(step + 1)  # steps done, as EvalRecord.step counts them
        # devices that sat the step out (0 samples, loss None) do not count; nan: no device trained (a gap)
        loss.append(sum(r.loss * r.samples for r in records if r.samples) / samples if samples else math.nan)
        host.append(elapsed)
        clocks = [r.virtual_s for r in records if r.virtual_s is not None]
        virtual = virtual and len(clocks) == len(records)
        modelled.append(max(clocks, default=0.0))
    task = summary.task or CLASSIFICATION  # a run before tasks: a classifier
    values = [e.values() for e in evals]
    return RunCurves(name=name, steps=done, train_loss=loss, host_s=host, modelled_s=modelled if virtual else None,
                     eval_steps=[e.step for e in evals], eval_loss=[e.test_loss for e in evals],
                     eval_accuracy=[e.test_accuracy for e in evals],
                     changes=[(m.step, m.kind) for m in summary.membership], task=task,
                     eval_metrics={m.name: [v.get(m.name, math.nan) for v in values] for m in task.metrics})


def _count(values: list[Any]) -> str:
    """``host x2, rpi4`` for a list of profiles."""
    counts = {v: values.count(v) for v in values}
    return ", ".join(f"{v} x{n}" if n > 1 else str(v) for v, n in counts.items())


def parameters(summary: RunSummary, config: dict[str, Any]) -> dict[str, Any]:
    """The parameter table of a training run: what it trained, on what, how (summary first, else config)."""
    c, d = config, summary.details
    optimizer = c.get("optimizer")
    if optimizer:
        momentum = f"momentum {c.get('momentum')}, " if optimizer == "sgd" else ""
        optimizer = (f"{optimizer}, lr {c.get('lr')}, {momentum}weight decay {c.get('weight_decay')}, "
                     f"{c.get('schedule')} schedule")
    link = d.get("link") or c.get("link")
    strategy = summary.strategy or c.get("strategy")
    if strategy and c.get("grid", "1x1") != "1x1":
        strategy += f", grid {c['grid']}"
    rows = {
        "task": summary.task.name if summary.task else c.get("task"),  # None: a run before tasks (classification)
        "model": summary.model or c.get("model"),
        "parameters": summary.params,
        "dataset": summary.dataset or c.get("dataset"),
        "input shape": "x".join(map(str, summary.input_shape)) if summary.input_shape else None,
        "devices": summary.devices or c.get("devices"),
        "profiles": _count(summary.profiles) if summary.profiles else c.get("cluster") or c.get("profile"),
        "throttle": c.get("throttle"),
        "strategy": strategy,
        "accelerator": summary.accelerator or c.get("accelerator"),
        "global batch": summary.global_batch or c.get("batch_size"),
        "local batches": ", ".join(map(str, summary.local_batches)) if summary.local_batches else None,
        "epochs": c.get("epochs"),
        "steps": summary.steps if c.get("steps") is None else f"{summary.steps} (limit {c['steps']})",
        "optimizer": optimizer,
        "compression": d.get("compress") or c.get("compress"),
        "sync": d.get("sync") or c.get("sync"),
        "link": f"{link} ({d.get('link_mode') or c.get('link_mode')})" if link else "none (not emulated)",
        "batchnorm": summary.batchnorm or c.get("batchnorm"),
        "seed": c.get("seed"),
    }
    return {k: v for k, v in rows.items() if v is not None}


def device_split(summary: RunSummary, steps: list[StepRecord]):
    """(device labels, time split per device in ms, {device: (steps, bytes sent at each)}) for the device chart;
    None where the summary has no time split (hand-written or older)."""
    per_device = [d for d in summary.per_device if None not in (d.data_s, d.compute_s, d.comm_s)]
    if not per_device:
        return None
    labels = [f"{d.rank}: {d.profile}" for d in per_device]
    split = {"data (waiting for the batch)": [1000 * d.data_s for d in per_device],
             "compute": [1000 * d.compute_s for d in per_device],
             "communication (waiting)": [1000 * d.comm_s for d in per_device]}
    label_of = {d.rank: label for d, label in zip(per_device, labels)}
    sent: dict[str, tuple[list[int], list[float]]] = {}
    for r in sorted(steps, key=lambda r: (r.rank, r.step)):
        if r.rank in label_of:
            xs, ys = sent.setdefault(label_of[r.rank], ([], []))
            xs.append(r.step + 1)
            ys.append(r.bytes_sent)
    return labels, split, sent
