import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
CIFAR = REPO.parent / "shared" / "data" / "cifar10-subset" / "cifar-10-batches-py"

# Subprocesses (the CLI, torchrun) must import this checkout's edgetrain too.
os.environ["PYTHONPATH"] = os.pathsep.join([str(REPO / "src"), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)


@pytest.fixture
def cifar_dir() -> Path:
    if not (CIFAR / "data_batch_1").is_file():
        pytest.skip(f"CIFAR-10 subset not found at {CIFAR}")
    return CIFAR


def run_cli(*args: str, timeout: float = 120, cwd=None) -> subprocess.CompletedProcess:
    """Run ``edgetrain ARGS`` in a fresh interpreter; returns the completed process (text output)."""
    return subprocess.run([sys.executable, "-m", "edgetrain", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=cwd)


# Quiet, fast defaults for training runs in tests.
FAST = dict(progress=False, eval=False, throttle=False, timeout=30)
