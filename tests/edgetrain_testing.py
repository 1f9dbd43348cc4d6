"""Helpers shared by the tests (imported by name: a conftest.py cannot be, as there are several)."""
import subprocess
import sys
from pathlib import Path

from torch import nn

REPO = Path(__file__).resolve().parents[1]
CIFAR = REPO.parent / "shared" / "data" / "cifar10-subset" / "cifar-10-batches-py"


def on_devices(fn, world: int, *args):
    """``fn(rank, world, *args)`` on ``world`` emulated devices in one gloo group; their return values by rank.

    The launcher's own spawner (``edgetrain.cluster.launch.run_group``), bounded for tests: 60 s per
    collective, 240 s in all (below pytest's 300 s, so the devices are stopped cleanly first).
    """
    from edgetrain.cluster.launch import run_group

    return run_group(fn, world, *args, timeout_s=60, deadline_s=240,
                     deadline_fix="a test's devices hung or the host is overloaded")


def run_cli(*args: str, timeout: float = 120, cwd=None) -> subprocess.CompletedProcess:
    """Run ``edgetrain ARGS`` in a fresh interpreter; returns the completed process (text output)."""
    return subprocess.run([sys.executable, "-m", "edgetrain", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=cwd)


def run_main(*args: str, cwd=None) -> subprocess.CompletedProcess:
    """``edgetrain ARGS`` through the CLI's ``main`` in this process, as ``run_cli`` runs it less a fresh
    interpreter's start (torch's import, and a fork server's for a training run: 5-8 s of CPU): its exit
    status and what it printed to stdout and stderr. For tests not about the process; what the devices
    print themselves (``epoch 1/2: ...``) goes to their own stdout, not here."""
    import contextlib
    import io
    import os

    from edgetrain.cli import main

    out, err, here = io.StringIO(), io.StringIO(), os.getcwd()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            os.chdir(cwd or here)
            code = main(list(args))
        except SystemExit as e:  # argparse exits from inside parse_args
            code = e.code if isinstance(e.code, int) else int(e.code is not None)
        finally:
            os.chdir(here)
    return subprocess.CompletedProcess(["edgetrain", *args], code, out.getvalue(), err.getvalue())


# Quiet, fast defaults for training runs in tests.
FAST = dict(progress=False, eval=False, throttle=False, timeout=30)


class DigitsMlp(nn.Module):
    """A small MLP on 8x8 digits without BatchNorm: pipeline stages, micro-batches and replicas then change
    nothing but the order of summation, so tests/train/test_pipeline*.py compare it with one device."""

    HIDDEN = 24

    def __init__(self):
        super().__init__()
        hidden = self.HIDDEN
        self.body = nn.Sequential(nn.Flatten(), nn.Linear(64, hidden), nn.ReLU(), nn.Linear(hidden, hidden),
                                  nn.Tanh(), nn.Linear(hidden, 10))

    def forward(self, x):
        return self.body(x)


def keys_written_by_rank(directory) -> dict[int, set[str]]:
    """A directory of parts (train/checkpoint.py ``write_parts``): per rank, the keys whose data lies in that
    rank's own DCP file, ``__<rank>_0.distcp``, as DCP's metadata says."""
    from torch.distributed.checkpoint import FileSystemReader

    written: dict[int, set[str]] = {}
    for index, info in FileSystemReader(directory).read_metadata().storage_data.items():
        written.setdefault(int(info.relative_path.split("_")[2]), set()).add(index.fqn)
    return written


@__import__("functools").lru_cache(maxsize=None)
def _pooled_unsupported() -> str | None:
    """Why this torch cannot run the pipeline and fsdp strategies (they are refused in one line), or None."""
    import importlib
    import inspect

    import torch.distributed.checkpoint as dcp

    try:
        importlib.import_module("edgetrain.train.fsdp")
    except ImportError as e:
        return f"this torch has no FSDP2 ({e})"
    if "no_dist" not in inspect.signature(dcp.save).parameters:
        return "this torch's torch.distributed.checkpoint.save has no no_dist"
    return None


# pytestmark of the modules that train with the pipeline or fsdp strategies (tests on the lowest torch)
NEEDS_POOLED = __import__("pytest").mark.skipif(_pooled_unsupported() is not None,
                                                reason=f"{_pooled_unsupported()}: pipeline and fsdp refused")
