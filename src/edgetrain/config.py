"""The training configuration: one flat dataclass, loaded from YAML and CLI flags.

Every field is an option of ``edgetrain train`` (``--batch-size`` for
``batch_size``) and a key of the YAML file given with ``--config``. Values are
checked on load; a wrong key, type or value is one line naming the key.
Floats must be finite: ``nan`` and ``inf`` parse as floats but would train to
a loss of nan or overflow a timeout in a device.

``resolve`` parses every string option once into a frozen ``RunSpec``
(``edgetrain.spec``), then runs each kind's refusals (``edgetrain.kinds``)
and those of the run as a whole; ``load_run`` loads a config and resolves it
once, returning both, and the training loop, ``comm``, ``tiling`` and
``plan`` take the spec, not the strings. It
reads no environment: the launcher hands it a ``spec.LaunchSpec``. This module imports
only ``edgetrain.spec``, ``edgetrain.kinds``, ``edgetrain.yamlfile`` and ``edgetrain.errors`` of edgetrain (no torch):
checking a config is cheap, and nothing here reaches up into the packages
that take its specs.

What needs more than the values (the model, the data files, a tiling grid
on the model's feature maps) is ``edgetrain.train.preflight``, a layer above.
"""
from __future__ import annotations

import argparse
import dataclasses
import difflib
import importlib.util
import math
import os
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from edgetrain.errors import EdgetrainError
from edgetrain.kinds import (STRATEGIES, STRATEGY_KINDS, SYNC_KINDS, Draft, check_compatible, check_secure_aggregation,
                             is_user_task, owner, run_task, strategy_kind, task_kind)
from edgetrain.spec import (DEDUP_DEFAULT_THRESHOLD, DEDUP_HASH_BITS, DEDUP_MAX_THRESHOLD, FAULT_ENV, LINK_MODES,
                            PIPELINE_SCHEDULES, CheckpointSpec, LaunchSpec, RunSpec, get_link, launch_spec,
                            parse_compress, parse_dedup, parse_dp, parse_local_batch, parse_partition,
                            parse_round_deadline, parse_server_opt, parse_sync, usage)
from edgetrain.yamlfile import read_yaml_mapping


STORAGE_NAMES = ("sd-card", "emmc", "nvme", "hdd")  # cluster/profiles.STORAGES (tests/data/test_storage.py)


def _opt(default: Any, help: str, choices: tuple | None = None, minimum: float | None = None, **extra) -> Any:
    meta = {"help": help, "choices": choices, "min": minimum, **extra}
    return field(default=default, metadata=meta)


