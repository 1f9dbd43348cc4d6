"""torchrun restarts continue the run (train/checkpoint.py, "torchrun restarts"): two torchrun "nodes" on 127.0.0.1.

Each node is a torchrun agent with one worker, ``--nnodes 1:2`` over one c10d rendezvous; node a serves the
rendezvous store (``is_host=1``). Node b is killed with its worker (SIGKILL): a's worker loses its peer and
fails, a's agent restarts it alone, and it continues from the run's checkpoint on 1 device. Node b started
again joins at the next rendezvous (a's agent stops its worker, which writes a checkpoint on SIGTERM), and
both continue from there on 2 devices to the last step. So that this does not depend on how fast the host
trains, a's lone worker is held (SIGSTOP) from its first checkpoint until a's agent has seen b waiting.
Every wait is bounded.
"""
import contextlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch

from edgetrain.cluster.launch import _loopback_interface, free_port
from edgetrain.train.checkpoint import checkpoint_files, checkpoint_step

RUN_ID = "elastic-test"
STEPS = 120
TRAIN = ["-m", "edgetrain", "train", "--dataset", "synthetic", "--image-size", "16", "--synthetic-samples", "1024",
         "--batch-size", "32", "--steps", str(STEPS), "--checkpoint-every", "5", "--no-progress", "--no-eval",
         "--no-throttle", "--timeout", "20"]


def start_node(tmp_path: Path, port: int, name: str, serves: bool) -> subprocess.Popen:
    rendezvous = ["--nnodes", "1:2", "--nproc-per-node", "1", "--rdzv-backend", "c10d",
                  "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", RUN_ID, "--max-restarts", "3",
                  "--monitor-interval", "0.5", "--local-addr", "127.0.0.1",
                  "--rdzv-conf", f"is_host={int(serves)},join_timeout=60,last_call_timeout=1,"
                                 "keep_alive_interval=1,keep_alive_max_attempt=3"]
    # TORCH_DISABLE_SHARE_RDZV_TCP_STORE: a node that joins a later round can meet rank 0 (ssh_launch.py says why)
    env = {**os.environ, "LOGLEVEL": "INFO", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", "GLOO_SOCKET_IFNAME": _loopback_interface() or "lo"}
    log = open(tmp_path / f"{name}.log", "a")
    return subprocess.Popen([sys.executable, "-m", "torch.distributed.run", *rendezvous, *TRAIN,
                             "--output", str(tmp_path / "runs")], env=env, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)  # its own process group: the kill takes its worker too


def wait_until(condition, timeout_s: float, what: str, nodes) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline or any(n.poll() not in (None, 0) for n in nodes):
            pytest.fail(f"{what} did not happen within {timeout_s:g} s (node exits {[n.poll() for n in nodes]})")
        time.sleep(0.2)


def processes(node: subprocess.Popen) -> list[psutil.Process]:
    """A node's torchrun agent and its workers (each worker has a session of its own)."""
    with_agent = [psutil.Process(node.pid)] if node.poll() is None else []
    return with_agent + [p for a in with_agent for p in a.children(recursive=True)]


def kill(node: subprocess.Popen) -> None:
    for p in processes(node):
        p.kill()
    node.wait(10)


def membership(run_dir: Path) -> list[dict]:
    path = run_dir / "membership.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []


@pytest.mark.slow
def test_killed_node_leaves_and_rejoins_and_the_run_goes_on_to_its_last_step(tmp_path):
    port = free_port()
    run_dir = tmp_path / "runs" / f"train-{RUN_ID}"
    a = start_node(tmp_path, port, "a", serves=True)
    b = start_node(tmp_path, port, "b", serves=False)
    nodes = [a, b]
    workers = []
    try:
        wait_until(lambda: checkpoint_files(run_dir), 120, "a first checkpoint", nodes)
        kill(b)  # node b crashes: its agent and its worker
        nodes = [a]
        wait_until(lambda: [m["world"] for m in membership(run_dir)] == [1], 90,
                   "node a going on alone", nodes)
        alone_from = membership(run_dir)[0]["step"]
        wait_until(lambda: checkpoint_step(checkpoint_files(run_dir)[-1]) > alone_from, 90,
                   "a checkpoint of node a alone", nodes)
        workers = processes(a)[1:]
        for worker in workers:  # held until the rendezvous has seen b, however fast it would train alone
            worker.suspend()
        b = start_node(tmp_path, port, "b", serves=False)  # node b back: it joins at the next rendezvous
        nodes = [a, b]
        wait_until(lambda: "Detected 1 new nodes" in (tmp_path / "a.log").read_text(), 90, "node b waiting", nodes)
        for worker in workers:
            worker.resume()  # it takes the agent's SIGTERM: a checkpoint at its next step, then it stops
        wait_until(lambda: [m["world"] for m in membership(run_dir)] == [1, 2], 90, "node b rejoining",
                   nodes)
        assert a.wait(180) == 0 and b.wait(60) == 0
    finally:
        for worker in workers:
            with contextlib.suppress(psutil.Error):
                worker.resume()
        for node in (a, b):
            kill(node)
    logs = "".join((tmp_path / f"{n}.log").read_text() for n in "ab")
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == STEPS and summary["devices"] == 2, logs[-3000:]
    steps = {json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()}
    assert steps == set(range(STEPS))
    assert [(m["kind"], m["world"], m["cause"]) for m in membership(run_dir)] == [
        ("leave", 1, "torchrun restart"), ("join", 2, "torchrun restart")]
    # The newest checkpoint after the rejoin holds both devices' models: the same parameters (BatchNorm's
    # running statistics are each device's own with --batchnorm local).
    newest = torch.load(checkpoint_files(run_dir)[-1], weights_only=True)
    assert newest["world"] == 2
    ours, theirs = (d["strategy"]["model"] for d in newest["devices"])
    parameters = [k for k in ours if not k.endswith(("running_mean", "running_var", "num_batches_tracked"))]
    assert parameters and all(torch.equal(ours[k], theirs[k]) for k in parameters)
    assert not list((tmp_path / "runs").glob(f"train-{RUN_ID}-*"))  # no restart began a new run
