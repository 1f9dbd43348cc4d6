"""The exchange between the replicas of a pooled strategy (fsdp or pipeline with replicas).

Each device holds one part of its replica (a shard, or a stage) and exchanges it with the devices holding
the same part in the other replicas (its ``group``): every step, its gradients (``--sync sync``), or every
``H`` steps DiLoCo's pseudo-gradient (``--sync diloco:H`` / ``local:H``), through ``--compress``.

Design: docs/design/fsdp.md (Replicas), docs/design/pipeline.md (Hybrid)
"""
from __future__ import annotations

import time

import torch

from edgetrain.comm.emulation import LinkEmulator
from edgetrain.comm.exchange import average
from edgetrain.comm.params import flatten, unflatten
from edgetrain.spec import SyncSpec


class ReplicaExchange:
    """This device's part of its replica, averaged with the same part of the other replicas.

    ``tensors``: the local tensors of this device's parameters (a DTensor's local shard, or a stage's
    parameters), in a stable order, each named (``names``: the error feedback is kept per name);
    ``group``: the devices holding the same part in every replica; ``peers``: their global ranks.
    ``sent`` counts the bytes this device has sent to other replicas (the ``CommStats`` tally counts them too).
    """

    def __init__(self, params: list, local, names: tuple[str, ...], sync: SyncSpec, compressor, memory,
                 emulator: LinkEmulator, group, peers: list[int]):
        self.params, self.local, self.names = params, local, names   # local(param) -> its local tensor
        self.compressor, self.memory, self.emulator = compressor, memory, emulator
        self.group, self.peers = group, peers
        self.period = 1 if sync.kind.lockstep else sync.period
        self.every_step_gradients = sync.kind.lockstep
        self.sent = 0
        self.steps = self.averages = 0
        self.outer = None
        if not self.every_step_gradients:
            self.ref = flatten(self._tensors()).requires_grad_(sync.nesterov)
            if sync.nesterov:  # DiLoCo's outer step; momentum 0 is a plain outer SGD step (torch refuses Nesterov)
                self.outer = torch.optim.SGD([self.ref], lr=sync.outer_lr, momentum=sync.outer_momentum,
                                             nesterov=sync.outer_momentum > 0)

    def _tensors(self) -> list[torch.Tensor]:
        return [self.local(p) for p in self.params]

    def _average(self, x: torch.Tensor, key: str) -> torch.Tensor:
        before = self.emulator.stats.bytes_sent
        mean = average(x, self.compressor, self.memory, self.emulator, key=key, group=self.group,
                       segments=tuple(t.numel() for t in self._tensors()), names=self.names, peers=self.peers)
        self.sent += self.emulator.stats.bytes_sent - before
        return mean

    def after_backward(self) -> None:
        """``--sync sync``: each gradient replaced by its mean over the replicas (before the optimizer steps)."""
        if not self.every_step_gradients:
            return
        for p in self.params:
            if p.grad is None:  # a parameter this step did not reach: a zero gradient, as DDP all-reduces it
                p.grad = torch.zeros_like(p)
        grads = [self.local(p.grad) for p in self.params]
        unflatten(self._average(flatten(grads), "gradients"), grads)

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
        mean = self._average(self.ref.detach() - flatten(tensors), "pseudo_gradient")
        if self.outer is None:
            self.ref -= mean
        else:
            self.ref.grad = mean.to(self.ref.dtype)
            self.outer.step()
            self.ref.grad = None
        unflatten(self.ref.detach(), tensors)
        self.averages += 1

    def finish(self) -> None:
        """The steps since the last outer step, averaged once more: the replicas end with the same model."""
        if not self.every_step_gradients and self.steps % self.period:
            self.outer_step()

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
