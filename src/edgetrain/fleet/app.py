"""edgetrain's federated rounds as a Flower app: a real fleet on Flower's own server and client processes.

Thousands of intermittent clients do not fit a static process group, so a
fleet runs on Flower (``pip install edgetrain[fleet]``): a SuperLink on the
server, a SuperNode on each device, and this module's ``server_app`` and
``client_app`` (Flower's Message API, flwr 1.41). The training is the same as
``--sync fedavg:steps=H`` (``comm/federated.py``), built from edgetrain's own
parts:

- ClientApp (``train``): the device builds the model (``models.build_model``),
  loads the global parameters from the message, takes ``local-steps`` steps of
  plain SGD on its own partition (``data.partition.split_dataset``, partition
  ``partition-id`` of ``num-partitions`` from the SuperNode's ``--node-config``;
  every device computes the same split from the seed, so no data moves), and
  replies with its update ``x - y_i`` encoded by the ``compress`` compressor
  (``comm/compress``) and packed into one byte array: edgetrain's wire format
  (``Payload.pack``), so every compressor's dtypes (bf16, int8, indices)
  cross Flower unchanged, and the bytes per client are the payload's.
- ServerApp (``main``): ``EdgetrainStrategy``, a subclass of Flower's
  message-based ``FedAvg``, keeps its sampling, its ``start`` loop and its
  handling of failed replies; its ``aggregate_train`` decodes each update
  (``unpack`` with the compressor's ``layout``), takes the plain mean over the
  replies that arrived and steps the global model with edgetrain's pure
  ``server_step`` and ``server_optimizer`` (``server-opt``: fedavg, fedavgm,
  fedadam). The mean is unweighted as in ``comm/federated.py`` (each client
  takes the same number of steps of the same batch).
- A client that fails (its ClientApp raises, its node is gone) comes back as an
  error reply, which Flower's ``FedAvg`` leaves out (the old API's
  ``accept_failures``): the round steps with the others' mean. A round with no
  reply leaves the model as it was.

Options are Flower's run config (``[tool.flwr.app.config]`` of the app's
``pyproject.toml``, overridable with ``flwr run --run-config``), parsed once
by ``fleet_spec`` into a ``FleetSpec`` with edgetrain's own spec parsers.

Limits: only parameters travel (BatchNorm running statistics stay each
device's own, as with ``--batchnorm local``); a ClientApp keeps no state
between rounds here, so there is no error feedback (compressors run without
their residual memory), no client momentum, no FedProx/SCAFFOLD, and
``randk`` (whose shared indices the server would need) and ``powersgd`` (a DDP
hook, not a ``Compressor``) are refused. Federated evaluation is off; the
server evaluates nothing either (the test set is the caller's to use).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from edgetrain.comm.compress.base import Compressor, unpack
from edgetrain.comm.compress.spec import build_compressor
from edgetrain.comm.federated import server_optimizer, server_step
from edgetrain.comm.params import flatten, unflatten
from edgetrain.config import TrainConfig
from edgetrain.data.datasets import build_data, check_dataset
from edgetrain.data.partition import split_dataset
from edgetrain.errors import EdgetrainError
from edgetrain.models import build_model, check_model
from edgetrain.spec import CompressSpec, PartitionSpec, ServerOptSpec, parse_compress, parse_partition, \
    parse_server_opt

try:
    from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
    from flwr.clientapp import ClientApp
    from flwr.serverapp import Grid, ServerApp
    from flwr.serverapp.strategy import FedAvg, Result
except ImportError:  # one line through the CLI, not a traceback
    raise EdgetrainError("edgetrain.fleet needs Flower (flwr), which is not installed; "
                         "install it with: pip install edgetrain[fleet]") from None

# run-config keys and their defaults (the app's pyproject.toml repeats them for `flwr run`)
DEFAULTS: dict[str, bool | float | int | str] = {
    "model": "small_cnn", "dataset": "digits", "data-dir": "", "partition": "iid", "num-rounds": 3,
    "local-steps": 5, "batch-size": 16, "lr": 0.05, "compress": "none", "server-opt": "fedavg",
    "fraction-train": 1.0, "min-nodes": 2, "round-timeout": 600.0, "seed": 0,
}
TYPE_NAMES = {int: "whole number", float: "number", str: "string", bool: "true or false"}
# compressors whose payload the server cannot decode without state the client keeps to itself
SERVER_CANNOT_DECODE = {"randk": "its shared random indices", "powersgd": "its low-rank state (a DDP hook)"}


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


def fleet_spec(run_config: dict) -> FleetSpec:
    """Parse and validate a Flower run config; raise ``EdgetrainError`` naming the key and the fix."""
    unknown = sorted(set(run_config) - set(DEFAULTS))
    if unknown:
        raise EdgetrainError(f"unknown run-config key {unknown[0]!r}; known keys: {', '.join(DEFAULTS)}")
    cfg = {key: _typed(key, value) for key, value in {**DEFAULTS, **run_config}.items()}
    for key in ("num-rounds", "local-steps", "batch-size", "min-nodes"):
        if cfg[key] < 1:
            raise EdgetrainError(f"run-config {key} must be a whole number >= 1, got {cfg[key]!r}")
    if not 0.0 < cfg["fraction-train"] <= 1.0:
        raise EdgetrainError(f"run-config fraction-train must be in (0, 1], got {cfg['fraction-train']!r}")
    if cfg["lr"] < 0 or cfg["round-timeout"] <= 0:
        raise EdgetrainError(f"run-config lr must be >= 0 and round-timeout > 0, got {cfg['lr']!r} and "
                             f"{cfg['round-timeout']!r}")
    check_model(cfg["model"])
    check_dataset(cfg["dataset"])
    partition = parse_partition(cfg["partition"])
    if not partition.local:
        raise EdgetrainError("run-config partition none gives no device its own data; use iid, dirichlet:ALPHA "
                             "or shards:K")
    compress = parse_compress(cfg["compress"])
    if compress.method in SERVER_CANNOT_DECODE:
        raise EdgetrainError(f"run-config compress {compress.text}: the server cannot decode it without "
                             f"{SERVER_CANNOT_DECODE[compress.method]}; use none, fp16, bf16, int8, qsgd, topk, "
                             "sign or threshold")
    return FleetSpec(cfg["model"], cfg["dataset"], cfg["data-dir"] or None, partition, cfg["num-rounds"],
                     cfg["local-steps"], cfg["batch-size"], cfg["lr"], compress,
                     parse_server_opt(cfg["server-opt"]), cfg["fraction-train"], cfg["min-nodes"],
                     cfg["round-timeout"], cfg["seed"])


def _typed(key: str, value):
    """``value`` as the type of ``key``'s default (TOML gives 1 for 1.0; a string is a mistake for a number)."""
    kind = type(DEFAULTS[key])
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if not isinstance(value, kind) or isinstance(value, bool) != (kind is bool):
        raise EdgetrainError(f"run-config {key} must be a {TYPE_NAMES[kind]}, got {value!r}")
    return value


