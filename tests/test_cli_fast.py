"""Bad input, ``--help`` and argparse errors are answered before torch is imported (seconds on a Raspberry Pi).

Each case runs ``edgetrain.cli.main`` in a fresh interpreter and reports, after it returned or exited, whether
``torch`` was ever imported; the config checks (``config.load_config`` / ``config.resolve``) are torch-free.
"""
import subprocess
import sys

import pytest

# Runs main(argv) and prints the exit code and whether torch was imported, whichever way main ended.
PROBE = """
import sys
from edgetrain.cli import main
try:
    code = main(sys.argv[1:])
except SystemExit as e:
    code = e.code
print(f"exit={code} torch={'torch' in sys.modules}")
"""


def run_probe(argv: list[str], tmp_path) -> tuple[str, str]:
    out = subprocess.run([sys.executable, "-c", PROBE, *argv], capture_output=True, text=True, timeout=120,
                         cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip().splitlines()[-1], out.stderr


@pytest.mark.parametrize("argv", [
    ["train", "--devices", "0"],                       # config.load_config's check
    ["train", "--sync", "local:0"],                    # config.resolve's (spec.py)
    ["train", "--no-such-flag"],                       # argparse's
    ["plan", "--devices", "0"],
    ["plan", "--scale", "4,2"],                        # plan's own option check
    ["bench", "--no-such-flag"],
])
def test_bad_input_is_one_line_without_torch(argv, tmp_path):
    result, stderr = run_probe(argv, tmp_path)
    assert result == "exit=2 torch=False", (result, stderr)
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("edgetrain: error: "), stderr


@pytest.mark.parametrize("argv", [["--help"], ["train", "--help"], ["plan", "--help"]])
def test_help_without_torch(argv, tmp_path):
    result, stderr = run_probe(argv, tmp_path)
    assert result == "exit=0 torch=False", (result, stderr)


def test_from_edgetrain_train_import_train_leaves_torch_out():
    code = "import sys; from edgetrain.train import train; print(callable(train), 'torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["True", "False"]
