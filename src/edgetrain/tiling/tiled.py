"""Tiled forward and backward of the tiled section, with autograd: halo exchange, hand-off
all-to-all and whole-map BatchNorm, each an autograd function with its adjoint as backward.

Design: docs/design/tiling.md
"""
from __future__ import annotations

import time
from collections import Counter

import torch
import torch.distributed as dist
import torch.nn.functional as F

from edgetrain.cluster.peers import wait
from edgetrain.models.batchnorm import cross_device_moments
from edgetrain.tiling.layers import Block, Layer, Unit
from edgetrain.tiling.plan import Rect, SectionPlan, intersect_rect
from edgetrain.tiling.regions import Step

Index = tuple[slice, ...]


class Comm:
    """This device's place in the tiling group, and the bytes and seconds it spent communicating."""

    def __init__(self, group=None, timeout_s: float = 300.0):
        self.group = group
        self.distributed = dist.is_available() and dist.is_initialized()
        self.rank = dist.get_rank(group) if self.distributed else 0
        self.world = dist.get_world_size(group) if self.distributed else 1
        self.timeout_s = timeout_s
        self.bytes_sent: Counter[str] = Counter()
        self.bytes_recv = 0
        self.seconds: Counter[str] = Counter()

    def reset(self) -> None:
        self.bytes_sent.clear()
        self.bytes_recv = 0
        self.seconds.clear()

    def _global(self, rank: int) -> int:
        return dist.get_global_rank(self.group, rank) if self.group is not None else rank

    def exchange(self, sends: list[tuple[int, torch.Tensor]], recvs: list[tuple[int, torch.Tensor]],
                 kind: str) -> None:
        """Send and receive tensors to and from peers (not self), all at once."""
        start = time.perf_counter()
        # gloo sends only CPU tensors point to point (a CUDA one fails: "Bad address"): a GPU's go via the host
        staged = [(buf, buf if buf.device.type == "cpu" else torch.empty(buf.shape, dtype=buf.dtype))
                  for _, buf in recvs]
        works = [dist.irecv(host, src=self._global(peer), group=self.group)
                 for (peer, _), (_, host) in zip(recvs, staged)]
        payload = []
        for peer, t in sends:
            t = t.contiguous().cpu()
            payload.append(t)
            works.append(dist.isend(t, dst=self._global(peer), group=self.group))
            self.bytes_sent[kind] += t.numel() * t.element_size()
        for w in works:
            wait(w, self.timeout_s, f"tiled training: {kind} exchange")
        for buf, host in staged:
            if host is not buf:
                buf.copy_(host)
        self.bytes_recv += sum(buf.numel() * buf.element_size() for _, buf in recvs)
        self.seconds[kind] += time.perf_counter() - start

    def all_reduce(self, t: torch.Tensor, kind: str) -> torch.Tensor:
        """Sum ``t`` in place over the group; the bytes counted are the payload, not the algorithm's traffic."""
        if self.world == 1:
            return t
        start = time.perf_counter()
        wait(dist.all_reduce(t, group=self.group, async_op=True), self.timeout_s, f"tiled training: {kind} all-reduce")
        self.bytes_sent[kind] += t.numel() * t.element_size()
        self.bytes_recv += t.numel() * t.element_size()
        self.seconds[kind] += time.perf_counter() - start
        return t


class Exchange(torch.autograd.Function):
    """``out[recv index] = owner's local[send index]`` for every piece; backward is the adjoint (sums)."""

    @staticmethod
    def forward(ctx, local: torch.Tensor, comm: Comm, out_shape: tuple[int, ...],
                sends: list[tuple[int, Index]], recvs: list[tuple[int, Index]], kind: str) -> torch.Tensor:
        ctx.comm, ctx.sends, ctx.recvs, ctx.kind = comm, sends, recvs, kind
        ctx.local_shape = local.shape
        out = local.new_empty(out_shape)
        _move(comm, local, out, sends, recvs, kind, add=False)
        return out

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        grad_local = grad_out.new_zeros(ctx.local_shape)
        # The adjoint runs every piece the other way and sums where pieces overlap.
        _move(ctx.comm, grad_out.contiguous(), grad_local, ctx.recvs, ctx.sends, ctx.kind + "_backward", add=True)
        return grad_local, None, None, None, None, None


