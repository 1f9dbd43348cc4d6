"""A run planned once on the launcher's side: ``RunPlan``, what every device process is handed.

``resolve_run`` turns a config and its overrides into the resolved ``(cfg, spec)``; ``plan_run`` adds the
devices, their local batches, the data the launcher loads once, the run directory and the cluster token.
The device side runs a plan in phases (train/loop.py, ``DeviceRun``). See docs/design/architecture.md.
"""
from __future__ import annotations

import dataclasses
import os
import sys
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from edgetrain.cluster.launch import under_torchrun
from edgetrain.cluster.profiles import DeviceSpec, device_speed, plan_devices, split_batch
from edgetrain.config import TrainConfig, load_run, read_config_file, source_values, with_device_count
from edgetrain.cluster.sensors import read_watts_file
from edgetrain.errors import EdgetrainError
from edgetrain.files import new_run_dir, write_yaml
from edgetrain.kinds import task_defaults
from edgetrain.spec import LaunchSpec, RunSpec, launch_spec

# Imported inside functions: torch and what needs it (edgetrain.cluster.peers, edgetrain.data, edgetrain.models, this
# package's checkpoint and preflight), once the config is valid, so that edgetrain train's flags, --help and bad input
# answer without it.

if TYPE_CHECKING:
    import torch
    from torch import nn

    from edgetrain.data import DataSplit
    from edgetrain.tasks import Task


@dataclass(frozen=True)
class UserParts:
    """What a Python caller of ``train`` passed instead of a config key, and what it registered."""
    model: nn.Module | None = None
    strategy: type | None = None  # a ``train.strategy.Strategy`` subclass
    task: Task | None = None
    models: dict = field(default_factory=dict)  # registered in the launcher: re-registered in every device
    datasets: dict = field(default_factory=dict)


@dataclass(frozen=True)
class Started:
    """How the launching process was started: by torchrun (one device of a cluster, its ``rank`` of
    ``world``) or by hand (rank 0 of no fixed world: it starts the emulated devices)."""
    torchrun: bool
    rank: int
    world: int | None
    launch: LaunchSpec

    @classmethod
    def here(cls) -> Started:
        if not under_torchrun():
            return cls(False, 0, None, launch_spec(os.environ))
        # a device of a real cluster: what it was started for is training, so torch now
        from edgetrain.cluster.peers import check_rank_environment

        return cls(True, *check_rank_environment(), launch_spec(os.environ))


@dataclass(frozen=True)
class RunPlan:
    """Everything a device process needs to train, decided once before any starts; picklable (the fork
    server hands it to every emulated device)."""
    cfg: TrainConfig
    spec: RunSpec
    started: Started
    devices: tuple[DeviceSpec, ...]
    local_batches: tuple[int, ...]
    speeds: tuple[float | None, ...]  # measured host speed each throttled device is held to, else None
    user: UserParts = UserParts()
    data: DataSplit | None = None  # loaded once by the launcher (datasets in LOADED_ONCE), else each device's own
    run_dir: str | None = None  # None on devices that do not write it (ranks > 0 under torchrun)
    token: str = field(default="", repr=False)  # the cluster token: beside the config, never in it
    # the launcher's cores when it plans the run: emulated devices share them out (cluster/throttle.assign_cores),
    # not the cores of the fork server they come from, which keeps the affinity of the run that started it
    host_cores: tuple[int, ...] | None = None


def phase(cfg: TrainConfig, rank: int, text: str) -> None:
    """A start-up phase on rank 0, one line on stderr as it begins (not with --no-progress)."""
    if cfg.progress and rank == 0:
        print(f"edgetrain: {text}", file=sys.stderr, flush=True)


