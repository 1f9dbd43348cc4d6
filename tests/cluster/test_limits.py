"""--device-limits cgroup (cluster/limits.py): kernel limits made, applied to the device process, removed;
a refused write is one line; a host without cgroup v1 falls back, labelled."""
import multiprocessing as mp
import os
from pathlib import Path

import pytest

from edgetrain.cluster import limits
from edgetrain.cluster.limits import DeviceLimits, block_device
from edgetrain.cluster.profiles import STORAGES
from edgetrain.config import STORAGE_NAMES
from edgetrain.errors import EdgetrainError

REAL = Path("/sys/fs/cgroup")
HAS_V1 = os.geteuid() == 0 and (REAL / "memory" / "cgroup.procs").is_file() and (REAL / "blkio" / "cgroup.procs").is_file()


def test_the_config_knows_every_storage():
    assert set(STORAGE_NAMES) == set(STORAGES)


def _inside(data_dir, queue):
    device = DeviceLimits("device 0", 3000, STORAGES["sd-card"], data_dir).apply()
    groups = [str(g) for g in device.made]
    seen = {g: (Path(g) / "cgroup.procs").read_text().split() for g in groups}
    memory = (REAL / "memory" / f"edgetrain-{os.getpid()}-memory" / "memory.limit_in_bytes").read_text().strip()
    bound = device.memory_bound
    device.close()
    queue.put((groups, seen, memory, device.describe() if bound else "not bound", str(os.getpid())))


@pytest.mark.skipif(not HAS_V1, reason="needs root and cgroup v1 memory and blkio")
def test_a_device_runs_inside_its_groups_and_they_are_removed(tmp_path):
    queue = mp.get_context("fork").Queue()
    child = mp.get_context("fork").Process(target=_inside, args=(str(tmp_path), queue))
    child.start()
    groups, seen, memory, described, pid = queue.get(timeout=30)
    child.join(10)
    assert memory == str(3000 * 2 ** 20) and described != "not bound"
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
    device = DeviceLimits("device 0", 100, None, str(tmp_path))
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


@pytest.mark.skipif(not HAS_V1, reason="needs root and cgroup v1 memory")
def test_a_device_the_oom_killer_ends_is_named_as_such_with_the_fix(tmp_path):
    from edgetrain_testing import run_cli

    cluster = tmp_path / "cluster.yaml"  # 96 MiB: the device's first batches of ResNet-18 activations do not fit
    cluster.write_text("profiles:\n  tiny: {base: host, memory_mb: 96}\ndevices:\n  - tiny\n")
    proc = run_cli("train", "--cluster", str(cluster), "--device-limits", "cgroup", "--model", "resnet18",
                   "--dataset", "synthetic", "--image-size", "64", "--batch-size", "64", "--steps", "3",
                   "--no-progress", "--no-eval", "--output", str(tmp_path / "runs"), timeout=180)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode != 0 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert "killed (SIGKILL) by the kernel's out-of-memory killer at its memory limit of 96 MiB" in lines[-1]
    assert "give its profile more memory_mb" in lines[-1]
