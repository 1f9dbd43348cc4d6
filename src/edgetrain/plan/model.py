"""The analytic cost model: step time, throughput and memory of a cluster, in closed form.

Design: docs/design/planner.md ("The analytic model").
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from edgetrain.cluster.links import PRESETS, Link, collective_time
from edgetrain.cluster.launch import idle_process_mb
from edgetrain.cluster.profiles import DeviceProfile, DeviceSpec, device_gflops, device_links
from edgetrain.errors import EdgetrainError
from edgetrain.kinds import SYNC_KINDS
from edgetrain.results import PlanDevice

if TYPE_CHECKING:  # annotations only: costs and traffic import torch, and plan's flags read DEFAULT_EFFICIENCY
    from edgetrain.plan.costs import ModelCosts
    from edgetrain.plan.exchanges import Traffic

DEFAULT_EFFICIENCY = 0.6
TIMINGS = ("lockstep", "periodic", "bounded")  # the step rules below (a sync kind's ``timing``)
MIB = 2**20


# What the host profile's compute leaves out, said in plan's output where a device uses it.
HOST_PROFILE_ERROR = (
    "host profile: one host core's GEMM rate x the device's share of this machine's cores; other processes' "
    "load and the per-step overheads of Python, autograd and the optimizer are not modelled, which dominate "
    "small models: one-thread small_cnn steps (batch 32, digits) measured 6-10x this compute time on the "
    "development host (docs/benchmarks/real-links.md); give a profile with the device's own measured GFLOPS "
    "(edgetrain bench peak) or measure with edgetrain train")


def exchange_seconds(traffic: Traffic, links: list[Link]) -> float:
    """Modelled seconds of one exchange among all ``links`` (not gossip), mean latency."""
    distinct = list(dict.fromkeys({id(link): link for link in links}.values()))  # by identity first: cheap
    return sum(collective_time(distinct, kind, sent, devices=len(links)) for kind, sent in traffic.collectives)


def gossip_seconds(traffic: Traffic, links: list[Link], rank: int) -> float:
    """Modelled seconds of device ``rank``'s exchange with its ring neighbours."""
    p = len(links)
    members = list(dict.fromkeys(links[j % p] for j in (rank - 1, rank, rank + 1)))
    return sum(collective_time(members, kind, sent) for kind, sent in traffic.collectives)


def step_timing(traffic: Traffic) -> str:
    """How steps wait for ``traffic``'s exchanges: its sync mode's ``timing`` (``edgetrain.kinds``), one of
    ``TIMINGS``; a timing without a step rule here is refused, never modelled as another."""
    timing = SYNC_KINDS[traffic.mode].timing
    if timing not in TIMINGS:
        raise EdgetrainError(f"--sync {traffic.sync} steps by {timing!r}, which the planner has no step model of; "
                             f"measure it with edgetrain train")
    return timing


@dataclass(kw_only=True)
class DevicePrediction(PlanDevice):
    """One device's prediction: ``plan.json``'s fields of a device (``results.PlanDevice``) and its rank."""

    rank: int


@dataclass
class Prediction:
    """The analytic model's output for one cluster. Every number is modelled."""

    costs: ModelCosts
    traffic: Traffic
    devices: list[DevicePrediction]
    links: list[Link | None]
    efficiency: float
    overlap: float
    runtime_mb: float
    exchange_s: float             # one exchange (gossip: the slowest device's)
    step_s: float                 # mean over devices (sync modes: the common step)
    throughput: float             # samples/s, summed over devices
    comm_fraction: float
    optimizer: str
    assumptions: list[str] = field(default_factory=list)

    @property
    def over_limit(self) -> list[int]:
        return [d.rank for d in self.devices if d.over_limit]

    def to_dict(self, per_device: bool = True) -> dict:
        out = {
            "kind": "modelled",
            "model": self.costs.to_dict() | {"kind": "counted"},
            "traffic": dataclasses.asdict(self.traffic) | {"kind": "counted from the compressor's payload"},
            "devices": len(self.devices), "efficiency": self.efficiency, "overlap": self.overlap,
            "runtime_mb": self.runtime_mb, "optimizer": self.optimizer,
            "exchange_s": self.exchange_s, "step_s": self.step_s, "throughput_samples_per_s": self.throughput,
            "comm_fraction": self.comm_fraction,
            "compute_s_max": max(d.compute_s for d in self.devices),
            "memory_total_mb_max": max(d.memory_total_mb for d in self.devices),
            "over_limit_ranks": self.over_limit,
            "assumptions": self.assumptions,
        }
        if per_device:
            out["per_device"] = [dataclasses.asdict(d) for d in self.devices]
        return out


ASSUMPTIONS = [
    "compute = counted train FLOPs x local batch / (profile GFLOPS x efficiency)",
    "communication = link model (alpha-beta per ring round, slowest link bottlenecks; TCP/IP framing, ACKs, "
    "gloo's per-round cost), mean latency, no jitter",
    "no overlap of communication with compute unless --overlap (edgetrain's hooks do not overlap)",
    "memory = weights + gradients + optimizer + comm buffers + activations x batch + dataset + runtime baseline",
]


@dataclass(frozen=True)
class PredictOptions:
    """What the model assumes beside the cluster: the fraction of a profile's GFLOPS training reaches, the share
    of the exchange hidden behind compute, the optimizer's state, and an idle device process's memory (None:
    measured now, ``idle_process_mb``)."""

    efficiency: float = DEFAULT_EFFICIENCY
    overlap: float = 0.0
    optimizer: str = "sgd"
    momentum: float = 0.9
    runtime_mb: float | None = None


