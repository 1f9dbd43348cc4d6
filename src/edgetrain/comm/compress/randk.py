"""Random-k sparsification (Stich et al., "Sparsified SGD with Memory", NeurIPS 2018).

Every device keeps the same ``k = ceil(ratio * n)`` random coordinates,
drawn from a generator all devices seed alike (seed, tensor key, call
number). Because the indices are shared, only the fp32 values travel, and
they are summed by an ordinary all-reduce: 4 bytes per kept entry, no
gather. Unscaled (the values are not multiplied by ``n/k``): run it with error
feedback, as the paper does.

Error bound: ``d == x`` on the ``k`` drawn coordinates, zero elsewhere.
"""
from __future__ import annotations

import math
import zlib

import torch

from edgetrain.comm.compress.base import Compressor, Payload
from edgetrain.comm.compress.memory import NoMemory, ResidualMemory
from edgetrain.kinds import named_by_kind


@named_by_kind("compress", builder="build")
class RandomK(Compressor):
    summable = True
    error_bound = "d == x on k shared random coordinates, 0 elsewhere"

    def __init__(self, ratio: float, seed: int = 0):
        if not 0 < ratio <= 1:
            raise ValueError(f"random-k ratio must be in (0, 1], got {ratio}")
        self.ratio = ratio
        self.seed = seed
        self.calls: dict[object, int] = {}
        self.name = f"randk:{ratio:g}"

    def _indices(self, key: object, n: int) -> torch.Tensor:
        call = self.calls.get(key, 0)
        self.calls[key] = call + 1
        g = torch.Generator()
        # crc32, not hash(): hash() of a str is salted per process and devices must agree
        g.manual_seed((self.seed * 1_000_003 + call) * 1_009 + zlib.crc32(str(key).encode()))
        k = min(n, max(1, math.ceil(self.ratio * n)))
        return torch.randperm(n, generator=g)[:k]

    def encode(self, x: torch.Tensor, key: object = 0, segments: tuple[int, ...] | None = None) -> Payload:
        # uniform over the whole input: every layer keeps about ``ratio`` of its entries anyway
        x = x.detach().reshape(-1).float()
        indices = self._indices(key, x.numel())
        return Payload((x[indices],), x.numel(), segments, ctx=indices)

    def decode(self, payload: Payload) -> torch.Tensor:
        out = torch.zeros(payload.numel, dtype=torch.float32, device=payload.tensors[0].device)
        out[payload.ctx] = payload.tensors[0]
        return out

    def layout(self, numel: int, nbytes: int, segments=None) -> list[tuple[torch.dtype, int]]:
        return [(torch.float32, nbytes // 4)]


def build(spec, link=None, seed: int = 0, rank: int = 0):
    """``--compress randk:RATIO``: ``seed`` must be the same on every device (shared indices)."""
    return RandomK(spec.arg, seed=seed), NoMemory() if "noef" in spec.options else ResidualMemory()
