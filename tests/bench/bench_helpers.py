"""Helpers for the bench tests: read a run's result, check a PNG decodes."""
from __future__ import annotations

import json
from pathlib import Path

from edgetrain.results import BenchResult


def read_result(run_dir) -> dict:
    """A bench's result.json as written, after checking it against its typed schema (``results.BenchResult``)."""
    path = Path(run_dir) / "result.json"
    data = json.loads(path.read_text())
    assert BenchResult.from_dict(data, str(path)).to_dict() == data  # every key known, of its type
    return data


def assert_png(path) -> None:
    import matplotlib.image as mpimg

    data = Path(path).read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", f"{path} is not a PNG"
    img = mpimg.imread(path)
    assert img.shape[0] > 100 and img.shape[1] > 100
