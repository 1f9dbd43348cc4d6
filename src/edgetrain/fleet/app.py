"""edgetrain's federated rounds as a Flower app: a real fleet on Flower's own server and client processes.

Design: docs/design/fleet.md ("Rounds as Flower apps").
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import functools
import json
import logging
import time

import numpy as np
import torch
from torch import nn
from torch.utils.data import Subset

from edgetrain.comm.compress.base import Compressor, unpack
from edgetrain.comm.compress.spec import build_compressor
from edgetrain.comm.compress.memory import Memory
from edgetrain.comm.exchange import compress
from edgetrain.comm.federated import corrected_gradient, server_optimizer, server_step
from edgetrain.comm.params import flatten, unflatten
from edgetrain.config import TrainConfig, check_output_dir
from edgetrain.data.datasets import build_data, check_dataset
from edgetrain.data.partition import split_dataset
from edgetrain.errors import EdgetrainError
from edgetrain.fleet.devices import DeviceGroup, ModelledFleet, RoundModel, parse_availability, parse_population
from edgetrain.tasks.flops import count_training_flops
from edgetrain.models import build_model, check_model
from edgetrain.files import atomic_write
from edgetrain.spec import CompressSpec, PartitionSpec, ServerOptSpec, parse_compress, parse_partition, \
    parse_server_opt
from edgetrain.data.device_data import class_labels
from edgetrain.kinds import COMPRESS_KINDS, run_task, task_kind
from edgetrain.tasks import Task, build_task
from edgetrain.train.evaluation import evaluate_task

try:
    from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MessageType, MetricRecord, RecordDict
    from flwr.clientapp import ClientApp
    from flwr.serverapp import Grid, ServerApp
    from flwr.serverapp.strategy import FedAvg, Result
    from flwr.common import Code, FitRes, Status, ndarrays_to_parameters, parameters_to_ndarrays
    from flwr.compat.common import recorddict_compat as compat
except ImportError:  # one line through the CLI, not a traceback
    raise EdgetrainError("edgetrain.fleet needs Flower (flwr), which is not installed; "
                         "install it with: pip install edgetrain[fleet]") from None
from edgetrain.fleet import privacy  # noqa: E402  (needs Flower too)

# run-config keys and their defaults (the app's pyproject.toml repeats them for `flwr run`)
# round-timeout: a dead or cut-off node leaves its round after this many seconds (Flower's own default is 600)
DEFAULTS: dict[str, bool | float | int | str] = {
    "model": "small_cnn", "dataset": "digits", "data-dir": "", "partition": "iid", "num-rounds": 3,
    "local-steps": 5, "batch-size": 16, "lr": 0.05, "compress": "none", "server-opt": "fedavg",
    "fraction-train": 1.0, "min-nodes": 2, "round-timeout": 120.0, "seed": 0,
    "prox-mu": 0.0, "scaffold": False, "fraction-evaluate": 1.0, "output-dir": "", "task": "",
    "population": "", "availability": "always", "round-deadline": 0.0, "server-evaluate": False,
    "synthetic-samples": 2048, "image-size": 32, **privacy.DEFAULTS,
}
TYPE_NAMES = {int: "whole number", float: "number", str: "string", bool: "true or false"}
STATE = "edgetrain"                   # the device's record in context.state
CONTROL = "scaffold-control"          # the server's control c in a train message's arrays
UPDATE, CONTROL_CHANGE = "update", "control-change"  # a reply's payloads (the rest are BatchNorm statistics)
MODEL_FILE = "global_model.pt"
ROUNDS_FILE = "fleet-rounds.jsonl"    # one line per round: the modelled clock, bytes, dropouts and accuracy


@dataclass(frozen=True)
class FleetSpec:
    """A Flower run config, parsed once."""

    model: str
    dataset: str
    data_dir: str | None
    partition: PartitionSpec
    num_rounds: int
    local_steps: int
    batch_size: int
    lr: float
    compress: CompressSpec
    server_opt: ServerOptSpec
    fraction_train: float
    min_nodes: int
    round_timeout: float
    seed: int
    prox_mu: float | None  # None: FedProx off
    scaffold: bool
    fraction_evaluate: float
    output_dir: Path | None
    task: str | None = None  # the built-in task (edgetrain.kinds), resolved: as given, else the dataset's
    population: tuple[DeviceGroup, ...] = ()  # () : no devices modelled (no modelled clock)
    availability: str = "always"              # parse_availability's text
    round_deadline: float | None = None       # modelled seconds; None: none
    server_evaluate: bool = False             # the global model on the whole test set, on the server, each round
    synthetic_samples: int = 2048             # the synthetic dataset's training images (thousands of devices)
    image_size: int = 32                      # ... and their side
    privacy: privacy.PrivacySpec = privacy.PrivacySpec()  # DP-FedAvg, SecAgg+ (fleet/privacy.py)


def fleet_spec(run_config: dict) -> FleetSpec:
    """Parse and validate a Flower run config; raise ``EdgetrainError`` naming the key and the fix."""
    unknown = sorted(set(run_config) - set(DEFAULTS))
    if unknown:
        raise EdgetrainError(f"unknown run-config key {unknown[0]!r}; known keys: {', '.join(DEFAULTS)}")
    cfg = {key: _typed(key, value) for key, value in {**DEFAULTS, **run_config}.items()}
    for key in ("num-rounds", "local-steps", "batch-size", "min-nodes", "synthetic-samples", "image-size"):
        if cfg[key] < 1:
            raise EdgetrainError(f"run-config {key} must be a whole number >= 1, got {cfg[key]!r}")
    if not 0.0 < cfg["fraction-train"] <= 1.0:
        raise EdgetrainError(f"run-config fraction-train must be in (0, 1], got {cfg['fraction-train']!r}")
    if not 0.0 <= cfg["fraction-evaluate"] <= 1.0:
        raise EdgetrainError(f"run-config fraction-evaluate must be in [0, 1] (0: no federated evaluation), got "
                             f"{cfg['fraction-evaluate']!r}")
    if cfg["prox-mu"] < 0:
        raise EdgetrainError(f"run-config prox-mu must be >= 0 (0: FedProx off), got {cfg['prox-mu']!r}")
    if cfg["output-dir"]:
        check_output_dir(cfg["output-dir"], "run-config output-dir")
    if cfg["lr"] < 0 or cfg["round-timeout"] <= 0:
        raise EdgetrainError(f"run-config lr must be >= 0 and round-timeout > 0, got {cfg['lr']!r} and "
                             f"{cfg['round-timeout']!r}")
    check_model(cfg["model"])
    check_dataset(cfg["dataset"])
    task = task_kind(run_task(cfg["task"] or None, cfg["dataset"])).name  # one line for an unknown task
    partition = parse_partition(cfg["partition"])
    if not partition.local:
        raise EdgetrainError("run-config partition none gives no device its own data; use iid, dirichlet:ALPHA "
                             "or shards:K")
    compress = parse_compress(cfg["compress"])
    if compress.kind.server_cannot_decode:  # the client keeps what decoding needs to itself
        decodable = [kind.name for kind in COMPRESS_KINDS.values() if not kind.server_cannot_decode]
        raise EdgetrainError(f"run-config compress {compress.text}: the server cannot decode it without "
                             f"{compress.kind.server_cannot_decode}; use {', '.join(decodable[:-1])} or "
                             f"{decodable[-1]}")
    population = parse_population(cfg["population"])
    availability = parse_availability(cfg["availability"], cfg["seed"])  # one line for a bad one, before any round
    if cfg["round-deadline"] < 0:
        raise EdgetrainError(f"run-config round-deadline must be >= 0 seconds (0: none), got {cfg['round-deadline']!r}")
    if not population and (availability.kind.churns or cfg["round-deadline"]):
        raise EdgetrainError("run-config availability and round-deadline need a modelled clock; set population, "
                             "e.g. population='60% rpi4@wifi-20m, 40% jetson-orin-nano'")
    server_opt = parse_server_opt(cfg["server-opt"])
    private = privacy.privacy_spec(cfg, _has_buffers(cfg["model"]), server_opt)
    return FleetSpec(cfg["model"], cfg["dataset"], cfg["data-dir"] or None, partition, cfg["num-rounds"],
                     cfg["local-steps"], cfg["batch-size"], cfg["lr"], compress,
                     server_opt, cfg["fraction-train"], cfg["min-nodes"],
                     cfg["round-timeout"], cfg["seed"], cfg["prox-mu"] or None, cfg["scaffold"],
                     cfg["fraction-evaluate"], Path(cfg["output-dir"]) if cfg["output-dir"] else None,
                     task, population, cfg["availability"].strip(), cfg["round-deadline"] or None,
                     cfg["server-evaluate"], cfg["synthetic-samples"], cfg["image-size"], private)


@functools.lru_cache(maxsize=8)
def _has_buffers(model: str) -> bool:
    """Whether the model keeps statistics beside its parameters (BatchNorm), which the privacy options refuse."""
    return any(True for _ in build_model(model).buffers())


def _typed(key: str, value):
    """``value`` as the type of ``key``'s default (TOML gives 1 for 1.0; a string is a mistake for a number)."""
    kind = type(DEFAULTS[key])
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if not isinstance(value, kind) or isinstance(value, bool) != (kind is bool):
        raise EdgetrainError(f"run-config {key} must be a {TYPE_NAMES[kind]}, got {value!r}")
    return value


