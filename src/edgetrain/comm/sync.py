"""How devices agree on the model each step.

A sync object wraps the model for one worker and is called by the training
loop at fixed points of every step. The default, ``Synchronous``, is plain DDP:
gradients are averaged during backward, by DDP's own all-reduce when nothing
is compressed and no link is emulated (bytes counted from the gradient sizes,
``comm_busy_s`` not measured: see the class), else through a communication
hook (compressed, or charging an emulated link). The other modes live beside it: ``local_sgd.py``,
``asynchronous.py``, ``gossip.py``; ``edgetrain.comm.build_sync`` picks one.

Interface the training loop's ``DataParallel`` strategy (train/strategy.py)
relies on, inside its ``train_step``, ``finish`` and ``summary``::

    sync = build_sync(model, cfg, rank, world_size, stats, link)
    if not sync.trains(step):    # a step this device sits out (rounds, local_sgd.py): no forward,
        sync.after_step(step)    # backward or optimizer step; the step's exchange still runs
        ...                      # (and nothing below)
    out = sync.model(x)          # the module to run forward on
    loss.backward()
    sync.after_backward(step)    # gradients are ready for optimizer.step()
    optimizer.step()
    sync.after_step(step)        # parameters may be exchanged here
    sync.step_metrics()          # extra fields for this step's StepRecord (records.py):
                                 # virtual_s (the device's clock), virtual_compute_s, virtual_comm_s
                                 # (modelled in virtual mode, measured otherwise), staleness (async)
    ...
    sync.settle(before)          # every device, before evaluation or a checkpoint: no background
                                 # exchange left that a peer could wait on (asynchronous.py)
    sync.finish()                # every device, after the last step: final exchange
    sync.summary()               # extra fields for summary.json
    sync.state_dict()            # for a checkpoint (train/checkpoint.py); load_state_dict after setup

State for checkpoints: every mode holds the device clock and byte tally (so a
resumed run's summary covers the whole run), plus its own: the compression
hook's error-feedback memory and compressor counters, or PowerSGD's state
(sync), the reference model, outer optimizer and step counters (local SGD),
the reference model, counters and the round in flight (async), counters
(gossip).
Memory is keyed by parameter identity in a process (``compress/memory.py``);
a checkpoint keys it by parameter name instead.

Every mode keeps the device's clock (``emulation.LinkEmulator``): a step
starts at the first training-mode forward of ``sync.model`` and ends in
``after_step``; evaluation forwards (``model.eval()`` or ``no_grad``) and
the time between steps (data loading, logging) are not counted.

Traffic that is not counted: DDP's buffer broadcast (``broadcast_buffers``)
and the statistics of cross-device BatchNorm travel outside the hooks.
"""
from __future__ import annotations

import time
import warnings
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from edgetrain.cluster.peers import all_gather_json, wait
from edgetrain.comm.accounting import CommStats, ring_allreduce_bytes
from edgetrain.comm.allreduce import allreduce_hook
from edgetrain.comm.compress.powersgd import PowerSGDHookState
from edgetrain.comm.emulation import LinkEmulator
from edgetrain.comm.hook import CompressionState
from edgetrain.comm.exchange import average
from edgetrain.comm.params import average_buffers, broadcast_model, flatten, unflatten
from edgetrain.kinds import named_by_kind

if TYPE_CHECKING:
    from edgetrain.comm.setup import SyncSetup
    from edgetrain.spec import SyncSpec

_CLOCK = ("virtual_s", "compute_s", "comm_model_s", "comm_blocked_s", "steps", "collectives")  # LinkEmulator's
_TALLY = ("bytes_sent", "bytes_recv", "collectives", "comm_s")  # CommStats'


def _renamed(key: object, names: dict) -> object:
    """``key`` with every part found in ``names`` replaced (memory keys: a parameter, or a tuple of them)."""
    if isinstance(key, tuple):
        return tuple(_renamed(k, names) for k in key)
    return names.get(key, key)


