"""A step simulator for clusters of up to a million devices (numpy, vectorised over devices).

Design: docs/design/planner.md ("The step simulator").
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from edgetrain.cluster.links import ROUNDS, round_seconds
from edgetrain.errors import EdgetrainError
from edgetrain.plan.model import Prediction, step_timing
from edgetrain.results import PlanScalingRow


@dataclass
class SimResult:
    """Simulated steps. Arrays are per device; ``step_ends[i, s]`` is device ``i``'s clock after step ``s``."""

    steps: int
    mode: str
    batches: np.ndarray
    step_ends: np.ndarray          # (devices, steps)
    compute_s: np.ndarray          # per device, summed over steps
    comm_s: np.ndarray             # per device, exposed communication summed over steps
    seed: int
    compute_cv: float
    straggler_prob: float
    straggler_factor: float
    jitter: bool

    @property
    def devices(self) -> int:
        return len(self.batches)

    @property
    def total_s(self) -> np.ndarray:
        return self.step_ends[:, -1]

    @property
    def wait_s(self) -> np.ndarray:
        return np.maximum(self.total_s - self.compute_s - self.comm_s, 0.0)

    @property
    def cluster_step_s(self) -> np.ndarray:
        """Per step: time from the last device finishing step s-1 to the last finishing step s."""
        done = self.step_ends.max(axis=0)
        return np.diff(done, prepend=0.0)

    @property
    def mean_step_s(self) -> float:
        return float(np.mean(self.total_s / self.steps))

    @property
    def throughput(self) -> float:
        return float(np.sum(self.batches * self.steps / self.total_s))

    def to_dict(self) -> dict:
        total = self.total_s
        steps = self.cluster_step_s

        def stats(a: np.ndarray) -> dict:
            return {"mean": float(a.mean()), "min": float(a.min()), "max": float(a.max())}

        return {
            "kind": "modelled (simulated)", "steps": self.steps, "devices": self.devices, "mode": self.mode,
            "seed": self.seed, "compute_cv": self.compute_cv, "straggler_prob": self.straggler_prob,
            "straggler_factor": self.straggler_factor, "link_jitter": self.jitter,
            "mean_step_s": self.mean_step_s, "throughput_samples_per_s": self.throughput,
            "cluster_step_s": {"mean": float(steps.mean()), "p50": float(np.percentile(steps, 50)),
                               "p99": float(np.percentile(steps, 99))},
            "per_device_step_s": stats(total / self.steps),
            "compute_fraction": float(np.mean(self.compute_s / total)),
            "comm_fraction": float(np.mean(self.comm_s / total)),
            "wait_fraction": float(np.mean(self.wait_s / total)),
            "wait_s_per_step": stats(self.wait_s / self.steps),
        }


def simulate(pred: Prediction, steps: int = 100, compute_cv: float = 0.05, straggler_prob: float = 0.0,
             straggler_factor: float = 3.0, jitter: bool = True, seed: int = 0) -> SimResult:
    """Simulate ``steps`` training steps of the cluster ``pred`` models."""
    if steps < 1:
        raise EdgetrainError(f"simulate at least 1 step, not {steps}")
    if compute_cv < 0 or not 0 <= straggler_prob <= 1 or straggler_factor < 1:
        raise EdgetrainError(f"compute CV must be >= 0, straggler probability in [0, 1] and its slowdown >= 1; "
                             f"got {compute_cv:g}, {straggler_prob:g}, {straggler_factor:g}")
    rng = np.random.default_rng(seed)
    traffic = pred.traffic
    p = len(pred.devices)
    batches = np.array([d.batch for d in pred.devices], dtype=float)
    mean = np.array([d.compute_s for d in pred.devices])
    compute = _compute_times(rng, mean, steps, compute_cv, straggler_prob, straggler_factor)
    compute_total = compute.sum(axis=1)
    comm_s = np.zeros(p)
    timing = step_timing(traffic)
    if timing == "bounded":
        ends = _async(rng, pred, compute, jitter)
    else:  # lockstep or periodic: an exchange every ``period`` steps
        # step by step over the rows of (steps, devices) arrays: one step's clocks lie together in memory
        by_step = np.ascontiguousarray(compute.T)
        del compute
        ends_by_step = np.empty((steps, p))
        period = traffic.period
        exchanges = [s for s in range(steps) if (s + 1) % period == 0] if traffic.collectives else []
        if traffic.neighbours_only:
            tc = _gossip_times(rng, pred, len(exchanges), jitter)            # (exchanges, p)
        else:
            tc = _exchange_times(rng, pred, len(exchanges), jitter)          # (exchanges,)
        t = np.zeros(p)
        x = 0
        for s in range(steps):
            arrive = t + by_step[s]
            if x < len(exchanges) and exchanges[x] == s:
                if traffic.neighbours_only:
                    ready = np.maximum(arrive, np.maximum(np.roll(arrive, 1), np.roll(arrive, -1)))
                    spent = tc[x]
                else:
                    ready = arrive.max()  # all devices leave together: one clock, broadcast below
                    spent = tc[x]
                    if timing == "lockstep":
                        spent = spent - min(pred.overlap * spent, by_step[s].max())
                t = ready + spent
                comm_s += spent
                x += 1
            else:
                t = arrive
            ends_by_step[s] = t
        ends = ends_by_step.T
    return SimResult(steps, traffic.mode, batches, ends, compute_total, comm_s, seed, compute_cv,
                     straggler_prob, straggler_factor, jitter)


