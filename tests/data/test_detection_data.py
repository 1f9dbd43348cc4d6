"""Detection data: the generated shapes set, YOLO folders, COCO JSON; every bad file is one line naming it."""
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from edgetrain.config import load_config
from edgetrain.data import build_data
from edgetrain.data.detection import SHAPE_CLASSES, shapes, shapes_image
from edgetrain.errors import EdgetrainError
from edgetrain.tasks.detection import collate_boxes


def data(dataset, path, **extra):
    return build_data(load_config(dataset=dataset, data_dir=str(path), image_size=32, **extra))


def test_shapes_are_deterministic_tight_and_in_range():
    a, b = shapes(40, 64, seed=3), shapes(40, 64, seed=3)
    assert torch.equal(a.train.images, b.train.images)
    assert all(torch.equal(x, y) for x, y in zip(a.train.boxes, b.train.boxes))
    assert not torch.equal(a.train.images, shapes(40, 64, seed=4).train.images)
    assert (a.num_classes, len(a.train), len(a.test), a.input_shape) == (3, 40, 10, (3, 64, 64))
    assert a.details["class_names"] == list(SHAPE_CLASSES)
    boxes = torch.cat(a.train.boxes)
    assert set(boxes[:, 0].long().tolist()) == {0, 1, 2}
    assert (boxes[:, 1:3] - boxes[:, 3:] / 2 >= 0).all() and (boxes[:, 1:3] + boxes[:, 3:] / 2 <= 1).all()
    # Each box is the tight box of its shape: the shape's colour fills its border rows and columns.
    img, found = shapes_image(np.random.default_rng((0, 0, 1)), 64)
    background = np.median(img.reshape(3, -1), axis=1)
    for _, cx, cy, w, h in found:
        c0, c1, r0, r1 = (int(round(v * 64)) for v in (cx - w / 2, cx + w / 2, cy - h / 2, cy + h / 2))
        patch = np.abs(img[:, r0:r1, c0:c1].astype(float) - background[:, None, None]).sum(0) > 60
        assert patch[0].any() and patch[-1].any() and patch[:, 0].any() and patch[:, -1].any()


def test_shapes_holds_images_without_objects():
    split = shapes(200, 32)
    counts = [len(b) for b in split.train.boxes]
    assert 0 in counts and max(counts) <= 3
    x, y = split.train[counts.index(0)]
    assert x.shape == (3, 32, 32) and y.shape == (0, 5)


def test_dedup_keeps_each_image_with_its_boxes():
    from edgetrain.data.dedup import without

    split = shapes(20, 32)
    kept = np.array([3, 7, 11])
    smaller = without(split.train, kept)
    assert len(smaller) == 3 and torch.equal(smaller.images, split.train.images[kept])
    for k, original in enumerate(kept):
        assert torch.equal(smaller[k][1], split.train[int(original)][1])
        assert torch.equal(smaller[k][0], split.train[int(original)][0])
    assert torch.equal(smaller.labels, split.train.labels[kept])


def test_collate_keeps_a_variable_number_of_boxes():
    one = torch.tensor([[1.0, 0.5, 0.5, 0.2, 0.2], [0.0, 0.2, 0.2, 0.1, 0.1]])
    x, target = collate_boxes([(torch.zeros(3, 4, 4), one), (torch.ones(3, 4, 4), torch.zeros(0, 5))])
    assert x.shape == (2, 3, 4, 4) and target.shape == (2, 2, 5)
    assert torch.equal(target[0], one) and (target[1, :, 0] == -1).all()
    _, empty = collate_boxes([(torch.zeros(3, 4, 4), torch.zeros(0, 5))])
    assert empty.shape == (1, 0, 5)


def write_yolo(root: Path, items: dict[str, str], size=(40, 30), classes: list[str] | None = None) -> Path:
    (root / "images").mkdir(parents=True, exist_ok=True)
    (root / "labels").mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    for k, (stem, text) in enumerate(items.items()):
        Image.fromarray(rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)).save(
            root / "images" / f"{stem}.{'png' if k % 2 else 'jpg'}")
        if text is not None:
            (root / "labels" / f"{stem}.txt").write_text(text)
    if classes:
        (root / "classes.txt").write_text("\n".join(classes) + "\n")
    return root


