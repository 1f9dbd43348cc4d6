"""Datasets that stay on storage, read item by item (in DataLoader workers), and the loader that times them.

Design and use: docs/how-to/storage.md. In short: an item is *read* (its bytes from a file, or from a tar
shard at an offset, or from the MinIO cache of ``data/cache.py``) and *decoded* (image decode, augment,
normalise) where the loader runs it; every item's read and decode times travel with its batch
(``LoadTimes``), so a step record can split the device's wait for data as DS-Analyzer does. A problem with
one item (a corrupt image, a file gone mid-epoch) travels as a ``Failed`` value and is raised in the
training process as one line naming the item; a worker that dies is named with its exit signal.
"""
from __future__ import annotations

import ctypes
import dataclasses
import io
import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

import numpy as np
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset
from torch.utils.data._utils.signal_handling import _remove_worker_pids

from edgetrain.cluster.limits import memory_group
from edgetrain.data.detection import yolo_parts
from edgetrain.data.formats import _class_names, class_files, image_folder_arrays, split_80_20
from edgetrain.data.images import DataSplit, normalise
from edgetrain.errors import EdgetrainError

# Imported inside functions: PIL (Pillow comes with matplotlib, not declared; only image files need it).

DECODE_ERRORS: tuple = (OSError, SyntaxError, ValueError, EOFError)
# The training images whose pixels give a dataset on storage its mean and std: a seeded sample of 1/STATS_SHARE of
# them, at least STATS_MIN (all of a smaller set), at most STATS_SAMPLE. Setup reads these and every header, no
# more: a per-channel mean and deviation need no more than a few dozen images to be right to a percent or two.
STATS_SAMPLE, STATS_MIN, STATS_SHARE = 2048, 64, 16


class _Account:
    """What the items read in this process since the last ``take`` cost (one per process: workers are forks)."""

    def __init__(self):
        self.take()

    def take(self) -> tuple[float, int, int, int]:
        out = getattr(self, "read_s", 0.0), getattr(self, "storage", 0), getattr(self, "cached", 0), \
            getattr(self, "bytes", 0)
        self.read_s, self.storage, self.cached, self.bytes = 0.0, 0, 0, 0
        return out


ACCOUNT = _Account()


@dataclass
class LoadTimes:
    """A batch's cost in the loader, summed over its items (seconds of the process that loaded it)."""

    read_s: float = 0.0       # bytes from storage or cache
    decode_s: float = 0.0     # decode, augment, normalise, collate
    items: int = 0
    storage_items: int = 0    # items read from storage (not the MinIO cache)
    cache_items: int = 0      # items served by the MinIO cache
    bytes_read: int = 0       # bytes read from storage


@dataclass
class Failed:
    """An item the loader could not give: travels with the batch, raised as one line in the training process."""

    message: str


# -- where items are --------------------------------------------------------------------------------------

class FileSource:
    """One file per item."""

    fix = "replace or remove it"

    def __init__(self, paths: Sequence[Path | str]):
        self.paths = [str(p) for p in paths]

    def __len__(self) -> int:
        return len(self.paths)

    def name(self, index: int) -> str:
        return self.paths[index]

    def size(self, index: int) -> int:
        return os.stat(self.paths[index]).st_size

    def read(self, index: int, drop: bool = False) -> bytes:
        with open(self.paths[index], "rb") as f:
            raw = f.read()
            if drop:  # its pages leave the page cache (``StoredItems.fetch`` says when)
                os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
        return raw

    def kind(self, index: int) -> str:
        return Path(self.paths[index]).suffix.lower().lstrip(".")


