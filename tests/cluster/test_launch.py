"""The one spawner (``cluster/launch.py``): results by rank, and nothing left running when a device fails
or a launch runs past its deadline. Device functions live at module level so spawned processes import them."""
from __future__ import annotations

import os
import subprocess
import time

import psutil
import pytest
import torch
import torch.distributed as dist

from edgetrain.cluster.launch import is_fork_server, run_group
from edgetrain.errors import EdgetrainError


def tensors_by_rank(rank: int, world: int, scale: float) -> dict:
    total = torch.full((3,), float(rank + 1))
    dist.all_reduce(total)
    return {"rank": rank, "world": world, "sum": total * scale, "threads": torch.get_num_threads()}


def fail_on_rank_1_with_a_grandchild(rank: int, world: int, pid_file: str) -> None:
    """Rank 0 starts a long-lived process of its own and blocks in a barrier; rank 1 fails."""
    if rank == 1:
        raise ValueError("rank 1 broke on purpose")
    helper = subprocess.Popen(["sleep", "120"])
    with open(pid_file, "w") as f:
        f.write(str(helper.pid))
    dist.barrier()  # never completes: rank 1 does not come


def sleep_forever(rank: int, world: int) -> None:
    time.sleep(120)


def _our_descendants() -> list[psutil.Process]:
    return [p for p in psutil.Process().children(recursive=True)
            if not is_fork_server(p)]  # multiprocessing's helpers, shared and kept


def _running(pid: int, grace_s: float = 5.0) -> bool:
    """Still running after ``grace_s``: the kernel delivers the parent-death signal at once, but a loaded
    host may take a moment to schedule the dying process."""
    deadline = time.monotonic() + grace_s
    while True:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                return False
        except psutil.NoSuchProcess:
            return False
        if time.monotonic() > deadline:
            return True
        time.sleep(0.05)


def test_run_group_returns_tensors_by_rank_from_one_gloo_group():
    results = run_group(tensors_by_rank, 2, 0.5, timeout_s=30, deadline_s=120)
    assert [r["rank"] for r in results] == [0, 1] and {r["world"] for r in results} == {2}
    for r in results:
        assert torch.equal(r["sum"], torch.full((3,), 1.5)) and r["threads"] == 1
    assert not _our_descendants()


def test_a_failing_device_stops_the_others_and_what_they_started(tmp_path):
    pid_file = tmp_path / "grandchild.pid"
    started = time.monotonic()
    with pytest.raises(EdgetrainError) as e:
        run_group(fail_on_rank_1_with_a_grandchild, 2, str(pid_file), timeout_s=60, deadline_s=120)
    message = str(e.value)
    assert "\n" not in message and message.startswith("device 1 failed: ValueError: rank 1 broke on purpose")
    assert time.monotonic() - started < 30  # not the 60 s the barrier would wait
    assert not _running(int(pid_file.read_text()))
    assert not _our_descendants()


def test_a_launch_past_its_deadline_is_stopped_in_one_line():
    started = time.monotonic()
    with pytest.raises(EdgetrainError, match=r"^device 0, device 1 did not finish within 2 s and were stopped; "
                                             r"try fewer steps$"):
        run_group(sleep_forever, 2, deadline_s=2, deadline_fix="try fewer steps")
    assert time.monotonic() - started < 20
    assert not _our_descendants()
    assert os.environ.get("EDGETRAIN_LAUNCHER_PID") is None
