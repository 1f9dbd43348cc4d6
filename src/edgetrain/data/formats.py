"""Your own data on disk: an image folder, a ``.npz`` of arrays or a CSV table
(``--dataset imagefolder|npz|csv --data-dir PATH``).

Design: docs/design/data.md ("Formats").
"""
from __future__ import annotations

import csv
import zipfile
from pathlib import Path

import numpy as np
import torch

from edgetrain.data.images import (DataSplit, TensorImages, TensorSamples, feature_statistics, split_indices,
                                   values_split)
from edgetrain.errors import EdgetrainError

# Imported inside functions: PIL (Pillow comes with matplotlib, not declared; only image files need it) and sklearn (a
# second of CPU in every device process that imported it).

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


def class_files(folder: Path, classes: list[str]) -> tuple[list[Path], list[int]]:
    """Every image file of the class subfolders of ``folder`` (sorted) and its label (the class's position)."""
    paths, labels = [], []
    for label, name in enumerate(classes):
        files = sorted(p for p in (folder / name).iterdir() if p.suffix.lower() in IMAGE_SUFFIXES) \
            if (folder / name).is_dir() else []
        if not files:
            raise EdgetrainError(f"class folder {folder / name} holds no PNG or JPEG images; add some or remove it")
        paths += files
        labels += [label] * len(files)
    return paths, labels


def _read_classes(folder: Path, classes: list[str]) -> tuple[np.ndarray, np.ndarray]:
    from PIL import Image, UnidentifiedImageError

    pictures = []
    files, labels = class_files(folder, classes)
    for path in files:
        try:
            with Image.open(path) as im:
                im.load()
                pictures.append((path, im.copy()))
        except (OSError, UnidentifiedImageError, SyntaxError, ValueError) as e:
            raise EdgetrainError(f"image {path} cannot be read ({e}); replace or remove it") from None
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
    arrays = _read_npz(path)
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


def npz_values(path: str | Path, seed: int = 0) -> DataSplit:
    """A regression ``.npz``: ``x`` (N, ...) float inputs and ``y`` (N,) or (N, K) float targets
    (docs/design/data.md)."""
    path = Path(path)
    arrays = _read_npz(path)
    x, y = _inputs(arrays["x"], path, "x"), _values(arrays["y"], path, "y", len(arrays["x"]))
    if "x_test" in arrays:
        x_test, y_test = _inputs(arrays["x_test"], path, "x_test"), _values(arrays["y_test"], path, "y_test",
                                                                             len(arrays["x_test"]))
        if x_test.shape[1:] != x.shape[1:] or y_test.shape[1:] != y.shape[1:]:
            raise EdgetrainError(f"npz file {path}: x_test/y_test samples are {x_test.shape[1:]}/{y_test.shape[1:]} "
                                 f"but x/y samples are {x.shape[1:]}/{y.shape[1:]}; save both with one shape")
        return values_split(x, y, name=path.stem, x_test=x_test, y_test=y_test)
    _enough(len(y), path)
    return values_split(x, y, *split_indices(len(y), seed), name=path.stem)


def _read_npz(path: Path) -> dict:
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
    return arrays


def _inputs(x: np.ndarray, path: Path, key: str) -> np.ndarray:
    if x.ndim < 2 or len(x) == 0:
        raise EdgetrainError(f"{path}: {key} has shape {x.shape}; save inputs as (N, ...) with one row per sample")
    if not (np.issubdtype(x.dtype, np.floating) or np.issubdtype(x.dtype, np.integer)):
        raise EdgetrainError(f"{path}: {key} is {x.dtype}; save numeric inputs")
    bad = np.argwhere(~np.isfinite(x.astype(np.float64)))
    if len(bad):
        raise EdgetrainError(f"{path}: {key} holds {x.flat[np.ravel_multi_index(bad[0], x.shape)]} at sample "
                             f"{bad[0][0]}; replace NaN and inf inputs (or drop those samples)")
    return x.astype(np.float64)


def _values(y: np.ndarray, path: Path, key: str, count: int, row_offset: int | None = None) -> np.ndarray:
    """Regression targets (N,) or (N, K): numeric and finite, one per sample."""
    if y.ndim not in (1, 2) or len(y) != count or not (np.issubdtype(y.dtype, np.floating)
                                                        or np.issubdtype(y.dtype, np.integer)):
        raise EdgetrainError(f"{path}: {key} has shape {y.shape} of {y.dtype}; save {count} real targets, (N,) or "
                             "(N, K), one per sample")
    bad = np.argwhere(~np.isfinite(y.astype(np.float64)))
    if len(bad):
        where = f"line {bad[0][0] + row_offset}" if row_offset is not None else f"sample {bad[0][0]}"
        raise EdgetrainError(f"{path}: target {key} is {y.reshape(len(y), -1)[bad[0][0]].tolist()} at {where}; "
                             f"regression targets must be finite numbers: fix or drop that sample")
    return y.astype(np.float64)


