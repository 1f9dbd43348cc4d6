"""Models for feature vectors and sensor series (regression, or classification of non-image data).

``mlp``: inputs (N, F), ``in_channels`` = F features; two hidden layers.
``conv1d``: sensor series (N, T, C), ``in_channels`` = C channels, any length T: two 1-D convolutions over
time, global average pooling, a linear head. No BatchNorm, so a sample's output never depends on the others in
its batch (N devices train as one). Both are ``nn.Sequential``: a pipeline can cut them between layers.
``num_classes`` is the output width: classes, or a regression's K targets.
"""
from __future__ import annotations

import torch
from torch import nn


class MLP(nn.Sequential):
    def __init__(self, in_channels: int = 10, num_classes: int = 1, hidden: int = 64):
        super().__init__(nn.Flatten(), nn.Linear(in_channels, hidden), nn.ReLU(), nn.Linear(hidden, hidden),
                         nn.ReLU(), nn.Linear(hidden, num_classes))


class ChannelsFirst(nn.Module):
    """(N, T, C) series to (N, C, T), what ``nn.Conv1d`` convolves over."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.transpose(1, 2)


class Conv1DNet(nn.Sequential):
    def __init__(self, in_channels: int = 3, num_classes: int = 1, width: int = 32, kernel: int = 5):
        super().__init__(ChannelsFirst(), nn.Conv1d(in_channels, width, kernel, padding=kernel // 2), nn.ReLU(),
                         nn.Conv1d(width, 2 * width, kernel, padding=kernel // 2), nn.ReLU(),
                         nn.AdaptiveAvgPool1d(1), nn.Flatten(), nn.Linear(2 * width, num_classes))
