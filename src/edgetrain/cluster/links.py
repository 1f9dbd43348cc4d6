"""Network links between edge devices, and how long a collective takes on them.

A ``Link`` is one device's connection: bandwidth, one-way latency, jitter and
packet loss. Presets cover the usual edge cases; an inline spec describes any
other link, e.g. ``20mbit:5ms:jitter=1ms:loss=0.01``. ``Link``, ``PRESETS`` and
the parsing (``get_link``) live in ``edgetrain.spec`` (torch-free, parsed once);
this module is the time model.

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

import random
from typing import Sequence

from edgetrain.spec import PRESETS, Link, get_link, parse_rate, parse_time

__all__ = ["Link", "PRESETS", "ROUNDS", "collective_time", "get_link", "parse_rate", "parse_time"]

ROUNDS = {
    "allreduce": lambda p: 2 * (p - 1),
    "allgather": lambda p: p - 1,
    "p2p": lambda p: 1,
}


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
