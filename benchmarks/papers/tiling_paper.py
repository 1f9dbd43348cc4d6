"""The tiled-training paper's experiment (Rama, Threadgill, Gerstlauer): YOLOv2 tiled over 1 to 6 Raspberry Pi 3s.

    PYTHONPATH=src python benchmarks/papers/tiling_paper.py [--fast] [--out FILE.json]

1. Per-device memory of the tiled section on grids 1x1, 1x2, 1x3, 2x2, 2x3, 3x2 (measured: activations
   autograd saves for backward plus the section's output tile, as ``TiledTraining`` reports them), for
   YOLOv2-tiny and the full YOLOv2 (Darknet's cfgs) at 416x416.
2. Speed-up of 2-6 ``rpi3``s over one ``rpi3`` core: the planner's (modelled: counted FLOPs and bytes at the
   profile's 12.4 GFLOPS and 100 Mbit/s) at 416x416, and the real trainer on emulated, throttled ``rpi3``s at
   a reduced size (measured), with the share of its rated speed each run reached.
3. Layer grouping's gain per device profile and batch size (modelled by ``tiling.grouping``'s cost model).
"""
from __future__ import annotations

import math
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import NOT_REPORTED, Row, load_average, paper_arguments, report  # noqa: E402

from edgetrain.cluster.launch import run_group  # noqa: E402
from edgetrain.cluster.links import collective_time  # noqa: E402
from edgetrain.cluster.profiles import get_profile  # noqa: E402
from edgetrain.comm.accounting import ring_allreduce_bytes  # noqa: E402
from edgetrain.errors import EdgetrainError  # noqa: E402
from edgetrain.tasks.flops import count_training_flops  # noqa: E402
from edgetrain.models.yolo_tiny import DARKNET_WIDTHS, YoloTiny  # noqa: E402
from edgetrain.models.yolov2 import YoloV2  # noqa: E402
from edgetrain.spec import get_link, parse_tiling  # noqa: E402
from edgetrain.tiling import TiledTraining  # noqa: E402
from edgetrain.tiling.grouping import Machine, choose_groups, grouping_cost  # noqa: E402
from edgetrain.tiling.plan import area  # noqa: E402
from edgetrain.tiling.strategy import plan_section  # noqa: E402

PAPER = "Rama, Threadgill, Gerstlauer, distributed CNN training on mobile and edge clusters (tiling)"
GRIDS = ("1x1", "1x2", "1x3", "2x2", "2x3", "3x2")
SPEEDUP_GRIDS = {2: "1x2", 3: "1x3", 4: "2x2", 5: "1x5", 6: "2x3"}
CLASSES = 10


def build(name: str, widths_scale: float = 1.0):
    """The paper's model by name. YOLOv2-tiny's section ends after its 4th block (26x26 at 416: even splits in
    2; its default 5th ends at 13x13, which splits 6/7 rows); YOLOv2's after its 3rd (52x52)."""
    torch.manual_seed(0)
    if name == "yolov2-tiny":
        widths = tuple(max(4, int(w * widths_scale)) for w in DARKNET_WIDTHS)
        return YoloTiny(CLASSES, widths=widths, tiled_blocks=4)
    return YoloV2(CLASSES, tiled_blocks=3)


def memory_on_devices(rank, world, model_name, grid, batch, side, scale):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(batch, 3, side, side, generator=g)
    y = torch.randint(0, CLASSES, (batch,), generator=g)
    tiled = TiledTraining(build(model_name, scale), parse_tiling(grid), (3, side, side))
    tiled.forward_backward(x, y, F.cross_entropy)
    report = tiled.report()
    return {"peak": report["peak_memory_bytes_tiled_section"], "groups": report["groups"],
            "recompute_pct": report["recompute_overhead_pct"], "end": report["tiled_section_end"]}