GOOD = {f"img{k}": f"{k % 2} 0.5 0.5 0.2 0.4\n1 0.25 0.3 0.1 0.1\n" for k in range(8)}


def test_yolo_folder_reads_boxes_and_splits(tmp_path):
    items = dict(GOOD, empty="")
    split = data("yolo", write_yolo(tmp_path / "set", items, classes=["a", "b", "c"]))
    assert (len(split.train), len(split.test), split.num_classes, split.input_shape) == (7, 2, 3, (3, 32, 32))
    assert split.details["class_names"] == ["a", "b", "c"]
    every = split.train.boxes + split.test.boxes
    assert sorted(len(b) for b in every) == [0] + [2] * 8
    assert any(torch.allclose(b[0], torch.tensor([1.0, 0.5, 0.5, 0.2, 0.4])) for b in every if len(b))


def test_yolo_folder_train_and_test_layouts(tmp_path):
    for part in ("train", "test"):
        write_yolo(tmp_path / "a" / part, GOOD)
    split = data("yolo", tmp_path / "a")
    assert (len(split.train), len(split.test), split.num_classes) == (8, 8, 2)
    # Ultralytics: images/train, images/val, labels/train, labels/val
    for part in ("train", "val"):
        sub = write_yolo(tmp_path / "tmp" / part, GOOD)
        for kind in ("images", "labels"):
            (tmp_path / "b" / kind).mkdir(parents=True, exist_ok=True)
            (sub / kind).rename(tmp_path / "b" / kind / part)
    split = data("yolo", tmp_path / "b")
    assert (len(split.train), len(split.test)) == (8, 8)


@pytest.mark.parametrize("text, message", [
    ("0 0.9 0.5 1.4 0.2\n", r"label file .*labels/img0.txt line 1: box \(cx 0.9, cy 0.5, w 1.4, h 0.2\) has a "
                           r"value outside \[0, 1\]; YOLO labels are"),
    ("0 0.5 0.5 0.2 0.2\n\n0 1.5 0.5 0.2 0.2\n", r"img0.txt line 3: box .* has a value outside \[0, 1\]"),
    ("0 -0.01 0.5 0.2 0.2\n", r"img0.txt line 1: box .* has a value outside \[0, 1\]"),
    ("3 0.5 0.5 0.2 0.2\n", r"img0.txt line 1: class 3 but .*classes.txt names 3 classes \(0..2\); fix the class id"),
    ("-1 0.5 0.5 0.2 0.2\n", r"img0.txt line 1: class -1 is negative; number classes from 0"),
    ("0 0.5 0.5 0.2\n", r"img0.txt line 1: '0 0.5 0.5 0.2' is not 'class cx cy w h'; write an integer class"),
    ("cat 0.5 0.5 0.2 0.2\n", r"img0.txt line 1: 'cat 0.5 0.5 0.2 0.2' is not 'class cx cy w h'"),
    ("0.5 0.5 0.5 0.2 0.2\n", r"img0.txt line 1: .* is not 'class cx cy w h'"),
    ("0 0.5 0.5 0 0.2\n", r"img0.txt line 1: box has zero or negative width or height"),
    ("0 nan 0.5 0.2 0.2\n", r"img0.txt line 1: box .* is not finite"),
])
def test_bad_yolo_labels_name_the_file_and_line(tmp_path, text, message):
    root = write_yolo(tmp_path / "set", dict(GOOD, img0=text), classes=["a", "b", "c"])
    with pytest.raises(EdgetrainError, match=message):
        data("yolo", root)


def test_a_box_past_the_edge_is_clipped_to_the_image_and_counted(tmp_path):
    # a labelling tool's export: right edge 0.85938 + 0.28125 / 2 = 1.000005; the second box passes the left edge
    root = write_yolo(tmp_path / "set", dict(GOOD, img0="0 0.85938 0.20833 0.28125 0.35417\n1 0.05 0.5 0.2 0.2\n"))
    split = data("yolo", root)
    assert split.details["clipped_boxes"] == 2
    every = [b for b in split.train.boxes + split.test.boxes if len(b)]
    corners = torch.cat([torch.stack([b[:, 1] - b[:, 3] / 2, b[:, 1] + b[:, 3] / 2], 1) for b in every])
    assert corners.min() >= 0 and corners.max() <= 1 + 1e-6
    # clipped: [0.718755, 1] and [0, 0.15] wide, centred within them
    assert any(torch.allclose(b, torch.tensor([[0.0, 0.8593775, 0.20833, 0.28125 - 0.000005, 0.35417],
                                               [1.0, 0.075, 0.5, 0.15, 0.2]]), atol=1e-6) for b in every)


