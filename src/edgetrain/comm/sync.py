"""Synchronous data parallelism (``--sync sync``, the default): DDP averages the gradients during backward.

By DDP's own all-reduce when nothing is compressed, masked or charged to an emulated link (bytes counted
from the gradient sizes, ``comm_busy_s`` not measured: see ``Synchronous``), else through a communication
hook (``comm/hook.py``, or the compressor's own, PowerSGD's). With DP-SGD (``--dp``) the gradients are
averaged after backward instead, once each sample's is clipped and the noise added.

The interface every mode implements is ``mode.py``'s ``SyncMode``; the other modes live beside this one
(``local_sgd.py``, ``asynchronous.py``, ``streaming.py``, ``gossip.py``, ``federated.py``) and
``edgetrain.comm.build_sync`` picks one.

Design: docs/design/strategies.md ("Sync modes")
"""
from __future__ import annotations

import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from edgetrain.comm.accounting import ring_allreduce_bytes
from edgetrain.comm.allreduce import allreduce_hook
from edgetrain.comm.compress.powersgd import PowerSGDHookState
from edgetrain.comm.emulation import LinkEmulator
from edgetrain.comm.exchange import average
from edgetrain.comm.hook import CompressionState
from edgetrain.comm.mode import Averaging, SyncMode
from edgetrain.comm.params import average_buffers, flatten, unflatten
from edgetrain.comm.setup import build_hook
from edgetrain.kinds import named_by_kind

if TYPE_CHECKING:
    from edgetrain.comm.setup import SyncSetup


@dataclass(frozen=True)
class GradientHook:
    """A DDP communication hook (``setup.build_hook``): the function ``fn``, its ``state``, and the
    ``secagg.SecureSum`` its sums are masked with (None: in the clear)."""

    fn: Callable
    state: object
    secure: object = None


