"""What one device puts on its link per exchange, for a ``--sync`` / ``--compress`` pair.

An *exchange* is the communication a mode does at once: a synchronous step
(one collective per DDP gradient bucket), a local-SGD average, an async
round, a gossip swap with the ring neighbours. Bytes are those the comm code
sends, not a formula of our own:

* payloads come from encoding a tensor of the right length with the real
  compressor (``edgetrain.comm.compress.build_compressor``) and reading
  ``Payload.nbytes``; summable compressors (fp32, fp16, bf16, random-k) are
  all-reduced, the others (int8, qsgd, top-k, sign) all-gathered;
* per-device traffic of a collective is ``edgetrain.comm.accounting``'s
  ``ring_allreduce_bytes`` / ``ring_allgather_bytes``;
* PowerSGD follows PyTorch's hook: per bucket, one all-reduce of the
  matrices it does not compress and one each of ``P`` and ``Q``, with the
  hook's own ``_should_compress`` rule (its first ``start`` steps send plain
  fp32 and are not modelled).

Synchronous DDP exchanges each gradient bucket separately (so a model in two
buckets pays the ring latency twice); local SGD and async average the whole
flattened model in one tensor; gossip sends its fp32 parameters to each ring
neighbour in one point-to-point round.

``threshold`` is refused: its payload depends on the gradients' values.
DGC's and top-k's warm-up ramps are not modelled (steady-state density).
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch

from edgetrain.comm.accounting import ring_allgather_bytes, ring_allreduce_bytes
from edgetrain.comm.compress.memory import DGCMemory, ResidualMemory
from edgetrain.comm.compress.spec import build_compressor
from edgetrain.errors import EdgetrainError
from edgetrain.plan.costs import ModelCosts
from edgetrain.spec import CompressSpec, SyncSpec, check_compatible


@dataclass(frozen=True)
class Traffic:
    """One device's communication. ``collectives``: (kind, bytes this device sends) of one exchange;
    kinds are those of ``edgetrain.cluster.links.ROUNDS``."""

    mode: str                    # sync, local, async, gossip
    period: int                  # steps between exchanges (async: the staleness bound)
    collectives: tuple[tuple[str, int], ...]
    payload_bytes: int           # the compressed data of one exchange, before the algorithm's traffic
    fp32_bytes: int              # the same data in fp32 (what plain DDP sends)
    neighbours_only: bool        # gossip: each device talks to its ring neighbours, not to all
    state_copies: float          # model-sized fp32 buffers the mode and compressor keep (for memory)
    sync: str = "sync"
    compress: str = "none"

    @property
    def bytes_per_exchange(self) -> int:
        return sum(b for _, b in self.collectives)

    @property
    def rounds_kinds(self) -> list[str]:
        return [k for k, _ in self.collectives]


def traffic(costs: ModelCosts, devices: int, sync: SyncSpec, compress: CompressSpec) -> Traffic:
    """The traffic of one device in a cluster of ``devices`` (specs parsed once: ``edgetrain.spec``)."""
    sync_spec, spec = sync, compress
    check_compatible(sync_spec, spec)  # a caller may pair specs that config.resolve never saw
    if spec.method == "threshold":
        raise EdgetrainError("--compress threshold sends as many entries as crossed the threshold, which depends on "
                             "the gradients' values: the planner cannot predict it; measure it with edgetrain train, "
                             "or plan with topk:RATIO at the density you expect")
    p = devices
    numel = costs.params
    common = dict(sync=sync_spec.text, compress=spec.text, fp32_bytes=4 * numel)
    if sync_spec.mode == "gossip":
        neighbours = len({-1 % p, 1 % p} - {0}) if p > 1 else 0
        sent = neighbours * 4 * numel
        return Traffic("gossip", sync_spec.period, (("p2p", sent),) if neighbours else (), payload_bytes=4 * numel,
                       neighbours_only=True, state_copies=neighbours + 1 if neighbours else 0, **common)
    if sync_spec.mode == "sync":
        return _synchronous(costs, p, spec, common)
    if sync_spec.mode == "streaming":  # its exchanges overlap compute, which this model of blocking rounds has not
        raise EdgetrainError(f"the planner does not model --sync {sync_spec.text} (background exchanges of "
                             "fragments); plan with diloco:H for the bytes, or measure with edgetrain train")
    # local SGD and async average the flattened model (pseudo-gradient) in one tensor
    kind, payload = _payload(spec, numel)
    sent = _traffic_bytes(kind, payload, p)
    copies = 1 + _memory_copies(spec)                     # ref
    if sync_spec.mode == "local":
        copies += 1 if sync_spec.nesterov else 0           # the outer optimizer's momentum
        return Traffic("local", sync_spec.period, ((kind, sent),) if p > 1 else (), payload_bytes=payload,
                       neighbours_only=False, state_copies=copies, **common)
    return Traffic("async", sync_spec.staleness, ((kind, sent),) if p > 1 else (), payload_bytes=payload,
                   neighbours_only=False, state_copies=copies + 1, **common)  # + the snapshot of the round in flight


def _synchronous(costs: ModelCosts, p: int, spec: CompressSpec, common: dict) -> Traffic:
    if p == 1:  # one device runs the bare model: no DDP, no hook
        return Traffic("sync", 1, (), payload_bytes=0, neighbours_only=False, state_copies=0.0, **common)
    collectives: list[tuple[str, int]] = []
    payload_total = 0
    copies = 1.0  # DDP's bucket buffers (gradient_as_bucket_view is off): a second copy of the gradients
    if spec.is_powersgd:
        rank = int(spec.arg or 2)
        for bucket in costs.buckets:
            parts = _powersgd_parts([costs.param_shapes[i] for i in bucket], rank)
            payload_total += 4 * sum(parts)
            collectives += [("allreduce", ring_allreduce_bytes(4 * n, p)) for n in parts]
        copies += 1  # PowerSGD's error feedback (warm-started P and Q are small and not counted)
    else:
        for numel in costs.bucket_numels:
            kind, payload = _payload(spec, numel)
            payload_total += payload
            collectives.append((kind, _traffic_bytes(kind, payload, p)))
        copies += _memory_copies(spec)
    return Traffic("sync", 1, tuple(collectives), payload_bytes=payload_total, neighbours_only=False,
                   state_copies=copies, **common)


def _payload(spec: CompressSpec, numel: int) -> tuple[str, int]:
    """(collective kind, payload bytes) of compressing ``numel`` fp32 values with ``spec``."""
    return _encoded(spec, numel)


@functools.lru_cache(maxsize=256)
def _encoded(spec: CompressSpec, numel: int) -> tuple[str, int]:
    compressor, _ = build_compressor(spec)
    x = torch.randn(numel, generator=torch.Generator().manual_seed(0))
    payload = compressor.encode(x, key="plan")
    return ("allreduce" if compressor.summable else "allgather"), payload.nbytes


def _traffic_bytes(kind: str, payload: int, p: int) -> int:
    return ring_allreduce_bytes(payload, p) if kind == "allreduce" else ring_allgather_bytes(payload, p)


def _memory_copies(spec: CompressSpec) -> int:
    """Model-sized buffers the compressor's error feedback keeps: residual 1, DGC 2 (velocity, accumulation)."""
    if spec.is_powersgd:
        return 1
    _, memory = build_compressor(spec)
    return 2 if isinstance(memory, DGCMemory) else 1 if isinstance(memory, ResidualMemory) else 0


def _powersgd_parts(shapes: list[tuple[int, ...]], rank: int) -> list[int]:
    """Values PyTorch's PowerSGD hook all-reduces for one bucket: [uncompressed, P, Q]."""
    from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import _should_compress

    uncompressed = ps = qs = 0
    for shape in shapes:
        n = shape[0] if shape else 1
        m = math.prod(shape[1:]) if len(shape) > 1 else 1
        r = min(n, m, rank)
        if _should_compress(n, m, r, 2)[0]:   # PowerSGDState's default min_compression_rate
            ps += n * r
            qs += m * r
        else:
            uncompressed += n * m
    return [uncompressed, ps, qs]