class SyncMode:
    """What every mode shares: the clock, the byte tally against fp32 all-reduce, the report."""

    averages = 0                     # rounds averaged so far (the round-based modes count them)
    secure = None                    # a ``secagg.SecureSum`` masking the mode's sums (--secure-aggregation)
    reset_client_optimizer = False   # fedavg:E:reset: the strategy clears its optimizer when ``averages`` moves

    def set_samples(self, samples: int, loss_scale: float) -> None:
        """This device's training samples and loss scale; only federated rounds weighted by them use it."""

    def __init__(self, model: nn.Module, world_size: int, emulator: LinkEmulator, clock_group=None,
                 spec: SyncSpec | str = "sync", compress: str = "none"):
        # ``spec``: the mode's SyncSpec (comm.setup), or what a strategy's own exchanges or a mode built without
        # one are reported as
        self.world_size = world_size
        self.emulator = emulator
        self.stats: CommStats = emulator.stats
        self.clock_group = clock_group
        self.spec = spec
        self.compress = compress
        numel = sum(p.numel() for p in model.parameters() if p.requires_grad)
        self.fp32_step_bytes = ring_allreduce_bytes(4 * numel, world_size)
        self._metrics: dict = {}
        self._devices: list[dict] | None = None
        self._param_names = {id(p): name for name, p in model.named_parameters()}
        self._hooks: list = []  # handles of the hooks put on the caller's model, removed by ``close``

    def _start_together(self, model: nn.Module, group=None) -> None:
        """Every device starts from rank 0's model; keep the trainable parameters the mode exchanges."""
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.segments = tuple(p.numel() for p in self.params)
        if self.world_size > 1:
            broadcast_model(model, self.emulator, group)

    def _watch(self, module: nn.Module) -> None:
        self._hooks.append(module.register_forward_pre_hook(self._on_forward))

    def close(self) -> None:
        """Take this mode's hooks off the model, which a new mode is about to wrap (elastic membership)."""
        for handle in self._hooks:
            handle.remove()
        self._hooks.clear()

    def _on_forward(self, module: nn.Module, args) -> None:
        if module.training and torch.is_grad_enabled():
            self.emulator.start_step()

    def _max_clock(self, arrived: float) -> float:
        """The latest arrival among all devices (virtual mode; a real all-reduce, not charged as traffic)."""
        if not self.emulator.virtual or self.world_size == 1:
            return arrived
        started = time.perf_counter()
        t = torch.tensor([arrived], dtype=torch.float64)
        wait(dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.clock_group, async_op=True),
             self.emulator.timeout_s, "clock all-reduce")
        self.emulator.blocked(time.perf_counter() - started)
        return float(t.item())

    def _close_step(self, ready_s: float | None = None, **extra) -> None:
        step = self.emulator.finish_step(ready_s)
        # names distinct from the training loop's own comm_s / compute_s, which they would overwrite
        self._metrics = {"virtual_s": step["virtual_s"], "virtual_compute_s": step["compute_s"],
                         "virtual_comm_s": step["comm_model_s"], **extra}

    # -- interface ------------------------------------------------------------------
    def trains(self, step: int) -> bool:
        """Whether this device trains this step (False: it sits the step out, see local_sgd.py's rounds)."""
        return True

    def after_backward(self, step: int) -> None:
        pass

    def settle(self, before: str) -> None:
        """Every device, before a collective that is not the mode's own (``before``: evaluation, a checkpoint):
        end what the mode exchanges in the background, so that no device waits there for a peer waiting in
        an exchange (asynchronous.py). Nothing for a mode whose exchanges every device starts at the same
        steps and completes within them or at fixed later steps (streaming.py's)."""

    def after_step(self, step: int) -> None:
        self._close_step(self._max_clock(self.emulator.arrive()))

    def step_metrics(self) -> dict:
        return dict(self._metrics)

    def finish(self) -> None:
        """After the last step, on every device (collectives): the mode's final exchange, then every
        device's totals for the summary. Calling it again does nothing."""
        if self._devices is not None:
            return
        if self.world_size > 1:
            self._final_exchange()
        mine = {"bytes_sent": self.stats.bytes_sent, "virtual_time_s": self.emulator.virtual_s}
        if self.world_size > 1 and dist.is_initialized():
            self._devices = all_gather_json(mine, group=self.clock_group)  # JSON, not pickles: see cluster/peers
        else:
            self._devices = [mine]

    def _final_exchange(self) -> None:
        """What the mode must still send so that every device ends with the same model."""

    def state_dict(self) -> dict:
        """What a resumed run needs of this mode (see the module docstring); modes add their own."""
        return {"clock": {k: getattr(self.emulator, k) for k in _CLOCK},
                "tally": {k: getattr(self.stats, k) for k in _TALLY}}

    def load_state_dict(self, state: dict) -> None:
        for k, v in state["clock"].items():
            setattr(self.emulator, k, v)
        for k, v in state["tally"].items():
            setattr(self.stats, k, v)

    def _codec_state(self, compressor, memory) -> dict:
        """The compressor's counters and the memory's state, keyed by parameter name."""
        kept = {store: {_renamed(k, self._param_names): v for k, v in parts.items()}
                for store, parts in memory.state_dict().items()}
        return {"compressor": compressor.state_dict(), "memory": kept}

    def _load_codec_state(self, compressor, memory, state: dict) -> None:
        ids = {name: i for i, name in self._param_names.items()}
        compressor.load_state_dict(state["compressor"])
        memory.load_state_dict({store: {_renamed(k, ids): v for k, v in parts.items()}
                                for store, parts in state["memory"].items()})

    def summary(self) -> dict:
        steps = max(1, self.emulator.steps)
        sent = self.stats.bytes_sent
        out = {
            "sync": getattr(self.spec, "text", self.spec),  # a SyncSpec, or the label of a strategy's own
            "compress": self.compress,
            "link": ", ".join(sorted({l.describe() for l in self.emulator.links})) if self.emulator.links else None,
            "sync_steps": self.emulator.steps,
            "bytes_sent_per_device": sent,
            "bytes_per_step_per_device": sent / steps,
            "fp32_allreduce_bytes_per_step": self.fp32_step_bytes,
            "compression_ratio": (self.fp32_step_bytes * self.emulator.steps / sent) if sent else None,
            **self.emulator.summary(),
        }
        if self.secure is not None:
            out["secure_aggregation"] = self.secure.summary()
        if self._devices:
            out["bytes_sent_max_device"] = max(d["bytes_sent"] for d in self._devices)
            out["virtual_time_max_device_s"] = max(d["virtual_time_s"] for d in self._devices)
        return out


