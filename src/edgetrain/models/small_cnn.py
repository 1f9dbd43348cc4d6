"""A small CNN for digits and fast tests: three 3x3 conv blocks, global pooling, one linear layer."""
from __future__ import annotations

from torch import nn


def conv_bn_relu(cin: int, cout: int) -> list[nn.Module]:
    return [nn.Conv2d(cin, cout, 3, padding=1, bias=False), nn.BatchNorm2d(cout), nn.ReLU()]


class SmallCNN(nn.Module):
    def __init__(self, in_channels: int = 1, num_classes: int = 10, width: int = 32):
        super().__init__()
        self.features = nn.Sequential(
            *conv_bn_relu(in_channels, width),
            *conv_bn_relu(width, 2 * width),
            nn.MaxPool2d(2),
            *conv_bn_relu(2 * width, 4 * width),
            nn.AdaptiveAvgPool2d(1),
            nn.Flatten(),
        )
        self.classifier = nn.Linear(4 * width, num_classes)

    def forward(self, x):
        return self.classifier(self.features(x))
