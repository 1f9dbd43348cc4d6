"""Sign compression: one bit per entry.

``ScaledSign`` (EF-signSGD, Karimireddy et al., ICML 2019): send the signs and,
per tensor (layer), one fp32 scale ``||x||_1 / n``; decode to
``scale * sign(x)``. Run with error feedback, which is what makes it converge
like SGD. Error, per tensor: exactly ``||x - d||^2 = ||x||^2 - ||x||_1^2 / n``
(the best one-scale fit to the signs). One scale for a whole DDP bucket would
let the many small entries of a large layer set the step of every layer.

``MajorityVote`` (signSGD with majority vote, Bernstein et al., ICLR 2019):
every device sends its signs; the update is the sign of their sum. The paper's
update has unit magnitude and needs a tiny learning rate; to keep the
learning rate of an ordinary run, the vote is multiplied by the devices'
mean ``||x||_1 / n`` per tensor. No error feedback: a vote does not
say what each device failed to send. Ties (possible with an even number of
devices) give zero.

Signs are packed 8 to a byte; zeros count as positive.
"""
from __future__ import annotations

import torch

from edgetrain.comm.compress.base import Compressor, Payload, segment_ids, segment_sum
from edgetrain.comm.compress.memory import NoMemory, ResidualMemory
from edgetrain.kinds import named_by_kind

_BITS = torch.tensor([128, 64, 32, 16, 8, 4, 2, 1], dtype=torch.uint8)


def pack_signs(x: torch.Tensor) -> torch.Tensor:
    """One bit per entry (1 = non-negative), 8 per uint8, zero-padded at the end."""
    bits = (x >= 0).to(torch.uint8)
    pad = (-bits.numel()) % 8
    if pad:
        bits = torch.cat([bits, bits.new_zeros(pad)])
    return (bits.view(-1, 8) * _BITS.to(bits.device)).sum(1, dtype=torch.uint8)


def unpack_signs(packed: torch.Tensor, numel: int) -> torch.Tensor:
    """+1.0 / -1.0 per entry."""
    bits = (packed.unsqueeze(1) & _BITS.to(packed.device)).ne(0).view(-1)[:numel]
    return bits.float().mul_(2).sub_(1)


@named_by_kind("compress", builder="build")
class ScaledSign(Compressor):
    error_bound = "||x-d||^2 == ||x||^2 - ||x||_1^2 / n"

    def encode(self, x: torch.Tensor, key: object = 0, segments: tuple[int, ...] | None = None) -> Payload:
        x = x.detach().reshape(-1).float()
        parts = segments or (x.numel(),)
        scale = segment_sum(x.abs(), segment_ids(parts, x.device), len(parts)) / x.new_tensor(parts)
        return Payload((scale, pack_signs(x)), x.numel(), segments)

    def decode(self, payload: Payload) -> torch.Tensor:
        scale, packed = payload.tensors
        return unpack_signs(packed, payload.numel).mul_(scale[segment_ids(payload.parts, packed.device)])

    def layout(self, numel: int, nbytes: int, segments=None) -> list[tuple[torch.dtype, int]]:
        return [(torch.float32, len(segments or (numel,))), (torch.uint8, (numel + 7) // 8)]


class MajorityVote(ScaledSign):
    name = ScaledSign.name + ":vote"
    error_bound = "each device: d == (||x||_1/n) sign(x); combined: sign of the vote times the mean scale"

    def combine(self, decoded: list[torch.Tensor]) -> torch.Tensor:
        votes = torch.stack([d.sign() for d in decoded]).sum(0)
        scale = torch.stack([d.abs() for d in decoded]).mean(0)  # each device's per-tensor scale, averaged
        return votes.sign_().mul_(scale)


def build(spec, link=None, seed: int = 0, rank: int = 0):
    """``--compress sign``: EF-signSGD, or with ``vote`` signSGD's majority vote (no error feedback)."""
    if "vote" in spec.options:
        return MajorityVote(), NoMemory()
    return ScaledSign(), NoMemory() if "noef" in spec.options else ResidualMemory()
