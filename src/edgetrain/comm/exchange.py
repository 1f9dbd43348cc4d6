"""Average a tensor over devices through a compressor: the one path every mode uses.

``average`` runs the GRACE pipeline for one flat tensor::

    compensated = memory.compensate(x)        # add what was not sent before
    payload     = compressor.encode(compensated)
    memory.update(compensated, decode(payload))   # keep what was not sent now
    all-reduce (summable) or all-gather the payloads, decode, combine

and charges every collective to the device's ``LinkEmulator``: bytes from the
packed payload actually handed to gloo, times the traffic of the algorithm
(``edgetrain.comm.accounting``), and modelled time from the link model.

Collectives block until done (``cluster.peers.wait``, bounded by the run's
``--timeout``) before the function returns; see ``emulation.py`` for why.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from edgetrain.cluster.peers import wait
from edgetrain.comm.accounting import ring_allgather_bytes, ring_allreduce_bytes
from edgetrain.comm.compress.base import Compressor, Payload, unpack
from edgetrain.comm.emulation import LinkEmulator


@dataclass(frozen=True)
class Channel:
    """How a tensor travels between devices: the ``compressor`` and its error-feedback ``memory``, the
    ``emulator`` that charges each collective to the device's link and counts its bytes, over ``group`` (None:
    every device; ``peers``: its global ranks where it is not every device, a round's members, whose links
    alone set the modelled time), and the ``secagg.SecureSum`` that masks the sum (None: in the clear)."""

    compressor: Compressor
    memory: object
    emulator: LinkEmulator
    group: object = None
    peers: list[int] | None = None
    secure: object = None

    def average(self, x: torch.Tensor, key: object, segments: tuple[int, ...] | None,
                names: tuple[object, ...] | None) -> torch.Tensor:
        """The mean of ``x`` over the group (``average``); the same on every one of its devices."""
        return average(x, self, key, segments, names)


def average(x: torch.Tensor, channel: Channel, key: object = 0, segments: tuple[int, ...] | None = None,
            names: tuple[object, ...] | None = None) -> torch.Tensor:
    """The mean over ``channel``'s group of every device's decoded ``x`` (flat fp32).

    ``segments``: lengths of the tensors laid end to end in ``x`` (see ``compress/base.py``).
    ``names``: a stable name for each segment (one for the whole ``x`` without segments), e.g.
    its parameter, under which the memory keeps that segment's state whatever its place in
    ``x`` (see ``compress/memory.py``); without names the memory keeps ``x`` whole under ``key``.
    """
    x = x.detach().reshape(-1)
    x = x if x.dtype == torch.float64 else x.float()  # fp64 only in exactness tests; compressors read fp32
    parts = tuple(zip(names, segments or (x.numel(),), strict=True)) if names else None
    payload, own = compress(x, channel.compressor, channel.memory, key, parts, segments)
    world = dist.get_world_size(channel.group) if dist.is_initialized() else 1
    if world == 1:
        return own
    if channel.secure is not None:
        return _secure_allreduce(payload, channel, world, key)
    if channel.compressor.summable:
        return _allreduce(payload, channel, world)
    return _allgather(payload, channel, world)


def compress(x: torch.Tensor, compressor: Compressor, memory, key: object = 0, parts=None,
             segments: tuple[int, ...] | None = None) -> tuple[Payload, torch.Tensor]:
    """The payload of ``x`` plus what ``memory`` kept from before, and its decoded value; the memory keeps
    what this payload leaves out (error feedback). The first half of ``average``; the Flower app sends it."""
    compensated = memory.compensate(x, key, parts)
    payload = compressor.encode(compensated, key, segments)
    own = compressor.decode(payload)
    memory.update(compensated, own, key, parts)
    return payload, own


def start_exchange(payload: Payload, compressor: Compressor, group, world: int):
    """Start ``payload``'s exchange in the background: an all-reduce of a summable compressor's one tensor, else an
    all-gather of the packed bytes. Returns (buffer, received or None, kind, bytes sent, work) for the caller to
    wait on and decode later (asynchronous rounds, streaming fragments)."""
    if compressor.summable:
        buf = payload.tensors[0].clone()
        sent = ring_allreduce_bytes(buf.numel() * buf.element_size(), world)
        return buf, None, "allreduce", sent, dist.all_reduce(buf, group=group, async_op=True)
    buf = payload.pack()
    received = [torch.empty_like(buf) for _ in range(world)]
    sent = ring_allgather_bytes(buf.numel(), world)
    return buf, received, "allgather", sent, dist.all_gather(received, buf, group=group, async_op=True)


def _allreduce(payload: Payload, channel: Channel, world: int) -> torch.Tensor:
    compressor, emulator, group = channel.compressor, channel.emulator, channel.group
    if len(payload.tensors) != 1:
        raise ValueError(f"summable compressor {compressor.name} must send one tensor")
    buf = payload.tensors[0].clone()
    nbytes = buf.numel() * buf.element_size()

    def collective() -> None:
        wait(dist.all_reduce(buf, group=group, async_op=True), emulator.timeout_s, f"{compressor.name} all-reduce")

    emulator.run("allreduce", ring_allreduce_bytes(nbytes, world), collective, channel.peers)
    total = compressor.decode(Payload((buf,), payload.numel, payload.segments, payload.ctx))
    return total.div_(world)


def _secure_allreduce(payload: Payload, channel: Channel, world: int, key: object) -> torch.Tensor:
    """``_allreduce`` with every device's payload masked (``secagg.py``): only the sum is revealed."""
    compressor = channel.compressor
    (values,) = payload.tensors
    if not compressor.summable or values.dtype != torch.float32:  # the kinds refuse these before any device starts
        raise ValueError(f"secure aggregation sums fp32 payloads, not {compressor.name}'s")
    members = group_ranks(channel.group, world)
    total = channel.secure.sum(values, members, key, channel.emulator, channel.group, channel.peers)
    return compressor.decode(Payload((total,), payload.numel, payload.segments, payload.ctx)).div_(world)


