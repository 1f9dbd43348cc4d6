"""Network links between edge devices, and how long a collective takes on them.

A ``Link`` is one device's connection: bandwidth, one-way latency, jitter and
packet loss. Presets cover the usual edge cases; an inline spec describes any
other link, e.g. ``20mbit:5ms:jitter=1ms:loss=0.01``.

Time model (the alpha-beta model of Hockney, per round of the algorithm used)::

    Tc = sum over rounds r of  max over devices i of  (latency_i + jitter_ir + chunk / goodput_i)

where ``chunk`` is the bytes a device sends in one round. With identical links
this is ``Tc = latency x rounds + bytes / bandwidth``. The slowest link taking
part bottlenecks every round, because a ring step completes only when every
device has passed its chunk on. Rounds per algorithm, for ``p`` devices:

* ring all-reduce: ``2 (p-1)`` rounds (reduce-scatter, then all-gather),
* ring all-gather: ``p-1`` rounds,
* point-to-point exchange: 1 round.

Loss is modelled as expected retransmissions: each packet is lost with
probability ``loss`` and resent until it arrives, so the goodput is
``bandwidth x (1 - loss)``. Retransmission timeouts and TCP's congestion
response are not modelled; real TCP degrades far more at a few percent loss.

Jitter adds ``N(0, jitter)`` to each round's latency (clipped so a round never
takes less than zero), drawn from a generator seeded per collective, so every
device computes the same duration for the same collective and a run repeats.
"""
from __future__ import annotations

import math
import random
import re
from dataclasses import dataclass
from typing import Sequence

from edgetrain.errors import EdgetrainError


@dataclass(frozen=True)
class Link:
    """One device's network link. ``bandwidth_bps`` in bits per second, times in seconds."""

    bandwidth_bps: float
    latency_s: float
    jitter_s: float = 0.0
    loss: float = 0.0
    name: str = ""

    def __post_init__(self) -> None:
        if not (self.bandwidth_bps > 0 and math.isfinite(self.bandwidth_bps)):
            raise EdgetrainError(f"link bandwidth must be a positive number of bits/s, got {self.bandwidth_bps}")
        if not (self.latency_s >= 0 and self.jitter_s >= 0):
            raise EdgetrainError(f"link latency and jitter must be >= 0, got {self.latency_s}, {self.jitter_s}")
        if not 0 <= self.loss < 1:
            raise EdgetrainError(f"link loss must be a probability in [0, 1), got {self.loss}")

    @property
    def goodput_Bps(self) -> float:
        """Bytes per second that arrive, after expected retransmissions."""
        return self.bandwidth_bps / 8 * (1 - self.loss)

    def describe(self) -> str:
        text = f"{_fmt_bits(self.bandwidth_bps)}, {self.latency_s * 1e3:g} ms"
        if self.jitter_s:
            text += f", jitter {self.jitter_s * 1e3:g} ms"
        if self.loss:
            text += f", loss {self.loss:g}"
        return f"{self.name} ({text})" if self.name else text


PRESETS: dict[str, Link] = {
    "lan-1g": Link(1e9, 0.0002, name="lan-1g"),
    "wifi-20m": Link(20e6, 0.005, jitter_s=0.001, name="wifi-20m"),
    "lte-10m": Link(10e6, 0.050, jitter_s=0.005, name="lte-10m"),
    # Shanghai-Boston is about 11,700 km; light in fibre needs ~58 ms, in vacuum 39 ms.
    # 78 ms one way is the figure the issue asks for (twice the vacuum time).
    "wan-intercontinental": Link(100e6, 0.078, name="wan-intercontinental"),
}

ROUNDS = {
    "allreduce": lambda p: 2 * (p - 1),
    "allgather": lambda p: p - 1,
    "p2p": lambda p: 1,
}

_RATE = {"bit": 1, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "bps": 1, "kbps": 1e3, "mbps": 1e6, "gbps": 1e9}
_TIME = {"s": 1.0, "ms": 1e-3, "us": 1e-6}


