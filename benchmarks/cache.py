"""The MinIO cache (``--cache-mb``) against the page cache alone, at one memory budget: docs/benchmarks/storage.md.

    env PYTHONPATH=src python benchmarks/cache.py [--out benchmarks/results/cache.json]

Set-up (root, cgroup v1): a folder of PNG images on this host's disk, read by a device process (forked, with its
loader workers) inside a memory cgroup and a blkio cgroup of its own (``cluster/limits.DeviceLimits``: the
storage profile's MB/s and IOPS throttle the disk's reads). The page cache is dropped before every run.

1. probe: one epoch with room to spare, the cgroup's memory sampled every 20 ms: the peak of what is not data
   (``usage - cache``: the processes' anonymous memory and the kernel's, the workers' included).
2. for each fraction f of the dataset (default 0.5): memory limit = that peak + f x the dataset, then
   - page cache alone: the page cache has f x the dataset of room;
   - MinIO: the cache (tmpfs, charged to the same cgroup) takes f x the dataset less ``--margin-mb``, so the
     page cache has about no room; with and without dropping each item's pages after its read (``drop_pages``).
   Per epoch: its time, the bytes the cgroup read from the disk (``blkio.throttle.io_service_bytes``) and the
   same as items, the loader's own counts (MinIO hits and misses), and the memory the cgroup held
   (file pages, tmpfs, anonymous).
3. the prediction beside it: each policy simulated over the sampler's own per-epoch orders (LRU with the page
   cache's room in items; MinIO with the items it caches).
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
import threading
import time
from collections import OrderedDict
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from edgetrain.cluster.limits import DeviceLimits
from edgetrain.cluster.profiles import STORAGES
from edgetrain.data.cache import attach_cache
from edgetrain.data.sampler import GlobalBatchSampler
from edgetrain.data.images import DataSplit, TensorImages
from edgetrain.data.shards import pack, shards_split
from edgetrain.data.storage import FileSource, LoaderOptions, StoredImages, TrainingLoader

MiB = 2 ** 20


def write_dataset(root: Path, kind: str, images: int, size: int, seed: int = 0) -> tuple[str, list[int]]:
    """``images`` noise images of 3 x size x size, 10 classes, as PNG files in a folder (``png``: decoding is
    real work) or packed into tar shards of uint8 ``.npy`` members (``shards``: ``edgetrain data pack``'s format
    for in-memory sets; decoding is a copy). Returns where they are and each training item's size."""
    rng = np.random.default_rng(seed)
    pixels = torch.from_numpy(rng.integers(0, 255, (images, 3, size, size), dtype=np.uint8))
    labels = torch.arange(images) % 10
    if kind == "png":
        for k in range(images):
            path = root / f"c{k % 10}" / f"{k:06d}.png"
            path.parent.mkdir(parents=True, exist_ok=True)
            Image.fromarray(pixels[k].permute(1, 2, 0).numpy()).save(path, compress_level=1)
    else:
        test = TensorImages(pixels[:10], labels[:10], [0.5] * 3, [0.29] * 3)
        pack(DataSplit(TensorImages(pixels, labels, [0.5] * 3, [0.29] * 3), test, 10, "noise"), root)
    os.sync()
    return load(root, kind, size)


def load(root: Path, kind: str, size: int):
    """The training set on storage: every item a training read, its index made here (before the page cache is
    dropped: a run reads it once at its start) and handed to the device process."""
    if kind == "png":
        paths = sorted(root.glob("c*/*.png"))
        labels = torch.tensor([int(p.parent.name[1:]) for p in paths])
        return StoredImages(FileSource(paths), labels, [0.5] * 3, [0.29] * 3, (3, size, size), "RGB")
    return shards_split(root).train


def drop_caches() -> None:
    if os.environ.get("EDGETRAIN_BENCH_NO_DROP"):  # a quick check beside other jobs: their caches stay
        return
    os.sync()
    Path("/proc/sys/vm/drop_caches").write_text("3")


def memory_stat(group: Path) -> dict[str, int]:
    stat = dict(line.split() for line in (group / "memory.stat").read_text().splitlines())
    usage = int((group / "memory.usage_in_bytes").read_text())
    return {"usage": usage, "cache": int(stat["cache"]), "rss": int(stat["rss"]), "shmem": int(stat["shmem"]),
            "file": int(stat["active_file"]) + int(stat["inactive_file"]), "active_file": int(stat["active_file"])}


