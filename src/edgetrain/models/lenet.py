"""LeNet as the gradient-inversion papers use it (Zhu et al., "Deep Leakage from Gradients", NeurIPS 2019).

Three 5x5 convolutions of 12 channels (strides 2, 2, 1), each followed by a
Sigmoid, and one linear layer: 15.8k parameters at 3x32x32. Sigmoid, not ReLU,
as in the attacks' standard setting: it is twice differentiable everywhere, so
gradient matching has useful second derivatives. ``activation="relu"`` gives
the ReLU variant.
"""
from __future__ import annotations

from torch import nn

ACTIVATIONS = {"sigmoid": nn.Sigmoid, "relu": nn.ReLU}


class LeNet(nn.Module):
    def __init__(self, in_channels: int = 3, num_classes: int = 10, image_size: int = 32,
                 activation: str = "sigmoid"):
        super().__init__()
        if activation not in ACTIVATIONS:
            raise ValueError(f"activation must be one of {sorted(ACTIVATIONS)}, got {activation!r}")
        act = ACTIVATIONS[activation]
        self.features = nn.Sequential(
            nn.Conv2d(in_channels, 12, 5, stride=2, padding=2), act(),
            nn.Conv2d(12, 12, 5, stride=2, padding=2), act(),
            nn.Conv2d(12, 12, 5, stride=1, padding=2), act(),
            # the identity at image_size (two stride-2 convolutions: a quarter of the side); other sizes
            # (digits' 8x8) are pooled to the classifier's input
            nn.AdaptiveAvgPool2d((image_size + 3) // 4),
            nn.Flatten(),
        )
        side = (image_size + 3) // 4
        self.classifier = nn.Linear(12 * side * side, num_classes)

    def forward(self, x):
        return self.classifier(self.features(x))