def _enough(n: int, source: Path) -> None:
    if n < 5:
        raise EdgetrainError(f"{source} holds {n} samples, too few to split 80/20 into training and test sets; "
                             "add samples or give the test set yourself")


def csv_values(path: str | Path, seed: int = 0, labels: bool = False) -> DataSplit:
    """A CSV table (docs/design/data.md): real targets (``labels`` False: regression) or class labels."""
    path = Path(path)
    if path.is_dir():
        if not ((path / "train.csv").is_file() and (path / "test.csv").is_file()):
            raise EdgetrainError(f"csv folder {path} lacks train.csv and test.csv; give a .csv file or a folder "
                                 "with both")
        (x, y), (x_test, y_test) = (_read_csv(path / f, labels) for f in ("train.csv", "test.csv"))
        if x_test.shape[1:] != x.shape[1:] or y_test.shape[1:] != y.shape[1:]:
            raise EdgetrainError(f"csv folder {path}: test.csv has other columns than train.csv; give both the same "
                                 "header")
    else:
        x, y = _read_csv(path, labels)
        _enough(len(y), path)
        train, test = split_indices(len(y), seed)
        x, y, x_test, y_test = x[train], y[train], x[test], y[test]
    if not labels:
        return values_split(x, y, name=path.stem, x_test=x_test, y_test=y_test)
    mean, std = feature_statistics(torch.as_tensor(x))
    classes = int(max(y.max(), y_test.max() if len(y_test) else 0)) + 1
    return DataSplit(TensorSamples(torch.as_tensor(x).float(), torch.as_tensor(y), mean, std),
                     TensorSamples(torch.as_tensor(x_test).float(), torch.as_tensor(y_test), mean, std), classes,
                     path.stem)


def _read_csv(path: Path, labels: bool) -> tuple[np.ndarray, np.ndarray]:
    if not path.is_file():
        raise EdgetrainError(f"csv file {path} does not exist; set data_dir to a .csv with a header row and a "
                             "column y")
    try:
        with open(path, newline="", encoding="utf-8") as f:
            rows = list(csv.reader(f))
    except (OSError, UnicodeDecodeError) as e:
        raise EdgetrainError(f"csv file {path} cannot be read ({e}); save it as UTF-8 text") from None
    if not rows:
        raise EdgetrainError(f"csv file {path} is empty; give a header row and one row per sample")
    header = [h.strip() for h in rows[0]]
    targets = [i for i, h in enumerate(header) if h == "y" or (h[:1] == "y" and h[1:].isdigit())]
    features = [i for i in range(len(header)) if i not in targets]
    if not targets or not features:
        raise EdgetrainError(f"csv file {path}: header {','.join(header)} names "
                             f"{'no target column' if not targets else 'no feature column'}; name the target "
                             "column y (or y1, y2, ...) and give at least one feature column")
    values = []
    for line, row in enumerate(rows[1:], start=2):
        if not any(cell.strip() for cell in row):
            continue
        if len(row) != len(header):
            raise EdgetrainError(f"{path} line {line}: {len(row)} values but the header has {len(header)} columns; "
                                 "give one value per column")
        try:
            values.append([float(cell) for cell in row])
        except ValueError:
            bad = next(c for c in row if not _is_float(c))
            raise EdgetrainError(f"{path} line {line}: {bad!r} is not a number; give numbers only") from None
    if not values:
        raise EdgetrainError(f"csv file {path} has a header but no rows; give one row per sample")
    table = np.asarray(values, dtype=np.float64)
    x = _inputs(table[:, features], path, "features")
    y = table[:, targets] if len(targets) > 1 else table[:, targets[0]]
    if labels:
        if len(targets) > 1 or not np.all(np.isfinite(y)) or np.any(y != np.round(y)) or y.min() < 0:
            raise EdgetrainError(f"{path}: column y must hold integer class labels >= 0 for a classifier; give "
                                 "labels 0..K-1, or --task regression for real targets")
        return x, y.astype(np.int64)
    return x, _values(y, path, "y", len(y), row_offset=2)


def _is_float(text: str) -> bool:
    try:
        float(text)
        return True
    except ValueError:
        return False
