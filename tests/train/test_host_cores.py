"""Emulated devices share the launcher's cores as they are when the run is planned, not the cores of the fork
server they are forked from (which keeps the affinity of the run that started it)."""
import json
import os
import subprocess
import sys

import pytest

SCRIPT = """
import json, os, edgetrain
if __name__ == "__main__":
    cores = sorted(os.sched_getaffinity(0))[:2]
    run = dict(dataset="digits", steps=2, batch_size=16, eval=False, progress=False, throttle=False,
               output={out!r})
    os.sched_setaffinity(0, cores[:1])          # a first run on one core starts the fork server there
    edgetrain.train(dict(run, devices=1))
    os.sched_setaffinity(0, cores)
    summary = edgetrain.train(dict(run, devices=2))
    print("CORES", json.dumps([[d["cores"] for d in summary["per_device"]], cores]))
"""


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity") or len(os.sched_getaffinity(0)) < 2,
                    reason="needs two cores to share out")
def test_devices_share_the_launchers_cores_not_the_fork_servers(tmp_path):
    script = tmp_path / "two_runs.py"
    script.write_text(SCRIPT.format(out=str(tmp_path / "runs")))
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    line = next(line for line in done.stdout.splitlines() if line.startswith("CORES"))
    per_device, cores = json.loads(line.removeprefix("CORES"))
    assert per_device == [[cores[0]], [cores[1]]], line
