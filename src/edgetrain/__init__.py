"""edgetrain: train deep networks across clusters of low-cost edge devices.

Python API::

    import edgetrain
    summary = edgetrain.train({"model": "resnet18", "dataset": "cifar10", "data_dir": "...", "devices": 4})
    summary = edgetrain.train("config.yaml", model=MyNet(), devices=2)   # your own nn.Module

``edgetrain.train`` is the function; the training loop itself lives in the
``edgetrain.train`` subpackage (``from edgetrain.train.loop import run_worker``).
"""
__version__ = "0.1.0"

import os  # noqa: E402

# c10d logs its retries and timeouts to stderr from C++ (a dozen lines with a stack) before raising the
# exception that edgetrain reports as one line. Read when torch's C++ library loads, so set before torch is
# imported; an explicit TORCH_CPP_LOG_LEVEL wins.
os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "FATAL")

from edgetrain.config import TrainConfig, load_config  # noqa: E402
from edgetrain.errors import EdgetrainError  # noqa: E402
from edgetrain.models import build_model, register_model  # noqa: E402
from edgetrain.train import train  # noqa: E402  (rebinds the name to the function)

__all__ = ["train", "TrainConfig", "load_config", "EdgetrainError", "build_model", "register_model", "__version__"]