class ShardSource:
    """Members of tar shards (``data/shards.py``): ``(shard path, offset of the data, size, extension, key)``
    per item, read with ``os.pread`` on a file descriptor this process opens once per shard.

    ``shuffled``: the items are read in a random order (a training split), so each descriptor is opened with
    ``POSIX_FADV_RANDOM``: the kernel's readahead would otherwise read past a member into its neighbours, which
    a dataset larger than memory evicts unread (1.3x the dataset's bytes per epoch from the page cache alone,
    docs/benchmarks/storage.md)."""

    fix = "pack the dataset again (edgetrain data pack)"

    def __init__(self, entries: list[tuple[str, int, int, str, str]], shuffled: bool = False):
        self.entries, self.shuffled = entries, shuffled
        self._fds: dict[str, int] = {}
        self._pid = os.getpid()

    def __len__(self) -> int:
        return len(self.entries)

    def __getstate__(self):
        return {"entries": self.entries, "shuffled": self.shuffled}

    def __setstate__(self, state):
        self.__init__(state["entries"], state.get("shuffled", False))

    def name(self, index: int) -> str:
        shard, _, _, ext, key = self.entries[index]
        return f"{key}.{ext} in shard {shard}"

    def size(self, index: int) -> int:
        return self.entries[index][2]

    def kind(self, index: int) -> str:
        return self.entries[index][3]

    def read(self, index: int, drop: bool = False) -> bytes:
        shard, offset, size, _, _ = self.entries[index]
        if self._pid != os.getpid():  # a forked worker: descriptors are per process
            self._fds, self._pid = {}, os.getpid()
        fd = self._fds.get(shard)
        if fd is None:
            fd = self._fds[shard] = os.open(shard, os.O_RDONLY)
            if self.shuffled:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
        raw = os.pread(fd, size, offset)
        if len(raw) != size:
            raise EOFError(f"the shard ends {size - len(raw)} bytes early")
        if drop:  # the pages wholly inside this member (a neighbour's shared edge page stays)
            os.posix_fadvise(fd, offset, size, os.POSIX_FADV_DONTNEED)
        return raw


# -- the datasets -----------------------------------------------------------------------------------------

class StoredItems(Dataset):
    """Items on storage, indexed like ``TensorImages`` (``(index, epoch)`` pairs, or plain ints: epoch 0)."""

    cache = None  # a MinioCache (data/cache.py) set by the training loader with --cache-mb

    def __init__(self, source, mean, std, augment: bool, seed: int):
        self.source = source
        self.mean = torch.tensor(mean, dtype=torch.float32).view(-1, 1, 1)
        self.std = torch.tensor(std, dtype=torch.float32).view(-1, 1, 1)
        self.augment, self.seed = augment, seed

    def __len__(self) -> int:
        return len(self.source)

    def fetch(self, index: int) -> bytes:
        t0 = time.perf_counter()
        raw = self.cache.get(index) if self.cache is not None else None
        if raw is None:
            try:
                raw = self.source.read(index, drop=self.cache is not None and self.cache.drop_pages)
            except FileNotFoundError:
                raise EdgetrainError(f"item {index}: {self.source.name(index)} is gone from storage (deleted or "
                                     "unmounted during training); restore it and run again (--resume where "
                                     "checkpoints were kept)") from None
            except (OSError, EOFError) as e:
                raise EdgetrainError(f"item {index}: {self.source.name(index)} cannot be read ({e}); check the "
                                     f"storage, or {self.source.fix}") from None
            ACCOUNT.storage += 1
            ACCOUNT.bytes += len(raw)
            if self.cache is not None:
                self.cache.put(index, raw)
        else:
            ACCOUNT.cached += 1
        ACCOUNT.read_s += time.perf_counter() - t0
        return raw

    def image(self, index: int, mode: str, size: int | None = None) -> np.ndarray:
        """Item ``index`` as a uint8 (C, H, W) array: an encoded image (PNG, JPEG), or an ``.npy`` array."""
        raw = self.fetch(index)
        try:
            if self.source.kind(index) == "npy":
                return load_npy(raw)
            return decode_image(raw, mode, size)
        except DECODE_ERRORS as e:
            raise EdgetrainError(f"item {index}: {self.source.name(index)} cannot be decoded ({e}); "
                                 f"{self.source.fix}") from None


