"""The fleet's privacy options on Flower's own parts: device-level differential privacy (Flower's
``DifferentialPrivacyClientSideFixedClipping`` and ``fixedclipping_mod``, epsilon from Opacus's RDP accountant)
and secure aggregation (``secaggplus_mod`` and ``SecAggPlusWorkflow``). Options, limits and measurements:
docs/tutorials/federated-fleet.md."""
from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch

from edgetrain.comm.federated import server_optimizer, server_step
from edgetrain.comm.params import flatten, unflatten
from edgetrain.errors import EdgetrainError
from edgetrain.privacy.dp import rdp_epsilon

# Imported inside functions: opacus (the privacy extra, for epsilon only) and flwr's legacy server and common
# parts (only secure aggregation runs on them).

try:
    from flwr.app import ArrayRecord, Context, Message, MessageType
    from flwr.clientapp.mod import fixedclipping_mod
    from flwr.client.mod import secaggplus_mod
    from flwr.serverapp import Grid
    from flwr.serverapp.strategy import DifferentialPrivacyClientSideFixedClipping
except ImportError:  # one line through the CLI, not a traceback
    raise EdgetrainError("edgetrain.fleet needs Flower (flwr), which is not installed; "
                         "install it with: pip install edgetrain[fleet]") from None

# run-config keys of the privacy options and their defaults (fleet.app.DEFAULTS takes them in)
DEFAULTS: dict[str, bool | float | int] = {
    "dp-noise": 0.0, "dp-clip": 1.0, "dp-delta": 1e-5,
    "secure-aggregation": False, "secagg-shares": 3, "secagg-threshold": 2, "secagg-clip-range": 8.0,
}


@dataclass(frozen=True)
class PrivacySpec:
    dp_noise: float | None = None  # Gaussian noise multiplier z of DP-FedAvg; None: off
    dp_clip: float = 1.0           # each device's update clipped to this L2 norm
    dp_delta: float = 1e-5
    secure_aggregation: bool = False
    secagg_shares: int = 3         # SecAgg+: each device's secrets shared with this many devices
    secagg_threshold: int = 2      # ... of which this many must stay to the end of the round
    secagg_clip_range: float = 8.0  # each update's values clipped to [-range, range] before quantising

    @property
    def dp(self) -> bool:
        return self.dp_noise is not None


def privacy_spec(cfg: dict, model_has_buffers: bool, server_opt) -> PrivacySpec:
    """The privacy options of a typed run config, checked against the rest of it (one line each)."""
    spec = PrivacySpec(cfg["dp-noise"] or None, cfg["dp-clip"], cfg["dp-delta"], cfg["secure-aggregation"],
                       cfg["secagg-shares"], cfg["secagg-threshold"], cfg["secagg-clip-range"])
    if cfg["dp-noise"] < 0 or spec.dp_clip <= 0 or not 0 < spec.dp_delta < 1:
        raise EdgetrainError(f"run-config dp-noise must be >= 0 (0: off), dp-clip > 0 and dp-delta in (0, 1), got "
                             f"{cfg['dp-noise']!r}, {spec.dp_clip!r} and {spec.dp_delta!r}")
    if spec.secure_aggregation and not (2 <= spec.secagg_threshold < spec.secagg_shares and
                                        spec.secagg_clip_range > 0):
        raise EdgetrainError(f"run-config secagg-threshold must be >= 2 and below secagg-shares, and "
                             f"secagg-clip-range > 0, got {spec.secagg_threshold}, {spec.secagg_shares} and "
                             f"{spec.secagg_clip_range!r}")
    if not (spec.dp or spec.secure_aggregation):
        return spec
    option = "dp-noise" if spec.dp else "secure-aggregation"
    if spec.dp and spec.secure_aggregation:
        raise EdgetrainError("run-config dp-noise and secure-aggregation together are not supported; choose one")
    if cfg["compress"] != "none" or cfg["scaffold"]:
        raise EdgetrainError(f"run-config {option} needs the dense model update; set compress='none' and "
                             "scaffold=false")
    if model_has_buffers:
        raise EdgetrainError(f"run-config {option}: model {cfg['model']} has BatchNorm statistics, which would "
                             "leave the device unclipped and unmasked; use a GroupNorm model, e.g. "
                             "model='small_cnn_gn'")
    if spec.dp and (server_opt.name != "fedavg" or server_opt.lr != 1.0):
        raise EdgetrainError("run-config dp-noise adds Flower's noise to the stepped model, which is the noised "
                             "mean only for server-opt 'fedavg'; set server-opt='fedavg'")
    if spec.secure_aggregation and (cfg["population"] or cfg["fraction-evaluate"] > 0):
        raise EdgetrainError("run-config secure-aggregation runs Flower's SecAgg+ workflow, which has neither the "
                             "modelled devices nor federated evaluation; set population='' and "
                             "fraction-evaluate=0 (server-evaluate=true evaluates on the server)")
    return spec


def privacy_mod(spec_of):
    """The ClientApp's mod: Flower's ``secaggplus_mod`` or ``fixedclipping_mod`` as the run config asks
    (``spec_of(context)`` parses it), else nothing."""
    def mod(msg: Message, context: Context, call_next) -> Message:
        if msg.metadata.message_type != MessageType.TRAIN:
            return call_next(msg, context)
        spec = spec_of(context).privacy
        if spec.secure_aggregation:
            return secaggplus_mod(msg, context, call_next)
        if spec.dp:
            return fixedclipping_mod(msg, context, call_next)
        return call_next(msg, context)
    return mod


