"""Loader workers hand the heap they freed back to the kernel after each batch (``data/storage.py``): with items
whose tensors glibc serves from its heap (benchmarks/cache.py's ``MALLOC_MMAP_THRESHOLD_`` of 1 MiB, or glibc's
own threshold once it has risen), the freed memory a worker kept grew the memory that is not data by tens of MB
over the first epochs, and the OOM killer ended the runs in a device's memory cgroup (docs/benchmarks/storage.md)."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

CHILD = r"""
import json, multiprocessing as mp, sys
from pathlib import Path
import numpy as np, torch
from edgetrain.data.cache import attach_cache
from edgetrain.data.images import DataSplit, TensorImages
from edgetrain.data.sampler import GlobalBatchSampler
from edgetrain.data.shards import pack, shards_split
from edgetrain.data.storage import LoaderOptions, TrainingLoader

def heap_kb(pid):
    # kB of the brk heap (glibc's main arena) that the process wrote since the fork
    # (its mappings: the part inherited from the fork and what the worker's brk added after it)
    lines = Path(f"/proc/{pid}/smaps").read_text().splitlines()
    return sum(next(int(x.split()[1]) for x in lines[k + 1:] if x.startswith("Private_Dirty:"))
               for k, line in enumerate(lines) if line.endswith("[heap]"))

root, images, size = Path(sys.argv[1]), 800, 128
pixels = torch.from_numpy(np.random.default_rng(0).integers(0, 255, (images, 3, size, size), dtype=np.uint8))
labels, stats = torch.arange(images) % 10, ([0.5] * 3, [0.29] * 3)
pack(DataSplit(TensorImages(pixels, labels, *stats), TensorImages(pixels[:10], labels[:10], *stats), 10, "n"), root)
del pixels
train = shards_split(root).train
attach_cache(train, images * 3 * size * size / 2 / 1e6, 0, str(root))
sampler = GlobalBatchSampler(images, [16], 0, seed=0)
mp.set_start_method("fork", force=True)  # as training forks them: they share the cache's map
loader = TrainingLoader(train, sampler, torch.utils.data.default_collate, "device 0", LoaderOptions(2, 1, 60))
after = []
for epoch in range(5):
    sampler.set_epoch(epoch)
    it = iter(loader)
    for _ in it:
        pass
    after.append([heap_kb(w.pid) for w in it.it._workers])
print(json.dumps(after))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/PID/smaps; glibc's heap")
def test_loader_workers_do_not_keep_freed_heap_across_epochs(tmp_path):
    # A fresh interpreter, its heap small at the fork as a device process's is, with the benchmark's threshold.
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_=str(1 << 20), PYTHONPATH=str(Path(__file__).parents[2] / "src"))
    out = subprocess.run([sys.executable, "-c", CHILD, str(tmp_path)], env=env, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    after = json.loads(out.stdout.strip().splitlines()[-1])
    grown = [b - a for a, b in zip(after[0], after[-1])]
    assert max(grown) < 4096, f"a worker's heap grew {max(grown)} kB from epoch 1 to 5 (kB per epoch: {after})"
