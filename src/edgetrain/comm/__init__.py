"""Communication over slow edge networks: link emulation, gradient compression, sync modes.

The training loop needs two functions from here:

* ``check_config(cfg)``: validate ``cfg.compress``, ``cfg.sync``, ``cfg.link``
  and ``cfg.link_mode`` early, in the parent process;
* ``build_sync(model, cfg, rank, world_size, stats, link)``: in each worker, the
  sync object the loop drives (interface in ``sync.py``).

A user's own DDP script needs only ``make_hook``::

    state, hook = make_hook("topk:0.01")          # or "powersgd:2", "threshold:0.001", ...
    ddp_model.register_comm_hook(state, hook)
    print(state.stats.bytes_sent)

Map: ``cluster/links.py`` (link model), ``emulation.py`` (enforced / virtual
clock), ``compress/`` (one module per method, ``memory.py`` for error
feedback), ``exchange.py`` (the compressed average every mode uses),
``hook.py`` (DDP hook), ``sync.py`` / ``local_sgd.py`` / ``asynchronous.py`` /
``gossip.py`` (modes), ``spec.py`` (``--sync`` and what composes with what).
"""
from __future__ import annotations

import torch.distributed as dist
from torch import nn

from edgetrain.cluster.links import PRESETS, Link, get_link
from edgetrain.cluster.peers import all_gather_json
from edgetrain.comm.accounting import CommStats
from edgetrain.comm.allreduce import AllReduceState, allreduce_hook
from edgetrain.comm.asynchronous import BoundedStaleness
from edgetrain.comm.compress.memory import NoMemory
from edgetrain.comm.compress.powersgd import PowerSGDHookState, powersgd_hook
from edgetrain.comm.compress.spec import CompressSpec, build_compressor, parse_compress
from edgetrain.comm.emulation import MODES as LINK_MODES
from edgetrain.comm.emulation import LinkEmulator
from edgetrain.comm.gossip import Gossip
from edgetrain.comm.hook import CompressionState, compression_hook
from edgetrain.comm.local_sgd import LocalSGD
from edgetrain.comm.spec import SyncSpec, check_compatible, parse_sync
from edgetrain.comm.sync import Synchronous, SyncMode
from edgetrain.errors import EdgetrainError

DEFAULT_TIMEOUT_S = 300.0

__all__ = ["check_config", "build_sync", "make_hook", "build_hook", "parse_compress", "parse_sync",
           "CommStats", "LinkEmulator", "SyncMode", "Synchronous", "LocalSGD", "BoundedStaleness", "Gossip"]


def check_config(cfg) -> None:
    """Validate the communication fields of a ``TrainConfig``; raise ``EdgetrainError`` if one is wrong."""
    compress = parse_compress(getattr(cfg, "compress", "none"))
    sync = parse_sync(getattr(cfg, "sync", "sync"))
    check_compatible(sync, compress)
    get_link(getattr(cfg, "link", None))
    mode = getattr(cfg, "link_mode", "virtual") or "virtual"
    if mode not in LINK_MODES:
        raise EdgetrainError(f"link mode must be one of {', '.join(LINK_MODES)}, got {mode!r}")
    if getattr(cfg, "batchnorm", "local") == "sync" and sync.mode != "sync":
        raise EdgetrainError(f"batchnorm sync all-reduces statistics at every forward, which --sync {sync.text} is "
                             "meant to avoid; use --batchnorm local")
    if compress.is_dgc and getattr(cfg, "optimizer", "sgd") == "sgd" and getattr(cfg, "momentum", 0.0) > 0:
        raise EdgetrainError(f"--compress {compress.text} applies momentum inside the hook (DGC momentum "
                             "correction); set --momentum 0 so that it is not applied twice")


def build_hook(spec: CompressSpec, emulator: LinkEmulator, link: Link | None = None, seed: int = 0,
               group=None) -> tuple[object, object]:
    """The DDP (state, hook) pair for a compression spec: ``allreduce.py``'s overlapping hook where the
    method allows (summable, no error feedback, no emulated link), else the blocking ``hook.py``."""
    if spec.is_powersgd:
        return PowerSGDHookState(rank=int(spec.arg or 2), start_iter=int(spec.options.get("start", 10)),
                                 emulator=emulator, group=group), powersgd_hook
    compressor, memory = build_compressor(spec, link, seed, emulator.rank)
    if compressor.summable and isinstance(memory, NoMemory) and not emulator.emulated:
        # nothing to charge to a link and nothing to remember: let the all-reduce overlap backward
        return AllReduceState(group, emulator.stats, compressor), allreduce_hook
    return CompressionState(compressor, memory, emulator, group), compression_hook


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


def build_sync(model: nn.Module, cfg, rank: int, world_size: int, stats: CommStats | None = None,
               link: str | Link | dict | None = None, **ddp_kwargs) -> SyncMode:
    """The sync object for this worker, as ``cfg.sync`` / ``cfg.compress`` / links say.

    ``link``: this device's link (from the cluster file); ``None`` falls back to
    ``cfg.link``. Every device must call this (it runs setup collectives).
    ``ddp_kwargs`` (``broadcast_buffers``, ``bucket_cap_mb``) go to DDP in sync mode;
    ``broadcast_buffers`` defaults to on unless ``cfg.batchnorm`` is ``sync``.
    """
    check_config(cfg)
    compress = parse_compress(getattr(cfg, "compress", "none"))
    sync = parse_sync(getattr(cfg, "sync", "sync"))
    my_link = get_link(link if link is not None else getattr(cfg, "link", None))
    seed = int(getattr(cfg, "seed", 0) or 0)
    timeout = float(getattr(cfg, "timeout", None) or DEFAULT_TIMEOUT_S)
    links = gather_links(my_link, world_size)
    emulator = LinkEmulator(links, rank, stats if stats is not None else CommStats(),
                            getattr(cfg, "link_mode", None) or "virtual", seed, timeout)
    distributed = world_size > 1 and dist.is_initialized()
    clock_group = dist.new_group(backend="gloo") if distributed else None
    common = dict(clock_group=clock_group, spec=sync.text, compress=compress.text)
    if sync.mode == "sync":
        hook = state = None
        # uncompressed and no link to charge: no hook, DDP's own all-reduce (Synchronous counts its bytes)
        if distributed and (compress.method != "none" or links is not None):
            state, hook = build_hook(compress, emulator, my_link, seed)
        ddp_kwargs.setdefault("broadcast_buffers", getattr(cfg, "batchnorm", "local") != "sync")
        return Synchronous(model, world_size, hook=hook, hook_state=state, emulator=emulator, **common,
                           **ddp_kwargs)
    # the averaging traffic gets its own group so it never interleaves with other collectives
    group = dist.new_group(backend="gloo") if distributed else None
    if sync.mode == "gossip":
        return Gossip(model, world_size, rank, emulator, sync.period, group=group, **common)
    compressor, memory = build_compressor(compress, my_link, seed, rank)
    if sync.mode == "local":
        return LocalSGD(model, world_size, emulator, sync.period, compressor, memory, sync.nesterov,
                        sync.outer_lr, sync.outer_momentum, group=group, **common)
    return BoundedStaleness(model, world_size, rank, emulator, sync.staleness, compressor, memory,
                            group=group, **common)
