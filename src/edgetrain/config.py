"""The training configuration: one flat dataclass, loaded from YAML and CLI flags.

Every field is an option of ``edgetrain train`` (``--batch-size`` for
``batch_size``) and a key of the YAML file given with ``--config``. Values are
checked on load; a wrong key, type or value is one line naming the key.
Floats must be finite: ``nan`` and ``inf`` parse as floats but would train to
a loss of nan or overflow a timeout in a device.

``resolve`` parses every string option once into a frozen ``RunSpec``
(``edgetrain.spec``) and is the one place that refuses combinations that
cannot run; ``load_config`` calls it, and the training loop, ``comm``,
``tiling`` and ``plan`` take the spec, not the strings. This module imports
only ``edgetrain.spec`` and ``edgetrain.errors`` of edgetrain (no torch):
checking a config is cheap, and nothing here reaches up into the packages
that take its specs.

What needs more than the values (the model, the data files, a tiling grid
on the model's feature maps) is ``edgetrain.preflight``, a layer above.
"""
from __future__ import annotations

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

import yaml

from edgetrain.errors import EdgetrainError
from edgetrain.spec import (DEDUP_DEFAULT_THRESHOLD, DEDUP_HASH_BITS, DEDUP_MAX_THRESHOLD, LINK_MODES,
                            RunSpec, check_compatible, get_link, parse_compress, parse_dedup, parse_sync,
                            parse_tiling)


def _opt(default: Any, help: str, choices: tuple | None = None, minimum: float | None = None, **extra) -> Any:
    meta = {"help": help, "choices": choices, "min": minimum, **extra}
    return field(default=default, metadata=meta)


@dataclass
class TrainConfig:
    # what to train
    model: str = _opt("small_cnn", "model name from the registry: small_cnn, resnet18, yolo_tiny (or one you registered)")
    dataset: str = _opt("digits", "digits (ships with scikit-learn), cifar10 (official python format, needs data_dir) or synthetic",
                        choices=("digits", "cifar10", "synthetic"))
    data_dir: str | None = _opt(None, "directory holding CIFAR-10's data_batch_1..5 and test_batch")
    image_size: int = _opt(32, "side of the synthetic dataset's square images", minimum=4)
    synthetic_samples: int = _opt(2048, "training images in the synthetic dataset (test set: a quarter of it)", minimum=1)
    augment: bool = _opt(True, "random crop and horizontal flip for CIFAR-10 training images")
    dedup: str = _opt("off", "drop near-duplicate training images before sampling: off, on (perceptual hashes within "
                      f"{DEDUP_DEFAULT_THRESHOLD} of {DEDUP_HASH_BITS} bits) or that Hamming distance "
                      f"0..{DEDUP_MAX_THRESHOLD} (higher drops more)")
    workers: int = _opt(0, "data-loader worker processes per device (0 = load in the training process)", minimum=0)

    # the cluster
    devices: int = _opt(1, "number of emulated devices on this host (ignored under torchrun, which sets WORLD_SIZE)", minimum=1)
    profile: str = _opt("host", "device profile for every emulated device: host, rpi4, jetson-nano, or one defined in the cluster file")
    cluster: str | None = _opt(None, "cluster file (YAML) listing devices and their profiles, batches and links")
    throttle: bool = _opt(True, "emulate each profile's compute speed by duty cycling (off: every device runs at host speed)")
    threads: int | None = _opt(None, "torch threads per device (default: the cores the device gets on this host)", minimum=1)

    # optimisation
    epochs: int = _opt(10, "passes over the training set", minimum=1)
    steps: int | None = _opt(None, "stop after this many steps (overrides epochs)", minimum=1)
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

    # communication over edge links
    compress: str = _opt("none", "gradient compression, e.g. none, fp16, topk:0.01, powersgd:2")
    sync: str = _opt("sync", "synchronisation: sync, local:H, async:S, gossip")
    link: str | None = _opt(None, "link of every device: a preset (lan-1g, wifi-20m, lte-10m, wan-intercontinental) or a spec")
    link_mode: str = _opt("virtual", "link emulation: virtual (model comm time on a virtual clock) or enforced (really wait)",
                          choices=("virtual", "enforced"))

    # spatial tiling
    strategy: str = _opt("ddp", "parallelism: ddp (data parallel) or tiled (spatial tiles of the early layers)",
                         choices=("ddp", "tiled"))
    grid: str = _opt("1x1", "tile grid ROWSxCOLS for --strategy tiled")
    groups: str = _opt("auto", "tiled layer groups: auto, or group ends as layer indices like 4,8: layers 0-3 and 4-7 "
                       "are fused groups, halos are exchanged between them, the data-parallel tail starts at 8")

    # run control and output
    eval: bool = _opt(True, "evaluate on the test set after every epoch")
    output: str = _opt("runs", "directory under which the run directory is made")
    run_name: str | None = _opt(None, "name of the run directory (default: train-<timestamp>)")
    cluster_token: str | None = _opt(None, "shared secret every node of a real cluster must give (or set "
                                     "EDGETRAIN_CLUSTER_TOKEN); checked right after the rendezvous, never written "
                                     "to the run directory")
    timeout: float = _opt(120.0, "seconds to wait for a peer (rendezvous and every collective) before giving up", minimum=1.0)
    progress: bool = _opt(True, "progress bar and start-up phase lines on rank 0")
    tensorboard: bool = _opt(False, "also write TensorBoard event files to <run>/tensorboard/ (needs the tensorboard "
                             "package: pip install tensorboard)")
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


