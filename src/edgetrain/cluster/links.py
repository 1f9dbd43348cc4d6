"""Network links between edge devices, and how long a collective takes on them.

Design: docs/design/links.md ("The link model").
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
