"""Data-stall analysis in the manner of DS-Analyzer.

Mohan et al., "Analyzing and Mitigating Data Stalls in DNN Training" (VLDB
2021) split an epoch into what the model could do if data were free and the
two ways the input pipeline makes it wait:

1. *ingestion*: training steps on synthetic batches already in memory; the
   rate the compute can absorb, with no stall (measured beside each worker
   count, since a shared machine's load drifts);
2. *prep stall*: the extra time when batches come from the real loader with
   the dataset in the page cache: decoding, augmenting and collating samples
   in ``w`` loader workers (plus worker start-up, which a real epoch pays);
3. *fetch stall*: the extra time when the dataset's pages are dropped first
   (``posix_fadvise(POSIX_FADV_DONTNEED)`` on its files), so the loader also
   waits on storage.

For each worker count ``0..k`` the bench times one pass of ``epoch_samples``
samples in each state, plus the loader alone (cached and cold). As in
DS-Analyzer, the limiting stage is the slowest of the three rates (ingestion,
prep, fetch), and the stall removed at the smallest worker count whose
loader keeps up with ingestion; the measured stall seconds (differences of
the training passes) are reported beside it, and show what rates alone do
not: workers competing with training for the same cores. Each
pass starts its workers afresh, as every epoch of a loader without persistent
workers does; on short passes that start-up is a visible part of the stall. On a
board with four cores the workers and the training threads compete for the
same cores, which is why more workers is not always better.

The data set is CIFAR-10 in its official python format: five pickled batch
files, read and augmented with the trainer's own code (``edgetrain.data``).
A batch file can only be read whole, so each worker process reads the files
it touches once per epoch: the fetch cost of this format is reading those
files from storage.
"""
from __future__ import annotations

import os
import statistics
import time
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from edgetrain.arguments import non_negative_float, non_negative_int, positive_int
from edgetrain.bench import workload
from edgetrain.bench.common import print_table, save_result, start_run
from edgetrain.data import cifar
from edgetrain.data.datasets import random_crop_flip
from edgetrain.errors import EdgetrainError
from edgetrain.results import StallsResult
from edgetrain.tasks.base import Task
from edgetrain.tasks.classification import ClassificationTask

def cifar_files(data_dir: str | os.PathLike) -> list[Path]:
    d = Path(data_dir)
    if (d / "cifar-10-batches-py").is_dir():
        d = d / "cifar-10-batches-py"
    files = [d / name for name in cifar.TRAIN_FILES if (d / name).is_file()]
    if not files:
        raise EdgetrainError(f"no CIFAR-10 python-format training files (data_batch_1..5) in {data_dir}; "
                             "pass --data-dir pointing at cifar-10-batches-py")
    return files


class CifarFiles(Dataset):
    """CIFAR-10 training images read from their batch files on first use, augmented as the trainer does.

    ``edgetrain.data.cifar10`` reads every file once at start-up and keeps the
    images in memory, which hides the fetch cost inside start-up. Here each
    process (the main one, or each loader worker) reads the files it touches
    itself (with ``edgetrain.data.cifar.read_batch``), so an epoch pays for its
    reads; ``fresh()`` gives a copy that has read nothing yet.
    """

    def __init__(self, files: list[Path], augment: bool = True, lengths: list[int] | None = None, seed: int = 0):
        self.files = files
        self.augment = augment
        self.seed = seed
        self.lengths = lengths or [len(cifar.read_batch(p)[1]) for p in files]
        self.offsets = np.cumsum([0] + self.lengths)
        self._loaded: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        self._mean = torch.tensor(cifar.MEAN).view(3, 1, 1)
        self._std = torch.tensor(cifar.STD).view(3, 1, 1)

    def fresh(self) -> "CifarFiles":
        return CifarFiles(self.files, self.augment, self.lengths, self.seed)

    def __len__(self) -> int:
        return int(self.offsets[-1])

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        f = int(np.searchsorted(self.offsets, i, side="right")) - 1
        if f not in self._loaded:
            self._loaded[f] = cifar.read_batch(self.files[f])
        images, labels = self._loaded[f]
        row = i - int(self.offsets[f])
        x = torch.from_numpy(images[row]).float() / 255
        if self.augment:
            x = random_crop_flip(x, np.random.default_rng((self.seed, i)))
        return (x - self._mean) / self._std, int(labels[row])


