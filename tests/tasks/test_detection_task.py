"""The YOLOv2 detector, its loss, decoding and NMS, and mAP by COCOeval."""
import math

import numpy as np
import pytest
import torch

from edgetrain.errors import EdgetrainError
from edgetrain.models import build_model
from edgetrain.models.yolo_tiny import VOC_ANCHORS, YoloV2Tiny
from edgetrain.tasks.detection import (DetectionTask, RegionScales, coco_map, collate_boxes, decode, nms, truths,
                                       yolo_loss)

ANCHORS = VOC_ANCHORS
C = 3
S = 4


def test_yolov2_tiny_output_is_the_yolov2_grid():
    full = build_model("yolov2_tiny", 3, 20)
    assert full(torch.randn(1, 3, 416, 416)).shape == (1, 5 * 25, 13, 13)
    small = build_model("yolov2_tiny_small", 3, C)
    assert isinstance(small, YoloV2Tiny) and small.anchors == VOC_ANCHORS
    assert small(torch.randn(2, 3, 128, 128)).shape == (2, 5 * (5 + C), 4, 4)
    assert small.features[0].out_channels == 4 and full.features[0].out_channels == 16
    # The classifier of the same stack is unchanged.
    assert build_model("yolo_tiny", 3, 10)(torch.randn(1, 3, 64, 64)).shape == (1, 10)


def logit(p):
    return math.log(p / (1 - p))


def best_anchor(w, h):
    ious = [min(w, aw) * min(h, ah) / (w * h + aw * ah - min(w, aw) * min(h, ah)) for aw, ah in ANCHORS]
    return int(np.argmax(ious))


def perfect_output(boxes_per_image):
    """The raw output that predicts exactly these boxes: the loss's encoding worked out independently."""
    out = torch.full((len(boxes_per_image), len(ANCHORS), 5 + C, S, S), 0.0, dtype=torch.float64)
    out[:, :, 4] = -30.0  # no object anywhere...
    for n, boxes in enumerate(boxes_per_image):
        for c, cx, cy, w, h in boxes:
            i, j, a = int(cx * S), int(cy * S), best_anchor(w, h)
            out[n, a, 0, j, i] = logit(cx * S - i)
            out[n, a, 1, j, i] = logit(cy * S - j)
            out[n, a, 2, j, i] = math.log(w / ANCHORS[a][0])
            out[n, a, 3, j, i] = math.log(h / ANCHORS[a][1])
            out[n, a, 4, j, i] = 30.0  # ...but here
            out[n, a, 5 + int(c), j, i] = 30.0
    return out.reshape(len(boxes_per_image), -1, S, S)


BOXES = [[(0, 0.3, 0.35, 0.2, 0.25), (2, 0.7, 0.6, 0.5, 0.4)], [], [(1, 0.55, 0.45, 0.08, 0.12)]]


def target_of(boxes_per_image):
    return collate_boxes([(torch.zeros(1), torch.tensor(b, dtype=torch.float32).reshape(-1, 5))
                          for b in boxes_per_image])[1].double()


def test_a_perfect_prediction_has_no_loss_and_full_map():
    out, target = perfect_output(BOXES), target_of(BOXES)
    assert yolo_loss(out, target, ANCHORS, C).item() < 1e-9
    shifted = out.clone().view(3, 5, 5 + C, S, S)
    shifted[0, :, 0] += 0.5  # the first box's centre moves: the loss sees it
    assert yolo_loss(shifted.view_as(out), target, ANCHORS, C).item() > 0.01
    found = decode(out, ANCHORS, C)
    assert [len(d) for d in found] == [2, 0, 1]
    by_class = found[0][np.argsort(found[0][:, 5])]
    assert np.allclose(by_class[:, [0, 1, 2, 3, 5]], [[0.2, 0.225, 0.4, 0.475, 0], [0.45, 0.4, 0.95, 0.8, 2]])
    scores = coco_map(list(zip(truths(target), found)), C, (128, 128))
    assert scores["map50"] == pytest.approx(1.0) and scores["map50_95"] == pytest.approx(1.0)


