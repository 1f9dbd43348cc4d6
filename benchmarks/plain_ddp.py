"""The DDP script a user writes first: the 2-device baseline of ``benchmarks/overhead.py``.

ResNet-18 (edgetrain's CIFAR variant, so both sides train the same network),
DDP over gloo with its own all-reduce, synthetic 32x32 data through a
``DistributedSampler``, SGD, one torch thread per process. Each process is
pinned to the cores edgetrain gives a device in the same slot
(``edgetrain.cluster.throttle.assign_cores``), so the two compete for the
host's cores in the same way::

    python -m torch.distributed.run --standalone --nproc-per-node 2 benchmarks/plain_ddp.py --steps 8

A step is timed as edgetrain times one (``train/loop.py``: from asking for
the batch to the end of ``optimizer.step()``); the first step (allocations,
DDP's bucket rebuild) is not counted. Rank 0 prints one JSON line:
``samples_per_s``, summed over processes as edgetrain's
``throughput_samples_per_s`` is, and ``cpu_s_per_step``, the CPU time of a
step (``time.process_time``, all threads) summed over processes as edgetrain's
per-device ``cpu_s`` is.
"""
from __future__ import annotations

import argparse
import json
import os
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from edgetrain.cluster.throttle import assign_cores, pin
from edgetrain.models import build_model


def timed_steps(model, loader, optimizer) -> tuple[list[float], list[float], list[int]]:
    """One pass over ``loader``: per step wall seconds, CPU seconds and samples."""
    times, cpu, seen = [], [], []
    batches = iter(loader)
    while True:
        started, cpu_started = time.perf_counter(), time.process_time()
        try:
            x, y = next(batches)
        except StopIteration:
            break
        loss = F.cross_entropy(model(x), y)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        times.append(time.perf_counter() - started)
        cpu.append(time.process_time() - cpu_started)
        seen.append(len(y))
    return times, cpu, seen


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=8, help="timed steps (one more runs first, untimed)")
    ap.add_argument("--batch", type=int, default=64, help="global batch, split evenly over processes")
    args = ap.parse_args()
    dist.init_process_group("gloo")
    world = dist.get_world_size()
    pin(assign_cores(int(os.environ["LOCAL_RANK"]), int(os.environ["LOCAL_WORLD_SIZE"])))
    torch.set_num_threads(1)
    torch.manual_seed(0)
    samples = args.batch * (args.steps + 1)
    data = TensorDataset(torch.rand(samples, 3, 32, 32), torch.randint(0, 10, (samples,)))
    loader = DataLoader(data, batch_size=args.batch // world, sampler=DistributedSampler(data, seed=0),
                        drop_last=True)
    model = DDP(build_model("resnet18"))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=5e-4)
    times, cpu, seen = timed_steps(model, loader, optimizer)
    totals = torch.tensor([sum(seen[1:]) / sum(times[1:]), sum(cpu[1:]) / len(cpu[1:])], dtype=torch.float64)
    dist.all_reduce(totals)
    if dist.get_rank() == 0:
        print(json.dumps({"samples_per_s": totals[0].item(), "cpu_s_per_step": totals[1].item(),
                          "processes": world, "steps_timed": len(times) - 1}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