@dataclass
class TrainConfig:
    # what to train
    task: str | None = _opt(None, "what is learned: classification, regression or detection (default: the one the "
                            "dataset implies: classification for digits, cifar10, synthetic, imagefolder, npz); "
                            "given alone it brings its own default dataset and model (regression: diabetes, mlp)")
    model: str = _opt("small_cnn", "model name from the registry: small_cnn, small_cnn_gn (GroupNorm), resnet18, "
                      "yolo_tiny, yolov2_tiny and yolov2_tiny_small (detectors) (or one you registered)")
    dataset: str = _opt("digits", "digits (ships with scikit-learn), cifar10 (official python format, needs data_dir), "
                        "synthetic, imagefolder or npz (your files at data_dir), shapes (generated detection "
                        "set), yolo or coco (detection files at data_dir), shards (packed by edgetrain data pack, "
                        "at data_dir, read from storage), or a name you registered")
    data_dir: str | None = _opt(None, "directory holding CIFAR-10's data_batch_1..5 and test_batch; the image folder "
                                "(one subfolder per class) or the .npz file of dataset imagefolder or npz; the YOLO "
                                "(images/, labels/) or COCO (train.json, test.json) folder of dataset yolo or coco")
    image_size: int = _opt(32, "side of the synthetic dataset's square images; the side detection images (shapes, "
                           "yolo, coco) are made or resized to (--task detection: 128)", minimum=4)
    synthetic_samples: int = _opt(2048, "training images in the synthetic and shapes datasets (test set: a quarter "
                                  "of it)", minimum=1)
    augment: bool = _opt(True, "augment training images in the loader, seeded per (seed, epoch, image): random crop "
                         "and horizontal flip for CIFAR-10 and classification sets on storage, flip and scale "
                         "jitter moving the boxes for detection sets on storage (in-memory imagefolder, npz, "
                         "digits, synthetic, shapes: never)")
    partition: str = _opt("none", "each device's own data: none (one shared, globally shuffled dataset), iid, "
                          "dirichlet:ALPHA (label skew, e.g. 0.5) or shards:K (K label-sorted shards per device)")
    dedup: str = _opt("off", "drop near-duplicate training images before sampling: off, on (perceptual hashes within "
                      f"{DEDUP_DEFAULT_THRESHOLD} of {DEDUP_HASH_BITS} bits) or that Hamming distance "
                      f"0..{DEDUP_MAX_THRESHOLD} (higher drops more)")
    workers: int = _opt(0, "data-loader worker processes per device (0 = load in the training process)", minimum=0)
    prefetch: int = _opt(2, "batches each data-loader worker prepares ahead (with --workers >= 1)", minimum=1)
    from_storage: bool = _opt(False, "leave imagefolder and yolo datasets on storage and read each image when a "
                              "batch needs it (dataset shards always is); off: read them whole into memory first")
    cache_mb: float = _opt(0.0, "a training-aware cache of this many MB per device for datasets on storage (MinIO: "
                           "a fixed set of items, never evicted); 0: the page cache alone", minimum=0.0)
    cache_dir: str = _opt("/dev/shm", "where the --cache-mb cache lives (/dev/shm: memory; a local disk folder: a "
                          "disk cache in front of slower storage)")

    device_limits: str = _opt("off", "emulated devices' memory and storage as kernel limits: off, or cgroup (cgroup v1 "
                              "as root: the profile's memory_mb including the page cache, and its storage's read "
                              "MB/s and IOPS on the data's disk; falls back, said once, where the host cannot)",
                              choices=("off", "cgroup"))
    storage: str | None = _opt(None, "every device's storage, for --device-limits cgroup: sd-card, emmc, nvme or hdd "
                               "(default: its profile's)", choices=STORAGE_NAMES)

    # the cluster
    devices: int = _opt(1, "number of emulated devices on this host (ignored under torchrun, which sets WORLD_SIZE)", minimum=1)
    profile: str = _opt("host", "device profile for every emulated device: host, rpi4, jetson-nano, rpi5, rpi-zero-2w, "
                        "jetson-orin-nano, smart-speaker-2g, or one defined in the cluster file")
    cluster: str | None = _opt(None, "cluster file (YAML) listing devices and their profiles, batches and links")
    throttle: bool = _opt(True, "emulate each profile's compute speed by duty cycling (off: every device runs at host speed)")
    threads: int | None = _opt(None, "torch threads per device (default: the cores the device gets on this host)", minimum=1)

    # optimisation
    epochs: int = _opt(10, "passes over the training set", minimum=1)
    steps: int | None = _opt(None, "stop after this many steps, or at the end of --epochs if that comes first", minimum=1)
    batch_size: int = _opt(64, "global batch: samples per step summed over all devices", minimum=1)
    local_batch: str = _opt("even", "split of the global batch: even, balanced (to device speed) or a list like 16,16,32")
    optimizer: str = _opt("sgd", "sgd (with momentum) or adam", choices=("sgd", "adam"))
    lr: float = _opt(0.05, "learning rate", minimum=0.0)
    momentum: float = _opt(0.9, "SGD momentum", minimum=0.0)
    weight_decay: float = _opt(5e-4, "L2 weight decay", minimum=0.0)
    schedule: str = _opt("cosine", "learning-rate schedule over the run", choices=("constant", "cosine"))
    batchnorm: str = _opt("local", "BatchNorm statistics: local (per device, DDP's default) or sync (over all devices: "
                          "same result as one device)", choices=("local", "sync"))
    seed: int = _opt(0, "seed for weights, shuffling and augmentation", minimum=0)
    dp: str = _opt("off", "differential privacy: off, or clip=C with epsilon=E (a target for the run, the noise "
                   "derived) or noise=SIGMA (a noise multiplier), [delta=1e-5], [level=sample (DP-SGD, default) or "
                   "device (DP-FedAvg: clip each device's round update, with --sync fedavg:E)]; e.g. "
                   "clip=1.0,epsilon=8")

    # communication over edge links
    compress: str = _opt("none", "gradient compression, e.g. none, fp16, topk:0.01, powersgd:2")
    sync: str = _opt("sync", f"synchronisation: {usage('sync')} (fedavg:E: federated rounds of E local epochs; "
                     "fedavg:steps=H; options :prox=MU, :scaffold, :weighted, :reset)")
    server_opt: str = _opt("fedavg", "federated server step: fedavg, fedavgm[:lr=1:momentum=0.9] or "
                           "fedadam[:lr=0.01:beta1=0.9:beta2=0.99:eps=0.001]")
    participation: float = _opt(1.0, "federated rounds: fraction of devices sampled per round, in (0, 1]")
    round_deadline: str = _opt("off", "rounds of local:H and fedavg:E: a device that has not finished its local steps "
                               "by then is left out of the round: off, auto (2x the median round time of recent "
                               "rounds) or SECONDS on the device's clock (virtual time with --link)")
    link: str | None = _opt(None, "link of every device: a preset (lan-1g, wifi-20m, lte-10m, wan-intercontinental) or a spec")
    secure_aggregation: bool = _opt(False, "mask every device's update so that peers see only the sum "
                                    "(pairwise X25519 masks, fixed point mod 2^32): --sync sync, local:H, diloco:H "
                                    "and fedavg:E with --compress none or randk:RATIO; needs edgetrain[secure-"
                                    "aggregation]")
    link_mode: str = _opt("virtual", "link emulation: virtual (model comm time on a virtual clock) or enforced (really wait)",
                          choices=("virtual", "enforced"))

    # spatial tiling
    strategy: str = _opt("ddp", "parallelism: ddp (data parallel), tiled (spatial tiles of the early layers), "
                         "fsdp (parameters, gradients and optimizer state sharded over the devices) or pipeline "
                         "(the model's layers split into stages, one per device)", choices=STRATEGIES)
    grid: str = _opt("1x1", "tile grid ROWSxCOLS for --strategy tiled")
    groups: str = _opt("auto", "tiled layer groups: auto, or group ends as layer indices like 4,8: layers 0-3 and 4-7 "
                       "are fused groups, halos are exchanged between them, the data-parallel tail starts at 8")

    # pipeline stages
    stages: str = _opt("auto", "pipeline stages for --strategy pipeline: auto (planned from counted layer FLOPs and "
                       "memory, device speeds and memory limits), even (layers split evenly over the devices) or the "
                       "layer indices where stages 1, 2, ... start, like 4,8")
    microbatches: int = _opt(4, "micro-batches per step for --strategy pipeline (must divide batch_size)", minimum=1)
    pipeline_schedule: str = _opt("gpipe", "pipeline schedule for --strategy pipeline: gpipe (all forwards, then all "
                                  "backwards) or 1f1b (one forward, one backward: fewer activations held)",
                                  choices=PIPELINE_SCHEDULES)
    pipeline_replicas: int = _opt(1, "--strategy pipeline: D pipelines side by side (devices = stages x D), each on "
                                  "1/D of the global batch, each stage's gradients all-reduced among its D devices "
                                  "through --compress", minimum=1)
    fsdp_replicas: int = _opt(1, "--strategy fsdp: R sharded replicas side by side (devices = shards x R), each "
                              "on 1/R of the global batch, exchanging between them as --sync says (sync: gradients "
                              "every step; diloco:H: DiLoCo's pseudo-gradient every H steps) through --compress",
                              minimum=1)

    # run control and output
    eval: bool = _opt(True, "evaluate on the test set after every epoch")
    output: str = _opt("runs", "directory under which the run directory is made")
    run_name: str | None = _opt(None, "name of the run directory (default: train-<timestamp>)")
    cluster_token: str | None = _opt(None, "shared secret every node of a real cluster must give; checked right "
                                     "after the rendezvous, never written to the run directory. Given as a flag it "
                                     "is VISIBLE TO OTHER USERS of the host (ps, /proc): prefer "
                                     "EDGETRAIN_CLUSTER_TOKEN or --cluster-token-file")
    cluster_token_file: str | None = _opt(None, "file whose first line is the cluster token (keep it mode 600): "
                                          "unlike --cluster-token, not shown by ps")
    power_file: str | None = _opt(None, "file holding this device's power draw in watts, kept current by a meter's "
                                  "logger (a Pi's USB meter): read through the training steps for measured joules "
                                  "per sample (else RAPL or a Jetson's INA3221 where readable, else the profile's "
                                  "power model, labelled modelled)")
    timeout: float = _opt(120.0, "seconds to wait for a peer (rendezvous and every collective) before giving up", minimum=1.0)
    progress: bool = _opt(True, "progress bar and start-up phase lines on rank 0")
    tensorboard: bool = _opt(False, "also write TensorBoard event files to <run>/tensorboard/ (needs the tensorboard "
                             "package: pip install tensorboard)")
    checkpoint_every: int | None = _opt(None, "write a checkpoint every N steps (atomic; default: only the final "
                                        "model, checkpoint.pt or, pipeline and fsdp, checkpoint/); SIGTERM then "
                                        "also stops with one", minimum=1)
    checkpoint_every_s: float | None = _opt(None, "write a checkpoint every S seconds (rank 0's clock decides, "
                                            "the devices agree at the next step); with --checkpoint-every too, "
                                            "whichever comes first", minimum=1.0)
    keep_checkpoints: int = _opt(2, "how many of the newest checkpoints to keep", minimum=1)
    min_devices: int | None = _opt(None, "elastic membership of emulated devices: when a device dies the others go on "
                                   "as long as this many remain, and a returning device rejoins (default: all "
                                   "devices, i.e. one lost device stops the run)", minimum=1)
    resume: str | None = _opt(None, "continue the run in this run directory from its newest checkpoint, with its "
                              "own config.yaml (options that change the training are refused)")
    accelerator: str = _opt("auto", "where each device computes: auto (cuda if torch sees a GPU, else cpu), cpu or "
                            "cuda (collectives stay on gloo)", choices=("auto", "cpu", "cuda"))

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