def test_the_loss_is_a_sum_over_images_and_an_empty_image_is_valid():
    torch.manual_seed(0)
    out = torch.randn(3, len(ANCHORS) * (5 + C), S, S, dtype=torch.float64)
    whole = yolo_loss(out, target_of(BOXES), ANCHORS, C)
    parts = sum(yolo_loss(out[k:k + 1], target_of([BOXES[k]]), ANCHORS, C) for k in range(3))
    assert abs(whole.item() - parts.item()) < 1e-10
    empty = yolo_loss(out[1:2], target_of([[]]), ANCHORS, C)
    assert empty.item() == pytest.approx(torch.sigmoid(out[1].view(5, 5 + C, S, S)[:, 4]).pow(2).sum().item())
    grad_out = out.clone().requires_grad_()
    yolo_loss(grad_out, target_of(BOXES), ANCHORS, C).backward()
    assert torch.isfinite(grad_out.grad).all() and grad_out.grad.abs().sum() > 0


def test_two_boxes_on_one_cell_and_anchor_the_later_wins():
    out = torch.zeros(1, len(ANCHORS) * (5 + C), S, S, dtype=torch.float64)
    a, b = (0, 0.30, 0.30, 0.02, 0.02), (1, 0.32, 0.31, 0.021, 0.02)  # same cell, same anchor; tiny: no ignore
    both = yolo_loss(out, target_of([[a, b]]), ANCHORS, C).item()
    assert both == pytest.approx(yolo_loss(out, target_of([[b]]), ANCHORS, C).item(), abs=1e-12)
    assert both != pytest.approx(yolo_loss(out, target_of([[a]]), ANCHORS, C).item(), abs=1e-6)


def test_predictions_overlapping_a_truth_are_not_pushed_to_no_object():
    box = (0, 0.375, 0.375, 0.25, 0.25)
    out = perfect_output([[box]]).view(1, 5, 5 + C, S, S)
    a = best_anchor(0.25, 0.25)
    other = (a + 1) % 5
    # Another anchor of the same cell predicts nearly the same box, with objectness 1.
    out[0, other, :4, 1, 1] = out[0, a, :4, 1, 1]
    out[0, other, 2, 1, 1] = math.log(0.26 / ANCHORS[other][0])
    out[0, other, 3, 1, 1] = math.log(0.25 / ANCHORS[other][1])
    out[0, other, 4, 1, 1] = 30.0
    kept = yolo_loss(out.view(1, -1, S, S), target_of([[box]]), ANCHORS, C).item()
    assert kept < 1e-9
    assert yolo_loss(out.view(1, -1, S, S), target_of([[box]]), ANCHORS, C, RegionScales(ignore_iou=0.99)).item() > 0.9


def test_nms_keeps_the_best_of_overlapping_boxes_per_class():
    boxes = np.array([[0, 0, 10, 10], [1, 1, 11, 11], [20, 20, 30, 30], [0, 0, 10, 9.5]], dtype=float)
    scores = np.array([0.5, 0.9, 0.7, 0.3])
    assert nms(boxes, scores, 0.5).tolist() == [1, 2]
    assert nms(boxes, scores, 0.95).tolist() == [1, 2, 0, 3]
    assert nms(boxes[:0], scores[:0], 0.5).tolist() == []


def test_decode_suppresses_within_a_class_not_across():
    box = (0, 0.375, 0.375, 0.25, 0.25)
    out = perfect_output([[box]]).view(1, 5, 5 + C, S, S)
    a = best_anchor(0.25, 0.25)
    twin = (a + 1) % 5
    out[0, twin] = out[0, a]
    out[0, twin, 2, 1, 1] = math.log(0.25 / ANCHORS[twin][0])
    out[0, twin, 3, 1, 1] = math.log(0.25 / ANCHORS[twin][1])
    assert len(decode(out.view(1, -1, S, S), ANCHORS, C)[0]) == 1  # the same box twice: one kept
    out[0, twin, 5:, 1, 1] = torch.tensor([-30.0, 30.0, -30.0])
    found = decode(out.view(1, -1, S, S), ANCHORS, C)[0]
    assert sorted(found[:, 5].tolist()) == [0.0, 1.0]