def accelerator_device(accelerator: str, local_rank: int = 0) -> torch.device:
    """The torch device ``--accelerator`` names for this device; one line if it asks for a GPU torch cannot see."""
    import torch

    if accelerator == "cuda" and not torch.cuda.is_available():
        raise EdgetrainError("accelerator cuda was asked for but torch sees no CUDA GPU on this host "
                             f"(torch {torch.__version__}); use --accelerator cpu or auto")
    if accelerator == "cpu" or not torch.cuda.is_available():
        return torch.device("cpu")
    device = torch.device("cuda", local_rank % torch.cuda.device_count())
    # Set and initialised now: torch's device mesh (fsdp) would otherwise pick GPU LOCAL_RANK, which emulated
    # devices sharing one GPU do not have
    torch.cuda.set_device(device)
    torch.cuda.init()
    return device


def resolve_run(config: Any, overrides: dict, started: Started) -> tuple[TrainConfig, RunSpec]:
    """The config and its spec, every option parsed once; a built-in ``--task`` given without a dataset or
    model brings its own (edgetrain.kinds). Under torchrun with restarts every restart of the job shares one
    run directory; rank 0 continues it from its newest checkpoint (train/checkpoint.py, "torchrun restarts")."""
    if isinstance(config, (str, os.PathLike)):  # read once: the task's defaults and the config both need it
        config = read_config_file(config)
    in_config = source_values(config)[0]
    given = {*overrides, *in_config}
    if "resume" not in given:  # a resumed run is as its config.yaml says
        overrides = {**overrides, **task_defaults(overrides.get("task") or in_config.get("task"), given,
                                                  overrides.get("dataset") or in_config.get("dataset"))}
    cfg, spec = load_run(config, started.launch, **overrides)
    elastic_dir = _elastic_dir(cfg, started)
    if elastic_dir is None or started.rank != 0:
        return cfg, spec
    from edgetrain.train.checkpoint import checkpoint_files

    if not checkpoint_files(elastic_dir):
        return cfg, spec
    phase(cfg, started.rank, f"continuing the torchrun job's run in {elastic_dir} from its newest checkpoint")
    return load_run(config, started.launch, **{**overrides, "resume": str(elastic_dir)})


def _elastic_dir(cfg: TrainConfig, started: Started):
    if not started.torchrun or cfg.resume:
        return None
    from edgetrain.train.checkpoint import elastic_run_dir

    return elastic_run_dir(cfg.output, cfg.run_name)


def plan_run(cfg: TrainConfig, spec: RunSpec, user: UserParts, started: Started) -> RunPlan:
    """The run's plan: checked before the run directory and the devices (bad input leaves nothing), then
    the devices and their batches, the data loaded once, the host's speed, the run directory."""
    # The config is valid: the run is going to start, and from here on it needs torch.
    from edgetrain.cluster.peers import cluster_token
    from edgetrain.data import user_datasets
    from edgetrain.models import model_reference, user_models

    checked = _check_before_launch(cfg, spec, user)
    if user.model is not None:
        cfg = dataclasses.replace(cfg, model=model_reference(user.model))
    # The token goes to the devices beside the config, never in it: the config is written to the run directory.
    token = cluster_token(cfg.cluster_token, cfg.cluster_token_file, os.environ)
    cfg = dataclasses.replace(cfg, cluster_token=None)
    devices = plan_devices(cfg, started.world)
    # the checks that need the count: a cluster file's is known now
    spec = with_device_count(cfg, spec, len(devices), started.launch)
    user = dataclasses.replace(user, models=user_models(), datasets=user_datasets())
    plan = RunPlan(cfg, spec, started, tuple(devices), tuple(split_batch(cfg, devices, spec.local_batch)), (),
                   user, token=token, host_cores=None if started.torchrun else _host_cores())
    # a user's dataset in memory is the devices' to load: the launcher keeps no copy through the run (``checked``
    # goes with this frame)
    plan = dataclasses.replace(plan, data=_check_shares(plan, checked))
    return dataclasses.replace(plan, speeds=_speeds(plan), run_dir=_run_dir(plan))


