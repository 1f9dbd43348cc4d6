"""Data-stall analysis in the manner of DS-Analyzer, on the loader training uses.

Mohan et al., "Analyzing and Mitigating Data Stalls in DNN Training" (VLDB 2021) split an epoch into what
the model could do if data were free (*ingestion*: training on one synthetic batch already in memory) and the
time it waits for the input pipeline. The Jetson study this project follows asks the practical question: does
slow storage with more loader workers match fast storage?

The bench trains over the same dataset on storage (an image folder or packed shards, read by training's own
``TrainingLoader`` and datasets of ``data/storage.py``) for every combination of loader workers x storage
(each storage's read MB/s and IOPS enforced by a blkio throttle on this process, ``cluster/limits.py``,
where the host allows: else said and labelled) x page cache (cold: dropped first, with
``/proc/sys/vm/drop_caches`` as root, else ``posix_fadvise(DONTNEED)`` on the files; warm: the pass right
after). Each row gives the training rate, the stall (time waiting for batches), and the loader's read and
decode time per batch as the step records have them. A row is ``compute``-limited when its stall is under
``--threshold`` of the pass, else ``fetch`` (reading dominates the loader's work) or ``prep`` (decoding).
On a board with four cores the workers and the training threads compete for the same cores, which is why more
workers is not always better.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from edgetrain.arguments import non_negative_float, non_negative_int, positive_int
from edgetrain.bench.common import print_table, save_result, start_run
from edgetrain.cluster.limits import DeviceLimits
from edgetrain.cluster.profiles import STORAGES
from edgetrain.errors import EdgetrainError
from edgetrain.results import StallsResult

# Imported inside functions: torch, edgetrain.data, edgetrain.models and edgetrain.tasks (torch), PIL and
# edgetrain.report.plots (matplotlib), so that ``edgetrain bench``'s flags and --help answer without them.


def drop_page_cache(files: list[Path]) -> None:
    """Ask the kernel to forget the files' cached pages (needs no root; dirty pages stay)."""
    for p in files:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)



def limiting_stage(ingest: float, prep: float, fetch: float, threshold: float) -> str:
    """The slowest stage from the three rates (samples/s), as DS-Analyzer predicts it.

    ``prep``: the loader alone on cached data; ``fetch``: the loader alone on a
    cold cache (fetch and prep together). Rates within ``threshold`` count as equal.
    """
    if min(prep, fetch) >= ingest * (1 - threshold):
        return "compute"
    return "fetch" if fetch < prep * (1 - threshold) else "prep"


def _stage(stall_fraction: float, read_s: float, decode_s: float, threshold: float) -> str:
    if stall_fraction < threshold:
        return "compute"
    return "fetch" if read_s > decode_s else "prep"