FIELDS = {f.name: f for f in dataclasses.fields(TrainConfig)}


def _base_type(annotation: str) -> tuple[type, bool]:
    """(type, optional) from a field annotation such as ``int | None``."""
    hint = typing.get_type_hints(TrainConfig)[annotation]
    args = typing.get_args(hint)
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        inner = [a for a in args if a is not type(None)]
        return inner[0], True
    return hint, False


def _coerce(key: str, value: Any, source: str) -> Any:
    typ, optional = _base_type(key)
    where = f" in {source}" if source else ""
    if value is None:
        if optional:
            return None
        raise EdgetrainError(f"config key '{key}'{where} must not be empty (expected {typ.__name__})")
    if typ is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "yes", "1", "on", "false", "no", "0", "off"):
            return value.lower() in ("true", "yes", "1", "on")
        raise EdgetrainError(f"config key '{key}'{where} must be true or false, not {value!r}")
    if typ is int:
        if isinstance(value, bool) or not (isinstance(value, int) or (isinstance(value, str) and value.strip().lstrip("-").isdigit())):
            raise EdgetrainError(f"config key '{key}'{where} must be an integer, not {value!r}; "
                                 f"give a whole number such as its default {FIELDS[key].default}")
        value = int(value)
    elif typ is float:
        try:
            if isinstance(value, bool):
                raise ValueError
            value = float(value)
        except (TypeError, ValueError):
            raise EdgetrainError(f"config key '{key}'{where} must be a number, not {value!r}; "
                                 f"give one such as its default {FIELDS[key].default}") from None
        if not math.isfinite(value):
            raise EdgetrainError(f"config key '{key}'{where} must be a finite number, not {value!r}; "
                                 f"give one such as its default {FIELDS[key].default}")
    elif typ is str:
        if isinstance(value, (dict, list)):
            raise EdgetrainError(f"config key '{key}'{where} must be a string, not a {type(value).__name__}")
        value = str(value)
    meta = FIELDS[key].metadata
    if meta.get("choices") and value not in meta["choices"]:
        raise EdgetrainError(f"config key '{key}'{where} must be one of {', '.join(meta['choices'])}, not {value!r}")
    if meta.get("min") is not None and value < meta["min"]:
        raise EdgetrainError(f"config key '{key}'{where} must be >= {meta['min']:g}, not {value!r}")
    return value


