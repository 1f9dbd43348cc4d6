"""Tasks: what a run learns (loss, target structure, metrics); the interface is tasks/base.py.

Built in: ``classification`` (tasks/classification.py), ``regression`` (tasks/regression.py), ``detection``
(tasks/detection.py). Their torch-free descriptors are in ``edgetrain.task_kinds``; ``build_task`` makes the
one a run names. Design notes: docs/how-to/tasks.md."""
from edgetrain.tasks.base import Evaluator, Metric, Task, task_reference

__all__ = ["Evaluator", "Metric", "Task", "task_reference"]
