"""Stand-in for the typed spec layer (branch spine-spec replaces this file): the names the loop reads.

``RunSpec`` is what ``config.resolve`` makes of a ``TrainConfig`` once; the
training loop builds its strategy from it. Torch-free. In this stand-in the
compression and sync specs are ``comm``'s own parsed ones and ``link`` is
the config's link option; the spec layer types them.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class TilingSpec:
    grid: tuple[int, int]
    groups: tuple[int, ...] | None  # None: chosen on the first step (auto)


@dataclass(frozen=True)
class RunSpec:
    compress: Any
    sync: Any
    link: Any
    link_mode: str
    strategy: str  # "ddp" | "tiled"
    tiling: TilingSpec | None
    timeout_s: float
    seed: int
    accelerator: str
