"""8-bit quantization: deterministic linear (int8) and stochastic (QSGD), one scale per tensor.

``Int8``: per tensor (segment) one fp32 scale ``s = max|x| / 127`` and
``q = round(x / s)`` as int8. Error bound: ``|x_i - d_i| <= max|x| / 254``,
``max`` over the entry's tensor.

``QSGD`` (Alistarh et al., NeurIPS 2017): with ``L`` levels, each entry is
``||x||_2 * sign(x_i) * l_i / L`` (norm of its tensor) where ``l_i`` rounds
``L |x_i| / ||x||_2`` up or down at random, with the probabilities that make
``d`` unbiased: ``E[d] = x``. Error bound: ``|x_i - d_i| <= ||x||_2 / L``.
Levels travel as int8 (``L <= 127``), with one fp32 norm per tensor. QSGD's
Elias coding of the levels is not used: the byte count is the int8 tensor's.

``LowBit`` (``quant:BITS``, 2 to 8 bits): per tensor one fp32 scale
``s = max|x|``, ``q = round(m x / s)`` with ``m = 2**(BITS-1) - 1`` levels on
each side of zero, sent as ``q + m`` in BITS bits, packed (``bitpack.py``):
the outer gradients of Streaming DiLoCo (Douillard et al. 2025, 4 bits).
Error bound: ``|x_i - d_i| <= max|x| / (2 m)``; run with error feedback
unless ``noef``.

Int8 and QSGD keep no state and are usually run without error feedback.
"""
from __future__ import annotations

import torch

from edgetrain.comm.compress import bitpack
from edgetrain.comm.compress.base import Compressor, Payload, segment_ids, segment_sum
from edgetrain.comm.compress.memory import NoMemory, ResidualMemory
from edgetrain.kinds import named_by_kind

TINY = torch.finfo(torch.float32).tiny


@named_by_kind("compress", builder="build_int8")
class Int8(Compressor):
    error_bound = "|x-d| <= max|x| / 254 per tensor"

    def encode(self, x: torch.Tensor, key: object = 0, segments: tuple[int, ...] | None = None) -> Payload:
        x = x.detach().reshape(-1).float()
        parts = segments or (x.numel(),)
        ids = segment_ids(parts, x.device)
        peak = torch.zeros(len(parts), device=x.device).scatter_reduce_(0, ids, x.abs(), "amax")
        scale = peak.clamp_min(TINY) / 127.0
        q = torch.round(x / scale[ids]).clamp_(-127, 127).to(torch.int8)
        return Payload((scale, q), x.numel(), segments)

    def decode(self, payload: Payload) -> torch.Tensor:
        scale, q = payload.tensors
        return q.float() * scale[segment_ids(payload.parts, q.device)]

    def layout(self, numel: int, nbytes: int, segments=None) -> list[tuple[torch.dtype, int]]:
        return [(torch.float32, len(segments or (numel,))), (torch.int8, numel)]


@named_by_kind("compress", builder="build_qsgd")
class QSGD(Compressor):
    error_bound = "E[d] = x and |x-d| <= ||x||_2 / levels per tensor"

    def __init__(self, levels: int = 127, seed: int | None = None):
        if not 1 <= levels <= 127:
            raise ValueError(f"QSGD levels must be in [1, 127] (int8 on the wire), got {levels}")
        self.levels = levels
        self.name = f"qsgd:{levels}"
        self.generator = torch.Generator()
        if seed is not None:
            self.generator.manual_seed(seed)

    def state_dict(self) -> dict:
        return {"generator": self.generator.get_state()}

    def load_state_dict(self, state: dict) -> None:
        self.generator.set_state(state["generator"])

    def encode(self, x: torch.Tensor, key: object = 0, segments: tuple[int, ...] | None = None) -> Payload:
        x = x.detach().reshape(-1).float()
        parts = segments or (x.numel(),)
        ids = segment_ids(parts, x.device)
        norm = segment_sum(x * x, ids, len(parts)).sqrt_()
        level = x.abs() / norm.clamp_min(TINY)[ids] * self.levels
        low = level.floor()
        up = torch.rand(x.numel(), generator=self.generator).to(x.device) < (level - low)  # CPU stream: seeded alike
        q = (low + up.float()).clamp_(max=self.levels) * x.sign()
        return Payload((norm, q.to(torch.int8)), x.numel(), segments)

    def decode(self, payload: Payload) -> torch.Tensor:
        norm, q = payload.tensors
        return q.float() * (norm / self.levels)[segment_ids(payload.parts, q.device)]

    def layout(self, numel: int, nbytes: int, segments=None) -> list[tuple[torch.dtype, int]]:
        return [(torch.float32, len(segments or (numel,))), (torch.int8, numel)]


@named_by_kind("compress", builder="build_quant")
class LowBit(Compressor):
    error_bound = "|x-d| <= max|x| / (2 (2**(bits-1) - 1)) per tensor"

    def __init__(self, bits: int = 4):
        if not 2 <= bits <= 8:
            raise ValueError(f"quant bits must be in [2, 8], got {bits}")
        self.bits, self.levels = bits, 2 ** (bits - 1) - 1
        self.name = f"quant:{bits}"

    def encode(self, x: torch.Tensor, key: object = 0, segments: tuple[int, ...] | None = None) -> Payload:
        x = x.detach().reshape(-1).float()
        parts = segments or (x.numel(),)
        ids = segment_ids(parts, x.device)
        scale = x.new_zeros(len(parts)).scatter_reduce_(0, ids, x.abs(), "amax").clamp_min_(TINY)
        q = torch.round(x / scale[ids] * self.levels).clamp_(-self.levels, self.levels).to(torch.int64)
        return Payload((scale, bitpack.pack(q + self.levels, self.bits)), x.numel(), segments)

    def decode(self, payload: Payload) -> torch.Tensor:
        scale, packed = payload.tensors
        q = bitpack.unpack(packed, self.bits, payload.numel) - self.levels
        return q.float() * (scale / self.levels)[segment_ids(payload.parts, packed.device)]

    def layout(self, numel: int, nbytes: int, segments=None) -> list[tuple[torch.dtype, int]]:
        return [(torch.float32, len(segments or (numel,))), (torch.uint8, bitpack.packed_bytes(numel, self.bits))]


def build_int8(spec, link=None, seed: int = 0, rank: int = 0):
    """``--compress int8``'s (compressor, memory) pair (``edgetrain.kinds``)."""
    return Int8(), NoMemory()


def build_qsgd(spec, link=None, seed: int = 0, rank: int = 0):
    """``--compress qsgd[:LEVELS]``: the rounding noise made independent per device from ``rank``."""
    return QSGD(int(spec.arg or 127), seed=seed * 1_000_003 + rank), NoMemory()


def build_quant(spec, link=None, seed: int = 0, rank: int = 0):
    """``--compress quant[:BITS]``: packed BITS-bit values, with error feedback unless ``noef``."""
    return LowBit(int(spec.arg or 4)), NoMemory() if "noef" in spec.options else ResidualMemory()
