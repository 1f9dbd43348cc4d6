"""Detection data: images with a variable number of boxes each (``--dataset shapes|yolo|coco``).

A sample is ``(image (C, H, W) normalised, boxes (n, 5))``, rows ``[class, cx, cy, w, h]`` as fractions of
the image (an image without objects has ``n = 0``); ``tasks.detection.collate_boxes`` pads a batch.

* ``shapes`` (the default, generated, no download): circles, squares and triangles of several colours and
  sizes on a noisy background, one to three per image (a few images empty), each with its tight box.
  Deterministic in (seed, split, index).
* ``yolo`` (``--data-dir PATH``): Darknet/Ultralytics folders, ``images/`` beside ``labels/`` holding one
  ``<image stem>.txt`` per image with a line ``class cx cy w h`` per object (an empty file: no objects);
  ``PATH/train`` and ``PATH/test`` (or ``val``) give the split, or ``images/train`` and ``labels/train``
  (Ultralytics), else a seeded 80/20 split. ``classes.txt`` (one name a line) sets the classes.
* ``coco`` (``--data-dir PATH``): ``PATH/train.json`` and ``PATH/test.json`` (or one ``annotations.json``,
  split 80/20), COCO's ``images``/``annotations``/``categories`` with ``bbox`` ``[x, y, w, h]`` in pixels;
  image files relative to the JSON's folder or its ``images/``. Categories are classes in id order; crowd
  annotations (``iscrowd``) are left out.

Images are read with Pillow, resized to ``image_size`` square (boxes are fractions, so they do not move)
and normalised with the training set's per-channel mean and deviation. Every file problem is one
``EdgetrainError`` naming the file (and line) and the fix, raised while the data is read: before any
device starts.
"""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch
from torch.utils.data import Dataset

from edgetrain.data.images import DataSplit
from edgetrain.errors import EdgetrainError

# Imported inside functions: PIL (Pillow comes with matplotlib, not declared; only image files need it).

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp")
SHAPE_CLASSES = ("circle", "square", "triangle")
_EDGE = 1e-6  # a box may overshoot the image by rounding, no more


class DetectionImages(Dataset):
    """Images (N, C, H, W) uint8 and per-image boxes (n_i, 5) float32, normalised on access.

    Indexed by ``(index, epoch)`` pairs from ``GlobalBatchSampler`` (or plain ints). ``labels`` is each
    image's most frequent class (0 for an empty image), what label-based partitions split by."""

    def __init__(self, images: torch.Tensor, boxes: list[torch.Tensor], mean, std, scale: float = 255.0):
        self.images, self.boxes = images, boxes
        self.mean = torch.tensor(mean, dtype=torch.float32).view(-1, 1, 1)
        self.std = torch.tensor(std, dtype=torch.float32).view(-1, 1, 1)
        self.scale = scale
        self.labels = torch.tensor([int(torch.mode(b[:, 0]).values) if len(b) else 0 for b in boxes],
                                   dtype=torch.int64)

    def __len__(self) -> int:
        return len(self.boxes)

    @property
    def shape(self) -> tuple[int, int, int]:
        return tuple(self.images.shape[1:])  # type: ignore[return-value]

    def subset(self, index: torch.Tensor) -> "DetectionImages":
        """The images ``index`` with their boxes (dedup keeps the images it does not drop)."""
        smaller = DetectionImages(self.images[index], [self.boxes[int(k)] for k in index], (), (), self.scale)
        smaller.mean, smaller.std = self.mean, self.std
        return smaller

    def __getitem__(self, key):
        index, _ = key if isinstance(key, tuple) else (key, 0)
        x = self.images[index].float() / self.scale
        return (x - self.mean) / self.std, self.boxes[index]


def detection_split(train: tuple[np.ndarray, list[np.ndarray]], test: tuple[np.ndarray, list[np.ndarray]],
                    num_classes: int, name: str, class_names: list[str] | None = None) -> DataSplit:
    """A ``DataSplit`` of ``DetectionImages`` from uint8 (N, C, H, W) images and per-image box arrays."""
    pixels = torch.as_tensor(train[0]).float().div(255.0).transpose(0, 1).reshape(train[0].shape[1], -1)
    mean, std = pixels.mean(1).tolist(), pixels.std(1).clamp_min(1e-6).tolist()

    def make(images, boxes):
        return DetectionImages(torch.as_tensor(images), [torch.as_tensor(b, dtype=torch.float32).reshape(-1, 5)
                                                          for b in boxes], mean, std)

    names = class_names or [str(c) for c in range(num_classes)]
    return DataSplit(make(*train), make(*test), num_classes, name,
                     {"class_names": names})


