"""A device's own data from the cluster file (data/device_data.py): read alone, checked before any device starts."""
import numpy as np
import pytest
from torch.utils.data import DataLoader

from edgetrain import train
from edgetrain.cluster.profiles import load_cluster, plan_devices
from edgetrain.config import load_config, resolve
from edgetrain.data import digits
from edgetrain.data.device_data import build_training_data, check_device_data
from edgetrain.errors import EdgetrainError
from edgetrain.spec import parse_partition
from edgetrain_testing import FAST, run_main

SAMPLES = 40  # 8x8 grey images, as the run's dataset (digits)


def write_device_files(folder, devices=2, shape=(8, 8), labels=10):
    """One .npz per device whose every pixel is 100 x device + the image's index: a batch says whose it is."""
    for d in range(devices):
        x = np.broadcast_to((100 * d + np.arange(SAMPLES, dtype=np.uint8))[:, None, None], (SAMPLES, *shape))
        np.savez(folder / f"device{d}.npz", x=np.ascontiguousarray(x), y=np.arange(SAMPLES) % labels)
    entries = "".join(f"  - {{profile: host, data: device{d}.npz}}\n" for d in range(devices))
    (folder / "cluster.yaml").write_text("devices:\n" + entries)
    return folder / "cluster.yaml"


def test_a_device_reads_only_its_own_file(tmp_path):
    devices = load_cluster(write_device_files(tmp_path))  # relative paths: from the cluster file's folder
    shared, batches = digits(), [8, 8]
    mean, std = shared.train.mean.item(), shared.train.std.item()
    for rank, device in enumerate(devices):
        dataset, sampler, report = build_training_data(shared, device, parse_partition("none"), batches, rank, 0)
        assert report is None and len(sampler) == len(shared.train) // sum(batches)  # lockstep epoch
        loader = DataLoader(dataset, batch_sampler=sampler)
        pixels = {round(v) for x, _ in loader for v in ((x[:, 0, 0, 0] * std + mean) * 255).tolist()}
        assert pixels == set(range(100 * rank, 100 * rank + SAMPLES))  # all of its own file and nothing else


@pytest.mark.slow  # two device processes: about 9 s on a loaded 2-core host
def test_each_device_trains_on_its_own_file(tmp_path, capfd):
    # federated rounds of one step: only model updates cross between the devices
    summary = train(cluster=str(write_device_files(tmp_path)), sync="fedavg:steps=1", steps=2, batch_size=16,
                    output=str(tmp_path / "runs"), **FAST)
    assert summary["steps"] == 2
    out = capfd.readouterr().out
    for d in range(2):
        assert f"device {d} (host) trains on its own data: {SAMPLES} images from {tmp_path / f'device{d}.npz'}" in out


def test_a_missing_device_file_is_one_line_before_any_device_starts(tmp_path):
    cluster = write_device_files(tmp_path)
    (tmp_path / "device1.npz").unlink()
    out = tmp_path / "runs"
    result = run_main("train", "--cluster", str(cluster), "--output", str(out), "--no-progress")
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        f"edgetrain: error: device 1 (host): its data {tmp_path / 'device1.npz'} does not exist; put the device's "
        "image folder or .npz there or fix its 'data' in the cluster file"]
    assert not out.exists()


def test_under_torchrun_a_device_checks_only_its_own_file(tmp_path):
    cfg = load_config(cluster=str(write_device_files(tmp_path)), **FAST)
    (tmp_path / "device1.npz").unlink()  # device 1's file is on device 1, not here
    devices = plan_devices(cfg, 2)
    check_device_data(cfg, resolve(cfg), devices, [32, 32], rank=0)
    with pytest.raises(EdgetrainError, match=r"device 1 \(host\): its data .*device1.npz does not exist"):
        check_device_data(cfg, resolve(cfg), devices, [32, 32], rank=1)


@pytest.mark.parametrize("change, options, message", [
    (None, {"partition": "iid"}, "--partition iid splits the shared dataset, but the cluster file gives each device"),
    (None, {"dedup": "on"}, "--dedup filters the shared dataset"),
    (None, {"strategy": "tiled", "grid": "1x2"}, "strategy tiled gives every device the whole global batch"),
    ("data: 3", {}, "device entry 2 data must be the path of an image folder or a .npz file, not 3"),
    ("no data", {"sync": "fedavg:1"}, "needs a partition or data per device; add --partition .* or give each device"),
    ("one device", {}, "gives 'data' for some devices but not device 1 \\(host\\)"),
    ("4x4 images", {}, r"device 0 \(host\): images in .* are 1x4x4 \(CxHxW\) but the run's dataset digits has 1x8x8"),
    ("12 classes", {}, "has 12 classes but the run's dataset digits has 10"),
    (None, {"batch_size": 100}, "holds 40 training images, fewer than its local batch of 50"),
])
def test_device_data_that_cannot_run_is_refused_in_one_line(tmp_path, change, options, message):
    cluster = write_device_files(tmp_path, shape=(4, 4) if change == "4x4 images" else (8, 8),
                                 labels=12 if change == "12 classes" else 10)
    if change == "data: 3":
        cluster.write_text(cluster.read_text().replace("device1.npz", "3"))
    if change in ("one device", "no data"):
        cluster.write_text("devices:\n" + ("  - {profile: host, data: device0.npz}\n" if change == "one device"
                                            else "  - host\n") + "  - host\n")
    with pytest.raises(EdgetrainError, match=message):
        train(cluster=str(cluster), steps=1, output=str(tmp_path / "runs"), **{**FAST, **options})
    assert not (tmp_path / "runs").exists()
