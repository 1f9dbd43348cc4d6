"""A run with no emulated link measures its clock: each device's wall time of its training steps. The time one
device took to get ready must not land in another's steps as a wait at their first exchange."""
import json
import time
from pathlib import Path

import pytest

import edgetrain
from edgetrain.train.strategy import DataParallel
from edgetrain_testing import FAST

LATE_S = 1.5


class LateDataParallel(DataParallel):
    """Data parallel, with device 1 ready LATE_S after the others, as on a slow link the device that receives the
    initial model last (10 Mbit/s delivers a 1.6 MB model to the last of 4 devices about 2 s after the first)."""

    def setup(self, model):
        super().setup(model)
        if self.context.rank == 1:
            time.sleep(LATE_S)


@pytest.mark.parametrize("sync", ["local:4", "sync"])
def test_a_device_ready_late_adds_no_wait_to_the_measured_clock(sync, tmp_path):
    summary = edgetrain.train(dict(FAST, dataset="digits", devices=2, steps=8, batch_size=32, sync=sync,
                                   output=str(tmp_path), run_name="late"), strategy=LateDataParallel)
    assert summary["link_mode"] == "none"
    records = [json.loads(line) for line in (Path(summary["run_dir"]) / "metrics.jsonl").read_text().splitlines()]
    # the clock at the first step that waits for the other device (the first exchange): a few steps of a small
    # MLP, not the LATE_S device 0 would have waited there for device 1
    first = 3 if sync.startswith("local") else 0
    clocks = [r["virtual_s"] for r in records if r["step"] == first]
    assert len(clocks) == 2 and max(clocks) < LATE_S / 3, clocks
