"""YOLOv2-tiny: the Darknet layer stack, as a classifier (``YoloTiny``) and as the detector (``YoloV2Tiny``).

The layer stack of Darknet's ``yolov2-tiny`` (Redmon and Farhadi, "YOLO9000",
2017): six blocks of 3x3 convolution + BatchNorm + leaky ReLU (0.1) + 2x2
max-pool, the sixth pooling with stride 1 (zero-pad right/bottom, as PyTorch
ports do), then two 3x3 convolutions at the deepest width. At 416x416 input the
first blocks hold most of the activation memory and the last two hold most of
the weights, which is what spatial tiling (``edgetrain.tiling``) exploits.
The head is detection-style, a 1x1 convolution to one map per class,
averaged over space into class logits, so the model trains on classification
data (and any input size).

``widths`` sets the eight convolution widths; tests use narrow versions on
small inputs. The tiled section defaults to the first ``tiled_blocks`` blocks.

``YoloV2Tiny`` is the detector of the paper: the same stack with the YOLOv2
head, a 1x1 convolution to ``anchors x (5 + classes)`` maps on the S x S grid
(S = input side / 32: 13 at 416x416). Each cell predicts, per anchor,
``tx, ty, tw, th``, an objectness logit and class logits; the loss and the
decoding are in ``edgetrain.tasks.detection`` (see docs/how-to/tasks.md).
"""
from __future__ import annotations

from torch import nn

DARKNET_WIDTHS = (16, 32, 64, 128, 256, 512, 1024, 1024)


# YOLOv2-tiny-voc's five anchors (Darknet cfg, in cells of the 13x13 grid) as fractions of the image side,
# so that one set serves any input resolution.
VOC_ANCHORS = tuple((round(w / 13, 4), round(h / 13, 4)) for w, h in
                    ((1.08, 1.19), (3.42, 4.41), (6.63, 11.38), (9.42, 5.11), (16.62, 10.52)))


def darknet_stack(in_channels: int, widths: tuple[int, ...]) -> tuple[nn.Sequential, list[int]]:
    """The eight conv blocks and the layer index where each block ends."""
    if len(widths) != 8:
        raise ValueError(f"widths needs 8 convolution widths, got {len(widths)}")
    layers: list[nn.Module] = []
    c = in_channels
    ends = []
    for i, w in enumerate(widths):
        layers += [nn.Conv2d(c, w, 3, padding=1, bias=False), nn.BatchNorm2d(w), nn.LeakyReLU(0.1)]
        if i < 5:
            layers.append(nn.MaxPool2d(2, 2))
        elif i == 5:
            layers += [nn.ZeroPad2d((0, 1, 0, 1)), nn.MaxPool2d(2, 1)]
        ends.append(len(layers))
        c = w
    return nn.Sequential(*layers), ends


class _DarknetWithHead(nn.Module):
    """``features`` (the Darknet stack) then ``head``: the forward and the layer sequence both models share."""

    def forward(self, x):
        return self.head(self.features(x))

    def tiling_layers(self) -> list[tuple[str, nn.Module]]:
        """The model as a sequence of layers, for ``edgetrain.tiling``."""
        return [(f"features.{n}", m) for n, m in self.features.named_children()] + \
               [(f"head.{n}", m) for n, m in self.head.named_children()]


class YoloTiny(_DarknetWithHead):
    def __init__(self, num_classes: int = 10, in_channels: int = 3,
                 widths: tuple[int, ...] = DARKNET_WIDTHS, tiled_blocks: int = 5):
        super().__init__()
        self.features, ends = darknet_stack(in_channels, widths)
        self.head = nn.Sequential(nn.Conv2d(widths[-1], num_classes, 1), nn.AdaptiveAvgPool2d(1), nn.Flatten())
        self.tiled_section_default = ends[tiled_blocks - 1] if tiled_blocks > 0 else None



def yolo_tiny(num_classes: int = 10, in_channels: int = 3, width_mult: float = 1.0, tiled_blocks: int = 5,
              **_: object) -> YoloTiny:
    """Builder for a model registry: ``width_mult`` scales all widths (min 4 channels)."""
    return YoloTiny(num_classes, in_channels, _widths(width_mult), tiled_blocks)


class YoloV2Tiny(_DarknetWithHead):
    """The YOLOv2-tiny detector: output ``(N, anchors * (5 + classes), S, S)``, raw (no activation)."""

    stride = 32

    def __init__(self, num_classes: int = 20, in_channels: int = 3, widths: tuple[int, ...] = DARKNET_WIDTHS,
                 anchors: tuple[tuple[float, float], ...] = VOC_ANCHORS, tiled_blocks: int = 5):
        super().__init__()
        self.num_classes = num_classes
        self.anchors = tuple((float(w), float(h)) for w, h in anchors)
        self.features, ends = darknet_stack(in_channels, widths)
        self.head = nn.Sequential(nn.Conv2d(widths[-1], len(self.anchors) * (5 + num_classes), 1))
        self.tiled_section_default = ends[tiled_blocks - 1] if tiled_blocks > 0 else None



def _widths(width_mult: float) -> tuple[int, ...]:
    return tuple(max(4, int(round(w * width_mult))) for w in DARKNET_WIDTHS)


def yolov2_tiny(num_classes: int = 20, in_channels: int = 3, width_mult: float = 1.0,
                anchors: tuple[tuple[float, float], ...] = VOC_ANCHORS, tiled_blocks: int = 5,
                **_: object) -> YoloV2Tiny:
    """The paper's detector at Darknet's widths (``width_mult`` scales them, min 4 channels)."""
    return YoloV2Tiny(num_classes, in_channels, _widths(width_mult), anchors, tiled_blocks)


# A quarter of Darknet's widths: the default detector, small enough to learn the embedded shapes set on 2 cores.
SMALL_WIDTH = 0.25


def yolov2_tiny_small(num_classes: int = 20, in_channels: int = 3,
                      anchors: tuple[tuple[float, float], ...] = VOC_ANCHORS, tiled_blocks: int = 5,
                      **_: object) -> YoloV2Tiny:
    return YoloV2Tiny(num_classes, in_channels, _widths(SMALL_WIDTH), anchors, tiled_blocks)