def load_data(spec: FleetSpec):
    """The dataset the spec names, built as ``edgetrain train`` builds it (once per process: a simulation's
    actor runs many devices' rounds)."""
    return _data(spec.dataset, spec.data_dir, spec.seed, spec.task, spec.synthetic_samples, spec.image_size)


@functools.lru_cache(maxsize=2)
def _data(dataset, data_dir, seed, task, synthetic_samples, image_size):
    return build_data(TrainConfig(dataset=dataset, data_dir=data_dir, seed=seed, task=task,
                                  synthetic_samples=synthetic_samples, image_size=image_size))


def fleet_task(spec: FleetSpec, data) -> Task:
    """The run's task (tasks/base.py): its loss trains each device, its evaluator scores the global model."""
    return build_task(spec.task, data)


def global_model(spec: FleetSpec, data) -> nn.Module:
    """The model, its initial weights from the seed (a client overwrites them with the global ones)."""
    torch.manual_seed(spec.seed)
    return build_model(spec.model, data.in_channels, data.num_classes)


def take_model(spec: FleetSpec, data) -> nn.Module:
    """``global_model``'s model for one device's call, built once per process and then reused (a simulation's
    actor runs many devices' rounds; the rebuild measured 1.2 ms of a 52.5 ms call): the call loads the global
    weights and statistics over all of it, and the generator is put back where a fresh build leaves it, so the call trains
    bit for bit as on a fresh model. Out of the pool while in use (calls at the same time each get their own);
    ``keep_model`` puts it back."""
    key = _model_key(spec, data)
    try:
        model = _IDLE_MODELS.get(key, []).pop()
    except IndexError:
        if len(_RNG_AFTER_BUILD) > 4:  # a process that meets many models keeps a few
            _IDLE_MODELS.clear()
            _RNG_AFTER_BUILD.clear()
        model = global_model(spec, data)
        _RNG_AFTER_BUILD[key] = torch.get_rng_state()
        return model
    torch.set_rng_state(_RNG_AFTER_BUILD[key])
    return model


