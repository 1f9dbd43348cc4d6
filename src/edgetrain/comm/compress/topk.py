"""Top-k sparsification (Aji & Heafield 2017; Lin et al., Deep Gradient Compression, ICLR 2018).

Each device sends its ``k = ceil(ratio * n)`` entries of largest magnitude (global selection by default,
``layerwise`` per tensor), with DGC's density warm-up, ``compact``'s 4-byte entries (fp16 value, 16-bit gap)
or ``bits``' B-bit codebook values (SparseLoCo). Run it with error feedback or DGC's momentum correction
(``compress/memory.py``); alone it drops most of the gradient for good.

Design: docs/design/compression.md ("Top-k")
"""
from __future__ import annotations

import math

import torch

from edgetrain.comm.compress import bitpack
from edgetrain.comm.compress.base import Compressor, Payload
from edgetrain.comm.compress.memory import DGCMemory, NoMemory, ResidualMemory
from edgetrain.kinds import named_by_kind


GAP_FILL = 65535  # the code of a filler; codes below it mean "next entry is code + 1 positions on"
FP16_MAX = 65504.0


@named_by_kind("compress", builder="build")
class TopK(Compressor):
    error_bound = "d == x on the k largest |x| (per tensor if layerwise), 0 elsewhere; ||x-d||^2 <= (1-k/n)||x||^2"

    def __init__(self, ratio: float, warmup_steps: int = 0, layerwise: bool = False, compact: bool = False,
                 bits: int | None = None):
        if not 0 < ratio <= 1:
            raise ValueError(f"top-k ratio must be in (0, 1], got {ratio}")
        if bits is not None and not 1 <= bits <= 8:
            raise ValueError(f"top-k value bits must be in [1, 8], got {bits}")
        self.bits = bits
        self.ratio = ratio
        self.warmup_steps = warmup_steps
        self.layerwise = layerwise
        self.compact = compact
        self.calls: dict[object, int] = {}
        self.name = f"topk:{ratio:g}" + (":compact" if compact else "") + (f":bits={bits}" if bits else "")

    def density(self, key: object = 0) -> float:
        """The fraction kept at this call for ``key`` (DGC warm-up, then ``ratio``)."""
        step = self.calls.get(key, 0)
        if step >= self.warmup_steps:
            return self.ratio
        stage = 4 * step // self.warmup_steps
        return max(self.ratio, 0.25 ** (stage + 1))

    def encode(self, x: torch.Tensor, key: object = 0, segments: tuple[int, ...] | None = None) -> Payload:
        x = x.detach().reshape(-1).float()
        if key not in self.calls:  # the step the other keys are in (this step's first key: step 0)
            self.calls[key] = max(self.calls.values(), default=1) - 1
        density = self.density(key)
        self.calls[key] += 1
        parts = segments if (segments and self.layerwise) else (x.numel(),)
        chosen, offset = [], 0
        for n in parts:
            k = min(n, max(1, math.ceil(density * n)))
            _, idx = torch.topk(x[offset:offset + n].abs(), k, sorted=False)
            chosen.append(idx + offset)
            offset += n
        indices = torch.cat(chosen) if len(chosen) > 1 else chosen[0]
        if self.bits:
            return Payload(_coded_encode(x, indices, self.bits), x.numel(), segments)
        if self.compact:
            return Payload(_gap_encode(x, indices), x.numel(), segments)
        return Payload((x[indices], indices.to(torch.int32)), x.numel(), segments)

    def decode(self, payload: Payload) -> torch.Tensor:
        out = torch.zeros(payload.numel, dtype=torch.float32, device=payload.tensors[0].device)
        if self.bits:
            codebook, gaps, packed = payload.tensors
            real, positions = _gap_positions(gaps)
            codes = bitpack.unpack(packed, self.bits, len(gaps))[real]
            group, negative = codes & (len(codebook) - 1), codes >> (self.bits - 1)
            out[positions] = torch.where(negative.bool(), -codebook[group], codebook[group])
            return out
        if self.compact:
            values, codes = payload.tensors
            real, positions = _gap_positions(codes)
            out[positions] = values[real].float()
            return out
        values, indices = payload.tensors
        out[indices.long()] = values
        return out

    def layout(self, numel: int, nbytes: int, segments=None) -> list[tuple[torch.dtype, int]]:
        if self.bits:
            groups = 2 ** (self.bits - 1)
            rest = nbytes - 4 * groups  # 2 bytes of gap and bits/8 of value per slot
            slots = rest * 8 // (16 + self.bits)
            while 2 * slots + bitpack.packed_bytes(slots, self.bits) < rest:
                slots += 1
            return [(torch.float32, groups), (torch.int16, slots), (torch.uint8, bitpack.packed_bytes(slots, self.bits))]
        if self.compact:
            return [(torch.float16, nbytes // 4), (torch.int16, nbytes // 4)]
        k = nbytes // 8
        return [(torch.float32, k), (torch.int32, k)]


def _gaps(indices: torch.Tensor, numel: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(sorted ``indices``, each one's slot, the 16-bit gap codes of all slots, padded to a fixed length)."""
    indices = torch.sort(indices).values
    gaps = torch.diff(indices, prepend=indices.new_tensor([-1])) - 1  # >= 0
    fillers = gaps // GAP_FILL
    counts = fillers + 1
    slots = len(indices) + (numel - 1) // GAP_FILL
    own = torch.cumsum(counts, 0) - 1  # each entry's slot, after its fillers
    codes = torch.full((slots,), GAP_FILL, dtype=torch.int64, device=indices.device)
    codes[own] = gaps - fillers * GAP_FILL
    return indices, own, (codes - 32768).to(torch.int16)


def _gap_positions(codes: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(which slots hold an entry, the entries' positions) from the gap codes ``_gaps`` wrote."""
    codes = codes.to(torch.int64) + 32768  # stored shifted into int16's range
    real = codes != GAP_FILL
    positions = torch.cumsum(torch.where(real, codes + 1, GAP_FILL), 0) - 1
    return real, positions[real]


def _gap_encode(x: torch.Tensor, indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fp16 values and 16-bit gap codes of the entries at ``indices``, padded to a fixed length."""
    indices, own, codes = _gaps(indices, x.numel())
    values = torch.zeros(len(codes), dtype=torch.float16, device=x.device)
    values[own] = x[indices].clamp(-FP16_MAX, FP16_MAX).half()
    return values, codes


def _coded_encode(x: torch.Tensor, indices: torch.Tensor, bits: int) -> tuple[torch.Tensor, ...]:
    """The codebook of group means, the gap codes and the packed ``bits``-bit codes (sign, magnitude group)."""
    indices, own, gaps = _gaps(indices, x.numel())
    values = x[indices]
    groups = 2 ** (bits - 1)
    k = len(values)
    rank = torch.empty(k, dtype=torch.int64, device=x.device)
    rank[torch.argsort(values.abs())] = torch.arange(k, device=x.device)
    group = rank * groups // k  # equal counts, smallest magnitudes first
    sums = x.new_zeros(groups).index_add_(0, group, values.abs())
    counts = x.new_zeros(groups).index_add_(0, group, torch.ones_like(values))
    codebook = sums / counts.clamp_min(1)
    codes = torch.zeros(len(gaps), dtype=torch.int64, device=x.device)
    codes[own] = group | ((values < 0).to(torch.int64) << (bits - 1))
    return codebook, gaps, bitpack.pack(codes, bits)


def build(spec, link=None, seed: int = 0, rank: int = 0):
    """``--compress topk:RATIO[:OPTION]...``'s (compressor, memory) pair: DGC's memory with ``dgc``, else a
    residual (error feedback) unless ``noef``."""
    opts = spec.options
    memory = DGCMemory(opts.get("momentum", 0.9)) if "dgc" in opts else \
        (NoMemory() if "noef" in opts else ResidualMemory())
    bits = int(opts["bits"]) if "bits" in opts else None
    return TopK(spec.arg, warmup_steps=int(opts.get("warmup", 0)), layerwise="layerwise" in opts,
                compact="compact" in opts, bits=bits), memory