def _unknown_key(key: str, source: str) -> EdgetrainError:
    prefixes = sorted((f for f in FIELDS if key.startswith(f + "_") or f.startswith(key)), key=len)
    close = prefixes[-1:] or difflib.get_close_matches(key, FIELDS, n=1)
    hint = f"; did you mean '{close[0]}'?" if close else f"; valid keys: {', '.join(FIELDS)}"
    where = f" in {source}" if source else ""
    return EdgetrainError(f"unknown config key '{key}'{where}{hint}")


@dataclass(frozen=True)
class ConfigFile:
    """A YAML config file read once (``read_config_file``): what it sets, and its path for the messages."""

    path: str
    values: dict


def read_config_file(path: str | os.PathLike) -> ConfigFile:
    return ConfigFile(str(path), read_yaml_mapping(path, "config file"))


Source = TrainConfig | ConfigFile | dict | str | os.PathLike | None


def load_config(source: Source = None, **overrides: Any) -> TrainConfig:
    """Build a validated ``TrainConfig`` from a config object, a dict or a YAML path, then ``overrides``."""
    return load_run(source, **overrides)[0]


def load_run(source: Source = None, launch: LaunchSpec | None = None, **overrides: Any
             ) -> tuple[TrainConfig, RunSpec]:
    """``load_config``'s config and its ``RunSpec``, every option resolved once (``resolve``, with ``launch``:
    how this process was started, read by the launcher)."""
    values, origin = source_values(source)
    cfg = _assign(TrainConfig(), values, origin, overrides)
    if cfg.resume:
        cfg = _resumed(cfg.resume, {**values, **overrides})
    return cfg, validate(cfg, launch)


