"""Layer grouping: after which layers of the tiled section devices exchange halos.

Fusing more layers into one group saves messages but makes every tile
recompute a wider overlap (its receptive field grows through the group);
exchanging after every layer recomputes nothing but pays a message latency at
every boundary. Rama, Threadgill and Gerstlauer choose the groups to balance
the two; ``choose_groups`` does it with a simple, stated cost model:

    time(group a..b) = max over devices of
        3 * forward FLOPs of the device's tiles in a..b / device_flops      (forward + backward)
      + 2 * (messages * latency + halo bytes received / bandwidth)          (halo in, its adjoint out)

The group costs add up, so the cheapest grouping is found exactly by dynamic
programming over the group ends. FLOPs and bytes are counted from the region
arithmetic; only the three machine numbers are modelled (given, or measured
once at start-up and broadcast from device 0 so that every device decides the same).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn.functional as F

from edgetrain.cluster.peers import wait
from edgetrain.tiling.plan import SectionPlan


@dataclass
class Machine:
    """What the cost model assumes about a device and its links; ``source`` says where each number came from."""

    device_flops: float
    bandwidth_bytes_s: float
    latency_s: float
    source: dict[str, str] = field(default_factory=dict)

    def describe(self) -> str:
        src = {k: self.source.get(k, "given") for k in ("device_flops", "bandwidth", "latency")}
        return (f"device {self.device_flops / 1e9:.1f} GFLOP/s ({src['device_flops']}), link "
                f"{self.bandwidth_bytes_s / 1e6:.1f} MB/s ({src['bandwidth']}), latency "
                f"{self.latency_s * 1e3:.3f} ms ({src['latency']})")


@dataclass
class GroupCost:
    seconds: float
    compute_s: float
    exchange_s: float
    flops: float  # forward FLOPs per step summed over devices
    halo_bytes: float  # forward halo bytes per step summed over devices (the backward moves as many again)
    messages: int


def group_cost(plan: SectionPlan, a: int, b: int, batch: int, itemsize: int, machine: Machine) -> GroupCost:
    worst = (0.0, 0.0, 0.0)
    flops = halo = 0.0
    messages = 0
    for d in range(plan.devices):
        f = plan.group_flops(a, b, d) * batch
        pixels, msgs = plan.halo_elements(a, b, d) if a > 0 else (0, 0)
        nbytes = pixels * plan.channels[a] * batch * itemsize
        compute = 3 * f / machine.device_flops
        exchange = 2 * (msgs * machine.latency_s + nbytes / machine.bandwidth_bytes_s)
        if compute + exchange > worst[0]:
            worst = (compute + exchange, compute, exchange)
        flops += f
        halo += nbytes
        messages += msgs
    return GroupCost(*worst, flops, halo, messages)


def grouping_cost(plan: SectionPlan, ends: list[int], batch: int, itemsize: int, machine: Machine) -> dict:
    """Totals of a grouping given by its group ends (the last is the end of the section)."""
    costs = [group_cost(plan, a, b, batch, itemsize, machine) for a, b in zip([0] + ends[:-1], ends)]
    untiled = plan.untiled_flops(0, plan.end) * batch
    flops = sum(c.flops for c in costs)
    return {
        "ends": list(ends),
        "modelled_seconds": sum(c.seconds for c in costs),
        "modelled_compute_s": sum(c.compute_s for c in costs),
        "modelled_exchange_s": sum(c.exchange_s for c in costs),
        "forward_flops_all_devices": flops,
        "recompute_overhead_pct": 100.0 * (flops / untiled - 1.0) if untiled else 0.0,
        "halo_bytes_per_step": 2 * sum(c.halo_bytes for c in costs),  # forward and its adjoint
        "halo_messages_per_step": 2 * sum(c.messages for c in costs),
    }


def choose_groups(plan: SectionPlan, batch: int, itemsize: int, machine: Machine) -> tuple[list[int], str]:
    """The group ends with the least modelled time, and a few lines saying why."""
    n = plan.end
    best: list[tuple[float, int]] = [(0.0, -1)] + [(float("inf"), -1)] * n
    for b in range(1, n + 1):
        for a in range(b):
            # A nanosecond per group breaks ties towards fewer groups (a boundary with no halo is a no-op).
            t = best[a][0] + group_cost(plan, a, b, batch, itemsize, machine).seconds + 1e-9
            if t < best[b][0]:
                best[b] = (t, a)
    ends, b = [], n
    while b > 0:
        ends.append(b)
        b = best[b][1]
    ends.reverse()
    chosen = grouping_cost(plan, ends, batch, itemsize, machine)
    one = grouping_cost(plan, [n], batch, itemsize, machine)
    every = grouping_cost(plan, list(range(1, n + 1)), batch, itemsize, machine)
    names = ", ".join(f"{plan.units[e - 1].name}" for e in ends[:-1]) or "none"

    def line(label: str, c: dict) -> str:
        return (f"  {label}: {c['modelled_seconds'] * 1e3:.2f} ms = compute {c['modelled_compute_s'] * 1e3:.2f} "
                f"(+{c['recompute_overhead_pct']:.1f}% recomputed) + exchange {c['modelled_exchange_s'] * 1e3:.2f} "
                f"({c['halo_bytes_per_step'] / 1e3:.1f} kB, {c['halo_messages_per_step']} messages)")

    why = "\n".join([
        f"auto grouping: {len(ends)} group(s), ends {ends}; halo exchanges after: {names}",
        f"  modelled for batch {batch} with {machine.describe()}",
        line("chosen", chosen),
        line("one fused group", one),
        line("exchange after every layer", every),
    ])
    return ends, why


def measure_machine(comm, device_flops: float | None, bandwidth: float | None, latency: float | None) -> Machine:
    """Fill in the numbers not given by measuring on device 0 (and its link to device 1), then broadcast.

    Every device takes part (it is a collective when there are several devices).
    """
    source = {"device_flops": "given", "bandwidth": "given", "latency": "given"}
    values = torch.tensor([device_flops or 0.0, bandwidth or 0.0, latency or 0.0], dtype=torch.float64)
    if comm.rank == 0 and device_flops is None:
        values[0] = _conv_flops_per_second()
    if comm.world > 1 and (bandwidth is None or latency is None):
        measured = _ping_pong(comm)
        if comm.rank == 0:
            values[1] = bandwidth if bandwidth is not None else measured[0]
            values[2] = latency if latency is not None else measured[1]
    if comm.world > 1:
        wait(dist.broadcast(values, src=comm._global(0), group=comm.group, async_op=True), comm.timeout_s,
             "tiled training: machine measurement broadcast")
    if device_flops is None:
        source["device_flops"] = "measured: 3x3 conv on device 0"
    for key, given, i in (("bandwidth", bandwidth, 1), ("latency", latency, 2)):
        if given is None:
            source[key] = "measured: ping-pong device 0 <-> 1" if comm.world > 1 else "unused: one device"
            if comm.world == 1:
                values[i] = float("inf") if key == "bandwidth" else 0.0
    return Machine(float(values[0]), float(values[1]), float(values[2]), source)


def _conv_flops_per_second() -> float:
    x = torch.randn(4, 32, 32, 32)
    w = torch.randn(32, 32, 3, 3)
    flops = 2 * 32 * 9 * 32 * 32 * 32 * 4
    best = float("inf")
    for _ in range(4):
        start = time.perf_counter()
        F.conv2d(x, w, padding=1)
        best = min(best, time.perf_counter() - start)
    return flops / best


def _ping_pong(comm) -> tuple[float, float]:
    """(bandwidth bytes/s, one-way latency s) between devices 0 and 1; others return zeros."""
    if comm.rank > 1:
        return 0.0, 0.0
    peer = comm._global(1 - comm.rank)

    def round_trips(t: torch.Tensor, reps: int) -> float:
        best = float("inf")
        for _ in range(reps):
            start = time.perf_counter()
            for sending in ((True, False) if comm.rank == 0 else (False, True)):  # device 0 serves first
                work = (dist.isend if sending else dist.irecv)(t, peer, group=comm.group)
                wait(work, comm.timeout_s, "tiled training: link measurement (ping-pong)")
            best = min(best, time.perf_counter() - start)
        return best

    latency = round_trips(torch.zeros(2), 5) / 2
    big = torch.zeros(1 << 18)  # 1 MiB
    # Latency included: a conservative bandwidth, never absurd when the two timings are noisy.
    return big.numel() * 4 / (round_trips(big, 3) / 2), latency