def predict(costs: ModelCosts, devices: list[DeviceSpec], batches: list[int], traffic: Traffic,
            options: PredictOptions = PredictOptions()) -> Prediction:
    """Model one cluster: ``devices`` with local ``batches``, exchanging ``traffic``."""
    efficiency, overlap, optimizer, momentum = options.efficiency, options.overlap, options.optimizer, options.momentum
    if not efficiency > 0:
        raise EdgetrainError(f"efficiency must be a positive fraction of the profile's GFLOPS (usually below 1), "
                             f"got {efficiency:g}")
    if not 0 <= overlap <= 1:
        raise EdgetrainError(f"overlap must be a fraction in [0, 1], got {overlap:g}")
    if len(batches) != len(devices):
        raise EdgetrainError(f"{len(batches)} local batches for {len(devices)} devices")
    runtime_mb = idle_process_mb() if options.runtime_mb is None else float(options.runtime_mb)
    p = len(devices)
    links = device_links(devices)
    if p > 1 and traffic.collectives and links[0] is None:
        raise EdgetrainError(f"the {p} devices have no link to plan communication over: give --link "
                             f"(a preset: {', '.join(PRESETS)}, or a spec like 20mbit:5ms) or links in the cluster file")

    on_host = sum(1 for d in devices if on_this_host(d.profile))
    gflops_cache: dict[DeviceProfile, tuple[float, str]] = {}
    compute = []
    for d, b in zip(devices, batches):
        if d.profile not in gflops_cache:
            gflops_cache[d.profile] = device_gflops(d.profile, on_host)
        compute.append(costs.train_flops_per_sample * b / (gflops_cache[d.profile][0] * 1e9 * efficiency))
    c_max = max(compute)
    exchange = _exchange_s(traffic, links)

    timing = step_timing(traffic)
    if timing == "bounded":
        round_s = max(exchange, c_max)
        steps = [max(c, round_s / traffic.period) if exchange else c for c in compute]
        comm = [0.0] * p  # rounds run in the background; what shows is waiting
    else:  # lockstep or periodic: step_timing admits no other
        exposed = exchange - min(overlap * exchange, c_max) if timing == "lockstep" else exchange
        comm = [exposed / traffic.period] * p
        steps = [c_max + comm[0]] * p
    memory = _memory(costs, traffic, optimizer, momentum, runtime_mb, batches)

    # Totals and link names once per distinct memory dict and link object (shared by many devices).
    totals = {key: sum(mem.values()) for key, mem in {id(mem): mem for mem in memory}.items()}
    link_names = {key: link.name or link.describe() if link else "none"
                  for key, link in {id(link): link for link in links}.items()}
    rows = []
    for d, b, c, t, s, link, mem in zip(devices, batches, compute, comm, steps, links, memory):
        total = totals[id(mem)]
        limit = d.profile.memory_mb
        g, source = gflops_cache[d.profile]
        rows.append(DevicePrediction(
            rank=d.rank, profile=d.profile.name, gflops=g, gflops_source=source, batch=b,
            link=link_names[id(link)], compute_s=c, comm_s=t, wait_s=max(0.0, s - c - t),
            step_s=s, samples_per_s=b / s, memory_mb=mem, memory_total_mb=total, memory_limit_mb=limit,
            over_limit=limit is not None and total > limit))
    step_mean = sum(steps) / p
    throughput = sum(r.samples_per_s for r in rows)
    comm_fraction = sum((r.step_s - r.compute_s) / r.step_s for r in rows) / p
    assumptions = list(ASSUMPTIONS) + ([HOST_PROFILE_ERROR] if on_host else [])
    return Prediction(costs, traffic, rows, links, efficiency, overlap, runtime_mb, exchange, step_mean, throughput,
                      comm_fraction, optimizer, assumptions)


def _exchange_s(traffic: Traffic, links: list) -> float:
    """Seconds of one exchange: the slowest device's where each talks to its neighbours only (gossip)."""
    p = len(links)
    if not traffic.collectives:
        return 0.0
    if not traffic.neighbours_only:
        return exchange_seconds(traffic, links)
    by_neighbours: dict[tuple[int, ...], float] = {}  # devices with the same three links: one computation
    per_device = []
    for r in range(p):
        key = tuple(id(links[j % p]) for j in (r - 1, r, r + 1))
        if key not in by_neighbours:
            by_neighbours[key] = gossip_seconds(traffic, links, r)
        per_device.append(by_neighbours[key])
    return max(per_device)


def on_this_host(profile: DeviceProfile) -> bool:
    """Whether ``profile`` runs at this machine's own speed on its cores (``host``: no speed, GFLOPS or cores)."""
    return profile.speed is None and profile.gflops is None and not profile.cores


def _memory(costs: ModelCosts, traffic: Traffic, optimizer: str, momentum: float, runtime_mb: float,
            batches: list[int]) -> list[dict]:
    """Per-device memory parts in MiB."""
    if optimizer not in ("sgd", "adam"):
        raise EdgetrainError(f"optimizer must be sgd or adam, not {optimizer!r}")
    optimizer_copies = 2 if optimizer == "adam" else (1 if momentum > 0 else 0)
    fixed = {
        "weights": (costs.param_bytes + costs.buffer_bytes) / MIB,
        "gradients": costs.param_bytes / MIB,
        "optimizer": optimizer_copies * costs.param_bytes / MIB,
        "comm_buffers": traffic.state_copies * costs.param_bytes / MIB,
    }
    tail = {"dataset": costs.dataset_bytes / MIB, "runtime": runtime_mb}
    cache: dict[int, dict] = {}
    out = []
    for b in batches:
        if b not in cache:
            cache[b] = {**fixed, "activations": costs.activation_bytes_per_sample * b / MIB, **tail}
        out.append(cache[b])
    return out
