"""Network links between edge devices, and how long a collective takes on them.

A ``Link`` is one device's connection: bandwidth, one-way latency, jitter and
packet loss. Presets cover the usual edge cases; an inline spec describes any
other link, e.g. ``20mbit:5ms:jitter=1ms:loss=0.01``. ``Link``, ``PRESETS`` and
the parsing (``get_link``) live in ``edgetrain.spec`` (torch-free, parsed once);
this module is the time model, the one the planner, its simulator and the
virtual clock all use. Derivation and measurements: docs/benchmarks/real-links.md.

Time model (the alpha-beta model of Hockney, per round of the algorithm used)::

    Tc = sum over rounds r of  max over devices i of  round_seconds(latency_i + jitter_ir, chunk, goodput_i, kind)
    round_seconds = latency + ROUND_OVERHEAD_S + (FRAME_BYTES + chunk x wire_bytes_per_byte(kind)) / goodput

where ``chunk`` is the payload a device sends in one round and ``goodput`` the
link's rate in bytes after loss (``Link.goodput_Bps``). Per round, beyond the
link's latency: gloo's per-message cost (``ROUND_OVERHEAD_S``, measured), one
frame's store-and-forward time (the last frame of a round passes a second shaper
or switch at the same rate before the receiver has it), and the payload with its
TCP/IP/Ethernet framing and, where every device sends while it receives, the ACKs
of what it receives on the same link (``wire_bytes_per_byte``). The slowest link
taking part bottlenecks every round, because a ring step completes only when
every device has passed its chunk on. Rounds per kind, for ``p`` devices
(``KINDS``): ring all-reduce ``2 (p-1)`` (reduce-scatter, then all-gather: each
round waits on the previous one's data), ring all-gather ``p-1``, point-to-point 1.

Loss is modelled as expected retransmissions: each packet is lost with
probability ``loss`` and resent until it arrives, so the goodput is
``bandwidth x (1 - loss)``. Retransmission timeouts and TCP's congestion
response are not modelled; real TCP degrades far more at a few percent loss.

Jitter adds ``N(0, jitter)`` to each round's latency (clipped so a round never
takes less than zero), drawn from a generator seeded per collective, so every
device computes the same duration for the same collective and a run repeats.

Not modelled: compute overlapping communication (edgetrain's hooks finish their
collective before backward goes on; DDP's own all-reduce of a small model is one
bucket, launched when backward ends), the physical layer's preamble, FCS and
inter-frame gap (24 bytes a frame that Linux's shaper does not count: a real
Ethernet link carries 1.6% less), and Wi-Fi's or LTE's own MAC overheads.
"""
from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Callable, Sequence

from edgetrain.spec import PRESETS, Link, get_link, parse_rate, parse_time

__all__ = ["KINDS", "Link", "PRESETS", "ROUNDS", "collective_time", "get_link", "parse_rate", "parse_time",
           "round_seconds", "wire_bytes_per_byte"]

# TCP over Ethernet at the usual MTU of 1500 bytes (IPv4; Linux sends the TCP timestamps option by default):
MTU = 1500
TCP_IP_HEADERS = 20 + 20 + 12         # IPv4 header + TCP header + timestamps option (10 bytes, padded to 12)
ETHERNET_HEADER = 14                  # destination, source, EtherType: what tbf and a switch's buffer count
MSS = MTU - TCP_IP_HEADERS            # 1448 payload bytes in a full frame
FRAME_BYTES = MTU + ETHERNET_HEADER   # 1514 bytes on the link for those 1448
ACK_BYTES = ETHERNET_HEADER + TCP_IP_HEADERS  # 66: a pure ACK carries headers only
SEGMENTS_PER_ACK = 2                  # delayed ACK (RFC 1122, RFC 5681): one ACK for every second full segment
# gloo's cost per dependent message between two hosts, beyond the wire: a 4-byte all_reduce of 2 devices (two
# dependent messages) took a median 0.16-0.18 ms between two network-namespace hosts on an unshaped veth
# (benchmarks/link_probe.py --rate none, this development host), so 80 us a round.
ROUND_OVERHEAD_S = 80e-6


@dataclass(frozen=True)
class CollectiveKind:
    """One kind of collective: its dependent rounds for ``p`` devices, and whether every device sends while it
    receives (a ring: its link then also carries the ACKs of what it receives, in the direction it sends)."""

    rounds: Callable[[int], int]
    duplex: bool


KINDS: dict[str, CollectiveKind] = {
    "allreduce": CollectiveKind(lambda p: 2 * (p - 1), duplex=True),
    "allgather": CollectiveKind(lambda p: p - 1, duplex=True),
    # one way (a pipeline's activations, a download); its ACKs go back on the other, idle, direction
    "p2p": CollectiveKind(lambda p: 1, duplex=False),
}
ROUNDS = {name: kind.rounds for name, kind in KINDS.items()}


def wire_bytes_per_byte(kind: str) -> float:
    """Bytes on the link per payload byte of ``kind``: ``FRAME_BYTES / MSS`` = 1514/1448 one way, and with a
    duplex kind half an ACK a segment more, ``(1514 + 66/2) / 1448`` = 1547/1448."""
    extra = ACK_BYTES / SEGMENTS_PER_ACK if KINDS[kind].duplex else 0.0
    return (FRAME_BYTES + extra) / MSS


def round_seconds(latency_s, chunk: float, goodput_Bps, kind: str):
    """Seconds of one round of ``kind`` on one link: ``chunk`` payload bytes sent, after ``latency_s`` (this
    round's, jitter included) at ``goodput_Bps`` (``Link.goodput_Bps``). Works on numbers or numpy arrays."""
    return latency_s + ROUND_OVERHEAD_S + (FRAME_BYTES + chunk * wire_bytes_per_byte(kind)) / goodput_Bps


def collective_time(links: Sequence[Link], kind: str, bytes_sent: int, seed: int | None = None,
                    devices: int | None = None) -> float:
    """Modelled seconds for one collective among the devices on ``links``.

    ``bytes_sent`` is what each device puts on its link over the whole collective
    (see ``edgetrain.comm.accounting``); it is split evenly over the rounds.
    ``seed`` picks this collective's jitter; ``None`` uses the mean latency.
    ``devices``: how many devices take part, where ``links`` lists only their distinct links (the planner's
    thousands of identical links); default ``len(links)``.
    """
    if kind not in KINDS:
        raise ValueError(f"unknown collective kind {kind!r}")
    if not links:
        return 0.0
    rounds = KINDS[kind].rounds(len(links) if devices is None else devices)
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
            slowest = max(slowest, round_seconds(latency, chunk, link.goodput_Bps, kind))
        total += slowest
    return total
