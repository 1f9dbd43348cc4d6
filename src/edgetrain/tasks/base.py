"""The Task interface: everything a training run does that depends on what is being learned.

A strategy (train/strategy.py, train/fsdp.py, train/pipeline.py, the tiled
step), the evaluation pass, the Flower fleet and the FLOP counts all drive a
``Task`` and compute no loss of their own. Design notes: docs/how-to/tasks.md.

Why the loss is a sum over samples: a strategy that splits a global batch of
``B`` samples into shares back-propagates ``task.loss(share) * world / B`` on
each device (or ``/ B`` for a share it scores alone), so the devices' gradients
add up to the gradient of the mean loss over ``B``, whatever the split: that
is what keeps N devices equal to one device step for step.

What the bottom layer knows of a task (its name, which strategies can run it,
where its class lives) is its descriptor in ``edgetrain.kinds`` (torch-free).
"""
from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import Any, Sequence

import torch
from torch.utils.data import default_collate

from edgetrain.errors import EdgetrainError
from edgetrain.records import MetricText


@dataclass(frozen=True)
class Metric(MetricText):
    """One figure an evaluation reports. ``unit`` is what the report's axis says: ``""`` for a fraction of 1
    (accuracy, mAP: shown as such), else the target's unit (``"MPa"``) or a free word; ``label`` is the name a
    plot or table prints (``"mAP@0.5"``), ``name`` the key in records and summary.json (``"map50"``)."""

    name: str
    unit: str = ""
    higher_is_better: bool = True
    label: str = ""
    fmt: str = ".4g"        # how a value is printed (accuracy: ".1%")


class Evaluator(abc.ABC):
    """Accumulates one device's part of a test pass; ``merge`` reduces every device's ``state``.

    ``state()`` must be picklable (devices exchange it with ``all_gather_object``) and ``merge`` must give the
    same answer on every device from the same list of states (every device evaluates, every device reports)."""

    @abc.abstractmethod
    def update(self, output: torch.Tensor, target: Any) -> None: ...

    @abc.abstractmethod
    def state(self) -> Any: ...

    @staticmethod
    @abc.abstractmethod
    def merge(states: list) -> dict[str, float]:
        """``{"loss": mean loss per sample, <metric.name>: value for every metric of the task}``."""


class Task(abc.ABC):
    """What is learned: the loss, the target's structure, the metrics. Subclass it at module level (a task
    travels to the device processes by pickle) and pass an instance: ``edgetrain.train(task=MyTask(), ...)``.

    Abstract: ``loss``, ``evaluator``, ``headline``. The defaults below fit targets that are one tensor with the
    samples along dim 0 (labels, regression values); a task whose target is anything else (a list of boxes per
    image) overrides ``collate``, ``batch_size``, ``to_device`` and ``take`` together."""

    name: str = "task"
    headline: Metric                                # the one metric printed, in summary.json, plotted
    metrics: tuple[Metric, ...] = ()                # everything ``evaluator`` reports (headline included)
    loss_name: str = ""                             # what the loss is, for plots ("cross-entropy")

    @classmethod
    def for_data(cls, data: Any) -> "Task":
        """The task a built-in kind (``--task NAME``) trains on ``data`` (a ``DataSplit``: its ``num_classes``,
        its ``details``); default ``cls()``. A task passed from Python is used as it is."""
        return cls()

    # -- the loss ---------------------------------------------------------------------------------------------
    @abc.abstractmethod
    def loss(self, output: torch.Tensor, target: Any) -> torch.Tensor:
        """Scalar tensor: the loss SUMMED over the batch's samples (not averaged: see the module docstring)."""

    def train_counts(self, output: torch.Tensor, target: Any) -> dict[str, float]:
        """Cheap per-step figures of a training batch (no grad), summable over steps and devices
        (classification: ``{"correct": n}``); may be ``{}``."""
        return {}

    def train_figures(self, counts: dict[str, float], samples: int) -> dict[str, float]:
        """Metric values from ``train_counts`` summed over ``samples`` (classification: ``{"accuracy": ...}``),
        shown by the progress bar and kept in the records; may be ``{}``."""
        return {}

    # -- the target's structure -------------------------------------------------------------------------------
    def collate(self, samples: Sequence[tuple[torch.Tensor, Any]]) -> tuple[torch.Tensor, Any]:
        """A DataLoader ``collate_fn``: ``(x, target)`` samples into ``(x batch, target batch)``."""
        return default_collate(samples)

    def batch_size(self, target: Any) -> int:
        """How many samples a target batch holds."""
        return len(target)

    def to_device(self, target: Any, device: torch.device | str) -> Any:
        return target.to(device)

    def take(self, target: Any, index: slice | torch.Tensor) -> Any:
        """Samples ``index`` of a target batch (a slice or a LongTensor of positions): how a strategy cuts a
        batch into shares or micro-batches."""
        return target[index]

    def example_target(self, output: torch.Tensor) -> Any:
        """A valid target batch for ``output`` (a batch of the model's output): what FLOP counts and the
        planner's cost model back-propagate through when they have no data."""
        raise NotImplementedError(f"task {self.name} has no example_target; FLOP counts need one")

    # -- evaluation -------------------------------------------------------------------------------------------
    @abc.abstractmethod
    def evaluator(self) -> Evaluator: ...

    # -- checks before any device starts ---------------------------------------------------------------------
    def check_data(self, data: Any) -> None:
        """Raise ``EdgetrainError`` (one line naming the problem and the fix) if the run's ``DataSplit`` holds a
        target this task cannot learn from (a regression target that is NaN). Run in the launcher."""

    def check(self, output: torch.Tensor, target: Any) -> None:
        """Raise ``EdgetrainError`` (one line: the problem; the fix) if the model's ``output`` for a batch does
        not fit this task's ``target`` for it. Run on one small batch before any device starts."""

    def describe(self) -> str:
        return self.name

    def metric(self, name: str) -> Metric | None:
        return next((m for m in self.metrics if m.name == name), None)


def add_counts(total: dict, more: dict) -> dict:
    """Train counts (``Task.train_counts``) summed key by key."""
    return {k: total.get(k, 0) + more.get(k, 0) for k in {**total, **more}}


def sum_totals(totals: list) -> tuple[float, dict, float]:
    """Several devices' (loss sum, train counts, samples) summed (an older checkpoint's counts: a classifier's
    right answers, a number)."""
    loss, counts, seen = 0.0, {}, 0.0
    for part_loss, part_counts, part_seen in totals:
        loss, seen = loss + part_loss, seen + part_seen
        counts = add_counts(counts, as_counts(part_counts))
    return loss, counts, seen


def as_counts(counts) -> dict:
    """Train counts as a dict: a number is a classifier's right answers (0: none counted)."""
    return counts if isinstance(counts, dict) else ({"correct": counts} if counts else {})


def task_reference(task: Task) -> str:
    """What a run of a passed Task records as its ``task``: the class as ``module:QualName``."""
    cls = type(task)
    return f"{cls.__module__}:{cls.__qualname__}"


def refuse(problem: str, fix: str) -> None:
    """A task's check failing: the project's one-line error."""
    raise EdgetrainError(f"{problem}; {fix}")