def _move(comm: Comm, src: torch.Tensor, dst: torch.Tensor, sends: list[tuple[int, Index]],
          recvs: list[tuple[int, Index]], kind: str, add: bool) -> None:
    me = comm.rank
    own_src = [idx for peer, idx in sends if peer == me]
    own_dst = [idx for peer, idx in recvs if peer == me]
    buffers = [(peer, idx, src.new_empty(dst[idx].shape)) for peer, idx in recvs if peer != me]
    comm.exchange([(peer, src[idx]) for peer, idx in sends if peer != me],
                  [(peer, buf) for peer, _, buf in buffers], kind)
    for s_idx, d_idx in zip(own_src, own_dst):
        if add:
            dst[d_idx] += src[s_idx]
        else:
            dst[d_idx] = src[s_idx]
    for _, idx, buf in buffers:
        if add:
            dst[idx] += buf
        else:
            dst[idx] = buf


def _index(rect: Rect, origin: tuple[int, int], batch: slice = slice(None)) -> Index:
    (r0, r1), (c0, c1) = rect
    return batch, slice(None), slice(r0 - origin[0], r1 - origin[0]), slice(c0 - origin[1], c1 - origin[1])


def halo_exchange(owned: torch.Tensor, plan: SectionPlan, a: int, b: int, comm: Comm) -> torch.Tensor:
    """From the region of map ``a`` this device owns to the region group ``a..b`` needs."""
    me = comm.rank
    mine = plan.owned(a, me)
    need = plan.group_input(a, b, me)
    sends, recvs = [], []
    for peer in range(plan.devices):
        piece = intersect_rect(plan.group_input(a, b, peer), mine)
        if piece:
            sends.append((peer, _index(piece, (mine[0][0], mine[1][0]))))
        piece = intersect_rect(need, plan.owned(a, peer))
        if piece:
            recvs.append((peer, _index(piece, (need[0][0], need[1][0]))))
    shape = (owned.shape[0], owned.shape[1], need[0][1] - need[0][0], need[1][1] - need[1][0])
    return Exchange.apply(owned, comm, shape, sends, recvs, "halo")


