"""Your own data on disk: an image folder or a ``.npz`` of arrays (``--dataset imagefolder|npz --data-dir PATH``).

``imagefolder``: ``PATH/<class>/<image>`` with one subfolder per class
(classes in sorted order are labels 0, 1, ...), PNG or JPEG files (by
extension; other files are ignored), read with Pillow (installed with
matplotlib, which requires it). All images must have one size; they are
grayscale (1 channel) if every one is, else RGB. ``PATH/train/<class>`` and
``PATH/test/<class>`` give the split; without them a seeded, stratified 80/20
split is made.

``npz``: a NumPy ``.npz`` (loaded without pickles) holding ``x`` (N, H, W) or
(N, C, H, W) images, uint8 (0..255) or float, and ``y`` (N,) integer labels
0..K-1; ``x_test``/``y_test`` give the split, else 80/20 as above.

Images are normalised per channel with the training set's mean and standard
deviation, and not augmented. A file that cannot be read, a wrong shape or
dtype, or a missing array is one ``EdgetrainError`` naming the file and the fix.
"""
from __future__ import annotations

import zipfile
from pathlib import Path

import numpy as np
import torch

from edgetrain.data.images import DataSplit, TensorImages
from edgetrain.errors import EdgetrainError

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg")


def image_folder(root: str | Path, seed: int = 0) -> DataSplit:
    return _split(*image_folder_arrays(root), seed, Path(root), Path(root).name)


def image_folder_arrays(root: str | Path) -> tuple[np.ndarray, np.ndarray, tuple | None]:
    """(images, labels, (test images, test labels) or None where the folder gives no test split)."""
    root = Path(root)
    if not root.is_dir():
        raise EdgetrainError(f"image folder {root} does not exist or is not a directory; set data_dir to a folder "
                             "with one subfolder of PNG/JPEG images per class")
    if (root / "train").is_dir() and (root / "test").is_dir():
        classes = _class_names(root / "train")
        train, test = (_read_classes(root / part, classes) for part in ("train", "test"))
        return *train, test
    return *_read_classes(root, _class_names(root)), None


def _split(x: np.ndarray, y: np.ndarray, test: tuple | None, seed: int, source: Path, name: str) -> DataSplit:
    """The file's own test split, or a seeded 80/20 one."""
    return arrays_split(*((x, y, *test) if test else split_80_20(x, y, seed, source)), name=name)


def _class_names(folder: Path) -> list[str]:
    classes = sorted(p.name for p in folder.iterdir() if p.is_dir())
    if not classes:
        raise EdgetrainError(f"image folder {folder} has no class subfolders; put each class's images in "
                             f"{folder}/<class>/")
    return classes


def _read_classes(folder: Path, classes: list[str]) -> tuple[np.ndarray, np.ndarray]:
    from PIL import Image, UnidentifiedImageError

    pictures, labels = [], []
    for label, name in enumerate(classes):
        files = sorted(p for p in (folder / name).iterdir() if p.suffix.lower() in IMAGE_SUFFIXES) \
            if (folder / name).is_dir() else []
        if not files:
            raise EdgetrainError(f"class folder {folder / name} holds no PNG or JPEG images; add some or remove it")
        for path in files:
            try:
                with Image.open(path) as im:
                    im.load()
                    pictures.append((path, im.copy()))
            except (OSError, UnidentifiedImageError, SyntaxError, ValueError) as e:
                raise EdgetrainError(f"image {path} cannot be read ({e}); replace or remove it") from None
            labels.append(label)
    grey = all(im.mode in ("L", "1") for _, im in pictures)
    size = pictures[0][1].size
    arrays = []
    for path, im in pictures:
        if im.size != size:
            raise EdgetrainError(f"image {path} is {im.size[0]}x{im.size[1]} pixels but {pictures[0][0]} is "
                                 f"{size[0]}x{size[1]}; resize the images to one size")
        a = np.asarray(im.convert("L" if grey else "RGB"), dtype=np.uint8)
        arrays.append(a[None] if grey else a.transpose(2, 0, 1))
    return np.stack(arrays), np.asarray(labels, dtype=np.int64)


def npz_arrays(path: str | Path, seed: int = 0) -> DataSplit:
    return _split(*npz_file_arrays(path), seed, Path(path), Path(path).stem)