def source_values(source: Source) -> tuple[dict[str, Any], str]:
    """The keys a config source sets (a ``TrainConfig`` sets every key) and where they come from."""
    if isinstance(source, TrainConfig):
        return source.to_dict(), ""
    if isinstance(source, ConfigFile):
        return dict(source.values), source.path
    if isinstance(source, dict):
        return dict(source), "config"
    if source is not None:
        return read_yaml_mapping(source, "config file"), str(source)
    return {}, ""


def _assign(cfg: TrainConfig, values: dict[str, Any], origin: str, overrides: dict[str, Any]) -> TrainConfig:
    """``cfg`` with ``values`` (from ``origin``), then ``overrides``, set on it, each key and value checked."""
    for key, value in values.items():
        if key not in FIELDS:
            raise _unknown_key(key, origin)
        setattr(cfg, key, _coerce(key, value, origin))
    for key, value in overrides.items():
        if key not in FIELDS:
            raise _unknown_key(key, "overrides")
        setattr(cfg, key, _coerce(key, value, "command line"))
    return cfg


# What a resumed run may set anew: how it is watched and stopped, not what it trains; and the number of devices,
# over which the same global batch is re-split (train/checkpoint.py, "Another number of devices").
RESUME_MAY_CHANGE = frozenset({"resume", "progress", "eval", "timeout", "workers", "prefetch", "cache_mb", "cache_dir",
                               "threads", "output", "run_name", "cluster_token", "cluster_token_file", "power_file",
                               "checkpoint_every", "checkpoint_every_s", "keep_checkpoints", "devices"})


