"""Spatially tiled training of the feature-map-heavy first layers of a CNN.

The first layers of a CNN hold most of its activation memory and few of its
weights. Following Rama, Threadgill and Gerstlauer ("Distributed CNN Training
on Mobile and Edge Clusters"), a grid of devices splits those layers' feature
maps into tiles, one per device; consecutive layers are fused into groups
inside which each device recomputes the overlap its tile needs instead of
communicating, and devices exchange halos only between groups. BatchNorm uses
the statistics of the whole feature map. After the tiled section an
all-to-all gives every device whole feature maps for its share of the batch
and the rest of the network runs data-parallel. Loss and gradients equal those
of one device training on the whole batch.

Modules, in reading order: ``regions`` (receptive-field arithmetic, one axis),
``layers`` (modules the tiler understands), ``plan`` (one section on one grid:
regions, FLOPs, halos), ``tiled`` (autograd forward/backward and the
exchanges), ``grouping`` (where to exchange: given, or ``auto`` by a cost
model), ``strategy`` (``TiledTraining``, what the trainer drives). The
options (``--grid``, ``--groups``) arrive parsed as a ``TilingSpec``
(``edgetrain.spec``); ``TiledTraining(model, tiling, input_shape)``.

Tiled training's exchanges run uncompressed, synchronously every step, on the
host's network: ``--compress``, ``--sync`` and ``--link`` do not apply and
``config.resolve`` refuses them; ``--timeout`` bounds every wait.

Layers supported in the tiled section:

* ``nn.Conv2d``: any kernel, stride, dilation, groups; integer, ``'same'`` or
  ``'valid'`` padding; ``padding_mode='zeros'`` only.
* ``nn.MaxPool2d``: any kernel, stride, padding, dilation, ``ceil_mode``;
  not ``return_indices``.
* ``nn.AvgPool2d``: without ``ceil_mode``; with padding only if
  ``count_include_pad=True`` (the default).
* ``nn.BatchNorm2d`` (and ``CrossDeviceBatchNorm2d``): whole-map statistics.
* ``nn.ZeroPad2d``, ``nn.ConstantPad2d`` (non-negative padding).
* Elementwise: ``ReLU, ReLU6, LeakyReLU, PReLU, ELU, SELU, CELU, GELU, SiLU,
  Mish, Hardswish, Hardsigmoid, Hardtanh, Sigmoid, Tanh, Softplus, Identity``.
* Residual blocks shaped like ResNet's ``BasicBlock``/``Bottleneck``
  (``conv1, bn1, conv2, bn2[, conv3, bn3]`` with a ``shortcut``/``downsample``
  of the layers above, ReLU after the sum), as one tiling unit whose input
  region is the hull of what both paths need; checked against the block's own
  forward.

Anything else (``Linear``, ``Flatten``, adaptive pooling, ``Dropout``, custom
modules) can only follow the tiled section, in the data-parallel tail; putting
it in the tiled section is an ``EdgetrainError`` naming the layer.
"""
SUPPORTED_LAYERS = ("Conv2d (zeros padding), MaxPool2d, AvgPool2d (count_include_pad), BatchNorm2d, ZeroPad2d, "
                    "ConstantPad2d, elementwise activations (ReLU, LeakyReLU, SiLU, ...), Identity, and "
                    "ResNet BasicBlock/Bottleneck residual blocks")

from edgetrain.spec import TilingSpec, parse_grid, parse_tiling  # noqa: E402  (parsed in the torch-free spec layer)
from edgetrain.tiling.strategy import TiledTraining  # noqa: E402

__all__ = ["SUPPORTED_LAYERS", "TiledTraining", "TilingSpec", "parse_grid", "parse_tiling"]
