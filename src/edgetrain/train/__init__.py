"""Training on emulated or real edge devices: ``train(config)``.

The launcher plans the run once (train/run_plan.py), then each device runs it (train/loop.py; strategies:
train/strategy.py). How an option travels through these layers: docs/design/architecture.md.
"""
from __future__ import annotations

import contextlib
import os
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

# Imported inside functions: edgetrain.tasks, edgetrain.data, edgetrain.cluster.peers and this package's loop and
# checkpoint (torch), so that ``edgetrain train``'s flags, ``--help`` and the config's checks answer before torch is
# imported (seconds on a Raspberry Pi); ``train`` imports the rest once the config has resolved.
from edgetrain.cluster.launch import launch_local, refuse_nested_launch
from edgetrain.cluster.membership import ElasticLaunch
from edgetrain.config import TrainConfig, load_config
from edgetrain.errors import EdgetrainError, Terminated
from edgetrain.spec import back_after_s
from edgetrain.train.run_plan import RunPlan, Started, UserParts, phase, plan_run, resolve_run

if TYPE_CHECKING:
    from torch import nn


def train(config: TrainConfig | dict | str | os.PathLike | None = None, model: nn.Module | str | None = None,
          strategy: str | type | None = None, task: Any = None, dataset: Any = None,
          **overrides: Any) -> dict | None:
    """Train as ``config`` says (a ``TrainConfig``, a dict or a YAML path) with ``overrides`` on top.

    On one host this starts ``config.devices`` emulated devices and returns the
    run summary (also written to ``<run_dir>/summary.json``). Under torchrun it
    trains this process's device; rank 0 returns the summary, the others None.
    ``model`` is either the name of a registered model (the config key) or
    your own ``nn.Module`` to train instead of a registered one; the run then
    records it as ``module:QualName`` (config.yaml, summary.json), which a
    later run from that config refuses until the model is passed again.
    Each device trains its own copy of it: your object is left as it was, and
    the trained weights are in ``<run_dir>/checkpoint.pt`` (pipeline, fsdp: ``<run_dir>/checkpoint/``, every
    device's part); ``edgetrain.load_checkpoint(run_dir)`` reads either back whole.
    ``strategy`` is the config's ``strategy`` key or a ``train.strategy.Strategy``
    subclass (defined at module level) to train with instead of a built-in one.
    ``task`` is the config's ``task`` key (classification, regression, detection) or your own
    ``tasks.base.Task`` instance (its class defined at module level), recorded as ``module:QualName``; a
    built-in task given without a dataset (or model) brings its own default one (``edgetrain.kinds``).
    ``dataset`` is the config's ``dataset`` key or a dataset factory ``(data_dir, seed) -> DataSplit or arrays``
    (module level), registered under its function's name for this run.
    """
    refuse_nested_launch()
    user, overrides = _user_parts(model, strategy, task, overrides)
    with _dataset_for_this_run(dataset) as name:
        if name is not None:
            overrides["dataset"] = name
        started = Started.here()
        # every option parsed once, with how this process was started (its environment); the devices build
        # from these
        cfg, spec = resolve_run(config, overrides, started)
        return _launch(plan_run(cfg, spec, user, started))


def _user_parts(model: Any, strategy: Any, task: Any, overrides: dict) -> tuple[UserParts, dict]:
    """Names go to the config's keys; objects stay beside the config (a task also recorded by reference)."""
    overrides = dict(overrides)
    for key, value in (("model", model), ("strategy", strategy), ("task", task)):
        if isinstance(value, str):
            overrides[key] = value
    task = None if isinstance(task, str) else task
    if task is not None:
        from edgetrain.tasks import Task, task_reference  # an object, not a name: the run needs torch anyway

        if not isinstance(task, Task):
            raise EdgetrainError(f"task must be a task name or an edgetrain.tasks.Task instance, not a "
                                 f"{type(task).__name__}; subclass edgetrain.tasks.Task at module level")
        overrides["task"] = task_reference(task)
    return UserParts(None if isinstance(model, str) else model, None if isinstance(strategy, str) else strategy,
                     task), overrides


@contextlib.contextmanager
def _dataset_for_this_run(dataset: Any):
    """The dataset's name for the config: a factory is registered for this run only, under its own name."""
    if dataset is None or isinstance(dataset, str):
        yield dataset
        return
    from edgetrain.data import register_dataset
    from edgetrain.data.datasets import DATASETS

    name = getattr(dataset, "__name__", type(dataset).__name__)
    before = DATASETS.get(name)
    register_dataset(name, dataset)
    try:
        yield name
    finally:
        if before is None:
            DATASETS.pop(name, None)
        else:
            DATASETS[name] = before


def _launch(plan: RunPlan) -> dict | None:
    """Under torchrun: train this process's device. Else start the plan's emulated devices on this host."""
    from edgetrain.train.checkpoint import resume_hint
    from edgetrain.train.loop import run_worker

    if plan.started.torchrun:
        return _train_here(plan)
    cfg, spec, devices = plan.cfg, plan.spec, plan.devices
    phase(cfg, 0, f"starting {len(devices)} emulated device(s) on this host")
    elastic = None
    if spec.min_devices is not None and spec.min_devices < len(devices):  # survivors go on (train/elastic.py)
        elastic = ElasticLaunch(spec.min_devices, plan.local_batches, spec.timeout_s, back_after_s(spec.faults))
    try:
        results = launch_local(len(devices), run_worker, (plan,), [d.label for d in devices],
                               log_dir=str(plan.run_dir), elastic=elastic)
        return next((r for r in results if r is not None), None)  # rank 0's at the end (elastic: may move)
    except Terminated as e:
        if spec.checkpoint.enabled:  # the devices stopped with a checkpoint: say how to go on
            raise Terminated(resume_hint(plan.run_dir), e.signum) from None
        raise


def _train_here(plan: RunPlan) -> dict | None:
    """One device of a real cluster: its failure, or a peer's, in one line."""
    from edgetrain.cluster.peers import peer_failure
    from edgetrain.train.loop import run_worker

    try:
        return run_worker(plan)
    except Exception as e:
        run_dir = Path(plan.run_dir) if plan.run_dir else None
        if run_dir and not plan.cfg.resume and [p.name for p in run_dir.iterdir()] == ["config.yaml"]:
            shutil.rmtree(run_dir, ignore_errors=True)  # refused before training (admission): nothing to keep
        line = peer_failure(e, plan.started.rank, plan.cfg.timeout)
        if line:
            raise EdgetrainError(line) from None
        raise


__all__ = ["train", "TrainConfig", "load_config"]
