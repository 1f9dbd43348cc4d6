"""What each device runs in the secure aggregation tests (started by ``edgetrain_testing.on_devices``)."""
from __future__ import annotations

import torch
import torch.distributed as dist

N = 5000


def update(rank: int, scale: float = 1.0) -> torch.Tensor:
    """Device ``rank``'s update: its own values, its own magnitude (10^(rank-1))."""
    g = torch.Generator().manual_seed(100 + rank)
    return torch.randn(N, generator=g) * (10.0 ** (rank - 1)) * scale


def secure_sums(rank: int, world: int) -> dict:
    """Masked sums against gloo's plain fp32 all-reduce and the exact fp64 sum: all devices, a larger range (the
    scale is redone), a subset of members in a group of their own, random-k's shared coordinates, a NaN."""
    from edgetrain.comm.accounting import ring_allreduce_bytes
    from edgetrain.comm.compress import NoMemory, RandomK
    from edgetrain.comm.emulation import LinkEmulator
    from edgetrain.comm.exchange import Channel, average
    from edgetrain.comm.secagg import TAIL, SecureSum

    secure = SecureSum.agree(rank, world, None, 60)
    emulator = LinkEmulator(None, rank)
    everyone = list(range(world))
    out = {}
    for name, scale in (("first", 1.0), ("again", 1.0), ("larger", 1000.0)):
        x = update(rank, scale)
        before = emulator.stats.bytes_sent
        got = secure.sum(x, everyone, "params", emulator, None).double()
        plain = x.clone()
        dist.all_reduce(plain)
        exact = sum(update(r, scale).double() for r in everyone)
        out[name] = {"error": float((got - exact).abs().max()), "step": secure.last_step,
                     "vs_plain": float((got - plain.double()).abs().max()), "largest": float(exact.abs().max()),
                     "bytes": emulator.stats.bytes_sent - before}
    out["redone"] = secure.redone
    out["want_bytes"] = ring_allreduce_bytes(4 * (N + TAIL), world)
    members = [0, world - 1]
    sub = dist.new_group(members)
    if rank in members:
        got = secure.sum(update(rank), members, "params", emulator, sub).double()
        out["members_error"] = float((got - sum(update(r).double() for r in members)).abs().max())
        out["members_step"] = secure.last_step
    x = update(rank)
    masked = average(x, Channel(RandomK(0.1, seed=3), NoMemory(), emulator, secure=secure), key="r")
    clear = average(x, Channel(RandomK(0.1, seed=3), NoMemory(), emulator), key="r")
    out["randk_error"] = float((masked - clear).abs().max())
    out["randk_step"] = secure.last_step / world
    broken = update(rank)
    if rank == 1:
        broken[7] = float("nan")
    out["nan"] = bool(secure.sum(broken, everyone, "nan", emulator, None).isnan().all())
    return out
