"""Build a model without memory, then give each device only the layers it holds, initialised per layer.

Every device builds the model on PyTorch's meta device (``build_on_meta``):
shapes and dtypes, no storage. A strategy then materialises what the device
holds (``materialise``): data parallelism every layer, a pipeline stage its
own layers, FSDP one layer at a time, keeping only its shard
(``initialised_layers``, train/fsdp.py). This is the flow of PyTorch's FSDP2
documentation and of torchtitan: build on meta, ``to_empty`` on the real
device, then initialise.

Initialisation is deterministic per layer, not one random stream over the
whole model: the module named ``name`` (its qualified name in the model, as
``named_modules`` gives it) runs its own ``reset_parameters()`` with the
global RNG seeded by ``layer_seed(seed, name)`` (and restored afterwards). A
layer's initial weights therefore depend on the run's seed and its name only,
not on which other layers this device built, so one device, DDP, a pipeline
stage and an FSDP shard all start from the same weights.

Limits: every module that owns parameters or buffers must restore all of
them in ``reset_parameters()`` (PyTorch's layers do: ``nn.Linear``,
``nn.Conv2d``, ``nn.BatchNorm2d``, whose running statistics it resets too);
one that does not is named in one line. A custom initialisation in a model's
``__init__`` (after its layers were built) is not replayed: the layers'
PyTorch defaults are what every strategy starts from. A model passed already
built (``edgetrain.train(config, model=...)``) keeps its own weights.
"""
from __future__ import annotations

import hashlib
from typing import Callable, Iterator

import torch
from torch import nn

from edgetrain.errors import EdgetrainError

META = torch.device("meta")


def build_on_meta(factory: Callable[..., nn.Module], *args, **kwargs) -> nn.Module:
    """``factory(*args, **kwargs)`` with every tensor on the meta device: the model's structure, no storage."""
    with META:
        return factory(*args, **kwargs)


def layer_seed(seed: int, name: str) -> int:
    """The seed of the layer called ``name``: stable across processes and Python runs (not ``hash``)."""
    digest = hashlib.blake2b(f"{seed}:{name}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


def owns_tensors(module: nn.Module) -> bool:
    """Whether the module has parameters or buffers of its own (not only in its children)."""
    return any(True for _ in module.parameters(recurse=False)) or any(True for _ in module.buffers(recurse=False))


def is_meta(module: nn.Module) -> bool:
    """Whether any of the module's own tensors still has no storage."""
    return any(t.is_meta for t in [*module.parameters(recurse=False), *module.buffers(recurse=False)])


def reset(module: nn.Module, name: str, seed: int) -> None:
    """Initialise ``module``'s own tensors with its ``reset_parameters()``, from the RNG seeded for ``name``."""
    if not hasattr(module, "reset_parameters"):
        raise EdgetrainError(f"layer '{name}' ({type(module).__name__}) has parameters or buffers of its own but no "
                             f"reset_parameters(), so a device cannot initialise it alone; give it one, or pass the "
                             f"built model with edgetrain.train(config, model=...)")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(layer_seed(seed, name))
        module.reset_parameters()


def initialised_layers(model: nn.Module, seed: int, device: torch.device,
                       keep: Callable[[str], bool] = lambda name: True) -> Iterator[tuple[str, nn.Module]]:
    """Materialise and initialise, one module at a time, each module of ``model`` still on meta whose name
    ``keep`` accepts; yields ``(name, module)`` after each (the caller may copy or free it before the next)."""
    for name, module in model.named_modules():
        if owns_tensors(module) and is_meta(module) and keep(name):
            module.to_empty(device=device, recurse=False)
            reset(module, name, seed)
            yield name, module


def materialise(model: nn.Module, seed: int, device: torch.device,
                keep: Callable[[str], bool] = lambda name: True) -> nn.Module:
    """``model`` with the layers ``keep`` names on ``device`` and initialised (the others stay on meta).

    A model with nothing on meta (built for real, or passed by the user) is only moved to ``device``."""
    if not any(is_meta(m) for m in model.modules()):
        return model.to(device)
    for _ in initialised_layers(model, seed, device, keep):
        pass
    return model