def load_config(source: TrainConfig | dict | str | os.PathLike | None = None, **overrides: Any) -> TrainConfig:
    """Build a validated ``TrainConfig`` from a config object, a dict or a YAML path, then ``overrides``."""
    values: dict[str, Any] = {}
    origin = ""
    if isinstance(source, TrainConfig):
        values = source.to_dict()
    elif isinstance(source, dict):
        values, origin = dict(source), "config"
    elif source is not None:
        values, origin = read_yaml_mapping(source, "config file"), str(source)
    cfg = TrainConfig()
    for key, value in values.items():
        if key not in FIELDS:
            raise _unknown_key(key, origin)
        setattr(cfg, key, _coerce(key, value, origin))
    for key, value in overrides.items():
        if key not in FIELDS:
            raise _unknown_key(key, "overrides")
        setattr(cfg, key, _coerce(key, value, "command line"))
    validate(cfg)
    return cfg


def read_yaml_mapping(path: str | os.PathLike, what: str) -> dict:
    path = Path(path)
    if path.is_dir():
        raise EdgetrainError(f"{what} {path} is a directory; give the YAML file in it")
    if not path.is_file():
        raise EdgetrainError(f"{what} {path} does not exist")
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError:
        raise EdgetrainError(f"{what} {path} is not a text file (not UTF-8); give a YAML file") from None
    except OSError as e:
        raise EdgetrainError(f"cannot read {what} {path}: {e.strerror}") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        at = f" at line {mark.line + 1}" if mark else ""
        raise EdgetrainError(f"{what} {path} is not valid YAML{at}: {getattr(e, 'problem', e)}; "
                             f"fix the syntax there") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise EdgetrainError(f"{what} {path} must be a mapping of keys to values, not a {type(data).__name__}")
    return data


def validate(cfg: TrainConfig) -> None:
    """Checks that span several keys or need other modules; each failure names its key."""
    if cfg.local_batch not in ("even", "balanced"):
        try:
            sizes = [int(s) for s in cfg.local_batch.split(",")]
        except ValueError:
            raise EdgetrainError(f"config key 'local_batch' must be even, balanced or a list like 16,16,32, "
                                 f"not {cfg.local_batch!r}") from None
        if any(s < 1 for s in sizes):
            raise EdgetrainError(f"config key 'local_batch' needs every device's batch >= 1, not {cfg.local_batch!r}")
        if sum(sizes) != cfg.batch_size:
            raise EdgetrainError(f"config key 'local_batch' {cfg.local_batch} sums to {sum(sizes)}, "
                                 f"but batch_size is {cfg.batch_size}; make them agree")
    resolve(cfg)


def resolve(cfg: TrainConfig) -> RunSpec:
    """Every string option of ``cfg`` parsed once, and the combinations that cannot run refused, each
    in one line naming the key and the fix (the list is ``RunSpec``'s docstring)."""
    compress, sync = parse_compress(cfg.compress), parse_sync(cfg.sync)
    check_compatible(sync, compress)
    link = get_link(cfg.link)
    if cfg.link_mode not in LINK_MODES:
        raise EdgetrainError(f"link mode must be one of {', '.join(LINK_MODES)}, got {cfg.link_mode!r}")
    if cfg.batchnorm == "sync" and sync.mode != "sync":
        raise EdgetrainError(f"batchnorm sync all-reduces statistics at every forward, which --sync {sync.text} is "
                             "meant to avoid; use --batchnorm local")
    if compress.is_dgc and cfg.optimizer == "sgd" and cfg.momentum > 0:
        raise EdgetrainError(f"--compress {compress.text} applies momentum inside the hook (DGC momentum "
                             "correction); set --momentum 0 so that it is not applied twice")
    tiling = None
    if cfg.strategy == "tiled":
        # Tiled training's exchanges (halos, the hand-off, gradients) run uncompressed, every step, on
        # the host's network: options that would change them are refused, not silently ignored.
        for key, text, ignored in (("compress", compress.text, compress.method != "none"),
                                   ("sync", sync.text, sync.mode != "sync")):
            if ignored:
                raise EdgetrainError(f"config key '{key}' {text} does not apply to strategy tiled, whose exchanges "
                                     f"are uncompressed and synchronous every step; drop --{key} or use --strategy ddp")
        if link is not None:
            raise EdgetrainError(f"config key 'link' {cfg.link} does not apply to strategy tiled, which does not "
                                 f"emulate links (its exchanges run on the host's network); drop --link or use "
                                 f"--strategy ddp")
        tiling = parse_tiling(cfg.grid, cfg.groups)
        if not cfg.cluster and "WORLD_SIZE" not in os.environ and cfg.devices != tiling.devices:
            raise EdgetrainError(f"config key 'devices' is {cfg.devices} but grid {cfg.grid} needs {tiling.devices} "
                                 f"devices, one per tile; set --devices {tiling.devices}")
    elif cfg.grid != "1x1":
        raise EdgetrainError(f"config key 'grid' {cfg.grid} needs strategy tiled (--strategy tiled)")
    elif cfg.groups != "auto":
        raise EdgetrainError(f"config key 'groups' {cfg.groups} needs strategy tiled (--strategy tiled)")
    if cfg.tensorboard and importlib.util.find_spec("tensorboard") is None:
        # torch.utils.tensorboard writes the files but needs this package; a device would fail only after start-up
        raise EdgetrainError("config key 'tensorboard' needs the tensorboard package, which is not installed; "
                             "pip install tensorboard (or edgetrain[tensorboard]), or drop --tensorboard")
    return RunSpec(compress, sync, link, cfg.link_mode, cfg.strategy, tiling, cfg.timeout, cfg.seed,
                   cfg.accelerator, cfg.batchnorm, tensorboard=cfg.tensorboard,
                   dedup=parse_dedup(cfg.dedup))


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
    import argparse

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