def blkio_reads(group: Path, device: str, what: str = "io_service_bytes") -> int:
    """Bytes (or requests: ``io_serviced``) the group read from ``device``."""
    for line in (group / f"blkio.throttle.{what}").read_text().splitlines():
        parts = line.split()
        if len(parts) == 3 and parts[0] == device and parts[1] == "Read":
            return int(parts[2])
    return 0


def anon_by_process(group: Path) -> list[float]:
    """RssAnon (MiB) of each process in the group: the device, then its workers."""
    out = []
    for pid in (group / "cgroup.procs").read_text().split():
        try:
            line = next(x for x in Path(f"/proc/{pid}/status").read_text().splitlines() if x.startswith("RssAnon:"))
            out.append(int(line.split()[1]) / 1024)
        except (OSError, StopIteration):
            pass
    return out


def proc_read_bytes(group: Path) -> int:
    """read_bytes of /proc/<pid>/io summed over the processes in the group (the device and its workers)."""
    total = 0
    for pid in (group / "cgroup.procs").read_text().split():
        try:
            for line in Path(f"/proc/{pid}/io").read_text().splitlines():
                if line.startswith("read_bytes:"):
                    total += int(line.split()[1])
        except OSError:
            pass
    return total


class MemoryWatch(threading.Thread):
    """The memory group's peak of what is not data (usage - file pages: anonymous memory, the kernel's, and the
    shared memory that carries batches from the workers) and of anonymous memory, every 20 ms."""

    def __init__(self, group: Path, cache_bytes: int = 0):
        super().__init__(daemon=True)
        self.group, self.cache_bytes, self.stop, self.peak_other, self.peak_rss = group, cache_bytes, \
            threading.Event(), 0, 0

    def run(self) -> None:
        while not self.stop.wait(0.02):
            m = memory_stat(self.group)
            self.peak_other = max(self.peak_other, m["usage"] - m["file"] - self.cache_bytes)
            self.peak_rss = max(self.peak_rss, m["rss"])


def _device(args, train, data_path: str, memory_mb: int, cache_mb: float, drop_pages: bool, epochs: int,
            queue) -> None:
    torch.set_num_threads(1)
    mp.set_start_method("fork", force=True)  # loader workers as training forks them (they share the cache's map)
    limits = DeviceLimits("bench device", memory_mb, STORAGES[args.storage], data_path).apply()
    try:
        memory = next(g for g in limits.made if g.name.endswith("-memory"))
        blkio = next(g for g in limits.made if g.name.endswith("-blkio"))
        device = limits.applied[-1].split("reads of ")[1].split()[0]
        shape = train.shape
        cache = attach_cache(train, cache_mb, args.seed, "/dev/shm", drop_pages)
        watch = MemoryWatch(memory, cache.bytes if cache else 0)  # the cache is data: preallocated, charged here
        watch.start()
        # Cheap (one pass over the pixels): the storage, not the model, is under test.
        model = torch.nn.Sequential(torch.nn.AdaptiveAvgPool2d(8), torch.nn.Flatten(),
                                    torch.nn.Linear(shape[0] * 64, 10))
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        sampler = GlobalBatchSampler(len(train), [args.batch], 0, seed=args.seed)
        loader = TrainingLoader(train, sampler, torch.utils.data.default_collate, "bench device",
                                LoaderOptions(args.workers, args.prefetch, 300))
        rows = []
        for epoch in range(epochs):
            sampler.set_epoch(epoch)
            disk0, ios0, io0 = blkio_reads(blkio, device), blkio_reads(blkio, device, "io_serviced"), \
                proc_read_bytes(memory)
            t0 = time.perf_counter()
            hits = misses = 0
            read_s = decode_s = 0.0
            it = iter(loader)
            for x, y in it:
                hits, misses = hits + it.last.cache_items, misses + it.last.storage_items
                read_s, decode_s = read_s + it.last.read_s, decode_s + it.last.decode_s
                opt.zero_grad()
                torch.nn.functional.cross_entropy(model(x), y).backward()
                opt.step()
            epoch_s = time.perf_counter() - t0
            m = memory_stat(memory)
            rows.append({"epoch": epoch + 1, "epoch_s": epoch_s, "items": hits + misses,
                         "disk_read_mb": (blkio_reads(blkio, device) - disk0) / 1e6,
                         "disk_reads": blkio_reads(blkio, device, "io_serviced") - ios0,
                         "proc_read_mb": (proc_read_bytes(memory) - io0) / 1e6,
                         "minio_hits": hits, "minio_misses": misses, "loader_read_s": read_s,
                         "loader_decode_s": decode_s, "page_cache_mb": m["file"] / MiB,
                         "active_file_mb": m["active_file"] / MiB, "tmpfs_mb": m["shmem"] / MiB,
                         "anon_mb": m["rss"] / MiB, "usage_mb": m["usage"] / MiB,
                         "anon_by_process_mb": anon_by_process(memory)})
        watch.stop.set()
        watch.join()
        failcnt = int((memory / "memory.failcnt").read_text())
        del it, loader  # its workers end here, before the limits go
        queue.put({"rows": rows, "limits": limits.describe(), "cache_items": cache.items if cache else 0,
                   "cache_bytes": cache.bytes if cache else 0, "peak_other_mb": watch.peak_other / MiB,
                   "peak_anon_mb": watch.peak_rss / MiB, "limit_hits": failcnt,
                   "cached": np.flatnonzero(cache.slot >= 0).tolist() if cache else []})
    except BaseException as e:  # noqa: BLE001 (reported by the parent)
        queue.put({"error": f"{type(e).__name__}: {e}"})
    finally:
        limits.close()


