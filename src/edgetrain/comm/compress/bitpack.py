"""Codes of ``bits`` bits each, packed back to back into bytes (low bits first): what low-bit compressors send."""
from __future__ import annotations

import torch


def packed_bytes(count: int, bits: int) -> int:
    """Bytes that ``count`` codes of ``bits`` bits take packed."""
    return (count * bits + 7) // 8


def pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """``codes`` (integers in ``[0, 2**bits)``) as ``packed_bytes(len(codes), bits)`` uint8."""
    codes = codes.reshape(-1).to(torch.int64)
    flat = ((codes.unsqueeze(1) >> torch.arange(bits, device=codes.device)) & 1).reshape(-1)
    flat = torch.cat([flat, flat.new_zeros(-len(flat) % 8)])
    return (flat.view(-1, 8) << torch.arange(8, device=codes.device)).sum(1).to(torch.uint8)


def unpack(buffer: torch.Tensor, bits: int, count: int) -> torch.Tensor:
    """The ``count`` codes (int64) that ``pack`` wrote into ``buffer``."""
    shifts = torch.arange(8, device=buffer.device)
    flat = ((buffer.to(torch.int64).unsqueeze(1) >> shifts) & 1).reshape(-1)[:count * bits]
    return (flat.view(count, bits) << shifts[:bits]).sum(1)
