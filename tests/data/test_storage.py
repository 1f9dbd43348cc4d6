"""Datasets left on storage (data/storage.py, data/shards.py), the timed training loader, the MinIO cache
(data/cache.py): same items as in memory, deterministic augmentation, and every fault as one line."""
import os
import pickle
import signal
import time
from pathlib import Path

import numpy as np
import psutil
import pytest
import torch
from PIL import Image

import edgetrain
from edgetrain.data.cache import MinioCache, attach_cache
from edgetrain.data.datasets import digits
from edgetrain.data.detection import shapes_image, yolo_folder
from edgetrain.data.formats import image_folder
from edgetrain.data.sampler import GlobalBatchSampler
from edgetrain.data.shards import META, pack, shards_split
from edgetrain.data.storage import (StoredImages, FileSource, LoaderOptions, TrainingLoader, flip_scale_boxes,
                                    image_folder_on_storage, yolo_on_storage)
from edgetrain.errors import EdgetrainError
from edgetrain.records import DeviceSummary, stall_what_ifs
from edgetrain.tasks.detection import collate_boxes
from edgetrain_testing import FAST


def write_folder(root: Path, classes: int = 3, per_class: int = 20, size: int = 12, seed: int = 0) -> Path:
    rng = np.random.default_rng(seed)
    for c in range(classes):
        (root / f"c{c}").mkdir(parents=True, exist_ok=True)
        template = rng.integers(0, 255, (size, size, 3))
        for k in range(per_class):
            a = np.clip(template * 0.6 + rng.integers(0, 255, (size, size, 3)) * 0.4, 0, 255).astype(np.uint8)
            Image.fromarray(a).save(root / f"c{c}" / f"{k:03d}.png")
    return root


def write_yolo(root: Path, count: int = 12, size: int = 32) -> Path:
    (root / "images").mkdir(parents=True)
    (root / "labels").mkdir()
    for k in range(count):
        image, boxes = shapes_image(np.random.default_rng(k), size)
        Image.fromarray(image.transpose(1, 2, 0)).save(root / "images" / f"{k:03d}.png")
        (root / "labels" / f"{k:03d}.txt").write_text("".join(f"{int(b[0])} {b[1]} {b[2]} {b[3]} {b[4]}\n"
                                                              for b in boxes))
    return root


def items(dataset, n=None):
    return [dataset[k] for k in range(n or len(dataset))]


def test_an_image_folder_on_storage_gives_the_in_memory_items(tmp_path):
    root = write_folder(tmp_path / "f")
    memory, stored = image_folder(root, seed=3), image_folder_on_storage(root, seed=3)
    assert stored.num_classes == memory.num_classes and len(stored.train) == len(memory.train)
    assert torch.equal(stored.train.labels, memory.train.labels)
    assert torch.allclose(stored.train.mean, memory.train.mean) and torch.allclose(stored.train.std, memory.train.std)
    for part in ("train", "test"):
        for (xa, ya), (xb, yb) in zip(items(getattr(memory, part)), items(getattr(stored, part))):
            assert torch.allclose(xa, xb, atol=1e-6) and int(ya) == int(yb)


def test_packed_shards_give_the_same_items_as_memory(tmp_path):
    data = digits(0)
    meta = pack(data, tmp_path / "s", shard_mb=0.05)
    assert len(meta["splits"]["train"]["shards"]) > 1  # several shards, read across their boundaries
    stored = shards_split(tmp_path / "s")
    assert stored.input_shape == data.input_shape and stored.num_classes == 10
    for part in ("train", "test"):
        for (xa, ya), (xb, yb) in zip(items(getattr(data, part)), items(getattr(stored, part))):
            assert torch.equal(xa, xb) and int(ya) == int(yb)
    with pytest.raises(EdgetrainError, match="already holds packed shards"):
        pack(data, tmp_path / "s")


def test_a_packed_image_folder_keeps_its_files(tmp_path):
    root = write_folder(tmp_path / "f")
    folder = image_folder_on_storage(root, seed=0)
    pack(folder, tmp_path / "s")
    stored = shards_split(tmp_path / "s")
    assert stored.train.source.kind(0) == "png"
    for (xa, ya), (xb, yb) in zip(items(folder.train), items(stored.train)):
        assert torch.equal(xa, xb) and int(ya) == int(yb)


