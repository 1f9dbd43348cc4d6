"""Measured step times on links shaped by the kernel (tc tbf) between separate hosts, beside the planner's.

Two test hosts (tests/hosts.py: network namespaces on a bridge, root needed), each link shaped to RATE both
ways with ``tc tbf`` (rate only: this kernel has no netem, so no added delay or loss). The tutorial's plain
recipe trains on them; the summary's per-device means (steps after the first) are printed, and the device
clock per step (the wall time of the training steps, from each step's first forward: no link is emulated).
Then the same run on loopback with the link emulated in virtual mode (``--link RATE:0ms``: this host's
measured compute + the link model's time), its clock per step (the virtual clock's prediction), and
``edgetrain plan`` for the same run (modelled). docs/benchmarks/real-links.md has the results.

    python benchmarks/real_links.py --rate 10mbit --steps 30 --batch-size 64 --threads 1
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))
os.environ["PYTHONPATH"] = os.pathsep.join([str(REPO / "src"), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)

import hosts as test_hosts  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rate", default="10mbit")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--model", default="small_cnn")
    p.add_argument("--threads", type=int, default=1,
                   help="per device: the two test hosts share this machine's cores (a real host would not)")
    p.add_argument("--no-slow-start-after-idle", action="store_true",
                   help="sysctl net.ipv4.tcp_slow_start_after_idle=0 on the hosts (Linux's default is 1: a connection "
                        "idle for a retransmission timeout starts again from a small congestion window)")
    p.add_argument("--burst", default="32kbit",
                   help="tbf bucket (tc units); at least rate / HZ (tc-tbf(8)): 500kb for 1gbit at HZ=250")
    args = p.parse_args()
    why = test_hosts.unavailable()
    if why:
        sys.exit(f"real_links: {why}")
    flags = ["--model", args.model, "--batch-size", str(args.batch_size), "--steps", str(args.steps),
             "--no-progress", "--no-eval", "--no-throttle", "--timeout", "60", "--threads", str(args.threads)]
    with tempfile.TemporaryDirectory(prefix="real_links") as tmp:
        tmp = Path(tmp)
        hosts = test_hosts.Hosts(2, tmp / "hosts", rate=args.rate, ssh=False, burst=args.burst)
        try:
            if args.no_slow_start_after_idle:
                for i in range(2):
                    hosts.run(i, ["sysctl", "-qw", "net.ipv4.tcp_slow_start_after_idle=0"], timeout=10).check_returncode()
            procs = []
            for i in range(2):
                env = dict(os.environ, RANK=str(i), WORLD_SIZE="2", MASTER_ADDR=hosts.addresses[0],
                           MASTER_PORT="29500", EDGETRAIN_CLUSTER_TOKEN="bench")
                procs.append(hosts.popen(i, [sys.executable, "-m", "edgetrain", "train", *flags, "--output",
                                             str(tmp / "runs")], env=env, stdout=subprocess.DEVNULL,
                                         stderr=subprocess.PIPE, text=True))
            for proc in procs:
                _, err = proc.communicate(timeout=600)
                if proc.returncode:
                    sys.exit(f"real_links: a host failed: {err[-2000:]}")
        finally:
            hosts.close()
        (run,) = (tmp / "runs").glob("*/summary.json")
        summary = json.loads(run.read_text())
        measured = clock_per_step(run.parent)
        for d in summary["per_device"]:
            print(f"measured  rank {d['rank']}: step {d['step_s']:.3f} s  comm {d['comm_s']:.3f} s  "
                  f"compute {d['compute_s']:.3f} s  sent {d['bytes_sent'] / 1e6 / args.steps:.3f} MB/step  "
                  f"clock {measured[d['rank']]:.3f} s/step")
        virtual = subprocess.run([sys.executable, "-m", "edgetrain", "train", *flags, "--devices", "2", "--link",
                                  f"{args.rate}:0ms", "--output", str(tmp / "virtual")],
                                 capture_output=True, text=True, timeout=600)
        if virtual.returncode:
            sys.exit(f"real_links: the virtual-clock run failed: {virtual.stderr[-2000:]}")
        (vrun,) = (tmp / "virtual").glob("*/summary.json")
        predicted = clock_per_step(vrun.parent)
        vsum = {d["rank"]: d for d in json.loads(vrun.read_text())["per_device"]}
        for rank in sorted(predicted):
            print(f"virtual   rank {rank}: clock {predicted[rank]:.3f} s/step (compute {vsum[rank]['compute_s']:.3f} s "
                  f"measured on loopback + the link model); measured / virtual {measured[rank] / predicted[rank]:.3f}")
        plan = subprocess.run([sys.executable, "-m", "edgetrain", "plan", "--model", args.model, "--devices", "2",
                               "--link", f"{args.rate}:0ms", "--batch-size", str(args.batch_size),
                               "--output", str(tmp / "plan")], capture_output=True, text=True, timeout=300)
        pj = json.loads(next((tmp / "plan").glob("*/plan.json")).read_text())["prediction"]
        step = sum(measured.values()) / len(measured)
        print(f"planner   step {pj['step_s']:.3f} s (compute {pj['compute_s_max']:.4f} s + exchange {pj['exchange_s']:.3f} s)"
              f"; measured clock / planner {step / pj['step_s']:.3f}")


def clock_per_step(run_dir: Path) -> dict[int, float]:
    """Each rank's device clock per step over the steps after the first (metrics.jsonl's ``virtual_s``: with no
    link emulated the wall time of the training steps, in virtual mode the virtual clock)."""
    clocks: dict[int, list[float]] = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        row = json.loads(line)
        if "virtual_s" in row and "step" in row:
            clocks.setdefault(row["rank"], []).append(row["virtual_s"])
    return {rank: (c[-1] - c[0]) / (len(c) - 1) for rank, c in clocks.items() if len(c) > 1}


if __name__ == "__main__":
    main()
