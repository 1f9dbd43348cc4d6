"""Virtual devices of a fleet: a profile and a link per device from a population, when each is online, and the
modelled time of its round. Design and formats: docs/tutorials/federated-fleet.md (devices as they are)."""
from __future__ import annotations

import bisect
import csv
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from edgetrain.cluster.links import collective_time
from edgetrain.cluster.profiles import DeviceProfile, get_profile, split_by_weights
from edgetrain.errors import EdgetrainError
from edgetrain.kinds import named_by_kind
from edgetrain.spec import AvailabilitySpec, Link, availability_spec, get_link

# the modelled wait of a round in which no sampled device is online and no --round-deadline bounds it
IDLE_ROUND_S = 60.0


@dataclass(frozen=True)
class DeviceGroup:
    """A share of the fleet: devices of one profile on one link."""

    share: float
    profile: DeviceProfile
    link: Link

    @property
    def label(self) -> str:
        return f"{self.profile.name}@{self.link.name or 'link'}"


def parse_population(text: str) -> tuple[DeviceGroup, ...]:
    """``"60% rpi4@wifi-20m, 30% smart-speaker-2g@lte-10m, 10% jetson-orin-nano"``: shares of built-in profiles,
    each on a link preset or inline spec (default: the profile's own link). ``""``: no population."""
    if not text.strip():
        return ()
    groups = []
    for item in text.split(","):
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*%\s*([A-Za-z0-9_.-]+)(?:@(\S+))?\s*", item)
        if not m:
            raise EdgetrainError(f"bad population entry {item.strip()!r}; write SHARE% PROFILE[@LINK], e.g. "
                                 "'60% rpi4@wifi-20m, 40% jetson-orin-nano'")
        profile = get_profile(m.group(2))
        if profile.gflops is None:
            raise EdgetrainError(f"population profile {profile.name!r} has no rated GFLOPS to model a device's "
                                 "compute; use rpi4, jetson-nano, jetson-orin-nano, rpi5, rpi-zero-2w or "
                                 "smart-speaker-2g")
        link = get_link(m.group(3) or profile.link)
        if link is None:
            raise EdgetrainError(f"population entry {item.strip()!r} has no link; add @LINK (e.g. @wifi-20m)")
        groups.append(DeviceGroup(float(m.group(1)), profile, link))
    if abs(sum(g.share for g in groups) - 100.0) > 1e-6:
        raise EdgetrainError(f"population shares add up to {sum(g.share for g in groups):g}%, not 100%; "
                             "fix the percentages")
    return tuple(groups)


def assign_groups(groups: tuple[DeviceGroup, ...], devices: int, seed: int) -> np.ndarray:
    """Each device's group index: the exact shares (largest remainder), in an order shuffled by ``seed``."""
    if devices < len(groups):
        raise EdgetrainError(f"a population of {len(groups)} groups needs at least {len(groups)} devices, "
                             f"got {devices}")
    counts = split_by_weights(devices, [g.share for g in groups])
    order = np.repeat(np.arange(len(groups)), counts)
    return np.random.default_rng((seed, 7)).permutation(order)


def device_round_s(group: DeviceGroup, train_flops: float, down_bytes: int, up_bytes: int) -> float:
    """Modelled seconds of one device's round: the global model down, its local steps, its update up, each way
    a point-to-point transfer on its link (``cluster.links``)."""
    compute_s = train_flops / (group.profile.gflops * 1e9)
    return (collective_time([group.link], "p2p", down_bytes) + compute_s
            + collective_time([group.link], "p2p", up_bytes))


class Availability:
    """When each device is online: ``window(device, t)`` is the online window ``(start, end)`` holding modelled
    time ``t``, or None while the device is offline. Each subclass is an availability kind's runtime
    (``kinds.AvailabilityKind``), built by ``from_spec``."""

    name: str
    kind: object
    text: str = ""

    def window(self, device: int, t: float) -> tuple[float, float] | None:
        raise NotImplementedError

    def online(self, device: int, t: float) -> bool:
        return self.window(device, t) is not None

    def offline_at(self, device: int, start: float, end: float) -> float | None:
        """When a device online at ``start`` goes offline before ``end`` (a dropout), or None if it stays."""
        window = self.window(device, start)
        if window is None:
            return start
        return window[1] if window[1] < end else None


