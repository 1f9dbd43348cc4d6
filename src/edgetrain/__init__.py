"""edgetrain: train deep networks across clusters of low-cost edge devices.

Python API::

    import edgetrain
    summary = edgetrain.train({"model": "resnet18", "dataset": "cifar10", "data_dir": "...", "devices": 4})
    summary = edgetrain.train("config.yaml", model=MyNet(), devices=2)   # your own nn.Module

``edgetrain.train`` is the function; the training loop itself lives in the
``edgetrain.train`` subpackage (``from edgetrain.train.loop import run_worker``).
"""
__version__ = "0.1.0"

from edgetrain.config import TrainConfig, load_config  # noqa: E402
from edgetrain.errors import EdgetrainError  # noqa: E402
from edgetrain.models import build_model, register_model  # noqa: E402
from edgetrain.train import train  # noqa: E402  (rebinds the name to the function)

__all__ = ["train", "TrainConfig", "load_config", "EdgetrainError", "build_model", "register_model", "__version__"]
