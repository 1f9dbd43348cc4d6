import os

import pytest

from edgetrain_testing import CIFAR, REPO

# Subprocesses (the CLI, torchrun) must import this checkout's edgetrain too.
os.environ["PYTHONPATH"] = os.pathsep.join([str(REPO / "src"), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)


@pytest.fixture
def cifar_dir():
    if not (CIFAR / "data_batch_1").is_file():
        pytest.skip(f"CIFAR-10 subset not found at {CIFAR}")
    return CIFAR
