"""Tiny models for the tiling tests, and the single-device reference they are compared with."""
from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn

from edgetrain.models import build_model
from edgetrain.models.yolo_tiny import YoloTiny


def plain_net() -> nn.Sequential:
    """Odd sizes, stride-2 and dilated convs, max-pools that drop a row, BatchNorm; then a Linear tail."""
    return nn.Sequential(
        nn.Conv2d(3, 4, 3, padding=1, bias=False), nn.BatchNorm2d(4), nn.LeakyReLU(0.1),  # 0-2
        nn.MaxPool2d(2),  # 3: 23x19 -> 11x9, drops the last row and column
        nn.Conv2d(4, 6, 3, stride=2, padding=1), nn.ReLU(), nn.Identity(),  # 4-6 (a bias without BatchNorm)
        nn.Conv2d(6, 6, 3, padding=2, dilation=2, bias=False), nn.BatchNorm2d(6), nn.ReLU(),  # 7-9
        nn.MaxPool2d(3, stride=1, padding=1),  # 10
        nn.Conv2d(6, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8), nn.ReLU(),  # 11-13
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 5),  # 14-16: the data-parallel tail
    )


PLAIN_SHAPE = (3, 23, 19)


class BasicBlock(nn.Module):
    """CIFAR ResNet block (kuangliu layout)."""

    def __init__(self, cin: int, cout: int, stride: int = 1):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.shortcut = nn.Sequential()
        if stride != 1 or cin != cout:
            self.shortcut = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x):
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return F.relu(out + self.shortcut(x))


class MiniResNet(nn.Module):
    """ResNet-18's CIFAR layout with one narrow block per stage."""

    def __init__(self, num_classes: int = 5):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 4, 3, 1, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(4)
        self.layer1 = nn.Sequential(BasicBlock(4, 4))
        self.layer2 = nn.Sequential(BasicBlock(4, 8, 2))
        self.layer3 = nn.Sequential(BasicBlock(8, 8, 2))
        self.layer4 = nn.Sequential(BasicBlock(8, 8, 1))
        self.linear = nn.Linear(8, num_classes)

    def forward(self, x):
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.layer4(self.layer3(self.layer2(self.layer1(out))))
        return self.linear(torch.flatten(F.adaptive_avg_pool2d(out, 1), 1))


RESNET_SHAPE = (3, 15, 17)


def narrow_yolo() -> YoloTiny:
    return YoloTiny(num_classes=5, widths=(4, 4, 8, 8, 8, 8, 8, 8), tiled_blocks=3)


YOLO_SHAPE = (3, 33, 35)


def narrow_resnet18() -> nn.Module:
    """edgetrain's own ResNet-18 (stem, layer1-4 of two blocks each), 4 channels wide."""
    return build_model("resnet18", 3, 5, width=4)


def build(name: str, dtype: torch.dtype) -> tuple[nn.Module, tuple[int, int, int]]:
    torch.manual_seed(0)
    model, shape = {"plain": (plain_net, PLAIN_SHAPE), "resnet": (MiniResNet, RESNET_SHAPE),
                    "resnet18": (narrow_resnet18, RESNET_SHAPE), "yolo": (narrow_yolo, YOLO_SHAPE)}[name]
    model = model().to(dtype)
    # Non-trivial BatchNorm affine parameters, so their gradients are tested too.
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.BatchNorm2d):
                m.weight.uniform_(0.5, 1.5)
                m.bias.uniform_(-0.5, 0.5)
    return model, shape


def batch(shape, n: int, dtype: torch.dtype, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, *shape, generator=g, dtype=dtype), torch.randint(0, 5, (n,), generator=g)


def reference_grads(model: nn.Module, x, y) -> tuple[float, dict[str, torch.Tensor]]:
    """Loss and gradients of one device training on the whole batch."""
    model = copy.deepcopy(model)
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    return loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()}


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def resnet18_w4(in_channels: int = 3, num_classes: int = 10) -> nn.Module:
    """A model factory for the trainer tests (module level, so device processes can import it)."""
    return build_model("resnet18", in_channels, num_classes, width=4)
