"""Fault injection for tests and chaos runs: ``EDGETRAIN_FAULT=ACTION:rank=R:step=S[;...]``.

Design: docs/design/launch.md ("Injected faults").
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
