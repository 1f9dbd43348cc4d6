"""Object detection as in YOLOv2 (Redmon and Farhadi, "YOLO9000", 2017): the loss, decoding, NMS, COCO mAP.

The model (``models/yolo_tiny.YoloV2Tiny``) outputs raw maps ``(N, A*(5+C), S, S)``; a target batch is one
tensor ``(N, G, 5)`` of rows ``[class, cx, cy, w, h]`` (normalised to the image), padded with rows of class
-1 to the batch's most boxes (``collate_boxes``). Because the target is a plain tensor with the images along
dim 0, every strategy splits it as it splits labels. Design notes: docs/how-to/tasks.md.

The metric is not computed here: ``coco_map`` hands detections and ground truth to pycocotools' COCOeval.
"""
from __future__ import annotations

import contextlib
import io
import math
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np
import torch
import torch.nn.functional as F

from edgetrain.kinds import named_by_kind
from edgetrain.models.yolo_tiny import VOC_ANCHORS
from edgetrain.tasks.base import Evaluator, Metric, Task, refuse

# Imported inside functions: pycocotools (the detection extra; check_data refuses a run without it in one line).

PAD = -1.0  # class of a padding row in a target batch


def collate_boxes(samples: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Images stacked; each image's ``(n_i, 5)`` boxes padded with class -1 rows to ``(N, max n_i, 5)``."""
    images = torch.stack([x for x, _ in samples])
    most = max((len(t) for _, t in samples), default=0)
    target = torch.full((len(samples), most, 5), PAD, dtype=torch.float32)
    target[..., 1:] = 0.0
    for k, (_, t) in enumerate(samples):
        if len(t):
            target[k, :len(t)] = t
    return images, target


def _grid(output: torch.Tensor, num_anchors: int, num_classes: int) -> torch.Tensor:
    n, ch, h, w = output.shape
    if ch != num_anchors * (5 + num_classes):
        raise ValueError(f"output has {ch} channels, {num_anchors} anchors x (5 + {num_classes} classes) "
                         f"= {num_anchors * (5 + num_classes)} expected")
    return output.view(n, num_anchors, 5 + num_classes, h, w).permute(0, 1, 3, 4, 2)


def predicted_boxes(p: torch.Tensor, anchors: torch.Tensor) -> torch.Tensor:
    """``(N, A, H, W, 4)`` boxes ``cx, cy, w, h`` (normalised) from the grid view ``p`` of the output."""
    _, _, h, w, _ = p.shape
    gy = torch.arange(h, dtype=p.dtype, device=p.device).view(1, 1, h, 1)
    gx = torch.arange(w, dtype=p.dtype, device=p.device).view(1, 1, 1, w)
    aw = anchors[:, 0].view(1, -1, 1, 1)
    ah = anchors[:, 1].view(1, -1, 1, 1)
    return torch.stack([(gx + torch.sigmoid(p[..., 0])) / w, (gy + torch.sigmoid(p[..., 1])) / h,
                        aw * torch.exp(p[..., 2]), ah * torch.exp(p[..., 3])], -1)


def box_iou_cxcywh(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """IoU of boxes ``a (..., P, 4)`` and ``b (..., Q, 4)`` in ``cx, cy, w, h``: ``(..., P, Q)``."""
    a0, a1 = a[..., :2] - a[..., 2:] / 2, a[..., :2] + a[..., 2:] / 2
    b0, b1 = b[..., :2] - b[..., 2:] / 2, b[..., :2] + b[..., 2:] / 2
    lo = torch.maximum(a0.unsqueeze(-2), b0.unsqueeze(-3))
    hi = torch.minimum(a1.unsqueeze(-2), b1.unsqueeze(-3))
    inter = (hi - lo).clamp(min=0).prod(-1)
    union = a[..., 2:].prod(-1).unsqueeze(-1) + b[..., 2:].prod(-1).unsqueeze(-2) - inter
    return inter / union.clamp(min=1e-12)


@dataclass(frozen=True)
class RegionScales:
    """The settings of Darknet's region layer that weigh the YOLOv2 loss (yolov2-tiny-voc.cfg's): how much the
    box coordinates, an object's and a background prediction's objectness and the classes count; the IoU
    with a truth above which a background prediction is not penalised; objectness against that IoU or 1."""
    coord_scale: float = 1.0
    object_scale: float = 5.0
    noobject_scale: float = 1.0
    class_scale: float = 1.0
    ignore_iou: float = 0.6
    rescore: bool = True


def yolo_loss(output: torch.Tensor, target: torch.Tensor, anchors: Sequence[tuple[float, float]], num_classes: int,
              scales: RegionScales = RegionScales()) -> torch.Tensor:
    """The YOLOv2 loss (Darknet's region layer, yolov2-tiny-voc.cfg's scales), SUMMED over the images.

    Each ground-truth box belongs to the cell holding its centre and to the anchor whose shape overlaps it
    best (IoU of the two boxes centred together); if two boxes claim the same cell and anchor the later one
    wins, as in Darknet. For that prediction: squared error of ``sigmoid(tx), sigmoid(ty)`` against the
    centre's offset in the cell and of ``tw, th`` against ``log(w / anchor w)``, weighted ``2 - w h`` (small
    boxes count more); squared error of the objectness against the IoU of the predicted box with the truth
    (``rescore``; 1 otherwise); cross-entropy of the class logits (Darknet applies the softmax gradient
    ``onehot - p``, which is cross-entropy's). Every other prediction is pushed to objectness 0 (weight
    ``noobject_scale``) unless its box overlaps some truth of its image by more than ``ignore_iou``.
    Darknet's early-training pull of unassigned boxes towards their anchors is not included.
    """
    coord_scale, object_scale, noobject_scale = scales.coord_scale, scales.object_scale, scales.noobject_scale
    class_scale, ignore_iou, rescore = scales.class_scale, scales.ignore_iou, scales.rescore
    a = torch.as_tensor(anchors, dtype=output.dtype, device=output.device).view(-1, 2)
    p = _grid(output, len(a), num_classes)
    n, na, h, w, _ = p.shape
    target = target.to(dtype=output.dtype, device=output.device)
    pred = predicted_boxes(p, a)
    obj = torch.sigmoid(p[..., 4])
    valid = target[..., 0] >= 0  # (N, G)

    # Predictions that overlap some truth of their image are left alone by the no-object term.
    if target.shape[1]:
        iou = box_iou_cxcywh(pred.detach().reshape(n, -1, 4), target[..., 1:])  # (N, A*H*W, G)
        best = iou.masked_fill(~valid.unsqueeze(1), 0.0).amax(-1).view(n, na, h, w)
        ignored = best > ignore_iou
    else:
        ignored = torch.zeros_like(obj, dtype=torch.bool)

    b, g = valid.nonzero(as_tuple=True)
    truth = target[b, g]  # (M, 5)
    cls, cx, cy, bw, bh = truth.unbind(-1)
    bw, bh = bw.clamp(min=1e-9), bh.clamp(min=1e-9)
    i = (cx * w).floor().long().clamp(0, w - 1)
    j = (cy * h).floor().long().clamp(0, h - 1)
    inter = torch.minimum(bw.unsqueeze(1), a[:, 0]) * torch.minimum(bh.unsqueeze(1), a[:, 1])
    shape_iou = inter / (bw.unsqueeze(1) * bh.unsqueeze(1) + a[:, 0] * a[:, 1] - inter)
    k = shape_iou.argmax(1)  # the first best anchor on a tie
    # Later boxes win a shared (image, anchor, cell), as Darknet overwrites its deltas.
    key = ((b * na + k) * h + j) * w + i
    if len(key):
        uniq, inverse = torch.unique(key, return_inverse=True)
        order = torch.arange(len(key), device=key.device)
        last = torch.full((len(uniq),), -1, dtype=torch.long, device=key.device).scatter_reduce(
            0, inverse, order, "amax")
        keep = last[inverse] == order
        b, k, j, i, cls, cx, cy, bw, bh = (t[keep] for t in (b, k, j, i, cls, cx, cy, bw, bh))

    assigned = torch.zeros_like(obj, dtype=torch.bool)
    assigned[b, k, j, i] = True
    loss_noobj = noobject_scale * obj[~assigned & ~ignored].pow(2).sum()

    cell = p[b, k, j, i]  # (M, 5 + C)
    weight = 2.0 - bw * bh
    xy_err = (torch.sigmoid(cell[:, 0]) - (cx * w - i)).pow(2) + (torch.sigmoid(cell[:, 1]) - (cy * h - j)).pow(2)
    wh_err = (cell[:, 2] - torch.log(bw / a[k, 0])).pow(2) + (cell[:, 3] - torch.log(bh / a[k, 1])).pow(2)
    loss_coord = coord_scale * (weight * (xy_err + wh_err)).sum()
    if rescore:
        truth_box = torch.stack([cx, cy, bw, bh], -1)
        goal = box_iou_cxcywh(pred[b, k, j, i].detach().unsqueeze(1), truth_box.unsqueeze(1)).view(-1)
    else:
        goal = torch.ones_like(cx)
    loss_obj = object_scale * (obj[b, k, j, i] - goal).pow(2).sum()
    loss_cls = class_scale * F.cross_entropy(cell[:, 5:], cls.long(), reduction="sum")
    return loss_coord + loss_obj + loss_noobj + loss_cls


def nms(boxes: np.ndarray, scores: np.ndarray, iou_threshold: float) -> np.ndarray:
    """Greedy non-maximum suppression of ``x0, y0, x1, y1`` boxes: indices kept, best score first."""
    order = np.argsort(-scores, kind="stable")
    boxes = boxes[order]
    lo = np.maximum(boxes[:, None, :2], boxes[None, :, :2])
    hi = np.minimum(boxes[:, None, 2:], boxes[None, :, 2:])
    inter = np.clip(hi - lo, 0, None).prod(-1)
    area = np.clip(boxes[:, 2:] - boxes[:, :2], 0, None).prod(-1)
    iou = inter / np.maximum(area[:, None] + area[None, :] - inter, 1e-12)
    suppressed = np.zeros(len(boxes), dtype=bool)
    keep = []
    for m in range(len(boxes)):
        if suppressed[m]:
            continue
        keep.append(m)
        suppressed |= iou[m] > iou_threshold
    return order[np.asarray(keep, dtype=np.int64)]


def decode(output: torch.Tensor, anchors: Sequence[tuple[float, float]], num_classes: int,
           conf_threshold: float = 0.005, iou_threshold: float = 0.45, max_detections: int = 100,
           candidates: int = 1000) -> list[np.ndarray]:
    """Detections per image: ``(k, 6)`` arrays ``x0, y0, x1, y1, score, class`` (normalised), best first.

    A box's score for a class is objectness x class probability; those above ``conf_threshold`` (the
    ``candidates`` best) go through non-maximum suppression per class, and the ``max_detections`` best stay.
    The low default threshold is the usual one for measuring mAP (it ranks, it does not decide)."""
    with torch.no_grad():
        a = torch.as_tensor(anchors, dtype=output.dtype, device=output.device).view(-1, 2)
        p = _grid(output, len(a), num_classes)
        n = p.shape[0]
        box = predicted_boxes(p, a).reshape(n, -1, 4)
        xyxy = torch.cat([box[..., :2] - box[..., 2:] / 2, box[..., :2] + box[..., 2:] / 2], -1)
        scores = torch.sigmoid(p[..., 4:5]) * torch.softmax(p[..., 5:], -1)
        scores = scores.reshape(n, -1, num_classes)
        xyxy, scores = xyxy.double().cpu().numpy(), scores.double().cpu().numpy()
    found = []
    for img in range(n):
        where, cls = np.nonzero(scores[img] > conf_threshold)
        s = scores[img][where, cls]
        if len(s) > candidates:
            top = np.argsort(-s, kind="stable")[:candidates]
            where, cls, s = where[top], cls[top], s[top]
        b = xyxy[img][where]
        # Per-class suppression in one pass: each class's boxes are moved apart from every other class's.
        apart = 2.0 * (np.abs(b).max(initial=0.0) + 1.0)
        keep = nms(b + cls[:, None] * apart, s, iou_threshold)[:max_detections]
        found.append(np.concatenate([b[keep], s[keep, None], cls[keep, None].astype(np.float64)], 1))
    return found


def truths(target: torch.Tensor) -> list[np.ndarray]:
    """Ground truth per image: ``(n, 5)`` arrays ``class, cx, cy, w, h`` without the padding rows."""
    t = target.detach().double().cpu().numpy()
    return [rows[rows[:, 0] >= 0] for rows in t]


def coco_map(images: list[tuple[np.ndarray, np.ndarray]], num_classes: int,
             image_size: tuple[int, int] = (1, 1)) -> dict[str, float]:
    """``{"map50": AP@0.5, "map50_95": AP@[0.5:0.95]}`` by pycocotools' COCOeval (all areas, 100 detections).

    ``images`` holds, per image, its truths (``truths``) and its detections (``decode``), normalised;
    ``image_size`` (width, height) scales them to pixels (only COCO's small/medium/large split, which is not
    reported, depends on it). No ground truth at all gives NaN: the metric is undefined."""
    from pycocotools.coco import COCO
    from pycocotools.cocoeval import COCOeval

    width, height = image_size
    scale = np.array([width, height, width, height], dtype=np.float64)
    gt_anns, dets = [], []
    for image_id, (gt, det) in enumerate(images, start=1):
        for c, cx, cy, bw, bh in gt:
            x0, y0, x1, y1 = np.array([cx - bw / 2, cy - bh / 2, cx + bw / 2, cy + bh / 2]) * scale
            gt_anns.append({"id": len(gt_anns) + 1, "image_id": image_id, "category_id": int(c) + 1,
                            "bbox": [x0, y0, x1 - x0, y1 - y0], "area": (x1 - x0) * (y1 - y0), "iscrowd": 0})
        for x0, y0, x1, y1, s, c in det:
            x0, y0, x1, y1 = np.array([x0, y0, x1, y1]) * scale
            dets.append({"image_id": image_id, "category_id": int(c) + 1, "bbox": [x0, y0, x1 - x0, y1 - y0],
                         "score": float(s)})
    if not gt_anns:
        return {"map50": math.nan, "map50_95": math.nan}
    if not dets:
        return {"map50": 0.0, "map50_95": 0.0}
    with contextlib.redirect_stdout(io.StringIO()):  # COCOeval prints its progress and table
        truth = COCO()
        truth.dataset = {"images": [{"id": k, "width": width, "height": height} for k in range(1, len(images) + 1)],
                         "annotations": gt_anns,
                         "categories": [{"id": c + 1, "name": str(c)} for c in range(num_classes)]}
        truth.createIndex()
        found = truth.loadRes(dets)
        ev = COCOeval(truth, found, "bbox")
        ev.evaluate()
        ev.accumulate()
        ev.summarize()
    return {"map50": max(float(ev.stats[1]), 0.0), "map50_95": max(float(ev.stats[0]), 0.0)}


def detection_images(output: torch.Tensor, target: torch.Tensor, anchors, num_classes: int,
                     **decode_options: Any) -> list[tuple[np.ndarray, np.ndarray]]:
    """``(truths, detections)`` per image of a batch, what ``coco_map`` scores."""
    return list(zip(truths(target), decode(output, anchors, num_classes, **decode_options)))


# -- the task ---------------------------------------------------------------------------------------------------

MAP50 = Metric("map50", "", True, "mAP@0.5", ".3f")
MAP50_95 = Metric("map50_95", "", True, "mAP@0.5:0.95", ".3f")


class DetectionEvaluator(Evaluator):
    """State: the loss sum, the images seen, and every image's truths and detections (what COCOeval needs),
    with the class count and image size so that ``merge`` needs nothing else."""

    def __init__(self, task: "DetectionTask"):
        self.task = task
        self.loss_sum, self.seen = 0.0, 0
        self.classes = task.num_classes
        self.images: list[tuple[np.ndarray, np.ndarray]] = []

    def update(self, output, target) -> None:
        self.loss_sum += float(self.task.loss(output, target))
        self.seen += int(output.shape[0])
        self.classes = self.task.classes(output)
        self.images += detection_images(output, target, self.task.anchors, self.classes)

    def state(self) -> dict:
        return {"loss_sum": self.loss_sum, "seen": self.seen, "images": self.images,
                "num_classes": self.classes, "image_size": self.task.image_size}

    @staticmethod
    def merge(states: list) -> dict[str, float]:
        images = [im for s in states for im in s["images"]]
        seen = sum(s["seen"] for s in states)
        classes = max(s["num_classes"] or 0 for s in states)  # None: a device that scored no batch
        scores = coco_map(images, classes, tuple(states[0]["image_size"]))
        return {"loss": sum(s["loss_sum"] for s in states) / max(seen, 1), **scores}


def _inside(boxes: torch.Tensor, edge: float = 1e-6) -> bool:
    """Every ``cx, cy, w, h`` box has an area and lies in the image (the readers' check, vectorised)."""
    lo, hi = boxes[:, :2] - boxes[:, 2:] / 2, boxes[:, :2] + boxes[:, 2:] / 2
    return bool(torch.isfinite(boxes).all() and (boxes[:, 2:] > 0).all() and (lo >= -edge).all()
                and (hi <= 1 + edge).all())


@named_by_kind("task")
class DetectionTask(Task):
    """YOLOv2 detection: ``yolo_loss`` to learn, ``decode`` and COCOeval to score (mAP@0.5 the headline).

    ``anchors`` (fractions of the image) must be the model's (``YoloV2Tiny.anchors``; both default to
    YOLOv2-tiny-voc's); ``image_size`` (width, height) only scales boxes for COCOeval. ``num_classes`` None:
    read from the model's output (``anchors x (5 + classes)`` channels), as for cost counts without data."""

    headline = MAP50
    metrics = (MAP50, MAP50_95)

    def __init__(self, num_classes: int | None = 20, anchors: Sequence[tuple[float, float]] = VOC_ANCHORS,
                 image_size: tuple[int, int] = (416, 416)):
        self.num_classes = int(num_classes) if num_classes is not None else None
        self.anchors = tuple((float(w), float(h)) for w, h in anchors)
        self.image_size = (int(image_size[0]), int(image_size[1]))

    @classmethod
    def for_data(cls, data) -> "DetectionTask":
        if data is None:  # the planner's cost counts: classes from the model's output
            return cls(None)
        shape = data.input_shape
        return cls(data.num_classes, VOC_ANCHORS, (shape[-1], shape[-2]))

    def classes(self, output: torch.Tensor) -> int:
        if self.num_classes is not None:
            return self.num_classes
        return max(output.shape[1] // len(self.anchors) - 5, 0)

    def loss(self, output, target):
        if output.device.type == "meta":
            # FLOP counts run the model on the meta device, where no value exists to assign boxes by. The loss
            # holds no matmul or convolution, and the model's backward costs the same whatever gradient
            # reaches the output, so a sum stands in for it there.
            return output.sum()
        return yolo_loss(output, target, self.anchors, self.classes(output))

    def collate(self, samples):
        return collate_boxes(samples)

    def example_target(self, output):
        target = torch.zeros(output.shape[0], 1, 5, dtype=output.dtype, device=output.device)
        target[..., 1:] = torch.tensor([0.5, 0.5, 0.25, 0.25], dtype=output.dtype)
        return target

    def evaluator(self) -> DetectionEvaluator:
        return DetectionEvaluator(self)

    def check_data(self, data) -> None:
        try:
            import pycocotools.cocoeval  # noqa: F401  (the metric's reference implementation)
        except ImportError:
            refuse("detection scores mAP with pycocotools, which is not installed",
                   "pip install 'edgetrain[detection]' (or pip install pycocotools)")
        # The readers (data/detection.py) check every file as they read it; a dataset of your own is checked here.
        for part, dataset in (("training", data.train), ("test", data.test)):
            boxes = getattr(dataset, "boxes", None)
            if boxes is None:
                refuse(f"dataset {data.name} has no boxes (its {part} set is a {type(dataset).__name__}), so it "
                       "cannot train the detection task", "use --dataset shapes, yolo or coco, or a DetectionImages")
            for k, b in enumerate(boxes):
                if len(b) and (b.dim() != 2 or b.shape[1] != 5):
                    refuse(f"dataset {data.name}: {part} image {k} has boxes of shape {tuple(b.shape)}",
                           "give (n, 5) rows [class, cx, cy, w, h]")
                if len(b) and self.num_classes is not None and (int(b[:, 0].max()) >= self.num_classes
                                                                 or float(b[:, 0].min()) < 0):
                    refuse(f"dataset {data.name}: {part} image {k} has class {int(b[:, 0].max())} outside "
                           f"0..{self.num_classes - 1}", "fix the class ids or the dataset's num_classes")
                if len(b) and not _inside(b[:, 1:].double()):
                    refuse(f"dataset {data.name}: {part} image {k} has a box reaching outside the image [0, 1] or "
                           "without area", "give boxes as cx, cy, w, h fractions of the image, w and h > 0")

    def check(self, output, target) -> None:
        classes = self.classes(output)
        want = len(self.anchors) * (5 + classes)
        if output.dim() != 4 or output.shape[1] != want or classes < 1:
            refuse(f"the model's output has shape {tuple(output.shape)} but detection needs (N, {want}, S, S) "
                   f"({len(self.anchors)} anchors x (5 + {classes} classes))",
                   "use --model yolov2_tiny or yolov2_tiny_small, or a model with that output")

    def describe(self) -> str:
        classes = self.num_classes if self.num_classes is not None else "its model's"
        return f"detection ({classes} classes, {len(self.anchors)} anchors)"