@named_by_kind("sync", builder="build")
class Synchronous(SyncMode):
    """Synchronous data parallelism with DDP; one device runs the bare model.

    ``hook``/``hook_state``: a DDP communication hook (``build_sync`` passes
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

    def __init__(self, model: nn.Module, world_size: int, stats: CommStats | None = None, hook=None,
                 hook_state=None, broadcast_buffers: bool = True, bucket_cap_mb: float = 25.0,
                 emulator: LinkEmulator | None = None, clock_group=None, spec: str = "sync",
                 compress: str = "none", secure=None, after_backward_codec: tuple | None = None, group=None):
        if emulator is None:
            emulator = LinkEmulator(None, dist.get_rank() if dist.is_initialized() else 0, stats)
        super().__init__(model, world_size, emulator, clock_group, spec, compress)
        # DP-SGD (--dp): the gradients are averaged once backward is over and each sample's has been clipped and
        # the noise added (train/strategy.py), through ``exchange.average`` with this (compressor, memory), not
        # by DDP during backward
        self.after_backward_codec = after_backward_codec if world_size > 1 else None
        self.secure = secure
        self._buffer_group = clock_group
        if self.after_backward_codec is not None:
            self.group = group
            self._start_together(model, group)
            self.model = model
            self.ddp_allreduce = self.overlapping = False
            self.hook_state = None
            self._watch(self.model)
            return
        self.ddp_allreduce = world_size > 1 and hook is None
        # collectives that run during backward instead of blocking in the hook
        self.overlapping = self.ddp_allreduce or (world_size > 1 and hook is allreduce_hook)
        if world_size > 1:
            # broadcast_buffers is DDP's default (rank 0's BatchNorm buffers win each step);
            # with cross-device BatchNorm the buffers already agree and the trainer turns it off.
            with warnings.catch_warnings():  # torch 2.13 deprecates the name, not the behaviour we rely on
                warnings.simplefilter("ignore", FutureWarning)
                self.model = DDP(model, broadcast_buffers=broadcast_buffers, bucket_cap_mb=bucket_cap_mb)
            if hook is not None:
                self.model.register_comm_hook(hook_state, hook)
        else:
            self.model = model
        if self.ddp_allreduce:
            gradient_bytes = sum(p.numel() * p.element_size() for p in self.params_with_grad(model))
            self._ddp_step_bytes = ring_allreduce_bytes(gradient_bytes, world_size)
            self._last_gradient_s = 0.0
            for p in self.params_with_grad(model):
                self._hooks.append(p.register_post_accumulate_grad_hook(self._gradient_ready))
        self.hook_state = hook_state
        self.secure = secure
        self._buffer_group = clock_group
        self._watch(self.model)

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
        if self.after_backward_codec is not None:
            self._average_gradients()
        if self.ddp_allreduce:
            self.stats.counted(self._ddp_step_bytes, launched_at=self._last_gradient_s)
        if self.overlapping:  # the clock's blocked time: the wait backward did not hide, from the last launch
            self.emulator.blocked(max(0.0, time.perf_counter() - self.stats.last_launch))

    def _average_gradients(self) -> None:
        """Every device's gradients replaced by their mean over the devices (fp32, one exchange)."""
        compressor, memory = self.after_backward_codec
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.params]
        mean = average(flatten(grads), compressor, memory, self.emulator, key="gradients", group=self.group,
                       segments=self.segments, secure=self.secure)
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
    from edgetrain.comm.setup import build_hook

    spec, hook, state = setup.spec, None, None
    secure = setup.secure_sum()
    if spec.dp is not None and spec.dp.per_sample and setup.distributed:
        # DP-SGD: the gradients are averaged after per-sample clipping and noise, not by DDP during backward
        return Synchronous(setup.model, setup.world_size, emulator=setup.emulator, secure=secure,
                           after_backward_codec=setup.compressor(), group=setup.averaging_group(), **setup.common)
    # uncompressed, no link to charge and nothing to mask: no hook, DDP's own all-reduce (Synchronous counts its
    # bytes)
    if setup.distributed and (not spec.compress.kind.plain or setup.emulator.links is not None or secure):
        state, hook = build_hook(spec.compress, setup.emulator, setup.link, spec.seed, secure=secure)
    # DDP's broadcast of rank 0's buffers each step is off with cross-device BatchNorm (they agree already) and
    # with secure aggregation (they would show rank 0's statistics; averaged masked at the end instead)
    ddp_kwargs = {"broadcast_buffers": spec.batchnorm != "sync" and secure is None, **setup.ddp_kwargs}
    return Synchronous(setup.model, setup.world_size, hook=hook, hook_state=state, emulator=setup.emulator,
                       secure=secure, **setup.common, **ddp_kwargs)
