"""Federated rounds (``--sync fedavg:E``): FedAvg, FedAvgM, FedAdam, FedProx and SCAFFOLD as a sync mode.

A round (McMahan et al., 2017): the devices sampled for it start from the global model ``x``, train ``E``
local epochs (``fedavg:steps=H``: ``H`` steps) on their own partition (``--partition``), and send their
update ``x - y_i``; the server steps ``x`` with the mean update as a pseudo-gradient (``--server-opt``), and
every device continues from the new ``x``. It is local SGD (``local_sgd.py``, which ``FederatedAveraging``
extends) with client sampling (``--participation``), a choice of server step, FedProx's and SCAFFOLD's
client-side corrections, weights by sample count (``:weighted``) and DP-FedAvg's clipped updates.

Design: docs/design/strategies.md ("Federated rounds"): the server steps, weights, bytes, client optimizers.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch import nn

from edgetrain.cluster.peers import all_gather_json
from edgetrain.comm.emulation import LinkEmulator
from edgetrain.comm.local_sgd import LocalSGD
from edgetrain.comm.mode import Averaging
from edgetrain.comm.params import flatten, unflatten
from edgetrain.kinds import named_by_kind
from edgetrain.spec import ServerOptSpec

if TYPE_CHECKING:
    from edgetrain.comm.setup import SyncSetup


def sample_participants(world: int, fraction: float, seed: int, round_index: int) -> list[int]:
    """The devices that train in round ``round_index``: the same list on every device."""
    count = max(1, int(round(fraction * world)))
    if count >= world:
        return list(range(world))
    rng = np.random.default_rng((seed, round_index))
    return sorted(int(r) for r in rng.choice(world, size=count, replace=False))


def update_weights(samples: list[int], loss_scales: list[float], members: list[int]) -> dict[int, float]:
    """Per member ``i``: the factor whose plain mean over the members gives ``sum_S (n_i / s_i) u_i / sum_S n_i``."""
    total = sum(samples[i] for i in members)
    return {i: len(members) * samples[i] / loss_scales[i] / total for i in members}


def control_weights(samples: list[int], members: list[int]) -> dict[int, float]:
    """Per member ``i``: the factor whose plain mean over the members, times ``|S| / N``, gives
    ``sum_S (n_i / n) d_i`` (``n`` over all ``N`` devices): SCAFFOLD's control step weighted by sample counts."""
    return {i: len(samples) * samples[i] / sum(samples) for i in members}


def server_optimizer(global_model: torch.Tensor, spec: ServerOptSpec) -> torch.optim.Optimizer:
    """The server's optimizer over the flat global model (which must require grad), as its kind builds it."""
    return spec.kind.load_runtime()(global_model, spec)


def sgd_server(global_model: torch.Tensor, spec: ServerOptSpec) -> torch.optim.Optimizer:
    """``fedavg`` (lr 1, no momentum: the mean of the models) and ``fedavgm``."""
    return torch.optim.SGD([global_model], lr=spec.lr, momentum=spec.momentum)


def adam_server(global_model: torch.Tensor, spec: ServerOptSpec) -> torch.optim.Optimizer:
    """``fedadam``."""
    return torch.optim.Adam([global_model], lr=spec.lr, betas=(spec.beta1, spec.beta2), eps=spec.eps)


def server_step(global_model: torch.Tensor, mean_update: torch.Tensor, optimizer: torch.optim.Optimizer) -> None:
    """Step the global model with the clients' mean update ``mean(x - y_i)`` as its gradient, in place."""
    with torch.no_grad():
        global_model.grad = mean_update
        optimizer.step()
        global_model.grad = None


def corrected_gradient(gradient: torch.Tensor, local: torch.Tensor, global_model: torch.Tensor,
                       prox_mu: float | None, control: torch.Tensor | None,
                       own_control: torch.Tensor | None) -> torch.Tensor:
    """A local gradient with FedProx's ``mu (y - x)`` and SCAFFOLD's ``c - c_i`` added (either may be off)."""
    out = gradient.clone()
    if prox_mu is not None:
        out += prox_mu * (local - global_model)
    if control is not None:
        out += control - own_control
    return out


def clipped_update(update: torch.Tensor, clip: float, noise_multiplier: float, generator: torch.Generator,
                   noise_here: bool) -> tuple[torch.Tensor, bool]:
    """DP-FedAvg's device side (McMahan et al., "Learning Differentially Private Recurrent Language Models",
    ICLR 2018): ``update`` scaled to norm ``clip`` at most, plus ``N(0, (noise_multiplier clip)^2)`` per
    coordinate where ``noise_here`` (one device of the round: the noise enters the sum once); and whether the
    clip shortened it."""
    norm = float(update.norm())
    out = update * min(1.0, clip / (norm + 1e-12))
    if noise_here and noise_multiplier > 0:
        drawn = torch.randn(out.shape, generator=generator, dtype=out.dtype)  # a CPU generator: drawn there
        out = out + noise_multiplier * clip * drawn.to(out.device)
    return out, norm > clip


@dataclass(frozen=True)
class ClientRounds:
    """Who takes part in a federated round and how: the ``participation`` share of the devices sampled per round
    (by ``seed``), FedProx's ``prox_mu`` (None: off), SCAFFOLD's control variates (``scaffold``), updates
    ``weighted`` by the devices' sample counts, and a fresh client optimizer each round (``reset``)."""

    participation: float = 1.0
    seed: int = 0
    prox_mu: float | None = None
    scaffold: bool = False
    weighted: bool = False
    reset: bool = False