def keep_model(spec: FleetSpec, data, model: nn.Module) -> None:
    """Back into the pool, once nothing of the call's reply refers to its tensors (a record holds copies)."""
    key = _model_key(spec, data)
    if key in _RNG_AFTER_BUILD:
        _IDLE_MODELS.setdefault(key, []).append(model)


def _model_key(spec: FleetSpec, data) -> tuple:
    return spec.model, spec.seed, data.in_channels, data.num_classes


_IDLE_MODELS: dict[tuple, list[nn.Module]] = {}
_RNG_AFTER_BUILD: dict[tuple, torch.Tensor] = {}


def model_record(model: nn.Module) -> ArrayRecord:
    """The global model that travels: its parameters and its BatchNorm statistics."""
    return ArrayRecord({name: t.detach() for name, t in model.state_dict().items()})


def load_global(model: nn.Module, record: ArrayRecord) -> None:
    """Load the global model (what else the message's arrays hold, SCAFFOLD's control, is not the model's)."""
    model.load_state_dict({name: t for name, t in record.to_torch_state_dict().items() if name != CONTROL})


def compressor_for(spec: FleetSpec, server_round: int = 0, partition_id: int = 0) -> tuple[Compressor, Memory]:
    """The update's compressor and an empty memory (a device loads its own, ``load_client_state``); QSGD's
    rounding noise differs between clients and rounds. Decoding needs neither (randk, which would, is refused)."""
    return build_compressor(spec.compress, seed=spec.seed + server_round, rank=partition_id)


