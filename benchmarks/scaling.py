"""Throughput of 1, 2 and 4 emulated devices, and the honesty of device throttling.

Part 1, host devices: ResNet-18 (CIFAR, width 32 to keep the run short) on
synthetic 32x32 images, 16 images per device per step (weak scaling), DDP
over gloo on this host. Prints samples/s, speedup and efficiency
(speedup / devices) with the time split. This host has few cores: devices
beyond the core count share cores, which the efficiency shows.

Part 2, throttled rpi4 devices: the same model on 1 and 4 `rpi4`-profile
devices. An rpi4 runs at speed s = 15.5 GFLOPS / (GFLOPS of one host core,
measured by each device when it starts; the device reports the s it used).
The per-device compute time of a throttled device should be the unthrottled
one-core compute time divided by its s; the ratio of measured to expected
speed is printed (target: within 10%), with the throttle's calibration: the
CPU time of a warm unthrottled forward + backward pass and how much more the
same pass cost when duty-cycled (the factor the throttle corrects for).

    python benchmarks/scaling.py [--steps 6] [--rounds 3]
"""
from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

import edgetrain
from edgetrain.cluster.profiles import BUILTIN_PROFILES, host_core_gflops

LOCAL_BATCH = 16


def resnet18_w32(in_channels: int, num_classes: int):
    return edgetrain.build_model("resnet18", in_channels, num_classes, width=32)


def run(out: str, devices: int, steps: int, **kw) -> dict:
    cfg = dict(model="resnet18_w32", dataset="synthetic", image_size=32, synthetic_samples=LOCAL_BATCH * 4 * (steps + 1),
               batch_size=LOCAL_BATCH * devices, steps=steps + 1, devices=devices, eval=False, progress=False,
               output=out)
    cfg.update(kw)
    return edgetrain.train(cfg)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--rounds", type=int, default=3, help="rounds of throttled runs (rpi4 part)")
    args = ap.parse_args()
    edgetrain.register_model("resnet18_w32", resnet18_w32)
    result: dict = {"benchmark": "scaling", "model": "resnet18 (width 32)", "local_batch": LOCAL_BATCH}
    with tempfile.TemporaryDirectory() as out:
        print(f"host devices: weak scaling, {LOCAL_BATCH} images per device per step")
        print(f"{'devices':>8} {'samples/s':>10} {'speedup':>8} {'efficiency':>10} {'compute%':>9} {'comm%':>6} {'data%':>6}")
        rows, base = [], None
        for n in (1, 2, 4):
            s = run(out, n, args.steps, threads=1)
            tput = s["throughput_samples_per_s"]
            base = base or tput
            frac = s["time_split_fraction"]
            row = {"devices": n, "samples_per_s": tput, "speedup": tput / base, "efficiency": tput / base / n,
                   "time_split_fraction": frac}
            rows.append(row)
            print(f"{n:>8} {tput:>10.1f} {row['speedup']:>8.2f} {row['efficiency']:>10.2f} "
                  f"{100 * frac['compute']:>8.0f}% {100 * frac['comm']:>5.0f}% {100 * frac['data']:>5.0f}%")
        result["host"] = rows

        gflops = host_core_gflops()
        speed = BUILTIN_PROFILES["rpi4"].gflops / gflops
        print(f"\nrpi4 devices: profile 15.5 GFLOPS, host core {gflops:.1f} GFLOPS (measured here) -> speed {speed:.3f}")
        # This VM's speed drifts by 10-15% from one second to the next, so the throttled runs are
        # compared with unthrottled one-core runs just before and after them, over several rounds,
        # and each device's ratio is the median over the rounds.
        print(f"{args.rounds} rounds of: host core unthrottled, 1 rpi4, 4 rpi4, host core unthrottled")
        host_runs, rounds = [run(out, 1, args.steps, threads=1)], []
        for _ in range(args.rounds):
            throttled = {n: run(out, n, args.steps, profile="rpi4") for n in (1, 4)}
            host_runs.append(run(out, 1, args.steps, threads=1))
            host_compute = sum(r["per_device"][0]["compute_s"] for r in host_runs[-2:]) / 2
            rows = []
            for n, s in throttled.items():
                for d in s["per_device"]:
                    expected = host_compute / d["speed"]  # the speed this device used (it measured the host)
                    rows.append({"devices": n, "rank": d["rank"], "speed": d["speed"], "compute_s": d["compute_s"],
                                 "expected_compute_s": expected, "speed_ratio": expected / d["compute_s"],
                                 "reference_pass_s": d["throttle_reference_pass_s"],
                                 "inflation": d["throttle_inflation"]})
            rounds.append({"host_compute_s": host_compute, "devices": rows})
        host_steps = [r["per_device"][0]["compute_s"] for r in host_runs]
        print(f"host core compute s/step in the {len(host_steps)} unthrottled runs: "
              + " ".join(f"{c:.3f}" for c in host_steps))
        print(f"{'devices':>8} {'device':>7} {'speed':>6} {'compute s/step':>15} {'expected':>9} {'speed ratio':>12} "
              f"{'ref pass s':>10} {'inflation':>9}   (one line per round)")
        medians = []
        for i, first in enumerate(rounds[0]["devices"]):
            per_round = [r["devices"][i] for r in rounds]
            for d in per_round:
                print(f"{d['devices']:>8} {d['rank']:>7} {d['speed']:>6.3f} {d['compute_s']:>15.3f} "
                      f"{d['expected_compute_s']:>9.3f} {d['speed_ratio']:>12.3f} {d['reference_pass_s']:>10.3f} "
                      f"{d['inflation']:>9.2f}")
            median = statistics.median(d["speed_ratio"] for d in per_round)
            medians.append({"devices": first["devices"], "rank": first["rank"], "median_speed_ratio": median})
            print(f"{'':>8} {'':>7} {'median speed ratio over rounds:':>40} {median:.3f}")
        worst = max(abs(m["median_speed_ratio"] - 1) for m in medians)
        result["rpi4"] = {"host_core_gflops": gflops, "rounds": rounds, "host_compute_s": host_steps,
                          "median_speed_ratio": medians, "worst_deviation": worst}
        print(f"worst deviation of emulated rpi4 speed (median over {args.rounds} rounds) from its profile: "
              f"{100 * worst:.1f}% (target <= 10%)")
    path = Path(__file__).parent / "results" / "scaling.json"
    path.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
