import time

import pytest
import torch

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


class BurnCPU(torch.nn.Module):
    """A layer whose forward costs ``seconds`` of CPU time, so a test controls the work exactly."""

    def __init__(self, seconds: float):
        super().__init__()
        self.seconds = seconds
        self.linear = torch.nn.Linear(4, 2)

    def forward(self, x):
        start = time.process_time()
        while time.process_time() - start < self.seconds:
            pass
        return self.linear(x)


def test_calibrated_throttle_charges_work_at_its_warm_cost():
    model = BurnCPU(0.01)
    throttle = Throttle(speed=0.5, quantum=0.001)
    assert throttle.calibrate(model, torch.randn(8, 4)) == pytest.approx(0.01, rel=0.5)
    throttle.attach(model)
    model.seconds = 0.02  # the same work now costs twice the CPU (as after sleeping on a cold core)
    for _ in range(12):
        model(torch.randn(8, 4)).sum().backward()
    assert throttle.inflation == pytest.approx(2.0, rel=0.25)
    # Charged at the warm cost: 10 ms of work at speed 0.5 is 20 ms, which the 20 ms of CPU already
    # took, so the throttle hardly sleeps (charging raw CPU it would sleep 20 ms per pass).
    before = throttle.slept
    for _ in range(5):
        model(torch.randn(8, 4)).sum().backward()
    assert throttle.slept - before < 0.5 * 5 * 0.02


def test_throttle_inflation_ignores_eval_and_other_batch_sizes():
    model = BurnCPU(0.005)
    throttle = Throttle(speed=0.5, quantum=0.001)
    throttle.calibrate(model, torch.randn(8, 4))
    throttle.attach(model)
    with torch.no_grad():
        model(torch.randn(8, 4))
    model(torch.randn(3, 4)).sum().backward()
    model.eval()
    model(torch.randn(8, 4)).sum().backward()
    assert throttle.inflations == []
    model.train()
    model(torch.randn(8, 4)).sum().backward()
    assert len(throttle.inflations) == 1


def test_balanced_split_never_leaves_a_device_without_samples(tmp_path):
    """Shares rounded up to 1 are paid back by devices with more, not by the slow device itself.

    raw shares 0.04, 0.04, 3.92 round to 1, 1, 3 = 5 > 4; the rounding once took the sample back
    from the first slow device, leaving it a batch of 0.
    """
    path = write(tmp_path, "profiles: {slow: {speed: 0.01}, fast: {speed: 1.0}}\ndevices: [slow, slow, fast]\n")
    cfg = load_config(cluster=str(path), batch_size=4, local_batch="balanced")
    assert split_batch(cfg, plan_devices(cfg)) == [1, 1, 2]



@pytest.mark.slow
def test_a_cluster_of_host_and_throttled_devices_starts(tmp_path):
    # The host profile has no throttle; it skipped the calibration's collectives while the throttled
    # device waited in them, and the run hung until the peer timeout (issue 14's fedavg-drop30 row).
    from edgetrain import train
    from edgetrain_testing import FAST
    path = write(tmp_path, "profiles: {slow: {base: host, speed: 0.5}}\ndevices: [host, slow]\n")
    summary = train(dict(FAST, model="small_cnn", dataset="digits", devices=2, cluster=str(path), throttle=True,
                         steps=2, batch_size=16, output=str(tmp_path), timeout=60))
    assert summary["steps"] == 2