def test_a_yolo_folder_on_storage_and_packed_gives_the_in_memory_items(tmp_path):
    root = write_yolo(tmp_path / "y")
    memory, stored = yolo_folder(root, 32, seed=1), yolo_on_storage(root, 32, seed=1)
    pack(stored, tmp_path / "s", detection=True)
    packed = shards_split(tmp_path / "s", detection=True)
    for part in ("train", "test"):
        for (xa, ba), (xb, bb), (xc, bc) in zip(items(getattr(memory, part)), items(getattr(stored, part)),
                                                items(getattr(packed, part))):
            assert torch.allclose(xa, xb, atol=1e-6) and torch.equal(xb, xc)
            assert torch.equal(ba, bb) and torch.allclose(bb, bc)
    with pytest.raises(EdgetrainError, match="are a detection dataset; train them with --task detection"):
        shards_split(tmp_path / "s")


def test_augmentation_is_seeded_per_image_and_epoch_not_per_worker(tmp_path):
    root = write_folder(tmp_path / "f", per_class=16)
    data = image_folder_on_storage(root, seed=0, augment=True)
    a, b = data.train[(5, 0)][0], data.train[(5, 0)][0]
    assert torch.equal(a, b)
    assert any(not torch.equal(data.train[(k, 0)][0], data.train[(k, 1)][0]) for k in range(8))
    plain = image_folder_on_storage(root, seed=0).train
    assert any(not torch.equal(data.train[(k, 0)][0], plain[k][0]) for k in range(8))

    def batches(workers):
        sampler = GlobalBatchSampler(len(data.train), [8], 0, seed=0)
        sampler.set_epoch(1)
        loader = TrainingLoader(data.train, sampler, torch.utils.data.default_collate, "device 0", LoaderOptions(workers, 2, 30))
        return [x for x, _ in loader]

    assert all(torch.equal(p, q) for p, q in zip(batches(0), batches(2)))


def test_flip_and_scale_jitter_move_the_boxes_with_the_pixels():
    x = torch.zeros(1, 64, 64)
    x[:, 10:30, 40:60] = 1.0  # an object at x 40..60, y 10..30
    box = torch.tensor([[0, 50 / 64, 20 / 64, 20 / 64, 20 / 64]])
    for seed in range(20):
        out, moved = flip_scale_boxes(x, box, np.random.default_rng(seed), torch.zeros(1, 1, 1))
        assert out.shape == x.shape
        for _, cx, cy, w, h in moved.tolist():
            x0, x1, y0, y1 = round((cx - w / 2) * 64), round((cx + w / 2) * 64), round((cy - h / 2) * 64), \
                round((cy + h / 2) * 64)
            inside = out[0, y0 + 1:y1 - 1, x0 + 1:x1 - 1]
            assert inside.numel() and inside.mean() > 0.9, seed
            assert out[0].sum() - out[0, y0:y1, x0:x1].sum() < 0.1 * out[0].sum() + 1, seed


def test_the_loader_times_each_batch_and_counts_storage_reads(tmp_path):
    data = image_folder_on_storage(write_folder(tmp_path / "f"), seed=0)
    sampler = GlobalBatchSampler(len(data.train), [8], 0)
    batches = iter(TrainingLoader(data.train, sampler, torch.utils.data.default_collate, "device 0", LoaderOptions(1, 2, 30)))
    next(batches)
    load = batches.last
    assert load.items == 8 and load.storage_items == 8 and load.cache_items == 0
    assert load.read_s > 0 and load.decode_s > 0 and load.bytes_read > 0


def test_the_minio_cache_keeps_a_fixed_set_shared_by_the_workers(tmp_path):
    data = image_folder_on_storage(write_folder(tmp_path / "f", per_class=20), seed=0)
    total = sum(os.path.getsize(p) for p in data.train.source.paths)
    cache = attach_cache(data.train, total / 2 / 1e6, 0, str(tmp_path))
    assert 0 < cache.items < len(data.train)
    assert not list(tmp_path.glob("edgetrain-cache-*"))  # unlinked at once: nothing left behind
    sampler = GlobalBatchSampler(len(data.train), [8], 0)
    loader = TrainingLoader(data.train, sampler, torch.utils.data.default_collate, "device 0", LoaderOptions(2, 2, 30))
    per_epoch = []
    for epoch in range(3):
        sampler.set_epoch(epoch)
        it, storage, cached = iter(loader), 0, 0
        for _ in it:
            storage, cached = storage + it.last.storage_items, cached + it.last.cache_items
        per_epoch.append((storage, cached))
    seen = len(sampler) * 8
    assert per_epoch[0] == (seen, 0)
    for storage, cached in per_epoch[1:]:  # every cached item read in epoch 1 is served from then on
        assert storage + cached == seen and cached > 0.3 * seen


