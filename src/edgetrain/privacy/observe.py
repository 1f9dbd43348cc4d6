"""What an observer of a device's traffic sees, built from edgetrain's own pieces.

An ``ObservedUpdate`` is the decoded update vector in parameter order, which
of its coordinates were actually received (a top-k payload carries some), and
``LocalTraining``: how the device turned its batch into that update. The
latter is public (it is the protocol: steps, learning rate, momentum), so the
attacker may use it. Later protections (DP-SGD noise, secure aggregation)
are further ways to build an ``ObservedUpdate``; the attack takes any of them.

The views here:

* ``gradient_view``: the fp32 gradient of one step (DDP's all-reduce input);
* ``compressed_view``: any of these through a compressor of ``comm/compress``
  with fresh error-feedback memory, packed to bytes, unpacked and decoded as
  the receiving peer does (top-k of a gradient, SparseLoCo's of a pseudo-gradient);
* ``local_update_view``: the pseudo-gradient ``ref - x`` that local SGD,
  DiLoCo and FedAvg send after the device's local steps (``comm/local_sgd.py``),
  here with every local step on the same batch (the device's data in the round);
* ``secagg_view``: one device's payload under ``--secure-aggregation``
  (``comm/secagg.py``), masked with the other members' pairwise masks, decoded
  at the members' shared scale as a peer on the ring would;
* ``aggregate_view``: what secure aggregation reveals, the mean of the members'
  updates: one device's batch hidden in a batch of N;
* ``dp_view``: one DP-SGD step's gradient (``--dp``, ``privacy/dp.py``'s ``SampleDP``).
"""
from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
from torch import nn

import numpy as np

from edgetrain.comm.compress.base import Compressor, unpack
from edgetrain.comm.params import flatten
from edgetrain.privacy.dp import SampleDP

# Imported inside functions: cryptography and edgetrain.comm.secagg (the secure-aggregation extra), for secagg_view
# only.


@dataclass(frozen=True)
class LocalTraining:
    """How a device made its update from its batch: ``steps`` of SGD (``lr``, ``momentum``, torch's SGD rule),
    the update being ``start - end``. One step at ``lr`` 1 is the gradient itself."""

    steps: int = 1
    lr: float = 1.0
    momentum: float = 0.0


GRADIENT = LocalTraining()


@dataclass
class ObservedUpdate:
    """The flat fp32 update an observer decoded, the coordinates it received (``None``: all) and the training
    that made it."""

    values: torch.Tensor
    training: LocalTraining = GRADIENT
    received: torch.Tensor | None = None


class Normalized(nn.Module):
    """``model`` behind the dataset's per-channel normalisation, so that images live in [0, 1]."""

    def __init__(self, model: nn.Module, mean: tuple[float, ...], std: tuple[float, ...]):
        super().__init__()
        self.model = model
        self.register_buffer("mean", torch.tensor(mean).view(1, -1, 1, 1))
        self.register_buffer("std", torch.tensor(std).view(1, -1, 1, 1))

    def forward(self, x):
        return self.model((x - self.mean) / self.std)


def gradient_view(model: nn.Module, images: torch.Tensor, labels: torch.Tensor) -> ObservedUpdate:
    """One step's fp32 gradient of the mean cross-entropy over the batch."""
    params = [p for p in model.parameters()]
    loss = nn.functional.cross_entropy(model(images), labels)
    return ObservedUpdate(flatten(list(torch.autograd.grad(loss, params))))


def compressed_view(observed: ObservedUpdate, compressor: Compressor, memory) -> ObservedUpdate:
    """``observed`` as the receiving peer decodes it from the bytes on the wire (top-k of a gradient; SparseLoCo:
    2-bit top-k of a pseudo-gradient); received: the decoded non-zero entries."""
    compensated = memory.compensate(observed.values)
    payload = compressor.encode(compensated)
    wire = payload.pack()
    received = unpack(wire, compressor.layout(payload.numel, wire.numel(), payload.segments), payload.numel,
                      payload.segments)
    decoded = compressor.decode(received)
    memory.update(compensated, decoded)
    return ObservedUpdate(decoded, observed.training, decoded != 0)


def dp_view(model: nn.Module, images: torch.Tensor, labels: torch.Tensor, clip: float, noise_multiplier: float,
            seed: int = 0) -> ObservedUpdate:
    """One DP-SGD step's gradient of the batch: each sample's clipped to ``clip``, summed, ``N(0, (noise_multiplier
    clip)^2)`` added, divided by the batch (the trainer's ``SampleDP``, on a copy of ``model``)."""
    local = copy.deepcopy(model)
    optimizer = torch.optim.SGD(local.parameters(), lr=1.0)
    private = SampleDP(local, clip, noise_multiplier, noise_here=True, expected_batch=len(images), seed=seed)
    private.zero_grad(optimizer)
    nn.functional.cross_entropy(local(images), labels, reduction="sum").backward()
    private.privatise(optimizer)
    return ObservedUpdate(flatten([p.grad for p in local.parameters()]))


def local_update_view(model: nn.Module, images: torch.Tensor, labels: torch.Tensor,
                      training: LocalTraining) -> ObservedUpdate:
    """``ref - x`` after ``training.steps`` SGD steps on the batch, as local SGD / DiLoCo / FedAvg send it."""
    local = copy.deepcopy(model)
    ref = flatten(list(model.parameters()))
    optimizer = torch.optim.SGD(local.parameters(), lr=training.lr, momentum=training.momentum)
    for _ in range(training.steps):
        optimizer.zero_grad()
        nn.functional.cross_entropy(local(images), labels).backward()
        optimizer.step()
    return ObservedUpdate(ref - flatten(list(local.parameters())), training)


def secagg_view(updates: list[ObservedUpdate], rank: int = 0, seed: int = 0) -> ObservedUpdate:
    """Device ``rank``'s masked payload among ``len(updates)`` members, each with its own update, decoded as a
    peer reads the words on the wire: at the shared fixed-point scale, masks and all. Keys from ``seed`` (the
    devices' X25519 keys are random in a run; seeded here for repeatable benchmarks)."""
    from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey

    from edgetrain.comm import secagg

    members = list(range(len(updates)))
    rng = np.random.default_rng(seed)
    keys = [secagg.PairwiseKeys(r, X25519PrivateKey.from_private_bytes(rng.bytes(32))) for r in members]
    for k in keys:
        k.agree([other.public for other in keys])
    exponents = [secagg.exponent_of(u.values) for u in updates]
    exponent = max(exponents)
    words = secagg.encode(updates[rank].values, exponent, len(members))
    wire = secagg.masked(words, rank, members, keys[rank], {})
    return ObservedUpdate(secagg.decode(wire, exponent, len(members)), updates[rank].training)


def aggregate_view(updates: list[ObservedUpdate]) -> ObservedUpdate:
    """The mean of the members' updates: what every member (and the server) decodes from the masked sum."""
    return ObservedUpdate(torch.stack([u.values for u in updates]).mean(dim=0), updates[0].training)
