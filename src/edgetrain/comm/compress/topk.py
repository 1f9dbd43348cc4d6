"""Top-k sparsification (Aji & Heafield 2017; Lin et al., Deep Gradient Compression, ICLR 2018).

Each device sends the ``k = ceil(ratio * n)`` entries of largest magnitude
of its input as (fp32 value, int32 index) pairs: 8 bytes per entry. With
``layerwise`` (as the DGC paper), each tensor (layer) of ``n_i`` entries keeps
``ceil(ratio * n_i)`` of its own instead; in our CIFAR benchmark the global
selection trained clearly better (it gives small conv layers with large
gradients more than a proportional share), so it is the default. Run it with
error feedback (``ResidualMemory``) or DGC's momentum correction
(``DGCMemory``); alone it drops most of the gradient for good.

DGC's warm-up is available: over the first ``warmup_steps`` calls the density
falls exponentially, 25%, 6.25%, 1.5625%, 0.39% (a quarter at each of four
equal stages, as the paper's 75% ... 99.9% sparsity over four epochs), never
below ``ratio``.

Error bound of ``decode(encode(x))``: equal to ``x`` on the kept entries, zero
elsewhere, and within each selection every dropped entry is at most the
smallest kept magnitude, so ``||x - d||^2 <= (1 - k/n) ||x||^2``.
"""
from __future__ import annotations

import math

import torch

from edgetrain.comm.compress.base import Compressor, Payload


class TopK(Compressor):
    error_bound = "d == x on the k largest |x| (per tensor if layerwise), 0 elsewhere; ||x-d||^2 <= (1-k/n)||x||^2"

    def __init__(self, ratio: float, warmup_steps: int = 0, layerwise: bool = False):
        if not 0 < ratio <= 1:
            raise ValueError(f"top-k ratio must be in (0, 1], got {ratio}")
        self.ratio = ratio
        self.warmup_steps = warmup_steps
        self.layerwise = layerwise
        self.calls: dict[object, int] = {}
        self.name = f"topk:{ratio:g}"

    def density(self, key: object = 0) -> float:
        """The fraction kept at this call for ``key`` (DGC warm-up, then ``ratio``)."""
        step = self.calls.get(key, 0)
        if step >= self.warmup_steps:
            return self.ratio
        stage = 4 * step // self.warmup_steps
        return max(self.ratio, 0.25 ** (stage + 1))

    def encode(self, x: torch.Tensor, key: object = 0, segments: tuple[int, ...] | None = None) -> Payload:
        x = x.detach().reshape(-1).float()
        density = self.density(key)
        self.calls[key] = self.calls.get(key, 0) + 1
        parts = segments if (segments and self.layerwise) else (x.numel(),)
        chosen, offset = [], 0
        for n in parts:
            k = min(n, max(1, math.ceil(density * n)))
            _, idx = torch.topk(x[offset:offset + n].abs(), k, sorted=False)
            chosen.append(idx + offset)
            offset += n
        indices = torch.cat(chosen) if len(chosen) > 1 else chosen[0]
        return Payload((x[indices], indices.to(torch.int32)), x.numel(), segments)

    def decode(self, payload: Payload) -> torch.Tensor:
        values, indices = payload.tensors
        out = torch.zeros(payload.numel, dtype=torch.float32)
        out[indices.long()] = values
        return out

    def layout(self, numel: int, nbytes: int, segments=None) -> list[tuple[torch.dtype, int]]:
        k = nbytes // 8
        return [(torch.float32, k), (torch.int32, k)]