def group_ranks(group, world: int) -> list[int]:
    """The global ranks of ``group`` in its rank order (every device when ``group`` is None)."""
    return list(range(world)) if group is None else dist.get_process_group_ranks(group)


def _allgather(payload: Payload, channel: Channel, world: int) -> torch.Tensor:
    compressor, emulator, group, peers = channel.compressor, channel.emulator, channel.group, channel.peers
    buf = payload.pack()
    if compressor.fixed_size:
        sizes = [buf.numel()] * world
    else:
        size = torch.tensor([buf.numel()], dtype=torch.int64)
        gathered = [torch.empty_like(size) for _ in range(world)]

        def exchange_sizes() -> None:
            wait(dist.all_gather(gathered, size, group=group, async_op=True), emulator.timeout_s,
                 f"{compressor.name} size all-gather")

        emulator.run("allgather", ring_allgather_bytes(8, world), exchange_sizes, peers)
        sizes = [int(s.item()) for s in gathered]
        longest = max(sizes)
        if longest > buf.numel():  # gloo gathers equal lengths: pad, and count the padding as sent
            buf = torch.cat([buf, buf.new_zeros(longest - buf.numel())])
    received = [torch.empty_like(buf) for _ in range(world)]

    def collective() -> None:
        wait(dist.all_gather(received, buf, group=group, async_op=True), emulator.timeout_s,
             f"{compressor.name} all-gather")

    emulator.run("allgather", ring_allgather_bytes(buf.numel(), world), collective, peers)
    decoded = [compressor.decode(unpack(r[:n], compressor.layout(payload.numel, n, payload.segments),
                                        payload.numel, payload.segments))
               for r, n in zip(received, sizes)]
    return compressor.combine(decoded)