def largest_owned_share(model, grid: str, side: int) -> float:
    """The largest tile any device owns at the section's end, as a share of the whole map (counted)."""
    _, _, plan = plan_section(model, parse_tiling(grid), (3, side, side))
    whole = plan.sizes[0][plan.end] * plan.sizes[1][plan.end]
    return max(area(plan.owned(plan.end, d)) for d in range(plan.devices)) / whole


def memory_sweep(model_name: str, grids, batch: int, side: int, scale: float = 1.0) -> list[dict]:
    rows = []
    for grid in grids:
        r, c = (int(v) for v in grid.split("x"))
        out = run_group(memory_on_devices, r * c, model_name, grid, batch, side, scale, timeout_s=600, deadline_s=1800,
                        deadline_fix="use --fast")[0]
        rows.append({"grid": grid, "devices": r * c, "worst_bytes": max(out["peak"]), "all_bytes": out["peak"],
                     "groups": out["groups"], "recompute_pct": out["recompute_pct"],
                     "owned_share": largest_owned_share(build(model_name, scale), grid, side)})
        print(f"  {model_name} {side}x{side} grid {grid}: worst device {max(out['peak']) / 2**20:.1f} MiB, groups "
              f"{out['groups']}", flush=True)
    base = rows[0]["worst_bytes"]
    for row in rows:
        row["ratio"] = row["worst_bytes"] / base
    return rows


def memory_rows(model_name: str, rows: list[dict]) -> list[Row]:
    out = []
    for row in rows[1:]:
        n = row["devices"]
        excess = row["ratio"] - row["owned_share"]
        target = ""
        if row["grid"] == "2x2":
            target = f"; target <= 25%: {'met' if row['ratio'] <= 0.25 else 'NOT met'}"
        note = (f"1/{n} = {100 / n:.1f}%; the largest tile owned at the section's end is {100 * row['owned_share']:.1f}% "
                f"of the map (counted), the other {100 * excess:+.1f} points are halo and recomputed overlap"
                f" (groups {row['groups']}){target}")
        paper = "up to 8x less memory per device (abstract)" if n == 6 else NOT_REPORTED
        out.append(Row(f"{model_name} tiled-section memory per device, grid {row['grid']} ({n} devices)", paper,
                       f"{100 * row['ratio']:.1f}% of 1x1 ({1 / row['ratio']:.1f}x less; "
                       f"{row['worst_bytes'] / 2**20:.0f} MiB)", "measured", note))
    return out


# ---------------------------------------------------------------- speed-up, modelled

def pi3_machine(profile) -> Machine:
    link = get_link(profile.link)
    return Machine(profile.gflops * 1e9, link.goodput_Bps, link.latency_s,
                   {"device_flops": f"{profile.name} profile", "bandwidth": f"{link.name} goodput",
                    "latency": f"{link.name}"})


def modelled_step(model, grid: str, batch: int, side: int, profile) -> dict:
    """Seconds of one tiled step on ``grid`` devices of ``profile`` (modelled from counted FLOPs and bytes):
    the tiled section by the grouping cost model, the hand-off of its output (an all-to-all, forward and
    backward, timed as an all-gather of the bytes that leave each device), the data-parallel tail on batch/N
    and the gradient all-reduce; and the whole model on one of the profile's cores."""
    _, _, plan = plan_section(model, parse_tiling(grid), (3, side, side))
    n = plan.devices
    machine, links = pi3_machine(profile), [get_link(profile.link)] * n
    ends, _ = choose_groups(plan, batch, 4, machine)
    section = grouping_cost(plan, ends, batch, 4, machine)
    total = count_training_flops(model, (3, side, side), CLASSES)["total_flops"] * batch
    tail = (total - 3 * plan.untiled_flops(0, plan.end) * batch) / n / machine.device_flops
    out_bytes = plan.channels[-1] * plan.sizes[0][plan.end] * plan.sizes[1][plan.end] * 4 * batch
    handoff = 2 * collective_time(links, "allgather", int(out_bytes / n * (n - 1) / n)) if n > 1 else 0.0
    params = sum(p.numel() for p in model.parameters()) * 4
    gradients = collective_time(links, "allreduce", ring_allreduce_bytes(params, n)) if n > 1 else 0.0
    step = section["modelled_seconds"] + handoff + tail + gradients
    one_core = total / (machine.device_flops / profile.cores)
    return {"grid": grid, "devices": n, "step_s": step, "one_core_s": one_core, "speedup": one_core / step,
            "section_s": section["modelled_seconds"], "handoff_s": handoff, "tail_s": tail, "gradients_s": gradients,
            "compute_only_speedup": one_core / (section["modelled_compute_s"] + tail), "groups": ends}


