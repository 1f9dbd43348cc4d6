"""From ``nn.Module`` objects to the layers the tiler understands.

A model is seen as a plain sequence of named layers whose composition is the
model's forward (``model_layers``). The first layers, the *tiled section*,
must each be one of the types listed in docs/design/tiling.md;
``describe`` turns each into a ``Layer`` (one sliding window per axis, see
``regions.Window``) or a ``Block`` (a residual block: main path, shortcut,
sum, activation), and rejects anything else with an error naming the layer.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from edgetrain.errors import EdgetrainError
from edgetrain.tiling.regions import Branches, Node, Window

# Imported inside functions: edgetrain.tiling's SUPPORTED_LAYERS, the one list users see (the package imports this
# module).

ELEMENTWISE_TYPES: tuple[type[nn.Module], ...] = (
    nn.ReLU, nn.ReLU6, nn.LeakyReLU, nn.PReLU, nn.ELU, nn.SELU, nn.CELU, nn.GELU, nn.SiLU, nn.Mish,
    nn.Hardswish, nn.Hardsigmoid, nn.Hardtanh, nn.Sigmoid, nn.Tanh, nn.Softplus, nn.Identity,
)


@dataclass
class Layer:
    """One tileable layer. ``windows`` is its geometry along (rows, cols)."""

    name: str
    module: nn.Module
    kind: str  # "conv", "maxpool", "avgpool", "pad", "batchnorm" or "elementwise"
    windows: tuple[Window, Window]
    in_channels: int
    out_channels: int
    flops_per_pixel: float  # forward FLOPs per output pixel per sample, all channels
    pad_value: float = 0.0

    def node(self, axis: int) -> Node:
        return self.windows[axis]


@dataclass
class Block:
    """A residual block: ``post(main(x) + shortcut(x))``; an empty shortcut is the identity."""

    name: str
    module: nn.Module
    main: list[Layer]
    shortcut: list[Layer]
    post: nn.Module
    in_channels: int
    out_channels: int
    flops_per_pixel: float = field(init=False)  # the sum and the activation

    def __post_init__(self) -> None:
        self.flops_per_pixel = 2.0 * self.out_channels

    def node(self, axis: int) -> Node:
        return Branches(tuple(l.node(axis) for l in self.main), tuple(l.node(axis) for l in self.shortcut))


Unit = Layer | Block


def _pair(v) -> tuple[int, int]:
    return (v, v) if isinstance(v, int) else (int(v[0]), int(v[1]))


def _plain(module: nn.Module, base: type[nn.Module]) -> bool:
    """``module`` is a ``base`` whose forward was not overridden by a subclass."""
    return isinstance(module, base) and type(module).forward is base.forward


def _unsupported(name: str, module: nn.Module, why: str) -> EdgetrainError:
    from edgetrain.tiling import SUPPORTED_LAYERS

    return EdgetrainError(
        f"layer {name!r} ({type(module).__name__}) cannot be tiled: {why}; tiled layers may be "
        f"{SUPPORTED_LAYERS}; end the tiled section before this layer (groups=[..., index of {name!r}])")


def describe(name: str, module: nn.Module, in_channels: int) -> Unit:
    """The tiler's view of ``module``, or an ``EdgetrainError`` naming it."""
    if _plain(module, nn.Conv2d):
        if module.padding_mode != "zeros":
            raise _unsupported(name, module, f"padding_mode={module.padding_mode!r} (only 'zeros')")
        k, s, d = _pair(module.kernel_size), _pair(module.stride), _pair(module.dilation)
        if module.padding == "same":
            total = [d[i] * (k[i] - 1) for i in range(2)]
            pads = [(t // 2, t - t // 2) for t in total]
        elif module.padding == "valid":
            pads = [(0, 0), (0, 0)]
        else:
            pads = [(p, p) for p in _pair(module.padding)]
        windows = tuple(Window(k[i], s[i], pads[i][0], pads[i][1], d[i]) for i in range(2))
        _check_channels(name, module, in_channels, module.in_channels)
        flops = 2.0 * (module.in_channels // module.groups) * k[0] * k[1] * module.out_channels
        return Layer(name, module, "conv", windows, in_channels, module.out_channels, flops)
    if _plain(module, nn.MaxPool2d) or _plain(module, nn.AvgPool2d):
        is_max = isinstance(module, nn.MaxPool2d)
        if is_max and module.return_indices:
            raise _unsupported(name, module, "return_indices=True")
        if not is_max and module.ceil_mode:
            raise _unsupported(name, module, "ceil_mode=True for average pooling")
        k, p = _pair(module.kernel_size), _pair(module.padding)
        s = _pair(module.stride if module.stride not in (None, ()) else module.kernel_size)
        d = _pair(module.dilation) if is_max else (1, 1)
        if not is_max and any(p) and not module.count_include_pad:
            raise _unsupported(name, module, "padding with count_include_pad=False")
        windows = tuple(Window(k[i], s[i], p[i], p[i], d[i], module.ceil_mode) for i in range(2))
        return Layer(name, module, "maxpool" if is_max else "avgpool", windows, in_channels, in_channels,
                     float(k[0] * k[1] * in_channels), float("-inf") if is_max else 0.0)
    if _plain(module, nn.ZeroPad2d) or _plain(module, nn.ConstantPad2d):
        left, right, top, bottom = module.padding
        if min(module.padding) < 0:
            raise _unsupported(name, module, "negative padding (cropping)")
        windows = (Window(1, 1, top, bottom), Window(1, 1, left, right))
        return Layer(name, module, "pad", windows, in_channels, in_channels, 0.0, float(module.value))
    if isinstance(module, nn.BatchNorm2d):
        _check_channels(name, module, in_channels, module.num_features)
        return Layer(name, module, "batchnorm", (Window(), Window()), in_channels, in_channels,
                     4.0 * in_channels)
    if any(_plain(module, t) for t in ELEMENTWISE_TYPES):
        return Layer(name, module, "elementwise", (Window(), Window()), in_channels, in_channels,
                     float(in_channels))
    if _is_residual_block(module):
        return _describe_block(name, module, in_channels)
    if isinstance(module, (nn.Dropout, nn.Dropout2d)):
        raise _unsupported(name, module, "its random mask would differ from tile to tile")
    raise _unsupported(name, module, "it does not slide a window over the feature map")


def _check_channels(name: str, module: nn.Module, have: int, want: int) -> None:
    if have != want:
        raise EdgetrainError(f"layer {name!r} expects {want} input channels but receives {have}; "
                             f"check input_shape and the model")


def _is_residual_block(module: nn.Module) -> bool:
    names = dict(module.named_children())
    return all(k in names for k in ("conv1", "bn1", "conv2", "bn2")) and (
        "shortcut" in names or "downsample" in names or hasattr(module, "downsample"))


def _describe_block(name: str, module: nn.Module, in_channels: int) -> Block:
    """A torchvision/kuangliu-style BasicBlock or Bottleneck; checked numerically against its forward."""
    main_names = ["conv1", "bn1", "relu", "conv2", "bn2"]
    if hasattr(module, "conv3"):
        main_names += ["relu", "conv3", "bn3"]
    main: list[Layer] = []
    c = in_channels
    for n in main_names:
        m = nn.ReLU() if n == "relu" else getattr(module, n)
        main.append(describe(f"{name}.{n}", m, c))
        c = main[-1].out_channels
    short_name = "shortcut" if hasattr(module, "shortcut") else "downsample"
    short_module = getattr(module, short_name, None)
    shortcut: list[Layer] = []
    if short_module is not None:
        children = list(short_module.named_children()) if isinstance(short_module, nn.Sequential) else \
            [("", short_module)]
        sc = in_channels
        for n, m in children:
            shortcut.append(describe(f"{name}.{short_name}.{n}".rstrip("."), m, sc))
            sc = shortcut[-1].out_channels
    block = Block(name, module, main, shortcut, nn.ReLU(), in_channels, c)
    _check_block(block)
    return block


def block_reference(block: Block, x: torch.Tensor) -> torch.Tensor:
    """What the tiler believes ``block`` computes, on a whole map."""
    y = x
    for layer in block.main:
        y = layer.module(y)
    s = x
    for layer in block.shortcut:
        s = layer.module(s)
    return block.post(y + s)


def _check_block(block: Block) -> None:
    was_training = block.module.training
    block.module.eval()
    try:
        weight = next(block.module.parameters())
        x = torch.randn(2, block.in_channels, 9, 9, dtype=weight.dtype, device=weight.device)
        with torch.no_grad():
            same = torch.allclose(block.module(x), block_reference(block, x), rtol=1e-4, atol=1e-5)
    finally:
        block.module.train(was_training)
    if not same:
        raise EdgetrainError(
            f"layer {block.name!r} ({type(block.module).__name__}) looks like a residual block but does not "
            f"compute relu(bn2(conv2(relu(bn1(conv1(x))))) + shortcut(x)); the tiler cannot split it; end the "
            f"tiled section before it")


def model_layers(model: nn.Module) -> tuple[list[tuple[str, nn.Module]], int | None]:
    """The model as a sequence of named layers, and the default end of its tiled section (or None).

    A model may say so itself with ``tiling_layers()`` (and ``tiled_section_default``);
    an ``nn.Sequential`` is flattened; a kuangliu or torchvision ResNet (``conv1``,
    ``bn1``, ``layer1``-``layer4``, functional ReLU and pooling) is recognised;
    any other model is taken to be its children in order, nested Sequentials
    flattened (as edgetrain's own ResNet18 is), which ``check_sequence`` verifies.
    For ResNets the tiled section defaults to the stem and ``layer1``.
    """
    if hasattr(model, "tiling_layers"):
        return list(model.tiling_layers()), getattr(model, "tiled_section_default", None)
    if isinstance(model, nn.Sequential):
        return _flatten(model, ""), None
    resnet = _resnet_layers(model)
    if resnet is not None:
        return resnet
    layers = _flatten(model, "")
    if not layers:
        raise EdgetrainError(f"{type(model).__name__} has no layers to tile")
    after_layer1 = [i + 1 for i, (n, _) in enumerate(layers) if n.startswith("layer1.")]
    return layers, (after_layer1[-1] if after_layer1 else None)


def _flatten(seq: nn.Module, prefix: str) -> list[tuple[str, nn.Module]]:
    out = []
    for n, m in seq.named_children():
        full = f"{prefix}{n}"
        out += _flatten(m, full + ".") if isinstance(m, nn.Sequential) else [(full, m)]
    return out


def _resnet_layers(model: nn.Module) -> tuple[list[tuple[str, nn.Module]], int] | None:
    """ResNet (CIFAR: conv1, bn1, layer1-4, linear; torchvision adds relu, maxpool, avgpool, fc).

    The tiled section defaults to the stem and ``layer1``: whole residual
    blocks are tiling units (their region is the hull of both paths).
    """
    if not all(hasattr(model, n) for n in ("conv1", "bn1", "layer1", "layer2", "layer3", "layer4")):
        return None
    head = getattr(model, "linear", None) or getattr(model, "fc", None)
    if not isinstance(head, nn.Linear):
        return None
    layers: list[tuple[str, nn.Module]] = [("conv1", model.conv1), ("bn1", model.bn1),
                                           ("relu", getattr(model, "relu", None) or nn.ReLU())]
    if isinstance(getattr(model, "maxpool", None), nn.MaxPool2d):
        layers.append(("maxpool", model.maxpool))
    for stage in ("layer1", "layer2", "layer3", "layer4"):
        layers += [(f"{stage}.{n}", m) for n, m in getattr(model, stage).named_children()]
        if stage == "layer1":
            default_end = len(layers)
    layers += [("avgpool", nn.AdaptiveAvgPool2d(1)), ("flatten", nn.Flatten()),
               ("linear" if hasattr(model, "linear") else "fc", head)]
    return layers, default_end


def check_sequence(model: nn.Module, layers: list[tuple[str, nn.Module]], input_shape: tuple[int, int, int]) -> None:
    """Fail clearly if running ``layers`` in order does not reproduce ``model`` (eval mode, no grad)."""
    if isinstance(model, nn.Sequential):
        return
    was_training = model.training
    model.eval()
    try:
        weight = next(model.parameters())
        x = torch.randn(1, *input_shape, dtype=weight.dtype, device=weight.device)
        with torch.no_grad():
            want = model(x)
            got = x
            for _, m in layers:
                got = m(got)
    finally:
        model.train(was_training)
    if got.shape != want.shape or not torch.allclose(got, want, rtol=1e-4, atol=1e-5):
        raise EdgetrainError(
            f"running the layers of {type(model).__name__} in sequence ({', '.join(n for n, _ in layers)}) does "
            f"not reproduce its forward; give the model a tiling_layers() method returning [(name, module), ...] "
            f"in the order its forward applies them")
