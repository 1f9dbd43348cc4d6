"""What the fleet's SecAgg+ costs: wall seconds per round with and without ``secure-aggregation`` on Flower's
simulation runtime (Ray), N virtual devices all sampled each round, small_cnn_gn on digits.

A round's time is its record's ``measured_train_wall_s`` (from the strategy sampling the devices to its
aggregate: for SecAgg+ its four stages, key exchange to unmasking); the plain run gets records from a
modelled population of one profile (nothing else changes). The median over rounds 2.. (round 1 starts the
actors) is reported with the machine's load.

Usage (from the repository root; the machine is shared, so run it niced)::

    PYTHONPATH=src nice -n 10 python benchmarks/fleet_privacy.py --devices 4 --rounds 4
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile

from edgetrain.fleet.simulation import SimulationResources, simulate


def round_times(run: dict, devices: int) -> list[float]:
    """Each round's measured wall seconds of one simulated run."""
    ray_dir, out = tempfile.mkdtemp(prefix="et-ray-"), tempfile.mkdtemp(prefix="et-fp-")
    try:
        simulate({**run, "output-dir": out}, devices,
                 SimulationResources(cpus_per_device=1.0, num_cpus=min(devices, os.cpu_count() or 1),
                                     object_store_mb=100, temp_dir=ray_dir))
        with open(os.path.join(out, "fleet-rounds.jsonl")) as f:
            return [json.loads(line)["measured_train_wall_s"] for line in f]
    finally:
        shutil.rmtree(ray_dir, ignore_errors=True)
        shutil.rmtree(out, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=4)
    args = parser.parse_args()
    base = {"model": "small_cnn_gn", "local-steps": 2, "batch-size": 16, "fraction-evaluate": 0.0,
            "min-nodes": args.devices, "round-timeout": 300.0, "num-rounds": args.rounds,
            "secagg-clip-range": 1.0}
    results = {"devices": args.devices, "rounds": args.rounds}
    for name, extra in (("plain", {"population": "100% jetson-orin-nano@lan-1g"}),
                        ("secagg+", {"secure-aggregation": True})):
        loads = [os.getloadavg()[0]]
        times = round_times({**base, **extra}, args.devices)
        loads.append(os.getloadavg()[0])
        results[name] = {"round_s": times, "median_round_s_after_first": statistics.median(times[1:]),
                         "load_1min_before_after": loads}
    print(json.dumps(results))


if __name__ == "__main__":
    main()