def modelled_speedups(model_name: str, batch: int, side: int, devices=(2, 3, 4, 5, 6)) -> list[dict]:
    model, profile = build(model_name), get_profile("rpi3")
    return [modelled_step(model, SPEEDUP_GRIDS[n], batch, side, profile) for n in devices]


# ---------------------------------------------------------------- speed-up, measured on emulated rpi3s

def cluster_file(directory: Path, count: int, one_core: bool) -> Path:
    """``count`` emulated rpi3s, their memory limit lifted (the table reports the peak beside the Pi 3's 1 GB),
    or one rpi3 core (a quarter of its GFLOPS) for the paper's baseline."""
    name = "rpi3-core" if one_core else "rpi3-run"
    extra = "cores: 1, gflops: 3.1, " if one_core else ""
    path = directory / f"{name}-{count}.yaml"
    path.write_text(f"profiles:\n  {name}: {{base: rpi3, {extra}memory_mb: 16384}}\n"
                    f"devices: [{{profile: {name}, count: {count}}}]\n")
    return path


def measured_speedups(directory: Path, side: int, batch: int, steps: int, devices=(2, 4, 6)) -> list[dict]:
    from edgetrain.bench.trainer_runs import cluster_timing, read_metrics, train_in_subprocess

    directory.mkdir(parents=True, exist_ok=True)
    common = {"model": "yolo_tiny", "dataset": "synthetic", "image_size": side, "batch_size": batch, "steps": steps,
              "eval": False, "progress": False, "output": str(directory), "synthetic_samples": 4 * batch}
    runs = [("1 rpi3 core", 1, {"strategy": "ddp", "cluster": str(cluster_file(directory, 1, True))})]
    runs += [(f"{n} rpi3s, grid {SPEEDUP_GRIDS[n]}", n, {"strategy": "tiled", "grid": SPEEDUP_GRIDS[n],
                                                         "cluster": str(cluster_file(directory, n, False))})
             for n in devices]
    rows = []
    for label, n, extra in runs:
        name = f"tiling-{label.split(',')[0].replace(' ', '-')}"
        load = os.getloadavg()[0]
        try:
            summary = train_in_subprocess({**common, **extra, "run_name": name})
        except EdgetrainError as e:  # a run the loaded host could not finish is a row, not the end of the table
            print(f"  measured {label}: failed: {e}", flush=True)
            rows.append({"label": label, "devices": n, "failed": str(e), "load_before": load})
            continue
        records = read_metrics(directory / name)
        timing = cluster_timing(records)
        rss = max(r.peak_rss_mb for r in records)
        # a device that never had to sleep ran at or below its profile's speed: the host could not keep up
        slept = [d.throttle_slept_s for d in summary.per_device]
        rows.append({"label": label, "devices": n, "step_s": timing["step_s_median"], "timing": timing,
                     "peak_rss_mb": rss, "load_before": load, "throttle_slept_s": slept})
        print(f"  measured {label}: median step {rows[-1]['step_s']:.2f} s, peak RSS {rss:.0f} MiB, throttle slept "
              f"{slept} s (load {load:.1f})", flush=True)
    return rows


def _seconds(values: list) -> str:
    return ", ".join(f"{v:.2f}" for v in values)