def test_coco_map_from_pycocotools():
    gt = np.array([[0, 0.5, 0.5, 0.4, 0.4], [1, 0.2, 0.2, 0.2, 0.2]])
    exact = np.array([[0.3, 0.3, 0.7, 0.7, 0.9, 0], [0.1, 0.1, 0.3, 0.3, 0.8, 1]])
    assert coco_map([(gt, exact)], 2, (100, 100)) == pytest.approx({"map50": 1.0, "map50_95": 1.0})
    # Boxes shifted to IoU ~0.68: found at 0.5, missed at the stricter thresholds.
    loose = exact.copy()
    loose[:, [0, 2]] += np.array([[0.08], [0.04]])
    scores = coco_map([(gt, loose)], 2, (100, 100))
    assert scores["map50"] == pytest.approx(1.0) and 0.1 < scores["map50_95"] < 0.6
    wrong_class = exact.copy()
    wrong_class[:, 5] = 1 - wrong_class[:, 5]
    assert coco_map([(gt, wrong_class)], 2, (100, 100))["map50"] == 0.0
    assert coco_map([(gt, np.zeros((0, 6)))], 2) == {"map50": 0.0, "map50_95": 0.0}
    assert all(math.isnan(v) for v in coco_map([(np.zeros((0, 5)), exact)], 2).values())


def test_evaluation_merged_over_devices_equals_one_device():
    task = DetectionTask(C, ANCHORS, (128, 128))
    torch.manual_seed(1)
    out = perfect_output(BOXES) + 0.3 * torch.randn(3, 5 * (5 + C), S, S, dtype=torch.float64)
    target = target_of(BOXES)
    one = task.evaluator()
    one.update(out, target)
    parts = [task.evaluator() for _ in range(2)]
    parts[0].update(out[:2], target[:2])
    parts[1].update(out[2:], target[2:, :1])  # another device's batch pads to its own most boxes
    merged = DetectionTask.evaluator(task).merge([p.state() for p in parts])
    assert merged == pytest.approx(one.merge([one.state()]), abs=1e-12)
    assert set(merged) == {"loss", "map50", "map50_95"} and 0 < merged["map50"] < 1


def test_without_data_the_class_count_comes_from_the_model_output():
    counting = DetectionTask.for_data(None)  # the planner's cost counts
    out, target = perfect_output(BOXES), target_of(BOXES)
    assert counting.loss(out, target).item() == pytest.approx(DetectionTask(C).loss(out, target).item(), abs=1e-12)
    counting.check(out, target)
    with pytest.raises(EdgetrainError, match=r"output has shape \(3, 43, 4, 4\)"):
        counting.check(torch.zeros(3, 43, 4, 4), target)


def test_the_task_checks_the_model_output_and_the_data():
    task = DetectionTask(C)
    task.check(torch.zeros(2, 5 * (5 + C), 4, 4), None)
    with pytest.raises(EdgetrainError, match=r"output has shape \(2, 10\) but detection needs \(N, 40, S, S\) "
                                             r"\(5 anchors x \(5 \+ 3 classes\)\); use --model yolov2_tiny"):
        task.check(torch.zeros(2, 10), None)
    from edgetrain.data.detection import shapes
    data = shapes(8, 32)
    task.check_data(data)
    with pytest.raises(EdgetrainError, match=r"training image \d+ has class 2 outside 0..1"):
        DetectionTask(2).check_data(data)
    data.test.boxes[1] = torch.tensor([[0.0, 0.95, 0.5, 0.2, 0.2]])
    with pytest.raises(EdgetrainError, match=r"test image 1 has a box reaching outside the image \[0, 1\]"):
        task.check_data(data)
    target = task.example_target(torch.zeros(2, 40, 4, 4))
    assert target.shape == (2, 1, 5) and torch.isfinite(task.loss(torch.zeros(2, 40, 4, 4), target))


def test_task_detection_brings_the_defaults_it_learns_with():
    from edgetrain.kinds import task_defaults

    implied = task_defaults("detection", {"epochs"})
    assert implied == {"dataset": "shapes", "model": "yolov2_tiny_small", "image_size": 128, "batch_size": 32,
                       "optimizer": "adam", "lr": 0.001, "weight_decay": 0.0}