def get_link(spec: str | Link | dict | None) -> Link | None:
    """A ``Link`` from a preset name, an inline spec, a mapping (cluster file) or a ``Link``.

    ``None``, ``""`` and ``"none"`` mean no emulation (the host's own network).
    Inline: ``BANDWIDTH:LATENCY[:jitter=T][:loss=P]``, e.g. ``20mbit:5ms:jitter=1ms:loss=0.01``.
    Mapping: ``{preset: lte-10m}`` or ``{bandwidth: 20mbit, latency: 5ms, jitter: 1ms, loss: 0.01}``.
    """
    if spec is None or isinstance(spec, Link):
        return spec
    if isinstance(spec, dict):
        return _link_from_mapping(spec)
    if not isinstance(spec, str):
        raise EdgetrainError(f"a link is a preset name or a spec string, got {type(spec).__name__}")
    text = spec.strip().lower()
    if text in ("", "none"):
        return None
    if text in PRESETS:
        return PRESETS[text]
    if ":" not in text:
        raise EdgetrainError(f"unknown link preset {spec!r}; use one of {', '.join(PRESETS)} "
                             "or an inline spec like 20mbit:5ms:jitter=1ms:loss=0.01")
    parts = text.split(":")
    options: dict[str, str] = {}
    for part in parts[2:]:
        key, eq, value = part.partition("=")
        if not eq or key not in ("jitter", "loss"):
            raise EdgetrainError(f"bad link option {part!r} in {spec!r}; options are jitter=TIME and loss=P")
        options[key] = value
    return Link(bandwidth_bps=parse_rate(parts[0]), latency_s=parse_time(parts[1]),
                jitter_s=parse_time(options.get("jitter", "0s")), loss=_parse_prob(options.get("loss", "0")),
                name=text)


def _link_from_mapping(spec: dict) -> Link | None:
    known = {"preset", "bandwidth", "latency", "jitter", "loss"}
    unknown = set(spec) - known
    if unknown:
        raise EdgetrainError(f"unknown link field(s) {sorted(unknown)}; use {sorted(known)}")
    if "preset" in spec:
        base = get_link(str(spec["preset"]))
        if base is None:
            return None
    elif "bandwidth" in spec and "latency" in spec:
        base = Link(parse_rate(str(spec["bandwidth"])), parse_time(str(spec["latency"])))
    else:
        raise EdgetrainError("a link needs either 'preset' or both 'bandwidth' and 'latency'")
    return Link(
        bandwidth_bps=parse_rate(str(spec["bandwidth"])) if "bandwidth" in spec else base.bandwidth_bps,
        latency_s=parse_time(str(spec["latency"])) if "latency" in spec else base.latency_s,
        jitter_s=parse_time(str(spec["jitter"])) if "jitter" in spec else base.jitter_s,
        loss=_parse_prob(str(spec["loss"])) if "loss" in spec else base.loss,
        name=str(spec.get("preset", "")),
    )


def parse_rate(text: str) -> float:
    """``"20mbit"`` -> 20e6 bits per second (``kbit``, ``mbit``, ``gbit``; ``mbps`` means the same)."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[+-]?\d+)?)\s*([a-z]+)\s*", text.lower())
    if not m or m.group(2) not in _RATE:
        raise EdgetrainError(f"bad bandwidth {text!r}; write it like 20mbit, 500kbit or 1gbit")
    value = float(m.group(1)) * _RATE[m.group(2)]
    if value <= 0:
        raise EdgetrainError(f"bandwidth must be positive, got {text!r}")
    return value


def parse_time(text: str) -> float:
    """``"5ms"`` -> 0.005 seconds (``s``, ``ms``, ``us``)."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[+-]?\d+)?)\s*([a-z]+)\s*", text.lower())
    if not m or m.group(2) not in _TIME:
        raise EdgetrainError(f"bad time {text!r}; write it like 5ms, 0.2s or 300us")
    return float(m.group(1)) * _TIME[m.group(2)]


def _parse_prob(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise EdgetrainError(f"bad loss {text!r}; write a probability like 0.01") from None
    if not 0 <= value < 1:
        raise EdgetrainError(f"loss must be in [0, 1), got {text!r}")
    return value


def collective_time(links: Sequence[Link], kind: str, bytes_sent: int, seed: int | None = None) -> float:
    """Modelled seconds for one collective among the devices on ``links``.

    ``bytes_sent`` is what each device puts on its link over the whole collective
    (see ``edgetrain.comm.accounting``); it is split evenly over the rounds.
    ``seed`` picks this collective's jitter; ``None`` uses the mean latency.
    """
    if kind not in ROUNDS:
        raise ValueError(f"unknown collective kind {kind!r}")
    if not links:
        return 0.0
    rounds = ROUNDS[kind](len(links))
    if rounds == 0:
        return 0.0
    chunk = bytes_sent / rounds
    jitters = [link.jitter_s for link in links]
    rng = random.Random(seed) if seed is not None and any(jitters) else None
    total = 0.0
    for _ in range(rounds):
        slowest = 0.0
        for link in links:
            latency = link.latency_s
            if rng is not None and link.jitter_s:
                latency = max(0.0, latency + rng.gauss(0.0, link.jitter_s))
            slowest = max(slowest, latency + chunk / link.goodput_Bps)
        total += slowest
    return total


def _fmt_bits(bps: float) -> str:
    for unit, scale in (("Gbit/s", 1e9), ("Mbit/s", 1e6), ("kbit/s", 1e3)):
        if bps >= scale:
            return f"{bps / scale:g} {unit}"
    return f"{bps:g} bit/s"