def drop_page_cache(files: list[Path]) -> None:
    """Ask the kernel to forget the files' cached pages (needs no root; dirty pages stay)."""
    for p in files:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def read_rate_mb_s(files: list[Path]) -> float:
    t0 = time.perf_counter()
    size = 0
    for p in files:
        with open(p, "rb") as f:
            while chunk := f.read(1 << 20):
                size += len(chunk)
    return size / 2**20 / (time.perf_counter() - t0)


def _loader(ds: CifarFiles, batch_size: int, workers: int, seed: int) -> DataLoader:
    return DataLoader(ds.fresh(), batch_size=batch_size, shuffle=True, num_workers=workers,
                      drop_last=True, generator=torch.Generator().manual_seed(seed),
                      timeout=120 if workers else 0)


def _epoch(model, loader_or_batch, steps: int, train: bool, task: Task | None = None) -> float:
    """Seconds for ``steps`` batches: training on them (``task``'s loss, default a classifier's, as a mean over
    the batch), or only fetching them when ``train`` is off."""
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9) if train else None
    task = task or ClassificationTask()
    t0 = time.perf_counter()
    if isinstance(loader_or_batch, DataLoader):
        batches = iter(loader_or_batch)
        source = (next(batches) for _ in range(steps))
    else:
        source = (loader_or_batch for _ in range(steps))
    for x, y in source:
        if train:
            opt.zero_grad(set_to_none=True)
            (task.loss(model(x), y) / task.batch_size(y)).backward()
            opt.step()
    elapsed = time.perf_counter() - t0
    if isinstance(loader_or_batch, DataLoader):
        del batches  # shut the workers down before the next measurement
    return elapsed


def limiting_stage(ingest: float, prep: float, fetch: float, threshold: float) -> str:
    """The slowest stage from the three rates (samples/s), as DS-Analyzer predicts it.

    ``prep``: the loader alone on cached data; ``fetch``: the loader alone on a
    cold cache (fetch and prep together). Rates within ``threshold`` count as equal.
    """
    if min(prep, fetch) >= ingest * (1 - threshold):
        return "compute"
    return "fetch" if fetch < prep * (1 - threshold) else "prep"