def _kept_up(slept: list) -> str:
    """A throttled device sleeps when it runs ahead of its profile: none sleeping means the host fell behind."""
    if min(slept) < 0.5:
        return "little: the host could not give the devices their speed"
    return "each waited for its profile's speed: the host kept up"


# ---------------------------------------------------------------- grouping, modelled

def grouping_gains(model_name: str, side: int, grid: str, batches=(1, 4, 16, 64),
                   profiles=("rpi3", "rpi4", "jetson-nano")) -> list[dict]:
    model = build(model_name)
    _, _, plan = plan_section(model, parse_tiling(grid), (3, side, side))
    n = plan.end
    rows = []
    for name in profiles:
        machine = pi3_machine(get_profile(name))
        for batch in batches:
            auto, _ = choose_groups(plan, batch, 4, machine)
            best = grouping_cost(plan, auto, batch, 4, machine)["modelled_seconds"]
            every = grouping_cost(plan, list(range(1, n + 1)), batch, 4, machine)["modelled_seconds"]
            fused = grouping_cost(plan, [n], batch, 4, machine)["modelled_seconds"]
            rows.append({"profile": name, "batch": batch, "auto": auto, "auto_s": best, "every_layer_s": every,
                         "one_group_s": fused, "gain_over_every_layer": every / best, "gain_over_one_group": fused / best})
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = paper_arguments(__doc__, "small sizes, a few seconds (the test suite's version)",
                         "where the measured training runs go", "/tmp/edgetrain-papers")
    ap.add_argument("--parts", default="memory,modelled,measured,grouping",
                    help="which parts to run, of memory, modelled (speed-up), measured (speed-up), grouping")
    args = ap.parse_args(argv)
    started = time.time()
    print(f"{PAPER}\n{load_average()} at the start; torch {torch.__version__}")
    side, batch = (64, 2) if args.fast else (416, 6)  # every device needs a sample of the tail's batch
    scale = 0.125 if args.fast else 1.0
    models = ("yolov2-tiny",) if args.fast else ("yolov2-tiny", "yolov2")
    grids = ("1x1", "1x2") if args.fast else GRIDS

    parts = set(args.parts.split(","))
    memory, rows = {}, []
    if "memory" in parts:
        print(f"\n1. Memory of the tiled section per device (measured), input {side}x{side}, batch {batch}")
    for name in (models if "memory" in parts else ()):
        memory[name] = memory_sweep(name, grids, batch, side, scale)
        rows += memory_rows(name, memory[name])

    print("\n2. Speed-up over one rpi3 core")
    speed_side, speed_batch = (64, 4) if args.fast else (416, 8)
    modelled = {name: modelled_speedups(name, speed_batch, speed_side, (2,) if args.fast else (2, 3, 4, 5, 6))
                for name in (("yolov2-tiny",) if args.fast else models) if "modelled" in parts}
    for name, mrows in modelled.items():
        for m in mrows:
            rows.append(Row(f"{name} speed-up, {m['devices']} rpi3s (grid {m['grid']}) over 1 core, "
                            f"{speed_side}px batch {speed_batch}", "2x-15x for 2-6 Pi 3s (abstract)",
                            f"{m['speedup']:.2f}x", "modelled",
                            f"step {m['step_s']:.1f} s = section {m['section_s']:.1f} + hand-off {m['handoff_s']:.1f} "
                            f"+ tail {m['tail_s']:.1f} + gradient all-reduce {m['gradients_s']:.1f} s at 100 Mbit/s; "
                            f"compute alone {m['compute_only_speedup']:.1f}x; one core {m['one_core_s']:.0f} s"))
    measured = []
    if "measured" in parts and not args.fast:
        m_side, m_batch, m_steps = 128, 12, 3
        print(f"  measured: YOLOv2-tiny at {m_side}px, batch {m_batch}, {m_steps} steps per run (throttled trainer)")
        measured = measured_speedups(Path(args.runs), m_side, m_batch, m_steps)
        predicted = {m["devices"]: m for m in modelled_speedups("yolov2-tiny", m_batch, m_side, (2, 4, 6))}
        base = measured[0]
        for m in measured[1:]:
            p = predicted[m["devices"]]
            if "failed" in m:
                rows.append(Row(f"yolov2-tiny speed-up, {m['label']} over 1 core, {m_side}px batch {m_batch}",
                                "2x-15x for 2-6 Pi 3s (abstract)", "run failed", "measured",
                                f"{m['failed']} (host load {m['load_before']:.1f}); the planner predicts "
                                f"{p['speedup']:.2f}x"))
                continue
            rows.append(Row(f"yolov2-tiny speed-up, {m['label']} over 1 core, {m_side}px batch {m_batch}",
                            "2x-15x for 2-6 Pi 3s (abstract)", f"{base['step_s'] / m['step_s']:.2f}x", "measured",
                            f"steps {base['step_s']:.1f} s / {m['step_s']:.1f} s, host load {m['load_before']:.1f} "
                            f"before the run, throttle slept {_seconds(m['throttle_slept_s'])} s per device "
                            f"({_kept_up(m['throttle_slept_s'])}); the planner predicts {p['speedup']:.2f}x with 100 Mbit/s links "
                            f"({p['compute_only_speedup']:.2f}x compute alone); the emulated devices exchange over "
                            f"this host's loopback (--link does not apply to tiled), and {m['devices']} throttled "
                            f"devices need {m['devices'] * 12.4 / 98:.1f} of this host's 2 shared cores"))
        peak = max(m.get("peak_rss_mb", 0) for m in measured)
        rows.append(Row(f"peak RSS of one device training YOLOv2-tiny (PyTorch), {m_side}px", NOT_REPORTED,
                        f"{peak:.0f} MiB", "measured",
                        f"{'within' if peak <= 1024 else 'above'} the Pi 3's 1 GB; these runs lifted the profile's "
                        f"limit so that a run is not stopped by it, and their synthetic dataset is {4 * m_batch} "
                        f"images (a dataset held in memory counts in a device's RSS)"))

    print("\n3. Layer grouping's gain (modelled)")
    grid_g = "2x2"
    gains = grouping_gains("yolov2-tiny", side, grid_g, (1, 4) if args.fast else (1, 4, 16, 64)) \
        if "grouping" in parts else []
    for g in gains:
        print(f"  {g['profile']:<12} batch {g['batch']:>3}: auto {g['auto']} {g['auto_s'] * 1e3:9.1f} ms, every layer "
              f"{g['every_layer_s'] * 1e3:9.1f} ms ({g['gain_over_every_layer']:.2f}x), one group "
              f"{g['one_group_s'] * 1e3:9.1f} ms ({g['gain_over_one_group']:.2f}x)")
    for profile in sorted({g["profile"] for g in gains}):
        mine = [g for g in gains if g["profile"] == profile]
        every = [g["gain_over_every_layer"] for g in mine]
        fused = [g["gain_over_one_group"] for g in mine]
        batches = [g["batch"] for g in mine]
        rows.append(Row(f"yolov2-tiny grouping gain on {profile}, grid {grid_g}, {side}px, batch "
                        f"{min(batches)}-{max(batches)}", "up to 1.5x by device profile and batch size (abstract)",
                        f"{min(every):.2f}x-{max(every):.2f}x over every layer; {min(fused):.2f}x-{max(fused):.2f}x "
                        f"over one group", "modelled",
                        "the tiled section's time only (3 x forward FLOPs at the profile's GFLOPS, halo bytes and "
                        "messages at its link); the paper's baseline for its 1.5x is not reported here"))
    return report(PAPER, rows, started, args.out, {"memory": memory, "modelled_speedup": modelled,
                                                        "measured_speedup": measured, "grouping": gains})


if __name__ == "__main__":
    sys.exit(main())
