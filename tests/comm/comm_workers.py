"""What each device runs in the distributed comm tests (started by ``edgetrain_testing.on_devices``).

Worker functions live here (not in the test files) so that spawned processes
can import them by name.
"""
from __future__ import annotations

import time

import torch
import torch.distributed as dist
from torch import nn


# -- tiny task -------------------------------------------------------------------------
def tiny_model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(20, 32), nn.ReLU(), nn.Linear(32, 4))


def tiny_data(rank: int, n: int = 256):
    """A learnable 4-class problem; each device holds its own shard."""
    g = torch.Generator().manual_seed(1234)
    w = torch.randn(20, 4, generator=g)
    g.manual_seed(rank + 1)
    x = torch.randn(n, 20, generator=g)
    return x, (x @ w).argmax(1)


def flat_params(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


# -- workers -------------------------------------------------------------------------
def plain_ddp_training(rank: int, world: int, specs: list[str], steps: int = 40) -> dict:
    """Register each compressor on a plain DDP model (no edgetrain trainer) and train."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    from edgetrain.comm import make_hook

    x, y = tiny_data(rank)
    results = {}
    for spec in specs:
        model = DDP(tiny_model())
        state, hook = make_hook(spec)
        model.register_comm_hook(state, hook)
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.0 if "dgc" in spec else 0.9)
        losses = []
        for step in range(steps):
            i = (step * 32) % len(x)
            loss = nn.functional.cross_entropy(model(x[i:i + 32]), y[i:i + 32])
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
        results[spec] = {"first": sum(losses[:4]) / 4, "last": sum(losses[-4:]) / 4,
                         "bytes": state.stats.bytes_sent, "params": flat_params(model.module)}
    return results


def exchange_exactness(rank: int, world: int) -> dict:
    """``exchange.average`` returns the combination of every device's decoded payload; bytes match payloads."""
    from edgetrain.comm.accounting import ring_allgather_bytes, ring_allreduce_bytes
    from edgetrain.comm.compress import (HalfCast, Int8, MajorityVote, NoCompression, NoMemory, RandomK,
                                         ScaledSign, Threshold, TopK)
    from edgetrain.comm.emulation import LinkEmulator
    from edgetrain.comm.exchange import Channel, average

    def inputs(r: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(100 + r)
        return torch.randn(1000, generator=g) * (0.05 if r == 0 else 0.1)

    segments = (400, 3, 597)  # three "layers" end to end, as in a DDP bucket
    makers = {"none": NoCompression, "fp16": HalfCast, "int8": Int8, "topk": lambda: TopK(0.03),
              "topk-layerwise": lambda: TopK(0.03, layerwise=True), "threshold-strom": lambda: Threshold(0.15, None, "strom"),
              "randk": lambda: RandomK(0.05, seed=9), "sign": ScaledSign, "vote": MajorityVote,
              "threshold": lambda: Threshold(0.15)}
    out = {}
    for name, make in makers.items():
        emu = LinkEmulator(None, rank)
        got = average(inputs(rank), Channel(make(), NoMemory(), emu), segments=segments)
        local = [make() for _ in range(world)]  # fresh compressors: same seeds and counters as the real ones
        payloads = [c.encode(inputs(r), segments=segments) for r, c in enumerate(local)]
        expected = local[0].combine([c.decode(p) for c, p in zip(local, payloads)])
        if local[0].summable:
            want_bytes = ring_allreduce_bytes(payloads[rank].nbytes, world)
        elif local[0].fixed_size:
            want_bytes = ring_allgather_bytes(payloads[rank].nbytes, world)
        else:  # lengths first, then every payload padded to the longest
            want_bytes = ring_allgather_bytes(8, world) + ring_allgather_bytes(max(p.nbytes for p in payloads), world)
        # fp16 payloads are also summed in fp16: one more rounding of the sum
        tol = 2 ** -10 * expected.abs().max().item() if name == "fp16" else 1e-6
        out[name] = {"max_error": (got - expected).abs().max().item(), "tol": tol, "bytes": emu.stats.bytes_sent,
                     "want_bytes": want_bytes, "payload": payloads[rank].nbytes}
    return out


def run_spec(**options):
    """The ``RunSpec`` of a run with these options and the defaults of the rest, as ``train`` builds it."""
    from edgetrain.config import load_config, resolve

    return resolve(load_config(None, **options))


def run_steps(sync, rank: int, steps: int, lr: float = 0.1, compute_s: float = 0.0) -> list[float]:
    x, y = tiny_data(rank)
    opt = torch.optim.SGD(sync.model.parameters(), lr=lr, momentum=0.9)
    losses = []
    for step in range(steps):
        i = (step * 32) % len(x)
        loss = nn.functional.cross_entropy(sync.model(x[i:i + 32]), y[i:i + 32])
        opt.zero_grad()
        loss.backward()
        if compute_s:
            time.sleep(compute_s)  # stands in for a device's compute: same in every mode
        sync.after_backward(step)
        opt.step()
        sync.after_step(step)
        losses.append(loss.item())
    return losses


def link_time_checks(rank: int, world: int, link: str) -> dict:
    """Enforced all-reduce vs the link model; virtual vs enforced clock on a short DDP run."""
    from edgetrain.cluster.links import collective_time, get_link
    from edgetrain.comm import build_sync
    from edgetrain.comm.accounting import ring_allreduce_bytes
    from edgetrain.comm.compress import NoCompression, NoMemory
    from edgetrain.comm.emulation import LinkEmulator
    from edgetrain.comm.exchange import Channel, average

    out = {}
    emu = LinkEmulator([get_link(link)] * world, rank, mode="enforced")
    x = torch.ones(100_000)
    dist.barrier()
    started = time.perf_counter()
    average(x, Channel(NoCompression(), NoMemory(), emu))
    out["allreduce_wall_s"] = time.perf_counter() - started
    out["allreduce_model_s"] = collective_time([get_link(link)] * world, "allreduce",
                                               ring_allreduce_bytes(400_000, world))
    for mode in ("virtual", "enforced"):
        sync = build_sync(tiny_model(), run_spec(link=link, link_mode=mode), rank, world)
        dist.barrier()
        started = time.perf_counter()
        run_steps(sync, rank, steps=6, compute_s=0.03)
        out[f"{mode}_wall_s"] = time.perf_counter() - started
        sync.finish()
        out[mode] = sync.summary()
    return out


def sync_modes(rank: int, world: int, cases: list[tuple]) -> dict:
    """Train with each (sync, compress, link, link mode, extra compute on device 1) through ``build_sync``."""
    from edgetrain.comm import build_sync

    results = {}
    for case in cases:
        sync_spec, compress, link, mode, slow_s = case
        sync = build_sync(tiny_model(), run_spec(sync=sync_spec, compress=compress, link=link, link_mode=mode),
                          rank, world)
        losses = run_steps(sync, rank, steps=32, compute_s=slow_s if rank == 1 else 0.0)
        metrics = sync.step_metrics()
        sync.finish()
        results[case] = {"first": sum(losses[:4]) / 4, "last": sum(losses[-4:]) / 4,
                         "params": flat_params(sync.model.module if hasattr(sync.model, "module") else sync.model),
                         "summary": sync.summary(), "metrics": metrics}
    return results


class HeadFirst(nn.Module):
    """A small CNN whose head is registered before its convolutions.

    DDP lays its first buckets out in reverse registration order and rebuilds
    them after step 0 in the order gradients become ready (head first), so the
    parameters of its one bucket change places after the first step.
    """

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.head = nn.Linear(8 * 4 * 4, 4)
        self.conv1 = nn.Conv2d(3, 4, 3, padding=1)
        self.conv2 = nn.Conv2d(4, 8, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = nn.functional.max_pool2d(nn.functional.relu(self.conv1(x)), 2)
        return self.head(nn.functional.relu(self.conv2(x)).flatten(1))


def memory_over_reordered_bucket(rank: int, world: int, specs: list[str], steps: int = 6) -> dict:
    """Per spec and parameter, the sums over steps of this device's local gradients and of the averaged ones.

    After ``steps`` steps one more step sends what the memory still holds: zero
    gradients through an uncompressed exchange. With error feedback nothing is
    then lost, so the averaged sum must equal the mean over devices of the local sums.
    """
    from torch.nn.parallel import DistributedDataParallel as DDP

    from edgetrain.comm import make_hook
    from edgetrain.comm.compress import NoCompression

    results = {}
    for spec in specs:
        model = DDP(HeadFirst(), bucket_cap_mb=100)  # one bucket
        state, hook = make_hook(spec)
        names = {id(p): n for n, p in model.module.named_parameters()}
        local = {n: torch.zeros_like(p) for n, p in model.module.named_parameters()}
        averaged = {n: torch.zeros_like(p) for n, p in model.module.named_parameters()}
        layouts = []

        def recording_hook(state, bucket, hook=hook, names=names, local=local, layouts=layouts):
            layouts.append(tuple(names[id(p)] for p in bucket.parameters()))
            for p, g in zip(bucket.parameters(), bucket.gradients()):
                local[names[id(p)]] += g.detach().reshape(p.shape)
            return hook(state, bucket)

        model.register_comm_hook(state, recording_hook)
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        g = torch.Generator().manual_seed(rank + 1)
        for step in range(steps + 1):
            x, y = torch.randn(16, 3, 8, 8, generator=g), torch.randint(0, 4, (16,), generator=g)
            if step == steps:  # the flush: zero gradients, sent uncompressed
                state.compressor = NoCompression()
                loss = model(x).sum() * 0.0
            else:
                loss = nn.functional.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            for n, p in model.module.named_parameters():
                averaged[n] += p.grad
            opt.step()
        results[spec] = {"local": local, "averaged": averaged, "layouts": layouts}
    return results


def overlapping_paths(rank: int, world: int) -> dict:
    """Without a link: which all-reduce uncompressed ``build_sync`` runs and what it counts; and whether
    make_hook("fp16")'s future is still pending when the hook returns (rank 1 starts backward late, so
    an all-reduce that overlaps backward cannot have finished)."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    from edgetrain.comm import build_sync, make_hook

    sync = build_sync(tiny_model(), run_spec(compress="none"), rank, world)
    run_steps(sync, rank, steps=3)
    results = {"none": {"comm_hook": sync.model._get_ddp_logging_data().get("comm_hook"),
                        "bytes": sync.stats.bytes_sent, "metrics": sync.step_metrics(), "summary": sync.summary(),
                        "numel": sum(p.numel() for p in sync.model.parameters())}}
    model = DDP(tiny_model())
    state, hook = make_hook("fp16")
    pending: list[bool] = []

    def watched(state, bucket):
        future = hook(state, bucket)
        pending.append(not future.done())
        return future

    model.register_comm_hook(state, watched)
    x, y = tiny_data(rank)
    for _ in range(3):
        loss = nn.functional.cross_entropy(model(x[:32]), y[:32])
        if rank == 1:
            time.sleep(0.2)
        loss.backward()
    results["fp16"] = {"pending": pending, "bytes": state.stats.bytes_sent,
                       "numel": sum(p.numel() for p in model.parameters())}
    return results


def round_members(rank: int, world: int, cases: list[dict], slow_rank: int, slow_s: float) -> dict:
    """Rounds through ``build_sync`` as the trainer drives them (``sync.trains`` first), device ``slow_rank``
    sleeping ``slow_s`` per trained step; per case, what each round did on this device."""
    from edgetrain.comm import build_sync
    from edgetrain.comm.params import flatten

    x, y = tiny_data(rank)
    results = {}
    for case in cases:
        options = dict(case["options"])
        sync = build_sync(tiny_model(), run_spec(**options), rank, world)
        period = sync.period
        opt = torch.optim.SGD(sync.model.parameters(), lr=0.1)
        out = {"trained": [], "sent": [], "received": [], "local": [], "after": [], "round_wall_s": [],
               "status": [], "control": [], "own_control": []}
        round_started = time.perf_counter()
        for step in range(case["steps"]):
            before = sync.stats.snapshot()
            trained = sync.trains(step)
            if trained:
                i = (step * 16) % len(x)
                loss = nn.functional.cross_entropy(sync.model(x[i:i + 16]), y[i:i + 16])
                opt.zero_grad()
                loss.backward()
                if rank == slow_rank:
                    time.sleep(slow_s)  # stands in for a slow device's compute
                sync.after_backward(step)
                opt.step()
            exchange = (step + 1) % period == 0
            if exchange:
                out["local"].append(flatten(sync.params))  # what this device would send
            sync.after_step(step)
            if exchange:
                out["after"].append(flatten(sync.params))
                out["round_wall_s"].append(time.perf_counter() - round_started)
                out["status"].append(sync.step_metrics()["round_status"])
                if getattr(sync, "scaffold", False):
                    out["control"].append(sync.control.clone())
                    out["own_control"].append(sync.own_control.clone())
                round_started = time.perf_counter()
            after = sync.stats.snapshot()
            out["trained"].append(trained)
            out["sent"].append(after["bytes_sent"] - before["bytes_sent"])
            out["received"].append(after["bytes_recv"] - before["bytes_recv"])
        sync.finish()
        out["summary"] = sync.summary()
        results[case["name"]] = out
    return results