@named_by_kind("availability")
@dataclass
class Always(Availability):
    """Every device online all the time."""

    text: str = "always"

    @classmethod
    def from_spec(cls, spec: AvailabilitySpec, seed: int) -> "Always":
        return cls(spec.text)

    def window(self, device, t):
        return (-math.inf, math.inf)


@named_by_kind("availability")
@dataclass
class Diurnal(Availability):
    """Online for ``fraction`` of each ``period``, at a phase of its own per device (drawn from the seed)."""

    period_s: float
    fraction: float
    seed: int
    text: str = "diurnal"
    phases: dict = field(default_factory=dict)

    @classmethod
    def from_spec(cls, spec: AvailabilitySpec, seed: int) -> "Diurnal":
        period_s, fraction = spec.args
        return cls(period_s, fraction, seed, spec.text)

    def phase(self, device: int) -> float:
        if device not in self.phases:
            self.phases[device] = float(np.random.default_rng((self.seed, 11, device)).random())
        return self.phases[device]

    def window(self, device, t):
        position = (t / self.period_s + self.phase(device)) % 1.0
        if position >= self.fraction:
            return None
        start = t - position * self.period_s
        return (start, start + self.fraction * self.period_s)


@named_by_kind("availability")
@dataclass
class OnOff(Availability):
    """Alternating online and offline spells of exponential lengths (means ``on_s``, ``off_s``) per device, from
    the seed; at time 0 a device is online with the stationary probability ``on / (on + off)``."""

    on_s: float
    off_s: float
    seed: int
    text: str = "onoff"
    spells: dict = field(default_factory=dict)  # device -> (window starts, window ends, generator)

    @classmethod
    def from_spec(cls, spec: AvailabilitySpec, seed: int) -> "OnOff":
        on_s, off_s = spec.args
        return cls(on_s, off_s, seed, spec.text)

    def _windows(self, device: int, until: float):
        if device not in self.spells:
            rng = np.random.default_rng((self.seed, 13, device))
            online = rng.random() < self.on_s / (self.on_s + self.off_s)
            first = 0.0 if online else rng.exponential(self.off_s)
            self.spells[device] = ([first], [first + rng.exponential(self.on_s)], rng)
        starts, ends, rng = self.spells[device]
        while ends[-1] <= until:
            starts.append(ends[-1] + rng.exponential(self.off_s))
            ends.append(starts[-1] + rng.exponential(self.on_s))
        return starts, ends

    def window(self, device, t):
        starts, ends = self._windows(device, t)
        i = bisect.bisect_right(starts, t) - 1
        if i < 0 or ends[i] <= t:
            return None
        return (-math.inf if i == 0 and starts[0] == 0.0 else starts[i], ends[i])


@named_by_kind("availability")
@dataclass
class Trace(Availability):
    """Online windows read from a file: CSV lines ``device,start_s,end_s`` (``#`` comments); a device is offline
    outside its windows, and a device the file does not name is never online."""

    windows: dict[int, tuple[list[float], list[float]]]
    text: str = "trace"

    @classmethod
    def from_spec(cls, spec: AvailabilitySpec, seed: int) -> "Trace":
        trace = read_trace(spec.args[0])
        trace.text = spec.text
        return trace

    def window(self, device, t):
        starts, ends = self.windows.get(device, ([], []))
        i = bisect.bisect_right(starts, t) - 1
        return (starts[i], ends[i]) if i >= 0 and t < ends[i] else None


def read_trace(path: str) -> Trace:
    """The trace file's windows by device, each device's sorted and not overlapping."""
    if not Path(path).is_file():
        raise EdgetrainError(f"availability trace {path!r} is not a file; give a CSV of device,start_s,end_s lines")
    rows: dict[int, list[tuple[float, float]]] = {}
    with open(path, newline="") as f:
        for number, row in enumerate(csv.reader(f), 1):
            if not row or row[0].lstrip().startswith("#"):
                continue
            try:
                device, start, end = int(row[0]), float(row[1]), float(row[2])
            except (ValueError, IndexError):
                raise EdgetrainError(f"{path} line {number}: {','.join(row)!r} is not device,start_s,end_s "
                                     "(a whole number and two numbers)") from None
            if device < 0 or end <= start:
                raise EdgetrainError(f"{path} line {number}: a window needs device >= 0 and end_s > start_s")
            rows.setdefault(device, []).append((start, end))
    windows = {}
    for device, spans in rows.items():
        spans.sort()
        if any(b[0] < a[1] for a, b in zip(spans, spans[1:])):
            raise EdgetrainError(f"{path}: device {device}'s windows overlap; merge them")
        windows[device] = ([s for s, _ in spans], [e for _, e in spans])
    return Trace(windows)


