"""What the fleet's SecAgg+ costs: wall and CPU seconds per round with and without ``secure-aggregation`` on
Flower's simulation runtime (Ray), N virtual devices all sampled each round, small_cnn_gn on digits.

Per round is the difference between a run of ``--rounds`` rounds and a run of one round, divided by
``--rounds - 1`` (so Ray's start and the data's build, the same in both, cancel). CPU seconds are this
process's and every process below it (Ray's actors), sampled each second by ``fleet_sim.Sampler``.

Usage (from the repository root; the machine is shared, so run it niced)::

    PYTHONPATH=src nice -n 10 python benchmarks/fleet_privacy.py --devices 4 --rounds 3
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import time

from fleet_sim import Sampler

from edgetrain.fleet.simulation import SimulationResources, simulate


def timed_run(run: dict, devices: int) -> tuple[float, float]:
    """Wall and CPU seconds of one simulated run."""
    ray_dir = tempfile.mkdtemp(prefix="et-ray-")
    sampler = Sampler()
    sampler.start()
    started = time.perf_counter()
    try:
        simulate(run, devices, SimulationResources(cpus_per_device=1.0, num_cpus=devices, object_store_mb=100,
                                                   temp_dir=ray_dir))
    finally:
        wall = time.perf_counter() - started
        sampler.stop.set()
        sampler.join()
        shutil.rmtree(ray_dir, ignore_errors=True)
    return wall, sum(sampler.cpu.values())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    base = {"model": "small_cnn_gn", "local-steps": 2, "batch-size": 16, "fraction-evaluate": 0.0,
            "min-nodes": args.devices, "round-timeout": 300.0}
    results = {}
    for secure in (False, True):
        runs = {rounds: timed_run({**base, "num-rounds": rounds, "secure-aggregation": secure}, args.devices)
                for rounds in (1, args.rounds)}
        per_round = [(runs[args.rounds][i] - runs[1][i]) / (args.rounds - 1) for i in (0, 1)]
        results["secagg+" if secure else "plain"] = {"wall_s_per_round": per_round[0],
                                                     "cpu_s_per_round": per_round[1]}
    results["load_1min"] = os.getloadavg()[0]
    print(json.dumps({"devices": args.devices, "rounds": args.rounds, **results}))


if __name__ == "__main__":
    main()
