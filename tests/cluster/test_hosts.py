"""Training across separate hosts: network namespaces with their own addresses and an sshd each (tests/hosts.py).

What breaks between real hosts and not on 127.0.0.1: the interface gloo advertises (this machine's hostname
resolves to 127.0.0.1, as a Raspberry Pi's does to 127.0.1.1), the cores a process alone on its host gets,
bounded waits when a peer cannot be reached, and exits after a run. The recipes here are the ones
docs/tutorials/raspberry-pi-cluster.md gives.
"""
import json
import os
import subprocess
import sys
import time

import pytest

TRAIN = ["-m", "edgetrain", "train", "--batch-size", "16", "--no-progress", "--no-eval", "--no-throttle"]
TOKEN = "test-hosts-token"


def plain_recipe(hosts, out, steps=3, timeout=30, env=None, per_host_env=None, extra=()):
    """The plain recipe on every host: ``RANK=i WORLD_SIZE=N MASTER_ADDR=<host 0> edgetrain train``."""
    procs = []
    for i in range(len(hosts.names)):
        e = {k: v for k, v in os.environ.items() if k != "GLOO_SOCKET_IFNAME"}  # as on a fresh host
        e.update(RANK=str(i), WORLD_SIZE=str(len(hosts.names)), MASTER_ADDR=hosts.addresses[0], MASTER_PORT="29500",
                 EDGETRAIN_CLUSTER_TOKEN=TOKEN, **(env or {}), **(per_host_env or {}).get(i, {}))
        procs.append(hosts.popen(i, [sys.executable, *TRAIN, "--steps", str(steps), "--timeout", str(timeout),
                                     "--output", str(out), *extra],
                                 env=e, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    return procs


def finish(procs, timeout):
    results = []
    for p in procs:
        try:
            out, err = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            p.kill()
            out, err = p.communicate()
            err += "\n<killed by the test after its timeout>"
        results.append((p.returncode, out, err))
    return results


def summary(out):
    (path,) = out.glob("*/summary.json")
    return json.loads(path.read_text())


@pytest.mark.slow
def test_plain_recipe_uses_every_core_and_finds_the_interface(test_hosts, tmp_path):
    """Two hosts, no GLOO_SOCKET_IFNAME (the hostname resolves to loopback here): gloo is put on the interface
    that reaches MASTER_ADDR, and each process, alone on its host, uses all the host's cores."""
    hosts = test_hosts(2, ssh=False)
    results = finish(plain_recipe(hosts, tmp_path / "runs"), 150)
    for code, out, err in results:
        assert code == 0, err[-3000:]
    devices = summary(tmp_path / "runs")["per_device"]
    cores = sorted(os.sched_getaffinity(0))
    assert [d["cores"] for d in devices] == [cores, cores]
    assert [d["threads"] for d in devices] == [len(cores)] * 2


@pytest.mark.slow
def test_timeout_bounds_every_rank_and_names_the_interface(test_hosts, tmp_path):
    """gloo on loopback (GLOO_SOCKET_IFNAME=lo, what a hostname mapped to 127.0.1.1 gives): the peers cannot
    reach each other. Every rank ends within
    --timeout plus a bound (gloo alone retries four times as long) with one line naming GLOO_SOCKET_IFNAME."""
    hosts = test_hosts(2, ssh=False)
    timeout = 20
    started = time.monotonic()
    procs = plain_recipe(hosts, tmp_path / "runs", timeout=timeout, env={"GLOO_SOCKET_IFNAME": "lo"})
    results = finish(procs, 150)
    took = time.monotonic() - started
    for code, out, err in results:
        assert code == 2, err[-3000:]
        lines = [line for line in err.splitlines() if line.startswith("edgetrain: error:")]
        assert lines and "GLOO_SOCKET_IFNAME" in lines[-1], err[-3000:]
        assert "Traceback" not in err
    assert took < timeout + 35, f"took {took:.0f} s for --timeout {timeout}"
