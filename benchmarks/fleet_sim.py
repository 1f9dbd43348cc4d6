"""The fleet on Flower's simulation runtime at scale: rounds per hour and memory for N virtual devices.

One run of ``edgetrain.fleet.simulation.simulate`` (Flower's ``run_simulation`` on Ray) with ``--devices``
virtual SuperNodes, ``--per-round`` sampled per round, ``--local-steps`` steps of small_cnn on the synthetic
dataset (enough samples for every device's partition). While it runs a thread samples, every second, the
resident memory (RSS) of this process and every process below it (Ray's GCS, raylet and actors), and the
1-minute load average; it prints and writes (``--json``) the wall time of the whole run and of each round's
training (measured), the peak memory (measured) and the records' modelled clock.

Usage (from the repository root; the machine is shared, so run it niced)::

    PYTHONPATH=src nice -n 10 python benchmarks/fleet_sim.py --devices 1000 --per-round 50 --rounds 100 \\
        --json benchmarks/results/fleet_sim_1000.json
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil

from edgetrain.fleet.simulation import SimulationResources, simulate


def tree_sample(root: psutil.Process, cpu: dict[int, float], names: dict[int, str], niceness: dict[str, int]) -> int:
    """Bytes resident in ``root`` and all its descendants now (processes that end meanwhile count zero); each
    one's CPU seconds so far (user + system) into ``cpu`` and its role into ``names``, by pid; the highest
    niceness seen of each role into ``niceness``."""
    total = 0
    for proc in [root, *root.children(recursive=True)]:
        try:
            total += proc.memory_info().rss
            times = proc.cpu_times()
            cpu[proc.pid] = times.user + times.system
            names[proc.pid] = process_role(proc, root)
            niceness[names[proc.pid]] = max(niceness.get(names[proc.pid], -20), proc.nice())
        except psutil.Error:
            pass
    return total


def process_role(proc: psutil.Process, root: psutil.Process) -> str:
    """What a process of the run is: the driver, a Ray actor (its title ``ray::ClientAppActor``, or
    ``ray::IDLE`` before its first task) or one of Ray's own processes (named by its program)."""
    if proc.pid == root.pid:
        return "driver (ServerApp, Flower's simulation engine)"
    cmdline = proc.cmdline()
    title = " ".join(cmdline)
    if title.startswith("ray::"):
        return "Ray worker / ClientApp actor"
    for part in cmdline:
        for name in ("gcs_server", "raylet", "dashboard", "log_monitor", "monitor.py", "runtime_env", "agent"):
            if name in part:
                return f"Ray: {name}"
    return "other: " + Path(cmdline[0]).name if cmdline else "other"


def cpu_by_role(cpu: dict[int, float], names: dict[int, str]) -> dict[str, float]:
    """The run's CPU seconds summed by process role."""
    roles: dict[str, float] = {}
    for pid, seconds in cpu.items():
        roles[names.get(pid, "other")] = roles.get(names.get(pid, "other"), 0.0) + seconds
    return dict(sorted(roles.items(), key=lambda item: -item[1]))


class PollTimer:
    """The CPU seconds of Flower's simulation engine looking for messages: its loop asks the in-memory state for
    each node's waiting message every 0.1 s (``vce_api.add_messages_to_queue``); ``get_message_ins`` is wrapped
    with a thread-CPU timer (measured, the call itself unchanged)."""

    def __init__(self):
        from flwr.server.superlink.linkstate.in_memory_linkstate import InMemoryLinkState
        self.cpu_s, self.calls, original = 0.0, 0, InMemoryLinkState.get_message_ins

        def timed(state, *args, **kwargs):
            start = time.thread_time()
            try:
                return original(state, *args, **kwargs)
            finally:
                self.cpu_s += time.thread_time() - start
                self.calls += 1
        InMemoryLinkState.get_message_ins = timed


