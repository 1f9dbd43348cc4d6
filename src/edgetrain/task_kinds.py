"""The tasks a run can train, one torch-free descriptor each (``--task NAME``, config key ``task``).

A descriptor says what the layers below torch need to know of a task: its
name, the dataset and model it trains by default, the datasets that imply it
when ``--task`` is not given, the strategies that can run it, and where its
runtime class lives (``module:Class``, imported by the devices only). A task
passed from Python (``edgetrain.train(task=MyTask())``) has no descriptor: it
is recorded as ``module:QualName`` and runs under every strategy whose needs it
meets (``Task`` subclasses state them as class attributes, checked in
``tasks.build_task``). Design notes: docs/how-to/tasks.md.

Nothing dispatches on a task's name elsewhere: code asks the descriptor.
"""
from __future__ import annotations

import difflib
from dataclasses import dataclass

from edgetrain.errors import EdgetrainError


@dataclass(frozen=True)
class TaskKind:
    name: str
    summary: str                        # one line: --help and the docs
    runtime: str                        # "package.module:Class", a tasks.base.Task subclass
    default_dataset: str                # what `--task NAME` trains on when no dataset is given
    default_model: str                  # and with which model
    implied_by: tuple[str, ...] = ()    # built-in datasets whose runs are this task when --task is not given
    strategies: tuple[str, ...] = ("ddp", "tiled", "fsdp", "pipeline")  # the strategies that can run it
    why_not: str = ""                   # what a refused strategy is told (the reason, then the fix)
    # the launcher checks the data and one batch through the model before any device starts (Task.check_data,
    # Task.check); classification skips it: its data is today's, checked as it always was, and CIFAR-10 is
    # not read twice
    check_batch: bool = True
    targets: str = "labels"             # what the built-in file formats (npz, csv) read as targets: "labels"
                                        # (integer classes) or "values" (real numbers); "own": the task's datasets
    # further config values `--task NAME` brings for keys the user did not give (detection: the resolution,
    # optimiser and schedule its default model learns the default dataset with)
    settings: tuple[tuple[str, object], ...] = ()

    def check_strategy(self, strategy: str) -> None:
        if strategy not in self.strategies:
            raise EdgetrainError(f"task {self.name} cannot run under strategy {strategy}{self.why_not}; use "
                                 f"--strategy {' or '.join(self.strategies)}")


TASK_KINDS: dict[str, TaskKind] = {k.name: k for k in (
    TaskKind("classification", "one class per sample: cross-entropy, accuracy",
             "edgetrain.tasks.classification:ClassificationTask", "digits", "small_cnn",
             implied_by=("digits", "cifar10", "synthetic", "imagefolder", "npz"), check_batch=False),
    TaskKind("regression", "real-valued targets (N,) or (N, K): squared error summed over samples, RMSE and MAE",
             "edgetrain.tasks.regression:RegressionTask", "diabetes", "mlp",
             implied_by=("diabetes",), strategies=("ddp", "fsdp", "pipeline"), targets="values",
             why_not=" (tiles are of images (C, H, W) and its inputs are feature vectors or series)"),
    TaskKind("detection", "objects in images: boxes and classes per image, YOLOv2 loss, mAP by COCOeval",
             "edgetrain.tasks.detection:DetectionTask", "shapes", "yolov2_tiny_small",
             implied_by=("shapes", "yolo", "coco"), targets="own",
             settings=(("image_size", 128), ("epochs", 8), ("batch_size", 32), ("optimizer", "adam"),
                       ("lr", 0.001), ("weight_decay", 0.0))),
)}

DEFAULT_TASK = "classification"


def is_user_task(name: str) -> bool:
    """A task passed from Python, recorded as ``module:QualName``."""
    return ":" in name


def task_kind(name: str) -> TaskKind:
    """The descriptor of a built-in task, or one line naming the known ones."""
    if name in TASK_KINDS:
        return TASK_KINDS[name]
    if is_user_task(name):
        cls = name.rsplit(":", 1)[1].rsplit(".", 1)[-1]
        raise EdgetrainError(f"task '{name}' is your own Task from an earlier run and a config cannot rebuild it; "
                             f"pass it again with edgetrain.train(config, task={cls}(...))")
    close = difflib.get_close_matches(name, TASK_KINDS, n=1)
    hint = f"did you mean '{close[0]}'? " if close else ""
    raise EdgetrainError(f"unknown task '{name}'; {hint}known tasks: {', '.join(TASK_KINDS)} (or pass your own "
                         f"with edgetrain.train(task=MyTask()))")


def implied_task(dataset: str) -> str:
    """The task a run of ``dataset`` trains when ``--task`` is not given (a dataset you registered: classification
    unless its factory's run names a task)."""
    return next((k.name for k in TASK_KINDS.values() if dataset in k.implied_by), DEFAULT_TASK)


def run_task(task: str | None, dataset: str) -> str:
    """The task a run trains: ``task`` as given, else the one ``dataset`` implies."""
    return task or implied_task(dataset)


def task_defaults(task: str | None, given: set[str] | frozenset[str], dataset: str | None = None) -> dict[str, object]:
    """The config values a built-in task implies for the keys the user did not give (``given``): its dataset,
    its model and its ``settings``. The task is ``--task``, else the one ``dataset`` implies (``implied_by``: a
    YOLO folder brings detection's model and resolution as ``--task detection`` does); ``{}`` for a task passed
    from Python, or with neither."""
    task = task or (implied_task(dataset) if dataset else None)
    if not task or is_user_task(task):
        return {}
    kind = task_kind(task)
    implied = {"dataset": kind.default_dataset, "model": kind.default_model, **dict(kind.settings)}
    return {k: v for k, v in implied.items() if k not in given}


def target_kind(cfg) -> str:
    """What a run's targets are (its task's ``targets``); a task passed from Python: class labels unless its
    dataset is its own (a registered factory, which gives the targets it likes)."""
    name = run_task(cfg.task, cfg.dataset)
    return "labels" if is_user_task(name) else task_kind(name).targets