def _orders(sampler: GlobalBatchSampler, epoch: int) -> list[list[int]]:
    sampler.set_epoch(epoch)
    return [[i for i, _ in batch] for batch in sampler]


def run(args, train, data_path: str, memory_mb: int, cache_mb: float, drop_pages: bool, epochs: int) -> dict:
    drop_caches()
    # A fresh interpreter (spawn): what it imports comes before its limits, so the group holds this run's own
    # memory, not copies of the pages of this long-lived parent (fork's copy-on-write grows for minutes).
    ctx = mp.get_context("spawn")
    # Freed batches go back to the kernel at once (glibc would raise its mmap threshold to a batch's size and keep
    # them in its heap): the memory not data stays steady, so the probe's peak holds in the runs.
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", str(1 << 20))
    queue = ctx.Queue()
    child = ctx.Process(target=_device, args=(args, train, data_path, memory_mb, cache_mb, drop_pages, epochs,
                                                    queue))
    child.start()
    result, deadline = None, time.monotonic() + 600
    while result is None:
        try:
            result = queue.get(timeout=2)
        except Exception:  # noqa: BLE001 (queue.Empty)
            if time.monotonic() > deadline:
                child.kill()
                result = {"error": "no result within 600 s; stopped"}
            elif not child.is_alive():
                result = {"error": f"the device process died (exit {child.exitcode}; -9: the cgroup's OOM killer)"}
    child.join(60)
    result.update(memory_limit_mb=memory_mb, cache_mb=cache_mb, drop_pages=drop_pages)
    return result


# -- the two policies simulated over the sampler's orders ---------------------------------------------------

def simulate_lru(orders: list[list[int]], capacity: int) -> list[int]:
    """Misses per epoch of a strict LRU cache of ``capacity`` items."""
    cache: OrderedDict[int, None] = OrderedDict()
    out = []
    for order in orders:
        misses = 0
        for i in order:
            if i in cache:
                cache.move_to_end(i)
                continue
            misses += 1
            cache[i] = None
            if len(cache) > capacity:
                cache.popitem(last=False)
        out.append(misses)
    return out


def simulate_minio(orders: list[list[int]], cached: set[int]) -> list[int]:
    """Misses per epoch of MinIO: a fixed set, filled on first read, never evicted."""
    filled: set[int] = set()
    out = []
    for order in orders:
        misses = 0
        for i in order:
            if i in filled:
                continue
            misses += 1
            if i in cached:
                filled.add(i)
        out.append(misses)
    return out