def _resumed(run_dir: str, given: dict[str, Any]) -> TrainConfig:
    """The config of the run in ``run_dir`` (its config.yaml), with the options of ``given`` that may change on
    top; an option that would change the training is refused in one line naming it."""
    saved_path = Path(run_dir) / "config.yaml"
    if not saved_path.is_file():
        raise EdgetrainError(f"--resume {run_dir} is not a run directory (no config.yaml there); give the directory "
                             f"edgetrain train made, e.g. runs/train-<timestamp>")
    cfg = _assign(TrainConfig(), read_yaml_mapping(saved_path, "config file"), "config", {})
    for key, value in given.items():
        value = _coerce(key, value, "command line")
        if key not in RESUME_MAY_CHANGE and value != getattr(cfg, key):
            raise EdgetrainError(f"option '{key}' is {value!r} but the run in {run_dir} was trained with "
                                 f"{getattr(cfg, key)!r}; a resumed run continues as it was configured: drop "
                                 f"--{key.replace('_', '-')} or start a new run")
        setattr(cfg, key, value)
    cfg.resume = str(run_dir)
    return cfg


def validate(cfg: TrainConfig, launch: LaunchSpec | None = None) -> RunSpec:
    """Checks that span several keys or need other modules, each failure naming its key: ``resolve``."""
    return resolve(cfg, launch)


def resolve(cfg: TrainConfig, launch: LaunchSpec | None = None) -> RunSpec:
    """Every string option of ``cfg`` parsed once, then each kind's refusals (``edgetrain.kinds``) and those of
    the run as a whole, each in one line naming the key and the fix (the list is ``RunSpec``'s docstring).

    ``launch``: how this process was started, which the launcher reads from its environment
    (``spec.launch_spec``); left out, it is this process's own (the library's ``resolve(cfg)``)."""
    launch = launch_spec(os.environ) if launch is None else launch
    local_batch = parse_local_batch(cfg.local_batch, cfg.batch_size)
    compress, sync = parse_compress(cfg.compress), parse_sync(cfg.sync)
    check_compatible(sync, compress)
    link = get_link(cfg.link)
    if cfg.link_mode not in LINK_MODES:
        raise EdgetrainError(f"link mode must be one of {', '.join(LINK_MODES)}, got {cfg.link_mode!r}")
    if cfg.batchnorm == "sync" and not sync.kind.lockstep:
        raise EdgetrainError(f"batchnorm sync all-reduces statistics at every forward, which --sync {sync.text} is "
                             "meant to avoid; use --batchnorm local")
    partition, server_opt = parse_partition(cfg.partition), parse_server_opt(cfg.server_opt)
    task = run_task(cfg.task, cfg.dataset)
    # a task passed from Python has no descriptor: preflight checks it with the object
    task_of = None if is_user_task(task) else task_kind(task)
    dp = parse_dp(cfg.dp)
    draft = Draft(cfg, compress, sync, partition, link, launch, task_of, dp)
    strategy = strategy_kind(cfg.strategy)
    for kind in (compress.kind, strategy, sync.kind, task_of):
        if kind is not None:
            kind.check(draft)
    _refuse_keys_of_other_kinds(draft, strategy, sync.kind)
    if cfg.secure_aggregation:
        _check_secure_aggregation(draft)
    own = strategy.spec(draft)
    round_deadline = _check_run_wide(cfg, strategy, sync, partition)
    if dp is not None and not dp.per_sample and not sync.kind.device_dp:
        rounds = " or ".join(k.usage for k in SYNC_KINDS.values() if k.device_dp)
        raise EdgetrainError(f"config key 'dp' {dp.text} clips and noises each device's round update (DP-FedAvg), "
                             f"which --sync {sync.text} does not send; use --sync {rounds}, or --dp level=sample")
    spec = RunSpec(compress, sync, link, cfg.link_mode, cfg.strategy, own.get("tiling"), cfg.timeout, cfg.seed,
                   cfg.accelerator, cfg.batchnorm, pipeline=own.get("pipeline"),
                   fsdp_replicas=own.get("fsdp_replicas", 1), partition=partition, server_opt=server_opt,
                   participation=cfg.participation, round_deadline=round_deadline,
                   checkpoint=CheckpointSpec(cfg.checkpoint_every, cfg.keep_checkpoints, cfg.resume,
                                             cfg.checkpoint_every_s),
                   faults=launch.faults, torchrun=launch.torchrun, tensorboard=cfg.tensorboard,
                   dedup=parse_dedup(cfg.dedup), min_devices=cfg.min_devices, task=task, local_batch=local_batch,
                   secure_aggregation=cfg.secure_aggregation, dp=dp)
    # A cluster file's device count (or torchrun's) is only known once the devices are planned: train applies
    # with_device_count then, with the count the run will have.
    return with_device_count(cfg, spec, cfg.devices, launch) if draft.devices_known else spec


