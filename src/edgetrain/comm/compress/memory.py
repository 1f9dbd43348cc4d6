"""The Memory half of the GRACE split: what a device keeps of what it did not send.

* ``NoMemory``: nothing; the compression error is lost.
* ``ResidualMemory``: error feedback (Seide et al., "1-bit SGD", 2014;
  Karimireddy et al., "Error Feedback Fixes SignSGD", 2019). The residual
  ``e`` is added to the next input and becomes ``input + e - sent``, so that
  over any number of steps ``sum(sent) + e == sum(inputs)``: nothing is lost,
  only delayed.
* ``DGCMemory``: Deep Gradient Compression's momentum correction and momentum
  factor masking (Lin et al., ICLR 2018). Momentum is accumulated locally
  *before* sparsification (``u = m u + g``, ``v = v + u``), the coordinates
  that were sent are cleared in both ``u`` and ``v``. The optimizer must then
  run without momentum of its own, or momentum is applied twice.

Pairing with momentum: with error feedback the optimizer's own momentum acts
on the decompressed average, after the compression error was set aside. In
our short CIFAR runs (``benchmarks/compression.py``) EF-signSGD reached 31%
that way and 51% with plain SGD at a higher learning rate; top-k was less
sensitive. DGC's answer is ``DGCMemory``: momentum before compression.

Keying: state follows the parameter, not its place in a flat tensor. A
DDP bucket is a flat tensor of several parameters' gradients, and DDP
rebuilds its buckets after the first iteration in the order the gradients
became ready, usually the reverse of registration: the same bucket index (even
the same length) then holds the parameters in another order. State keyed by
the bucket index would add one parameter's residual to another parameter's
gradient (at 1% top-k the step-0 residual is ~99% of the step-0 gradient).
So every method takes ``parts``, the ``(name, length)`` of each tensor laid
end to end in ``x`` (the hook names each parameter by its identity), and keeps
one piece of state per name, assembled into the layout of the call at hand.
Without ``parts`` the whole tensor is one part named ``key`` (local SGD and
async, whose flat vector of all parameters never changes order). A part whose
length changes starts afresh.

Checkpoints: ``state_dict()`` is the stored pieces by name (the caller turns
names that are parameter identities into parameter names, see
``comm/mode.py``); ``load_state_dict`` puts them back.
"""
from __future__ import annotations

import torch


Parts = tuple[tuple[object, int], ...]


def _parts(x: torch.Tensor, key: object, parts: Parts | None) -> Parts:
    return parts or ((key, x.numel()),)


def _assemble(store: dict, parts: Parts, like: torch.Tensor) -> torch.Tensor:
    """The stored pieces of ``parts``, end to end in their order; zeros for a part not (or no longer) known."""
    pieces = []
    for name, n in parts:
        piece = store.get(name)
        pieces.append(piece if piece is not None and piece.numel() == n else like.new_zeros(n))
    return torch.cat(pieces)


def _store(store: dict, parts: Parts, flat: torch.Tensor) -> None:
    """Keep each part's piece of ``flat`` under its name."""
    for (name, _), piece in zip(parts, flat.split([n for _, n in parts])):
        store[name] = piece


class Memory:
    """What every memory shares: its per-part state for checkpoints."""

    stores: tuple[str, ...] = ()  # the names of the dicts of per-part state a checkpoint holds

    def state_dict(self) -> dict:
        return {store: dict(getattr(self, store)) for store in self.stores}

    def load_state_dict(self, state: dict) -> None:
        for store in self.stores:
            setattr(self, store, dict(state[store]))


class NoMemory(Memory):
    name = "none"

    def compensate(self, x: torch.Tensor, key: object = 0, parts: Parts | None = None) -> torch.Tensor:
        return x

    def update(self, compensated: torch.Tensor, sent: torch.Tensor, key: object = 0,
               parts: Parts | None = None) -> None:
        pass


class ResidualMemory(Memory):
    name = "residual"
    stores = ("residuals",)

    def __init__(self) -> None:
        self.residuals: dict[object, torch.Tensor] = {}

    def compensate(self, x: torch.Tensor, key: object = 0, parts: Parts | None = None) -> torch.Tensor:
        return x + _assemble(self.residuals, _parts(x, key, parts), x)

    def update(self, compensated: torch.Tensor, sent: torch.Tensor, key: object = 0,
               parts: Parts | None = None) -> None:
        _store(self.residuals, _parts(compensated, key, parts), compensated - sent)


class DGCMemory(Memory):
    name = "dgc"
    stores = ("velocity", "accumulated")

    def __init__(self, momentum: float = 0.9) -> None:
        if not 0 <= momentum < 1:
            raise ValueError(f"momentum must be in [0, 1), got {momentum}")
        self.momentum = momentum
        self.velocity: dict[object, torch.Tensor] = {}      # u
        self.accumulated: dict[object, torch.Tensor] = {}   # v

    def compensate(self, x: torch.Tensor, key: object = 0, parts: Parts | None = None) -> torch.Tensor:
        parts = _parts(x, key, parts)
        u = _assemble(self.velocity, parts, x).mul_(self.momentum).add_(x)
        _store(self.velocity, parts, u)
        return _assemble(self.accumulated, parts, x) + u

    def update(self, compensated: torch.Tensor, sent: torch.Tensor, key: object = 0,
               parts: Parts | None = None) -> None:
        parts = _parts(compensated, key, parts)
        mask = sent != 0
        _store(self.accumulated, parts, compensated.masked_fill(mask, 0.0))
        _store(self.velocity, parts, _assemble(self.velocity, parts, sent).masked_fill_(mask, 0.0))