def steady(rows: list[dict], key: str) -> float:
    return statistics.mean(r[key] for r in rows[1:])


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default="benchmarks/results/cache.json")
    p.add_argument("--images", type=int, default=2400)
    p.add_argument("--size", type=int, default=256, help="side in pixels (3 x size x size bytes per image)")
    p.add_argument("--format", default="shards", choices=("shards", "png"))
    p.add_argument("--storage", default="sd-card", help="a STORAGES profile: the blkio throttle")
    p.add_argument("--fractions", default="0.5", help="memory for data as fractions of the dataset")
    p.add_argument("--epochs", type=int, default=4)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--prefetch", type=int, default=1, help="batches in flight per worker (each is memory not data)")
    p.add_argument("--workers", type=int, default=0, help="loader workers (docs/benchmarks/storage.md ran 0 and 2; the "
                   "default --margin-mb held with both)")
    p.add_argument("--margin-mb", type=float, default=32.0, help="of the data's room left out of the MinIO cache "
                   "(the memory not data rose up to 16 MiB past the probe's peak in a run; the cache's memory cannot "
                   "be reclaimed)")
    p.add_argument("--configs", default="page,minio,minio-keep", help="page: page cache alone; minio: --cache-mb "
                   "(pages dropped after each read); minio-keep: the same, pages kept")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    if os.geteuid() != 0 or not (Path("/sys/fs/cgroup/memory") / "cgroup.procs").is_file():
        sys.exit("edgetrain: error: benchmarks/cache.py needs root and cgroup v1 (memory, blkio); run it as root")
    work = Path(tempfile.mkdtemp(prefix="edgetrain-cache-bench-", dir="/work" if Path("/work").is_dir() else None))
    result = {"date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"), "host": platform.node(),
              "cpus": os.cpu_count(), "python": sys.version.split()[0], "torch": torch.__version__,
              "command": " ".join(sys.argv), "load_avg_start": os.getloadavg(), "args": vars(args)}
    try:
        data_path = work / "data"
        train = write_dataset(data_path, args.format, args.images, args.size, args.seed)
        sizes = [train.source.size(k) for k in range(len(train))]
        item_mb = statistics.mean(sizes) / 1e6
        dataset_mb = sum(sizes) / 1e6
        result["dataset"] = {"images": args.images, "format": args.format, "mb": dataset_mb, "item_mb": item_mb,
                             "storage": STORAGES[args.storage].source}
        print(json.dumps(result["dataset"]), flush=True)
        probe = run(args, train, str(data_path), 4096, 0.0, False, 1)
        result["probe"] = probe
        if "error" in probe:
            raise SystemExit(f"probe failed: {probe['error']}")
        other_mb = probe["peak_other_mb"]
        print(f"probe: not data {other_mb:.1f} MiB at peak (anonymous {probe['peak_anon_mb']:.1f} MiB), epoch "
              f"{probe['rows'][0]['epoch_s']:.1f} s", flush=True)
        orders = [[i for b in _orders_for(args, e) for i in b] for e in range(args.epochs)]
        result["runs"] = []
        for fraction in [float(f) for f in args.fractions.split(",")]:
            room_mb = fraction * dataset_mb * 1e6 / MiB
            memory_mb = int(round(other_mb + room_mb))
            for config in args.configs.split(","):
                cache_mb = 0.0 if config == "page" else (room_mb - args.margin_mb) * MiB / 1e6
                r = run(args, train, str(data_path), memory_mb, cache_mb, config != "minio-keep", args.epochs)
                r.update(config=config, fraction=fraction, room_mb=room_mb)
                if "rows" in r:
                    capacity = int(room_mb * MiB / 1e6 / item_mb)
                    r["predicted_lru_misses"] = simulate_lru(orders, capacity)
                    measured_room = steady(r["rows"], "page_cache_mb") * MiB / 1e6
                    r["predicted_lru_misses_measured_room"] = simulate_lru(orders, int(measured_room / item_mb))
                    if cache_mb:
                        r["predicted_minio_misses"] = simulate_minio(orders, set(r["cached"]))
                    for row in r["rows"]:
                        row["disk_items"] = row["disk_read_mb"] / item_mb
                result["runs"].append(r)
                print(json.dumps({k: v for k, v in r.items() if k != "cached"}), flush=True)
                Path(args.out).write_text(json.dumps(result, indent=1))
    finally:
        shutil.rmtree(work, ignore_errors=True)
        result["load_avg_end"] = os.getloadavg()
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(table(result))


def _orders_for(args, epoch: int) -> list[list[int]]:
    return _orders(GlobalBatchSampler(args.images, [args.batch], 0, seed=args.seed), epoch)


def table(result: dict) -> str:
    lines = ["| fraction | run | epoch 1 s | epochs 2+ s | disk items/epoch (2+) | MinIO hits/misses (2+) | "
             "predicted misses (2+) | page cache MiB | tmpfs MiB |", "|" + "---|" * 9]
    for r in result["runs"]:
        if "rows" not in r:
            lines.append(f"| {r['fraction']} | {r['config']} | {r['error']} |")
            continue
        rows = r["rows"]
        predicted = r.get("predicted_minio_misses", r["predicted_lru_misses"])
        lines.append(f"| {r['fraction']} | {r['config']} | {rows[0]['epoch_s']:.1f} | {steady(rows, 'epoch_s'):.1f} | "
                     f"{steady(rows, 'disk_items'):.0f} of {rows[0]['items']} | "
                     f"{steady(rows, 'minio_hits'):.0f}/{steady(rows, 'minio_misses'):.0f} | "
                     f"{statistics.mean(predicted[1:]):.0f} | {steady(rows, 'page_cache_mb'):.0f} | "
                     f"{steady(rows, 'tmpfs_mb'):.0f} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