def load_data(spec: FleetSpec):
    """The dataset the spec names, built as ``edgetrain train`` builds it."""
    return build_data(TrainConfig(dataset=spec.dataset, data_dir=spec.data_dir, seed=spec.seed))


def global_model(spec: FleetSpec, data) -> nn.Module:
    """The model, its initial weights from the seed (a client overwrites them with the global ones)."""
    torch.manual_seed(spec.seed)
    return build_model(spec.model, data.input_shape[0], data.num_classes)


def parameter_record(model: nn.Module) -> ArrayRecord:
    """The model's parameters (not its buffers) as the record that travels."""
    return ArrayRecord({name: p.detach() for name, p in model.named_parameters()})


def load_parameters(model: nn.Module, record: ArrayRecord) -> None:
    model.load_state_dict(record.to_torch_state_dict(), strict=False)


def compressor_for(spec: FleetSpec, server_round: int = 0, partition_id: int = 0) -> Compressor:
    """The update's compressor, without its error-feedback memory (no state between rounds); QSGD's rounding
    noise differs between clients and rounds. Decoding needs neither (randk, which would, is refused)."""
    compressor, _memory = build_compressor(spec.compress, seed=spec.seed + server_round, rank=partition_id)
    return compressor


def local_update(spec: FleetSpec, model: nn.Module, data, partition: np.ndarray, server_round: int,
                 partition_id: int) -> tuple[torch.Tensor, float]:
    """``local-steps`` SGD steps on the device's own samples; the update ``x - y`` and the mean loss."""
    start = flatten([p.detach() for p in model.parameters()])
    optimizer = torch.optim.SGD(model.parameters(), lr=spec.lr)
    rng = np.random.default_rng((spec.seed, server_round, partition_id))
    model.train()
    losses = []
    for _ in range(spec.local_steps):
        x, y = data.train[torch.from_numpy(rng.choice(partition, size=spec.batch_size, replace=False))]
        loss = nn.functional.cross_entropy(model(x), y)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return start - flatten([p.detach() for p in model.parameters()]), float(np.mean(losses))


