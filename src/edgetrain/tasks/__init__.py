"""Tasks: what a run learns (loss, target structure, metrics); the interface is tasks/base.py.

Built in: ``classification`` (tasks/classification.py), ``regression`` (tasks/regression.py), ``detection``
(tasks/detection.py). Their torch-free descriptors are in ``edgetrain.kinds``; ``build_task`` makes the
one a run names. Design notes: docs/how-to/tasks.md."""
from __future__ import annotations

import importlib

from edgetrain.records import MetricRecord, TaskRecord
from edgetrain.kinds import task_kind
from edgetrain.tasks.base import Evaluator, Metric, Task, task_reference


def task_class(name: str) -> type[Task]:
    """The runtime class of the built-in task ``name`` (its descriptor's ``runtime``), imported on first use."""
    module, _, cls = task_kind(name).runtime.partition(":")
    return getattr(importlib.import_module(module), cls)


def build_task(name: str, data) -> Task:
    """The built-in task ``name`` for the run's data (``Task.for_data``)."""
    return task_class(name).for_data(data)


def task_record(task: Task, name: str | None = None) -> TaskRecord:
    """The summary's typed description of ``task`` (records.py): what the report plots and how."""
    return TaskRecord(name=name or task.name, headline=task.headline.name,
                      metrics=[MetricRecord(m.name, m.unit, m.higher_is_better, m.label, m.fmt)
                               for m in (task.metrics or (task.headline,))], loss=task.loss_name)


__all__ = ["Evaluator", "Metric", "Task", "task_reference", "build_task", "task_class", "task_record"]
