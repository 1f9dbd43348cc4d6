"""Model registry: a name maps to a factory ``(in_channels, num_classes, **kwargs) -> nn.Module``.

Register your own with ``register_model("mynet", MyNet)``, or pass a built
``nn.Module`` straight to ``edgetrain.train(config, model=...)``.

A run of a passed ``nn.Module`` records its class as ``module:QualName``
(``model_reference``) in config.yaml and summary.json. That names the model
truthfully, but a config cannot rebuild it (its constructor arguments and
weights are not in the file), so ``check_model`` refuses such a name, before
any device starts, with the two ways to run it again.
"""
from __future__ import annotations

import difflib
from typing import Callable

from torch import nn

from edgetrain.errors import EdgetrainError
from edgetrain.models.lenet import LeNet
from edgetrain.models.resnet import ResNet18
from edgetrain.models.sensors import MLP, Conv1DNet
from edgetrain.models.small_cnn import SmallCNN, SmallCNNGroupNorm
from edgetrain.models.yolo_tiny import YoloTiny, yolov2_tiny, yolov2_tiny_small
from edgetrain.models.yolov2 import yolov2

ModelFactory = Callable[..., nn.Module]

MODELS: dict[str, ModelFactory] = {"small_cnn": SmallCNN, "small_cnn_gn": SmallCNNGroupNorm,
                                   "resnet18": ResNet18, "lenet": LeNet, "yolo_tiny": YoloTiny, "mlp": MLP, "conv1d": Conv1DNet,
                                   "yolov2_tiny": yolov2_tiny, "yolov2_tiny_small": yolov2_tiny_small,
                                   "yolov2": yolov2}
_BUILTIN = frozenset(MODELS)


def register_model(name: str, factory: ModelFactory) -> None:
    """Make ``name`` usable as ``model:``. The factory travels to device processes by pickle,
    so define it at module level (a class or a ``def``, not a lambda)."""
    MODELS[name] = factory


def user_models() -> dict[str, ModelFactory]:
    """Models registered in this process, to re-register in the device processes."""
    return {k: v for k, v in MODELS.items() if k not in _BUILTIN}


def model_reference(model: nn.Module) -> str:
    """What a run of a passed ``nn.Module`` records as its ``model``: the class as ``module:QualName``."""
    cls = type(model)
    return f"{cls.__module__}:{cls.__qualname__}"


def check_model(name: str) -> None:
    """Raise ``EdgetrainError`` in one line unless ``name`` can be built from the registry."""
    if name in MODELS:
        return
    if ":" in name:
        cls = name.rsplit(":", 1)[1].rsplit(".", 1)[-1]
        raise EdgetrainError(f"model '{name}' is your own nn.Module from an earlier run and a config cannot rebuild "
                             f"it; pass it again with edgetrain.train(config, model={cls}(...)), or register it "
                             f"with edgetrain.models.register_model('{cls.lower()}', {cls}) and set model: "
                             f"{cls.lower()}")
    close = difflib.get_close_matches(name, MODELS, n=1)
    hint = f"did you mean '{close[0]}'? " if close else ""
    raise EdgetrainError(f"unknown model '{name}'; {hint}known models: {', '.join(sorted(MODELS))} "
                         f"(register your own with edgetrain.models.register_model)")


def build_model(name: str, in_channels: int = 3, num_classes: int = 10, **kwargs) -> nn.Module:
    check_model(name)
    return MODELS[name](in_channels=in_channels, num_classes=num_classes, **kwargs)


def count_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())
