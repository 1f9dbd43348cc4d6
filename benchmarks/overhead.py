"""edgetrain's training step against plain PyTorch: one device, and two devices under DDP.

ResNet-18 (CIFAR), global batch 64, synthetic 32x32 data, one torch thread
per device, on the same cores:

* 1 device: ``edgetrain.train(devices=1)`` against the hand-written loop
  below, both pinned to one core;
* 2 devices: ``edgetrain.train(devices=2)`` against ``plain_ddp.py`` (plain
  DDP over gloo) under ``torchrun``, each process pinned as edgetrain pins
  its devices (``cluster.throttle.assign_cores``).

Both sides time a step the same way, from asking for the batch to the end of
``optimizer.step()``, and skip the first (warm-up) step; process start-up
is not counted. They run alternately (plain, edgetrain, plain, edgetrain...),
and the ratio edgetrain / plain is taken within each round, so drift on a
shared host cancels; the result is the median of the ratios. Targets:
>= 0.97 on both. Results go to ``results/overhead.txt`` and ``.json``.

Each round also prints CPU seconds per step (``time.process_time``, all
threads, summed over devices) and plain / edgetrain of it: on a host shared
with other work, wall time swings with the load while CPU time mostly does
not, so that ratio shows whether edgetrain does more work. It is a
diagnostic, not the target.

    python benchmarks/overhead.py [--steps 6] [--rounds 3]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch.utils.data import DataLoader, TensorDataset

import edgetrain
from edgetrain.data import synthetic
from edgetrain.models import build_model
from plain_ddp import timed_steps  # beside this file: the same step loop, timed the same way

HERE = Path(__file__).resolve().parent
TARGET = 0.97


def plain_pytorch(steps: int, batch: int, core: int) -> tuple[float, float]:
    """(samples/s, CPU s per step) of the loop everyone writes first, timed after one warm-up step."""
    os.sched_setaffinity(0, [core])
    torch.set_num_threads(1)
    torch.manual_seed(0)
    data = synthetic(samples=batch * (steps + 1), image_size=32)
    x = torch.stack([data.train[i][0] for i in range(len(data.train))])
    loader = DataLoader(TensorDataset(x, data.train.labels), batch_size=batch, shuffle=True, drop_last=True)
    model = build_model("resnet18")
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=5e-4)
    times, cpu, _ = timed_steps(model, loader, opt)
    return batch * len(times[1:]) / sum(times[1:]), sum(cpu[1:]) / len(cpu[1:])


def plain_ddp(steps: int, batch: int, devices: int) -> tuple[float, float]:
    """(samples/s, CPU s per step summed over processes) of ``plain_ddp.py`` under torchrun (it imports edgetrain only to pin and build the model)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(Path(edgetrain.__file__).parents[1]),
                                                       os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                           str(devices), str(HERE / "plain_ddp.py"), "--steps", str(steps), "--batch", str(batch)],
                          capture_output=True, text=True, timeout=600, env=env)
    if proc.returncode != 0:
        raise SystemExit(f"plain_ddp.py failed:\n{proc.stderr[-3000:]}")
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    return result["samples_per_s"], result["cpu_s_per_step"]


def edgetrain_run(steps: int, batch: int, devices: int, out: str) -> tuple[float, float]:
    summary = edgetrain.train(dict(model="resnet18", dataset="synthetic", image_size=32,
                                   synthetic_samples=batch * (steps + 1), batch_size=batch, steps=steps + 1,
                                   devices=devices, threads=1, eval=False, progress=False, throttle=False,
                                   output=out))
    return summary["throughput_samples_per_s"], sum(d["cpu_s"] for d in summary["per_device"])


def compare(label: str, plain, ours, rounds: int, say) -> dict:
    """Alternate plain and edgetrain runs; the median of the per-round ratios."""
    rows = []
    for r in range(rounds):
        p, p_cpu = plain()
        e, e_cpu = ours()
        rows.append({"round": r, "plain_samples_per_s": p, "edgetrain_samples_per_s": e, "ratio": e / p,
                     "plain_cpu_s_per_step": p_cpu, "edgetrain_cpu_s_per_step": e_cpu, "cpu_ratio": p_cpu / e_cpu})
        say(f"{label} round {r}: plain {p:6.1f} samples/s   edgetrain {e:6.1f} samples/s   ratio {e / p:.3f}"
            f"   (CPU s/step {p_cpu:.2f} vs {e_cpu:.2f}, ratio {p_cpu / e_cpu:.3f})")
    ratio = statistics.median(row["ratio"] for row in rows)
    cpu_ratio = statistics.median(row["cpu_ratio"] for row in rows)
    met = ratio >= TARGET
    say(f"{label}: median ratio {ratio:.3f}  (target >= {TARGET}) {'MET' if met else 'MISSED'}"
        f"   median CPU-time ratio {cpu_ratio:.3f}")
    return {"rounds": rows, "median_ratio": ratio, "median_cpu_ratio": cpu_ratio, "target": TARGET, "met": met}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=6, help="timed steps per run (one more runs first, untimed)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--batch", type=int, default=64, help="global batch")
    args = ap.parse_args()
    host_cores = sorted(os.sched_getaffinity(0))
    lines: list[str] = []

    def say(line: str) -> None:
        print(line, flush=True)
        lines.append(line)

    result = {"benchmark": "overhead", "model": "resnet18", "batch": args.batch, "steps_timed": args.steps,
              "host_cores": host_cores, "load_average_start": os.getloadavg()}
    # other work on the host makes the wall-time ratios swing; the load says how busy it was
    say(f"host cores {host_cores}, load average (1, 5, 15 min) at start: "
        + ", ".join(f"{x:.1f}" for x in os.getloadavg()))
    with tempfile.TemporaryDirectory(prefix="overhead-") as out:
        # One device on one core; the spawned edgetrain device inherits this process's affinity.
        os.sched_setaffinity(0, host_cores[:1])
        result["one_device_vs_plain_loop"] = compare(
            "1 device vs plain loop", lambda: plain_pytorch(args.steps, args.batch, host_cores[0]),
            lambda: edgetrain_run(args.steps, args.batch, 1, out), args.rounds, say)
        os.sched_setaffinity(0, host_cores)
        result["two_devices_vs_plain_ddp"] = compare(
            "2 devices vs plain torchrun DDP", lambda: plain_ddp(args.steps, args.batch, 2),
            lambda: edgetrain_run(args.steps, args.batch, 2, out), args.rounds, say)
    result["load_average_end"] = os.getloadavg()
    say("load average at end: " + ", ".join(f"{x:.1f}" for x in result["load_average_end"]))
    for name, text in (("overhead.json", json.dumps(result, indent=2) + "\n"), ("overhead.txt", "\n".join(lines) + "\n")):
        path = HERE / "results" / name
        path.write_text(text)
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