@pytest.mark.parametrize("layout", ["train-test", "ultralytics"])
def test_a_class_out_of_range_names_the_classes_file_that_was_read(tmp_path, layout):
    bad = dict(GOOD, img0="5 0.5 0.5 0.2 0.2\n")
    root = tmp_path / "set"
    for part in ("train", "val"):
        sub = write_yolo(root / part if layout == "train-test" else tmp_path / "parts" / part,
                         bad if part == "train" else GOOD)
        if layout == "ultralytics":
            for kind in ("images", "labels"):
                (root / kind).mkdir(parents=True, exist_ok=True)
                (sub / kind).rename(root / kind / part)
    (root / "classes.txt").write_text("a\nb\n")
    with pytest.raises(EdgetrainError, match=rf"class 5 but {root}/classes.txt names 2 classes .*add the class to "
                                             rf"{root}/classes.txt$"):
        data("yolo", root)


def test_yolo_label_without_image_and_image_without_label(tmp_path):
    root = write_yolo(tmp_path / "set", GOOD)
    (root / "labels" / "ghost.txt").write_text("0 0.5 0.5 0.1 0.1\n")
    with pytest.raises(EdgetrainError, match=r"label file .*labels/ghost.txt has no image .*images/ghost.png or "
                                             r".jpg; add the image or remove the label file"):
        data("yolo", root)
    (root / "labels" / "ghost.txt").unlink()
    (root / "labels" / "img3.txt").unlink()
    with pytest.raises(EdgetrainError, match=r"image .*images/img3.png has no label file .*labels/img3.txt; add it "
                                             r"\(empty if the image holds no objects\)"):
        data("yolo", root)
    with pytest.raises(EdgetrainError, match=r"YOLO folder .*nowhere does not exist; set data_dir"):
        data("yolo", tmp_path / "nowhere")
    for dataset in ("yolo", "coco"):
        with pytest.raises(EdgetrainError, match=f"config key 'data_dir' is required with dataset {dataset}; "
                                                 "point it at the folder holding"):
            build_data(load_config(dataset=dataset))


def write_coco(root: Path, annotations: list[dict], images=4, size=(50, 40)) -> Path:
    (root / "images").mkdir(parents=True, exist_ok=True)
    entries = []
    for k in range(images):
        Image.new("RGB", size, (k * 40, 0, 0)).save(root / "images" / f"{k}.png")
        entries.append({"id": 100 + k, "file_name": f"{k}.png", "width": size[0], "height": size[1]})
    doc = {"images": entries, "annotations": annotations,
           "categories": [{"id": 3, "name": "car"}, {"id": 7, "name": "bike"}]}
    for part in ("train", "test"):
        (root / f"{part}.json").write_text(json.dumps(doc))
    return root


def test_coco_json_reads_pixel_boxes(tmp_path):
    anns = [{"image_id": 100, "category_id": 7, "bbox": [10, 8, 20, 16]},
            {"image_id": 102, "category_id": 3, "bbox": [0, 0, 50, 40]},
            {"image_id": 101, "category_id": 3, "bbox": [0, 0, 50, 40], "iscrowd": 1}]
    split = data("coco", write_coco(tmp_path / "c", anns))
    assert (len(split.train), len(split.test), split.num_classes) == (4, 4, 2)
    assert split.details["class_names"] == ["car", "bike"]
    assert torch.allclose(split.train.boxes[0], torch.tensor([[1.0, 0.4, 0.4, 0.4, 0.4]]))
    assert torch.allclose(split.train.boxes[2], torch.tensor([[0.0, 0.5, 0.5, 1.0, 1.0]]))
    assert split.train.boxes[1].shape == (0, 5)