class LocalResult(NamedTuple):
    update: torch.Tensor         # x - y_i
    loss: float                  # the mean over the local steps
    mean_gradient: torch.Tensor  # of the raw gradients: SCAFFOLD's new c_i


def local_update(spec: FleetSpec, model: nn.Module, data, partition: np.ndarray, server_round: int,
                 partition_id: int, control: torch.Tensor | None = None,
                 own_control: torch.Tensor | None = None) -> LocalResult:
    """``local-steps`` SGD steps on the device's own samples, each gradient corrected by FedProx (the
    model the round started from is the anchor) and SCAFFOLD (``control`` c and ``own_control`` c_i)."""
    params = list(model.parameters())
    task = fleet_task(spec, data)
    start = flatten([p.detach() for p in params])
    optimizer = torch.optim.SGD(params, lr=spec.lr)
    rng = np.random.default_rng((spec.seed, server_round, partition_id))
    model.train()
    losses, gradient_sum = [], torch.zeros_like(start)
    for _ in range(spec.local_steps):
        x, y = task.collate([data.train[int(i)] for i in rng.choice(partition, size=spec.batch_size, replace=False)])
        loss = task.loss(model(x), y) / spec.batch_size  # the task's sum, as a mean over the batch
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        gradient = flatten([p.grad for p in params])
        gradient_sum += gradient
        unflatten(corrected_gradient(gradient, flatten([p.detach() for p in params]), start, spec.prox_mu,
                                     control, own_control), [p.grad for p in params])
        optimizer.step()
        losses.append(loss.item())
    return LocalResult(start - flatten([p.detach() for p in params]), float(np.mean(losses)),
                       gradient_sum / spec.local_steps)


def client_partition(spec: FleetSpec, data, node_config: dict, split: str = "train") -> tuple[int, np.ndarray]:
    """This device's partition id and sample indices of ``split`` (train, or test: its own test split), from
    its SuperNode's ``--node-config``."""
    try:
        partition_id, partitions = int(node_config["partition-id"]), int(node_config["num-partitions"])
    except KeyError as key:
        raise EdgetrainError(f"the SuperNode has no {key.args[0]} in --node-config; start it with "
                             "--node-config 'partition-id=0 num-partitions=N'") from None
    if not 0 <= partition_id < partitions:
        raise EdgetrainError(f"partition-id {partition_id} is outside 0..{partitions - 1} (num-partitions)")
    key = (spec, split, partitions)
    if key not in _PARTS:  # once per process and fleet: a simulation's actor runs many devices' rounds
        if len(_PARTS) > 4:
            _PARTS.clear()
        dataset, min_size = (data.train, spec.batch_size) if split == "train" else (data.test, 1)
        _PARTS[key] = split_dataset(np.asarray(class_labels(dataset)), spec.partition, [min_size] * partitions,
                                    spec.seed)
    return partition_id, _PARTS[key][partition_id]


_PARTS: dict[tuple, list[np.ndarray]] = {}


def to_wire(compressor: Compressor, update: torch.Tensor, memory: Memory | None = None,
            key: str = UPDATE) -> np.ndarray:
    """The encoded update (plus what ``memory`` kept from before, under ``key``) as one byte array:
    edgetrain's wire format (``Payload.pack``)."""
    if memory is None:
        return compressor.encode(update).pack().numpy()
    return compress(update, compressor, memory, key)[0].pack().numpy()


def as_tensor(array) -> torch.Tensor:
    """A record's ``Array`` as a tensor of its own (Flower's buffer may be read-only)."""
    return torch.from_numpy(array.numpy().copy())


def from_wire(compressor: Compressor, wire: np.ndarray, numel: int) -> torch.Tensor:
    """Inverse of ``to_wire`` for an update of ``numel`` values."""
    buffer = torch.from_numpy(wire.copy())
    return compressor.decode(unpack(buffer, compressor.layout(numel, buffer.numel()), numel))


