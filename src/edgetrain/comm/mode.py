"""The interface of a sync mode (``SyncMode``, abstract), and the clock and byte tally every mode keeps
(``DeviceClock``).

The strategy drives a ``SyncMode`` at fixed points of every step (``trains``, ``model``, ``after_backward``,
``after_step``, ``step_metrics``; ``settle``, ``finish``, ``summary``, ``state_dict``, ``close``). A mode
defines ``after_step`` (its exchange, if one is due, then the end of the step on the clock) and overrides
only what it changes of the rest. A mode that averages the model itself hands the base its ``Averaging``
(``SyncSetup.averaging``), and the base starts every device from rank 0's model.

Design: docs/design/strategies.md ("Sync modes")
"""
from __future__ import annotations

import abc
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn

from edgetrain.cluster.peers import all_gather_json, wait
from edgetrain.comm.accounting import CommStats, ring_allreduce_bytes
from edgetrain.comm.emulation import LinkEmulator
from edgetrain.comm.exchange import Channel
from edgetrain.comm.params import broadcast_model

if TYPE_CHECKING:
    from edgetrain.spec import SyncSpec

_CLOCK = ("virtual_s", "compute_s", "comm_model_s", "comm_blocked_s", "steps", "collectives")  # LinkEmulator's
_TALLY = ("bytes_sent", "bytes_recv", "collectives", "comm_s")  # CommStats'


def _renamed(key: object, names: dict) -> object:
    """``key`` with every part found in ``names`` replaced (memory keys: a parameter, or a tuple of them)."""
    if isinstance(key, tuple):
        return tuple(_renamed(k, names) for k in key)
    return names.get(key, key)


@dataclass(frozen=True)
class Averaging:
    """How a mode that averages the model itself sends it: this device's ``rank``, the ``group`` of the
    averaging traffic, ``--compress``'s compressor and its error-feedback ``memory``, and the
    ``secagg.SecureSum`` that masks the sums (None: sums in the clear)."""

    rank: int
    group: object
    compressor: object
    memory: object
    secure: object = None


class DeviceClock:
    """The device's clock, its byte tally against fp32 all-reduce, and the report: what every sync mode keeps.
    Alone, the clock of a strategy whose exchanges are its own (fsdp, pipeline), which charges them to
    ``emulator`` and ends each step with ``after_step``."""

    secure = None  # a ``secagg.SecureSum`` masking the mode's sums (--secure-aggregation)

    def __init__(self, model: nn.Module, world_size: int, emulator: LinkEmulator, clock_group=None,
                 spec: SyncSpec | str = "sync", compress: str = "none"):
        # ``spec``: the mode's SyncSpec (comm.setup), or the label a strategy's own exchanges are reported as
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

    def after_step(self, step: int) -> None:
        """The step's exchanges are over: it ends when the latest device has arrived."""
        self._close_step(self._max_clock(self.emulator.arrive()))

    def step_metrics(self) -> dict:
        """Extra fields for this step's ``StepRecord``: the device clock (``virtual_s``, ``virtual_compute_s``,
        ``virtual_comm_s``) and what the mode adds."""
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
        """The clock and the byte tally (a resumed run's summary covers the whole run); modes add their own."""
        return {"clock": {k: getattr(self.emulator, k) for k in _CLOCK},
                "tally": {k: getattr(self.stats, k) for k in _TALLY}}

    def load_state_dict(self, state: dict) -> None:
        for k, v in state["clock"].items():
            setattr(self.emulator, k, v)
        for k, v in state["tally"].items():
            setattr(self.stats, k, v)

    def summary(self) -> dict:
        """Extra fields for summary.json; modes add their own."""
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

    # -- for the modes: the clock ---------------------------------------------------------
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
        """End the step on the clock (``ready_s``: when its exchange was ready, virtual mode); ``extra``: fields
        of the step's record."""
        step = self.emulator.finish_step(ready_s)
        # names distinct from the training loop's own comm_s / compute_s, which they would overwrite
        self._metrics = {"virtual_s": step["virtual_s"], "virtual_compute_s": step["compute_s"],
                         "virtual_comm_s": step["comm_model_s"], **extra}


