"""Elastic membership of emulated devices, the launcher's side: who is in the next generation.

An elastic run (``--min-devices K`` below the device count; the devices'
side is ``train/elastic.py``) goes through *generations*: the devices of
generation ``n`` form one gloo group over the launcher's loopback store
under the prefix ``elastic/gen<n>/pg``, ranked in the order of their first
rank. Generation 0 is the run's ordinary group.

The launcher decides each generation, as torchft's Lighthouse decides a
quorum: the devices never have to agree among themselves on who is alive,
which they cannot do once a peer is gone. Keys of the store:

- ``elastic/changes``: a counter. The launcher adds 1 when a device's
  process ends (``lost``), a returning device when it announces itself; the
  members read it at every step boundary and agree (a MAX all-reduce) to
  change together when it moved.
- ``elastic/lost``: a counter the launcher adds 1 to when a member's
  process ends. Each member watches it from a thread of its own and,
  when it moves, cuts its gloo connections (train/elastic.py: fast
  failure detection), so no member waits ``--timeout`` in a collective
  with a peer that already left it.
- ``elastic/join/<d>``: device ``d``, started again, asks to join;
  ``elastic/join/<d>/gen`` is the generation it was admitted to.
- ``elastic/gen<n>/dev/<d>``: member ``d`` asks for generation ``n``
  (after a failed collective or an agreed change).
- ``elastic/gen<n>/members``: the launcher's answer, JSON: ``members``
  (ranks in order), ``left`` and ``joined`` (first ranks), ``changes``
  (the counter when it decided: later moves are the next change),
  ``lost`` (the same for ``elastic/lost``) and
  ``local_batches``: the same global batch re-split over the members in
  proportion to their first shares (speed-proportional where the first
  split was), decided once here so that every member agrees.

``Lighthouse.poll`` decides generation ``n`` once every member of the
current one whose process is alive has asked (a dead one never will: its
exit was seen first), or ``timeout_s`` after the first request; a member
that is alive but silent that long (stopped, disconnected) is left out and
the launcher stops it. Admitted returning devices join the generation being
decided. Fewer than ``min_devices`` members is the end of the run: one line
naming the devices lost.

Limits: a device can only come back under its own first rank (the launcher
restarts it); a brand-new device beyond the first count cannot join.
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
    """The launcher's membership decisions (see the module docstring)."""

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