def _check_secure_aggregation(draft: Draft) -> None:
    """The kinds' refusals of ``--secure-aggregation`` (``kinds.check_secure_aggregation``), then its package."""
    check_secure_aggregation(draft)
    if importlib.util.find_spec("cryptography") is None:  # a device would fail only after start-up
        raise EdgetrainError("--secure-aggregation needs the cryptography package (X25519, HKDF, ChaCha20), which is "
                             "not installed; pip install 'edgetrain[secure-aggregation]', or drop "
                             "--secure-aggregation")


def _refuse_keys_of_other_kinds(draft: Draft, strategy, sync_kind) -> None:
    """A key that belongs to a strategy or sync mode other than the run's, changed from its default: one line."""
    cfg = draft.cfg
    for family, usage in (("strategy", "needs strategy {0} (--strategy {0})"), ("sync", "{1}")):
        for key in FIELDS:
            owning = owner(key, family)
            if owning is not None and owning not in (strategy, sync_kind) and draft.changed(key):
                raise EdgetrainError(f"config key '{key}' {getattr(cfg, key)} "
                                     + usage.format(owning.name, owning.options_hint if family == "sync" else ""))


def _check_run_wide(cfg: TrainConfig, strategy, sync, partition):
    """The run-wide options' refusals (partition, participation, round deadline, dedup on storage, tensorboard);
    returns the parsed round deadline."""
    if partition.local and not strategy.shards_batch:
        raise EdgetrainError(f"config key 'partition' {partition.text} does not apply to strategy {cfg.strategy}, "
                             "where every device reads the whole batch; drop --partition or use --strategy ddp")
    if not 0 < cfg.participation <= 1:
        raise EdgetrainError(f"config key 'participation' must be a fraction in (0, 1], not {cfg.participation:g}; "
                             "e.g. 0.3 samples 30% of the devices each round")
    round_deadline = parse_round_deadline(cfg.round_deadline)
    if round_deadline is not None and (not sync.kind.rounds or strategy.own_exchanges is not None):
        # lockstep modes and strategies of their own exchanges step together every step; gossip's pairwise and
        # async's background exchanges have no round for a deadline to close (comm/deadline.py says how async's
        # staleness bound relates)
        rounds = " and ".join(k.usage for k in SYNC_KINDS.values() if k.rounds)
        raise EdgetrainError(f"config key 'round_deadline' {round_deadline.text} bounds the rounds of --sync "
                             f"{rounds}, which --sync {sync.text} with strategy {cfg.strategy} does not have; "
                             f"drop --round-deadline or use --sync {rounds.replace(' and ', ' or ')}")
    if cfg.dedup != "off" and (cfg.from_storage or cfg.dataset == "shards"):
        # dedup hashes the training images as a tensor in memory; a dataset on storage is read item by item
        raise EdgetrainError(f"config key 'dedup' {cfg.dedup} hashes the training images held in memory, which a "
                             f"dataset on storage ({'--from-storage' if cfg.from_storage else 'shards'}) does not "
                             "hold; drop --dedup, or train from memory (`edgetrain data dedup` reports a folder's "
                             "near duplicates)")
    if cfg.tensorboard and importlib.util.find_spec("tensorboard") is None:
        # torch.utils.tensorboard writes the files but needs this package; a device would fail only after start-up
        raise EdgetrainError("config key 'tensorboard' needs the tensorboard package, which is not installed; "
                             "pip install tensorboard (or edgetrain[tensorboard]), or drop --tensorboard")
    return round_deadline