def parse_availability(text: str, seed: int) -> Availability:
    """The availability ``text`` names (``kinds.AvailabilityKind``: ``always``, ``diurnal:24h:0.4``,
    ``onoff:30m:10m``, ``trace:PATH``), parsed by its kind and built by its runtime class for ``seed``."""
    spec = availability_spec(text)
    return spec.kind.load_runtime().from_spec(spec, seed)


@dataclass(frozen=True)
class RoundModel:
    """What models a round: the population, its availability, the deadline (None: none) and the work."""

    groups: tuple[DeviceGroup, ...]
    availability: Availability
    deadline_s: float | None
    train_flops: float   # one device's local steps
    down_bytes: int      # the global model (and SCAFFOLD's control) a sampled device receives


class ModelledFleet:
    """The modelled clock of a fleet's rounds. Device ``k`` is the ``k``-th node in sorted node-id order (its data
    is its node's partition); it gets a group of the population and an availability of its own. Sampling picks
    among the devices online when the round starts; a sampled device's round takes ``device_round_s``; one that
    goes offline before it ends is a dropout, one whose round is longer than the deadline is late, and neither's
    update is aggregated."""

    def __init__(self, model: RoundModel, seed: int):
        self.model, self.seed, self.clock = model, seed, 0.0
        self.device_of: dict[int, int] = {}
        self.group_of = np.zeros(0, dtype=np.int64)

    def _devices(self, node_ids) -> None:
        if set(node_ids) - set(self.device_of):  # the first round (or new nodes): number them all again
            self.device_of = {node: k for k, node in enumerate(sorted(node_ids))}
            self.group_of = assign_groups(self.model.groups, len(self.device_of), self.seed)

    def online(self, node_ids) -> list[int]:
        self._devices(node_ids)
        return [n for n in sorted(node_ids) if self.model.availability.online(self.device_of[n], self.clock)]

    def sample(self, server_round: int, node_ids, count: int) -> tuple[list[int], int]:
        """(sampled node ids, how many were online): ``count`` of the online ones, drawn from the seed."""
        online = self.online(node_ids)
        rng = np.random.default_rng((self.seed, 17, server_round))
        picked = rng.choice(len(online), size=min(count, len(online)), replace=False) if online else []
        return [online[i] for i in sorted(picked)], len(online)

    def device_s(self, node: int, up_bytes: int) -> float:
        group = self.model.groups[self.group_of[self.device_of[node]]]
        return device_round_s(group, self.model.train_flops, self.model.down_bytes, up_bytes)

    def settle(self, server_round: int, sampled: list[int], online: int, up_bytes: dict[int, int]) -> dict:
        """Close the round: which replies (``up_bytes`` by node) count, the modelled round time, the clock moved
        on. Returns the round's record, with ``kept`` the node ids whose updates are aggregated."""
        start, deadline = self.clock, self.model.deadline_s
        kept, dropouts, late, waited = [], [], [], [0.0]
        for node in sampled:
            if node not in up_bytes:  # no reply at all (its ClientApp failed): the server waited the round out
                waited.append(deadline or 0.0)
                continue
            duration = self.device_s(node, up_bytes[node])
            gone = self.model.availability.offline_at(self.device_of[node], start, start + duration)
            if gone is not None:
                dropouts.append(node)
                waited.append(gone - start)
            elif deadline is not None and duration > deadline:
                late.append(node)
            else:
                kept.append(node)
                waited.append(duration)
        round_s = max(waited)
        if deadline is not None and len(kept) < len(sampled):
            round_s = deadline  # the server waits the deadline out for the missing replies
        if not sampled:
            round_s = deadline or IDLE_ROUND_S
        self.clock = start + round_s
        delivered = kept + late
        return {"round": server_round, "modelled_round_s": round_s, "modelled_clock_s": self.clock,
                "devices": len(self.device_of), "online": online, "sampled": len(sampled), "aggregated": len(kept),
                "dropouts": len(dropouts), "late": len(late),
                "modelled_bytes_down": self.model.down_bytes * len(sampled),
                "bytes_up": sum(up_bytes[n] for n in delivered), "kept": kept}