def batch_bounds(n: int, world: int) -> list[int]:
    return [i * n // world for i in range(world + 1)]


def hand_off(owned: torch.Tensor, plan: SectionPlan, comm: Comm) -> torch.Tensor:
    """All-to-all: from this device's tile of the whole batch to whole maps of its share of the batch."""
    me, end = comm.rank, plan.end
    shares = batch_bounds(owned.shape[0], plan.devices)
    sends, recvs = [], []
    for peer in range(plan.devices):
        sends.append((peer, (slice(shares[peer], shares[peer + 1]),)))
        recvs.append((peer, _index(plan.owned(end, peer), (0, 0))))
    shape = (shares[me + 1] - shares[me], owned.shape[1], plan.sizes[0][end], plan.sizes[1][end])
    return Exchange.apply(owned, comm, shape, sends, recvs, "handoff")


class TiledBatchNorm(torch.autograd.Function):
    """Training-mode BatchNorm of a tile with whole-map statistics (docs/design/tiling.md)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None,
                owned: Index, bn: torch.nn.BatchNorm2d, comm: Comm) -> torch.Tensor:
        shift = bn.running_mean if bn.track_running_stats else None
        start = time.perf_counter()
        mean, var, n = cross_device_moments(x[owned], comm.group if comm.world > 1 else None, shift)
        if comm.world > 1:
            payload = (2 * x.shape[1] + 1) * x.element_size()
            comm.bytes_sent["batchnorm"] += payload
            comm.bytes_recv += payload
            comm.seconds["batchnorm"] += time.perf_counter() - start
        if bn.track_running_stats:
            bn.num_batches_tracked.add_(1)
            m = bn.momentum if bn.momentum is not None else 1.0 / float(bn.num_batches_tracked)
            bn.running_mean.mul_(1 - m).add_(mean, alpha=m)
            bn.running_var.mul_(1 - m).add_(var * (n / (n - 1)), alpha=m)
        invstd = torch.rsqrt(var + bn.eps)
        y = F.batch_norm(x, mean, var, weight, bias, False, 0.0, bn.eps)
        ctx.save_for_backward(x, weight, mean, invstd)
        ctx.owned, ctx.comm, ctx.n = owned, comm, n
        ctx.has_bias = bias is not None
        return y

    @staticmethod
    def backward(ctx, gy: torch.Tensor):
        x, weight, mean, invstd = ctx.saved_tensors
        shape = (1, -1, 1, 1)
        sum_gy = gy.sum((0, 2, 3))
        sum_gy_xhat = x.sub(mean.view(shape)).mul_(gy).sum((0, 2, 3)) * invstd
        total_gy, total_gy_xhat = ctx.comm.all_reduce(torch.cat([sum_gy, sum_gy_xhat]), "batchnorm_backward").chunk(2)
        scale = invstd if weight is None else invstd * weight
        gx = gy * scale.view(shape)
        # The statistics' share of the gradient, on owned elements only:
        # gx -= scale / n * (total_gy + xhat * total_gy_xhat), written as gx -= a + b * x.
        b = scale * invstd * total_gy_xhat / ctx.n
        a = scale * total_gy / ctx.n - b * mean
        owned = gx[ctx.owned]
        owned.addcmul_(x[ctx.owned], b.view(shape), value=-1.0).sub_(a.view(shape))
        # This device's share of the weight gradients; the strategy sums the shares over devices.
        gw = sum_gy_xhat if weight is not None else None
        gb = sum_gy if ctx.has_bias else None
        return gx, gw, gb, None, None, None


def _batchnorm(layer: Layer, r: Step, c: Step, x: torch.Tensor, comm: Comm) -> torch.Tensor:
    bn = layer.module
    if bn.training or not bn.track_running_stats:
        owned = (slice(None), slice(None), slice(r.owned[0] - r.src[0], r.owned[1] - r.src[0]),
                 slice(c.owned[0] - c.src[0], c.owned[1] - c.src[0]))
        return TiledBatchNorm.apply(x, bn.weight, bn.bias, owned, bn, comm)
    return F.batch_norm(x, bn.running_mean, bn.running_var, bn.weight, bn.bias, False, 0.0, bn.eps)


def run_layer(layer: Layer, r: Step, c: Step, x: torch.Tensor, comm: Comm) -> torch.Tensor:
    """One layer on one tile: ``x`` holds ``(r.src, c.src)``; the result holds ``(r.dst, c.dst)``."""
    (r0, r1), (c0, c1) = r.crop, c.crop
    if (r0, r1, c0, c1) != (0, x.shape[2], 0, x.shape[3]):
        x = x[:, :, r0:r1, c0:c1]
    m = layer.module
    if layer.kind == "batchnorm":
        return _batchnorm(layer, r, c, x, comm)
    if layer.kind == "elementwise":
        return m(x)
    pads = (*c.pad, *r.pad)
    if any(pads):
        x = F.pad(x, pads, value=layer.pad_value)
    kr, kc = layer.windows
    if layer.kind == "conv":
        return F.conv2d(x, m.weight, m.bias, (kr.stride, kc.stride), 0, (kr.dilation, kc.dilation), m.groups)
    if layer.kind == "maxpool":
        return F.max_pool2d(x, (kr.kernel, kc.kernel), (kr.stride, kc.stride), 0, (kr.dilation, kc.dilation))
    if layer.kind == "avgpool":
        return F.avg_pool2d(x, (kr.kernel, kc.kernel), (kr.stride, kc.stride), 0, False, True,
                            m.divisor_override)
    return x  # "pad": the padding above is the layer


def run_units(units: list[Unit], rows: tuple[Step, ...], cols: tuple[Step, ...], x: torch.Tensor,
              comm: Comm) -> torch.Tensor:
    for u, r, c in zip(units, rows, cols):
        if isinstance(u, Layer):
            x = run_layer(u, r, c, x, comm)
            continue
        main = _crop_to(x, r, c, r.main[0].src, c.main[0].src)
        main = run_units(u.main, r.main, c.main, main, comm)
        if u.shortcut:
            short = _crop_to(x, r, c, r.shortcut[0].src, c.shortcut[0].src)
            short = run_units(u.shortcut, r.shortcut, c.shortcut, short, comm)
        else:
            short = _crop_to(x, r, c, r.dst, c.dst)
        x = u.post(main + short)
    return x


def _crop_to(x: torch.Tensor, r: Step, c: Step, rows, cols) -> torch.Tensor:
    return x[:, :, rows[0] - r.src[0]:rows[1] - r.src[0], cols[0] - c.src[0]:cols[1] - c.src[0]]


def section_forward(x: torch.Tensor, plan: SectionPlan, groups: list[tuple[int, int]], comm: Comm) -> torch.Tensor:
    """The tiled section on this device: whole input batch in, the owned tile of the last map out."""
    me = comm.rank
    h = x
    for a, b in groups:
        if a == 0:
            (r0, r1), (c0, c1) = plan.group_input(a, b, me)
            h = x[:, :, r0:r1, c0:c1]
        else:
            h = halo_exchange(h, plan, a, b, comm)
        h = run_units(plan.units[a:b], plan.steps(a, b, me, 0), plan.steps(a, b, me, 1), h, comm)
    return h
