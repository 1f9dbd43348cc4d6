"""A YOLOv2-tiny-style backbone with a small classification head.

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
"""
from __future__ import annotations

from torch import nn

DARKNET_WIDTHS = (16, 32, 64, 128, 256, 512, 1024, 1024)


class YoloTiny(nn.Module):
    def __init__(self, num_classes: int = 10, in_channels: int = 3,
                 widths: tuple[int, ...] = DARKNET_WIDTHS, tiled_blocks: int = 5):
        super().__init__()
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
        self.features = nn.Sequential(*layers)
        self.head = nn.Sequential(nn.Conv2d(c, num_classes, 1), nn.AdaptiveAvgPool2d(1), nn.Flatten())
        self.tiled_section_default = ends[tiled_blocks - 1] if tiled_blocks > 0 else None

    def forward(self, x):
        return self.head(self.features(x))

    def tiling_layers(self) -> list[tuple[str, nn.Module]]:
        """The model as a sequence of layers, for ``edgetrain.tiling``."""
        return [(f"features.{n}", m) for n, m in self.features.named_children()] + \
               [(f"head.{n}", m) for n, m in self.head.named_children()]


def yolo_tiny(num_classes: int = 10, in_channels: int = 3, width_mult: float = 1.0, tiled_blocks: int = 5,
              **_: object) -> YoloTiny:
    """Builder for a model registry: ``width_mult`` scales all widths (min 4 channels)."""
    widths = tuple(max(4, int(round(w * width_mult))) for w in DARKNET_WIDTHS)
    return YoloTiny(num_classes, in_channels, widths, tiled_blocks)
