"""A finished device's exit cannot abort (docs/design/shutdown.md).

``terminate called without an active exception`` (SIGABRT, exit 134) after a successful run comes from a
thread that is inside native code with the GIL released when the interpreter finalizes: as it returns it
must retake the GIL, Python ends the thread with ``pthread_exit``, and the unwinding through a C++
``noexcept`` frame (pybind11's GIL guard, a destructor) calls ``std::terminate``. The test makes that
deterministic: ``sitecustomize`` gives the device a daemon thread that waits in a TCPStore call (as any
native thread of gloo, the store or a library can) and makes finalization last longer than one such wait.
A device of the plain recipe must still exit 0: it leaves with ``os._exit`` once its output is flushed,
without finalizing the interpreter. Before it did, this exited 134.
"""
import os
import subprocess
import sys

import pytest

from edgetrain_testing import REPO

NATIVE_THREAD_AT_EXIT = '''
import datetime, threading, time
import torch.distributed as dist

_store = dist.TCPStore("127.0.0.1", 0, 1, True, timeout=datetime.timedelta(seconds=60), wait_for_workers=False)


def _wait_in_native_code():
    client = dist.TCPStore("127.0.0.1", _store.port, 1, False, timeout=datetime.timedelta(seconds=60))
    while True:  # each wait blocks 1 s in C++ with the GIL released, then raises its timeout
        try:
            client.wait(["never-set"], datetime.timedelta(seconds=1))
        except Exception:
            pass


threading.Thread(target=_wait_in_native_code, daemon=True).start()


class _SlowFinalization:  # cleared with this module's globals, after the interpreter began finalizing
    def __del__(self):
        time.sleep(2.5)


_slow = _SlowFinalization()
'''


@pytest.mark.slow
def test_a_device_with_a_native_thread_at_exit_leaves_with_its_code(tmp_path):
    (tmp_path / "sitecustomize.py").write_text(NATIVE_THREAD_AT_EXIT)
    env = {k: v for k, v in os.environ.items() if k not in ("GLOO_SOCKET_IFNAME", "LOCAL_RANK")}
    env.update(PYTHONPATH=os.pathsep.join(filter(None, [str(tmp_path), str(REPO / "src"), env.get("PYTHONPATH")])),
               RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT="29581",
               EDGETRAIN_CLUSTER_TOKEN="exit-test-token")
    done = subprocess.run([sys.executable, "-m", "edgetrain", "train", "--batch-size", "16", "--no-progress",
                           "--no-eval", "--no-throttle", "--steps", "2", "--timeout", "30",
                           "--output", str(tmp_path / "runs")],
                          env=env, cwd=tmp_path, capture_output=True, text=True, timeout=180)
    assert "terminate called" not in done.stderr, done.stderr[-2000:]
    assert done.returncode == 0, done.stderr[-2000:]
    assert len(list((tmp_path / "runs").glob("*/summary.json"))) == 1
