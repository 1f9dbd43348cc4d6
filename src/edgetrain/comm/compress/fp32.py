"""No compression: the fp32 tensor itself, summed by all-reduce (what plain DDP sends)."""
from __future__ import annotations

import torch

from edgetrain.comm.compress.base import Compressor, Payload
from edgetrain.comm.compress.memory import NoMemory
from edgetrain.kinds import named_by_kind


@named_by_kind("compress", builder="build")
class NoCompression(Compressor):
    summable = True
    error_bound = "exact: decode(encode(x)) == x"

    def encode(self, x: torch.Tensor, key: object = 0, segments: tuple[int, ...] | None = None) -> Payload:
        # fp64 stays fp64 (and is counted at 8 bytes): the exactness tests train in double precision
        x = x.detach().reshape(-1)
        return Payload((x if x.dtype == torch.float64 else x.float(),), x.numel(), segments)

    def decode(self, payload: Payload) -> torch.Tensor:
        x = payload.tensors[0]
        return x if x.dtype == torch.float64 else x.float()

    def layout(self, numel: int, nbytes: int, segments=None) -> list[tuple[torch.dtype, int]]:
        return [(torch.float32, numel)]


def build(spec, link=None, seed: int = 0, rank: int = 0):
    """``--compress none``'s (compressor, memory) pair (``edgetrain.kinds``)."""
    return NoCompression(), NoMemory()