@pytest.mark.parametrize("ann, message", [
    ({"image_id": 100, "category_id": 5, "bbox": [1, 1, 5, 5]},
     r"train.json annotations\[0\]: category_id 5 is not in 'categories' \(3, 7\); fix the id"),
    ({"image_id": 100, "category_id": 3, "bbox": [40, 1, 20, 5]},
     r"annotations\[0\]: box .* reaches outside the image \[0, 1\]; COCO bbox is \[x, y, width, height\]"),
    ({"image_id": 999, "category_id": 3, "bbox": [1, 1, 5, 5]},
     r"annotations\[0\]: image_id 999 is not in 'images'; add the image"),
    ({"image_id": 100, "bbox": [1, 1, 5, 5]}, r"annotations\[0\] is not an annotation with image_id"),
])
def test_bad_coco_annotations_are_named(tmp_path, ann, message):
    with pytest.raises(EdgetrainError, match=message):
        data("coco", write_coco(tmp_path / "c", [ann]))


def test_coco_image_file_missing_and_no_json(tmp_path):
    root = write_coco(tmp_path / "c", [])
    (root / "images" / "2.png").unlink()
    with pytest.raises(EdgetrainError, match=r"COCO file .*train.json: images\[2\] names 2.png but neither .* "
                                             r"exists; add the image or remove its entry"):
        data("coco", root)
    with pytest.raises(EdgetrainError, match=r"COCO folder .* holds neither train.json and test.json nor "
                                             r"annotations.json"):
        data("coco", tmp_path)


def test_a_bad_label_stops_the_cli_in_one_line_before_any_device_starts(tmp_path):
    from edgetrain_testing import run_main

    root = write_yolo(tmp_path / "set", dict(GOOD, img5="0 0.5 0.5 0.2 0.2\n2 0.5 1.2 0.1 0.1\n"))
    done = run_main("train", "--dataset", "yolo", "--data-dir", str(root), "--devices", "2",
                    "--output", str(tmp_path / "runs"))
    assert done.returncode == 2
    assert done.stderr.startswith("edgetrain: error: label file ") and done.stderr.count("\n") == 1, done.stderr
    assert "img5.txt line 2: box (cx 0.5, cy 1.2, w 0.1, h 0.1) has a value outside [0, 1]" in done.stderr
    assert "Traceback" not in done.stderr and not (tmp_path / "runs").exists()


def test_the_summary_shows_how_many_boxes_were_clipped():
    from rich.console import Console

    from edgetrain.records import RunSummary
    from edgetrain.report.html import headline
    from edgetrain.report.tables import print_train_summary

    device = dict(rank=0, profile="host", local_batch=8, samples_per_s=10.0, step_s=0.1, data_s=0.0, compute_s=0.1,
                  comm_s=0.0, peak_rss_mb=100.0, bytes_sent=0)
    summary = RunSummary.from_dict({"per_device": [device], "throughput_samples_per_s": 10.0, "steps": 3,
                                    "train_loss": 1.0, "wall_time_s": 1.0, "clipped_boxes": 2}, "test")
    assert summary.clipped_boxes == 2 and summary.to_dict()["clipped_boxes"] == 2
    note = "labels: 2 box(es) passed the image's edge and were clipped to it"
    console = Console(record=True, width=200)
    print_train_summary(summary, console)
    assert note in console.export_text()
    assert any(n.startswith(note) for n in headline(summary)[2])
    assert "clipped_boxes" not in RunSummary.from_dict({**summary.to_dict(), "clipped_boxes": None}, "t").to_dict()


def test_a_yolo_dataset_alone_trains_detection_with_its_defaults_and_counts_clipped_boxes(tmp_path):
    """``--dataset yolo`` without ``--task``: detection's model and settings, as ``--task detection`` brings."""
    import edgetrain
    from edgetrain_testing import FAST

    root = write_yolo(tmp_path / "set", dict(GOOD, img0="0 0.85938 0.20833 0.28125 0.35417\n"))
    summary = edgetrain.train(dict(dataset="yolo", data_dir=str(root), image_size=32, steps=1, batch_size=4,
                                   devices=1, output=str(tmp_path / "out"), **FAST))
    assert (summary["model"], summary["task"]["name"], summary["input_shape"]) == ("yolov2_tiny_small", "detection",
                                                                                   [3, 32, 32])
    assert summary["clipped_boxes"] == 1
