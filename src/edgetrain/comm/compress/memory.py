"""The Memory half of the GRACE split: what a device keeps of what it did not send.

``NoMemory`` keeps nothing (the compression error is lost); ``ResidualMemory`` is error feedback (the residual
joins the next input: nothing is lost, only delayed); ``DGCMemory`` is Deep Gradient Compression's momentum
correction and factor masking (the optimizer then runs without momentum of its own). State follows the named
parts of a flat tensor (``parts``: a DDP bucket's parameters), not their place in it; ``state_dict`` keeps it
by name for checkpoints.

Design: docs/design/compression.md ("Error feedback and memory")
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
