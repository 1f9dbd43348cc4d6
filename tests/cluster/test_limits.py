"""--device-limits cgroup (cluster/limits.py): kernel limits made, applied to the device process, removed;
a refused write is one line; a host without cgroup v1 falls back, labelled; a device is charged for all the
memory it holds (also what it shares with the fork server it was forked from) and cannot hold more."""
import os
import re
from pathlib import Path

import psutil
import pytest
import torch

from edgetrain.cluster import limits
from edgetrain.cluster.limits import DeviceLimits, block_device
from edgetrain.cluster.profiles import STORAGES
from edgetrain.config import STORAGE_NAMES
from edgetrain.errors import EdgetrainError

REAL = Path("/sys/fs/cgroup")
HAS_V1 = os.geteuid() == 0 and (REAL / "memory" / "cgroup.procs").is_file() and (REAL / "blkio" / "cgroup.procs").is_file()


def test_the_config_knows_every_storage():
    assert set(STORAGE_NAMES) == set(STORAGES)


def _inside(data_dir):
    device = DeviceLimits("device 0", 3000, STORAGES["sd-card"], data_dir).apply()
    groups = [str(g) for g in device.made]
    seen = {g: (Path(g) / "cgroup.procs").read_text().split() for g in groups}
    memory = {name: int((REAL / "memory" / f"edgetrain-{os.getpid()}-memory" / name).read_text())
              for name in ("memory.limit_in_bytes", "memory.soft_limit_in_bytes")}
    bound = device.memory_bound
    device.close()
    return groups, seen, memory, device.held_alone_bytes, device.describe() if bound else "not bound", str(os.getpid())


@pytest.mark.skipif(not HAS_V1, reason="needs root and cgroup v1 memory and blkio")
def test_a_device_runs_inside_its_groups_and_they_are_removed(tmp_path):
    from edgetrain.cluster.launch import Deadline, launch_local

    (groups, seen, memory, held_alone, described, pid), = launch_local(1, _inside, (str(tmp_path),), ["device 0"],
                                                                        deadline=Deadline(120))
    # the hard limit: the profile's memory less what the process held alone before joining (charged elsewhere);
    # the soft limit records the profile's figure
    assert memory == {"memory.limit_in_bytes": 3000 * 2 ** 20 - held_alone,
                      "memory.soft_limit_in_bytes": 3000 * 2 ** 20} and described != "not bound"
    assert 0 < held_alone < 32 * 2 ** 20 and f"{held_alone >> 20} MiB its process held before joining" in described
    assert all(pid in procs for procs in seen.values())
    assert not any(Path(g).exists() for g in groups)
    if block_device(tmp_path)[0]:
        assert len(groups) == 2 and "storage sd-card" in described and "50 MB/s, 1500 IOPS" in described


@pytest.mark.skipif(not HAS_V1, reason="needs root and cgroup v1")
def test_a_refused_cgroup_write_is_one_line_and_leaves_no_group(monkeypatch, tmp_path):
    real_write = Path.write_text

    def refuse(self, text, *a, **k):
        if self.name == "memory.limit_in_bytes":
            raise OSError(22, "Invalid argument")
        return real_write(self, text, *a, **k)

    monkeypatch.setattr(Path, "write_text", refuse)
    device = DeviceLimits("device 0", 64000, None, str(tmp_path))
    with pytest.raises(EdgetrainError) as caught:
        device.apply()
    message = str(caught.value)
    assert "\n" not in message and "memory.limit_in_bytes (Invalid argument); run edgetrain as root" in message
    assert not list((REAL / "memory").glob(f"edgetrain-{os.getpid()}-*"))


def test_a_host_without_cgroup_v1_falls_back_labelled(monkeypatch, tmp_path):
    monkeypatch.setattr(limits, "ROOT", tmp_path / "nothing")
    device = DeviceLimits("device 0", 512, STORAGES["nvme"], str(tmp_path)).apply()
    assert not device.made and not device.memory_bound
    assert "fallback: no writable cgroup v1 memory hierarchy" in device.describe()
    device.close()


def test_tmpfs_has_no_block_device_to_throttle():
    device, why = block_device("/proc")
    assert device is None and "without a block device" in why


def _rss_anon_mib() -> float:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) / 1024 for line in status if line.startswith("RssAnon:"))


def _holds(room_mb: int, allocate_mb: int, memory_mb: int | None = None) -> dict:
    """A device (forked from the launcher's fork server, as in training) whose profile has ``room_mb`` MiB more
    than it holds at start, or ``memory_mb``: it joins its memory group, then allocates ``allocate_mb`` MiB."""
    memory_mb = memory_mb or int(_rss_anon_mib()) + room_mb
    device = DeviceLimits("device 0", memory_mb, None, None).apply()
    try:
        block = bytearray(allocate_mb * 2 ** 20)  # zero-filled: every page touched
        charged = int((device.made[0] / "memory.usage_in_bytes").read_text()) / 2 ** 20
        held_alone = getattr(device, "held_alone_bytes", 0) / 2 ** 20
        return {"rss_anon": _rss_anon_mib(), "charged": charged, "held_alone": held_alone, "block": len(block)}
    finally:
        device.close()


@pytest.mark.skipif(not HAS_V1, reason="needs root and cgroup v1 memory")
def test_a_device_under_its_profile_lives_and_its_group_covers_all_it_holds():
    from edgetrain.cluster.launch import Deadline, launch_local

    held, = launch_local(1, _holds, (96, 32), ["device 0 (small)"], deadline=Deadline(120))
    # its copy of the fork server's pages (torch, about 220 MiB) is charged to it; the few MiB it held alone
    # before joining came off its limit
    assert held["rss_anon"] > 150 and held["held_alone"] < 32, held
    assert held["charged"] + held["held_alone"] >= held["rss_anon"] - 2, held  # 2 MiB: the kernel counts in batches


