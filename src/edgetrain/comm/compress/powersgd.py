"""PowerSGD (Vogels et al., NeurIPS 2019), as PyTorch implements it, with bytes and link time counted.

``powersgd_hook`` runs PyTorch's own ``powerSGD_hook`` unchanged, bounded by ``--timeout``, and charges its
all-reduces (three per bucket once compression starts) from PyTorch's own tally. ``PowerSGDHookState`` keeps
its state per parameter, not per DDP bucket, so that a resumed run (whose first step runs on DDP's
construction layout) goes on where the uninterrupted one would have; checkpoints store it by parameter name.

Design: docs/design/compression.md ("PowerSGD")
"""
# No "from __future__ import annotations": DDP checks the hook's annotations are the real types.

from dataclasses import dataclass, field

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import PowerSGDState, _should_compress, powerSGD_hook

from edgetrain.cluster.peers import wait
from edgetrain.comm.accounting import ring_allreduce_bytes
from edgetrain.comm.emulation import LinkEmulator


@dataclass
class PowerSGDHookState:
    """PyTorch's ``PowerSGDState`` plus the device's ``LinkEmulator``."""

    rank: int = 2
    start_iter: int = 10
    emulator: LinkEmulator | None = None
    group: object = None
    psgd: PowerSGDState = field(init=False)
    _buckets: dict = field(default_factory=dict, init=False)  # bucket index -> its parameters when last seen
    _parked: dict = field(default_factory=lambda: {piece: {} for piece in _PIECES}, init=False)  # cut pieces

    def __post_init__(self) -> None:
        if self.emulator is None:
            self.emulator = LinkEmulator(None, dist.get_rank() if dist.is_initialized() else 0)
        # PyTorch requires start_powerSGD_iter > 1 with error feedback / warm start (DDP rebuilds
        # its buckets after the first iteration).
        self.psgd = PowerSGDState(process_group=self.group, matrix_approximation_rank=self.rank,
                                  start_powerSGD_iter=max(2, self.start_iter), use_error_feedback=True,
                                  warm_start=True, random_seed=0)

    @property
    def stats(self):
        return self.emulator.stats

    def state_dict(self, names: dict[int, str]) -> dict:
        """``PowerSGDState``'s slots, as its ``__getstate__`` pickles them (not the process group), the
        residuals, P and Q cut per parameter and keyed by its name (``names``: ``id(parameter)`` -> name) under
        ``errors``, ``p``, ``q`` (residuals are one device's: a resume on another device count drops them), the
        RNG as tensors."""
        kept = [k for k in self.psgd.__slots__ if k not in _PER_BUCKET + ("process_group", "rng")]
        slots = {k: getattr(self.psgd, k) for k in kept}
        _, key, pos, has_gauss, gauss = self.psgd.rng.get_state()
        pieces = {piece: {names[i]: t for i, t in parts.items()} for piece, parts in self._pieces().items()}
        return {"slots": slots, **pieces,
                "rng": {"key": torch.from_numpy(key.astype(np.int64)), "pos": pos, "has_gauss": has_gauss,
                        "gauss": gauss}}

    def load_state_dict(self, state: dict, ids: dict[str, int]) -> None:
        """``state`` from ``state_dict``; ``ids``: parameter name -> ``id(parameter)`` in this process."""
        for name, value in state["slots"].items():
            setattr(self.psgd, name, value)
        for store in _PER_BUCKET:
            getattr(self.psgd, store).clear()
        self._buckets.clear()
        self._parked = {piece: {ids[name]: t for name, t in state[piece].items()} for piece in _PIECES}
        rng = state["rng"]
        self.psgd.rng.set_state(("MT19937", rng["key"].numpy().astype(np.uint32), rng["pos"], rng["has_gauss"],
                                 rng["gauss"]))

    def follow_layout(self, bucket: dist.GradBucket) -> None:
        """Before PyTorch's hook runs on ``bucket``: if DDP laid the bucket out anew since its state was made,
        cut every bucket's state into pieces; then give this bucket its parameters' pieces (module docstring)."""
        index, params = bucket.index(), bucket.parameters()
        held = self._buckets.get(index)
        if held is not None and [id(p) for p in held] != [id(p) for p in params] and self._has_state(index):
            self._parked = self._pieces()
            for store in _PER_BUCKET:
                getattr(self.psgd, store).clear()
        self._buckets[index] = params
        if self._has_state(index):
            return
        slices = _bucket_slices(params, self.psgd.matrix_approximation_rank, self.psgd.min_compression_rate)
        for piece, store in zip(_PIECES, _PER_BUCKET):
            parked = self._parked[piece]
            if slices[piece] and all(i in parked for i in slices[piece]):
                getattr(self.psgd, store)[index] = torch.cat([parked.pop(i) for i in slices[piece]])

    def _has_state(self, index: int) -> bool:
        return any(index in getattr(self.psgd, store) for store in _PER_BUCKET)

    def _pieces(self) -> dict:
        """Every parameter's residual, P and Q (those still parked included), by ``id(parameter)``."""
        pieces = {piece: dict(parked) for piece, parked in self._parked.items()}
        for index, params in self._buckets.items():
            slices = _bucket_slices(params, self.psgd.matrix_approximation_rank, self.psgd.min_compression_rate)
            for piece, store in zip(_PIECES, _PER_BUCKET):
                flat = getattr(self.psgd, store).get(index)
                if flat is not None:
                    pieces[piece].update({i: flat[at].clone() for i, at in slices[piece].items()})
        return pieces