_NPY_HEADERS: dict[bytes, tuple[np.dtype, tuple[int, ...], str, int]] = {}


def load_npy(raw: bytes) -> np.ndarray:
    """An ``.npy`` member as a writable array, as ``np.load`` gives it, with one copy of the data: the header is
    parsed once per distinct header (a packed set's items share one), where ``np.load(BytesIO(raw))`` parses each
    with ``ast`` and copies the data twice (measured: docs/benchmarks/storage.md)."""
    major = raw[6] if len(raw) > 7 and raw[:6] == b"\x93NUMPY" else 0
    end = 10 + int.from_bytes(raw[8:10], "little") if major == 1 else \
        12 + int.from_bytes(raw[8:12], "little") if major in (2, 3) else 0
    header = raw[:end]
    known = _NPY_HEADERS.get(header) if end else None
    if known is None:
        if major not in (1, 2):  # not an .npy file, or a version numpy's public parser leaves to np.load
            return np.load(io.BytesIO(raw), allow_pickle=False)
        with io.BytesIO(raw) as f:  # numpy's own parser and checks (a bad header: ValueError)
            np.lib.format.read_magic(f)
            read = np.lib.format.read_array_header_1_0 if major == 1 else np.lib.format.read_array_header_2_0
            shape, fortran, dtype = read(f)
            if dtype.hasobject:
                raise ValueError("Object arrays cannot be loaded when allow_pickle=False")
            known = (dtype, tuple(shape), "F" if fortran else "C", f.tell())
        if len(_NPY_HEADERS) < 64:  # a handful in any one dataset
            _NPY_HEADERS[header] = known
    dtype, shape, order, offset = known
    count = int(np.prod(shape, dtype=np.int64))
    if len(raw) - offset < count * dtype.itemsize:
        raise EOFError(f"the array ends {count * dtype.itemsize - (len(raw) - offset)} bytes early")
    return np.frombuffer(raw, dtype, count, offset).reshape(shape, order=order).copy(order="K")


def decode_image(raw: bytes, mode: str, size: int | None = None) -> np.ndarray:
    """An encoded image as uint8 (C, H, W), as the in-memory readers make it (``data/formats.py``,
    ``data/detection.py``): converted to ``mode``, resized bilinearly to ``size`` x ``size`` where given."""
    from PIL import Image

    with Image.open(io.BytesIO(raw)) as im:
        im = im.convert(mode)
        if size is not None:
            im = im.resize((size, size), Image.BILINEAR)
        a = np.array(im, dtype=np.uint8)  # a copy torch may write to
    return a[None] if a.ndim == 2 else np.ascontiguousarray(a.transpose(2, 0, 1))


class StoredImages(StoredItems):
    """A classifier's images on storage with their labels (read up front), normalised on access; with
    ``augment`` the CIFAR recipe (``random_crop_flip``) keyed by (seed, epoch, index)."""

    def __init__(self, source, labels: torch.Tensor, mean, std, shape: tuple[int, int, int], mode: str,
                 scale: float = 255.0, augment: bool = False, seed: int = 0):
        super().__init__(source, mean, std, augment, seed)
        self.labels, self._shape, self.mode, self.scale = labels, tuple(shape), mode, scale

    @property
    def shape(self) -> tuple[int, int, int]:
        return self._shape  # type: ignore[return-value]

    def __getitem__(self, key):
        index, epoch = key if isinstance(key, tuple) else (key, 0)
        a = self.image(index, self.mode)
        if tuple(a.shape) != self._shape:
            raise EdgetrainError(f"item {index}: {self.source.name(index)} is {'x'.join(map(str, a.shape))} (CxHxW) "
                                 f"but the dataset's images are {'x'.join(map(str, self._shape))}; resize it to the "
                                 "others' size")
        return normalise(torch.from_numpy(np.ascontiguousarray(a)), self.scale, self.mean, self.std, self.augment,
                         (self.seed, epoch, index)), self.labels[index]