# -- the embedded default -------------------------------------------------------------------------------------

_PALETTE = np.array([[230, 60, 60], [60, 200, 80], [70, 110, 240], [240, 210, 60], [220, 90, 220],
                     [80, 220, 230]], dtype=np.float32)


def _shape_mask(kind: int, x0: float, y0: float, side: float, size: int) -> np.ndarray:
    yy, xx = np.mgrid[0:size, 0:size].astype(np.float32) + 0.5
    if kind == 0:  # circle
        r = side / 2
        return (xx - x0 - r) ** 2 + (yy - y0 - r) ** 2 <= r * r
    if kind == 1:  # square
        return (xx >= x0) & (xx < x0 + side) & (yy >= y0) & (yy < y0 + side)
    # upright triangle: apex at the top centre, base along the bottom
    top, bottom, cx = y0, y0 + side, x0 + side / 2
    inside_rows = (yy >= top) & (yy < bottom)
    half = (yy - top) / side * side / 2
    return inside_rows & (np.abs(xx - cx) <= half)


def shapes_image(rng: np.random.Generator, size: int) -> tuple[np.ndarray, np.ndarray]:
    """One generated image (3, size, size) uint8 and its boxes (n, 5)."""
    base = rng.uniform(10, 70, size=3).astype(np.float32)
    img = base[:, None, None] + rng.normal(0, 12, size=(3, size, size)).astype(np.float32)
    count = 0 if rng.random() < 0.05 else int(rng.integers(1, 4))
    placed: list[tuple[float, float, float, float]] = []
    boxes = []
    for _ in range(count):
        for _try in range(20):
            side = float(rng.uniform(0.15, 0.45)) * size
            x0, y0 = (float(v) for v in rng.uniform(0, size - side, size=2))
            if all(x0 + side <= a or a + s <= x0 or y0 + side <= b or b + s <= y0 for a, b, s, _ in placed):
                break
        else:
            continue
        kind = int(rng.integers(0, len(SHAPE_CLASSES)))
        mask = _shape_mask(kind, x0, y0, side, size)
        if not mask.any():
            continue
        colour = _PALETTE[rng.integers(0, len(_PALETTE))] * float(rng.uniform(0.8, 1.1))
        img[:, mask] = colour[:, None] + rng.normal(0, 8, size=(3, int(mask.sum()))).astype(np.float32)
        rows, cols = np.nonzero(mask.any(1))[0], np.nonzero(mask.any(0))[0]
        c0, c1, r0, r1 = cols[0], cols[-1] + 1, rows[0], rows[-1] + 1
        placed.append((x0, y0, side, kind))
        boxes.append([kind, (c0 + c1) / 2 / size, (r0 + r1) / 2 / size, (c1 - c0) / size, (r1 - r0) / size])
    return np.clip(img, 0, 255).astype(np.uint8), np.asarray(boxes, dtype=np.float32).reshape(-1, 5)


