"""Packed shards: a dataset as WebDataset-style tar files, for few large sequential files instead of many small.

Format (docs/how-to/storage.md): ``OUT/train-000000.tar``, ``OUT/test-000000.tar``, ... plain POSIX tar
archives as WebDataset writes them: one sample is the members sharing a key, ``<key>.<ext>``: the image as
it was on disk (``.png``, ``.jpg``) or as a NumPy array (``.npy``, for in-memory sets), and its target
(``.cls``: the class as decimal text; ``.txt``: YOLO box lines ``class cx cy w h``). ``OUT/edgetrain-shards.json``
holds what training needs before the first item: task, classes, shape, normalisation, each split's shards
and item count. Any tar tool lists them, and WebDataset reads them.

Reading (``shards_split``): each shard's member headers are read once up front (Python's ``tarfile``) into an
index of (offset, size), and the targets; an item is then one ``pread`` at its offset, in any order, as
WebDataset's indexed reader (``wids``) does, so the shuffled global batches are the same as any dataset's.
"""
from __future__ import annotations

import io
import json
import os
import tarfile
from pathlib import Path

import numpy as np
import torch

from edgetrain.data.images import DataSplit, TensorImages
from edgetrain.data.storage import FileSource, ShardSource, StoredBoxes, StoredImages
from edgetrain.errors import EdgetrainError

META = "edgetrain-shards.json"
FORMAT = "edgetrain-shards (WebDataset tar)"


def _sample_members(dataset, index: int, detection: bool) -> list[tuple[str, bytes]]:
    """(extension, bytes) of one sample."""
    if isinstance(getattr(dataset, "source", None), FileSource):
        image = (dataset.source.kind(index), dataset.source.read(index))
    else:  # an in-memory set: its array as it is held (uint8 or float), exact
        array = dataset.images[index].numpy()
        buffer = io.BytesIO()
        np.save(buffer, array, allow_pickle=False)
        image = ("npy", buffer.getvalue())
    if detection:
        text = "".join(f"{int(b[0])} {b[1]:.8g} {b[2]:.8g} {b[3]:.8g} {b[4]:.8g}\n" for b in dataset.boxes[index].tolist())
        return [image, ("txt", text.encode())]
    return [image, ("cls", f"{int(dataset.labels[index])}\n".encode())]


def pack(data: DataSplit, output: str | Path, shard_mb: float = 64.0, detection: bool = False) -> dict:
    """Write ``data`` (its train and test sets) as shards in ``output``; returns the metadata written.

    Shard files are written under a ``.partial`` name and renamed once whole; the metadata file comes last, so
    a pack that fails leaves no shard set that reads as complete (and removes its partial files)."""
    out = Path(output)
    out.mkdir(parents=True, exist_ok=True)
    if (out / META).exists():
        raise EdgetrainError(f"{out} already holds packed shards ({META}); pick an empty --output folder or remove "
                             "the old shards")
    splits, written = {}, []
    try:
        for part in ("train", "test"):
            dataset = getattr(data, part)
            names, shard, size, k = [], None, 0, 0
            for index in range(len(dataset)):
                members = _sample_members(dataset, index, detection)
                if shard is None or size >= shard_mb * 1e6:
                    if shard is not None:
                        shard.close()
                    names.append(f"{part}-{len(names):06d}.tar")
                    path = out / (names[-1] + ".partial")
                    written.append(path)
                    shard, size = tarfile.open(path, "w", format=tarfile.USTAR_FORMAT), 0
                for ext, raw in members:
                    info = tarfile.TarInfo(f"{index:08d}.{ext}")
                    info.size, info.mtime, info.mode = len(raw), 0, 0o444
                    shard.addfile(info, io.BytesIO(raw))
                    size += len(raw) + 1024
                k += 1
            if shard is not None:
                shard.close()
            splits[part] = {"shards": names, "items": k}
        for path in written:
            path.rename(path.with_suffix(""))
    except OSError as e:
        for path in written:
            for p in (path, path.with_suffix("")):
                p.unlink(missing_ok=True)
        raise EdgetrainError(f"packing into {out} failed ({e}); free space there or pick another --output") from None
    train = data.train
    meta = {"format": FORMAT, "version": 1, "task": "detection" if detection else "classification",
            "name": data.name, "num_classes": data.num_classes,
            "class_names": data.details.get("class_names"), "shape": list(data.input_shape),
            "mean": train.mean.flatten().tolist(), "std": train.std.flatten().tolist(),
            "mode": getattr(train, "mode", "L" if data.input_shape[0] == 1 else "RGB"),
            "scale": float(getattr(train, "scale", 255.0)), "image_size": data.input_shape[-1], "splits": splits}
    (out / META).write_text(json.dumps(meta, indent=1))
    return meta