def load_client_state(state: RecordDict, memory: Memory, numel: int) -> torch.Tensor:
    """Put the device's compressor memory back from ``context.state``; return its SCAFFOLD control c_i."""
    record = state.get(STATE)
    saved = record.to_torch_state_dict() if record is not None else {}
    memory.load_state_dict({store: {name.split("/", 1)[1]: t for name, t in saved.items()
                                    if name.split("/", 1)[0] == store} for store in memory.stores})
    return saved.get("own-control", torch.zeros(numel))


def save_client_state(state: RecordDict, memory: Memory, own_control: torch.Tensor | None) -> None:
    """Keep the compressor memory and c_i (SCAFFOLD's; None without it) in ``context.state`` for the device's
    next round. Only what is used is kept: a simulation's driver holds every device's state."""
    kept = {f"{store}/{key}": t for store, pieces in memory.state_dict().items() for key, t in pieces.items()}
    state[STATE] = ArrayRecord({**kept, **({"own-control": own_control} if own_control is not None else {})})


def train(msg: Message, context: Context, overrides: dict | None = None) -> Message:
    """The device's round: the global model, ``local-steps`` steps on its partition, its encoded update back."""
    spec = fleet_spec({**context.run_config, **(overrides or {})})
    if spec.privacy.secure_aggregation:
        return secure_train(msg, context, spec)
    data = load_data(spec)
    partition_id, partition = client_partition(spec, data, context.node_config)
    model = take_model(spec, data)
    load_global(model, msg.content["arrays"])
    server_round = int(msg.content["config"]["server-round"])
    compressor, memory = compressor_for(spec, server_round, partition_id)
    numel = sum(p.numel() for p in model.parameters())
    own_control = load_client_state(context.state, memory, numel)
    control = as_tensor(msg.content["arrays"][CONTROL]) if spec.scaffold else None
    result = local_update(spec, model, data, partition, server_round, partition_id, control,
                          own_control if spec.scaffold else None)
    if spec.privacy.dp:  # the trained model itself: Flower's fixedclipping_mod clips it against the global one
        content = RecordDict({"arrays": model_record(model), "metrics": MetricRecord({
            "num-examples": len(partition), "train-loss": result.loss,
            "payload-bytes": sum(p.numel() * p.element_size() for p in model.parameters())})})
        keep_model(spec, data, model)
        return Message(content=content, reply_to=msg)
    payloads = {UPDATE: to_wire(compressor, result.update, memory, UPDATE)}
    if spec.scaffold:
        payloads[CONTROL_CHANGE] = to_wire(compressor, result.mean_gradient - own_control, memory, CONTROL_CHANGE)
        own_control = result.mean_gradient
    save_client_state(context.state, memory, own_control if spec.scaffold else None)
    buffers = {name: b.detach() for name, b in model.named_buffers()}
    content = RecordDict({"arrays": ArrayRecord({**{k: torch.from_numpy(v) for k, v in payloads.items()}, **buffers}),
                          "metrics": MetricRecord({"num-examples": len(partition), "train-loss": result.loss,
                                                   "payload-bytes": sum(int(v.nbytes) for v in payloads.values())})})
    keep_model(spec, data, model)
    return Message(content=content, reply_to=msg)


def secure_train(msg: Message, context: Context, spec: FleetSpec) -> Message:
    """The device's round under SecAgg+ (Flower's legacy fit messages, which ``secaggplus_mod`` masks): its
    update ``x - y_i`` back, one array per parameter, weight 1 (the fleet's mean is unweighted)."""
    fitins = compat.recorddict_to_fitins(msg.content, keep_input=True)
    data = load_data(spec)
    partition_id, partition = client_partition(spec, data, context.node_config)
    model = global_model(spec, data)
    params = list(model.parameters())
    unflatten(flatten([torch.from_numpy(np.array(a)) for a in parameters_to_ndarrays(fitins.parameters)]), params)
    result = local_update(spec, model, data, partition, int(fitins.config["server-round"]), partition_id)
    pieces = [torch.empty_like(p) for p in params]
    unflatten(result.update, pieces)
    fitres = FitRes(Status(Code.OK, ""), ndarrays_to_parameters([t.numpy() for t in pieces]), 1,
                    {"train-loss": result.loss})
    return Message(content=compat.fitres_to_recorddict(fitres, keep_input=True), reply_to=msg)


