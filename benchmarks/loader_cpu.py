"""Where the CPU time of one item goes in the cache benchmark's loop (benchmarks/cache.py's data, model and
loader, no workers, no limits, the page cache warm): docs/benchmarks/storage.md.

    PYTHONPATH=src python benchmarks/loader_cpu.py [--images 800] [--out benchmarks/results/loader_cpu.json]

Each stage is timed on its own over the same items (read: ``pread`` from the shard; decode: ``np.load`` of the
``.npy`` member; convert and normalise: the dataset's ``__getitem__`` less the two before; collate: the
loader's ``default_collate`` of a batch; step: the bench model's forward, backward and SGD step), and the
whole loop (``TrainingLoader``) once more under ``cProfile`` for its top functions by own time.
"""
from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cache import write_dataset  # noqa: E402  (the same data as the cache benchmark)

from edgetrain.data import storage  # noqa: E402
from edgetrain.data.sampler import GlobalBatchSampler  # noqa: E402
from edgetrain.data.storage import LoaderOptions, TrainingLoader  # noqa: E402


def per_item(fn, count: int, repeats: int = 3) -> float:
    """Median over ``repeats`` of the mean seconds of ``fn(k)`` over items 0..count-1."""
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for k in range(count):
            fn(k)
        times.append((time.perf_counter() - t0) / count)
    return statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--images", type=int, default=800)
    p.add_argument("--size", type=int, default=256)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    torch.set_num_threads(1)  # as the cache benchmark's device process
    work = Path(tempfile.mkdtemp(prefix="edgetrain-loader-cpu-"))
    try:
        train = write_dataset(work / "data", "shards", args.images, args.size)
        n = len(train)
        for k in range(n):  # warm: the CPU, not the disk, is measured here
            train.source.read(k)
        raws = [train.source.read(k) for k in range(n)]
        read = per_item(train.source.read, n)
        # The loader's own .npy decoding (np.load before it had load_npy: run this with an older src to compare).
        load = getattr(storage, "load_npy", None) or (lambda raw: np.load(io.BytesIO(raw), allow_pickle=False))
        decode = per_item(lambda k: load(raws[k]), n)
        whole = per_item(lambda k: train[k], n)  # read + decode + convert/normalise
        items = [train[k] for k in range(args.batch)]
        collate = per_item(lambda _: torch.utils.data.default_collate(items), 20) / args.batch
        model = torch.nn.Sequential(torch.nn.AdaptiveAvgPool2d(8), torch.nn.Flatten(),
                                    torch.nn.Linear(train.shape[0] * 64, 10))
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        x, y = torch.utils.data.default_collate(items)

        def step(_):
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            opt.step()

        step_s = per_item(step, 20) / args.batch
        stages = {"read_ms": read * 1e3, "npy_decode_ms": decode * 1e3,
                  "convert_normalise_ms": (whole - read - decode) * 1e3, "collate_ms": collate * 1e3,
                  "train_step_ms": step_s * 1e3}
        stages["total_ms"] = sum(stages.values())
        sampler = GlobalBatchSampler(n, [args.batch], 0, seed=0)
        loader = TrainingLoader(train, sampler, torch.utils.data.default_collate, "profile", LoaderOptions(0, 1, 300))

        def epoch():
            for xb, yb in loader:
                opt.zero_grad()
                torch.nn.functional.cross_entropy(model(xb), yb).backward()
                opt.step()

        t0 = time.perf_counter()
        epoch()
        loop_ms = (time.perf_counter() - t0) / n * 1e3  # the whole loop, unprofiled
        prof = cProfile.Profile()
        prof.enable()
        epoch()
        prof.disable()
        text = io.StringIO()
        pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(12)
        result = {"command": " ".join(sys.argv), "load_avg": os.getloadavg(), "torch": torch.__version__,
                  "src": storage.__file__, "malloc_mmap_threshold": os.environ.get("MALLOC_MMAP_THRESHOLD_"),
                  "images": n, "item_bytes": len(raws[0]), "per_item": stages, "loop_ms_per_item": loop_ms,
                  "profile_top": text.getvalue().splitlines()}
        print(json.dumps({k: v for k, v in result.items() if k != "profile_top"}, indent=1))
        print(text.getvalue())
        if args.out:
            Path(args.out).write_text(json.dumps(result, indent=1))
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
