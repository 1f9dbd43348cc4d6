"""Round deadlines (``--round-deadline``): a device that cannot finish its round in time is left out of it.

In the round-based modes (``local_sgd.py``, ``federated.py``) a device stops training once its next step would
end past the round's deadline on its own clock; at the exchange every device learns the same member list
(``RoundReport``, one small all-reduce not counted as traffic), the late device's update is dropped and it
takes the new model. ``auto`` derives each deadline from the median of recent round times
(``RoundDeadline``); the other modes refuse deadlines (``config.resolve``).

Design: docs/design/strategies.md ("Round deadlines")
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
