"""Helpers for the bench tests: read a run's result, check a PNG decodes."""
from __future__ import annotations

import json
from pathlib import Path


def read_result(run_dir) -> dict:
    return json.loads((Path(run_dir) / "result.json").read_text())


def assert_png(path) -> None:
    import matplotlib.image as mpimg

    data = Path(path).read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", f"{path} is not a PNG"
    img = mpimg.imread(path)
    assert img.shape[0] > 100 and img.shape[1] > 100
