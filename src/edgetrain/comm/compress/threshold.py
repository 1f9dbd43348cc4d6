"""Two-step threshold compression for poor links (Strom, "Scalable distributed DNN
training using commodity GPU cloud computing", Interspeech 2015).

Step 1, accumulate: each device adds its update to a local residual (error
feedback, always on for this method). Step 2, send what crossed: every entry
whose residual reached the device's threshold ``Wt`` is sent as one 32-bit
word, index and sign together (``index * 2 + negative``), and decodes to
``+Wt`` or ``-Wt``; ``Wt`` is subtracted from that residual entry, everything
else stays for later. The payload is one fp32 ``Wt`` plus 4 bytes per entry
sent, and its length differs from device to device and step to step.

``Wt`` is per device and derived from its link: poorer links wait for a
larger accumulation before they send::

    Wt = tau * sqrt(reference_bps / bandwidth_bps),   reference = 1 Gbit/s

so a 1 Gbit/s link uses ``tau``, a 10 Mbit/s LTE link ``10 tau``; links faster
than the reference use ``tau``. ``tau`` is the spec's argument
(``threshold:0.001``); with no emulated link ``Wt = tau``.

Error bound of ``decode(encode(x))``: ``d_i = sign(x_i) Wt`` where
``|x_i| >= Wt``, ``d_i = 0`` elsewhere (so unsent entries are below ``Wt``).
"""
from __future__ import annotations

import math

import torch

from edgetrain.cluster.links import Link
from edgetrain.comm.compress.base import Compressor, Payload

REFERENCE_BPS = 1e9


def link_threshold(tau: float, link: Link | None) -> float:
    """The per-device threshold ``Wt`` for base threshold ``tau`` on ``link``."""
    if link is None:
        return tau
    return tau * math.sqrt(max(1.0, REFERENCE_BPS / link.bandwidth_bps))


class Threshold(Compressor):
    fixed_size = False
    error_bound = "d == sign(x) Wt where |x| >= Wt, 0 elsewhere"

    def __init__(self, tau: float, link: Link | None = None):
        if not tau > 0:
            raise ValueError(f"threshold must be positive, got {tau}")
        self.tau = tau
        self.wt = link_threshold(tau, link)
        self.name = f"threshold:{tau:g}"

    def encode(self, x: torch.Tensor, key: object = 0) -> Payload:
        x = x.detach().reshape(-1).float()
        if x.numel() >= 2 ** 30:
            raise ValueError("threshold compression packs index and sign in 31 bits: tensor too long")
        indices = torch.nonzero(x.abs() >= self.wt).view(-1)
        codes = indices * 2 + (x[indices] < 0).long()
        return Payload((torch.tensor([self.wt], dtype=torch.float32), codes.to(torch.int32)), x.numel())

    def decode(self, payload: Payload) -> torch.Tensor:
        wt, codes = payload.tensors
        codes = codes.long()
        out = torch.zeros(payload.numel, dtype=torch.float32)
        out[codes >> 1] = (1 - 2 * (codes & 1)).float() * wt
        return out

    def layout(self, numel: int, nbytes: int) -> list[tuple[torch.dtype, int]]:
        return [(torch.float32, 1), (torch.int32, (nbytes - 4) // 4)]
