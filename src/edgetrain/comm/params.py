"""Whole-model helpers shared by the parameter-averaging modes (local SGD, async, gossip)."""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.utils import parameters_to_vector

from edgetrain.cluster.peers import wait
from edgetrain.comm.accounting import ring_allreduce_bytes
from edgetrain.comm.emulation import LinkEmulator


def broadcast_model(model: nn.Module, emulator: LinkEmulator, group=None) -> None:
    """Start every device from rank 0's parameters and buffers (DDP does this in its constructor).

    Setup traffic, not counted: DDP's own initial broadcast is not counted either, and the
    modes should compare on what training sends.
    """
    tensors = [t for t in list(model.parameters()) + list(model.buffers()) if t.is_floating_point()]
    if not tensors:
        return
    flat = flatten(tensors)
    wait(dist.broadcast(flat, src=0, group=group, async_op=True), emulator.timeout_s, "initial model broadcast")
    unflatten(flat, tensors)


def flatten(tensors: list[torch.Tensor]) -> torch.Tensor:
    """One fp32 vector holding ``tensors`` back to back (a copy); fp64 if they all are (exactness tests)."""
    wide = bool(tensors) and all(t.dtype == torch.float64 for t in tensors)
    return parameters_to_vector([t.detach().to(torch.float64 if wide else torch.float32) for t in tensors]).clone()


def unflatten(flat: torch.Tensor, tensors: list[torch.Tensor]) -> None:
    """Copy ``flat`` back into ``tensors`` in place (parameters keep their identity and optimizer state)."""
    offset = 0
    with torch.no_grad():
        for t in tensors:
            t.copy_(flat[offset:offset + t.numel()].view_as(t))
            offset += t.numel()


def average_buffers(model: nn.Module, emulator: LinkEmulator, world_size: int, group=None, secure=None) -> None:
    """Average floating-point buffers (BatchNorm statistics) in fp32 over all devices; masked with ``secure``
    (a ``secagg.SecureSum``, whose group is every device)."""
    buffers = [b for b in model.buffers() if b.is_floating_point()]
    if not buffers or world_size == 1:
        return
    flat = flatten(buffers)
    if secure is not None:
        total = secure.sum(flat.float(), list(range(world_size)), "buffers", emulator, group)
        unflatten(total / world_size, buffers)
        return

    def collective() -> None:
        wait(dist.all_reduce(flat, group=group, async_op=True), emulator.timeout_s, "buffer all-reduce")

    emulator.run("allreduce", ring_allreduce_bytes(flat.numel() * 4, world_size), collective)
    unflatten(flat / world_size, buffers)
