"""The CIFAR-10 subset beside the repository (shared/data), skipped with a reason where absent."""
from __future__ import annotations

from pathlib import Path

import pytest

CIFAR = Path(__file__).parents[1].parent.parent / "shared/data/cifar10-subset/cifar-10-batches-py"


@pytest.fixture
def cifar_dir() -> Path:
    if not (CIFAR / "data_batch_1").is_file():
        pytest.skip(f"CIFAR-10 subset not found at {CIFAR}")
    return CIFAR