def generated_folder(root: Path, images: int, size: int = 32, classes: int = 10, seed: int = 0) -> Path:
    """An image folder of noisy class templates (PNG), for a bench without --data-dir."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    templates = rng.integers(0, 255, (classes, size, size, 3))
    for k in range(images):
        c = k % classes
        (root / f"c{c}").mkdir(parents=True, exist_ok=True)
        a = np.clip(templates[c] * 0.5 + rng.integers(0, 255, (size, size, 3)) * 0.5, 0, 255).astype(np.uint8)
        Image.fromarray(a).save(root / f"c{c}" / f"{k:06d}.png", compress_level=1)
    return root


def open_dataset(data_dir: Path):
    """The training set at ``data_dir`` on storage: packed shards, or an image folder."""
    from edgetrain.data.shards import META, shards_split
    from edgetrain.data.storage import image_folder_on_storage

    if (data_dir / META).is_file():
        return shards_split(data_dir, augment=True)
    return image_folder_on_storage(data_dir, augment=True)


def _files(dataset) -> list[Path]:
    source = dataset.source
    paths = getattr(source, "paths", None) or sorted({e[0] for e in source.entries})
    return [Path(p) for p in paths]


def _drop(files: list[Path]) -> str:
    try:
        os.sync()
        Path("/proc/sys/vm/drop_caches").write_text("3")
        return "drop_caches"
    except OSError:
        drop_page_cache(files)
        return "fadvise"


def _pass(model, dataset, batch_size: int, workers: int, steps: int, seed: int, prefetch: int = 2) -> dict:
    import torch

    from edgetrain.data.sampler import GlobalBatchSampler
    from edgetrain.data.storage import LoaderOptions, TrainingLoader
    from edgetrain.tasks.classification import ClassificationTask

    task = ClassificationTask()
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    sampler = GlobalBatchSampler(len(dataset), [batch_size], 0, seed=seed)
    loader = TrainingLoader(dataset, sampler, task.collate, "bench", LoaderOptions(workers, prefetch, 300))
    stall = read = decode = 0.0
    t0 = time.perf_counter()
    batches = iter(loader)
    for _ in range(steps):
        w0 = time.perf_counter()
        x, y = next(batches)
        stall += time.perf_counter() - w0
        read, decode = read + batches.last.read_s, decode + batches.last.decode_s
        opt.zero_grad(set_to_none=True)
        (task.loss(model(x), y) / task.batch_size(y)).backward()
        opt.step()
    elapsed = time.perf_counter() - t0
    del batches, loader  # its workers end before the next pass
    return {"epoch_s": elapsed, "stall_s": stall, "read_s": read, "decode_s": decode}


def _ingestion(model, shape, classes: int, batch_size: int, steps: int) -> float:
    import torch

    from edgetrain.tasks.classification import ClassificationTask

    task = ClassificationTask()
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    x, y = torch.randn(batch_size, *shape), torch.randint(0, classes, (batch_size,))
    t0 = time.perf_counter()
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        (task.loss(model(x), y) / batch_size).backward()
        opt.step()
    return time.perf_counter() - t0


def run(data_dir: str | None, model: str = "small_cnn", *, batch_size: int = 32, epoch_samples: int = 512,
        workers: tuple[int, ...] = (0, 1, 2, 4), storages: tuple[str, ...] = ("sd-card", "nvme"),
        threads: int | None = None, threshold: float = 0.05, seed: int = 0, output: str = "runs",
        name: str | None = None) -> StallsResult:
    import torch

    from edgetrain.models import build_model

    unknown = [s for s in storages if s not in STORAGES]
    if unknown:
        raise EdgetrainError(f"unknown storage {unknown[0]!r}; use some of {', '.join(STORAGES)}")
    with _data_folder(data_dir, output, epoch_samples) as folder:
        data = open_dataset(Path(folder))
        if epoch_samples < batch_size or epoch_samples > len(data.train):
            raise EdgetrainError(f"--epoch-samples must be between the batch size ({batch_size}) and the "
                                 f"data set's training images ({len(data.train)}), got {epoch_samples}")
        threads = threads or os.cpu_count() or 1
        torch.set_num_threads(threads)
        torch.manual_seed(seed)
        sweep = _Sweep(batch_size, epoch_samples // batch_size, seed, threshold)
        net = build_model(model, in_channels=data.in_channels, num_classes=data.num_classes)
        net.train()
        _ingestion(net, data.input_shape, data.num_classes, batch_size, 1)  # warm-up: allocations are no stall
        rows, notes, dropped = _measure(net, data, folder, storages, workers, sweep)
    samples = sweep.steps * batch_size
    verdict = _verdict(rows, storages, workers)
    params = dict(data_dir=data_dir if data_dir is not None else "generated image folder", model=model,
                  batch_size=batch_size, epoch_samples=samples, workers=list(workers), storages=list(storages),
                  threads=threads, stall_threshold=threshold, seed=seed, cold_cache=sorted(dropped))
    run_dir = start_run(output, name, "stalls")
    ingestion = statistics.median(r["ingestion_samples_per_s"] for r in rows)
    result = save_result(run_dir, StallsResult(params=params, ingestion_samples_per_s=ingestion,
                                               rows=rows, verdict=verdict, notes=notes))
    from edgetrain.report import plots

    plots.plot_stalls(result.to_dict(), run_dir / "stalls.png")
    _print(result, f"bench stalls: {model}, batch {batch_size}, {samples} samples/pass, training's loader -> "
                   f"{run_dir}", dropped)
    return result


@dataclass(frozen=True)
class _Sweep:
    """Every pass: ``steps`` batches of ``batch_size`` (loader seeded with ``seed``); a stall share above
    ``threshold`` names the stage that limits it."""
    batch_size: int
    steps: int
    seed: int
    threshold: float


@contextlib.contextmanager
def _data_folder(data_dir: str | None, output: str, epoch_samples: int):
    """``data_dir``, or an image folder generated beside the runs for the bench (a disk, not tmpfs: blkio
    throttles disks), removed after it."""
    if data_dir is not None:
        yield data_dir
        return
    Path(output).mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix="stalls-data-", dir=output))
    try:
        yield str(generated_folder(scratch, max(epoch_samples * 5 // 4 + 10, 20)))
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def _measure(net, data, folder: str, storages: tuple[str, ...], workers: tuple[int, ...], sweep: _Sweep
             ) -> tuple[list[dict], list[str], set[str]]:
    """One row per storage x workers x page cache (cold, warm), each storage emulated on ``folder``'s disk:
    (rows, notes, how the page cache was dropped)."""
    files = _files(data.train)
    samples = sweep.steps * sweep.batch_size
    rows, notes, dropped = [], [], set()
    for storage in storages:
        limits = DeviceLimits("bench", None, STORAGES[storage], folder).apply()
        try:
            throttled = not any("storage" in f for f in limits.fallbacks) and bool(limits.made)
            if not throttled:
                notes.append(f"{storage}: not throttled here ({'; '.join(limits.fallbacks)}): this host's disk")
            for w in workers:
                ingest_s = _ingestion(net, data.input_shape, data.num_classes, sweep.batch_size, sweep.steps)
                for cache in ("cold", "warm"):
                    if cache == "cold":
                        dropped.add(_drop(files))
                    m = _pass(net, data.train, sweep.batch_size, w, sweep.steps, sweep.seed)
                    fraction = m["stall_s"] / m["epoch_s"]
                    rows.append({
                        "storage": storage, "throttled": throttled, "workers": w, "cache": cache,
                        "ingestion_samples_per_s": samples / ingest_s, "epoch_compute_s": ingest_s,
                        "train_samples_per_s": samples / m["epoch_s"], "epoch_s": m["epoch_s"],
                        "stall_s": m["stall_s"], "stall_fraction": fraction,
                        "read_ms_per_batch": 1000 * m["read_s"] / sweep.steps,
                        "decode_ms_per_batch": 1000 * m["decode_s"] / sweep.steps,
                        "limiting_stage": _stage(fraction, m["read_s"], m["decode_s"], sweep.threshold)})
        finally:
            limits.close()
    return rows, notes, dropped


def _print(result: StallsResult, title: str, dropped: set[str]) -> None:
    rows = result.rows
    print_table(title,
                ["storage", "workers", "page cache", "train/s", "ingestion/s", "stall %", "read ms/batch",
                 "decode ms/batch", "limiting"],
                [(r["storage"] + ("" if r["throttled"] else " (unthrottled)"), r["workers"], r["cache"],
                  r["train_samples_per_s"], r["ingestion_samples_per_s"], 100 * r["stall_fraction"],
                  r["read_ms_per_batch"], r["decode_ms_per_batch"], r["limiting_stage"]) for r in rows],
                [f"ingestion rate (one synthetic batch in memory, no stall): {result.ingestion_samples_per_s:.1f} "
                 "samples/s (median)",
                 "stall % = time waiting for batches over the pass; read and decode = the loader's work per batch "
                 "(summed over its items and workers); cold = page cache dropped before the pass "
                 f"({', '.join(sorted(dropped))})", *result.notes, result.verdict])


def _verdict(rows: list[dict], storages: tuple[str, ...], workers: tuple[int, ...]) -> str:
    cold = {(r["storage"], r["workers"]): r["train_samples_per_s"] for r in rows if r["cache"] == "cold"}
    if len(storages) < 2:
        return "one storage measured: nothing to compare"
    slow, fast = storages[0], storages[-1]
    most, least = max(workers), min(workers)
    return (f"cold page cache: {slow} with {most} worker(s) trains at "
            f"{cold[(slow, most)] / cold[(fast, most)]:.0%} of {fast}'s rate with as many "
            f"({cold[(slow, least)] / cold[(fast, least)]:.0%} with {least}); and at "
            f"{cold[(slow, most)] / cold[(fast, least)]:.0%} of {fast} with {least}")


def _workers(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(v) for v in text.split(","))
    except ValueError:
        values = ()
    if not values or min(values) < 0:
        raise argparse.ArgumentTypeError(f"expected worker counts like 0,1,2,4, got {text!r}")
    return values


def add_parser(sub) -> None:
    p = sub.add_parser("stalls", help="data stalls (DS-Analyzer) with training's loader: workers x storage x "
                                      "cold/warm page cache")
    p.add_argument("--data-dir", default=None, help="an image folder or packed shards (edgetrain data pack); "
                                                    "default: a generated image folder")
    p.add_argument("--model", default="small_cnn")
    p.add_argument("--batch-size", type=positive_int, default=32)
    p.add_argument("--epoch-samples", type=positive_int, default=512, help="samples per measured pass")
    p.add_argument("--workers", type=_workers, default=(0, 1, 2, 4), help="loader worker counts, e.g. 0,1,2,4")
    p.add_argument("--storages", type=lambda t: tuple(t.split(",")), default=("sd-card", "nvme"),
                   help="storage emulated by a blkio throttle (sd-card, emmc, nvme, hdd), slowest first")
    p.add_argument("--threads", type=positive_int, default=None, help="training threads (default: all cores)")
    p.add_argument("--threshold", type=non_negative_float, default=0.05, help="stall fraction counted as no stall")
    p.add_argument("--seed", type=non_negative_int, default=0)
    p.set_defaults(bench_func=lambda a: run(
        a.data_dir, a.model, batch_size=a.batch_size, epoch_samples=a.epoch_samples, workers=a.workers,
        storages=a.storages, threads=a.threads, threshold=a.threshold, seed=a.seed, output=a.output,
        name=a.name))
