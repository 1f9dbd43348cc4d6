"""YOLOv2 as Darknet's yolov2.cfg defines it: shapes, the passthrough, and the section tiling can split."""
from __future__ import annotations

import torch
from torch import nn

from edgetrain.models import build_model
from edgetrain.models.yolov2 import YoloV2
from edgetrain.spec import parse_tiling
from edgetrain.tiling.strategy import plan_section


def test_the_cfg_layers_and_the_detection_output():
    model = YoloV2(80, detect=True)
    convs = [m for m in model.modules() if isinstance(m, nn.Conv2d)]
    pools = [m for m in model.modules() if isinstance(m, nn.MaxPool2d)]
    assert len(convs) == 23 and len(pools) == 5  # yolov2.cfg: 23 convolutional and 5 maxpool sections
    assert convs[-1].out_channels == 425 and convs[-1].bias is not None  # 5 x (5 + 80), linear, with bias
    with torch.no_grad():
        assert model(torch.zeros(1, 3, 64, 64)).shape == (1, 425, 2, 2)  # stride 32


def test_registry_model_classifies_and_its_first_blocks_tile():
    model = build_model("yolov2", in_channels=3, num_classes=10)
    with torch.no_grad():
        assert model(torch.zeros(2, 3, 64, 64)).shape == (2, 10)
    layers, end, plan = plan_section(model, parse_tiling("2x2"), (3, 64, 64))
    assert end == model.tiled_section_default == 18  # three blocks (5 convolutions, 3 pools): the 8x8 map at 64
    assert plan.sizes[0][plan.end] == 8 and layers[-1][0] == "head.0"