def _read_meta(root: Path) -> dict:
    path = root / META
    if not path.is_file():
        raise EdgetrainError(f"{root} holds no {META}; write shards with 'edgetrain data pack --output {root}' and "
                             "set data_dir to that folder")
    try:
        meta = json.loads(path.read_text())
        assert meta["format"] == FORMAT and meta["splits"]["train"]["shards"] is not None
    except (OSError, ValueError, KeyError, TypeError, AssertionError):
        raise EdgetrainError(f"{path} is not the metadata edgetrain data pack writes; pack the dataset again") from None
    return meta


def index_shard(path: Path) -> dict[str, dict[str, tuple[int, int]]]:
    """{key: {extension: (offset of its data, size)}} of one tar shard, checked to be whole."""
    if not path.is_file():
        raise EdgetrainError(f"shard {path} is missing; restore it or pack the dataset again")
    end = path.stat().st_size
    samples: dict[str, dict[str, tuple[int, int]]] = {}
    try:
        with tarfile.open(path, "r:") as tar:
            for member in tar:
                if not member.isfile():
                    continue
                key, _, ext = member.name.rpartition("/")[2].partition(".")
                if member.offset_data + member.size > end:
                    raise tarfile.ReadError(f"member {member.name} runs past the end of the file")
                samples.setdefault(key, {})[ext] = (member.offset_data, member.size)
    except (tarfile.TarError, OSError, EOFError, ValueError) as e:
        raise EdgetrainError(f"shard {path} is corrupt ({e}); pack the dataset again (edgetrain data pack)") from None
    return samples


def _targets(path: Path, fd: int, key: str, members: dict, detection: bool):
    ext = "txt" if detection else "cls"
    if ext not in members:
        raise EdgetrainError(f"shard {path}: sample {key} has no .{ext} member; pack the dataset again")
    offset, size = members[ext]
    text = os.pread(fd, size, offset).decode("utf-8", "replace")
    try:
        if not detection:
            return int(text.strip())
        rows = [[float(v) for v in line.split()] for line in text.splitlines() if line.strip()]
        return torch.tensor(rows, dtype=torch.float32).reshape(-1, 5)
    except (ValueError, RuntimeError):
        raise EdgetrainError(f"shard {path}: {key}.{ext} holds {text[:40]!r}, not a target; pack the dataset "
                             "again") from None


def _split_items(root: Path, names: list[str], items: int, detection: bool):
    entries, targets = [], []
    for name in names:
        path = root / name
        samples = index_shard(path)
        fd = os.open(path, os.O_RDONLY)
        try:
            for key in sorted(samples):
                members = samples[key]
                image = next((e for e in ("png", "jpg", "jpeg", "npy") if e in members), None)
                if image is None:
                    raise EdgetrainError(f"shard {path}: sample {key} has no image (.png, .jpg or .npy); pack the "
                                         "dataset again")
                entries.append((str(path), *members[image], image, key))
                targets.append(_targets(path, fd, key, members, detection))
        finally:
            os.close(fd)
    if len(entries) != items:
        raise EdgetrainError(f"the shards of {root} hold {len(entries)} samples but {META} says {items}; a shard is "
                             "missing or truncated: pack the dataset again")
    return entries, targets


def shards_split(root: str | Path, seed: int = 0, augment: bool = False, detection: bool = False) -> DataSplit:
    """A packed dataset (``pack``), left on storage."""
    root = Path(root) if root is not None else Path("")
    meta = _read_meta(root)
    if (meta["task"] == "detection") != detection:
        raise EdgetrainError(f"the shards in {root} are a {meta['task']} dataset; train them with --task "
                             f"{meta['task']}")
    parts = {}
    for part in ("train", "test"):
        split = meta["splits"][part]
        parts[part] = _split_items(root, split["shards"], split["items"], detection)
    mean, std, size = meta["mean"], meta["std"], int(meta["image_size"])
    details = {"class_names": meta.get("class_names") or [str(c) for c in range(meta["num_classes"])],
               "storage": "shards"}
    if not detection:
        shape, mode, scale = tuple(meta["shape"]), meta["mode"], float(meta["scale"])

    def make(part, train: bool):
        # The training split is read shuffled (ShardSource: no readahead), the test split in order.
        entries, targets = part
        source = ShardSource(entries, shuffled=train)
        if detection:
            return StoredBoxes(source, targets, mean, std, size, train and augment, seed)
        return StoredImages(source, torch.tensor(targets, dtype=torch.int64), mean, std, shape, mode, scale,
                            train and augment, seed)

    return DataSplit(make(parts["train"], True), make(parts["test"], False), int(meta["num_classes"]),
                     meta.get("name") or root.name, details)


def is_packable(data: DataSplit) -> bool:
    return all(isinstance(d, (TensorImages, StoredImages, StoredBoxes)) or hasattr(d, "boxes")
               for d in (data.train, data.test))