def _host_cores() -> tuple[int, ...] | None:
    return tuple(sorted(os.sched_getaffinity(0))) if hasattr(os, "sched_getaffinity") else None  # macOS: none


def _check_before_launch(cfg: TrainConfig, spec: RunSpec, user: UserParts):
    """What the values cannot say, before the run directory; returns the dataset where a check built it."""
    from edgetrain.train.preflight import check_before_launch
    if cfg.power_file:  # unreadable: one line now, not one per device after the run directory is made
        read_watts_file(cfg.power_file)
    checked = check_before_launch(cfg, spec, user.model, user.task)
    accelerator_device(cfg.accelerator)
    return checked


def _check_shares(plan: RunPlan, checked: DataSplit | None) -> DataSplit | None:
    """Each device's share checked (resume, its data, its partition, the faults named); returns the data the
    launcher hands its emulated devices, if it loads it once."""
    from edgetrain.data import build_data
    from edgetrain.data.datasets import LOADED_ONCE
    from edgetrain.data.device_data import check_device_data, class_labels
    from edgetrain.data.partition import split_dataset
    from edgetrain.data.storage import SetupReads
    from edgetrain.train.checkpoint import check_resume_devices

    cfg, spec, started, devices = plan.cfg, plan.spec, plan.started, list(plan.devices)
    local_batches = list(plan.local_batches)
    if spec.checkpoint.resume_dir and started.rank == 0:
        check_resume_devices(spec.checkpoint.resume_dir, len(devices), spec.partition.local)
    check_device_data(cfg, spec, devices, local_batches, started.rank if started.torchrun else None)
    # digits' loader imports scikit-learn, a second of CPU in every device process: the launcher loads it once
    # and hands it to its emulated devices with their arguments. Under torchrun each device loads its own.
    data = (checked or build_data(cfg, spec.task)) if cfg.dataset in LOADED_ONCE and not started.torchrun else None
    setup_read = checked.details.get("setup_read") if checked is not None else None
    if setup_read:  # a dataset on storage: its index, described once here (a process under torchrun is its device)
        data = checked  # and handed on: a device that described it again would read every header again
        phase(cfg, started.rank, f"indexed {cfg.dataset} on storage: {SetupReads(**setup_read).describe()}")
    if spec.partition.local:  # a split that leaves a device short of a batch: refused before any device starts
        split_dataset(class_labels((data or build_data(cfg, spec.task)).train), spec.partition, local_batches,
                      spec.seed)
    beyond = next((f.rank for f in spec.faults if f.rank >= len(devices)), None)
    if beyond is not None:
        raise EdgetrainError(f"EDGETRAIN_FAULT names device {beyond}, but the run has {len(devices)} "
                             f"(ranks 0 to {len(devices) - 1}); name one of them or unset it")
    return data


def _speeds(plan: RunPlan) -> tuple[float | None, ...]:
    """Measured once, before the devices start, so they do not disturb each other's measurement."""
    cfg = plan.cfg
    needs = cfg.throttle and any(d.profile.speed is not None or d.profile.gflops is not None for d in plan.devices)
    if needs:
        phase(cfg, plan.started.rank, "measuring this host's core speed (GFLOPS) to throttle the devices to their "
                                      "profiles")
    return tuple(device_speed(d.profile) if needs else None for d in plan.devices)


def _run_dir(plan: RunPlan) -> str | None:
    """Rank 0's: a resumed run's own (its config.yaml as it was), else a new one with the config in it."""
    cfg, started = plan.cfg, plan.started
    if started.rank != 0:
        return None
    if cfg.resume:
        return cfg.resume
    elastic_dir = _elastic_dir(cfg, started)
    run_dir = new_run_dir(cfg.output, elastic_dir.name if elastic_dir else cfg.run_name)
    # under torchrun or the plain recipe the run has WORLD_SIZE devices, whatever --devices says
    write_yaml(run_dir / "config.yaml", {**cfg.to_dict(), **({"devices": started.world} if started.torchrun else {})})
    return str(run_dir)
