"""The fleet on Flower's simulation runtime (Ray): 20 virtual devices of a population, on/off availability,
3 rounds, through ``edgetrain.fleet.simulation.simulate`` in a process of its own; every Ray process it
started must be gone soon after it returns."""
import json
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
import time

import psutil
import pytest

pytest.importorskip("ray", reason="the simulation runtime is not installed (pip install edgetrain[fleet])")

from edgetrain.errors import EdgetrainError  # noqa: E402
from edgetrain.fleet.simulation import SimulationResources, simulate  # noqa: E402

RUN = {"num-rounds": 3, "local-steps": 2, "batch-size": 8, "fraction-train": 0.5, "fraction-evaluate": 0.0,
       "server-evaluate": True, "partition": "dirichlet:0.5", "min-nodes": 20, "lr": 0.1,
       "population": "60% rpi4@wifi-20m, 30% smart-speaker-2g@lte-10m, 10% jetson-orin-nano",
       "availability": "onoff:60s:30s", "round-timeout": 120.0}


def run_watching_descendants(cmd: list[str], timeout: float,
                             niceness: dict[int, int] | None = None) -> tuple[subprocess.CompletedProcess, list]:
    """Run ``cmd``; return its result and every process below it seen while it ran (Ray's GCS, raylet and
    actors, whose titles do not name the run) that has not ended 60 s after it (Ray's teardown is
    asynchronous: actors end a few seconds after ``ray.shutdown``). ``niceness``: each Ray worker's seen."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    seen, deadline = {}, time.monotonic() + timeout
    while proc.poll() is None:
        try:
            children = psutil.Process(proc.pid).children(recursive=True)
        except psutil.Error:
            children = []
        seen.update({child.pid: child for child in children})
        for child in children if niceness is not None else ():
            try:  # one by one: a process that ended since must not hide the others (Ray starts short-lived ones)
                if " ".join(child.cmdline()).startswith(("ray::IDLE", "ray::ClientAppActor")):  # titles, not names
                    niceness[child.pid] = child.nice()
            except psutil.Error:
                pass
        if time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"the simulation did not end within {timeout:.0f} s")
        time.sleep(0.2)
    out, err = proc.communicate()
    _, alive = psutil.wait_procs(list(seen.values()), timeout=60)
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err), [p.pid for p in alive]


@pytest.mark.slow  # Ray's start and 20 devices' rounds: 47 s at load ~10, 147 s at ~30 (2-core machine)
def test_a_small_simulated_fleet_trains_with_availability_and_leaves_no_process(tmp_path):
    ray_dir = tempfile.mkdtemp(prefix="et-ray-")  # short: Ray's socket paths must fit 107 bytes
    try:
        run = {**RUN, "output-dir": str(tmp_path)}
        code = textwrap.dedent(f"""
            from edgetrain.fleet.simulation import SimulationResources, simulate
            simulate({run!r}, 20,
                     SimulationResources(cpus_per_device=1.0, object_store_mb=100, temp_dir={ray_dir!r}))
        """)
        workers: dict[int, int] = {}
        done, left = run_watching_descendants([sys.executable, "-c", code], timeout=300, niceness=workers)
        assert done.returncode == 0, done.stderr[-3000:]
        records = [json.loads(line) for line in (tmp_path / "fleet-rounds.jsonl").read_text().splitlines()]
        assert [r["round"] for r in records] == [1, 2, 3]
        for r in records:
            assert r["devices"] == 20 and r["sampled"] == min(10, r["online"]) and r["online"] < 20
            assert r["aggregated"] + r["dropouts"] + r["late"] == r["sampled"]
            assert 0.0 <= r["server_accuracy"] <= 1.0 and r["modelled_round_s"] > 0
        assert (tmp_path / "global_model.pt").is_file()
        assert records[-1]["server_loss"] < 2.30  # from ln(10) = 2.3026 at the start
        assert left == []
        assert workers and set(workers.values()) == {os.nice(0)}  # the actors run as the run does (Ray's own: +15)
    finally:
        shutil.rmtree(ray_dir, ignore_errors=True)


def test_a_bad_simulation_is_refused_before_ray_starts():
    with pytest.raises(EdgetrainError, match="population"):
        simulate({"availability": "onoff:1m:1m"}, 20)
    with pytest.raises(EdgetrainError, match="fewer samples than its local batch"):  # digits: 1,437 training images
        simulate({"partition": "dirichlet:0.5", "batch-size": 8}, 1000)
    with pytest.raises(EdgetrainError, match="at least 1 device"):
        simulate({}, 0)
    with pytest.raises(EdgetrainError, match="cpus per device"):
        SimulationResources(cpus_per_device=0).backend_config()
    with pytest.raises(EdgetrainError, match="worker niceness must be 0..19"):
        SimulationResources(worker_niceness=-5).backend_config()


def test_joining_a_cluster_keeps_its_temp_dir_and_refuses_what_its_nodes_decide():
    joined = SimulationResources(address="auto", temp_dir="/tmp/rc1/n0").backend_config()["init_args"]
    # "auto" finds the cluster whose `ray start --temp-dir` this is, not /tmp/ray's or any GCS on the machine
    assert joined == {"address": "auto", "_temp_dir": "/tmp/rc1/n0", "logging_level": "warning", "log_to_driver": True}
    assert "_temp_dir" not in SimulationResources(address="10.213.1.1:6379").backend_config()["init_args"]
    with pytest.raises(EdgetrainError, match="ray start --num-cpus"):
        SimulationResources(address="10.213.1.1:6379", num_cpus=4).backend_config()
    with pytest.raises(EdgetrainError, match="RAY_worker_niceness=5 ray start"):
        SimulationResources(address="10.213.1.1:6379", worker_niceness=5).backend_config()