class Sampler(threading.Thread):
    """Peak tree RSS, the tree's CPU seconds and the load averages seen, sampled every ``interval`` seconds (CPU
    seconds: what the run cost, nearly independent of the other load on a shared machine)."""

    def __init__(self, interval: float = 1.0):
        super().__init__(daemon=True)
        self.interval, self.stop, self.peak, self.loads = interval, threading.Event(), 0, []
        self.root, self.cpu, self.names, self.niceness = psutil.Process(), {}, {}, {}

    def run(self):
        while not self.stop.wait(self.interval):
            self.peak = max(self.peak, tree_sample(self.root, self.cpu, self.names, self.niceness))
            self.loads.append(os.getloadavg()[0])
            if len(self.loads) % 60 == 0:  # a long run's progress, readable from its log
                print(f"PROGRESS peak_rss_mb={self.peak / 2**20:.0f} cpu_s={sum(self.cpu.values()):.0f} "
                      f"load_1min={self.loads[-1]:.1f}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--devices", type=int, default=1000)
    ap.add_argument("--per-round", type=int, default=50)
    ap.add_argument("--rounds", type=int, default=100)
    ap.add_argument("--local-steps", type=int, default=5)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--image-size", type=int, default=16)
    ap.add_argument("--cpus-per-device", type=float, default=1.0)
    ap.add_argument("--worker-niceness", type=int, default=0,
                    help="added to the Ray actors' niceness (Ray's own default is 15; SimulationResources')")
    ap.add_argument("--population", default="60% rpi4@wifi-20m, 30% smart-speaker-2g@lte-10m, 10% jetson-orin-nano")
    ap.add_argument("--availability", default="always")
    ap.add_argument("--config", default="", help="more run-config keys, as JSON")
    ap.add_argument("--own-mode", action="store_true",
                    help="instead: the same rounds on edgetrain's own federated mode (edgetrain train --sync "
                         "fedavg:steps=H, one emulated device process per device; --per-round must equal --devices)")
    ap.add_argument("--json", help="write the result here")
    args = ap.parse_args()
    if args.own_mode:
        return own_mode(args)
    out = Path(tempfile.mkdtemp(prefix="fleet-sim-"))
    config = {"model": "small_cnn", "dataset": "synthetic", "image-size": args.image_size,
              "synthetic-samples": args.devices * args.batch_size * 2, "partition": "iid",
              "num-rounds": args.rounds, "local-steps": args.local_steps, "batch-size": args.batch_size,
              "fraction-train": args.per_round / args.devices, "fraction-evaluate": 0.0, "server-evaluate": True,
              "min-nodes": args.devices, "population": args.population, "availability": args.availability,
              "round-timeout": 600.0, "output-dir": str(out), **json.loads(args.config or "{}")}
    print(f"records: {Path(config['output-dir']) / 'fleet-rounds.jsonl'}", flush=True)
    poll = PollTimer()
    sampler = Sampler()
    sampler.start()
    start = time.perf_counter()
    simulate(config, args.devices, SimulationResources(cpus_per_device=args.cpus_per_device,
                                                          worker_niceness=args.worker_niceness))
    wall = time.perf_counter() - start
    sampler.stop.set()
    sampler.join()
    rounds_file = Path(config["output-dir"]) / "fleet-rounds.jsonl"  # --config may name its own output-dir
    records = [json.loads(line) for line in rounds_file.read_text().splitlines()]
    train_walls = [r["measured_train_wall_s"] for r in records]
    result = {"devices": args.devices, "per_round": args.per_round, "rounds": args.rounds,
              "worker_niceness": args.worker_niceness, "nice": os.nice(0),
              "local_steps": args.local_steps, "batch_size": args.batch_size, "image_size": args.image_size,
              "cpus_per_device": args.cpus_per_device, "cores": os.cpu_count(), "measured_wall_s": wall,
              "measured_rounds_per_hour": args.rounds / wall * 3600,
              "measured_mean_round_train_s": sum(train_walls) / len(train_walls),
              "measured_first_round_train_s": train_walls[0],
              "measured_peak_rss_mb": sampler.peak / 2**20,
              "measured_cpu_s": sum(sampler.cpu.values()),
              "measured_cpu_s_by_process": cpu_by_role(sampler.cpu, sampler.names),
              "niceness_by_process": sampler.niceness, "measured_flower_poll_cpu_s": poll.cpu_s, "flower_poll_calls": poll.calls,
              "measured_round_train_s": train_walls,
              "load_average_1min_mean": sum(sampler.loads) / max(len(sampler.loads), 1),
              "load_average_1min_max": max(sampler.loads, default=0.0),
              "final_server_accuracy": records[-1].get("server_accuracy"),
              "modelled_clock_s": records[-1]["modelled_clock_s"], "config": config, "records": records}
    print(json.dumps({k: v for k, v in result.items() if k not in ("records", "config", "measured_round_train_s")},
                     indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))


def own_mode(args) -> None:
    """``edgetrain train --sync fedavg:steps=H`` with ``--devices`` emulated devices, every one in every round
    (the same per-device batch, steps and data), measured as ``main`` measures the simulation."""
    out = Path(tempfile.mkdtemp(prefix="fleet-own-"))
    cmd = [sys.executable, "-m", "edgetrain", "train", "--devices", str(args.devices), "--model", "small_cnn",
           "--dataset", "synthetic", "--image-size", str(args.image_size),
           "--synthetic-samples", str(args.devices * args.batch_size * 2), "--partition", "iid",
           "--sync", f"fedavg:steps={args.local_steps}", "--steps", str(args.rounds * args.local_steps),
           "--batch-size", str(args.batch_size * args.devices), "--output", str(out)]
    sampler = Sampler()
    sampler.start()
    start = time.perf_counter()
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    wall = time.perf_counter() - start
    sampler.stop.set()
    sampler.join()
    result = {"mode": "edgetrain train --sync fedavg", "devices": args.devices, "rounds": args.rounds,
              "local_steps": args.local_steps, "batch_size": args.batch_size, "measured_wall_s": wall,
              "measured_cpu_s": sum(sampler.cpu.values()), "measured_peak_rss_mb": sampler.peak / 2**20,
              "measured_cpu_s_by_process": cpu_by_role(sampler.cpu, sampler.names),
              "load_average_1min_mean": sum(sampler.loads) / max(len(sampler.loads), 1), "command": cmd}
    print(json.dumps(result, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
