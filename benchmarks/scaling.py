"""Throughput of 1, 2 and 4 emulated devices, and the honesty of device throttling.

Part 1, host devices: ResNet-18 (CIFAR, width 32 to keep the run short) on
synthetic 32x32 images, 16 images per device per step (weak scaling), DDP
over gloo on this host. Prints samples/s, speedup and efficiency
(speedup / devices) with the time split. This host has few cores: devices
beyond the core count share cores, which the efficiency shows.

Part 2, throttled rpi4 devices: the same model on 1 and 4 `rpi4`-profile
devices. An rpi4 runs at speed s = 15.5 GFLOPS / (measured GFLOPS of one host
core). The per-device compute time of a throttled device should be the
unthrottled one-core compute time divided by s; the ratio of measured to
expected speed is printed (target: within 10%).

    python benchmarks/scaling.py [--steps 6]
"""
from __future__ import annotations

import argparse
import json
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
        print(f"\nrpi4 devices: profile 15.5 GFLOPS, host core {gflops:.1f} GFLOPS (measured) -> speed {speed:.3f}")
        # The unthrottled one-core reference, measured before and after the throttled runs (drift cancels).
        refs = [run(out, 1, args.steps, threads=1)]
        throttled = {n: run(out, n, args.steps, profile="rpi4") for n in (1, 4)}
        refs.append(run(out, 1, args.steps, threads=1))
        host_compute = sum(r["per_device"][0]["compute_s"] for r in refs) / len(refs)
        host_tput = sum(r["throughput_samples_per_s"] for r in refs) / len(refs)
        expected = host_compute / speed
        result["rpi4"] = {"host_core_gflops": gflops, "speed": speed, "host_compute_s": host_compute,
                          "expected_compute_s": expected, "runs": []}
        one = throttled[1]["throughput_samples_per_s"]
        result["rpi4"]["single_device_throughput_ratio"] = one / host_tput / speed
        print(f"1 rpi4 device: {one:.2f} samples/s vs host core {host_tput:.2f} samples/s: "
              f"{one / host_tput:.3f}x, profile says {speed:.3f}x -> measured/profile {one / host_tput / speed:.3f}")
        print(f"{'devices':>8} {'device':>7} {'compute s/step':>15} {'expected':>9} {'speed ratio':>12}")
        for n, s in throttled.items():
            for d in s["per_device"]:
                ratio = expected / d["compute_s"]  # measured speed / profile speed
                result["rpi4"]["runs"].append({"devices": n, "rank": d["rank"], "compute_s": d["compute_s"],
                                               "speed_ratio": ratio, "samples_per_s": d["samples_per_s"]})
                print(f"{n:>8} {d['rank']:>7} {d['compute_s']:>15.3f} {expected:>9.3f} {ratio:>12.3f}")
        worst = max(abs(r["speed_ratio"] - 1) for r in result["rpi4"]["runs"])
        result["rpi4"]["worst_deviation"] = worst
        print(f"worst deviation of emulated rpi4 speed from its profile: {100 * worst:.1f}% (target <= 10%)")
    path = Path(__file__).parent / "results" / "scaling.json"
    path.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