def evaluate(msg: Message, context: Context, overrides: dict | None = None) -> Message:
    """The global model on the device's own test split: its loss and the task's metrics (``eval-accuracy`` for a
    classifier), weighted by its test samples."""
    spec = fleet_spec({**context.run_config, **(overrides or {})})
    data = load_data(spec)
    _, test_split = client_partition(spec, data, context.node_config, split="test")
    model = global_model(spec, data)
    load_global(model, msg.content["arrays"])
    metrics = evaluate_task(model, Subset(data.test, test_split.tolist()), 0, 1, fleet_task(spec, data))
    return Message(content=RecordDict({"metrics": MetricRecord({"num-examples": len(test_split),
                                                                **{f"eval-{k}": v for k, v in metrics.items()}})}),
                   reply_to=msg)


def make_client_app(overrides: dict | None = None) -> ClientApp:
    """A ClientApp whose run config is the run's with ``overrides`` on top (the Python API's simulation, which
    has no run config of its own, passes the whole config here)."""
    app = ClientApp(mods=[privacy.privacy_mod(lambda context: fleet_spec({**context.run_config,
                                                                            **(overrides or {})}))])
    app.train()(lambda msg, context: train(msg, context, overrides))
    app.evaluate()(lambda msg, context: evaluate(msg, context, overrides))
    return app


client_app = make_client_app()


