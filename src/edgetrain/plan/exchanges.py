"""What one device puts on its link per exchange, for a ``--sync`` / ``--compress`` pair.

Design: docs/design/planner.md ("Traffic per exchange").
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import _should_compress

from edgetrain.comm.accounting import ring_allgather_bytes, ring_allreduce_bytes
from edgetrain.comm.compress.memory import DGCMemory, ResidualMemory
from edgetrain.comm.compress.spec import build_compressor
from edgetrain.errors import EdgetrainError
from edgetrain.plan.costs import ModelCosts
from edgetrain.kinds import check_compatible
from edgetrain.spec import CompressSpec, ServerOptSpec, SyncSpec


@dataclass(frozen=True)
class Traffic:
    """One device's communication. ``collectives``: (kind, bytes this device sends) of one exchange;
    kinds are those of ``edgetrain.cluster.links.ROUNDS``."""

    mode: str                    # the sync mode (its kind's ``timing`` says how steps wait for it)
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


@dataclass(frozen=True)
class TrafficOptions:
    """What a sync mode's traffic may need beyond the two specs (``config.resolve``'s ``RunSpec`` has them)."""

    steps_per_epoch: int | None = None    # steps of one pass over the training set (None: not known here)
    server_opt: ServerOptSpec = ServerOptSpec()
    participation: float = 1.0


def traffic(costs: ModelCosts, devices: int, sync: SyncSpec, compress: CompressSpec,
            options: TrafficOptions = TrafficOptions()) -> Traffic:
    """The traffic of one device in a cluster of ``devices`` (specs parsed once: ``edgetrain.spec``), as the sync
    mode's planner model says (its kind's ``planner``, ``edgetrain.kinds``); a kind without one is refused."""
    check_compatible(sync, compress)  # a caller may pair specs that config.resolve never saw
    compress.kind.load_planner()      # a compressor the planner cannot model is refused in its own line
    return sync.kind.load_planner()(costs, devices, sync, compress, options)


def _common(costs: ModelCosts, sync: SyncSpec, compress: CompressSpec) -> dict:
    return dict(sync=sync.text, compress=compress.text, fp32_bytes=4 * costs.params)


def _compressed(costs: ModelCosts, p: int, spec: CompressSpec, whole_model: bool
                ) -> tuple[tuple[tuple[str, int], ...], int, float]:
    """(collectives, payload bytes, model-sized buffers of error feedback) of one exchange of ``spec``: of DDP's
    gradient buckets, or of the whole flattened model (``whole_model``), as the compressor's planner says."""
    return spec.kind.load_planner()(costs, p, spec, whole_model)


def gossip(costs: ModelCosts, p: int, sync: SyncSpec, compress: CompressSpec, options: TrafficOptions) -> Traffic:
    """``gossip[:H]``: fp32 parameters to each ring neighbour in one point-to-point round."""
    numel = costs.params
    neighbours = len({-1 % p, 1 % p} - {0}) if p > 1 else 0
    sent = neighbours * 4 * numel
    return Traffic("gossip", sync.period, (("p2p", sent),) if neighbours else (), payload_bytes=4 * numel,
                   neighbours_only=True, state_copies=neighbours + 1 if neighbours else 0,
                   **_common(costs, sync, compress))


def synchronous(costs: ModelCosts, p: int, sync: SyncSpec, compress: CompressSpec,
                options: TrafficOptions) -> Traffic:
    """``sync``: DDP's gradient buckets, each exchanged on its own."""
    common = _common(costs, sync, compress)
    if p == 1:  # one device runs the bare model: no DDP, no hook
        return Traffic("sync", 1, (), payload_bytes=0, neighbours_only=False, state_copies=0.0, **common)
    collectives, payload, memory = _compressed(costs, p, compress, whole_model=False)
    # + DDP's bucket buffers (gradient_as_bucket_view is off): a second copy of the gradients
    return Traffic("sync", 1, collectives, payload_bytes=payload, neighbours_only=False,
                   state_copies=1.0 + memory, **common)


def local_sgd(costs: ModelCosts, p: int, sync: SyncSpec, compress: CompressSpec, options: TrafficOptions) -> Traffic:
    """``local:H``: the flattened model's delta in one tensor every H steps; keeps the reference model."""
    collectives, payload, memory = _compressed(costs, p, compress, whole_model=True)
    copies = 1 + memory + (1 if sync.nesterov else 0)   # ref, error feedback, the outer optimizer's momentum
    return Traffic("local", sync.period, collectives if p > 1 else (), payload_bytes=payload, neighbours_only=False,
                   state_copies=copies, **_common(costs, sync, compress))


