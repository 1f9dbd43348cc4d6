"""Federated rounds (``--sync fedavg:E``): FedAvg, FedAvgM, FedAdam, FedProx and SCAFFOLD as a sync mode.

A round (McMahan et al., "Communication-Efficient Learning of Deep Networks
from Decentralized Data", 2017): the devices sampled for it start from the
global model ``x``, train ``E`` local epochs (``fedavg:E``; ``fedavg:steps=H``
for ``H`` steps) on their own partition (``--partition``, which fedavg
requires), and send their update ``x - y_i``; the server steps ``x`` with the
mean update as a pseudo-gradient, and every device continues from the new
``x``. It is local SGD (``local_sgd.py``, which this class extends) with
client sampling, a choice of server step and two client-side corrections:

- server step (``--server-opt``), on ``g = mean_S(x - y_i)``:
  ``fedavg``: ``x = x - g`` (the mean of the client models);
  ``fedavgm``: ``v = momentum v + g; x = x - lr v`` (Hsu et al. 2019), which is
  ``torch.optim.SGD`` with momentum; ``fedadam``: ``torch.optim.Adam`` on
  ``g`` (Reddi et al., "Adaptive Federated Optimization", 2021; their
  algorithm has no bias correction, Adam's has; ``eps`` is their ``tau``).
- participation ``F`` (``--participation``): each round ``max(1, round(F N))``
  of the ``N`` devices are sampled, with a generator seeded by (seed, round)
  that every device shares (``sample_participants``). A device not sampled
  trains no step of the round and sends nothing; the sampled ones average in
  a group of their own and every other device receives the mean
  (``local_sgd.py``, "Rounds and their members"). With ``--round-deadline``
  (``deadline.py``) a sampled device that is late is left out too: the mean
  is over the sampled devices that made it.
- FedProx (``:prox=MU``; Li et al., MLSys 2020): each local gradient gets
  ``MU (y - x)``, the gradient of ``MU/2 ||y - x||^2``.
- SCAFFOLD (``:scaffold``; Karimireddy et al., ICML 2020): each local gradient
  gets ``c - c_i``; after the round a participant sets ``c_i`` to the mean of
  its raw gradients over the round (their option II, ``c_i - c + (x - y_i) /
  (K lr)``, is exactly that for plain SGD at a constant lr, and needs no lr),
  and ``c = c + mean_N(c_i' - c_i)`` over all ``N`` devices (non-participants
  add zero), computed as the paper's ``|S|/N mean_S`` over the round's
  members ``S``. The controls travel in a second exchange per round, so
  SCAFFOLD sends twice the bytes of FedAvg.

Weights: the loop's loss scaling (``train/strategy.py``) already weights
device ``i``'s local step by its share ``b_i world / B`` of the global batch,
so the server takes the plain mean over participants: with one local step,
full participation and IID partitions, a round is exactly one data-parallel
step (``tests/comm/test_federated.py``), for equal and unequal local batches.

Updates go through the compressor and error feedback of ``--compress``
(``exchange.average``), as in local SGD; a device's error-feedback memory
changes only in the rounds it is a member of. Bytes per device are what it
sent as a member plus the fp32 mean it received when it was not one (every
device keeps the global model and the server optimizer's state, which a
real server would keep alone and send only to the next round's clients).
Client optimizers (momentum) keep their state across rounds, as in local SGD.
"""
from __future__ import annotations

import numpy as np
import torch
from torch import nn

from edgetrain.comm.compress.base import Compressor
from edgetrain.comm.emulation import LinkEmulator
from edgetrain.comm.exchange import average
from edgetrain.comm.local_sgd import LocalSGD
from edgetrain.comm.params import flatten, unflatten
from edgetrain.spec import ServerOptSpec


def sample_participants(world: int, fraction: float, seed: int, round_index: int) -> list[int]:
    """The devices that train in round ``round_index``: the same list on every device."""
    count = max(1, int(round(fraction * world)))
    if count >= world:
        return list(range(world))
    rng = np.random.default_rng((seed, round_index))
    return sorted(int(r) for r in rng.choice(world, size=count, replace=False))


def server_optimizer(global_model: torch.Tensor, spec: ServerOptSpec) -> torch.optim.Optimizer:
    """The server's optimizer over the flat global model (which must require grad)."""
    if spec.name == "fedadam":
        return torch.optim.Adam([global_model], lr=spec.lr, betas=(spec.beta1, spec.beta2), eps=spec.eps)
    return torch.optim.SGD([global_model], lr=spec.lr, momentum=spec.momentum)


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


class FederatedAveraging(LocalSGD):
    name = "fedavg"

    def __init__(self, model: nn.Module, world_size: int, rank: int, emulator: LinkEmulator, period: int,
                 compressor: Compressor, memory, server: ServerOptSpec, participation: float = 1.0,
                 prox_mu: float | None = None, scaffold: bool = False, seed: int = 0, group=None, **common):
        super().__init__(model, world_size, emulator, period, compressor, memory, group=group, rank=rank, **common)
        self.participation, self.seed = participation, seed
        self.server = server
        self.ref.requires_grad_(True)
        self.outer = server_optimizer(self.ref, server)
        self.prox_mu = prox_mu
        self.scaffold = scaffold
        if scaffold:
            self.control = torch.zeros_like(self.ref.detach())      # c, the same on every device
            self.own_control = torch.zeros_like(self.control)      # c_i
            self.gradient_sum = torch.zeros_like(self.control)
        self.participants = sample_participants(world_size, participation, seed, 0)
        self.members_per_round: list[int] = []

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

    def _average(self, members: list[int]) -> None:
        mean_update = self._members_mean(self.ref.detach() - flatten(self.params), members, "params")
        if mean_update is not None:
            server_step(self.ref, mean_update, self.outer)
        if self.scaffold:
            change = torch.zeros_like(self.control)
            if self.rank in members:
                new_control = self.gradient_sum / self.round_trained  # a member trained every step of the round
                change = new_control - self.own_control
                self.own_control = new_control
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
                "prox_mu": self.prox_mu, "scaffold": self.scaffold}
