"""The Compressor half of the GRACE split (Xu et al., "GRACE: A Compressed
Communication Framework for Distributed Machine Learning", ICDCS 2021).

A compressor turns a flat fp32 tensor into a ``Payload`` (the tensors that go
on the wire) and back. It holds no error-feedback state; that is the job of a
``Memory`` (``memory.py``), so any compressor can run with or without it.

How payloads from the devices are combined depends on the compressor:

* ``summable``: decoding is linear and every device's payload has the same
  layout, so the payloads are summed by an all-reduce and decoded once (fp32,
  fp16, bf16, random-k with a shared seed);
* otherwise every device's payload is gathered (gloo has no sparse
  all-reduce), decoded one by one and summed. If ``fixed_size`` is false (its kind says so) the
  payload length varies between devices and steps, and the lengths travel
  first in a small all-gather of their own.

On the wire a payload is one byte buffer: its tensors' bytes back to back.
Bytes are counted from that buffer, never from a formula.

``segments`` are the lengths of the tensors (layers) laid end to end in the
flat input, e.g. the parameters of a DDP bucket. Compressors that keep one
scale per tensor (sign, int8, QSGD, threshold) or one budget per tensor
(top-k, as DGC selects layer by layer) use them; every device knows them, so
they never travel. Without segments the whole input is one tensor.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Payload:
    """What one device sends: ``tensors`` (flat), plus ``numel`` of the tensor they encode.

    ``segments`` and ``ctx`` are what every device knows without receiving it
    (the layer lengths; random-k's shared indices); they never go on the wire.
    """

    tensors: tuple[torch.Tensor, ...]
    numel: int
    segments: tuple[int, ...] | None = None
    ctx: object = None

    @property
    def parts(self) -> tuple[int, ...]:
        """Segment lengths, the whole input as one segment if none were given."""
        return self.segments or (self.numel,)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors)

    def pack(self) -> torch.Tensor:
        """All tensors' bytes back to back, as one uint8 tensor."""
        parts = [t.contiguous().view(-1).view(torch.uint8) for t in self.tensors]
        return torch.cat(parts) if len(parts) > 1 else parts[0].clone()


def unpack(buffer: torch.Tensor, layout: list[tuple[torch.dtype, int]], numel: int,
           segments: tuple[int, ...] | None = None) -> Payload:
    """Inverse of ``Payload.pack`` given each tensor's dtype and length (wider dtypes first, for alignment)."""
    tensors, offset = [], 0
    for dtype, count in layout:
        size = count * torch.empty((), dtype=dtype).element_size()
        tensors.append(buffer[offset:offset + size].view(dtype))
        offset += size
    if offset != buffer.numel():
        raise ValueError(f"payload of {buffer.numel()} bytes does not match layout {layout}")
    return Payload(tuple(tensors), numel, segments)


def segment_ids(parts: tuple[int, ...], device: torch.device | None = None) -> torch.Tensor:
    """For every entry of the flat input, the index of its segment (on ``device``: the input's)."""
    return torch.repeat_interleave(torch.arange(len(parts), device=device), torch.tensor(parts, device=device))


def segment_sum(values: torch.Tensor, ids: torch.Tensor, count: int) -> torch.Tensor:
    """Per-segment sums of ``values`` (entries labelled by ``ids``)."""
    return torch.zeros(count, dtype=values.dtype, device=values.device).index_add_(0, ids, values)


class Compressor:
    """Base class. Subclasses implement ``encode``, ``decode`` and ``layout``.

    ``key`` names the tensor being compressed (a DDP bucket index, a parameter
    group) so that compressors with per-tensor state (a step counter, a seed)
    keep it apart; every device calls ``encode`` with the same keys in the
    same order.
    """

    name = "base"
    kind = None        # its descriptor (kinds.named_by_kind sets it, with ``name``)
    summable = False
    error_bound = ""

    @property
    def fixed_size(self) -> bool:
        """The same bytes every exchange, whatever the values: as its kind declares (``CompressKind``)."""
        return self.kind.fixed_size

    def encode(self, x: torch.Tensor, key: object = 0, segments: tuple[int, ...] | None = None) -> Payload:
        raise NotImplementedError

    def decode(self, payload: Payload) -> torch.Tensor:
        raise NotImplementedError

    def combine(self, decoded: list[torch.Tensor]) -> torch.Tensor:
        """The average of the devices' decoded tensors (majority vote overrides this)."""
        total = decoded[0].clone()
        for d in decoded[1:]:
            total += d
        return total.div_(len(decoded))

    def layout(self, numel: int, nbytes: int, segments: tuple[int, ...] | None = None
               ) -> list[tuple[torch.dtype, int]]:
        """How a packed payload of ``nbytes`` encoding ``numel`` values splits into tensors."""
        raise NotImplementedError

    def describe(self) -> str:
        return self.name

    def state_dict(self) -> dict:
        """What a resumed run needs to encode as this one would have: per-key call counts, where the
        compressor keeps them (top-k's warm-up, random-k's shared index sequence)."""
        return {"calls": dict(self.calls)} if hasattr(self, "calls") else {}

    def load_state_dict(self, state: dict) -> None:
        if "calls" in state:
            self.calls = dict(state["calls"])
