"""Training on emulated or real edge devices: ``train(config)`` (loop: train/loop.py; strategies: train/strategy.py)."""
from __future__ import annotations

import dataclasses
import os
import shutil
from typing import TYPE_CHECKING, Any

# Torch-free at the top: ``edgetrain train``'s flags, ``--help`` and the config's checks answer before torch is
# imported (seconds on a Raspberry Pi); ``train`` imports the rest once the config has resolved.
from edgetrain.cluster.launch import launch_local, refuse_nested_launch, under_torchrun
from edgetrain.cluster.membership import ElasticLaunch
from edgetrain.bench.power import read_watts_file
from edgetrain.cluster.profiles import device_speed, plan_devices, split_batch
from edgetrain.config import TrainConfig, load_config, load_run, read_config_file, source_values, with_device_count
from edgetrain.errors import EdgetrainError, Terminated
from edgetrain.report.files import new_run_dir, write_yaml
from edgetrain.spec import back_after_s, launch_spec

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
    from edgetrain.kinds import task_defaults

    refuse_nested_launch()
    if isinstance(model, str):
        overrides["model"], model = model, None
    if isinstance(strategy, str):
        overrides["strategy"], strategy = strategy, None
    if isinstance(task, str):
        overrides["task"], task = task, None
    elif task is not None:
        from edgetrain.tasks import Task, task_reference  # an object, not a name: the run needs torch anyway

        if not isinstance(task, Task):
            raise EdgetrainError(f"task must be a task name or an edgetrain.tasks.Task instance, not a "
                                 f"{type(task).__name__}; subclass edgetrain.tasks.Task at module level")
        overrides["task"] = task_reference(task)
    if isinstance(dataset, str):
        overrides["dataset"] = dataset
    elif dataset is not None:  # a factory: registered for this run only, under its own name
        from edgetrain.data import register_dataset
        from edgetrain.data.datasets import DATASETS

        name = getattr(dataset, "__name__", type(dataset).__name__)
        before = DATASETS.get(name)
        register_dataset(name, dataset)
        rest = {k: v for k, v in overrides.items() if k not in ("dataset", "task")}
        try:
            return train(config, model, strategy, task if task is not None else overrides.get("task"), name, **rest)
        finally:
            if before is None:
                DATASETS.pop(name, None)
            else:
                DATASETS[name] = before
    if isinstance(config, (str, os.PathLike)):  # read once: the task's defaults and the config both need it
        config = read_config_file(config)
    # a built-in --task given without a dataset or model brings its own (edgetrain.kinds)
    in_config = source_values(config)[0]
    given = {*overrides, *in_config}
    if "resume" not in given:  # a resumed run is as its config.yaml says
        overrides.update(task_defaults(overrides.get("task") or in_config.get("task"), given,
                                       overrides.get("dataset") or in_config.get("dataset")))
    torchrun = under_torchrun()
    if torchrun:  # a device of a real cluster: what it was started for is training, so torch now
        from edgetrain.cluster.peers import check_rank_environment
        from edgetrain.train.checkpoint import checkpoint_files, elastic_run_dir
        from edgetrain.train.loop import phase
    rank, world = check_rank_environment() if torchrun else (0, None)
    # every option parsed once, with how this process was started (its environment); the devices build from these
    launch = launch_spec(os.environ)
    cfg, spec = load_run(config, launch, **overrides)
    # Under torchrun with restarts every restart of the job shares one run directory; rank 0 continues it
    # from its newest checkpoint (train/checkpoint.py, "torchrun restarts").
    elastic_dir = elastic_run_dir(cfg.output, cfg.run_name) if torchrun and not cfg.resume else None
    if elastic_dir is not None and rank == 0 and checkpoint_files(elastic_dir):
        phase(cfg, rank, f"continuing the torchrun job's run in {elastic_dir} from its newest checkpoint")
        cfg, spec = load_run(config, launch, **{**overrides, "resume": str(elastic_dir)})
    # The config is valid: the run is going to start, and from here on it needs torch.
    from edgetrain.cluster.peers import cluster_token, peer_failure
    from edgetrain.data import build_data, user_datasets
    from edgetrain.data.datasets import LOADED_ONCE
    from edgetrain.data.device_data import check_device_data, class_labels
    from edgetrain.data.partition import split_dataset
    from edgetrain.data.storage import SetupReads
    from edgetrain.models import model_reference, user_models
    from edgetrain.preflight import check_before_launch
    from edgetrain.train.checkpoint import check_resume_devices, resume_hint
    from edgetrain.train.loop import accelerator_device, phase, run_worker

    if cfg.power_file:  # unreadable: one line now, not one per device after the run directory is made
        read_watts_file(cfg.power_file)
    checked = check_before_launch(cfg, spec, model, task)  # before the run directory and the devices: bad input
    # leaves nothing
    accelerator_device(cfg.accelerator)
    if model is not None:
        cfg = dataclasses.replace(cfg, model=model_reference(model))
    # The token goes to the devices beside the config, never in it: the config is written to the run directory.
    token = cluster_token(cfg.cluster_token, cfg.cluster_token_file, os.environ)
    cfg = dataclasses.replace(cfg, cluster_token=None)
    devices = plan_devices(cfg, world)
    # the checks that need the count: a cluster file's is known now
    spec = with_device_count(cfg, spec, len(devices), launch)
    local_batches = split_batch(cfg, devices, spec.local_batch)
    if spec.checkpoint.resume_dir and rank == 0:
        check_resume_devices(spec.checkpoint.resume_dir, len(devices), spec.partition.local)
    check_device_data(cfg, spec, devices, local_batches, rank if torchrun else None)  # the cluster file's 'data'
    # digits' loader imports scikit-learn, a second of CPU in every device process: the launcher loads it once
    # and hands it to its emulated devices with their arguments. Under torchrun each device loads its own.
    data = (checked or build_data(cfg, spec.task)) if cfg.dataset in LOADED_ONCE and not torchrun else None
    setup_read = checked.details.get("setup_read") if checked is not None else None
    if setup_read:  # a dataset on storage: its index, described once here (a process under torchrun is its device)
        data = checked  # and handed on: a device that described it again would read every header again
        phase(cfg, rank, f"indexed {cfg.dataset} on storage: {SetupReads(**setup_read).describe()}")
    del checked  # a user's dataset in memory is the devices' to load: the launcher keeps no copy through the run
    if spec.partition.local:  # a split that leaves a device short of a batch: refused before any device starts
        split_dataset(class_labels((data or build_data(cfg, spec.task)).train), spec.partition, local_batches, spec.seed)
    beyond = next((f.rank for f in spec.faults if f.rank >= len(devices)), None)
    if beyond is not None:
        raise EdgetrainError(f"EDGETRAIN_FAULT names device {beyond}, but the run has {len(devices)} "
                             f"(ranks 0 to {len(devices) - 1}); name one of them or unset it")
    needs_speed = cfg.throttle and any(d.profile.speed is not None or d.profile.gflops is not None for d in devices)
    # Measured once, before the devices start, so they do not disturb each other's measurement.
    if needs_speed:
        phase(cfg, rank, "measuring this host's core speed (GFLOPS) to throttle the devices to their profiles")
    speeds = [device_speed(d.profile) if needs_speed else None for d in devices]
    run_dir = None
    if cfg.resume:
        run_dir = cfg.resume if rank == 0 else None  # the same directory, its config.yaml as it was
    elif rank == 0:
        run_dir = new_run_dir(cfg.output, elastic_dir.name if elastic_dir else cfg.run_name)
        # under torchrun or the plain recipe the run has WORLD_SIZE devices, whatever --devices says
        write_yaml(run_dir / "config.yaml", {**cfg.to_dict(), **({"devices": world} if torchrun else {})})

    args = (cfg, spec, devices, local_batches, speeds, str(run_dir) if run_dir else None, model, user_models(),
            token, strategy, user_datasets(), data, task)
    if torchrun:
        try:
            return run_worker(*args)
        except Exception as e:
            if run_dir and not cfg.resume and [p.name for p in run_dir.iterdir()] == ["config.yaml"]:
                shutil.rmtree(run_dir, ignore_errors=True)  # refused before training (admission): nothing to keep
            line = peer_failure(e, rank, cfg.timeout)
            if line:
                raise EdgetrainError(line) from None
            raise
    phase(cfg, rank, f"starting {len(devices)} emulated device(s) on this host")
    elastic = None
    if spec.min_devices is not None and spec.min_devices < len(devices):  # survivors go on (train/elastic.py)
        elastic = ElasticLaunch(spec.min_devices, tuple(local_batches), spec.timeout_s,
                                back_after_s(spec.faults))
    try:
        results = launch_local(len(devices), run_worker, args, [d.label for d in devices], log_dir=str(run_dir),
                               elastic=elastic)
        return next((r for r in results if r is not None), None)  # rank 0's at the end (elastic: may move)
    except Terminated as e:
        if spec.checkpoint.enabled:  # the devices stopped with a checkpoint: say how to go on
            raise Terminated(resume_hint(run_dir), e.signum) from None
        raise


__all__ = ["train", "TrainConfig", "load_config"]