class EdgetrainStrategy(FedAvg):
    """Flower's FedAvg sampling, failure handling and evaluation; edgetrain's decoding and server step."""

    def __init__(self, spec: FleetSpec, model: nn.Module, **fedavg):
        super().__init__(fraction_evaluate=spec.fraction_evaluate, **fedavg)
        self.spec, self.compressor = spec, compressor_for(spec)[0]
        self.names = [name for name, _ in model.named_parameters()]
        self.global_tensors = [p.detach().clone() for p in model.parameters()]
        self.global_flat = flatten([p.detach() for p in model.parameters()]).requires_grad_(True)
        self.optimizer = server_optimizer(self.global_flat, spec.server_opt)
        self.buffers = {name: b.detach().clone() for name, b in model.named_buffers()}
        self.control = torch.zeros(self.global_flat.numel()) if spec.scaffold else None
        self.nodes = 0
        self.fleet = modelled_fleet(spec, model) if spec.population else None
        self.sampled: tuple[list[int], int] = ([], 0)  # this round's (sampled node ids, devices online)
        self.records: list[dict] = []                 # one per round with a modelled clock
        self.round_started = 0.0
        self.last_aggregated = 0                      # replies in the last aggregate (DP's accounting)

    def decode(self, wire) -> torch.Tensor:
        return from_wire(self.compressor, wire.numpy(), self.global_flat.numel())

    def update_of(self, arrays: ArrayRecord) -> torch.Tensor:
        """A reply's update ``x - y_i``: decoded, or (under DP, where the device sends its clipped model) taken."""
        if not self.spec.privacy.dp:
            return self.decode(arrays[UPDATE])
        return self.global_flat.detach() - flatten([as_tensor(arrays[name]) for name in self.names])

    def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid):
        self.nodes = len(list(grid.get_node_ids()))  # SCAFFOLD's N
        if self.spec.privacy.dp:  # the global model is the one Flower's DP wrapper noised, not our step's
            state = arrays.to_torch_state_dict()
            with torch.no_grad():
                self.global_flat.copy_(flatten([state[name] for name in self.names]))
        if self.control is not None:
            arrays = ArrayRecord({**arrays.to_torch_state_dict(), CONTROL: self.control.clone()})
        if self.fleet is None:
            return super().configure_train(server_round, arrays, config, grid)
        self.round_started = time.perf_counter()
        nodes = list(grid.get_node_ids())  # Flower's sampling, but among the devices online now
        self.sampled = self.fleet.sample(server_round, nodes, max(int(len(nodes) * self.fraction_train), 1))
        config["server-round"] = server_round
        record = RecordDict({self.arrayrecord_key: arrays, self.configrecord_key: config})
        return self._construct_messages(record, self.sampled[0], MessageType.TRAIN)

    def aggregate_train(self, server_round: int, replies) -> tuple[ArrayRecord | None, MetricRecord | None]:
        valid, _failed = self._check_and_log_replies(list(replies), is_train=True)
        if self.fleet is not None:
            valid = self.settle(server_round, valid)
        if not valid:
            return None, None
        arrays = [reply.content["arrays"] for reply in valid]
        self.last_aggregated = len(valid)
        server_step(self.global_flat, torch.stack([self.update_of(a) for a in arrays]).mean(0), self.optimizer)
        unflatten(self.global_flat.detach(), self.global_tensors)
        if self.control is not None:  # c + |S|/N mean_S(c_i' - c_i)
            self.control += torch.stack([self.decode(a[CONTROL_CHANGE]) for a in arrays]).sum(0) / self.nodes
        weights = torch.tensor([float(reply.content["metrics"]["num-examples"]) for reply in valid])
        weights /= weights.sum()
        for name, buffer in self.buffers.items():
            buffer.copy_(sum(w * as_tensor(a[name]).double() for w, a in zip(weights.tolist(), arrays)))
        metrics = self.train_metrics_aggr_fn([reply.content for reply in valid], self.weighted_by_key)
        return ArrayRecord({**dict(zip(self.names, self.global_tensors)), **self.buffers}), metrics

    def settle(self, server_round: int, valid: list[Message]) -> list[Message]:
        """The replies of the devices that finished within their online window and the deadline; the round's
        record (modelled clock, bytes, dropouts) kept."""
        sampled, online = self.sampled
        up = {reply.metadata.src_node_id: int(reply.content["metrics"]["payload-bytes"]) for reply in valid}
        record = self.fleet.settle(server_round, sampled, online, up)
        record["measured_train_wall_s"] = time.perf_counter() - self.round_started  # this machine's, not modelled
        kept = set(record.pop("kept"))
        self.records.append(record)
        self.write_records()
        logging.getLogger("flwr").info(
            "round %d (modelled): %.1f s, clock %.1f s; %d online, %d sampled, %d dropouts, %d late", server_round,
            record["modelled_round_s"], record["modelled_clock_s"], online, len(sampled), record["dropouts"],
            record["late"])
        return [reply for reply in valid if reply.metadata.src_node_id in kept]

    def aggregate_evaluate(self, server_round: int, replies):
        metrics = super().aggregate_evaluate(server_round, replies)
        if metrics is not None:
            self.note_accuracy(server_round, "federated", metrics)
        return metrics

    def note_round(self, server_round: int, figures: dict) -> None:
        """Put ``figures`` into the round's record (a record of its own without a modelled clock)."""
        record = next((r for r in self.records if r["round"] == server_round), None)
        if record is None:
            self.records.append(record := {"round": server_round})
        record.update(figures)
        self.write_records()

    def note_accuracy(self, server_round: int, where: str, metrics) -> None:
        """Put an evaluation's figures beside the round's modelled clock."""
        for record in self.records:
            if record["round"] == server_round:
                record.update({f"{where}_{key}": float(value) for key, value in metrics.items()
                               if key != "num-examples"})
                self.write_records()

    def write_records(self) -> None:
        """The rounds so far, in ``output-dir`` (rewritten whole each round: a long run can be read as it goes)."""
        if self.spec.output_dir is not None:
            write_rounds(self.spec.output_dir / ROUNDS_FILE, self.records)


def modelled_fleet(spec: FleetSpec, model: nn.Module) -> ModelledFleet:
    """The modelled clock of the run: its population, availability, deadline; one device's local-steps FLOPs
    (the trainer's own counter) and the bytes of what goes down (the model, SCAFFOLD's control)."""
    data = load_data(spec)
    sample = data.train[0][0]
    per_sample = count_training_flops(model, tuple(sample.shape), data.num_classes,
                                      task=fleet_task(spec, data))["total_flops"]
    down = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    if spec.scaffold:
        down += sum(p.numel() * p.element_size() for p in model.parameters())
    return ModelledFleet(RoundModel(spec.population, parse_availability(spec.availability, spec.seed),
                                    spec.round_deadline, per_sample * spec.batch_size * spec.local_steps, down),
                         spec.seed)