@named_by_kind("sync", builder="build")
class FederatedAveraging(LocalSGD):

    def __init__(self, model: nn.Module, world_size: int, emulator: LinkEmulator, averaging: Averaging, period: int,
                 server: ServerOptSpec, clients: ClientRounds | None = None, **common):
        clients = clients or ClientRounds()
        super().__init__(model, world_size, emulator, averaging, period, **common)
        self.participation, self.seed = clients.participation, clients.seed
        self.server = server
        self.ref.requires_grad_(True)
        self.outer = server_optimizer(self.ref, server)
        self.prox_mu = clients.prox_mu
        self.scaffold = clients.scaffold
        if self.scaffold:
            self.control = torch.zeros_like(self.ref.detach())      # c, the same on every device
            self.own_control = torch.zeros_like(self.control)      # c_i
            self.gradient_sum = torch.zeros_like(self.control)
        self.participants = sample_participants(world_size, self.participation, self.seed, 0)
        self.members_per_round: list[int] = []
        self.weighted = clients.weighted
        self.reset_client_optimizer = clients.reset  # the strategy clears its state when ``averages`` moves on
        self.dp: tuple[float, float, torch.Generator] | None = None   # DP-FedAvg: clip, noise, generator
        self.dp_clipped = 0                                            # this device's updates the clip shortened
        self.own_samples: tuple[int, float] | None = None   # (n_i, s_i), set by the loop once the data is built
        self.samples: list[int] | None = None                # every device's n_i, gathered at the first round
        self.loss_scales: list[float] | None = None

    def set_samples(self, samples: int, loss_scale: float) -> None:
        """This device's training samples (its partition) and its loss scale ``b_i world / B``."""
        self.own_samples = (int(samples), float(loss_scale))

    def _gather_samples(self) -> None:
        """Every device's sample count and loss scale, once (a collective: every device calls it in round 0)."""
        if self.samples is not None:
            return
        if self.own_samples is None:
            raise RuntimeError("fedavg:weighted needs set_samples before the first round")
        every = all_gather_json(list(self.own_samples), group=self.clock_group) if self.world_size > 1 \
            else [list(self.own_samples)]
        self.samples = [int(n) for n, _ in every]
        self.loss_scales = [float(s) for _, s in every]

    def sampled_ranks(self) -> list[int]:
        return self.participants

    def after_backward(self, step: int) -> None:
        if self.prox_mu is None and not self.scaffold:
            return
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.params]
        gradient = flatten(grads)
        if self.scaffold:
            self.gradient_sum += gradient
        corrected = corrected_gradient(gradient, flatten(self.params), self.ref.detach(), self.prox_mu,
                                       self.control if self.scaffold else None,
                                       self.own_control if self.scaffold else None)
        for p, g in zip(self.params, grads):
            p.grad = g
        unflatten(corrected, [p.grad for p in self.params])

    def privatise_updates(self, clip: float, noise_multiplier: float, seed: int) -> None:
        """DP-FedAvg (``--dp level=device``): from now on each member's update is clipped to norm ``clip`` and
        the round's lowest-ranked member adds ``N(0, (noise_multiplier clip)^2)`` to its own, so the round's sum
        holds the noise once (``clipped_update``)."""
        self.dp = (clip, noise_multiplier, torch.Generator().manual_seed(seed))

    def _average(self, members: list[int]) -> None:
        update = self.ref.detach() - flatten(self.params)
        if self.dp is not None and self.rank in members:
            update, shortened = clipped_update(update, *self.dp, noise_here=self.rank == members[0])
            self.dp_clipped += int(shortened)
        if self.weighted:
            self._gather_samples()
            if self.rank in members:
                update = update * update_weights(self.samples, self.loss_scales, members)[self.rank]
        mean_update = self._members_mean(update, members, "params")
        if mean_update is not None:
            server_step(self.ref, mean_update, self.outer)
        if self.scaffold:
            change = torch.zeros_like(self.control)
            if self.rank in members:
                new_control = self.gradient_sum / self.round_trained  # a member trained every step of the round
                change = new_control - self.own_control
                self.own_control = new_control
                if self.weighted:
                    change = change * control_weights(self.samples, members)[self.rank]
            mean_change = self._members_mean(change, members, "controls")
            if mean_change is not None:
                self.control += mean_change * (len(members) / self.world_size)
            self.gradient_sum.zero_()
        unflatten(self.ref.detach(), self.params)
        self.members_per_round.append(len(members))
        self.averages += 1
        self.participants = sample_participants(self.world_size, self.participation, self.seed, self.averages)

    def summary(self) -> dict:
        return {**super().summary(), "rounds": self.averages, "round_steps": self.period,
                "server_opt": self.server.text, "participation": self.participation,
                "participants_per_round_mean": (float(np.mean(self.members_per_round)) if self.members_per_round
                                                else None),
                "prox_mu": self.prox_mu, "scaffold": self.scaffold, "weighted": self.weighted,
                "client_optimizer_reset": self.reset_client_optimizer,
                **({"dp_updates_clipped": self.dp_clipped} if self.dp is not None else {})}


def build(setup: SyncSetup) -> FederatedAveraging:
    """``--sync fedavg:E`` (or ``fedavg:steps=H``): a round is ``E`` epochs of ``steps_per_epoch`` local steps."""
    spec, sync = setup.spec, setup.spec.sync
    period = sync.period or sync.local_epochs * setup.steps_per_epoch
    if period < 1:
        raise ValueError(f"--sync {sync.text} needs steps_per_epoch to count its local epochs in steps")
    clients = ClientRounds(spec.participation, spec.seed, sync.prox_mu, sync.scaffold, sync.weighted, sync.reset)
    return FederatedAveraging(setup.model, setup.world_size, setup.emulator, setup.averaging(masked=True), period,
                              spec.server_opt, clients, deadline=spec.round_deadline, **setup.common)
