"""Helpers shared by the tests (imported by name: a conftest.py cannot be, as there are several)."""
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CIFAR = REPO.parent / "shared" / "data" / "cifar10-subset" / "cifar-10-batches-py"


def run_cli(*args: str, timeout: float = 120, cwd=None) -> subprocess.CompletedProcess:
    """Run ``edgetrain ARGS`` in a fresh interpreter; returns the completed process (text output)."""
    return subprocess.run([sys.executable, "-m", "edgetrain", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=cwd)


# Quiet, fast defaults for training runs in tests.
FAST = dict(progress=False, eval=False, throttle=False, timeout=30)
