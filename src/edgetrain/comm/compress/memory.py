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

All memories are keyed, like compressors, by the name of the tensor (a DDP
bucket index). A memory whose tensor changes length (DDP rebuilds its buckets
after the first iteration) starts that key afresh.
"""
from __future__ import annotations

import torch


class NoMemory:
    name = "none"

    def compensate(self, x: torch.Tensor, key: object = 0) -> torch.Tensor:
        return x

    def update(self, compensated: torch.Tensor, sent: torch.Tensor, key: object = 0) -> None:
        pass


class ResidualMemory:
    name = "residual"

    def __init__(self) -> None:
        self.residuals: dict[object, torch.Tensor] = {}

    def compensate(self, x: torch.Tensor, key: object = 0) -> torch.Tensor:
        e = self.residuals.get(key)
        if e is None or e.numel() != x.numel():
            return x.clone()
        return x + e

    def update(self, compensated: torch.Tensor, sent: torch.Tensor, key: object = 0) -> None:
        self.residuals[key] = compensated - sent


class DGCMemory:
    name = "dgc"

    def __init__(self, momentum: float = 0.9) -> None:
        if not 0 <= momentum < 1:
            raise ValueError(f"momentum must be in [0, 1), got {momentum}")
        self.momentum = momentum
        self.velocity: dict[object, torch.Tensor] = {}      # u
        self.accumulated: dict[object, torch.Tensor] = {}   # v

    def compensate(self, x: torch.Tensor, key: object = 0) -> torch.Tensor:
        u = self.velocity.get(key)
        if u is None or u.numel() != x.numel():
            u = torch.zeros_like(x)
            self.accumulated[key] = torch.zeros_like(x)
        u = u.mul(self.momentum).add_(x)
        self.velocity[key] = u
        return self.accumulated[key] + u

    def update(self, compensated: torch.Tensor, sent: torch.Tensor, key: object = 0) -> None:
        mask = sent != 0
        self.accumulated[key] = compensated.masked_fill(mask, 0.0)
        self.velocity[key].masked_fill_(mask, 0.0)
