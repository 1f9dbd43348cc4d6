"""edgetrain: train deep networks across clusters of low-cost edge devices.

Python API::

    import edgetrain
    summary = edgetrain.train({"model": "resnet18", "dataset": "cifar10", "data_dir": "...", "devices": 4})
    summary = edgetrain.train("config.yaml", model=MyNet(), devices=2)   # your own nn.Module
    summary = edgetrain.train(task="regression")              # real-valued targets (docs/how-to/tasks.md)
    summary = edgetrain.train(model=MyNet(), task=MyTask(), dataset=my_data)  # your own edgetrain.Task
    state = edgetrain.load_checkpoint(summary["run_dir"])  # the final model, whole: {"model", "optimizer", ...}

``edgetrain.train`` is the function; the training loop itself lives in the
``edgetrain.train`` subpackage (``from edgetrain.train.loop import run_worker``).

``import edgetrain`` leaves torch out, so that the torch-free modules (``edgetrain.spec``,
``edgetrain.config``, ``edgetrain.report.html``) do not pay for it: ``train`` is imported here (its
subpackage imports torch when a run starts), the other names on first use (PEP 562 module ``__getattr__``).
"""
__version__ = "0.1.0"

import importlib  # noqa: E402
import os  # noqa: E402

# c10d logs its retries and timeouts to stderr from C++ (a dozen lines with a stack) before raising the
# exception that edgetrain reports as one line. Read when torch's C++ library loads, so set before torch is
# imported; an explicit TORCH_CPP_LOG_LEVEL wins.
os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "FATAL")

# name -> module it lives in; imported on first access
_LAZY = {
    "TrainConfig": "edgetrain.config",
    "load_config": "edgetrain.config",
    "EdgetrainError": "edgetrain.errors",
    "build_model": "edgetrain.models",
    "register_model": "edgetrain.models",
    "register_dataset": "edgetrain.data",
    "load_checkpoint": "edgetrain.train.checkpoint",
    "Task": "edgetrain.tasks",
    "Metric": "edgetrain.tasks",
    "Evaluator": "edgetrain.tasks",
}

__all__ = ["train", "TrainConfig", "load_config", "EdgetrainError", "build_model", "register_model",
           "register_dataset", "load_checkpoint", "Task", "Metric", "Evaluator", "__version__"]


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module 'edgetrain' has no attribute {name!r}")
    value = getattr(importlib.import_module(_LAZY[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


# Every strategy, sync mode and compressor is declared in edgetrain.kinds, whose descriptors the parsers of
# edgetrain.spec look names up in: imported here, so that they are declared whatever is imported first.
import edgetrain.kinds  # noqa: E402,F401

# The function, bound here after its subpackage: importing the subpackage (edgetrain.train.loop, say) once
# edgetrain is imported no longer rebinds the name, so edgetrain.train stays the function.
from edgetrain.train import train  # noqa: E402