_PER_BUCKET = ("error_dict", "p_memory_dict", "q_memory_dict")  # PowerSGDState's stores keyed by bucket index
_PIECES = ("errors", "p", "q")  # the same, cut per parameter


def _bucket_slices(params: list[torch.Tensor], rank: int, min_compression_rate: float) -> dict:
    """Where each parameter's state lies in its bucket's flat tensors, as PyTorch's ``powerSGD_hook`` lays
    them out: ``errors`` (the residual: the bucket's gradients in order), ``p`` and ``q`` (the matrices it
    compresses, grouped by matrix shape in order of first appearance; the others hold an empty slice, so
    that a bucket of them gets its empty P and Q back and draws no new Q). ``{piece: {id(param): slice}}``."""
    errors, offset, by_shape, plain = {}, 0, {}, []
    for param in params:
        errors[id(param)] = slice(offset, offset + param.numel())
        offset += param.numel()
        n = param.shape[0]
        m = param.numel() // n
        if _should_compress(n, m, min(n, m, rank), min_compression_rate)[0]:
            by_shape.setdefault((n, m), []).append(param)
        else:
            plain.append(param)
    p_at, q_at, p_end, q_end = {}, {}, 0, 0
    for (n, m), group in by_shape.items():
        r = min(n, m, rank)
        for param in group:
            p_at[id(param)] = slice(p_end, p_end + n * r)
            q_at[id(param)] = slice(q_end, q_end + m * r)
            p_end, q_end = p_end + n * r, q_end + m * r
    for param in plain:
        p_at[id(param)], q_at[id(param)] = slice(p_end, p_end), slice(q_end, q_end)
    return {"errors": errors, "p": p_at, "q": q_at}


def powersgd_hook(state: PowerSGDHookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    psgd, emulator = state.psgd, state.emulator
    world = dist.get_world_size(state.group)
    element = bucket.buffer().element_size()
    vanilla = psgd.iter < psgd.start_powerSGD_iter
    before = psgd.total_numel_after_compression
    started = emulator.begin()
    state.follow_layout(bucket)
    fut = powerSGD_hook(psgd, bucket)
    result = wait(fut, emulator.timeout_s, "PowerSGD all-reduce")
    if vanilla:
        parts = [bucket.buffer().numel()]
    else:
        p = psgd.p_memory_dict[bucket.index()].numel()
        q = psgd.q_memory_dict[bucket.index()].numel()
        uncompressed = psgd.total_numel_after_compression - before - p - q
        parts = [uncompressed, p, q]
    emulator.end(started, [("allreduce", ring_allreduce_bytes(n * element, world)) for n in parts])
    out: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    out.set_result(result)
    return out


def build_hook(spec, emulator: LinkEmulator, group=None) -> tuple[PowerSGDHookState, object]:
    """``--compress powersgd[:RANK][:start=ITER]``: the DDP (state, hook) pair (``edgetrain.kinds``)."""
    return PowerSGDHookState(rank=int(spec.arg or 2), start_iter=int(spec.options.get("start", 10)),
                             emulator=emulator, group=group), powersgd_hook