def npz_file_arrays(path: str | Path) -> tuple[np.ndarray, np.ndarray, tuple | None]:
    """(images, labels, (test images, test labels) or None where the file holds no x_test/y_test)."""
    path = Path(path)
    if not path.is_file():
        raise EdgetrainError(f"npz file {path} does not exist; set data_dir to a .npz holding arrays x and y")
    try:
        with np.load(path, allow_pickle=False) as f:
            arrays = {k: f[k] for k in f.files}
    except (OSError, ValueError, zipfile.BadZipFile, EOFError) as e:
        raise EdgetrainError(f"npz file {path} cannot be read ({e}); write it with numpy.savez(path, x=..., y=...) "
                             "and numeric arrays") from None
    missing = [k for k in ("x", "y") if k not in arrays]
    if missing or (("x_test" in arrays) != ("y_test" in arrays)):
        raise EdgetrainError(f"npz file {path} lacks {' and '.join(missing) or 'x_test or y_test'} (holds "
                             f"{', '.join(sorted(arrays)) or 'nothing'}); save x, y and optionally x_test, y_test")
    x, y = (_images(arrays["x"], path, "x"), _labels(arrays["y"], path, "y", len(arrays["x"])))
    if "x_test" in arrays:
        test = (_images(arrays["x_test"], path, "x_test"), _labels(arrays["y_test"], path, "y_test",
                                                                   len(arrays["x_test"])))
        if test[0].shape[1:] != x.shape[1:]:
            raise EdgetrainError(f"npz file {path}: x_test images are {test[0].shape[1:]} but x images are "
                                 f"{x.shape[1:]}; save both with one shape")
        return x, y, test
    return x, y, None


def _images(x: np.ndarray, path: Path, key: str) -> np.ndarray:
    if x.ndim == 3:
        x = x[:, None]
    if x.ndim != 4 or not 1 <= x.shape[1] <= 4 or len(x) == 0:
        raise EdgetrainError(f"npz file {path}: {key} has shape {x.shape}; save images as (N, H, W) or (N, C, H, W) "
                             "with 1 to 4 channels")
    if x.dtype != np.uint8 and not (np.issubdtype(x.dtype, np.floating) and np.isfinite(x).all()):
        raise EdgetrainError(f"npz file {path}: {key} is {x.dtype}; save uint8 (0..255) or finite float images")
    return x


def _labels(y: np.ndarray, path: Path, key: str, count: int) -> np.ndarray:
    if y.ndim != 1 or len(y) != count or not np.issubdtype(y.dtype, np.integer) or (len(y) and y.min() < 0):
        raise EdgetrainError(f"npz file {path}: {key} has shape {y.shape} of {y.dtype}; save {count} integer "
                             "labels >= 0, one per image")
    return y.astype(np.int64)


def split_80_20(images: np.ndarray, labels: np.ndarray, seed: int, source: Path):
    """(train images, train labels, test images, test labels): seeded, stratified where every class has two."""
    from sklearn.model_selection import train_test_split

    if len(labels) < 5:
        raise EdgetrainError(f"{source} holds {len(labels)} images, too few to split 80/20 into training and test "
                             "sets; add images or give the test set yourself")
    order = np.arange(len(labels))
    try:
        train, test = train_test_split(order, test_size=0.2, random_state=seed, stratify=labels)
    except ValueError:  # a class with one image, or more classes than test images: split without strata
        train, test = train_test_split(order, test_size=0.2, random_state=seed)
    return images[train], labels[train], images[test], labels[test]


def arrays_split(x_train, y_train, x_test, y_test, name: str) -> DataSplit:
    """A ``DataSplit`` from (N, C, H, W) arrays or tensors, normalised with the training set's statistics."""
    x_train, x_test = torch.as_tensor(np.asarray(x_train)), torch.as_tensor(np.asarray(x_test))
    y_train, y_test = torch.as_tensor(np.asarray(y_train)).long(), torch.as_tensor(np.asarray(y_test)).long()
    scale = 255.0 if x_train.dtype == torch.uint8 else 1.0
    pixels = x_train.float().div(scale).transpose(0, 1).reshape(x_train.shape[1], -1)
    mean, std = pixels.mean(1).tolist(), pixels.std(1).clamp_min(1e-6).tolist()
    classes = int(max(y_train.max(), y_test.max() if len(y_test) else 0)) + 1
    return DataSplit(TensorImages(x_train, y_train, mean, std, scale=scale),
                     TensorImages(x_test, y_test, mean, std, scale=scale), classes, name)