@named_by_kind("sync", builder="build")
class Synchronous(SyncMode):
    """Synchronous data parallelism with DDP; one device runs the bare model.

    ``hook``: a DDP communication hook and its state (``build_sync`` passes
    edgetrain's compression or PowerSGD hook, sharing ``emulator``; the
    overlapping ``allreduce_hook`` where no link is emulated). Without
    one, DDP's own all-reduce averages the gradients: nothing of edgetrain's
    runs inside backward. Its traffic is then counted, not observed: DDP
    all-reduces every gradient exactly once per step, so each step adds
    ``ring_allreduce_bytes(gradient bytes)``, the same total the accounted fp32
    hook counts. Its time is measured only in part: a hook on each gradient
    marks when the last one is ready, which is when DDP launches its last
    bucket; the loop's ``comm_s`` (the wait backward did not hide) runs from
    there. How long the all-reduces ran in all (``comm_busy_s``) is not
    measured on this path and is reported as ``None``.

    On both overlapping paths (no hook, ``allreduce_hook``) the device clock's
    blocked time, hence ``comm_time_s`` in the summary, is that same unhidden
    wait, measured in ``after_backward``.
    """

    def __init__(self, model: nn.Module, world_size: int, emulator: LinkEmulator, averaging: Averaging | None = None,
                 hook: GradientHook | None = None, broadcast_buffers: bool = True, bucket_cap_mb: float = 25.0,
                 **common):
        # DP-SGD (--dp) passes ``averaging``: the gradients are averaged once backward is over and each sample's
        # has been clipped and the noise added (train/strategy.py), through ``exchange.average`` with its
        # compressor, memory and secure sum, not by DDP during backward
        self.gradients_after_backward = averaging is not None and world_size > 1
        super().__init__(model, world_size, emulator, averaging if self.gradients_after_backward else None, **common)
        self._buffer_group = self.clock_group
        hook_fn, self.hook_state, secure = (hook.fn, hook.state, hook.secure) if hook else (None, None, None)
        if self.gradients_after_backward:
            self.ddp_allreduce = self.overlapping = False
            return
        self.secure = secure
        self.ddp_allreduce = world_size > 1 and hook_fn is None
        # collectives that run during backward instead of blocking in the hook
        self.overlapping = self.ddp_allreduce or (world_size > 1 and hook_fn is allreduce_hook)
        if world_size > 1:
            # broadcast_buffers is DDP's default (rank 0's BatchNorm buffers win each step);
            # with cross-device BatchNorm the buffers already agree and the trainer turns it off.
            with warnings.catch_warnings():  # torch 2.13 deprecates the name, not the behaviour we rely on
                warnings.simplefilter("ignore", FutureWarning)
                self.model = DDP(model, broadcast_buffers=broadcast_buffers, bucket_cap_mb=bucket_cap_mb)
            if hook_fn is not None:
                self.model.register_comm_hook(self.hook_state, hook_fn)
        if self.ddp_allreduce:
            gradient_bytes = sum(p.numel() * p.element_size() for p in self.params_with_grad(model))
            self._ddp_step_bytes = ring_allreduce_bytes(gradient_bytes, world_size)
            self._last_gradient_s = 0.0
            for p in self.params_with_grad(model):
                self._hooks.append(p.register_post_accumulate_grad_hook(self._gradient_ready))
        self._watch(self.model)

    def after_step(self, step: int) -> None:
        """The gradients were averaged within the step: it ends when the latest device has arrived."""
        self._close_step(self._max_clock(self.emulator.arrive()))

    def _final_exchange(self) -> None:
        """Masked sums leave BatchNorm's running statistics on each device (no broadcast of rank 0's each step,
        which would show its data's statistics): their mean, masked too, once at the end."""
        if self.secure is not None:
            average_buffers(self.model, self.emulator, self.world_size, self._buffer_group, self.secure)

    def state_dict(self) -> dict:
        state = super().state_dict()
        if isinstance(self.hook_state, CompressionState):
            state["codec"] = self._codec_state(self.hook_state.compressor, self.hook_state.memory)
        elif isinstance(self.hook_state, PowerSGDHookState):
            state["powersgd"] = self.hook_state.state_dict(self._param_names)
        return state

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        if "codec" in state:
            self._load_codec_state(self.hook_state.compressor, self.hook_state.memory, state["codec"])
        if "powersgd" in state:
            self.hook_state.load_state_dict(state["powersgd"], {name: i for i, name in self._param_names.items()})

    @staticmethod
    def params_with_grad(model: nn.Module) -> list[nn.Parameter]:
        return [p for p in model.parameters() if p.requires_grad]

    def _gradient_ready(self, param: torch.Tensor) -> None:
        self._last_gradient_s = time.perf_counter()

    def after_backward(self, step: int) -> None:
        if self.gradients_after_backward:
            self._average_gradients()
        if self.ddp_allreduce:
            self.stats.counted(self._ddp_step_bytes, launched_at=self._last_gradient_s)
        if self.overlapping:  # the clock's blocked time: the wait backward did not hide, from the last launch
            self.emulator.blocked(max(0.0, time.perf_counter() - self.stats.last_launch))

    def _average_gradients(self) -> None:
        """Every device's gradients replaced by their mean over the devices (fp32, one exchange)."""
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.params]
        mean = average(flatten(grads), self.channel, key="gradients", segments=self.segments)
        for p, g in zip(self.params, grads):
            p.grad = g
        unflatten(mean, grads)

    def step_metrics(self) -> dict:
        metrics = super().step_metrics()
        if self.ddp_allreduce:
            metrics["comm_busy_s"] = None  # DDP's own all-reduce: not measured (see the class docstring)
        return metrics


def build(setup: SyncSetup) -> Synchronous:
    """``--sync sync``: DDP, through the compressor's hook where there is one to run."""
    spec, hook = setup.spec, None
    secure = setup.secure_sum()
    if spec.dp is not None and spec.dp.per_sample and setup.distributed:
        # DP-SGD: the gradients are averaged after per-sample clipping and noise, not by DDP during backward
        return Synchronous(setup.model, setup.world_size, setup.emulator, setup.averaging(masked=True),
                           **setup.common)
    # uncompressed, no link to charge and nothing to mask: no hook, DDP's own all-reduce (Synchronous counts its
    # bytes)
    if setup.distributed and (not spec.compress.kind.plain or setup.emulator.links is not None or secure):
        state, fn = build_hook(spec.compress, setup.emulator, setup.link, spec.seed, secure=secure)
        hook = GradientHook(fn, state, secure)
    # DDP's broadcast of rank 0's buffers each step is off with cross-device BatchNorm (they agree already) and
    # with secure aggregation (they would show rank 0's statistics; averaged masked at the end instead)
    ddp_kwargs = {"broadcast_buffers": spec.batchnorm != "sync" and secure is None, **setup.ddp_kwargs}
    return Synchronous(setup.model, setup.world_size, setup.emulator, hook=hook, **setup.common, **ddp_kwargs)
