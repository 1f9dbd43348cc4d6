"""Elastic membership of emulated devices, the launcher's side: who is in the next generation.

Design: docs/design/elastic.md ("The launcher's side").
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass

from edgetrain.cluster.profiles import split_by_weights

CHANGES_KEY = "elastic/changes"
LOST_KEY = "elastic/lost"
JOIN_ENV = "EDGETRAIN_ELASTIC_JOIN"  # set to 1 in a device the launcher started again


def join_key(device: int) -> str:
    return f"elastic/join/{device}"


def admitted_key(device: int) -> str:
    return f"elastic/join/{device}/gen"


def request_key(generation: int, device: int) -> str:
    return f"elastic/gen{generation}/dev/{device}"


def members_key(generation: int) -> str:
    return f"elastic/gen{generation}/members"


def group_prefix(generation: int) -> str:
    return f"elastic/gen{generation}/pg"


@dataclass(frozen=True)
class ElasticLaunch:
    """What ``launch_local`` needs for an elastic run."""

    min_devices: int
    local_batches: tuple[int, ...]  # the first split of the global batch, by first rank
    timeout_s: float              # how long a generation waits for a silent member
    back_s: float | None = None   # start a lost device again this long after it ended (None: never)


class Lighthouse:
    """The launcher's membership decisions (docs/design/elastic.md)."""

    def __init__(self, store, world: int, launch: ElasticLaunch, labels: list[str]):
        self.store, self.world, self.launch, self.labels = store, world, launch, labels
        self.members = list(range(world))
        self.generation = 0
        self.lost_devices: list[int] = []   # every device lost so far, in order, for the final line
        self.down: set[int] = set()         # devices whose process ended and was not started again
        self.departed: set[int] = set()     # members lost since the current generation was decided
        self._first_request: float | None = None

    def lost(self, device: int) -> str | None:
        """A device's process ended: tell the members; the run's last line if too few remain."""
        self.lost_devices.append(device)
        self.down.add(device)
        if device in self.members and device not in self.departed:  # one left out already is no news
            self.departed.add(device)
            self.store.add(CHANGES_KEY, 1)
            self.store.add(LOST_KEY, 1)
        return self._too_few(len(set(self.members) - self.departed))

    def restarting(self, device: int) -> None:
        """A lost device is started again: forget its earlier admission."""
        self.down.discard(device)
        for key in (join_key(device), admitted_key(device)):
            self.store.delete_key(key)

    def poll(self, alive: set[int]) -> tuple[list[int], str | None]:
        """Decide the next generation if it is due: (devices left out that the launcher must stop, the
        run's last line if fewer than ``min_devices`` remain)."""
        n = self.generation + 1
        current = [d for d in self.members if d not in self.departed]
        asked = {d for d in current if self.store.check([request_key(n, d)])}
        if not asked:
            return [], None
        now = time.monotonic()
        self._first_request = self._first_request or now
        expected = {d for d in current if d in alive}
        if not expected <= asked and now - self._first_request < self.launch.timeout_s:
            return [], None
        joining = [d for d in range(self.world) if d not in current and d in alive
                   and self.store.check([join_key(d)]) and not self.store.check([admitted_key(d)])]
        members = sorted((asked & alive) | set(joining))
        silent = sorted(expected - asked)
        left = [d for d in self.members if d not in members or d in self.departed]
        if len(members) < self.launch.min_devices:
            return silent, self._too_few(len(members))
        changes = self.store.add(CHANGES_KEY, 0)  # the members' count of changes from now on
        lost = self.store.add(LOST_KEY, 0)  # and of losses: the members' watchers cut on a later one
        # The same global batch over the new set, in proportion to the first split (which followed the
        # devices' speeds where --local-batch balanced): decided here, once, so every member agrees.
        batches = split_by_weights(sum(self.launch.local_batches), [self.launch.local_batches[d] for d in members])
        self.store.set(members_key(n), json.dumps({"members": members, "left": left, "joined": joining,
                                                   "changes": changes, "lost": lost, "local_batches": batches}))
        for d in joining:
            self.store.set(admitted_key(d), str(n))
        self.members, self.generation, self._first_request = members, n, None
        self.departed.clear()
        return silent, None

    def _too_few(self, remaining: int) -> str | None:
        if remaining >= self.launch.min_devices:
            return None
        lost = ", ".join(self.labels[d] for d in sorted(set(self.lost_devices)))  # by rank: deaths race
        return (f"lost {lost}; {remaining} of {self.world} devices remain, fewer than --min-devices "
                f"{self.launch.min_devices}, so the run stopped; lower --min-devices or keep the devices up")
