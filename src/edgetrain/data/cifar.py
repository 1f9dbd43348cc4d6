"""CIFAR-10 from a directory in the official python format.

The official release pickles each batch as a dict with ``data`` (N x 3072
uint8, channel-major 32x32 images) and ``labels``. Files are unpickled with a
restricted unpickler that builds only numpy arrays, so a hostile file cannot
run code, and every batch is checked: a missing, truncated or wrong file is one
clear error naming the file.
"""
from __future__ import annotations

import io
import pickle
from pathlib import Path

import numpy as np
import torch

from edgetrain.errors import EdgetrainError

TRAIN_FILES = tuple(f"data_batch_{i}" for i in range(1, 6))
TEST_FILE = "test_batch"
MEAN = (0.4914, 0.4822, 0.4465)
STD = (0.2470, 0.2435, 0.2616)
CLASSES = ("airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck")


class _NumpyOnlyUnpickler(pickle.Unpickler):
    ALLOWED = {("numpy", "ndarray"), ("numpy", "dtype"), ("numpy.core.multiarray", "_reconstruct"),
               ("numpy._core.multiarray", "_reconstruct"), ("numpy.core.multiarray", "scalar"),
               ("numpy._core.multiarray", "scalar"), ("copy_reg", "_reconstructor"), ("copyreg", "_reconstructor"),
               ("__builtin__", "object"), ("builtins", "object"),
               # protocol 5 pickles an array as frombuffer(bytes, dtype).reshape(shape): it copies no code
               # and refuses object dtypes, so it builds only plain numpy arrays too.
               ("numpy.core.numeric", "_frombuffer"), ("numpy._core.numeric", "_frombuffer")}
    # numpy 2 moved numpy.core to numpy._core (the old name still imports, with a DeprecationWarning).
    MOVED = {"numpy.core.multiarray": "numpy._core.multiarray", "numpy.core.numeric": "numpy._core.numeric"}

    def find_class(self, module: str, name: str):
        if (module, name) not in self.ALLOWED:
            raise pickle.UnpicklingError(f"refusing to load {module}.{name}")
        if np.lib.NumpyVersion(np.__version__) >= "2.0.0":
            module = self.MOVED.get(module, module)
        return super().find_class(module, name)


def read_batch(path: Path) -> tuple[np.ndarray, np.ndarray]:
    """Images (N, 3, 32, 32) uint8 and labels (N,) int64 of one batch file."""
    fix = "re-download or re-extract CIFAR-10 (python version)"
    if not path.is_file():
        raise EdgetrainError(f"CIFAR-10 file {path} is missing; {fix}")
    try:
        with open(path, "rb") as f:
            batch = _NumpyOnlyUnpickler(io.BufferedReader(f), encoding="bytes").load()
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError, IndexError, MemoryError) as e:
        raise EdgetrainError(f"CIFAR-10 file {path} is corrupt or truncated ({type(e).__name__}: {e}); {fix}") from None
    if not isinstance(batch, dict):
        raise EdgetrainError(f"CIFAR-10 file {path} is not a CIFAR-10 batch (holds a {type(batch).__name__}); {fix}")
    batch = {k.decode() if isinstance(k, bytes) else k: v for k, v in batch.items()}
    data, labels = batch.get("data"), batch.get("labels")
    if not isinstance(data, np.ndarray) or labels is None:
        raise EdgetrainError(f"CIFAR-10 file {path} lacks 'data' or 'labels'; {fix}")
    labels = np.asarray(labels, dtype=np.int64)
    if data.dtype != np.uint8 or data.ndim != 2 or data.shape[1] != 3072 or len(data) != len(labels):
        raise EdgetrainError(f"CIFAR-10 file {path} has data of shape {data.shape} and dtype {data.dtype}, "
                             f"expected (N, 3072) uint8 with {len(labels)} labels; {fix}")
    if len(labels) and (labels.min() < 0 or labels.max() > 9):
        raise EdgetrainError(f"CIFAR-10 file {path} has labels outside 0..9; {fix}")
    return data.reshape(-1, 3, 32, 32), labels


def check_cifar10_dir(root: str | Path) -> Path:
    """``root`` if it is a directory holding every batch file (not read here: ``read_batch`` checks contents)."""
    root = Path(root)
    fix = "set data_dir to the folder holding data_batch_1..5 and test_batch (cifar-10-batches-py)"
    if not root.is_dir():
        raise EdgetrainError(f"CIFAR-10 directory {root} does not exist; {fix}")
    missing = [name for name in (*TRAIN_FILES, TEST_FILE) if not (root / name).is_file()]
    if missing:
        verb = "is" if len(missing) == 1 else "are"
        raise EdgetrainError(f"CIFAR-10 directory {root}: {', '.join(missing)} {verb} missing; {fix}")
    return root


def load_cifar10(root: str | Path) -> tuple[tuple[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
    """((train images, labels), (test images, labels)) as uint8 / int64 tensors."""
    root = check_cifar10_dir(root)
    train = [read_batch(root / name) for name in TRAIN_FILES]
    test = read_batch(root / TEST_FILE)
    x = np.concatenate([b[0] for b in train])
    y = np.concatenate([b[1] for b in train])
    return (torch.from_numpy(x), torch.from_numpy(y)), (torch.from_numpy(test[0].copy()), torch.from_numpy(test[1]))
