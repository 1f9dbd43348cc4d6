"""Training from storage: two of the three targets of docs/benchmarks/storage.md (the third, the MinIO cache
against the page cache, is ``benchmarks/cache.py``).

    PYTHONPATH=src python benchmarks/storage.py [--out benchmarks/results/storage.json]

1. memory: a dataset twice a device's memory (``--device-limits cgroup``: the profile's memory_mb as a
   cgroup v1 limit, page cache included) trains from storage to the same test accuracy as the same data
   read whole into memory (no limit), ``edgetrain train`` both.
2. overhead: step time of a dataset served from storage (packed shards, 2 loader workers, warm page cache)
   against the same dataset in memory (0 workers), ``edgetrain train`` both, measured alternately.

Needs root and cgroup v1 (memory, blkio) for 1; says so and skips it otherwise.
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
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
from edgetrain.data.formats import image_folder
from edgetrain.data.storage import image_folder_on_storage

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
    from edgetrain.train.evaluation import EvalPass, evaluate_task

    model = TinyNet(size)
    model.load_state_dict(edgetrain.load_checkpoint(run_dir)["model"])
    return evaluate_task(model, data.test, 0, 1, ClassificationTask(), EvalPass(batch=32))["accuracy"]


class TinyNet(torch.nn.Module):
    """Cheap at any resolution (a strided conv, then pooling), so that reading, not compute, is the work."""

    def __init__(self, size: int, channels: int = 3, classes: int = 10):
        super().__init__()
        self.conv = torch.nn.Conv2d(channels, 4, 8, stride=8)
        self.head = torch.nn.Linear(4 * (size // 8) ** 2, classes)

    def forward(self, x):
        return self.head(torch.relu(self.conv(x)).flatten(1))


def memory_target(work: Path, folder: Path, dataset_mb: float, size: int, workers: int = 0, prefetch: int = 2) -> dict:
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
    # Loader workers (``--memory-workers``) are processes whose memory the device's limit counts too.
    stored = edgetrain.train(dict(output=str(work / "runs"), run_name="from-storage", from_storage=True,
                                  workers=workers, prefetch=prefetch,
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
                             "wall_s": t2 - t1, "workers": workers, "prefetch": prefetch,
                             "limits": device.get("limits", device.get("details", {}).get("limits")),
                             "storage_items_per_epoch": device.get("storage_items_per_epoch"),
                             "stall_share": device["data_s"] / device["step_s"]}}


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
    # Each storage run over the in-memory run just before it: the spread of the ratio, pair by pair.
    pairs = [s["step_s"] / m["step_s"] for m, s in zip(runs["in memory, 0 workers"],
                                                        runs["shards on storage, 2 workers"])]
    return {"runs": runs, "median_step_s": median,
            "ratio": median["shards on storage, 2 workers"] / median["in memory, 0 workers"],
            "pair_ratios": pairs, "pair_ratio_median": statistics.median(pairs)}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default="benchmarks/results/storage.json")
    p.add_argument("--images", type=int, default=1000, help="images in the memory part's generated folder")
    p.add_argument("--memory-size", type=int, default=512, help="their side in pixels")
    p.add_argument("--parts", default="memory,overhead")
    p.add_argument("--memory-workers", type=int, default=0, help="loader workers of the memory part's run from storage")
    p.add_argument("--memory-prefetch", type=int, default=2, help="batches each of those workers prepares ahead")
    p.add_argument("--repeats", type=int, default=2, help="alternated pairs of the overhead part")
    args = p.parse_args()
    work = Path(tempfile.mkdtemp(prefix="edgetrain-storage-bench-", dir="/work" if Path("/work").is_dir() else None))
    result = {"date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"), "host": platform.node(),
              "cpus": os.cpu_count(), "python": sys.version.split()[0], "torch": torch.__version__,
              "command": " ".join(sys.argv), "load_avg_start": os.getloadavg()}
    try:
        parts = args.parts.split(",")
        if not cgroups_here():
            result["note"] = "no root or no cgroup v1 here: the memory part was skipped"
            parts = [p for p in parts if p == "overhead"]
        if "memory" in parts:
            folder = work / "memory-folder"
            dataset_mb = write_folder(folder, 10, args.images // 10, args.memory_size) / 1e6
            result["memory_dataset"] = {"images": args.images, "size": args.memory_size, "mb": dataset_mb}
            try:
                result["memory"] = memory_target(work, folder, dataset_mb, args.memory_size, args.memory_workers,
                                                 args.memory_prefetch)
            except edgetrain.EdgetrainError as e:  # a device killed at its limit is a result too
                result["memory"] = {"error": str(e), "workers": args.memory_workers}
            print(json.dumps(result["memory"]), flush=True)
            Path(args.out).write_text(json.dumps(result, indent=1))  # so far, should a later part fail
        if "overhead" in parts:
            result["overhead"] = overhead_target(work, args.repeats)
            print(json.dumps(result["overhead"]), flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
        result["load_avg_end"] = os.getloadavg()
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
