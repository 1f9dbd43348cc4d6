"""Round deadlines (``--round-deadline``): a device that cannot finish its round in time is left out of it.

In the round-based modes (local SGD, ``local_sgd.py``, and federated rounds,
``federated.py``) every device trains ``H`` local steps, then the devices
average. Without a deadline the average waits for the slowest device, so one
rpi-zero-class device sets the pace of the fleet. With one, a round has a
length ``D`` on each device's own clock, measured from the end of the last
exchange (``LinkEmulator``: virtual time with ``--link`` in virtual mode,
else the wall time of the device's steps):

- before each local step a device checks ``elapsed + last step > D`` (it
  would not finish the step in time); if so it stops training for the rest
  of the round: its remaining steps of the round are skipped (no forward or
  backward; the loop records 0 samples), and it reaches the exchange at about
  ``D``, so nobody waits for it longer;
- at the exchange the devices tell each other, in one small float64
  all-reduce on the bookkeeping group, their clock, whether they finished
  and their round time (``RoundReport``); every device then knows the same
  member list. The late device's partial update is dropped (weight 0: it
  sends nothing), the mean is taken over the devices that made it, and the
  late device takes the new global model like every device that sat the
  round out (``local_sgd.py``: the members' exchange and the download), so
  it catches up at the next round.

In a real fleet the server learns who made it from who reported before the
deadline, and the round times ride with the reports, so this all-reduce
stands for no message of its own: it is not counted as traffic (like the
clock all-reduce of virtual mode, which it replaces in these rounds).

``auto`` (``DeadlineSpec``): round 0 has no deadline (nothing is measured
yet); after each round every device adds the sampled devices' round times
to the same history, and the next deadline is::

    D = max(floor, factor x median(round times of the last `window` rounds))

with factor 2, floor 0.05 s, window 5. A device that finished reports its
round time; one that stopped early reports its projection
``elapsed / steps done x H`` (``last step x H`` if it did none), so the
median also sees the slow devices: if more than half the fleet is slow the
deadline grows to fit them, and a round cannot stay empty for long. Every
device computes ``D`` from the same all-reduced numbers, so they agree
without a message. A fixed ``SECONDS`` applies from round 0.

Weights: the loop scales each device's loss by its share of the global
batch (``train/strategy.py``), so the mean over the members is the
unweighted mean of their updates; leaving a device out keeps it an average
of full local updates (each member did all ``H`` steps), which is what
FedAvg with client dropout computes (McMahan et al. 2017 average over the
clients that report). ``tests/comm/test_deadline.py`` checks it against a
hand computation.

The other modes: ``sync`` and the strategies other than ``ddp`` step
together every step (no round to bound); ``gossip``'s pairwise exchange has
no point where the neighbours of a late device learn it is late without
waiting for it or a global agreement, which gossip exists to avoid; and
``async:S`` already lets a slow device lag: its averages run in the
background and a fast device waits only when its own round is ``S`` steps
old, so the staleness bound plays the deadline's part, counted in steps. So
``config.resolve`` refuses ``--round-deadline`` with them.
"""
from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass

import torch

from edgetrain.spec import DeadlineSpec


class RoundDeadline:
    """The deadline of the current round on every device (the same number on all: see the module docstring)."""

    def __init__(self, spec: DeadlineSpec):
        self.spec = spec
        self.history: deque[list[float]] = deque(maxlen=spec.window)

    @property
    def seconds(self) -> float:
        if self.spec.seconds is not None:
            return self.spec.seconds
        times = [t for round_times in self.history for t in round_times]
        if not times:
            return math.inf
        return max(self.spec.floor_s, self.spec.factor * statistics.median(times))

    def observe(self, round_times: list[float]) -> None:
        """The round times of a round's sampled devices (finished or projected)."""
        if round_times:
            self.history.append(list(round_times))

    def state_dict(self) -> dict:
        return {"history": [list(r) for r in self.history]}

    def load_state_dict(self, state: dict) -> None:
        self.history = deque(state["history"], maxlen=self.spec.window)


def projected_round_time(elapsed_s: float, steps_done: int, period: int, last_step_s: float) -> float:
    """What a round of ``period`` steps takes this device: the elapsed time if it did them all, else an estimate."""
    if steps_done >= period:
        return elapsed_s
    if steps_done > 0:
        return elapsed_s / steps_done * period
    return last_step_s * period


@dataclass
class RoundReport:
    """Every device's part of a round's report, all-reduced as one float64 vector of 3 x world numbers."""

    clocks: list[float]        # each device's clock when it reached the exchange
    on_time: list[bool]        # sampled and finished its local steps before the deadline
    round_times: list[float]   # each sampled device's (projected) round time; 0 for the others

    @staticmethod
    def mine(rank: int, world: int, clock_s: float, on_time: bool, round_time_s: float) -> torch.Tensor:
        """This device's slots filled, the others zero: a SUM all-reduce gives every device the whole report."""
        vector = torch.zeros(3 * world, dtype=torch.float64)
        vector[rank], vector[world + rank], vector[2 * world + rank] = clock_s, float(on_time), round_time_s
        return vector

    @classmethod
    def from_vector(cls, vector: torch.Tensor, world: int) -> RoundReport:
        values = vector.tolist()
        return cls(values[:world], [v > 0.5 for v in values[world:2 * world]], values[2 * world:])
