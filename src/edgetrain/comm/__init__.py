"""Communication over slow edge networks: link emulation, gradient compression, sync modes.

The training loop needs one function from here: ``build_sync(model, spec,
rank, world_size, stats, link)``, in each worker, the sync object the loop
drives (interface in ``mode.py``). Its options come parsed and checked in a
``RunSpec`` (``edgetrain.spec``, built once by ``config.resolve``, which also
refuses the combinations that cannot run); nothing here reads a config.

A user's own DDP script needs only ``make_hook``::

    state, hook = make_hook("topk:0.01")          # or "powersgd:2", "threshold:0.001", ...
    ddp_model.register_comm_hook(state, hook)
    print(state.stats.bytes_sent)

Map: ``cluster/links.py`` (link model), ``emulation.py`` (enforced / virtual
clock), ``compress/`` (one module per method, ``memory.py`` for error
feedback), ``exchange.py`` (the compressed average every mode uses),
``hook.py`` (DDP hook), ``mode.py`` (the interface), ``sync.py`` / ``local_sgd.py`` / ``asynchronous.py`` /
``gossip.py``, ``federated.py``, ``streaming.py`` (modes), ``deadline.py`` (round deadlines of local SGD and
federated rounds); the specs themselves are parsed in ``edgetrain.spec``.
"""
from __future__ import annotations

import torch.distributed as dist
from torch import nn

from edgetrain.cluster.peers import all_gather_json
from edgetrain.comm.accounting import CommStats
from edgetrain.comm.asynchronous import BoundedStaleness
from edgetrain.comm.emulation import LinkEmulator
from edgetrain.comm.federated import FederatedAveraging
from edgetrain.comm.gossip import Gossip
from edgetrain.comm.local_sgd import LocalSGD
from edgetrain.comm.mode import Averaging, DeviceClock, SyncMode
from edgetrain.comm.setup import SyncSetup, build_hook
from edgetrain.comm.streaming import StreamingDiLoCo
from edgetrain.comm.sync import Synchronous
from edgetrain.spec import PRESETS, CompressSpec, Link, RunSpec, get_link, parse_compress, parse_sync

__all__ = ["build_sync", "device_clock", "link_emulator", "make_hook", "build_hook", "parse_compress", "parse_sync",
           "CommStats", "LinkEmulator", "Averaging", "DeviceClock", "SyncMode", "Synchronous", "LocalSGD",
           "BoundedStaleness", "Gossip", "FederatedAveraging", "StreamingDiLoCo"]


def make_hook(compress: str = "none", link: str | Link | None = None, mode: str = "virtual",
              seed: int = 0) -> tuple[object, object]:
    """(state, hook) for ``ddp_model.register_comm_hook`` on a plain DDP model.

    ``link``: every device's link (the same for all); ``state.stats`` counts bytes;
    with a link, ``state.emulator`` keeps the modelled time.
    """
    spec = parse_compress(compress)
    link = get_link(link)
    world = dist.get_world_size() if dist.is_initialized() else 1
    rank = dist.get_rank() if dist.is_initialized() else 0
    emulator = LinkEmulator([link] * world if link else None, rank, CommStats(), mode, seed)
    return build_hook(spec, emulator, link, seed)


def gather_links(link: Link | None, world_size: int) -> list[Link] | None:
    """Every device's link, from each device's own (a setup collective). ``None`` if no device emulates;
    a device without a link among devices with one is taken to be on ``lan-1g``."""
    if world_size == 1 or not dist.is_initialized():
        return [link] if link else None
    mine = None if link is None else (link.bandwidth_bps, link.latency_s, link.jitter_s, link.loss, link.name)
    everyone = all_gather_json(mine)  # JSON, not pickles: see cluster/peers
    if all(x is None for x in everyone):
        return None
    return [PRESETS["lan-1g"] if x is None else Link(*x) for x in everyone]


def link_emulator(spec: RunSpec, rank: int, world_size: int, stats: CommStats | None = None,
                  link: str | Link | dict | None = None) -> LinkEmulator:
    """This device's clock over every device's link (``link`` as in ``build_sync``; every device calls it)."""
    links = gather_links(get_link(link) if link is not None else spec.link, world_size)
    return LinkEmulator(links, rank, stats if stats is not None else CommStats(), spec.link_mode, spec.seed,
                        spec.timeout_s)


def device_clock(model: nn.Module, spec: RunSpec, rank: int, world_size: int, stats: CommStats,
                 link: str | Link | dict | None, name: str) -> DeviceClock:
    """The clock, byte tally and summary every sync mode keeps, for a strategy whose exchanges are its own
    (fsdp, pipeline): it charges them to ``.emulator`` and closes each step itself (every device calls it)."""
    emulator = link_emulator(spec, rank, world_size, stats, link)
    group = dist.new_group(backend="gloo") if world_size > 1 and dist.is_initialized() else None
    return DeviceClock(model, world_size, emulator, group, spec=name)


def build_sync(model: nn.Module, spec: RunSpec, rank: int, world_size: int, stats: CommStats | None = None,
               link: str | Link | dict | None = None, steps_per_epoch: int = 0, **ddp_kwargs) -> SyncMode:
    """The sync object for this worker, as ``spec.sync`` / ``spec.compress`` / links say: built by the sync
    mode's own module (its kind's ``runtime``, ``edgetrain.kinds``) from a ``SyncSetup``.

    ``link``: this device's link (from the cluster file, checked by ``plan_devices``);
    ``None`` falls back to ``spec.link``. Every device must call this (it runs setup
    collectives). ``ddp_kwargs`` (``broadcast_buffers``, ``bucket_cap_mb``) go to DDP in
    sync mode; ``broadcast_buffers`` defaults to on unless ``spec.batchnorm`` is ``sync``.
    ``steps_per_epoch`` turns ``fedavg:E``'s local epochs into steps per round.
    """
    my_link = get_link(link) if link is not None else spec.link
    emulator = link_emulator(spec, rank, world_size, stats, my_link)
    distributed = world_size > 1 and dist.is_initialized()
    clock_group = dist.new_group(backend="gloo") if distributed else None
    setup = SyncSetup(model, spec, rank, world_size, emulator, my_link, distributed, clock_group, steps_per_epoch,
                      ddp_kwargs)
    return spec.sync.kind.load_runtime()(setup)