def shapes(samples: int = 2048, image_size: int = 128, seed: int = 0) -> DataSplit:
    """The embedded detection set: ``samples`` training images and a quarter as many test images."""
    def make(n: int, part: int):
        made = [shapes_image(np.random.default_rng((seed, part, k)), image_size) for k in range(n)]
        return np.stack([m[0] for m in made]), [m[1] for m in made]

    return detection_split(make(samples, 0), make(max(samples // 4, 1), 1), len(SHAPE_CLASSES), "shapes",
                           list(SHAPE_CLASSES))


# -- files ----------------------------------------------------------------------------------------------------

def _read_image(path: Path, size: int) -> np.ndarray:
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(path) as im:
            im = im.convert("RGB").resize((size, size), Image.BILINEAR)
            return np.asarray(im, dtype=np.uint8).transpose(2, 0, 1)
    except (OSError, UnidentifiedImageError, SyntaxError, ValueError) as e:
        raise EdgetrainError(f"image {path} cannot be read ({e}); replace or remove it") from None


def _finite_with_area(box: tuple[float, float, float, float], where: str, fix_units: str) -> None:
    if not all(math.isfinite(v) for v in box):
        raise EdgetrainError(f"{where}: box {list(box)} is not finite; {fix_units}")
    if box[2] <= 0 or box[3] <= 0:
        raise EdgetrainError(f"{where}: box has zero or negative width or height ({box[2]:g} x {box[3]:g}); give "
                             f"the object's size, or drop the line")


def check_box(box: tuple[float, float, float, float], where: str, fix_units: str) -> None:
    """A ``cx, cy, w, h`` box (fractions) must lie in the image and have an area."""
    _finite_with_area(box, where, fix_units)
    cx, cy, w, h = box
    if cx - w / 2 < -_EDGE or cy - h / 2 < -_EDGE or cx + w / 2 > 1 + _EDGE or cy + h / 2 > 1 + _EDGE:
        raise EdgetrainError(f"{where}: box (cx {cx:g}, cy {cy:g}, w {w:g}, h {h:g}) reaches outside the image "
                             f"[0, 1]; {fix_units}")


def yolo_box(box: tuple[float, float, float, float], where: str, fix_units: str
             ) -> tuple[tuple[float, float, float, float], bool]:
    """A YOLO ``cx, cy, w, h`` box clipped to the image, and whether it had to be. As Ultralytics' label check,
    each value must be a fraction in [0, 1] (anything else is pixels or a broken export), but a box may pass the
    image's edge (labelling tools round, and a box of an object cut by the frame does): it is clipped."""
    _finite_with_area(box, where, fix_units)
    cx, cy, w, h = box
    if not all(0 <= v <= 1 for v in box):
        raise EdgetrainError(f"{where}: box (cx {cx:g}, cy {cy:g}, w {w:g}, h {h:g}) has a value outside [0, 1]; "
                             f"{fix_units}")
    x0, x1 = max(cx - w / 2, 0.0), min(cx + w / 2, 1.0)
    y0, y1 = max(cy - h / 2, 0.0), min(cy + h / 2, 1.0)
    clipped = (x0, x1, y0, y1) != (cx - w / 2, cx + w / 2, cy - h / 2, cy + h / 2)
    return ((x0 + x1) / 2, (y0 + y1) / 2, x1 - x0, y1 - y0), clipped


def _check_class(c: int, num_classes: int | None, where: str, names_file: str) -> None:
    if c < 0:
        raise EdgetrainError(f"{where}: class {c} is negative; number classes from 0")
    if num_classes is not None and c >= num_classes:
        raise EdgetrainError(f"{where}: class {c} but {names_file} names {num_classes} classes (0..{num_classes - 1})"
                             f"; fix the class id or add the class to {names_file}")


def read_yolo_labels(path: Path, num_classes: int | None, names_file: Path) -> tuple[np.ndarray, int]:
    """One label file: ``(n, 5)`` rows ``class cx cy w h`` (blank lines skipped) and how many of its boxes were
    clipped to the image (``yolo_box``); ``names_file`` is the ``classes.txt`` that gave ``num_classes``."""
    rows, clipped = [], 0
    units = "YOLO labels are 'class cx cy w h' with the centre and size as fractions of the image (0..1)"
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        fields = line.split()
        if not fields:
            continue
        where = f"label file {path} line {number}"
        try:
            values = [float(v) for v in fields]
        except ValueError:
            values = []
        if len(values) != 5 or values[0] != int(values[0]):
            raise EdgetrainError(f"{where}: {line.strip()!r} is not 'class cx cy w h'; write an integer class and "
                                 "four numbers per line")
        c = int(values[0])
        _check_class(c, num_classes, where, str(names_file))
        box, cut = yolo_box(tuple(values[1:]), where, units)
        clipped += cut
        rows.append([c, *box])
    return np.asarray(rows, dtype=np.float32).reshape(-1, 5), clipped


def yolo_listing(images_dir: Path, labels_dir: Path, num_classes: int | None, names_file: Path
                 ) -> tuple[list[Path], list[np.ndarray], int]:
    """The images of one YOLO part (sorted), their boxes (every label file read and checked) and how many boxes
    were clipped to their image."""
    if not images_dir.is_dir() or not labels_dir.is_dir():
        missing = images_dir if not images_dir.is_dir() else labels_dir
        raise EdgetrainError(f"YOLO folder: {missing} does not exist; put images in {images_dir} and one "
                             f"<image name>.txt per image in {labels_dir}")
    pictures = {p.stem: p for p in sorted(images_dir.iterdir()) if p.suffix.lower() in IMAGE_SUFFIXES}
    labels = {p.stem: p for p in sorted(labels_dir.iterdir()) if p.suffix == ".txt"}
    for stem, path in labels.items():
        if stem not in pictures:
            raise EdgetrainError(f"label file {path} has no image {images_dir}/{stem}.png or .jpg; add the image "
                                 "or remove the label file")
    for stem, path in pictures.items():
        if stem not in labels:
            raise EdgetrainError(f"image {path} has no label file {labels_dir}/{stem}.txt; add it (empty if the "
                                 "image holds no objects)")
    if not pictures:
        raise EdgetrainError(f"YOLO folder {images_dir} holds no PNG or JPEG images; add images and their labels")
    read = [read_yolo_labels(labels[s], num_classes, names_file) for s in pictures]
    return list(pictures.values()), [boxes for boxes, _ in read], sum(clipped for _, clipped in read)


def _class_names(root: Path) -> list[str] | None:
    path = root / "classes.txt"
    if not path.is_file():
        return None
    names = [line.strip() for line in path.read_text().splitlines() if line.strip()]
    if not names:
        raise EdgetrainError(f"{path} names no classes; write one class name a line, or remove it to number "
                             "classes from the labels")
    return names


def _required(root, dataset: str, what: str) -> Path:
    if not root:
        raise EdgetrainError(f"config key 'data_dir' is required with dataset {dataset}; point it at {what}")
    return Path(root)


def yolo_folder(root: str | Path, image_size: int = 128, seed: int = 0) -> DataSplit:
    parts = yolo_parts(root, seed)
    read = lambda part: (np.stack([_read_image(p, image_size) for p in part[0]]), part[1])  # noqa: E731
    data = detection_split(read(parts.train), read(parts.test), parts.classes, parts.root.name, parts.names)
    data.details["clipped_boxes"] = parts.clipped
    return data


class YoloParts(NamedTuple):
    train: tuple[list[Path], list[np.ndarray]]   # image paths, boxes
    test: tuple[list[Path], list[np.ndarray]]
    classes: int
    names: list[str] | None     # classes.txt's, if there is one
    root: Path
    clipped: int                # boxes clipped to their image (yolo_box)


def yolo_parts(root: str | Path, seed: int = 0) -> YoloParts:
    """A YOLO folder's parts, every label file read and checked; the images are not read."""
    root = _required(root, "yolo", "the folder holding images/ and labels/")
    if not root.is_dir():
        raise EdgetrainError(f"YOLO folder {root} does not exist; set data_dir to a folder holding images/ and "
                             "labels/ (or train/ and test/, each holding both)")
    names = _class_names(root)
    known = len(names) if names else None
    parts = None
    for test in ("test", "val"):
        if (root / "train").is_dir() and (root / test).is_dir():
            parts = [(root / p / "images", root / p / "labels") for p in ("train", test)]
        elif (root / "images" / "train").is_dir() and (root / "images" / test).is_dir():
            parts = [(root / "images" / p, root / "labels" / p) for p in ("train", test)]
        if parts:
            break
    names_file = root / "classes.txt"  # the one _class_names read, whatever the layout
    if parts:
        (*train, cut_train), (*test_part, cut_test) = (yolo_listing(i, l, known, names_file) for i, l in parts)
        clipped = cut_train + cut_test
    else:
        paths, boxes, clipped = yolo_listing(root / "images", root / "labels", known, names_file)
        train, test_part = _split_80_20((np.array(paths, dtype=object), boxes), seed, root)
    count = known or 1 + int(max((b[:, 0].max() for b in list(train[1]) + list(test_part[1]) if len(b)), default=0))
    return YoloParts((list(train[0]), list(train[1])), (list(test_part[0]), list(test_part[1])), count, names, root,
                     clipped)


def _split_80_20(part, seed: int, source: Path):
    images, boxes = part
    if len(boxes) < 5:
        raise EdgetrainError(f"{source} holds {len(boxes)} images, too few to split 80/20 into training and test "
                             "sets; add images or give the test set yourself (train/ and test/)")
    order = np.random.default_rng(seed).permutation(len(boxes))
    cut = int(round(len(boxes) * 0.8))
    pick = lambda idx: (images[idx], [boxes[k] for k in idx])  # noqa: E731
    return pick(np.sort(order[:cut])), pick(np.sort(order[cut:]))


def read_coco(path: Path, image_size: int, categories: list[int] | None = None):
    """(images, boxes, (category id, name) in class order) of one COCO JSON file; ``categories``: the ids
    another file of the set defined (a test file is read in the training file's classes)."""
    try:
        data = json.loads(path.read_text())
        images, annotations = data["images"], data.get("annotations", [])
        names = {int(c["id"]): str(c.get("name", c["id"])) for c in data.get("categories", [])}
        cats = sorted(names)
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise EdgetrainError(f"COCO file {path} cannot be read ({type(e).__name__}: {e}); give a JSON object with "
                             "'images', 'annotations' and 'categories' lists") from None
    cats = categories if categories is not None else cats
    if not cats:
        raise EdgetrainError(f"COCO file {path} lists no categories; add 'categories': [{{'id': 1, 'name': ...}}]")
    index = {c: k for k, c in enumerate(cats)}
    by_id, files = {}, []
    for k, im in enumerate(images):
        try:
            by_id[im["id"]] = (k, float(im["width"]), float(im["height"]))
            name = im["file_name"]
        except (KeyError, TypeError, ValueError):
            raise EdgetrainError(f"COCO file {path}: images[{k}] lacks id, file_name, width or height; give all "
                                 "four") from None
        found = [p / name for p in (path.parent, path.parent / "images") if (p / name).is_file()]
        if not found:
            raise EdgetrainError(f"COCO file {path}: images[{k}] names {name} but neither {path.parent / name} nor "
                                 f"{path.parent / 'images' / name} exists; add the image or remove its entry")
        files.append(found[0])
    boxes: list[list] = [[] for _ in images]
    units = "COCO bbox is [x, y, width, height] in pixels inside the image"
    for k, ann in enumerate(annotations):
        where = f"COCO file {path} annotations[{k}]"
        try:
            image, x, y, bw, bh = ann["image_id"], *(float(v) for v in ann["bbox"])
            cat = int(ann["category_id"])
        except (KeyError, TypeError, ValueError):
            raise EdgetrainError(f"{where} is not an annotation with image_id, category_id and bbox [x, y, w, h]; "
                                 "fix or remove it") from None
        if ann.get("iscrowd", 0):  # a crowd region, not one object: COCO's own evaluation ignores it too
            continue
        if image not in by_id:
            raise EdgetrainError(f"{where}: image_id {image} is not in 'images'; add the image or remove the "
                                 "annotation")
        if cat not in index:
            raise EdgetrainError(f"{where}: category_id {cat} is not in 'categories' ({', '.join(map(str, cats))}); "
                                 "fix the id or add the category")
        row, w, h = by_id[image]
        box = ((x + bw / 2) / w, (y + bh / 2) / h, bw / w, bh / h)
        check_box(box, where, units)
        boxes[row].append([index[cat], *box])
    pictures = np.stack([_read_image(f, image_size) for f in files]) if files else None
    if pictures is None:
        raise EdgetrainError(f"COCO file {path} lists no images; add some")
    return pictures, [np.asarray(b, dtype=np.float32).reshape(-1, 5) for b in boxes], \
        [(c, names.get(c, str(c))) for c in cats]


def coco_folder(root: str | Path, image_size: int = 128, seed: int = 0) -> DataSplit:
    root = _required(root, "coco", "the folder holding train.json and test.json")
    if (root / "train.json").is_file() and (root / "test.json").is_file():
        xs, bs, cats = read_coco(root / "train.json", image_size)
        xt, bt, _ = read_coco(root / "test.json", image_size, [c for c, _ in cats])
        train, test = (xs, bs), (xt, bt)
    elif (root / "annotations.json").is_file():
        xs, bs, cats = read_coco(root / "annotations.json", image_size)
        train, test = _split_80_20((xs, bs), seed, root)
    else:
        raise EdgetrainError(f"COCO folder {root} holds neither train.json and test.json nor annotations.json; "
                             "set data_dir to the folder holding them")
    return detection_split(train, test, len(cats), root.name, [name for _, name in cats])
