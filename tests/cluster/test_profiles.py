import time

import pytest

from edgetrain.cluster.profiles import BUILTIN_PROFILES, load_cluster, plan_devices, split_batch
from edgetrain.cluster.throttle import Throttle, assign_cores
from edgetrain.config import load_config
from edgetrain.errors import EdgetrainError


def write(tmp_path, text):
    path = tmp_path / "cluster.yaml"
    path.write_text(text)
    return path


def test_cluster_file_with_user_profile(tmp_path):
    path = write(tmp_path, """
profiles:
  pi-zero: {base: rpi4, cores: 1, gflops: 1.5, memory_mb: 512}
devices:
  - rpi4
  - {profile: jetson-nano, link: wifi-20m}
  - {profile: pi-zero, count: 2}
""")
    devices = load_cluster(path)
    assert [d.profile.name for d in devices] == ["rpi4", "jetson-nano", "pi-zero", "pi-zero"]
    assert [d.rank for d in devices] == [0, 1, 2, 3]
    assert devices[1].link == "wifi-20m" and devices[0].link == BUILTIN_PROFILES["rpi4"].link
    assert devices[2].profile.memory_mb == 512 and devices[2].profile.gflops == 1.5 and devices[2].profile.cores == 1


@pytest.mark.parametrize("text, message", [
    ("devices: []", "non-empty list"),
    ("devices: [banana]", "unknown device profile 'banana'"),
    ("devices: [{profile: rpi4, speed: 2}]", "unknown key 'speed'"),
    ("profiles: {x: {gflops: -1}}\ndevices: [x]", "gflops must be a positive number"),
    ("profiles: {x: {base: nope}}\ndevices: [x]", "based on unknown profile 'nope'"),
    ("nodes: [rpi4]", "unknown key 'nodes'"),
])
def test_bad_cluster_files(tmp_path, text, message):
    with pytest.raises(EdgetrainError, match=message):
        load_cluster(write(tmp_path, text))


def test_split_batch_even_balanced_and_explicit(tmp_path):
    cfg = load_config(devices=3, batch_size=64)
    devices = plan_devices(cfg)
    assert split_batch(cfg, devices) == [22, 21, 21]
    path = write(tmp_path, "profiles: {slow: {speed: 0.25}, fast: {speed: 0.75}}\ndevices: [slow, fast]\n")
    cfg = load_config(cluster=str(path), batch_size=64, local_batch="balanced")
    assert split_batch(cfg, plan_devices(cfg)) == [16, 48]
    cfg = load_config(cluster=str(path), batch_size=64, local_batch="10,54")
    assert split_batch(cfg, plan_devices(cfg)) == [10, 54]
    cfg = load_config(devices=4, batch_size=3)
    with pytest.raises(EdgetrainError, match="smaller than the 4 devices"):
        split_batch(cfg, plan_devices(cfg))


def test_assign_cores_splits_or_shares():
    assert assign_cores(0, 2, [0, 1]) == [0] and assign_cores(1, 2, [0, 1]) == [1]
    assert assign_cores(0, 1, [0, 1]) == [0, 1]
    assert [assign_cores(r, 4, [0, 1]) for r in range(4)] == [[0], [1], [0], [1]]


def test_throttle_stretches_cpu_work():
    throttle = Throttle(speed=0.5, quantum=0.001)
    start_cpu, start = time.process_time(), time.perf_counter()
    while time.process_time() - start_cpu < 0.15:
        for _ in range(2000):
            pass
        throttle.checkpoint()
    throttle.checkpoint()
    cpu, wall = time.process_time() - start_cpu, time.perf_counter() - start
    # At speed 0.5 the work takes at least twice its CPU time (more only if the host is busy,
    # in which case the throttle sleeps less: time lost to other processes counts as stretch).
    assert wall >= 0.9 * cpu / 0.5
    assert throttle.slept > 0


def test_throttle_gives_no_credit_for_waiting():
    throttle = Throttle(speed=0.5, quantum=0.001)
    time.sleep(0.1)  # waiting, not computing
    throttle.checkpoint()
    start_cpu, start = time.process_time(), time.perf_counter()
    while time.process_time() - start_cpu < 0.05:
        pass
    throttle.checkpoint()
    assert time.perf_counter() - start >= 0.9 * (time.process_time() - start_cpu) / 0.5
