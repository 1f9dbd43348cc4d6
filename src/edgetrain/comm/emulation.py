"""Emulated links and the per-device training clock.

``LinkEmulator`` charges every collective the time the link model (``edgetrain.cluster.links``) gives it:
``enforced``, the device sleeps that long after the real collective; ``virtual``, nothing sleeps and each device
keeps a virtual clock (measured compute plus modelled communication, synchronised at each blocking exchange).
Both assume communication does not overlap computation. Compute time is measured on the emulation host, not
on a real edge device.

Design: docs/design/links.md ("Emulated links and the device clock")
"""
from __future__ import annotations

import time
from typing import Callable, Sequence, TypeVar

from edgetrain.cluster.links import Link, collective_time
from edgetrain.comm.accounting import CommStats
from edgetrain.spec import LINK_MODES as MODES

T = TypeVar("T")


class LinkEmulator:
    """One device's view of the emulated network (every device's link) and its clock.

    ``links[i]`` is device ``i``'s link, or ``links`` is ``None`` for no emulation.
    """

    def __init__(self, links: Sequence[Link] | None, rank: int, stats: CommStats | None = None,
                 mode: str = "virtual", seed: int = 0, timeout_s: float = 300.0):
        if mode not in MODES:
            raise ValueError(f"link mode must be one of {MODES}, got {mode!r}")
        self.links = list(links) if links is not None else None
        self.rank = rank
        self.stats = stats if stats is not None else CommStats()
        self.mode = mode
        self.seed = seed
        self.timeout_s = timeout_s
        self.collectives = 0
        # clock
        self.virtual_s = 0.0
        self.compute_s = 0.0           # summed measured compute
        self.comm_model_s = 0.0        # summed modelled comm charged to steps (blocking)
        self.comm_blocked_s = 0.0      # summed real time blocked in communication during steps
        self.steps = 0
        self._step_start: float | None = None
        self._blocked = 0.0            # real seconds blocked in this step so far
        self._model = 0.0              # modelled comm seconds charged to this step so far
        self._arrived: float | None = None
        self.last_step: dict = {}

    @property
    def emulated(self) -> bool:
        return self.links is not None

    @property
    def virtual(self) -> bool:
        return self.emulated and self.mode == "virtual"

    # -- communication ------------------------------------------------------------
    def model_time(self, kind: str, bytes_sent: int, peers: Sequence[int] | None = None) -> float:
        """Modelled seconds for one collective among ``peers`` (default all devices); counts it for jitter."""
        if self.links is None:
            return 0.0
        members = [self.links[i] for i in (peers if peers is not None else range(len(self.links)))]
        seconds = collective_time(members, kind, bytes_sent, seed=self.seed * 1_000_003 + self.collectives)
        self.collectives += 1
        return seconds

    def begin(self) -> float:
        """Mark the start of a blocking exchange; pass the result to ``end``."""
        return time.perf_counter()

    def end(self, started: float, parts: Sequence[tuple[str, int]], peers: Sequence[int] | None = None,
            bytes_recv: int | None = None, download: bool = False) -> float:
        """Charge a finished blocking exchange made of collectives ``parts`` = [(kind, bytes sent)].

        Counts the bytes, and the modelled time; in enforced mode sleeps it
        first, so the wall clock pays the link. The real collective returned
        only once every device had arrived, so the sleep starts from there.
        ``download``: the device only received ``parts`` (counted as received, nothing sent).
        Returns the modelled seconds.
        """
        sent = 0 if download else sum(b for _, b in parts)
        if self.emulated:
            modelled = sum(self.model_time(kind, b, peers) for kind, b in parts)
            if self.mode == "enforced":
                time.sleep(modelled)
        else:
            modelled = time.perf_counter() - started
        self.stats.record(sent, sent if bytes_recv is None else bytes_recv, len(parts),
                          time.perf_counter() - started)
        self._model += modelled
        self._blocked += time.perf_counter() - started
        return modelled

    def run(self, kind: str, bytes_sent: int, fn: Callable[[], T], peers: Sequence[int] | None = None,
            bytes_recv: int | None = None) -> T:
        """Run the blocking collective ``fn`` and charge it (see ``end``)."""
        started = self.begin()
        result = fn()
        self.end(started, [(kind, bytes_sent)], peers, bytes_recv)
        return result

    def step_charged(self) -> tuple[float, float]:
        """(real seconds blocked in exchanges, modelled seconds charged) in this step so far: for a strategy that
        works out its own step's clock from several exchanges (a hybrid pipeline, train/pipeline.py)."""
        return self._blocked, self._model

    def blocked(self, seconds: float) -> None:
        """Real time spent waiting on communication outside ``run`` (e.g. an async wait)."""
        self._blocked += seconds

    # -- clock --------------------------------------------------------------------
    def start_step(self) -> None:
        """Mark the start of a training step (the first training forward calls this)."""
        if self._step_start is None:
            self._step_start = time.perf_counter()
            self._blocked = 0.0
            self._model = 0.0
            self._arrived = None

    def arrive(self) -> float:
        """This device's clock now: virtual time at which it reaches a synchronisation point."""
        if self._step_start is None:
            self.start_step()
        compute = time.perf_counter() - self._step_start - self._blocked
        if self.virtual:
            self._arrived = self.virtual_s + compute
        else:
            self._arrived = self.virtual_s + time.perf_counter() - self._step_start
        return self._arrived

    def finish_step(self, ready_s: float | None = None, count: bool = True) -> dict:
        """Close the step. ``ready_s``: virtual time at which the data this step waited for was ready
        (e.g. the max of the other devices' ``arrive()``); ignored outside virtual mode.
        ``count=False`` closes a stretch that is not a training step (the final exchange)."""
        if self._step_start is None:
            self.start_step()
        wall = time.perf_counter() - self._step_start
        compute = max(0.0, wall - self._blocked)
        if self.virtual:
            start = self.virtual_s + compute
            if ready_s is not None:
                start = max(start, ready_s)
            end = start + self._model
        else:
            end = self.virtual_s + wall
        return self.close_step_at(end, compute, self._model, count)

    def close_step_at(self, virtual_s: float, compute_s: float, comm_model_s: float, count: bool = True) -> dict:
        """Close the step with the clock at ``virtual_s``, worked out by the caller (``finish_step``, or a
        pipeline's timeline of micro-batches, ``train/pipeline.py``); the totals add its parts."""
        self.virtual_s = virtual_s
        self.compute_s += compute_s
        self.comm_model_s += comm_model_s
        self.comm_blocked_s += self._blocked
        self.steps += int(count)
        self.last_step = {"compute_s": compute_s, "comm_model_s": comm_model_s,
                          "comm_blocked_s": self._blocked, "virtual_s": self.virtual_s}
        self._step_start = None
        return self.last_step

    def summary(self) -> dict:
        """Clock totals. ``comm_fraction``: the share of the device's time not spent computing, i.e.
        transferring (``comm_time_s``) or waiting for other devices or a background exchange (``wait_s``)."""
        comm = self.comm_model_s if self.virtual else self.comm_blocked_s
        total = self.virtual_s
        return {
            "link_mode": self.mode if self.emulated else "none",
            "virtual_time_s": total,
            "compute_s": self.compute_s,
            "comm_time_s": comm,
            "comm_time_is": "modelled" if self.virtual else "measured",
            "wait_s": max(0.0, total - self.compute_s - comm),
            "comm_fraction": max(0.0, total - self.compute_s) / total if total > 0 else 0.0,
        }
