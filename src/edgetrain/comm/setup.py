"""What a sync mode is built from (``SyncSetup``), and the DDP gradient hook a compressor gives (``build_hook``).

``build_sync`` (``comm/__init__.py``) makes one ``SyncSetup`` per device and hands it to the sync mode's
builder, which its kind names (``edgetrain.kinds``); each mode's module has its own ``build(setup)``.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch.distributed as dist
from torch import nn

from edgetrain.comm.allreduce import AllReduceState, allreduce_hook
from edgetrain.comm.compress.memory import NoMemory
from edgetrain.comm.compress.spec import build_compressor
from edgetrain.comm.emulation import LinkEmulator
from edgetrain.comm.hook import CompressionState, compression_hook
from edgetrain.comm.mode import Averaging
from edgetrain.spec import CompressSpec, Link, RunSpec

# Imported inside functions: edgetrain.comm.secagg (cryptography, the secure-aggregation extra: only runs that
# mask import it).


def build_hook(spec: CompressSpec, emulator: LinkEmulator, link: Link | None = None, seed: int = 0,
               group=None, secure=None) -> tuple[object, object]:
    """The DDP (state, hook) pair for a compression spec: a hook of the compressor's own (PowerSGD), else
    ``allreduce.py``'s overlapping hook where the method allows (summable, no error feedback, no emulated
    link, nothing masked), else the blocking ``hook.py`` (with ``secure``, a ``secagg.SecureSum``: masked)."""
    if spec.kind.hook:
        return spec.kind.load_runtime()(spec, emulator, group)
    compressor, memory = build_compressor(spec, link, seed, emulator.rank)
    if compressor.summable and isinstance(memory, NoMemory) and not emulator.emulated and secure is None:
        # nothing to charge to a link and nothing to remember: let the all-reduce overlap backward
        return AllReduceState(group, emulator.stats, compressor), allreduce_hook
    return CompressionState(compressor, memory, emulator, group, secure), compression_hook


@dataclass
class SyncSetup:
    """One device's inputs to its sync mode's builder (every device builds at once: setup collectives)."""

    model: nn.Module
    spec: RunSpec
    rank: int
    world_size: int
    emulator: LinkEmulator
    link: Link | None             # this device's link (None: not emulated)
    distributed: bool
    clock_group: object           # the group of the clocks' and summaries' exchanges
    steps_per_epoch: int = 0      # turns fedavg:E's local epochs into steps
    ddp_kwargs: dict = field(default_factory=dict)
    _secure: object = None

    @property
    def common(self) -> dict:
        """The keyword arguments every ``SyncMode`` takes (besides the model, device count and emulator)."""
        return dict(clock_group=self.clock_group, spec=self.spec.sync, compress=self.spec.compress.text)

    def averaging(self, masked: bool = False) -> Averaging:
        """How a mode that averages the model sends it (``mode.Averaging``): a gloo group of its own for the
        averaging traffic (so that it never interleaves with other collectives), ``--compress``'s compressor and
        memory, and (``masked``: a mode whose sums --secure-aggregation masks) the secure sum. Setup
        collectives: every device calls it, once per mode."""
        group = dist.new_group(backend="gloo") if self.distributed else None
        compressor, memory = build_compressor(self.spec.compress, self.link, self.spec.seed, self.rank)
        return Averaging(self.rank, group, compressor, memory, self.secure_sum() if masked else None)

    def secure_sum(self):
        """The ``secagg.SecureSum`` of ``--secure-aggregation`` (keys agreed over the clock group: every device
        calls this, once per mode), or None: sums in the clear."""
        if not self.spec.secure_aggregation or not self.distributed:
            return None
        if self._secure is None:
            from edgetrain.comm.secagg import SecureSum

            self._secure = SecureSum.agree(self.rank, self.world_size, self.clock_group, self.spec.timeout_s)
        return self._secure
