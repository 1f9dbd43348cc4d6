"""A small CNN for digits and fast tests: three 3x3 conv blocks, global pooling, one linear layer.

``small_cnn`` normalises with BatchNorm; ``small_cnn_gn`` is the same network
with GroupNorm (Wu and He 2018) in its place. GroupNorm normalises each
sample over groups of channels, so it keeps no running statistics and a
training step does not depend on which other samples share the batch: on
non-IID federated partitions a client's batch holds few classes, and
BatchNorm's batch statistics (and the running statistics averaged over
clients) then differ from the global ones. Hsieh et al., "The Non-IID Data
Quagmire of Decentralized Machine Learning" (ICML 2020), recommend GroupNorm
there. Compare the two with the same model on both sides (centralized and
federated).
"""
from __future__ import annotations

from torch import nn

NORMS = ("batch", "group")
GROUPS = 8  # channel groups of small_cnn_gn: 4, 8 and 16 channels per group at width 32


def conv_norm_relu(cin: int, cout: int, norm: str = "batch") -> list[nn.Module]:
    layer = nn.BatchNorm2d(cout) if norm == "batch" else nn.GroupNorm(min(GROUPS, cout), cout)
    return [nn.Conv2d(cin, cout, 3, padding=1, bias=False), layer, nn.ReLU()]


def conv_bn_relu(cin: int, cout: int) -> list[nn.Module]:
    return conv_norm_relu(cin, cout, "batch")


class SmallCNN(nn.Module):
    def __init__(self, in_channels: int = 1, num_classes: int = 10, width: int = 32, norm: str = "batch"):
        super().__init__()
        if norm not in NORMS:
            raise ValueError(f"norm must be one of {NORMS}, got {norm!r}")
        self.features = nn.Sequential(
            *conv_norm_relu(in_channels, width, norm),
            *conv_norm_relu(width, 2 * width, norm),
            nn.MaxPool2d(2),
            *conv_norm_relu(2 * width, 4 * width, norm),
            nn.AdaptiveAvgPool2d(1),
            nn.Flatten(),
        )
        self.classifier = nn.Linear(4 * width, num_classes)

    def forward(self, x):
        return self.classifier(self.features(x))


class SmallCNNGroupNorm(SmallCNN):
    """``small_cnn`` with GroupNorm: the registry's ``small_cnn_gn``."""

    def __init__(self, in_channels: int = 1, num_classes: int = 10, width: int = 32):
        super().__init__(in_channels, num_classes, width, norm="group")
