"""Training from storage: the three targets of docs/benchmarks/storage.md, side by side in one run.

    PYTHONPATH=src python benchmarks/storage.py [--out benchmarks/results/storage.json]

1. memory: a dataset twice a device's memory (``--device-limits cgroup``: the profile's memory_mb as a
   cgroup v1 limit, page cache included) trains from storage to the same test accuracy as the same data
   read whole into memory (no limit), ``edgetrain train`` both.
2. cache: epoch time of a device whose memory leaves room for half the dataset, reading from a throttled
   SD card (blkio), with the MinIO cache (``--cache-mb``) and with the page cache alone; items read from
   storage per epoch for both. Each configuration runs in a forked process inside its own cgroups, after
   the host's page cache is dropped.
3. overhead: step time of a dataset served from storage (packed shards, 2 loader workers, warm page cache)
   against the same dataset in memory (0 workers), ``edgetrain train`` both, measured alternately.

Needs root and cgroup v1 (memory, blkio) for 1 and 2; says so and skips them otherwise.
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import multiprocessing as mp
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import yaml
from PIL import Image

import edgetrain
from edgetrain.cluster.limits import DeviceLimits
from edgetrain.cluster.profiles import STORAGES
from edgetrain.data.cache import attach_cache
from edgetrain.data.sampler import GlobalBatchSampler
from edgetrain.data.formats import image_folder
from edgetrain.data.storage import TrainingLoader, image_folder_on_storage

QUIET = dict(progress=False, throttle=False, timeout=120)


def write_folder(root: Path, classes: int, per_class: int, size: int, seed: int = 0) -> int:
    """Noisy class templates as PNG files (noise does not compress: each file is about size*size*3 bytes)."""
    rng = np.random.default_rng(seed)
    total = 0
    for c in range(classes):
        (root / f"c{c}").mkdir(parents=True, exist_ok=True)
        template = rng.integers(0, 255, (size, size, 3))
        for k in range(per_class):
            a = np.clip(template * 0.1 + rng.integers(0, 255, (size, size, 3)) * 0.9, 0, 255).astype(np.uint8)
            path = root / f"c{c}" / f"{k:05d}.png"
            Image.fromarray(a).save(path, compress_level=1)
            total += path.stat().st_size
    return total


def drop_caches() -> bool:
    try:
        os.sync()
        Path("/proc/sys/vm/drop_caches").write_text("3")
        return True
    except OSError:
        return False


def cgroups_here() -> bool:
    return os.geteuid() == 0 and all((Path("/sys/fs/cgroup") / c / "cgroup.procs").is_file()
                                     for c in ("memory", "blkio"))


# -- 1: twice the memory --------------------------------------------------------------------------------

def test_accuracy(run_dir: str, data, size: int) -> float:
    from edgetrain.tasks.classification import ClassificationTask
    from edgetrain.train.evaluation import evaluate_task

    model = TinyNet(size)
    model.load_state_dict(edgetrain.load_checkpoint(run_dir)["model"])
    return evaluate_task(model, data.test, 0, 1, ClassificationTask(), batch=32)["accuracy"]


class TinyNet(torch.nn.Module):
    """Cheap at any resolution (a strided conv, then pooling), so that reading, not compute, is the work."""

    def __init__(self, size: int, channels: int = 3, classes: int = 10):
        super().__init__()
        self.conv = torch.nn.Conv2d(channels, 4, 8, stride=8)
        self.head = torch.nn.Linear(4 * (size // 8) ** 2, classes)

    def forward(self, x):
        return self.head(torch.relu(self.conv(x)).flatten(1))


def memory_target(work: Path, folder: Path, dataset_mb: float, size: int) -> dict:
    memory_mb = int(dataset_mb / 2)
    cluster = work / "cluster.yaml"
    cluster.write_text(yaml.safe_dump({"profiles": {"small": {"base": "rpi4", "memory_mb": memory_mb}},
                                       "devices": [{"profile": "small"}]}))
    # Evaluated here afterwards, 32 images at a time: the loop's evaluation takes 256 at once, more than a device
    # of a few hundred MB holds at this image size.
    common = dict(dataset="imagefolder", data_dir=str(folder), epochs=2, batch_size=16, augment=False,
                  lr=0.01, eval=False, **QUIET)
    t0 = time.perf_counter()
    torch.manual_seed(0)  # the model is passed built: both runs start from the same weights
    memory = edgetrain.train(dict(output=str(work / "runs"), run_name="in-memory", **common), model=TinyNet(size))
    t1 = time.perf_counter()
    drop_caches()
    torch.manual_seed(0)
    # No loader workers: each would hold its own copy of the pages of the process it touches, which a device
    # of a few hundred MB cannot spare.
    stored = edgetrain.train(dict(output=str(work / "runs"), run_name="from-storage", from_storage=True, workers=0,
                                  cluster=str(cluster), device_limits="cgroup", storage="sd-card", **common),
                             model=TinyNet(size))
    t2 = time.perf_counter()
    device = stored["per_device"][0]
    memory["test_accuracy"] = test_accuracy(memory["run_dir"], image_folder(folder, 0), size)
    stored["test_accuracy"] = test_accuracy(stored["run_dir"], image_folder_on_storage(folder, 0), size)
    return {"dataset_mb": dataset_mb, "device_memory_mb": memory_mb,
            "in_memory": {"test_accuracy": memory["test_accuracy"], "train_loss": memory["train_loss"],
                          "wall_s": t1 - t0, "peak_rss_mb": memory["per_device"][0]["peak_rss_mb"]},
            "from_storage": {"test_accuracy": stored["test_accuracy"], "train_loss": stored["train_loss"],
                             "wall_s": t2 - t1, "limits": device.get("limits", device.get("details", {}).get("limits")),
                             "storage_items_per_epoch": device.get("storage_items_per_epoch"),
                             "stall_share": device["data_s"] / device["step_s"]}}


# -- 2: the MinIO cache against the page cache ----------------------------------------------------------

def _epochs(folder: str, memory_mb: int, cache_mb: float, epochs: int, batch: int, workers: int, storage: str,
            queue) -> None:
    limits = DeviceLimits("bench device", memory_mb, STORAGES[storage], folder).apply()
    try:
        data = image_folder_on_storage(folder, seed=0)
        train = data.train
        attach_cache(train, cache_mb, 0, "/dev/shm")
        model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(int(np.prod(train.shape)), data.num_classes))
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        sampler = GlobalBatchSampler(len(train), [batch], 0, seed=0)
        loader = TrainingLoader(train, sampler, torch.utils.data.default_collate, workers, 2, 300, "bench device")
        rows = []
        for epoch in range(epochs):
            sampler.set_epoch(epoch)
            t0, read, cached, stall = time.perf_counter(), 0, 0, 0.0
            it = iter(loader)
            while True:
                w0 = time.perf_counter()
                try:
                    x, y = next(it)
                except StopIteration:
                    break
                stall += time.perf_counter() - w0
                read, cached = read + it.last.storage_items, cached + it.last.cache_items
                opt.zero_grad()
                torch.nn.functional.cross_entropy(model(x), y).backward()
                opt.step()
            rows.append({"epoch": epoch, "epoch_s": time.perf_counter() - t0, "storage_items": read,
                         "cache_items": cached, "stall_s": stall})
        usage = Path(f"/sys/fs/cgroup/memory/edgetrain-{os.getpid()}-memory/memory.max_usage_in_bytes")
        del it, loader  # its workers end here, before the limits are removed
        queue.put({"rows": rows, "limits": limits.describe(), "items": len(train),
                   "cgroup_max_usage_mb": int(usage.read_text()) / 2 ** 20 if usage.is_file() else None})
    except BaseException as e:  # noqa: BLE001 (reported by the parent)
        queue.put({"error": f"{type(e).__name__}: {e}"})
    finally:
        limits.close()


def _in_cgroup(folder: Path, memory_mb: int, cache_mb: float, epochs: int, storage: str) -> dict:
    drop_caches()
    queue = mp.get_context("fork").Queue()
    # No loader workers: each would copy the pages of the process it touches, more than the half of the data
    # this memory limit leaves room for (a worker was killed by the cgroup's OOM killer with 2).
    child = mp.get_context("fork").Process(target=_epochs, args=(str(folder), memory_mb, cache_mb, epochs, 64, 0,
                                                                 storage, queue))
    child.start()
    result = None
    deadline = time.monotonic() + 900
    while result is None:
        if time.monotonic() > deadline:
            child.kill()
            result = {"error": "the bench process gave no result within 900 s; it was stopped"}
            break
        try:
            result = queue.get(timeout=2)
        except Exception:  # noqa: BLE001 (queue.Empty)
            if not child.is_alive():
                result = {"error": f"the bench process died (exit {child.exitcode}: -9 is the cgroup's OOM killer)"}
    child.join(60)
    result["cache_mb"] = cache_mb
    return result


def cache_target(folder: Path, dataset_mb: float, storage: str, epochs: int = 3) -> dict:
    """Memory limit = the bench process's own peak (its loader workers' included: each Python process copies
    the pages it touches), measured first with room to spare, + half the (training) dataset."""
    train_mb = 0.8 * dataset_mb  # the 80/20 split's training part, what the epochs read
    probe = _in_cgroup(folder, 4096, 0.0, 1, storage)
    overhead_mb = probe["cgroup_max_usage_mb"] - train_mb if "rows" in probe else 400.0
    half = train_mb / 2
    memory_mb = int(overhead_mb + half)
    out = {"train_mb": train_mb, "room_for_data_mb": half, "memory_limit_mb": memory_mb,
           "overhead_mb": overhead_mb, "storage": STORAGES[storage].source, "probe": probe}
    for name, cache_mb in (("page cache alone", 0.0), ("MinIO cache", 0.9 * half)):
        result = _in_cgroup(folder, memory_mb, cache_mb, epochs, storage)
        out[name] = result
        print(name, json.dumps(result), flush=True)
    steady = lambda r: statistics.mean(row["epoch_s"] for row in r["rows"][1:])  # noqa: E731
    if "rows" in out["page cache alone"] and "rows" in out["MinIO cache"]:
        out["speedup_epochs_2_on"] = steady(out["page cache alone"]) / steady(out["MinIO cache"])
    return out


# -- 3: loading overhead with enough workers ----------------------------------------------------------

def overhead_target(work: Path, repeats: int = 2) -> dict:
    from edgetrain.data.datasets import synthetic
    from edgetrain.data.shards import pack

    shards = work / "synthetic-shards"
    pack(synthetic(4096, 32, seed=0), shards)
    common = dict(epochs=1, batch_size=64, model="small_cnn", threads=1, eval=False, augment=False, **QUIET)
    runs = {"in memory, 0 workers": [], "shards on storage, 2 workers": []}
    for _ in range(repeats):  # alternately: the host's load drifts
        for name, extra in (("in memory, 0 workers", dict(dataset="synthetic", synthetic_samples=4096)),
                            ("shards on storage, 2 workers", dict(dataset="shards", data_dir=str(shards),
                                                                  workers=2))):
            summary = edgetrain.train(dict(output=str(work / "runs"), **extra, **common))
            d = summary["per_device"][0]
            runs[name].append({"step_s": d["step_s"], "data_s": d["data_s"], "train_loss": summary["train_loss"]})
    median = {k: statistics.median(r["step_s"] for r in v) for k, v in runs.items()}
    return {"runs": runs, "median_step_s": median,
            "ratio": median["shards on storage, 2 workers"] / median["in memory, 0 workers"]}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default="benchmarks/results/storage.json")
    p.add_argument("--images", type=int, default=1000, help="images in the memory part's generated folder")
    p.add_argument("--memory-size", type=int, default=512, help="their side in pixels")
    p.add_argument("--cache-images", type=int, default=600, help="images in the cache part's generated folder")
    p.add_argument("--size", type=int, default=256, help="the cache part's images' side in pixels")
    p.add_argument("--cache-storage", default="hdd", help="the storage the cache part reads from (a STORAGES name)")
    p.add_argument("--parts", default="memory,cache,overhead")
    args = p.parse_args()
    work = Path(tempfile.mkdtemp(prefix="edgetrain-storage-bench-", dir="/work" if Path("/work").is_dir() else None))
    result = {"date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"), "host": platform.node(),
              "cpus": os.cpu_count(), "python": sys.version.split()[0], "torch": torch.__version__,
              "command": " ".join(sys.argv)}
    try:
        parts = args.parts.split(",")
        if not cgroups_here():
            result["note"] = "no root or no cgroup v1 here: the memory and cache parts were skipped"
            parts = [p for p in parts if p == "overhead"]
        if "cache" in parts:
            folder = work / "cache-folder"
            dataset_mb = write_folder(folder, 10, args.cache_images // 10, args.size, seed=1) / 1e6
            result["cache_dataset"] = {"images": args.cache_images, "size": args.size, "mb": dataset_mb}
            result["cache"] = cache_target(folder, dataset_mb, args.cache_storage)
            Path(args.out).write_text(json.dumps(result, indent=1))
        if "memory" in parts:
            folder = work / "memory-folder"
            dataset_mb = write_folder(folder, 10, args.images // 10, args.memory_size) / 1e6
            result["memory_dataset"] = {"images": args.images, "size": args.memory_size, "mb": dataset_mb}
            result["memory"] = memory_target(work, folder, dataset_mb, args.memory_size)
            print(json.dumps(result["memory"]), flush=True)
            Path(args.out).write_text(json.dumps(result, indent=1))  # so far, should a later part fail
        if "overhead" in parts:
            result["overhead"] = overhead_target(work)
            print(json.dumps(result["overhead"]), flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