def client_partition(spec: FleetSpec, data, node_config: dict) -> tuple[int, np.ndarray]:
    """This device's partition id and sample indices, from its SuperNode's ``--node-config``."""
    try:
        partition_id, partitions = int(node_config["partition-id"]), int(node_config["num-partitions"])
    except KeyError as key:
        raise EdgetrainError(f"the SuperNode has no {key.args[0]} in --node-config; start it with "
                             "--node-config 'partition-id=0 num-partitions=N'") from None
    if not 0 <= partition_id < partitions:
        raise EdgetrainError(f"partition-id {partition_id} is outside 0..{partitions - 1} (num-partitions)")
    parts = split_dataset(data.train.labels.numpy(), spec.partition, [spec.batch_size] * partitions, spec.seed)
    return partition_id, parts[partition_id]


def to_wire(compressor: Compressor, update: torch.Tensor) -> np.ndarray:
    """The encoded update as one byte array: edgetrain's wire format (``Payload.pack``)."""
    return compressor.encode(update).pack().numpy()


def from_wire(compressor: Compressor, wire: np.ndarray, numel: int) -> torch.Tensor:
    """Inverse of ``to_wire`` for an update of ``numel`` values."""
    buffer = torch.from_numpy(wire.copy())
    return compressor.decode(unpack(buffer, compressor.layout(numel, buffer.numel()), numel))


client_app = ClientApp()


@client_app.train()
def train(msg: Message, context: Context) -> Message:
    spec = fleet_spec(context.run_config)
    data = load_data(spec)
    partition_id, partition = client_partition(spec, data, context.node_config)
    model = global_model(spec, data)
    load_parameters(model, msg.content["arrays"])
    server_round = int(msg.content["config"]["server-round"])
    update, loss = local_update(spec, model, data, partition, server_round, partition_id)
    wire = to_wire(compressor_for(spec, server_round, partition_id), update)
    content = RecordDict({"arrays": ArrayRecord(numpy_ndarrays=[wire]),
                          "metrics": MetricRecord({"num-examples": len(partition), "train-loss": loss,
                                                   "payload-bytes": int(wire.nbytes)})})
    return Message(content=content, reply_to=msg)


class EdgetrainStrategy(FedAvg):
    """Flower's FedAvg sampling and failure handling; edgetrain's decoding and server step."""

    def __init__(self, spec: FleetSpec, model: nn.Module, **fedavg):
        super().__init__(fraction_evaluate=0.0, **fedavg)
        self.spec, self.compressor = spec, compressor_for(spec)
        self.names = [name for name, _ in model.named_parameters()]
        self.global_tensors = [p.detach().clone() for p in model.parameters()]
        self.global_flat = flatten([p.detach() for p in model.parameters()]).requires_grad_(True)
        self.optimizer = server_optimizer(self.global_flat, spec.server_opt)

    def decode(self, reply: Message) -> torch.Tensor:
        return from_wire(self.compressor, reply.content["arrays"].to_numpy_ndarrays()[0], self.global_flat.numel())

    def aggregate_train(self, server_round: int, replies) -> tuple[ArrayRecord | None, MetricRecord | None]:
        valid, _failed = self._check_and_log_replies(list(replies), is_train=True)
        if not valid:
            return None, None
        mean_update = torch.stack([self.decode(reply) for reply in valid]).mean(0)
        server_step(self.global_flat, mean_update, self.optimizer)
        unflatten(self.global_flat.detach(), self.global_tensors)
        metrics = self.train_metrics_aggr_fn([reply.content for reply in valid], self.weighted_by_key)
        return ArrayRecord(dict(zip(self.names, self.global_tensors))), metrics


def run_server(grid: Grid, run_config: dict) -> Result:
    """The whole federated run on ``grid``: Flower's ``Strategy.start`` with ``EdgetrainStrategy``."""
    spec = fleet_spec(run_config)
    model = global_model(spec, load_data(spec))
    strategy = EdgetrainStrategy(spec, model, fraction_train=spec.fraction_train, min_train_nodes=1,
                                 min_available_nodes=spec.min_nodes)
    return strategy.start(grid, parameter_record(model), num_rounds=spec.num_rounds, timeout=spec.round_timeout,
                          train_config=ConfigRecord())


server_app = ServerApp()


@server_app.main()
def main(grid: Grid, context: Context) -> None:
    run_server(grid, context.run_config)