def test_a_full_disk_while_making_the_cache_is_one_line(monkeypatch, tmp_path):
    def full(fd, offset, length):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "posix_fallocate", full)
    with pytest.raises(EdgetrainError, match=r"does not fit in .* \(No space left on device\); lower --cache-mb"):
        MinioCache([1000] * 10, 1.0, 0, str(tmp_path))
    assert not list(tmp_path.iterdir())


def _loader_error(dataset, workers=2, timeout=30):
    sampler = GlobalBatchSampler(len(dataset), [4], 0, shuffle=False)
    loader = TrainingLoader(dataset, sampler, torch.utils.data.default_collate, "device 0", LoaderOptions(workers, 2, timeout))
    children = set(psutil.Process().children(recursive=True))
    with pytest.raises(EdgetrainError) as caught:
        for _ in loader:
            pass
    time.sleep(0.2)
    left = [p for p in psutil.Process().children(recursive=True) if p not in children and p.is_running()
            and p.status() != psutil.STATUS_ZOMBIE]
    assert not left, "a loader worker was left behind"
    message = str(caught.value)
    assert "\n" not in message and "; " in message and "Traceback" not in message
    return message


@pytest.mark.parametrize("workers", [0, 2])
def test_a_corrupt_image_is_one_line_naming_it(tmp_path, workers):
    root = write_folder(tmp_path / "f")
    data = image_folder_on_storage(root, seed=0)
    bad = Path(data.train.source.paths[2])
    bad.write_bytes(bad.read_bytes()[:60])  # the header reads, the pixels do not
    message = _loader_error(data.train, workers)
    assert f"device 0: item 2: {bad} cannot be decoded" in message and "replace or remove it" in message


def test_a_file_that_vanishes_mid_epoch_is_one_line_naming_it(tmp_path):
    data = image_folder_on_storage(write_folder(tmp_path / "f"), seed=0)
    gone = Path(data.train.source.paths[9])
    gone.unlink()
    message = _loader_error(data.train)
    assert f"item 9: {gone} is gone from storage" in message and "restore it" in message


def test_a_missing_image_up_front_is_one_line(tmp_path):
    root = write_folder(tmp_path / "f")
    (root / "c1" / "000.png").write_bytes(b"not an image")
    with pytest.raises(EdgetrainError, match=r"000.png cannot be read .*; replace or remove it"):
        image_folder_on_storage(root)


class Killer(torch.utils.data.Dataset):
    def __len__(self):
        return 16

    def __getitem__(self, key):
        if torch.utils.data.get_worker_info() is not None and key[0] == 5:
            os.kill(os.getpid(), signal.SIGKILL)
        return torch.zeros(2), 0


class Hanger(Killer):
    def __getitem__(self, key):
        time.sleep(30)
        return torch.zeros(2), 0


def test_a_dead_worker_is_named_with_its_signal():
    message = _loader_error(Killer())
    assert "data-loader worker" in message and "was killed by SIGKILL (9)" in message
    assert "out-of-memory" in message


def test_a_hung_worker_is_bounded_by_the_timeout():
    t0 = time.perf_counter()
    message = _loader_error(Hanger(), timeout=2)
    assert "gave no batch within 2 s" in message and time.perf_counter() - t0 < 20


