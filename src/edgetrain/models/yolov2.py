"""YOLOv2 as Darknet's ``yolov2.cfg`` defines it (Redmon and Farhadi, "YOLO9000", 2017).

The 31 layers of the cfg: the Darknet-19 convolutions (3x3 and 1x1, each with
BatchNorm and leaky ReLU 0.1) and five 2x2 max-pools, two more 3x3 x 1024
convolutions, the passthrough (``route -9``: layer 16's 26x26x512 map, a 1x1
convolution to 64 channels, ``reorg`` to 13x13x256, concatenated before
layer 24's output), a 3x3 x 1024 convolution and the last 1x1 convolution.
``reorg`` is written as PyTorch's space-to-depth (``pixel_unshuffle``): the
same shapes and values as Darknet's, in another channel order, which a learned
model does not notice.

``YoloV2(detect=True)`` ends as the cfg does, in ``anchors x (5 + classes)``
maps (425 for COCO's 80 classes); the default ends in one map per class
averaged over space, so that the model trains on classification data as
``YoloTiny`` does (the two differ only in the last 1x1 convolution's width).
``features`` holds layers 0-16, which spatial tiling (``edgetrain.tiling``)
can split; the tiled section defaults to the first ``tiled_blocks``
convolution + pool blocks (3: up to the 52x52 map at 416x416 input).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

# (filters, size) per convolution, "M" for a 2x2 max-pool, layers 0-16 of yolov2.cfg (up to the route source).
DARKNET19_TO_ROUTE = (32, 3), "M", (64, 3), "M", (128, 3), (64, 1), (128, 3), "M", (256, 3), (128, 1), (256, 3), "M", \
    (512, 3), (256, 1), (512, 3), (256, 1), (512, 3)
COCO_ANCHORS = 5


def _conv(c_in: int, c_out: int, size: int) -> list[nn.Module]:
    return [nn.Conv2d(c_in, c_out, size, padding=size // 2, bias=False), nn.BatchNorm2d(c_out), nn.LeakyReLU(0.1)]


class Passthrough(nn.Module):
    """Layers 17-30 of yolov2.cfg: pool, the 13x13 convolutions, route, reorg and the last convolutions."""

    def __init__(self, out_maps: int, pooled: bool):
        super().__init__()
        self.deep = nn.Sequential(nn.MaxPool2d(2, 2), *_conv(512, 1024, 3), *_conv(1024, 512, 1), *_conv(512, 1024, 3),
                                  *_conv(1024, 512, 1), *_conv(512, 1024, 3), *_conv(1024, 1024, 3),
                                  *_conv(1024, 1024, 3))
        self.route = nn.Sequential(*_conv(512, 64, 1))
        self.final = nn.Sequential(*_conv(1280, 1024, 3), nn.Conv2d(1024, out_maps, 1))
        self.pooled = pooled

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        fine = F.pixel_unshuffle(self.route(x), 2)      # reorg: 26x26x64 -> 13x13x256
        out = self.final(torch.cat([fine, self.deep(x)], 1))  # route -1,-4: the reorg first
        return out.mean((2, 3)) if self.pooled else out


class YoloV2(nn.Module):
    stride = 32

    def __init__(self, num_classes: int = 80, in_channels: int = 3, detect: bool = False, tiled_blocks: int = 3):
        super().__init__()
        layers: list[nn.Module] = []
        c, block_ends = in_channels, []
        for item in DARKNET19_TO_ROUTE:
            if item == "M":
                layers.append(nn.MaxPool2d(2, 2))
                block_ends.append(len(layers))
            else:
                layers += _conv(c, item[0], item[1])
                c = item[0]
        self.features = nn.Sequential(*layers)
        out_maps = COCO_ANCHORS * (5 + num_classes) if detect else num_classes
        self.head = nn.Sequential(Passthrough(out_maps, pooled=not detect))
        if not 0 <= tiled_blocks <= len(block_ends):
            raise ValueError(f"tiled_blocks must be 0..{len(block_ends)}, got {tiled_blocks}")
        self.tiled_section_default = block_ends[tiled_blocks - 1] if tiled_blocks else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x))

    def tiling_layers(self) -> list[tuple[str, nn.Module]]:
        """The model as a sequence of layers, for ``edgetrain.tiling`` (the passthrough is one tail layer)."""
        return [(f"features.{n}", m) for n, m in self.features.named_children()] + [("head.0", self.head[0])]


def yolov2(num_classes: int = 10, in_channels: int = 3, tiled_blocks: int = 3, **_: object) -> YoloV2:
    """Builder for the model registry: the classification-headed YOLOv2 (``YoloV2``'s default)."""
    return YoloV2(num_classes, in_channels, detect=False, tiled_blocks=tiled_blocks)
