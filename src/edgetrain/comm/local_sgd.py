"""Local SGD: every device trains alone for ``H`` steps, then the devices average their models.

Local SGD (Stich, ICLR 2019; Lin et al., "Don't Use Large Mini-Batches, Use
Local SGD", ICLR 2020) communicates ``H`` times less often than DDP. Every
device keeps ``ref``, the model of the last average (identical on all
devices). At an averaging step each device sends its *pseudo-gradient*
``ref - x`` through any compressor of ``edgetrain.comm.compress`` (with its
error feedback), and the devices step ``ref`` with the mean::

    plain:     ref = ref - mean(ref - x_i)          (= mean of the models)
    nesterov:  ref = outer SGD step on ref with gradient mean(ref - x_i),
               lr 0.7, momentum 0.9, Nesterov      (DiLoCo, Douillard et al. 2023)

then every device continues from ``ref``. Each device's optimizer keeps its
own state (momentum) across averages, as in the papers.

Parameters are averaged; floating-point buffers (BatchNorm running
statistics) stay local until ``finish``, which averages them once in fp32.
PowerSGD (a DDP gradient hook) and DGC momentum correction (a gradient
method) do not apply to model deltas and are refused by ``build_sync``.
"""
from __future__ import annotations

import torch
from torch import nn

from edgetrain.comm.compress.base import Compressor
from edgetrain.comm.emulation import LinkEmulator
from edgetrain.comm.exchange import average
from edgetrain.comm.params import average_buffers, flatten, unflatten
from edgetrain.comm.sync import SyncMode


class LocalSGD(SyncMode):
    name = "local"

    def __init__(self, model: nn.Module, world_size: int, emulator: LinkEmulator, period: int,
                 compressor: Compressor, memory, nesterov: bool = False, outer_lr: float = 0.7,
                 outer_momentum: float = 0.9, group=None, clock_group=None, spec: str = "local",
                 compress: str = "none"):
        if period < 1:
            raise ValueError(f"local SGD period must be >= 1, got {period}")
        super().__init__(model, world_size, emulator, clock_group, spec, compress)
        self.model = model
        self.period = period
        self.compressor, self.memory = compressor, memory
        self.group = group
        self._start_together(model, group)
        self.ref = flatten(self.params)
        self.outer = None
        if nesterov:
            self.ref.requires_grad_(True)
            self.outer = torch.optim.SGD([self.ref], lr=outer_lr, momentum=outer_momentum, nesterov=True)
        self.local_steps = 0
        self.averages = 0
        self._watch(model)

    def after_step(self, step: int) -> None:
        self.local_steps += 1
        if self.local_steps % self.period != 0:
            self._close_step(None, local_steps=self.local_steps % self.period)
            return
        ready = self._max_clock(self.emulator.arrive())
        self._average()
        self._close_step(ready, local_steps=0)

    def _average(self) -> None:
        x = flatten(self.params)
        pseudo_grad = average(self.ref.detach() - x, self.compressor, self.memory, self.emulator,
                              key="params", group=self.group, segments=self.segments)
        with torch.no_grad():
            if self.outer is None:
                self.ref -= pseudo_grad
            else:
                self.ref.grad = pseudo_grad
                self.outer.step()
                self.ref.grad = None
        unflatten(self.ref.detach(), self.params)
        self.averages += 1

    def _final_exchange(self) -> None:
        self.emulator.start_step()
        ready = self._max_clock(self.emulator.arrive())
        if self.local_steps % self.period != 0:  # steps since the last average: one more
            self._average()
        average_buffers(self.model, self.emulator, self.world_size, self.group)
        self.emulator.finish_step(ready, count=False)

    def state_dict(self) -> dict:
        return {**super().state_dict(), "codec": self._codec_state(self.compressor, self.memory),
                "ref": self.ref.detach().clone(), "outer": self.outer.state_dict() if self.outer else None,
                "local_steps": self.local_steps, "averages": self.averages}

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        self._load_codec_state(self.compressor, self.memory, state["codec"])
        with torch.no_grad():
            self.ref.copy_(state["ref"])
        if self.outer is not None:
            self.outer.load_state_dict(state["outer"])
        self.local_steps, self.averages = state["local_steps"], state["averages"]

    def summary(self) -> dict:
        return {**super().summary(), "averages": self.averages,
                "staleness_max_steps": self.period - 1}