def bounded_staleness(costs: ModelCosts, p: int, sync: SyncSpec, compress: CompressSpec,
                      options: TrafficOptions) -> Traffic:
    """``async:S``: as local SGD's exchange, in rounds at most S steps behind; ``period`` is the bound."""
    collectives, payload, memory = _compressed(costs, p, compress, whole_model=True)
    return Traffic("async", sync.staleness, collectives if p > 1 else (), payload_bytes=payload,
                   neighbours_only=False, state_copies=1 + memory + 1,  # ref, EF, the snapshot of the round in flight
                   **_common(costs, sync, compress))


def server_state_copies(server_opt: ServerOptSpec) -> int:
    """Model-sized buffers of the server optimizer's state, as its kind declares them (SGD without momentum
    none, with it one, Adam two)."""
    return server_opt.kind.state_copies


def federated(costs: ModelCosts, p: int, sync: SyncSpec, compress: CompressSpec, options: TrafficOptions) -> Traffic:
    """``fedavg:E`` / ``fedavg:steps=H``: a round is ``H`` local steps (``E`` epochs of them), then one exchange of
    the compressed update (SCAFFOLD: a second one, of its control variates), as ``comm/federated.py`` does."""
    if options.participation != 1:
        raise EdgetrainError(f"edgetrain plan models federated rounds in which every device takes part, not "
                             f"participation {options.participation:g}; plan with participation 1, and measure "
                             "sampled rounds with edgetrain train")
    period = sync.period or sync.local_epochs * (options.steps_per_epoch or 0)
    if period < 1:
        raise EdgetrainError(f"--sync {sync.text} counts a round in epochs of the training set, which this plan "
                             "does not know; plan --sync fedavg:steps=H with H the steps of a round")
    collectives, payload, memory = _compressed(costs, p, compress, whole_model=True)
    exchanges = 2 if sync.scaffold else 1
    # the global model, error feedback, the server optimizer's state, SCAFFOLD's c, c_i and gradient sum
    copies = 1 + memory + server_state_copies(options.server_opt) + (3 if sync.scaffold else 0)
    return Traffic("fedavg", period, collectives * exchanges if p > 1 else (), payload_bytes=payload * exchanges,
                   neighbours_only=False, state_copies=copies, **_common(costs, sync, compress))


def encoded_buckets(costs: ModelCosts, p: int, spec: CompressSpec, whole_model: bool
                    ) -> tuple[tuple[tuple[str, int], ...], int, float]:
    """A ``Compressor``'s exchange: each bucket (or the whole model) encoded by the real compressor, summable
    payloads all-reduced, the others all-gathered."""
    collectives = []
    total = 0
    for numel in [costs.params] if whole_model else costs.bucket_numels:
        kind, payload = _encoded(spec, numel)
        total += payload
        collectives.append((kind, _traffic_bytes(kind, payload, p)))
    return tuple(collectives), total, _memory_copies(spec)


def powersgd_buckets(costs: ModelCosts, p: int, spec: CompressSpec, whole_model: bool
                     ) -> tuple[tuple[tuple[str, int], ...], int, float]:
    """PowerSGD's hook: per bucket, all-reduces of the matrices it does not compress and of ``P`` and ``Q``;
    one model-sized buffer of error feedback (warm-started P and Q are small and not counted)."""
    if whole_model:
        raise EdgetrainError("powersgd compresses DDP's gradient buckets, not a model delta; plan it with --sync sync")
    rank = int(spec.arg or 2)
    collectives: list[tuple[str, int]] = []
    payload_total = 0
    for bucket in costs.buckets:
        parts = _powersgd_parts([costs.param_shapes[i] for i in bucket], rank)
        payload_total += 4 * sum(parts)
        collectives += [("allreduce", ring_allreduce_bytes(4 * n, p)) for n in parts]
    return tuple(collectives), payload_total, 1


def _encoded(spec: CompressSpec, numel: int) -> tuple[str, int]:
    compressor, _ = build_compressor(spec)
    x = torch.randn(numel, generator=torch.Generator().manual_seed(0))
    payload = compressor.encode(x, key="plan")
    return ("allreduce" if compressor.summable else "allgather"), payload.nbytes


def _traffic_bytes(kind: str, payload: int, p: int) -> int:
    return ring_allreduce_bytes(payload, p) if kind == "allreduce" else ring_allgather_bytes(payload, p)


def _memory_copies(spec: CompressSpec) -> int:
    """Model-sized buffers the compressor's error feedback keeps: residual 1, DGC 2 (velocity, accumulation)."""
    _, memory = build_compressor(spec)
    return 2 if isinstance(memory, DGCMemory) else 1 if isinstance(memory, ResidualMemory) else 0


def _powersgd_parts(shapes: list[tuple[int, ...]], rank: int) -> list[int]:
    """Values PyTorch's PowerSGD hook all-reduces for one bucket: [uncompressed, P, Q]."""
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