class SyncMode(DeviceClock, abc.ABC):
    """How devices agree on the model: one object per device, wrapping its model, that the strategy calls at
    fixed points of every step (docs/design/strategies.md gives the order). A mode defines ``after_step``;
    the other hooks' defaults suit a mode whose devices train every step and exchange within it."""

    model: nn.Module                 # the module to run forward on (DDP's wrapper, or the model itself)
    averages = 0                     # rounds averaged so far (the round-based modes count them)
    reset_client_optimizer = False   # fedavg:E:reset: the strategy clears its optimizer when ``averages`` moves

    def __init__(self, model: nn.Module, world_size: int, emulator: LinkEmulator,
                 averaging: Averaging | None = None, clock_group=None, spec: SyncSpec | str = "sync",
                 compress: str = "none"):
        super().__init__(model, world_size, emulator, clock_group, spec, compress)
        self.model = model
        self._param_names = {id(p): name for name, p in model.named_parameters()}
        self._hooks: list = []  # handles of the hooks put on the caller's model, removed by ``close``
        if averaging is not None:
            self.rank, self.group = averaging.rank, averaging.group
            self.compressor, self.memory, self.secure = averaging.compressor, averaging.memory, averaging.secure
            self._start_together(model, self.group)
            self._watch(model)

    # -- what a mode defines -----------------------------------------------------------------
    @abc.abstractmethod
    def after_step(self, step: int) -> None:
        """At the end of every step, on every device (a step it sat out too): the mode's exchange if one is
        due, then ``_close_step`` with the clock at which it was ready."""

    # -- what a mode may override ----------------------------------------------------------
    def trains(self, step: int) -> bool:
        """Whether this device trains this step (False: it sits the step out, see local_sgd.py's rounds)."""
        return True

    def after_backward(self, step: int) -> None:
        """Gradients are ready; the optimizer steps after this."""

    def settle(self, before: str) -> None:
        """Every device, before a collective that is not the mode's own (``before``: evaluation, a checkpoint):
        end what the mode exchanges in the background, so that no device waits there for a peer waiting in
        an exchange (asynchronous.py). Nothing for a mode whose exchanges every device starts at the same
        steps and completes within them or at fixed later steps (streaming.py's)."""

    def set_samples(self, samples: int, loss_scale: float) -> None:
        """This device's training samples and loss scale; only federated rounds weighted by them use it."""

    # ``_final_exchange``, and ``state_dict``/``load_state_dict``/``summary`` extended through super(): above

    # -- shared --------------------------------------------------------------------------------
    def close(self) -> None:
        """Take this mode's hooks off the model, which a new mode is about to wrap (elastic membership)."""
        for handle in self._hooks:
            handle.remove()
        self._hooks.clear()

    @property
    def channel(self) -> Channel:
        """How the mode's averages travel (``exchange.average``): its compressor and memory, over its group,
        masked by its secure sum if it has one."""
        return Channel(self.compressor, self.memory, self.emulator, self.group, secure=self.secure)

    def _start_together(self, model: nn.Module, group=None) -> None:
        """Every device starts from rank 0's model; keep the trainable parameters the mode exchanges."""
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.segments = tuple(p.numel() for p in self.params)
        if self.world_size > 1:
            broadcast_model(model, self.emulator, group)

    def _watch(self, module: nn.Module) -> None:
        """A step starts at ``module``'s first training-mode forward."""
        self._hooks.append(module.register_forward_pre_hook(self._on_forward))

    def _on_forward(self, module: nn.Module, args) -> None:
        if module.training and torch.is_grad_enabled():
            self.emulator.start_step()

    def _global_rank(self, rank: int) -> int:
        """The global rank of ``self.group``'s member ``rank`` (point-to-point operations take global ranks)."""
        return rank if self.group is None else dist.get_global_rank(self.group, rank)

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