def with_device_count(cfg: TrainConfig, spec: RunSpec, n: int, launch: LaunchSpec | None = None) -> RunSpec:
    """``spec`` (``resolve(cfg)``) checked against ``n``, the number of devices the run will have, with
    ``--min-devices K`` kept only below it (elastic membership, train/elastic.py), else None (fail-stop).
    ``launch`` as for ``resolve``."""
    launch = launch_spec(os.environ) if launch is None else launch
    k = spec.min_devices
    devices = "--devices" if not cfg.cluster else f"the {n} devices of cluster file {cfg.cluster}"
    if k is not None and k > n:
        raise EdgetrainError(f"--min-devices {k} is more than the {n} devices of the run; give 1 to {n}")
    back = next((f for f in spec.faults if f.back_s is not None), None)
    if back is not None and (k is None or k >= n):
        raise EdgetrainError(f"{FAULT_ENV} brings device {back.rank} back after {back.back_s:g} s, which needs an "
                             f"elastic run; add --min-devices below {devices} or drop :back=")
    if k is None or k == n:
        return dataclasses.replace(spec, min_devices=None)
    if launch.torchrun:
        raise EdgetrainError("--min-devices is for emulated devices on this host; under torchrun use its elastic "
                             "restarts (--nnodes MIN:MAX)")
    sync, partition = spec.sync, spec.partition
    elastic = " or ".join(kind.usage for kind in SYNC_KINDS.values() if kind.elastic)
    elastic_strategies = " or ".join(name for name, kind in STRATEGY_KINDS.items() if kind.elastic)
    refusals = (
        (not strategy_kind(cfg.strategy).elastic, f"strategy {cfg.strategy} splits the model or the images over "
                                                  f"the devices; use --strategy {elastic_strategies}"),
        (not sync.kind.elastic, f"--sync {sync.text} is not elastic yet; use --sync {elastic}"),
        (bool(cfg.checkpoint_every or cfg.checkpoint_every_s or cfg.resume),
         "survivors restore from a peer, not from checkpoints; drop --checkpoint-every/--resume"),
        (partition.local, f"--partition {partition.text} would lose a departed device's data; drop --partition"),
        (isinstance(spec.local_batch, tuple), f"local_batch {cfg.local_batch} cannot be re-split over the "
                                              f"devices that remain; use even or balanced"),
        (spec.dp is not None, f"--dp {cfg.dp}'s noise and accountant are set up once for the devices of the start "
                              "(re-forming the group with them is not built); drop --dp or --min-devices"),
    )
    for refused, why in refusals:
        if refused:
            raise EdgetrainError(f"--min-devices {k} (elastic membership) does not apply here: {why}")
    return spec


# Kernel pseudo-filesystems: writes there fail half-way or change the system, never make a run directory.
PSEUDO_FILESYSTEMS = (Path("/proc"), Path("/sys"))


def check_output_dir(path: str | os.PathLike, what: str) -> None:
    """Fail in one line unless a directory can be made (or exists) at ``path`` and be written; creates nothing."""
    target = Path(path).expanduser().resolve()
    for pseudo in PSEUDO_FILESYSTEMS:
        if target == pseudo or pseudo in target.parents:
            raise EdgetrainError(f"{what} {path} is under {pseudo}, a kernel pseudo-filesystem; "
                                 f"choose a directory on disk")
    existing = target
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir():
        raise EdgetrainError(f"{what} {path} is not a directory ({existing} exists and is not one); "
                             f"choose a directory")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise EdgetrainError(f"{what} {path} is not writable ({existing} does not let this user write); "
                             f"choose a directory you can write to")


def add_config_arguments(parser, names=None) -> None:
    """One ``--flag`` per config field (all, or ``names``); unset flags stay out of the namespace."""
    for name in names or FIELDS:
        f = FIELDS[name]
        typ, _ = _base_type(name)
        meta = f.metadata
        kwargs = {"dest": name, "default": argparse.SUPPRESS, "help": meta["help"] + f" (default: {f.default})"}
        flag = "--" + name.replace("_", "-")
        if typ is bool:
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, **kwargs)
        else:
            metavar = "|".join(meta["choices"]) if meta.get("choices") else typ.__name__.upper()
            parser.add_argument(flag, metavar=metavar, **kwargs)

