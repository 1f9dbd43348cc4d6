"""Spatially tiled training of the feature-map-heavy first layers of a CNN (``--strategy tiled``).

Modules, in reading order: ``regions``, ``layers``, ``plan``, ``tiled``, ``grouping``, ``strategy``.

Design: docs/design/tiling.md
"""
SUPPORTED_LAYERS = ("Conv2d (zeros padding), MaxPool2d, AvgPool2d (count_include_pad), BatchNorm2d, ZeroPad2d, "
                    "ConstantPad2d, elementwise activations (ReLU, LeakyReLU, SiLU, ...), Identity, and "
                    "ResNet BasicBlock/Bottleneck residual blocks")

from edgetrain.spec import TilingSpec, parse_grid, parse_tiling  # noqa: E402  (parsed in the torch-free spec layer)
from edgetrain.tiling.strategy import TiledTraining  # noqa: E402

__all__ = ["SUPPORTED_LAYERS", "TiledTraining", "TilingSpec", "parse_grid", "parse_tiling"]
