"""How close ``edgetrain plan``'s predictions come to emulated training, side by side in one run.

Runs short emulated trainings (small_cnn width 16 on synthetic 32x32 images,
32 images per device per step, throttled ``rpi4`` devices, ``lte-10m`` links
in virtual link mode) on 1, 2 and 4 devices, plus 4 devices with top-k
compression and with local SGD, and prints, for each, predicted against
measured:

* compute per step of the slowest device. Predicted twice: with the planner's
  default efficiency (a blind prediction), and with the efficiency the
  emulator realises for this model (its training step's CPU time on one host
  thread, measured just before, against the host-core GFLOPS from which
  edgetrain derived the rpi4 speed). Also printed: the throttle's target,
  the worker's CPU time per step / its speed, which is what the emulation
  would give on an idle host; the gap between it and the measurement is
  host contention. The model's true efficiency (against the GEMM rate timed
  by CPU time) is printed beside the default.
* communication per step: the modelled link time the comm code charged to
  the virtual clock (``virtual_comm_s`` in metrics.jsonl), against the
  planner's; both come from the same link model, so this checks the bytes,
  the bucket and round counts, and the cadence of each mode;
* step time: the virtual clock's advance per step (compute, waiting for the
  slowest device, communication) against the analytic model and the simulator,
  and against the simulator fed each device's *measured* mean compute and CV,
  which checks the step model (waiting, communication, cadence) alone;
* memory: peak RSS of the busiest device against the modelled total.

What this validates and what it does not: an emulated rpi4's speed is *derived
from* its profile (GFLOPS / the host core's measured GEMM GFLOPS, by duty
cycling), so agreement here checks the FLOP counting, the efficiency and the
communication model against edgetrain's emulator, not against a real
Raspberry Pi. Steps after the first are measured (the first pays set-up).

    python benchmarks/plan_accuracy.py [--steps 8]
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

import edgetrain
from edgetrain.cluster.profiles import BUILTIN_PROFILES, host_core_gflops
from edgetrain.config import load_config
from edgetrain.models import build_model
from edgetrain.plan.config import plan_inputs, predict_inputs
from edgetrain.plan.model import DEFAULT_EFFICIENCY
from edgetrain.plan.simulation import simulate

LOCAL_BATCH = 32
MODEL = "small_cnn_w16"
RUNS = [("1 device", dict(devices=1)),
        ("2 devices", dict(devices=2)),
        ("4 devices", dict(devices=4)),
        ("4, topk:0.01", dict(devices=4, compress="topk:0.01")),
        ("4, local:4", dict(devices=4, sync="local:4"))]


def small_cnn_w16(in_channels: int, num_classes: int):
    return build_model("small_cnn", in_channels, num_classes, width=16)


def config(steps: int, out: str, **kw) -> dict:
    cfg = dict(model=MODEL, dataset="synthetic", image_size=32, synthetic_samples=LOCAL_BATCH * 4 * (steps + 1),
               batch_size=LOCAL_BATCH * kw["devices"], steps=steps + 1, profile="rpi4", link="lte-10m",
               link_mode="virtual", eval=False, progress=False, output=out)
    cfg.update(kw)
    return cfg


def host_step_cpu_s(steps: int = 12) -> tuple[float, float]:
    """(median CPU seconds, CV) of one MODEL training step at LOCAL_BATCH on one host thread."""
    model = small_cnn_w16(3, 10)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    x, y = torch.randn(LOCAL_BATCH, 3, 32, 32), torch.randint(0, 10, (LOCAL_BATCH,))
    times = []
    for i in range(steps + 3):
        start = time.process_time()
        loss = F.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if i >= 3:
            times.append(time.process_time() - start)
    return statistics.median(times), statistics.stdev(times) / statistics.mean(times)


def measured(summary: dict) -> dict:
    """Per-step means over steps after the first, from the run's metrics.jsonl and summary.json."""
    records = [json.loads(line) for line in open(Path(summary["run_dir"]) / "metrics.jsonl")]
    world = summary["devices"]
    by_rank = [[r for r in records if r["rank"] == k and r["step"] >= 1] for k in range(world)]
    first = {r["rank"]: r for r in records if r["step"] == 0}
    steps = len(by_rank[0])
    clock = max((rs[-1]["virtual_s"] - first[k]["virtual_s"]) / steps for k, rs in enumerate(by_rank))
    compute = [statistics.mean(r["virtual_compute_s"] for r in rs) for rs in by_rank]
    target = [statistics.mean(r["cpu_s"] for r in rs) / d["speed"] for rs, d in zip(by_rank, summary["per_device"])]
    slow = max(range(world), key=lambda k: compute[k])
    cvs = [statistics.stdev(r["virtual_compute_s"] for r in rs) / statistics.mean(r["virtual_compute_s"] for r in rs)
           for rs in by_rank if len(rs) > 1]
    return {"step_s": clock, "compute_s": compute[slow], "compute_s_per_device": compute,
            "throttle_target_s": target[slow], "comm_s": statistics.mean(r["virtual_comm_s"] for r in by_rank[0]),
            "compute_cv": statistics.mean(cvs) if cvs else 0.0,
            "peak_rss_mb": summary["peak_rss_mb_max"], "summary_compute_s": max(d["compute_s"] for d in summary["per_device"])}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=8, help="measured steps per run (one more is run and dropped)")
    args = ap.parse_args()
    edgetrain.register_model(MODEL, small_cnn_w16)
    started = time.perf_counter()
    gflops = host_core_gflops()  # cached: the same number sets the emulated devices' speed
    speed = BUILTIN_PROFILES["rpi4"].gflops / gflops
    result: dict = {"benchmark": "plan_accuracy", "model": "small_cnn (width 16)", "local_batch": LOCAL_BATCH,
                    "host_core_gflops": gflops, "rpi4_speed": speed, "runs": []}
    with tempfile.TemporaryDirectory() as out:
        inputs0 = plan_inputs(load_config(config(args.steps, out, devices=1)))
        costs = inputs0.costs
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            step_cpu, cpu_cv = host_step_cpu_s()
        finally:
            torch.set_num_threads(threads)
        achieved = costs.train_flops_per_sample * LOCAL_BATCH / step_cpu / 1e9
        # Emulated compute = worker CPU time / speed = CPU time x (host GEMM GFLOPS) / 15.5: the emulator
        # realises this efficiency against the rpi4 profile.
        efficiency = achieved / gflops
        runtime_mb = predict_inputs(inputs0).runtime_mb
        print(f"{MODEL}: {costs.train_flops_per_sample / 1e6:.1f} MFLOP/sample train (counted), {costs.params:,} parameters")
        print(f"host core GEMM: {gflops:.1f} GFLOPS by CPU time (edgetrain's measurement; sets rpi4 speed {speed:.3f})")
        print(f"training step on one host thread: {achieved:.1f} GFLOPS by CPU time (CV {cpu_cv:.3f}) -> efficiency "
              f"{efficiency:.3f} of the GEMM rate (planner default {DEFAULT_EFFICIENCY}), which the emulator realises")
        print(f"idle process RSS {runtime_mb:.0f} MiB (measured)")
        result.update(efficiency_default=DEFAULT_EFFICIENCY, efficiency_emulated=efficiency, runtime_mb=runtime_mb)
        rows = []
        for label, kw in RUNS:
            cfg = config(args.steps, out, **kw)
            summary = edgetrain.train(cfg)
            m = measured(summary)
            inputs = plan_inputs(load_config(cfg), costs=costs)
            blind = predict_inputs(inputs, runtime_mb=runtime_mb)
            calibrated = predict_inputs(inputs, efficiency=efficiency, runtime_mb=runtime_mb)
            sim = simulate(calibrated, steps=args.steps, compute_cv=m["compute_cv"], seed=0)
            # the step model alone: the simulator fed the measured per-device compute instead of the predicted
            given = dataclasses.replace(calibrated, devices=[dataclasses.replace(d, compute_s=c) for d, c in
                                                             zip(calibrated.devices, m["compute_s_per_device"])])
            sim_given = simulate(given, steps=args.steps, compute_cv=m["compute_cv"], seed=0)
            row = {"run": label, "measured": m,
                   "predicted": {"compute_s_default_eff": max(d.compute_s for d in blind.devices),
                                 "compute_s_host_eff": max(d.compute_s for d in calibrated.devices),
                                 "comm_s": calibrated.devices[0].comm_s, "step_s_default_eff": blind.step_s,
                                 "step_s_host_eff": calibrated.step_s, "simulated_step_s_host_eff": sim.mean_step_s,
                                 "simulated_step_s_measured_compute": sim_given.mean_step_s,
                                 "simulated_comm_s": float(sim.comm_s.mean() / args.steps),
                                 "memory_mb": max(d.memory_total_mb for d in calibrated.devices), "kind": "modelled"}}
            rows.append(row)
        result["runs"] = rows

    print("\ncompute per step, slowest device (s): predicted (modelled) vs measured on emulated rpi4")
    print(f"{'run':<14} {'pred eff=0.6':>12} {'pred emul eff':>13} {'throttle target':>15} {'measured':>9} "
          f"{'meas/pred(0.6)':>14} {'meas/pred(emul)':>15} {'target/pred(emul)':>17} {'meas CV':>8}")
    for r in rows:
        p, m = r["predicted"], r["measured"]
        print(f"{r['run']:<14} {p['compute_s_default_eff']:>12.3f} {p['compute_s_host_eff']:>13.3f} "
              f"{m['throttle_target_s']:>15.3f} {m['compute_s']:>9.3f} {m['compute_s'] / p['compute_s_default_eff']:>14.2f} "
              f"{m['compute_s'] / p['compute_s_host_eff']:>15.2f} {m['throttle_target_s'] / p['compute_s_host_eff']:>17.2f} "
              f"{m['compute_cv']:>8.3f}")
    print("\ncommunication and step time per step (s), memory (MiB): predicted (modelled) vs measured")
    print(f"{'run':<14} {'comm pred':>9} {'comm sim':>8} {'comm meas':>9} {'m/pred':>6} {'m/sim':>6} "
          f"{'step pred':>9} {'step sim':>8} {'sim|meas comp':>13} {'step meas':>9} {'m/pred':>6} {'m/sim':>6} "
          f"{'m/sim|mc':>8} {'mem pred':>8} {'RSS meas':>8} {'ratio':>5}")
    for r in rows:
        p, m = r["predicted"], r["measured"]
        comm_ratio = f"{m['comm_s'] / p['comm_s']:.3f}" if p["comm_s"] else "-"
        sim_ratio = f"{m['comm_s'] / p['simulated_comm_s']:.3f}" if p["simulated_comm_s"] else "-"
        print(f"{r['run']:<14} {p['comm_s']:>9.3f} {p['simulated_comm_s']:>8.3f} {m['comm_s']:>9.3f} {comm_ratio:>6} "
              f"{sim_ratio:>6} {p['step_s_host_eff']:>9.3f} {p['simulated_step_s_host_eff']:>8.3f} "
              f"{p['simulated_step_s_measured_compute']:>13.3f} {m['step_s']:>9.3f} "
              f"{m['step_s'] / p['step_s_host_eff']:>6.2f} {m['step_s'] / p['simulated_step_s_host_eff']:>6.2f} "
              f"{m['step_s'] / p['simulated_step_s_measured_compute']:>8.2f} {p['memory_mb']:>8.0f} "
              f"{m['peak_rss_mb']:>8.0f} {m['peak_rss_mb'] / p['memory_mb']:>5.2f}")
    print("(step pred/sim: the efficiency the emulator realises; sim adds the measured compute CV and link jitter; "
          "sim|meas comp: the simulator fed each device's measured mean compute, i.e. the step model alone)")
    print("Emulated rpi4 speed is derived from the profile's GFLOPS: this validates FLOP counting, efficiency and the "
          "comm model against edgetrain's emulator, not real hardware.")
    elapsed = time.perf_counter() - started
    result["elapsed_s"] = elapsed
    path = Path(__file__).parent / "results" / "plan_accuracy.json"
    path.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {path} ({elapsed:.0f} s)")


if __name__ == "__main__":
    main()
