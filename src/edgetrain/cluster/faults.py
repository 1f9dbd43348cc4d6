"""Fault injection for tests and chaos runs: ``EDGETRAIN_FAULT=ACTION:rank=R:step=S[;...]``.

As torchft's tests do (a failure injected at a chosen replica and step),
device ``R`` does ``ACTION`` to itself at the start of step ``S``: after any
checkpoint due at that step, before the batch is taken.

- ``kill``: SIGKILL (a device unplugged: no clean-up, no message; the
  launcher names it: "its process was killed by signal SIGKILL");
- ``stop``: SIGSTOP (a device frozen or swapped out: its peers time out
  after ``--timeout`` and the launcher blames the stopped one);
- ``disconnect``: leaves the process group at once (its sockets close, its
  peers' next collective fails), then stays alive without a word for
  ``--timeout`` seconds and ends with one line.

Several faults are separated by ``;`` (``kill:rank=1:step=40:back=20;
kill:rank=3:step=90:back=20``, as benchmarks/chaos.py sets): each device
does those that name it, at their steps; at most one per device and step.
In an elastic run a killed device that comes back does not do the faults of
its rank at or before the step it rejoins at (the one that took it down,
and those it missed while away).

The variable is parsed once, into ``RunSpec.faults``, by ``config.resolve``
(``spec.parse_faults``): a malformed value is one line before any device
starts. It is an
environment variable, not an option, so that it never lands in a run's
``config.yaml``; a resumed run injects it again only if it is still set.
"""
from __future__ import annotations

import os
import signal
import time

import torch.distributed as dist

from edgetrain.errors import EdgetrainError
from edgetrain.spec import FaultSpec


def inject_fault(faults: tuple[FaultSpec, ...], rank: int, step: int, timeout_s: float) -> None:
    """Do the fault of ``faults`` that is this device's at this step, if there is one."""
    fault = next((f for f in faults if (f.rank, f.step) == (rank, step)), None)
    if fault is None:
        return
    if fault.action == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    elif fault.action == "stop":
        os.kill(os.getpid(), signal.SIGSTOP)
    else:
        dist.destroy_process_group()
        time.sleep(timeout_s)  # unreachable, but alive, as long as a peer would wait for it
        raise EdgetrainError(f"fault injected: device {rank} disconnected at step {step} and gave up after "
                             f"{timeout_s:g} s")