class StoredBoxes(StoredItems):
    """A detector's images on storage, resized to ``image_size``, with their boxes (read and checked up front);
    with ``augment``: horizontal flip and scale jitter that move the boxes (``flip_scale_boxes``)."""

    def __init__(self, source, boxes: list[torch.Tensor], mean, std, image_size: int, augment: bool = False,
                 seed: int = 0):
        super().__init__(source, mean, std, augment, seed)
        self.boxes, self.image_size = boxes, image_size
        self.labels = torch.tensor([int(torch.mode(b[:, 0]).values) if len(b) else 0 for b in boxes],
                                   dtype=torch.int64)

    @property
    def shape(self) -> tuple[int, int, int]:
        return (3, self.image_size, self.image_size)

    def __getitem__(self, key):
        index, epoch = key if isinstance(key, tuple) else (key, 0)
        x = torch.from_numpy(np.ascontiguousarray(self.image(index, "RGB", self.image_size))).float() / 255.0
        boxes = self.boxes[index]
        if self.augment:
            x, boxes = flip_scale_boxes(x, boxes, np.random.default_rng((self.seed, epoch, index)), self.mean)
        return (x - self.mean) / self.std, boxes


def flip_scale_boxes(x: torch.Tensor, boxes: torch.Tensor, rng: np.random.Generator, fill: torch.Tensor,
                     jitter: float = 0.25, keep: float = 0.3) -> tuple[torch.Tensor, torch.Tensor]:
    """Flip half the time, then scale by a factor in [1 - jitter, 1 + jitter] about a random point: a larger
    image is cropped back to the size, a smaller one pasted on ``fill`` (the mean: 0 once normalised). Boxes
    (class, cx, cy, w, h as fractions) move with the pixels, are clipped to the image, and a box left with
    under ``keep`` of its scaled area is dropped (its object is mostly outside)."""
    _, h, w = x.shape
    boxes = boxes.clone()
    if rng.random() < 0.5:
        x = x.flip(-1)
        boxes[:, 1] = 1.0 - boxes[:, 1]
    s = float(rng.uniform(1 - jitter, 1 + jitter))
    nh, nw = max(1, round(h * s)), max(1, round(w * s))
    scaled = F.interpolate(x[None], size=(nh, nw), mode="bilinear", align_corners=False)[0]
    oy, ox = int(rng.integers(0, abs(nh - h) + 1)), int(rng.integers(0, abs(nw - w) + 1))
    if nh >= h:
        out, dy = scaled[:, oy:oy + h], -oy
    else:
        out, dy = fill.expand(x.shape[0], h, nw).clone(), oy
        out[:, oy:oy + nh] = scaled
    if nw >= w:
        out, dx = out[:, :, ox:ox + w], -ox
    else:
        wide = fill.expand(x.shape[0], h, w).clone()
        wide[:, :, ox:ox + nw] = out
        out, dx = wide, ox
    if len(boxes):
        x0 = (boxes[:, 1] - boxes[:, 3] / 2) * nw + dx
        x1 = (boxes[:, 1] + boxes[:, 3] / 2) * nw + dx
        y0 = (boxes[:, 2] - boxes[:, 4] / 2) * nh + dy
        y1 = (boxes[:, 2] + boxes[:, 4] / 2) * nh + dy
        area = (x1 - x0) * (y1 - y0)
        x0, x1, y0, y1 = x0.clamp(0, w), x1.clamp(0, w), y0.clamp(0, h), y1.clamp(0, h)
        kept = ((x1 - x0) * (y1 - y0) >= keep * area) & (x1 - x0 >= 1) & (y1 - y0 >= 1)
        boxes = torch.stack([boxes[:, 0], (x0 + x1) / 2 / w, (y0 + y1) / 2 / h, (x1 - x0) / w, (y1 - y0) / h],
                            1)[kept]
    return out.contiguous(), boxes


