"""Half-precision casts: fp16 or bf16 on the wire, summed by all-reduce in that precision.

As PyTorch's ``fp16_compress_hook`` / ``bf16_compress_hook``: 2x fewer bytes,
no state. fp16 keeps 11 significant bits but overflows above 65504, so values
are clamped to that range first; bf16 keeps fp32's range with 8 significant
bits. The sum over devices is also computed in the half type; with few
devices that adds at most a few more rounding errors of the same size.

Error bound of ``decode(encode(x))`` (round to nearest):

* fp16: ``|x - d| <= max(2**-11 * |x|, 2**-25)`` for ``|x| <= 65504``;
* bf16: ``|x - d| <= 2**-8 * |x|`` for normal ``x``.
"""
from __future__ import annotations

import torch

from edgetrain.comm.compress.base import Compressor, Payload
from edgetrain.comm.compress.memory import NoMemory
from edgetrain.spec import KINDS

FP16_MAX = 65504.0


class HalfCast(Compressor):
    summable = True

    def __init__(self, dtype: torch.dtype = torch.float16):
        if dtype not in (torch.float16, torch.bfloat16):
            raise ValueError(f"HalfCast casts to float16 or bfloat16, not {dtype}")
        self.dtype = dtype
        self.name = "fp16" if dtype == torch.float16 else "bf16"
        self.kind = KINDS["compress"][self.name]   # one class for two kinds: its dtype says which
        self.error_bound = ("|x-d| <= max(2^-11 |x|, 2^-25) for |x| <= 65504" if dtype == torch.float16
                            else "|x-d| <= 2^-8 |x|")

    def encode(self, x: torch.Tensor, key: object = 0, segments: tuple[int, ...] | None = None) -> Payload:
        x = x.detach().reshape(-1)
        if self.dtype == torch.float16:
            x = x.clamp(-FP16_MAX, FP16_MAX)
        return Payload((x.to(self.dtype),), x.numel(), segments)

    def decode(self, payload: Payload) -> torch.Tensor:
        return payload.tensors[0].float()

    def layout(self, numel: int, nbytes: int, segments=None) -> list[tuple[torch.dtype, int]]:
        return [(self.dtype, numel)]


def build_fp16(spec, link=None, seed: int = 0, rank: int = 0):
    """``--compress fp16``'s (compressor, memory) pair (``edgetrain.kinds``)."""
    return HalfCast(torch.float16), NoMemory()


def build_bf16(spec, link=None, seed: int = 0, rank: int = 0):
    """``--compress bf16``'s (compressor, memory) pair (``edgetrain.kinds``)."""
    return HalfCast(torch.bfloat16), NoMemory()