def epsilon(rounds: list[tuple[float, float]], delta: float) -> float:
    """Epsilon after ``rounds`` of (noise multiplier, sampling rate), by Opacus's RDP accountant (which assumes
    Poisson sampling; Flower samples a fixed number of devices, the usual approximation of DP-FedAvg)."""
    try:
        import opacus  # noqa: F401
    except ImportError:
        raise EdgetrainError("run-config dp-noise reports epsilon with Opacus, which is not installed; install it "
                             "with: pip install edgetrain[privacy]") from None
    return rdp_epsilon([(z, q, 1) for z, q in rounds], delta)


class FleetDifferentialPrivacy(DifferentialPrivacyClientSideFixedClipping):
    """Flower's client-side fixed clipping wrapper around the fleet's strategy: each device clips its update
    (``fixedclipping_mod``), the server adds Gaussian noise of std ``z C / n`` to the new model, ``n`` the
    devices sampled this round (Flower's wrapper takes ``n`` fixed; here it is each round's sample). Each
    round's epsilon goes into the fleet's round records."""

    def __init__(self, strategy, spec: PrivacySpec):
        super().__init__(strategy, spec.dp_noise, spec.dp_clip, num_sampled_clients=1)
        self.spec, self.history = spec, []

    def configure_train(self, server_round: int, arrays: ArrayRecord, config, grid: Grid):
        messages = list(super().configure_train(server_round, arrays, config, grid))
        self.num_sampled_clients = max(len(messages), 1)
        return messages

    def aggregate_train(self, server_round: int, replies):
        replies = list(replies)
        arrays, metrics = super().aggregate_train(server_round, replies)
        if arrays is None:
            return arrays, metrics
        kept = self.strategy.last_aggregated
        nodes = max(self.strategy.nodes, 1)
        # fewer replies than sampled: the mean's sensitivity is C / kept while the noise was scaled for n
        effective = self.noise_multiplier * kept / self.num_sampled_clients
        self.history.append((effective, self.num_sampled_clients / nodes))
        self.strategy.note_round(server_round, {
            "dp_noise_multiplier": self.noise_multiplier, "dp_effective_noise_multiplier": effective,
            "dp_clip": self.clipping_norm, "dp_sampled": self.num_sampled_clients, "dp_aggregated": kept,
            "dp_nodes": nodes, "dp_noise_std": self.noise_multiplier * self.clipping_norm / self.num_sampled_clients,
            "dp_delta": self.spec.dp_delta, "dp_epsilon": epsilon(self.history, self.spec.dp_delta)})
        return arrays, metrics


def run_secure_server(grid: Grid, context: Context, strategy) -> None:
    """The run on Flower's SecAgg+ workflow: ``strategy`` (a legacy Flower strategy) sees only the sum."""
    from flwr.server import ServerConfig
    from flwr.server.compat import LegacyContext
    from flwr.server.workflow import DefaultWorkflow, SecAggPlusWorkflow

    spec = strategy.spec
    legacy = LegacyContext(context=context, config=ServerConfig(num_rounds=spec.num_rounds,
                                                                round_timeout=spec.round_timeout),
                           strategy=strategy)
    # every device's weight is 1 (the fleet's mean is unweighted): max-weight 1 keeps SecAgg+'s whole
    # quantisation range for the update (with its default 1000, the step would be 1000 times coarser)
    workflow = SecAggPlusWorkflow(spec.privacy.secagg_shares, spec.privacy.secagg_threshold, max_weight=1.0,
                                  clipping_range=spec.privacy.secagg_clip_range, timeout=spec.round_timeout)
    DefaultWorkflow(fit_workflow=workflow)(grid, legacy)


def secure_strategy_class():
    """A legacy Flower FedAvg whose aggregate is SecAgg+'s mean of the updates, stepped with edgetrain's server
    optimizer (built lazily: flwr.server's legacy parts are only imported with secure aggregation)."""
    from flwr.common import FitRes, ndarrays_to_parameters, parameters_to_ndarrays
    from flwr.server.strategy import FedAvg as LegacyFedAvg

    class SecureFedAvg(LegacyFedAvg):
        def __init__(self, spec, model, on_round, **fedavg):
            params = [p.detach().clone() for p in model.parameters()]
            super().__init__(initial_parameters=ndarrays_to_parameters([p.numpy() for p in params]),
                             on_fit_config_fn=lambda server_round: {"server-round": server_round}, **fedavg)
            self.spec, self.params, self.on_round = spec, params, on_round
            self.global_flat = flatten(params).requires_grad_(True)
            self.optimizer = server_optimizer(self.global_flat, spec.server_opt)
            self.started = 0.0

        def configure_fit(self, server_round, parameters, client_manager):
            self.started = time.perf_counter()
            return super().configure_fit(server_round, parameters, client_manager)

        def aggregate_fit(self, server_round, results: list[tuple[object, FitRes]], failures):
            if not results:
                return None, {}
            # SecAgg+ hands every result the same parameters: the mean of the masked updates, unmasked
            mean = flatten([torch.from_numpy(np.array(a, dtype=np.float32))
                            for a in parameters_to_ndarrays(results[0][1].parameters)])
            server_step(self.global_flat, mean, self.optimizer)
            unflatten(self.global_flat.detach(), self.params)
            self.on_round(server_round, {"secagg_aggregated": len(results), "secagg_failures": len(failures),
                                         "measured_train_wall_s": time.perf_counter() - self.started})
            return ndarrays_to_parameters([p.numpy() for p in self.params]), {}

    return SecureFedAvg