def statistics_sample(count: int) -> int:
    """How many of ``count`` training images give the normalisation statistics (``STATS_SAMPLE``'s rule)."""
    return min(count, max(STATS_MIN, min(STATS_SAMPLE, count // STATS_SHARE)))


def pixel_statistics(read: Callable[[int], np.ndarray], count: int, seed: int, scale: float = 255.0):
    """Per-channel mean and standard deviation of images ``read(k)`` (uint8 (C, H, W)) over a seeded sample of
    ``statistics_sample(count)`` of the ``count``, computed as ``formats.arrays_split`` computes an in-memory
    set's: the same figures where every image is read."""
    size = statistics_sample(count)
    pick = np.arange(count) if count <= size else np.sort(np.random.default_rng(seed).permutation(count)[:size])
    # Sums in float64 one image at a time: a device with little memory never holds the sample whole.
    total = squares = None
    n = 0
    for k in pick:
        pixels = torch.as_tensor(read(int(k))).double().div(scale).flatten(1)
        total = pixels.sum(1) if total is None else total + pixels.sum(1)
        squares = (pixels ** 2).sum(1) if squares is None else squares + (pixels ** 2).sum(1)
        n += pixels.shape[1]
    mean = total / n
    var = (squares - n * mean ** 2) / max(n - 1, 1)
    return mean.float().tolist(), var.clamp_min(0).sqrt().float().clamp_min(1e-6).tolist()


# -- the training loader ----------------------------------------------------------------------------------

class TimedItems(Dataset):
    """A training set whose items come with what they cost (``ACCOUNT``'s read, the rest decode), and whose
    refused items (``EdgetrainError``) come as ``Failed`` values rather than as a worker's traceback."""

    def __init__(self, dataset: Dataset):
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)  # type: ignore[arg-type]

    def __getitem__(self, key):
        ACCOUNT.take()
        t0 = time.perf_counter()
        try:
            sample = self.dataset[key]
        except EdgetrainError as e:
            return Failed(str(e))
        total = time.perf_counter() - t0
        read_s, storage, cached, nbytes = ACCOUNT.take()
        return sample, (read_s, total - read_s, storage, cached, nbytes)


def _malloc_trim() -> Callable[[], None]:
    """glibc's ``malloc_trim(0)``, or nothing where the C library has none (musl, macOS)."""
    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return lambda: None
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return lambda: trim(0)


release_freed_heap = _malloc_trim()


class TimedCollate:
    """The task's collate over the samples, the batch's ``LoadTimes`` beside it (collate counted as decode).

    In a loader worker, the heap the batch's items freed goes back to the kernel after each batch: glibc keeps
    freed chunks below live ones (an item's bytes and tensors, where its mmap threshold is above their size),
    and a worker's heap grew by tens of MB over the first epochs, charged to the device's memory cgroup until
    the OOM killer ended the run (docs/benchmarks/storage.md)."""

    def __init__(self, collate: Callable):
        self.collate = collate

    def __call__(self, items):
        failed = next((i for i in items if isinstance(i, Failed)), None)
        if failed is not None:
            return failed
        t0 = time.perf_counter()
        batch = self.collate([s for s, _ in items])
        costs = [c for _, c in items]
        if torch.utils.data.get_worker_info() is not None:
            release_freed_heap()  # what the items freed while decoding (the batch itself lives in shared memory)
        return batch, LoadTimes(read_s=sum(c[0] for c in costs),
                                decode_s=sum(c[1] for c in costs) + time.perf_counter() - t0, items=len(costs),
                                storage_items=sum(c[2] for c in costs), cache_items=sum(c[3] for c in costs),
                                bytes_read=sum(c[4] for c in costs))


@dataclass(frozen=True)
class LoaderOptions:
    """How a device loads: ``workers`` processes with ``prefetch`` batches each (0: in the loop's process),
    ``timeout`` seconds for a batch from a worker, pinned memory for a GPU, and what a worker runs first."""

    workers: int = 0
    prefetch: int = 2
    timeout: float = 60.0
    pin_memory: bool = False
    worker_init_fn: Callable | None = None


class TrainingLoader:
    """The loop's loader: a ``DataLoader`` over ``TimedItems`` with the options' workers and prefetch;
    iterating yields the task's batches, and ``last`` of the iterator holds the ``LoadTimes`` of the batch it
    gave last. ``label`` names the device in its one-line errors."""

    def __init__(self, dataset: Dataset, sampler, collate: Callable, label: str,
                 options: LoaderOptions = LoaderOptions()):
        workers = options.workers
        self.dataset, self.workers, self.timeout, self.label = dataset, workers, options.timeout, label
        self.loader = DataLoader(TimedItems(dataset), batch_sampler=sampler, num_workers=workers,
                                 collate_fn=TimedCollate(collate), persistent_workers=workers > 0,
                                 timeout=options.timeout if workers > 0 else 0,
                                 worker_init_fn=options.worker_init_fn if workers else None,
                                 pin_memory=options.pin_memory, prefetch_factor=options.prefetch if workers > 0 else None)

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self) -> "TimedBatches":
        return TimedBatches(self)


class TimedBatches:
    def __init__(self, owner: TrainingLoader):
        self.owner = owner
        self.it = iter(owner.loader)
        self.last = LoadTimes()

    def __iter__(self):
        return self

    def __next__(self):
        try:
            item = next(self.it)
        except StopIteration:
            raise
        except RuntimeError as e:
            problem = loader_failure(e, self.it, self.owner)
            self.close(hung="timed out" in str(e))
            raise problem from None
        if isinstance(item, Failed):
            self.close()
            raise EdgetrainError(f"{self.owner.label}: {item.message}")
        batch, self.last = item
        return batch

    def close(self, hung: bool = False) -> None:
        """Stop the workers now (a failed batch ends the run: none may be left behind, and a hung one would
        hold torch's orderly shutdown for seconds per worker)."""
        if hung and getattr(self.it, "_worker_pids_set", False):
            _remove_worker_pids(id(self.it))  # torch's SIGCHLD handler would report the kill below as a death
            self.it._worker_pids_set = False
            for worker in self.it._workers:
                if worker.is_alive():
                    worker.kill()
        shutdown = getattr(self.it, "_shutdown_workers", None)
        if shutdown is not None:
            shutdown()


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


_SIGNAL_FIXES = {
    signal.SIGKILL: "most often the kernel's out-of-memory killer (the device's memory, page cache included): lower "
                    "--workers, --prefetch or --cache-mb, or give the device more memory",
    signal.SIGBUS: "a memory-mapped file shrank or its file system filled up under it: check the data and "
                   "/dev/shm, or lower --cache-mb",
    signal.SIGSEGV: "a crash in native code while loading an item: run with --workers 0 to see which item",
}


def _worker_oom(sig: int) -> str | None:
    """Under ``--device-limits cgroup``, what a worker's SIGKILL was, exactly: the device's memory group, which
    its workers are in, counts the out-of-memory killer's kills. None where the device has no group."""
    group = memory_group(os.getpid()) if sig == signal.SIGKILL else None
    if group is None:
        return None
    limit, kills = group
    if kills:
        return (f"the kernel's out-of-memory killer, at the device's memory limit of {limit} MiB (page cache "
                "included): lower --workers, --prefetch or --cache-mb, or give its profile more memory_mb")
    return ("not the out-of-memory killer (the device's memory group counted no kill): another process or a person "
            "killed it; see the system log (dmesg)")


def loader_failure(error: RuntimeError, it, owner: TrainingLoader) -> EdgetrainError:
    """One line for a DataLoader's failure: a dead worker named with its exit signal or code, or a timeout."""
    text = str(error)
    if "timed out" in text:
        return EdgetrainError(f"{owner.label}: its data loader gave no batch within {owner.timeout:g} s "
                              f"({owner.workers} worker(s)); the storage is too slow or a worker hangs: raise "
                              "--timeout, or check the storage")
    if "DataLoader worker" not in text:
        raise error
    for k, worker in enumerate(getattr(it, "_workers", [])):
        worker.join(timeout=1.0)
        code = worker.exitcode
        if code is None or code == 0:
            continue
        if code < 0:
            sig = -code
            fix = _worker_oom(sig) or _SIGNAL_FIXES.get(sig, "see the system log (dmesg) for why")
            return EdgetrainError(f"{owner.label}: data-loader worker {k} (pid {worker.pid}) was killed by "
                                  f"{_signal_name(sig)} ({sig}); {fix}")
        return EdgetrainError(f"{owner.label}: data-loader worker {k} (pid {worker.pid}) exited with code {code}; "
                              "run with --workers 0 to see the error in the training process")
    return EdgetrainError(f"{owner.label}: a data-loader worker died ({text.splitlines()[0].strip()}); run with "
                          "--workers 0 to see the error in the training process")


# -- datasets from folders, left on storage ---------------------------------------------------------------

@dataclass
class SetupReads:
    """What reading a dataset's description on storage read (headers, the statistics' sample), of its bytes."""

    headers: int = 0
    header_bytes: int = 0
    sample: int = 0
    sample_bytes: int = 0
    dataset_bytes: int = 0

    def describe(self) -> str:
        return (f"read {self.headers:,} image headers ({self.header_bytes / 1e6:.2f} MB) and {self.sample:,} images "
                f"for the normalisation statistics ({self.sample_bytes / 1e6:.2f} MB), "
                f"{(self.header_bytes + self.sample_bytes) / max(self.dataset_bytes, 1):.1%} of its "
                f"{self.dataset_bytes / 1e6:.2f} MB")


class _HeaderFile(io.FileIO):
    """An image file opened for its header: unbuffered, as Python's 8 KiB buffer would read a small image whole,
    and without the kernel's readahead (``POSIX_FADV_RANDOM``), which would read the rest into the page cache;
    counts the bytes Pillow asked for."""

    def __init__(self, path, reads: SetupReads):
        super().__init__(path, "rb")
        os.posix_fadvise(self.fileno(), 0, 0, os.POSIX_FADV_RANDOM)
        self.reads = reads
        reads.headers += 1
        reads.dataset_bytes += os.fstat(self.fileno()).st_size

    def read(self, size: int = -1):
        data = super().read(size)
        self.reads.header_bytes += len(data or b"")
        return data

    def readinto(self, buffer):
        n = super().readinto(buffer)
        self.reads.header_bytes += n or 0
        return n


def _headers(paths: Sequence[Path], reads: SetupReads) -> tuple[str, tuple[int, int]]:
    """Every image's header (not its pixels): ("L" if all are grey else "RGB", the one (width, height))."""
    from PIL import Image, UnidentifiedImageError

    grey, size, first = True, None, None
    for path in paths:
        try:
            with _HeaderFile(path, reads) as f, Image.open(f) as im:
                mode, this = im.mode, im.size
        except (OSError, UnidentifiedImageError, SyntaxError, ValueError) as e:
            raise EdgetrainError(f"image {path} cannot be read ({e}); replace or remove it") from None
        grey = grey and mode in ("L", "1")
        if size is None:
            size, first = this, path
        elif this != size:
            raise EdgetrainError(f"image {path} is {this[0]}x{this[1]} pixels but {first} is {size[0]}x{size[1]}; "
                                 "resize the images to one size")
    return ("L" if grey else "RGB"), size  # type: ignore[return-value]


def image_folder_on_storage(root: str | Path, seed: int = 0, augment: bool = False):
    """``imagefolder`` left on storage (``--from-storage``): the same classes, split and (for a set of up to
    ``STATS_SAMPLE`` training images) the same normalisation as ``formats.image_folder``; every file's header
    is read up front, its pixels when a loader asks for it."""
    root = Path(root) if root is not None else Path("")
    if not root.is_dir():
        image_folder_arrays(root)  # its one line for a missing folder
    if (root / "train").is_dir() and (root / "test").is_dir():
        classes = _class_names(root / "train")
        (ptr, ltr), (pte, lte) = (class_files(root / part, classes) for part in ("train", "test"))
    else:
        paths, labels = class_files(root, _class_names(root))
        ptr, ltr, pte, lte = split_80_20(np.array(paths, dtype=object), np.asarray(labels), seed, root)
    reads = SetupReads()
    mode, (w, h) = _headers([*ptr, *pte], reads)
    shape = (1 if mode == "L" else 3, h, w)
    ytr, yte = torch.as_tensor(np.asarray(ltr, dtype=np.int64)), torch.as_tensor(np.asarray(lte, dtype=np.int64))
    plain = StoredImages(FileSource(ptr), ytr, [0.0] * shape[0], [1.0] * shape[0], shape, mode)
    mean, std = _sampled_statistics(lambda k: plain.image(k, mode), len(plain), seed, reads)
    classes = int(max(ytr.max(), yte.max() if len(yte) else 0)) + 1
    make = lambda p, y, aug: StoredImages(FileSource(p), y, mean, std, shape, mode, augment=aug, seed=seed)  # noqa: E731
    return DataSplit(make(ptr, ytr, augment), make(pte, yte, False), classes, root.name,
                     {"storage": "files", "setup_read": dataclasses.asdict(reads)})


def _sampled_statistics(read: Callable[[int], np.ndarray], count: int, seed: int, reads: SetupReads):
    """``pixel_statistics``, the sample's images and bytes counted in ``reads``."""
    before = ACCOUNT.bytes
    stats = pixel_statistics(read, count, seed)
    reads.sample, reads.sample_bytes = statistics_sample(count), ACCOUNT.bytes - before
    return stats


def yolo_on_storage(root: str | Path, image_size: int = 128, seed: int = 0, augment: bool = False):
    """``yolo`` left on storage: every label file read and checked up front (``detection.yolo_parts``), every
    image's header too; pixels when a loader asks, resized to ``image_size``."""
    parts = yolo_parts(root, seed)
    (ptr, btr), (pte, bte), count, names, root = parts.train, parts.test, parts.classes, parts.names, parts.root
    reads = SetupReads()
    _check_headers([*ptr, *pte], reads)
    as_boxes = lambda bs: [torch.as_tensor(b, dtype=torch.float32).reshape(-1, 5) for b in bs]  # noqa: E731
    plain = StoredBoxes(FileSource(ptr), as_boxes(btr), [0.0] * 3, [1.0] * 3, image_size)
    mean, std = _sampled_statistics(lambda k: plain.image(k, "RGB", image_size), len(plain), seed, reads)
    train = StoredBoxes(FileSource(ptr), as_boxes(btr), mean, std, image_size, augment, seed)
    test = StoredBoxes(FileSource(pte), as_boxes(bte), mean, std, image_size)
    return DataSplit(train, test, count, root.name,
                     {"class_names": names or [str(c) for c in range(count)], "storage": "files",
                      "clipped_boxes": parts.clipped, "setup_read": dataclasses.asdict(reads)})


def _check_headers(paths: Sequence[Path], reads: SetupReads) -> None:
    from PIL import Image, UnidentifiedImageError

    for path in paths:
        try:
            with _HeaderFile(path, reads) as f, Image.open(f):
                pass
        except (OSError, UnidentifiedImageError, SyntaxError, ValueError) as e:
            raise EdgetrainError(f"image {path} cannot be read ({e}); replace or remove it") from None