def _compute_times(rng: np.random.Generator, mean: np.ndarray, steps: int, cv: float, straggler_prob: float,
                   straggler_factor: float) -> np.ndarray:
    """(devices, steps) compute seconds: gamma with the given mean and CV, some steps slowed by stragglers."""
    if cv > 0:
        shape = 1.0 / cv**2
        times = rng.gamma(shape, 1.0, size=(len(mean), steps))
        times *= (mean / shape)[:, None]  # in place: with a million devices the array is 800 MB
    else:
        times = np.repeat(mean[:, None], steps, axis=1)
    if straggler_prob > 0:
        slow = rng.random(times.shape) < straggler_prob
        np.multiply(times, straggler_factor, out=times, where=slow)
    return times


def _distinct_links(pred: Prediction) -> tuple[list, np.ndarray]:
    """The devices' distinct link objects (in order of first appearance) and each device's index into them."""
    slot: dict[int, int] = {}
    distinct = []
    for link in pred.links:  # by identity: devices on one link share one object (model.device_links)
        if id(link) not in slot:
            slot[id(link)] = len(distinct)
            distinct.append(link)
    index = np.fromiter((slot[id(link)] for link in pred.links), dtype=np.int64, count=len(pred.links))
    return distinct, index


def _link_arrays(pred: Prediction) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    distinct, index = _distinct_links(pred)
    latency, jitter, goodput = (np.array([getattr(link, name) for link in distinct])[index]
                                for name in ("latency_s", "jitter_s", "goodput_Bps"))
    return latency, jitter, goodput


def _link_groups(pred: Prediction) -> list[tuple[tuple[float, float, float], int]]:
    """((latency, jitter, goodput), devices) per group of identical links, in order of first appearance."""
    distinct, index = _distinct_links(pred)
    groups: dict[tuple[float, float, float], int] = {}
    for link, n in zip(distinct, np.bincount(index, minlength=len(distinct)).tolist()):
        key = (link.latency_s, link.jitter_s, link.goodput_Bps)
        groups[key] = groups.get(key, 0) + n
    return list(groups.items())


def _max_of_normals(rng: np.random.Generator, n: int, size: tuple[int, ...]) -> np.ndarray:
    """Draws of the maximum of ``n`` independent standard normals: ``Phi^-1(U^(1/n))``."""
    u = rng.random(size)
    upper_tail = -np.expm1(np.log(u) / n)          # 1 - U^(1/n), computed without cancellation
    return -torch.special.ndtri(torch.from_numpy(upper_tail)).numpy()


# A ring of a million devices has two million rounds: exchanges are simulated a block of rows at
# a time (bounds memory) and rounds drawn a piece at a time (small temporaries the allocator reuses).
ROUNDS_PER_BLOCK = 1 << 22
ROUNDS_PER_PIECE = 1 << 16