def run(data_dir: str, model: str = "resnet18", *, batch_size: int = 64, epoch_samples: int = 1024,
        max_workers: int = 2, threads: int | None = None, threshold: float = 0.05, seed: int = 0,
        output: str = "runs", name: str | None = None) -> StallsResult:
    files = cifar_files(data_dir)
    ds = CifarFiles(files, seed=seed)
    if epoch_samples < batch_size or epoch_samples > len(ds):
        raise EdgetrainError(f"--epoch-samples must be between the batch size ({batch_size}) and the "
                             f"data set's size ({len(ds)}), got {epoch_samples}")
    if max_workers < 0:
        raise EdgetrainError("--max-workers must be >= 0")
    threads = threads or os.cpu_count() or 1
    torch.set_num_threads(threads)
    torch.manual_seed(seed)
    np.random.seed(seed)
    steps = epoch_samples // batch_size
    samples = steps * batch_size
    net = workload.build_model(model, "cifar10")
    net.train()

    synthetic = (torch.randn(batch_size, 3, 32, 32), torch.randint(0, 10, (batch_size,)))
    _epoch(net, synthetic, 1, train=True)  # warm-up: first-step allocation is nobody's stall

    drop_page_cache(files)
    cold_read = read_rate_mb_s(files)
    cached_read = read_rate_mb_s(files)

    rows = []
    for w in range(max_workers + 1):
        # Ingestion is measured again beside each worker count: on a shared machine the load drifts, and
        # a stall is a difference between passes that should see the same load.
        ingest_s = _epoch(net, synthetic, steps, train=True)
        read_rate_mb_s(files)  # dataset in the page cache
        prep_s = _epoch(net, _loader(ds, batch_size, w, seed), steps, train=False)
        cached_s = _epoch(net, _loader(ds, batch_size, w, seed), steps, train=True)
        drop_page_cache(files)
        fetch_s = _epoch(net, _loader(ds, batch_size, w, seed), steps, train=False)
        drop_page_cache(files)
        cold_s = _epoch(net, _loader(ds, batch_size, w, seed), steps, train=True)
        rows.append({
            "workers": w,
            "ingestion_samples_per_s": samples / ingest_s,
            "prep_samples_per_s": samples / prep_s,
            "fetch_samples_per_s": samples / fetch_s,
            "train_cached_samples_per_s": samples / cached_s,
            "train_cold_samples_per_s": samples / cold_s,
            "epoch_compute_s": ingest_s, "epoch_cached_s": cached_s, "epoch_cold_s": cold_s,
            "prep_stall_s": max(0.0, cached_s - ingest_s),
            "fetch_stall_s": max(0.0, cold_s - cached_s),
            "stall_fraction": max(0.0, cold_s - ingest_s) / cold_s,
            "limiting_stage": limiting_stage(samples / ingest_s, samples / prep_s, samples / fetch_s, threshold),
        })
    removes = next((r["workers"] for r in rows if r["limiting_stage"] == "compute"), None)
    fastest = max(rows, key=lambda r: r["train_cold_samples_per_s"])
    if removes is None:
        verdict = (f"no worker count up to {max_workers} removes the stall; with {fastest['workers']} "
                   f"worker(s) (fastest) the limiting stage is {fastest['limiting_stage']}")
    elif removes == 0:
        verdict = "no data stall even with 0 workers: loading in the training process keeps up with compute"
    else:
        verdict = (f"{removes} loader worker(s) remove the stall (under {100 * threshold:.0f}% of the epoch); "
                   "with fewer, the limiting stage is "
                   + ", ".join(f"{r['limiting_stage']} at {r['workers']}" for r in rows[:removes]))
    params = dict(data_dir=str(files[0].parent), model=model, batch_size=batch_size, epoch_samples=samples,
                  max_workers=max_workers, threads=threads, stall_threshold=threshold, seed=seed)
    run_dir = start_run(output, name, "stalls")
    ingestion = statistics.median(r["ingestion_samples_per_s"] for r in rows)
    result = save_result(run_dir, StallsResult(params=params, ingestion_samples_per_s=ingestion,
                                               read_mb_per_s={"cold": cold_read, "cached": cached_read},
                                               rows=rows, stall_removed_at_workers=removes, verdict=verdict))
    from edgetrain.report import plots

    plots.plot_stalls(result.to_dict(), run_dir / "stalls.png")
    print_table(f"bench stalls: {model}, batch {batch_size}, {samples} samples/epoch -> {run_dir}",
                ["workers", "ingestion/s", "loader cached/s", "loader cold/s", "train cached/s", "train cold/s", "prep stall s",
                 "fetch stall s", "stall %", "limiting"],
                [(r["workers"], r["ingestion_samples_per_s"], r["prep_samples_per_s"], r["fetch_samples_per_s"], r["train_cached_samples_per_s"],
                  r["train_cold_samples_per_s"], r["prep_stall_s"], r["fetch_stall_s"],
                  100 * r["stall_fraction"], r["limiting_stage"]) for r in rows],
                [f"ingestion rate (synthetic data in memory, no stall): {ingestion:.1f} samples/s "
                 "(median of the per-row measurements)",
                 f"reading the data set files: {cold_read:.0f} MB/s after dropping their pages, "
                 f"{cached_read:.0f} MB/s cached",
                 "limiting = the slowest of ingestion, loader cached (prep) and loader cold (fetch + prep) rates; "
                 "stall seconds = measured training epochs' differences (on a shared machine they include "
                 "interference: workers and other processes competing for the cores)", verdict])
    return result


def add_parser(sub) -> None:
    p = sub.add_parser("stalls", help="data stalls (DS-Analyzer): ingestion, prep and fetch, for 0..k workers")
    p.add_argument("--data-dir", required=True, help="CIFAR-10 python-format directory (cifar-10-batches-py)")
    p.add_argument("--model", default="resnet18")
    p.add_argument("--batch-size", type=positive_int, default=64)
    p.add_argument("--epoch-samples", type=positive_int, default=1024, help="samples per measured pass")
    p.add_argument("--max-workers", type=non_negative_int, default=2, help="measure 0..k loader workers")
    p.add_argument("--threads", type=positive_int, default=None, help="training threads (default: all cores)")
    p.add_argument("--threshold", type=non_negative_float, default=0.05, help="stall fraction counted as no stall")
    p.add_argument("--seed", type=non_negative_int, default=0)
    p.set_defaults(bench_func=lambda a: run(
        a.data_dir, a.model, batch_size=a.batch_size, epoch_samples=a.epoch_samples,
        max_workers=a.max_workers, threads=a.threads, threshold=a.threshold, seed=a.seed,
        output=a.output, name=a.name))
