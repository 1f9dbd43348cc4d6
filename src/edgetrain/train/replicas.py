"""The exchange between the replicas of a pooled strategy (fsdp or pipeline with replicas).

Each device holds one part of its replica (a shard, or a stage) and exchanges it with the devices holding
the same part in the other replicas (its ``group``): every step, its gradients (``--sync sync``), or every
``H`` steps DiLoCo's pseudo-gradient (``--sync diloco:H`` / ``local:H``), through ``--compress``.

Design: docs/design/fsdp.md (Replicas), docs/design/pipeline.md (Hybrid)
"""
from __future__ import annotations

import time

import torch

from edgetrain.comm.exchange import Channel
from edgetrain.comm.local_sgd import outer_optimizer, outer_step
from edgetrain.comm.params import flatten, unflatten
from edgetrain.spec import SyncSpec


class ReplicaExchange:
    """This device's part of its replica, averaged with the same part of the other replicas.

    ``params``: this device's parameters, in a stable order, each named (``names``: the error feedback is kept
    per name), ``local(param)`` its local tensor (a DTensor's local shard, or a stage's parameter); ``channel``:
    how they travel between the replicas. ``sent`` counts the bytes this device has sent to other replicas (the ``CommStats`` tally counts them too).
    """

    def __init__(self, params: list, local, names: tuple[str, ...], sync: SyncSpec, channel: Channel):
        self.params, self.local, self.names = params, local, names   # local(param) -> its local tensor
        self.channel = channel
        self.compressor, self.memory, self.emulator = channel.compressor, channel.memory, channel.emulator
        self.period = 1 if sync.kind.lockstep else sync.period
        self.every_step_gradients = sync.kind.lockstep
        self.sent = 0
        self.steps = self.averages = 0
        self.outer = None
        if not self.every_step_gradients:
            self.ref = flatten(self._tensors()).requires_grad_(sync.nesterov)
            if sync.nesterov:  # DiLoCo's outer step
                self.outer = outer_optimizer(self.ref, sync.outer_lr, sync.outer_momentum)

    def _tensors(self) -> list[torch.Tensor]:
        return [self.local(p) for p in self.params]

    def _average(self, x: torch.Tensor, key: str) -> torch.Tensor:
        before = self.emulator.stats.bytes_sent
        mean = self.channel.average(x, key, tuple(t.numel() for t in self._tensors()), self.names)
        self.sent += self.emulator.stats.bytes_sent - before
        return mean

    def after_backward(self) -> None:
        """``--sync sync``: each gradient replaced by its mean over the replicas (before the optimizer steps)."""
        if not self.every_step_gradients:
            return
        before = self.emulator.stats.bytes_sent
        allreduce_gradients(self.params, self.names, self.channel, self.local)
        self.sent += self.emulator.stats.bytes_sent - before

    def after_step(self) -> bool:
        """After the optimizer's step: the outer step if this is the ``H``-th since the last; True if it ran."""
        if self.every_step_gradients:
            return False
        self.steps += 1
        if self.steps % self.period:
            return False
        self.outer_step()
        return True

    @torch.no_grad()
    def outer_step(self) -> None:
        """DiLoCo: the replicas' mean pseudo-gradient ``ref - x`` steps ``ref`` (plain: ``ref -= mean``; with
        Nesterov: the outer SGD), and every replica continues from the new ``ref``."""
        tensors = self._tensors()
        outer_step(self.ref, self._average(self.ref.detach() - flatten(tensors), "pseudo_gradient"), self.outer)
        unflatten(self.ref.detach(), tensors)
        self.averages += 1

    def finish(self) -> None:
        """The steps since the last outer step, averaged once more: the replicas end with the same model."""
        if not self.every_step_gradients and self.steps % self.period:
            self.outer_step()

    def state_dict(self, optimizer: torch.optim.Optimizer) -> dict:
        """What this device alone holds, for its own checkpoint file: between two outer steps the replicas differ,
        so its part of its replica (parameters and the optimizer's state over them) is here, besides DiLoCo's
        reference and outer momentum, the step in the round and the error feedback."""
        def own(value):
            return self.local(value).detach().clone() if isinstance(value, torch.Tensor) else value

        return {"params": [own(p) for p in self.params],
                "optimizer": [{k: own(v) for k, v in optimizer.state[p].items()} for p in self.params],
                "ref": None if self.every_step_gradients else self.ref.detach().clone(),
                "outer": self.outer.state_dict() if self.outer else None,
                "steps": self.steps, "averages": self.averages, "sent": self.sent,
                "compressor": self.compressor.state_dict(), "memory": self.memory.state_dict()}

    @torch.no_grad()
    def load_state_dict(self, state: dict, optimizer: torch.optim.Optimizer) -> None:
        """``state_dict``'s, after the shared checkpoint (which holds one replica's model and optimizer) was read."""
        for p, value, saved in zip(self.params, state["params"], state["optimizer"], strict=True):
            self.local(p).copy_(value)
            for key, tensor in saved.items():
                mine = optimizer.state[p].get(key)
                if isinstance(mine, torch.Tensor):
                    self.local(mine).copy_(tensor)
                else:
                    optimizer.state[p][key] = tensor
        if state["ref"] is not None:
            self.ref.copy_(state["ref"])
        if self.outer is not None:
            self.outer.load_state_dict(state["outer"])
        self.steps, self.averages, self.sent = state["steps"], state["averages"], state["sent"]
        self.compressor.load_state_dict(state["compressor"])
        self.memory.load_state_dict(state["memory"])

    def timed(self, run) -> tuple[bool, float, float]:
        """``run()`` (an exchange) timed: (its result, seconds computing outside the collectives, modelled
        link seconds charged), for a strategy that builds its own step clock (train/pipeline.py)."""
        blocked, modelled = self.emulator.step_charged()
        started = time.perf_counter()
        result = run()
        seconds = time.perf_counter() - started
        blocked_now, modelled_now = self.emulator.step_charged()
        return result, max(0.0, seconds - (blocked_now - blocked)), modelled_now - modelled

    def summary(self) -> dict:
        return {"between_replicas": "gradients every step" if self.every_step_gradients
                else f"pseudo-gradient every {self.period} steps", "outer_steps": self.averages,
                "replica_bytes_sent": self.sent}


def replica_part(exchange: ReplicaExchange | None, optimizer, final: bool) -> dict:
    """A pooled strategy's ``sharded_state`` part of what this device alone holds (during the run, with replicas):
    no tensor at its top, so the checkpoint keeps it in the device's own file (``checkpoint.split_sharded``)."""
    return {} if exchange is None or final else {"replica": {"state": exchange.state_dict(optimizer)}}


def load_replica_part(exchange: ReplicaExchange | None, state: dict, optimizer) -> None:
    if exchange is not None and state.get("replica"):
        exchange.load_state_dict(state["replica"]["state"], optimizer)


def allreduce_gradients(params: list, names: tuple[str, ...], channel: Channel, local=lambda t: t) -> None:
    """Replace each parameter's gradient (``local``: its local tensor) by its mean over the ``channel``'s group
    (one part's replicas) through ``comm.exchange.average``: the run's compressor, error feedback kept per
    parameter name, bytes counted and the collective charged to its emulator. Every device of the group gets
    the same mean."""
    for p in params:
        if p.grad is None:  # a parameter this step did not reach: a zero gradient, as DDP all-reduces it
            p.grad = torch.zeros_like(p)
    grads = [local(p.grad) for p in params]
    mean = channel.average(flatten(grads), "gradients", tuple(g.numel() for g in grads), names)
    unflatten(mean, grads)