def server_evaluation(spec: FleetSpec, strategy: EdgetrainStrategy, model: nn.Module, data):
    """Flower's ``evaluate_fn``: the global model on the whole test set, on the server."""
    task = fleet_task(spec, data)

    def evaluate_fn(server_round: int, arrays: ArrayRecord) -> MetricRecord:
        load_global(model, arrays)
        metrics = evaluate_task(model, data.test, 0, 1, task)
        strategy.note_accuracy(server_round, "server", metrics)
        return MetricRecord(metrics)
    return evaluate_fn


def write_rounds(path: Path, records: list[dict]) -> None:
    """The rounds' records, one JSON line each (written whole, atomically)."""
    with atomic_write(path) as f:
        f.writelines(json.dumps(record) + "\n" for record in records)


def run_server(grid: Grid, run_config: dict) -> Result:
    """The whole federated run on ``grid``: Flower's ``Strategy.start`` with ``EdgetrainStrategy``; the final
    global model saved to ``output-dir`` if set."""
    spec = fleet_spec(run_config)
    data = load_data(spec)
    model = global_model(spec, data)
    strategy = EdgetrainStrategy(spec, model, fraction_train=spec.fraction_train, min_train_nodes=1,
                                 min_evaluate_nodes=1, min_available_nodes=spec.min_nodes)
    evaluate_fn = server_evaluation(spec, strategy, global_model(spec, data), data) if spec.server_evaluate else None
    wrapped = privacy.FleetDifferentialPrivacy(strategy, spec.privacy) if spec.privacy.dp else strategy
    result = wrapped.start(grid, model_record(model), num_rounds=spec.num_rounds, timeout=spec.round_timeout,
                           train_config=ConfigRecord(), evaluate_fn=evaluate_fn)
    if spec.output_dir is not None:  # the initial model if no round had a reply
        with atomic_write(spec.output_dir / MODEL_FILE, "wb") as f:
            torch.save((result.arrays if len(result.arrays) else model_record(model)).to_torch_state_dict(), f)
    return result


def serve(grid: Grid, context: Context, run_config: dict) -> None:
    """The ServerApp's run: Flower's SecAgg+ workflow with secure aggregation, else ``run_server``."""
    spec = fleet_spec(run_config)
    if not spec.privacy.secure_aggregation:
        run_server(grid, run_config)
        return
    strategy = secure_strategy(spec)
    privacy.run_secure_server(grid, context, strategy)
    if spec.output_dir is not None:
        names = [name for name, _ in global_model(spec, load_data(spec)).named_parameters()]
        with atomic_write(spec.output_dir / MODEL_FILE, "wb") as f:
            torch.save(dict(zip(names, strategy.params)), f)


def secure_strategy(spec: FleetSpec):
    """Flower's legacy FedAvg for SecAgg+ (which sums what it samples and hands the strategy only the mean),
    edgetrain's server step, each round's record and the server's evaluation."""
    data = load_data(spec)
    model = global_model(spec, data)
    records: list[dict] = []

    def on_round(server_round: int, figures: dict) -> None:
        if not records or records[-1]["round"] != server_round:
            records.append({"round": server_round})
        records[-1].update(figures)
        if spec.output_dir is not None:
            write_rounds(spec.output_dir / ROUNDS_FILE, records)
    def evaluate_fn(server_round: int, arrays, config):
        if server_round == 0:
            return None
        evaluated = global_model(spec, data)
        unflatten(flatten([torch.from_numpy(np.array(a)) for a in arrays]), list(evaluated.parameters()))
        metrics = evaluate_task(evaluated, data.test, 0, 1, fleet_task(spec, data))
        records[-1].update({f"server_{key}": float(value) for key, value in metrics.items()})
        on_round(server_round, {})
        return metrics["loss"], metrics
    strategy = privacy.secure_strategy_class()(spec, model, on_round, fraction_fit=spec.fraction_train,
                                               fraction_evaluate=0.0, min_fit_clients=2,
                                               min_available_clients=spec.min_nodes,
                                               evaluate_fn=evaluate_fn if spec.server_evaluate else None)
    strategy.records = records  # the rounds so far (also in output-dir when set)
    return strategy


def make_server_app(overrides: dict | None = None) -> ServerApp:
    """A ServerApp whose run config is the run's with ``overrides`` on top (see ``make_client_app``)."""
    app = ServerApp()
    app.main()(lambda grid, context: serve(grid, context, {**context.run_config, **(overrides or {})}))
    return app


server_app = make_server_app()
