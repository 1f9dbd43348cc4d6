"""What communication cost: bytes on the wire and time spent in collectives.

One ``CommStats`` lives in each worker. Communication hooks record every
collective they launch; the training loop reads the per-step deltas.

Bytes are counted from the payload actually handed to the collective, times
the traffic the algorithm generates per device: a ring all-reduce of ``n``
bytes over ``p`` devices sends and receives ``2 (p-1)/p n`` bytes per device
(reduce-scatter then all-gather), an all-gather of ``n`` bytes per device
sends ``(p-1) n`` along the ring and receives the same. DDP's own all-reduce
(no hook, ``sync.py``) hands edgetrain no payload; it is counted from the
gradient bytes, which it all-reduces exactly once per step.
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field


def ring_allreduce_bytes(payload: int, world: int) -> int:
    """Bytes one device sends (and receives) in a ring all-reduce of ``payload`` bytes."""
    return 0 if world <= 1 else int(2 * (world - 1) * payload / world)


def ring_allgather_bytes(payload: int, world: int) -> int:
    """Bytes one device sends (and receives) in a ring all-gather of ``payload`` bytes per device."""
    return 0 if world <= 1 else (world - 1) * payload


@dataclass
class CommStats:
    """Running totals for one device. Thread-safe: gloo completes futures on its own threads."""

    bytes_sent: int = 0
    bytes_recv: int = 0
    comm_s: float = 0.0          # summed duration of collectives; may overlap compute
    collectives: int = 0
    last_launch: float = 0.0     # perf_counter() of the latest collective launched
    last_done: float = 0.0       # perf_counter() of the latest collective completed
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def launched(self, sent: int, recv: int | None = None) -> float:
        now = time.perf_counter()
        with self._lock:
            self.bytes_sent += int(sent)
            self.bytes_recv += int(sent if recv is None else recv)
            self.collectives += 1
            self.last_launch = now
        return now

    def finished(self, started: float) -> None:
        now = time.perf_counter()
        with self._lock:
            self.comm_s += now - started
            self.last_done = max(self.last_done, now)

    def counted(self, sent: int, recv: int | None = None, launched_at: float | None = None) -> None:
        """Count an exchange that ran out of sight (DDP's own all-reduce): bytes, not time.
        ``launched_at``: perf_counter() when its last collective was launched, if known."""
        with self._lock:
            self.bytes_sent += int(sent)
            self.bytes_recv += int(sent if recv is None else recv)
            self.collectives += 1
            if launched_at is not None:
                self.last_launch = launched_at

    def record(self, sent: int, recv: int, collectives: int, seconds: float) -> None:
        """Count a finished blocking exchange in one go."""
        now = time.perf_counter()
        with self._lock:
            self.bytes_sent += int(sent)
            self.bytes_recv += int(recv)
            self.collectives += collectives
            self.comm_s += seconds
            self.last_launch = now - seconds
            self.last_done = max(self.last_done, now)

    def snapshot(self) -> dict:
        with self._lock:
            return {"bytes_sent": self.bytes_sent, "bytes_recv": self.bytes_recv,
                    "comm_s": self.comm_s, "collectives": self.collectives,
                    "last_launch": self.last_launch, "last_done": self.last_done}