def _exchange_times(rng: np.random.Generator, pred: Prediction, count: int, jitter: bool,
                    groups: list | None = None) -> np.ndarray:
    """Seconds of ``count`` exchanges among all devices (every collective of one exchange summed).

    O(link groups x rounds x count), nothing per device; without jitter a round lasts a
    constant and no round is drawn. ``groups``: ``_link_groups(pred)``, if already known.
    """
    out = np.zeros(count)
    if count == 0:
        return out
    groups = _link_groups(pred) if groups is None else groups
    jittered = [g for g in groups if jitter and g[0][1] > 0]
    steady = [g for g in groups if g not in jittered]
    p = len(pred.links)
    for kind, sent in pred.traffic.collectives:
        rounds = ROUNDS[kind](p)
        if rounds == 0:
            continue
        chunk = sent / rounds
        steady_s = max((round_seconds(lat, chunk, gp, kind) for (lat, _, gp), _ in steady), default=0.0)
        if not jittered:
            out += rounds * steady_s
            continue
        # Draws in the order one (exchanges, rounds) array per group would take them: with one
        # jittered group blocks of exchanges follow each other in the random stream; with several,
        # every group draws all its exchanges before the next (one block).
        block = max(1, ROUNDS_PER_BLOCK // rounds) if len(jittered) == 1 else count
        for start in range(0, count, block):
            rows = min(block, count - start)
            slowest = np.full((rows, rounds), steady_s)
            flat = slowest.reshape(-1)
            for (lat, sigma, gp), n in jittered:
                for at in range(0, flat.size, ROUNDS_PER_PIECE):
                    piece = flat[at:at + ROUNDS_PER_PIECE]
                    round_lat = np.maximum(0.0, lat + sigma * _max_of_normals(rng, n, piece.shape))
                    np.maximum(piece, round_seconds(round_lat, chunk, gp, kind), out=piece)
            out[start:start + rows] += slowest.sum(axis=1)
    return out


def _gossip_times(rng: np.random.Generator, pred: Prediction, count: int, jitter: bool) -> np.ndarray:
    """(count, devices) seconds of each device's exchange with its ring neighbours."""
    p = len(pred.devices)
    out = np.zeros((count, p))
    if count == 0:
        return out
    latency, jit, goodput = _link_arrays(pred)
    members = [0, 1] if p == 2 else [-1, 0, 1]
    for kind, sent in pred.traffic.collectives:
        rounds = ROUNDS[kind](len(members))
        chunk = sent / rounds
        total = np.zeros((count, p))
        for _ in range(rounds):
            slowest = np.zeros((count, p))
            for shift in members:
                lat, sigma, gp = (np.roll(a, shift) for a in (latency, jit, goodput))
                round_lat = np.broadcast_to(lat, (count, p))
                if jitter and np.any(sigma > 0):
                    round_lat = np.maximum(0.0, lat + sigma * rng.standard_normal((count, p)))
                slowest = np.maximum(slowest, round_seconds(round_lat, chunk, gp, kind))
            total += slowest
        out += total
    return out


def _async(rng: np.random.Generator, pred: Prediction, compute: np.ndarray, jitter: bool) -> np.ndarray:
    """Step end clocks (devices, steps) under bounded staleness, simulated round by round."""
    p, steps = compute.shape
    bound = pred.traffic.period
    ends = np.empty((p, steps))
    if not pred.traffic.collectives:
        return np.cumsum(compute, axis=1)
    rows = np.arange(p)
    groups = _link_groups(pred)  # once, not per round
    ends[:, 0] = compute[:, 0]
    done = np.ones(p, dtype=int)          # steps finished; every device launches its first round after step 1
    launch = ends[:, 0].copy()
    while done.min() < steps:
        complete = launch.max() + _exchange_times(rng, pred, 1, jitter, groups)[0]
        index = done[:, None] + np.arange(bound)[None, :]
        inside = index < steps
        step = np.where(inside, compute[rows[:, None], np.minimum(index, steps - 1)], 0.0)
        end = launch[:, None] + np.cumsum(step, axis=1)
        reached = end >= complete
        applied = reached.any(axis=1)
        k = np.where(applied, reached.argmax(axis=1) + 1, bound)      # steps run in this round
        new_launch = np.where(applied, end[rows, k - 1], np.maximum(end[:, -1], complete))
        # the step that waited ends when the round completes (the wait is charged to it)
        end[rows, k - 1] = new_launch
        record = (np.arange(bound)[None, :] < k[:, None]) & inside
        ends[rows[:, None].repeat(bound, 1)[record], index[record]] = end[record]
        done = done + np.minimum(k, np.maximum(steps - done, 0))
        launch = new_launch
    return ends


def scaling(predict_for, counts: list[int], steps: int = 100, **sim) -> list[PlanScalingRow]:
    """Speedup and efficiency over device counts, against the first. ``predict_for(n)`` gives the ``Prediction``
    for ``n`` devices; only each count's figures are kept, not its (possibly million-device) prediction."""
    rows: list[PlanScalingRow] = []
    for n in counts:
        pred = predict_for(n)
        result = simulate(pred, steps=steps, **sim)
        summary = result.to_dict()
        base = rows[0] if rows else None
        analytic_speedup = pred.throughput / base.analytic_throughput if base else 1.0
        simulated_speedup = result.throughput / base.simulated_throughput if base else 1.0
        scale = n / base.devices if base else 1.0
        rows.append(PlanScalingRow(
            devices=n, analytic_step_s=pred.step_s, analytic_throughput=pred.throughput,
            simulated_step_s=result.mean_step_s, simulated_throughput=result.throughput,
            simulated_p99_step_s=summary["cluster_step_s"]["p99"], comm_fraction=summary["comm_fraction"],
            wait_fraction=summary["wait_fraction"], over_limit=bool(pred.over_limit),
            analytic_speedup=analytic_speedup, simulated_speedup=simulated_speedup,
            analytic_efficiency=analytic_speedup / scale, simulated_efficiency=simulated_speedup / scale))
    return rows