def test_corrupt_truncated_and_missing_shards_are_one_line(tmp_path):
    pack(digits(0), tmp_path / "s", shard_mb=0.05)
    shard = tmp_path / "s" / "train-000001.tar"
    whole = shard.read_bytes()
    shard.write_bytes(whole[: len(whole) // 2])
    with pytest.raises(EdgetrainError, match=r"train-000001.tar: sample \d+ has no .cls member; pack the dataset "):
        shards_split(tmp_path / "s")
    shard.write_bytes(whole[:len(whole) // 2 // 512 * 512 + 700])  # a member's data cut short
    with pytest.raises(EdgetrainError, match=r"train-000001.tar is corrupt .*; pack the dataset again"):
        shards_split(tmp_path / "s")
    shard.write_bytes(b"\x00garbage" * 300)
    with pytest.raises(EdgetrainError, match=r"train-000001.tar .*pack the dataset again"):
        shards_split(tmp_path / "s")
    shard.unlink()
    with pytest.raises(EdgetrainError, match=r"shard .*train-000001.tar is missing; restore it"):
        shards_split(tmp_path / "s")
    (tmp_path / "s" / META).unlink()
    with pytest.raises(EdgetrainError, match=f"holds no {META}; write shards with 'edgetrain data pack"):
        shards_split(tmp_path / "s")


def test_what_ifs_follow_the_pipeline_model():
    d = DeviceSummary(rank=0, profile="host", local_batch=8, samples_per_s=1.0, step_s=0.10, data_s=0.06,
                      read_s=0.04, decode_s=0.02, workers=0)
    w = stall_what_ifs(d)
    assert w["stall_share"] == pytest.approx(0.6) and w["cached_step_s"] == pytest.approx(0.06)
    assert w["more_workers"] == 1 and w["more_workers_step_s"] == pytest.approx(0.06)
    d = DeviceSummary(rank=0, profile="host", local_batch=8, samples_per_s=1.0, step_s=0.10, data_s=0.02,
                      read_s=0.12, decode_s=0.04, workers=2)
    w = stall_what_ifs(d)
    assert w["cached_step_s"] == pytest.approx(0.08) and w["more_workers_step_s"] == pytest.approx(0.08)
    assert stall_what_ifs(DeviceSummary(rank=0, profile="host", local_batch=8, samples_per_s=1.0)) is None


@pytest.mark.slow
def test_training_from_shards_with_workers_equals_training_in_memory(tmp_path):
    pack(digits(0), tmp_path / "s", shard_mb=0.1)
    common = dict(steps=8, batch_size=32, augment=False, **FAST)
    memory = edgetrain.train(dict(dataset="digits", output=str(tmp_path / "m"), **common))
    stored = edgetrain.train(dict(dataset="shards", data_dir=str(tmp_path / "s"), workers=2,
                                  output=str(tmp_path / "d"), **common))
    assert stored["train_loss"] == pytest.approx(memory["train_loss"], rel=1e-6)
    device = stored["per_device"][0]
    assert device["workers"] == 2 and device["read_s"] > 0 and device["decode_s"] > 0
    assert device["storage_items_per_epoch"] == 8 * 32


def test_the_summary_prints_each_devices_stall_and_what_ifs():
    from rich.console import Console

    from edgetrain.records import RunSummary
    from edgetrain.report.tables import stall_lines

    device = dict(rank=0, profile="rpi4", local_batch=32, samples_per_s=100.0, step_s=0.2, data_s=0.05,
                  compute_s=0.15, comm_s=0.0, read_s=0.08, decode_s=0.12, workers=2, storage_items_per_epoch=800.0,
                  cache_items_per_epoch=200.0)
    summary = RunSummary.from_dict({"per_device": [device], "throughput_samples_per_s": 100.0}, "test")
    (line,) = stall_lines(summary)
    assert line.startswith("data, rank 0: stall 25% of the step (50.0 ms waiting")
    assert "800 items/epoch from storage, 200 from the cache" in line
    assert "modelled (DS-Analyzer what-ifs): cached in memory 150.0 ms/step, 4 worker(s) 150.0 ms/step" in line
    in_memory = dict(device, workers=0, storage_items_per_epoch=None, cache_items_per_epoch=None)
    assert stall_lines(RunSummary.from_dict({"per_device": [in_memory], "throughput_samples_per_s": 1.0}, "t")) == []



def _resident_pages(path: Path) -> int:
    """Pages of ``path`` in the page cache: mincore(2) over a mapping of it (mapping does not read it)."""
    import ctypes
    import mmap

    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    size = path.stat().st_size
    vec = (ctypes.c_ubyte * ((size + mmap.PAGESIZE - 1) // mmap.PAGESIZE))()
    with open(path, "rb") as f:
        base = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, f.fileno(), 0)
    assert base not in (None, ctypes.c_void_p(-1).value), ctypes.get_errno()
    try:
        assert libc.mincore(base, size, vec) == 0, ctypes.get_errno()
    finally:
        libc.munmap(base, size)
    return sum(v & 1 for v in vec)


def _on_a_disk(path: Path) -> bool:
    return os.major(os.stat(path).st_dev) != 0  # tmpfs and overlays have no pages to drop


@pytest.mark.parametrize("packed", [False, True])
def test_a_read_with_drop_leaves_no_pages_in_the_page_cache(tmp_path, packed):
    folder = write_folder(tmp_path / "f", per_class=4, size=64)
    data = image_folder_on_storage(folder, seed=0)
    if packed:
        pack(data, tmp_path / "shards")
        data = shards_split(tmp_path / "shards")
    source = data.train.source
    path = Path(source.entries[0][0] if packed else source.paths[0])
    if not _on_a_disk(path):
        pytest.skip(f"{path} is not on a block device")
    os.sync()
    kept = source.read(0)
    assert _resident_pages(path) > 0  # read through the page cache, as any read
    assert source.read(0, drop=True) == kept
    if packed:  # the member's whole pages are gone; the shard's other members' stay
        offset, size = source.entries[0][1:3]
        first, last = -(-offset // 4096), (offset + size) // 4096
        assert _resident_pages(path) <= (os.path.getsize(path) + 4095) // 4096 - (last - first)
    else:
        assert _resident_pages(path) == 0


class _Recording(FileSource):
    def __init__(self, paths):
        super().__init__(paths)
        self.drops: list[bool] = []

    def read(self, index, drop=False):
        self.drops.append(drop)
        return super().read(index, drop)


@pytest.mark.parametrize("cache_mb, drop_pages, expected", [(0.0, True, False), (1.0, True, True),
                                                             (1.0, False, False)])
def test_items_read_beside_a_minio_cache_leave_the_page_cache_unless_told(tmp_path, cache_mb, drop_pages, expected):
    data = image_folder_on_storage(write_folder(tmp_path / "f", per_class=4), seed=0)
    train = data.train
    train.source = _Recording(train.source.paths)
    attach_cache(train, cache_mb, 0, str(tmp_path), drop_pages)
    for k in range(len(train)):
        train[k]
    assert train.source.drops == [expected] * len(train)


def test_a_training_split_of_shards_reads_members_without_readahead(tmp_path):
    data = image_folder_on_storage(write_folder(tmp_path / "f", per_class=20, size=48), seed=0)
    pack(data, tmp_path / "shards")
    split = shards_split(tmp_path / "shards")
    assert split.train.source.shuffled and not split.test.source.shuffled  # training reads are in a random order
    source = pickle.loads(pickle.dumps(split.train.source))  # as a spawned loader worker gets it
    assert source.shuffled
    path = Path(source.entries[0][0])
    if not _on_a_disk(path):
        pytest.skip(f"{path} is not on a block device")
    os.sync()
    with open(path, "rb") as f:
        os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
    assert _resident_pages(path) == 0
    first = len(source) // 4
    for k in range(first, first + 3):  # neighbours in a row: the kernel would take it for a sequential reader
        source.read(k)
    start, (end, size) = source.entries[first][1], source.entries[first + 2][1:3]
    assert _resident_pages(path) <= (end + size) // 4096 - start // 4096 + 1  # the members' pages, no more


def _bytes_read_by_this_process() -> int:
    """``rchar`` of /proc/self/io: what this process's read calls returned, whatever read them (the kernel's count)."""
    return int(next(line for line in open("/proc/self/io") if line.startswith("rchar:")).split()[1])


def test_setting_up_a_folder_on_storage_reads_its_headers_and_a_small_sample_only(tmp_path):
    """Setup reads each image's header (not the whole file, as a buffered open would for a small image) and the
    statistics' sample: a small fraction of the dataset, counted by the kernel, not by edgetrain."""
    root = write_folder(tmp_path / "f", classes=5, per_class=250, size=32)  # 1,250 images of 3.2 KB
    total = sum(p.stat().st_size for p in root.rglob("*.png"))
    image_folder_on_storage(write_folder(tmp_path / "warm", per_class=3))  # imports and caches, not counted
    before = _bytes_read_by_this_process()
    data = image_folder_on_storage(root)
    read = _bytes_read_by_this_process() - before
    assert read < 0.1 * total, f"setup read {read:,} of {total:,} bytes"
    reads = data.details["setup_read"]
    assert (reads["headers"], reads["sample"], reads["dataset_bytes"]) == (1250, 64, total)
    assert reads["header_bytes"] + reads["sample_bytes"] <= read


def test_the_cache_serves_the_items_of_a_devices_loader_workers(tmp_path):
    """A device starts its loader workers as it was started itself (from the fork server), so the cache reaches
    them by its file descriptor, not by fork: epoch 2 reads every item from the cache the workers filled in 1."""
    root = write_folder(tmp_path / "f", per_class=10)  # 24 training images of 12x12
    summary = edgetrain.train(dict(dataset="imagefolder", data_dir=str(root), from_storage=True, workers=1,
                                   cache_mb=1, epochs=2, batch_size=8, augment=False, output=str(tmp_path / "o"),
                                   **FAST))
    device = summary["per_device"][0]
    # 3 steps of 8 an epoch: 24 from storage in the first, 24 from the cache in the second
    assert (device["workers"], device["storage_items_per_epoch"], device["cache_items_per_epoch"]) == (1, 12, 12)
    assert summary["setup_read"]["sample"] == 24  # all of a set this small, read once by the launcher
