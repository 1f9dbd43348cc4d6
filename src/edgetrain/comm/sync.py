"""How devices agree on the model each step.

A sync object wraps the model for one worker and is called by the training
loop at two points of every step. The default, ``Synchronous``, is plain DDP:
gradients are all-reduced during backward through a communication hook.

Interface the training loop relies on::

    sync = Synchronous(model, world_size, stats, hook=..., hook_state=...)
    out = sync.model(x)          # the module to run forward on
    loss.backward()
    sync.after_backward(step)    # gradients are ready for optimizer.step()
    optimizer.step()
    sync.after_step(step)        # parameters may be exchanged here
    sync.step_metrics()          # extra fields for this step's metrics.jsonl record
    sync.summary()               # extra fields for summary.json
"""
from __future__ import annotations

import warnings

from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from edgetrain.comm.accounting import CommStats
from edgetrain.comm.allreduce import AllReduceState, allreduce_hook


class Synchronous:
    """Synchronous data parallelism with DDP; one device runs the bare model."""

    def __init__(self, model: nn.Module, world_size: int, stats: CommStats, hook=None, hook_state=None,
                 broadcast_buffers: bool = True, bucket_cap_mb: float = 25.0):
        self.stats = stats
        if world_size > 1:
            # broadcast_buffers is DDP's default (rank 0's BatchNorm buffers win each step);
            # with cross-device BatchNorm the buffers already agree and the trainer turns it off.
            with warnings.catch_warnings():  # torch 2.13 deprecates the name, not the behaviour we rely on
                warnings.simplefilter("ignore", FutureWarning)
                self.model = DDP(model, broadcast_buffers=broadcast_buffers, bucket_cap_mb=bucket_cap_mb)
            if hook is None:
                hook, hook_state = allreduce_hook, AllReduceState(stats=stats)
            self.model.register_comm_hook(hook_state, hook)
        else:
            self.model = model

    def after_backward(self, step: int) -> None:
        pass

    def after_step(self, step: int) -> None:
        pass

    def step_metrics(self) -> dict:
        return {}

    def summary(self) -> dict:
        return {"sync": "sync"}