@pytest.mark.skipif(not HAS_V1, reason="needs root and cgroup v1 memory")
def test_a_device_that_allocates_past_its_profile_is_killed_and_named():
    from edgetrain.cluster.launch import Deadline, launch_local

    with pytest.raises(EdgetrainError) as caught:  # 96 MiB of room, 160 allocated
        launch_local(1, _holds, (96, 160), ["device 0 (small)"], deadline=Deadline(120))
    assert re.search(r"^device 0 \(small\) failed: its process was killed \(SIGKILL\) by the kernel's out-of-memory "
                     r"killer at its memory limit of \d+ MiB, page cache included", str(caught.value)), caught.value


@pytest.mark.skipif(not HAS_V1, reason="needs root and cgroup v1 memory")
def test_a_profile_smaller_than_what_a_device_holds_at_start_is_one_line():
    from edgetrain.cluster.launch import Deadline, launch_local

    with pytest.raises(EdgetrainError) as caught:
        launch_local(1, _holds, (0, 0, 96), ["device 0 (tiny)"], deadline=Deadline(120))
    assert re.fullmatch(r"device 0 \(tiny\) failed: its profile's memory_mb of 96 MiB is less than the \d+ MiB of "
                        r"memory its process holds before training \(torch and edgetrain loaded\); give its profile "
                        r"more memory_mb, or use --device-limits off; the other devices were stopped",
                        str(caught.value)), caught.value
    # its group went with it (the groups of devices still running, another run's, may be there)
    groups = (REAL / "memory").glob("edgetrain-*-memory")
    assert not [g for g in groups if not psutil.pid_exists(int(g.name.split("-")[1]))]


class _Greedy(torch.utils.data.Dataset):
    """Each item takes 640 MiB in the loader worker that reads it, which the out-of-memory killer is asked to
    choose first (the kernel picks the group's largest process, which a worker just started may not be yet)."""

    def __len__(self):
        return 8

    def __getitem__(self, key):
        Path("/proc/self/oom_score_adj").write_text("1000")
        held = bytearray(640 * 2 ** 20)
        return torch.zeros(2), len(held) % 2


def _worker_past_the_limit() -> str:
    from edgetrain.data.sampler import GlobalBatchSampler
    from edgetrain.data.storage import LoaderOptions, TrainingLoader

    # room for the worker to start (forked, it copies much of the device's heap as Python touches it)
    device = DeviceLimits("device 0", int(_rss_anon_mib()) + 320, None, None).apply()
    loader = TrainingLoader(_Greedy(), GlobalBatchSampler(8, [4], 0, shuffle=False),
                            torch.utils.data.default_collate, "device 0", LoaderOptions(1, 1, 60))
    try:
        for _ in loader:
            pass
    except EdgetrainError as e:
        return str(e)
    finally:
        device.close()
    return "no error"


class _Parent(torch.utils.data.Dataset):
    def __len__(self):
        return 2

    def __getitem__(self, key):
        return torch.tensor(os.getppid())


def _workers_parent() -> tuple[int, list[int]]:
    loader = torch.utils.data.DataLoader(_Parent(), batch_size=1, num_workers=1)
    return os.getpid(), [int(batch) for batch in loader]


def test_a_devices_loader_workers_are_forked_by_the_device():
    """As a torchrun worker's: in its memory group and process group, its SIGCHLD telling it at once of a dead
    worker (not at the loader's timeout), not started by a fork server of the device's own."""
    from edgetrain.cluster.launch import Deadline, launch_local

    (device, parents), = launch_local(1, _workers_parent, (), ["device 0"], deadline=Deadline(120))
    assert parents == [device, device]


@pytest.mark.skipif(not HAS_V1, reason="needs root and cgroup v1 memory")
def test_a_loader_worker_the_oom_killer_ends_is_named_as_such():
    from edgetrain.cluster.launch import Deadline, launch_local

    message, = launch_local(1, _worker_past_the_limit, (), ["device 0"], deadline=Deadline(120))
    assert re.fullmatch(r"device 0: data-loader worker 0 \(pid \d+\) was killed by SIGKILL \(9\); the kernel's "
                        r"out-of-memory killer, at the device's memory limit of \d+ MiB \(page cache included\): "
                        r"lower --workers, --prefetch or --cache-mb, or give its profile more memory_mb",
                        message), message


@pytest.mark.skipif(not HAS_V1, reason="needs root and cgroup v1 memory")
def test_a_device_the_oom_killer_ends_is_named_as_such_with_the_fix(tmp_path):
    from edgetrain_testing import run_cli

    # 300 MiB: torch and edgetrain (about 230 MiB) fit, the first batches of ResNet-18 activations do not
    cluster = tmp_path / "cluster.yaml"
    cluster.write_text("profiles:\n  tiny: {base: host, memory_mb: 300}\ndevices:\n  - tiny\n")
    proc = run_cli("train", "--cluster", str(cluster), "--device-limits", "cgroup", "--model", "resnet18",
                   "--dataset", "synthetic", "--image-size", "64", "--batch-size", "64", "--steps", "3",
                   "--no-progress", "--no-eval", "--output", str(tmp_path / "runs"), timeout=180)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode != 0 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert "killed (SIGKILL) by the kernel's out-of-memory killer at its memory limit of 300 MiB" in lines[-1]
    assert "give its profile more memory_mb" in lines[-1]
