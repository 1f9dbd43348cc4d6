"""8-bit quantization: deterministic linear (int8) and stochastic (QSGD).

``Int8``: one fp32 scale ``s = max|x| / 127`` and ``q = round(x / s)`` as
int8. Error bound: ``|x - d| <= max|x| / 254`` for every element.

``QSGD`` (Alistarh et al., NeurIPS 2017): with ``L`` levels, each element is
``||x||_2 * sign(x_i) * l_i / L`` where ``l_i`` rounds ``L |x_i| / ||x||_2``
up or down at random, with the probabilities that make ``d`` unbiased:
``E[d] = x``. Error bound: ``|x_i - d_i| <= ||x||_2 / L`` for every element.
Levels travel as int8 (``L <= 127``), with the norm as one fp32. QSGD's Elias
coding of the levels is not used: the byte count is that of the int8 tensor.

Neither keeps state; both are usually run without error feedback.
"""
from __future__ import annotations

import torch

from edgetrain.comm.compress.base import Compressor, Payload


class Int8(Compressor):
    name = "int8"
    error_bound = "|x-d| <= max|x| / 254"

    def encode(self, x: torch.Tensor, key: object = 0) -> Payload:
        x = x.detach().reshape(-1).float()
        scale = x.abs().max().clamp_min(torch.finfo(torch.float32).tiny) / 127.0
        q = torch.round(x / scale).clamp_(-127, 127).to(torch.int8)
        return Payload((scale.reshape(1), q), x.numel())

    def decode(self, payload: Payload) -> torch.Tensor:
        scale, q = payload.tensors
        return q.float() * scale

    def layout(self, numel: int, nbytes: int) -> list[tuple[torch.dtype, int]]:
        return [(torch.float32, 1), (torch.int8, numel)]


class QSGD(Compressor):
    error_bound = "E[d] = x and |x-d| <= ||x||_2 / levels"

    def __init__(self, levels: int = 127, seed: int | None = None):
        if not 1 <= levels <= 127:
            raise ValueError(f"QSGD levels must be in [1, 127] (int8 on the wire), got {levels}")
        self.levels = levels
        self.name = f"qsgd:{levels}"
        self.generator = torch.Generator()
        if seed is not None:
            self.generator.manual_seed(seed)

    def encode(self, x: torch.Tensor, key: object = 0) -> Payload:
        x = x.detach().reshape(-1).float()
        norm = x.norm()
        if norm == 0:
            return Payload((norm.reshape(1), torch.zeros(x.numel(), dtype=torch.int8)), x.numel())
        level = x.abs() / norm * self.levels
        low = level.floor()
        up = torch.rand(x.numel(), generator=self.generator) < (level - low)
        q = (low + up.float()).clamp_(max=self.levels) * x.sign()
        return Payload((norm.reshape(1), q.to(torch.int8)), x.numel())

    def decode(self, payload: Payload) -> torch.Tensor:
        norm, q = payload.tensors
        return q.float() * (norm / self.levels)

    def layout(self, numel: int, nbytes: int) -> list[tuple[torch.dtype, int]]:
        return [(torch.float32, 1), (torch.int8, numel)]
