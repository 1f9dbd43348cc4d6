"""edgetrain.fleet on Flower's real processes on 127.0.0.1: a SuperLink, three SuperNodes (one misconfigured,
so its ClientApp fails every round) and `flwr run` of the app in src/edgetrain/fleet/flower-app."""
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("flwr", reason="the fleet extra is not installed (pip install edgetrain[fleet])")

from edgetrain_testing import REPO  # noqa: E402

BIN = Path(sys.executable).parent
APP = REPO / "src" / "edgetrain" / "fleet" / "flower-app"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(args: list[str], log: Path, env: dict) -> subprocess.Popen:
    # a session of its own, so that stopping it stops the SuperExec and app processes it starts
    return subprocess.Popen([str(BIN / args[0]), *args[1:]], stdout=log.open("w"), stderr=subprocess.STDOUT,
                            env=env, start_new_session=True)


def stop(processes: list[subprocess.Popen]) -> None:
    for p in processes:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGTERM)
    deadline = time.monotonic() + 15
    for p in processes:
        try:
            p.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait(timeout=5)


@pytest.mark.slow
def test_a_fleet_on_flowers_own_processes_trains_and_drops_a_failing_node(tmp_path):
    link = free_port()
    env = {**os.environ, "FLWR_HOME": str(tmp_path / "flwr"), "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}"}
    (tmp_path / "flwr").mkdir()
    (tmp_path / "flwr" / "config.toml").write_text(
        f'[superlink]\ndefault = "fleet"\n\n[superlink.fleet]\naddress = "127.0.0.1:{link}"\ninsecure = true\n')
    nodes = ["partition-id=0 num-partitions=2", "partition-id=1 num-partitions=2",
             "partition-id=2 num-partitions=2"]  # the last one is outside 0..1: its ClientApp raises every round
    processes = []
    try:
        processes.append(start(["flower-superlink", "--insecure", "--disable-runtime-dependency-installation",
                                "--port", str(link)], tmp_path / "superlink.log", env))
        for i, node_config in enumerate(nodes):
            processes.append(start(["flower-supernode", "--insecure", "--superlink", f"127.0.0.1:{link}",
                                    "--port", str(free_port()), "--node-config", node_config],
                                   tmp_path / f"supernode{i}.log", env))
        # No federated evaluation: each evaluate phase starts another ClientApp process on every node, and
        # what it computes is checked in-process (test_fleet_app.py, the evaluation and the saved model).
        run = subprocess.run([str(BIN / "flwr"), "run", str(APP), "fleet", "--stream", "--run-config",
                              "num-rounds=2 local-steps=5 lr=0.1 min-nodes=3 round-timeout=60.0 "
                              "fraction-evaluate=0.0"],
                             capture_output=True, text=True, env=env, timeout=240)
    finally:
        stop(processes)
    log = run.stdout + run.stderr
    assert "Strategy execution finished" in log, log[-3000:]
    assert log.count("aggregate_train: Received 2 results and 1 failures") == 2, log[-3000:]
    assert "partition-id 2 is outside 0..1" in log + "".join(
        (tmp_path / f"supernode{i}.log").read_text() for i in range(3)), log[-3000:]
    losses = [float(x) for x in re.findall(r"Aggregated MetricRecord: \{'train-loss': ([0-9.]+)", log)]
    assert len(losses) == 2 and losses[1] < losses[0], losses
