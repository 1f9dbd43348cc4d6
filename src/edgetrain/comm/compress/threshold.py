"""Two-step threshold compression for poor links (Strom, "Scalable distributed DNN
training using commodity GPU cloud computing", Interspeech 2015).

Each device accumulates its update in a residual and sends every entry that crossed its threshold ``Wt``
(index and sign in one 32-bit word), decoded to ``+-Wt`` (``strom``) or to the mean magnitude of its
layer's sent entries (``mean``, the default). ``Wt`` grows on a poorer link: ``tau * sqrt(1 Gbit/s /
bandwidth)``. The payload's length varies between devices and steps.

Design: docs/design/compression.md ("Threshold")
"""
from __future__ import annotations

import math

import torch

from edgetrain.cluster.links import Link
from edgetrain.comm.compress.base import Compressor, Payload, segment_ids, segment_sum
from edgetrain.comm.compress.memory import ResidualMemory
from edgetrain.kinds import named_by_kind

REFERENCE_BPS = 1e9


def link_threshold(tau: float, link: Link | None) -> float:
    """The per-device threshold ``Wt`` for base threshold ``tau`` on ``link``."""
    if link is None:
        return tau
    return tau * math.sqrt(max(1.0, REFERENCE_BPS / link.bandwidth_bps))


@named_by_kind("compress", builder="build")
class Threshold(Compressor):
    error_bound = ("d == 0 where |x| < Wt; elsewhere d == sign(x) Wt (strom) or sign(x) times the mean |x| "
                   "sent with that sign in that tensor (mean)")

    def __init__(self, tau: float, link: Link | None = None, decode_to: str = "mean"):
        if not tau > 0:
            raise ValueError(f"threshold must be positive, got {tau}")
        if decode_to not in ("mean", "strom"):
            raise ValueError(f"threshold decodes to 'mean' or 'strom', not {decode_to!r}")
        self.tau = tau
        self.wt = link_threshold(tau, link)
        self.decode_to = decode_to
        self.name = f"threshold:{tau:g}" + (":strom" if decode_to == "strom" else "")

    def encode(self, x: torch.Tensor, key: object = 0, segments: tuple[int, ...] | None = None) -> Payload:
        x = x.detach().reshape(-1).float()
        if x.numel() >= 2 ** 30:
            raise ValueError("threshold compression packs index and sign in 31 bits: tensor too long")
        indices = torch.nonzero(x.abs() >= self.wt).view(-1)
        values = x[indices]
        negative = values < 0
        codes = (indices * 2 + negative.long()).to(torch.int32)
        if self.decode_to == "strom":
            return Payload((x.new_tensor([self.wt]), codes), x.numel(), segments)
        parts = segments or (x.numel(),)
        # slot 2s: positive entries of tensor s, slot 2s+1: negative ones
        slots = segment_ids(parts, x.device)[indices] * 2 + negative.long()
        total = segment_sum(values.abs(), slots, 2 * len(parts))
        count = segment_sum(torch.ones_like(values), slots, 2 * len(parts))
        return Payload((total / count.clamp_min(1), codes), x.numel(), segments)

    def decode(self, payload: Payload) -> torch.Tensor:
        magnitudes, codes = payload.tensors
        codes = codes.long()
        indices, negative = codes >> 1, codes & 1
        if self.decode_to == "strom" or magnitudes.numel() == 1:
            size = magnitudes[0].expand(indices.numel())
        else:
            size = magnitudes[segment_ids(payload.parts, codes.device)[indices] * 2 + negative]
        out = torch.zeros(payload.numel, dtype=torch.float32, device=codes.device)
        out[indices] = torch.where(negative.bool(), -size, size)
        return out

    def layout(self, numel: int, nbytes: int, segments=None) -> list[tuple[torch.dtype, int]]:
        head = 1 if self.decode_to == "strom" else 2 * len(segments or (numel,))
        return [(torch.float32, head), (torch.int32, (nbytes - 4 * head) // 4)]


def build(spec, link: Link | None = None, seed: int = 0, rank: int = 0):
    """``--compress threshold[:TAU]``: ``Wt`` from this device's ``link``; always with error feedback."""
    return Threshold(spec.arg or 0.001, link, "strom" if "strom" in spec.options else "mean"), ResidualMemory()
