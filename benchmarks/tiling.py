"""Spatially tiled training of a YOLOv2-tiny-style backbone at 416x416, side by side in one run.

    PYTHONPATH=src python benchmarks/tiling.py [--batch 8] [--steps 4] [--out tiling.json]

Prints, all measured in this run unless labelled "modelled" or "counted":

1. per-device peak memory of the tiled section for grids 1x1, 1x2 and 2x2
   (activations autograd saves for backward + the section's output tile,
   measured with saved_tensors_hooks; target: 2x2 <= 35% of 1x1);
2. step time of 2 devices on a 1x2 grid (one core each: one thread, pinned
   with sched_setaffinity) against the plain model on 1 device on one core
   (target speedup >= 1.6x, limit 2x); the contenders take turns step by
   step because the machine is shared and its load drifts;
3. for several groupings of the tiled section: halo bytes, messages and
   recomputed FLOPs (counted from the region arithmetic) and the cost model's
   modelled time, with the grouping ``auto`` picked marked, for the machine
   measured in this run and for an assumed Raspberry-Pi-like one.

A step is forward, backward and an SGD step on a global batch of ``--batch``
images (default 8, small to keep the run to a few minutes on a 2-core host).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

from edgetrain.cluster.launch import run_group
from edgetrain.cluster.memory import SavedTensorMeter
from edgetrain.models.yolo_tiny import YoloTiny
from edgetrain.spec import parse_tiling
from edgetrain.tiling import TiledTraining
from edgetrain.tiling.grouping import Machine, choose_groups, grouping_cost
from edgetrain.tiling.layers import describe
from edgetrain.tiling.plan import SectionPlan

SHAPE = (3, 416, 416)


def _pinned(rank, world, cores, fn, *args):
    if cores:
        os.sched_setaffinity(0, {cores[rank % len(cores)]})
    return fn(rank, world, *args)


def on_devices(fn, world: int, *args, cores: list[int] | None = None) -> list:
    """``fn(rank, world, *args)`` in ``world`` processes, one thread each, pinned round-robin to ``cores``."""
    return run_group(_pinned, world, cores, fn, *args, timeout_s=300, deadline_s=1800,
                     deadline_fix="use a smaller --batch or fewer --steps")


def data(batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return torch.randn(batch, *SHAPE, generator=g), torch.randint(0, 10, (batch,), generator=g)


def model() -> YoloTiny:
    torch.manual_seed(0)
    return YoloTiny(num_classes=10)


def tiled_steps(rank, world, grid, batch, steps):
    """Tiled training steps; returns the report of the last one and the step times."""
    x, y = data(batch)
    tiled = TiledTraining(model(), parse_tiling(grid), SHAPE)
    opt = torch.optim.SGD(tiled.parameters(), lr=0.01, momentum=0.9)
    times = []
    for _ in range(steps + 1):  # the first step also measures the machine and chooses groups: not timed
        start = time.perf_counter()
        opt.zero_grad()
        tiled.forward_backward(x, y, F.cross_entropy)
        opt.step()
        times.append(time.perf_counter() - start)
    report = tiled.report()
    report["step_times_s"] = times[1:]
    if rank == 0 and world == 1:
        report["untiled_reference_saved_bytes"] = untiled_saved_bytes(tiled, x)
    return report


def untiled_saved_bytes(tiled: TiledTraining, x: torch.Tensor) -> int:
    """The same section run by its own PyTorch modules, untiled: a check on the 1x1 figure."""
    modules = [u.module for u in tiled.plan.units]
    meter = SavedTensorMeter(list(tiled.parameters()) + [x])
    with meter:
        h = x
        for m in modules:
            h = m(h)
    return meter.bytes + h.numel() * h.element_size()


def side_by_side(rank, world, batch, steps):
    """Ranks 0 and 1 train tiled on a 1x2 grid, rank 2 trains the plain model alone; they take turns,
    step by step, so that both see the same load on a shared machine."""
    import torch.distributed as dist

    pair = dist.new_group([0, 1])
    x, y = data(batch)
    if rank < 2:
        tiled = TiledTraining(model(), parse_tiling("1x2"), SHAPE, group=pair)
        opt = torch.optim.SGD(tiled.parameters(), lr=0.01, momentum=0.9)

        def step():
            tiled.forward_backward(x, y, F.cross_entropy)
    else:
        net = model()
        opt = torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9)

        def step():
            F.cross_entropy(net(x), y).backward()
    a = torch.randn(512, 512)

    def matmuls():
        for _ in range(100):
            a @ a

    times = {"one": [], "two": [], "cal_one": [], "cal_two": []}
    for i in range(steps + 1):  # the first turn is not timed (the tiled pair also measures the machine)
        for who in times:
            dist.barrier()
            if who.endswith("one") == (rank == 2):
                start = time.perf_counter()
                if who.startswith("cal"):
                    matmuls()
                else:
                    opt.zero_grad()
                    step()
                    opt.step()
                if i:
                    times[who].append(time.perf_counter() - start)
    mine = ("one", "cal_one") if rank == 2 else ("two", "cal_two")
    out = {"step_times_s": times[mine[0]], "calibration_s": times[mine[1]]}
    if rank < 2:
        out.update(tiled.report())
    return out


def mib(n: float) -> str:
    return f"{n / 2**20:8.1f} MiB"


def groupings_table(grid: tuple[int, int], batch: int, machine: Machine, label: str) -> list[dict]:
    net = model()  # geometry only: no process group needed
    layers = net.tiling_layers()[:net.tiled_section_default]
    units, c = [], SHAPE[0]
    for name, m in layers:
        units.append(describe(name, m, c))
        c = units[-1].out_channels
    plan = SectionPlan(units, SHAPE[1:], grid, SHAPE[0])
    n = plan.end
    pools = [i + 1 for i, u in enumerate(units) if u.kind == "maxpool"]
    auto, _ = choose_groups(plan, batch, 4, machine)
    candidates = {
        "one fused group": [n],
        "after every 2nd block": pools[1::2] + ([n] if n not in pools[1::2] else []),
        "after every block (pool)": pools if pools[-1] == n else pools + [n],
        "after every layer": list(range(1, n + 1)),
        "auto": auto,
    }
    print(f"\n  groupings on grid {grid[0]}x{grid[1]}, batch {batch}, {label}: {machine.describe()}")
    print(f"  {'grouping':<26}{'group ends':<34}{'halo bytes/step':>16}{'msgs':>6}{'recomputed':>12}"
          f"{'extra GFLOP':>12}{'modelled ms':>12}")
    rows = []
    for name, ends in candidates.items():
        c = grouping_cost(plan, ends, batch, 4, machine)
        extra = c["forward_flops_all_devices"] - plan.untiled_flops(0, n) * batch
        mark = "  <- auto" if ends == auto and name != "auto" else ""
        if name == "auto" and any(ends == v for k, v in candidates.items() if k != "auto"):
            continue
        print(f"  {name:<26}{str(ends):<34}{c['halo_bytes_per_step']:>16,.0f}{c['halo_messages_per_step']:>6}"
              f"{c['recompute_overhead_pct']:>11.1f}%{3 * extra / 1e9:>12.2f}{c['modelled_seconds'] * 1e3:>12.1f}"
              f"{mark}")
        rows.append({"grouping": name, **c, "auto": ends == auto})
    print("  (halo bytes: forward and backward, all devices; extra GFLOP: forward+backward recomputation)")
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=4, help="timed steps of each contender (after one untimed)")
    ap.add_argument("--out", help="also write the results as JSON here")
    args = ap.parse_args()
    cores = sorted(os.sched_getaffinity(0))
    started = time.time()
    print(f"YOLOv2-tiny-style backbone, input {SHAPE}, global batch {args.batch}, float32, "
          f"{len(cores)} cores visible, torch {torch.__version__}")

    print("\n1. Peak memory of the tiled section per device (measured)")
    memory = {}
    for grid, world in (("1x1", 1), ("1x2", 2), ("2x2", 4)):
        reports = on_devices(tiled_steps, world, grid, args.batch, 1, cores=cores)
        memory[grid] = reports[0]
        peaks = reports[0]["peak_memory_bytes_tiled_section"]
        print(f"  grid {grid}: worst device {mib(max(peaks))}  (all: {', '.join(mib(p).strip() for p in peaks)}); "
              f"groups {reports[0]['groups']}, recomputed +{reports[0]['recompute_overhead_pct']:.1f}%")
    base = max(memory["1x1"]["peak_memory_bytes_tiled_section"])
    print(f"  check: the same layers untiled by their own modules hold {mib(memory['1x1']['untiled_reference_saved_bytes']).strip()}")
    for grid in ("1x2", "2x2"):
        ratio = max(memory[grid]["peak_memory_bytes_tiled_section"]) / base
        target = "  (target <= 35%: " + ("met" if ratio <= 0.35 else "NOT met") + ")" if grid == "2x2" else ""
        print(f"  ratio {grid} / 1x1 = {100 * ratio:.1f}%{target}")

    print(f"\n2. Step time, 2 devices (grid 1x2, one core each) vs 1 device on one core (measured: the two "
          f"take turns step by step, {args.steps} timed steps each)")
    timing = {}
    if len(cores) < 2:
        print("  only one core visible: skipped")
    else:
        ranks = on_devices(side_by_side, 3, args.batch, args.steps, cores=[cores[0], cores[1], cores[0]])
        one = ranks[2]["step_times_s"]
        two = [max(a, b) for a, b in zip(ranks[0]["step_times_s"], ranks[1]["step_times_s"])]
        ratios = [a / b for a, b in zip(one, two)]
        split = ranks[0]["time_split_s"]
        timing = {"one_device_s": one, "two_devices_s": two, "speedups": ratios, "split_device0": split,
                  "seconds_by_kind_device0_last_step": ranks[0]["seconds_by_kind"],
                  "bytes_by_kind_device0": ranks[0]["bytes_exchanged_by_kind"], "groups": ranks[0]["groups"]}
        for i, (a, b) in enumerate(zip(one, two)):
            print(f"  step {i + 1}: 1 device {a:.3f} s, 2 devices {b:.3f} s -> {a / b:.2f}x")
        cal_one = ranks[2]["calibration_s"]
        cal_two = [max(a, b) for a, b in zip(ranks[0]["calibration_s"], ranks[1]["calibration_s"])]
        ceiling = statistics.median(2 * a / b for a, b in zip(cal_one, cal_two))
        timing["machine_two_core_ceiling"] = ceiling
        print(f"  machine check, same turns: a single-thread matmul loop takes {statistics.median(cal_one):.3f} s "
              f"alone on one core and {statistics.median(cal_two):.3f} s when both cores run one at once: this "
              f"machine gives compute-bound work at most {ceiling:.2f}x from its 2 cores right now")
        med = statistics.median(ratios)
        print(f"  speedup: median {med:.2f}x, from median step times {statistics.median(one):.3f} s / "
              f"{statistics.median(two):.3f} s = {statistics.median(one) / statistics.median(two):.2f}x "
              f"(target >= 1.6x, limit 2x: {'met' if med >= 1.6 else 'NOT met'})")
        print(f"  device 0, mean step {split['step']:.3f} s = compute {split['compute']:.3f} s + exchange "
              f"{split['exchange']:.3f} s (waiting included); last step's exchange by kind: "
              + ", ".join(f"{k} {v * 1e3:.0f} ms" for k, v in ranks[0]["seconds_by_kind"].items()))
        print(f"  bytes sent per step by device 0: {ranks[0]['bytes_exchanged_per_step']:,} ("
              + ", ".join(f"{k} {v:,}" for k, v in ranks[0]["bytes_exchanged_by_kind"].items() if k != "metrics")
              + f"); groups {ranks[0]['groups']}")

    print("\n3. Groupings of the tiled section (bytes and FLOPs counted; time modelled)")
    measured = memory["1x2"]["machine"]
    m = Machine(measured["device_flops"], measured["bandwidth_bytes_s"], measured["latency_s"], measured["source"])
    pi = Machine(3e9, 12.5e6, 0.5e-3, {"device_flops": "assumed", "bandwidth": "assumed 100 Mbit/s",
                                        "latency": "assumed"})
    groupings = {
        "1x2 measured": groupings_table((1, 2), args.batch, m, "machine measured in this run"),
        "2x2 measured": groupings_table((2, 2), args.batch, m, "machine measured in this run"),
        "2x2 pi-like": groupings_table((2, 2), args.batch, pi, "assumed Raspberry-Pi-like machine"),
    }
    print(f"\ntotal benchmark time {time.time() - started:.0f} s")
    if args.out:
        from edgetrain.files import write_json

        write_json(args.out, {"batch": args.batch, "memory": memory, "timing": timing, "groupings": groupings})
    return 0


if __name__ == "__main__":
    sys.exit(main())
