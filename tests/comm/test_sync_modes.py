"""The sync modes' interface (comm/mode.py): an abstract base, implemented by every registered sync kind's mode."""
from __future__ import annotations

import inspect

import pytest
import torch
from comm_workers import run_spec, tiny_data, tiny_model

from edgetrain.comm import DeviceClock, SyncMode, build_sync
from edgetrain.comm.emulation import LinkEmulator
from edgetrain.kinds import SYNC_KINDS

OPTIONS = {"fedavg": {"partition": "iid"}}  # what a kind needs besides itself to resolve


def test_a_sync_mode_must_define_after_step_and_only_that():
    assert inspect.isabstract(SyncMode) and SyncMode.__abstractmethods__ == {"after_step"}
    with pytest.raises(TypeError, match="after_step"):
        SyncMode(tiny_model(), 1, LinkEmulator(None, 0))
    assert not inspect.isabstract(DeviceClock)  # the clock of fsdp and pipeline, whose exchanges are their own


@pytest.mark.parametrize("kind", SYNC_KINDS.values(), ids=lambda k: k.name)
def test_every_sync_kind_builds_a_mode_that_implements_the_interface(kind):
    text = kind.example or kind.usage
    model = tiny_model()
    sync = build_sync(model, run_spec(sync=text, **OPTIONS.get(kind.name, {})), 0, 1, steps_per_epoch=2)
    assert isinstance(sync, SyncMode) and type(sync).kind is kind and not inspect.isabstract(type(sync))
    optimizer = torch.optim.SGD(sync.model.parameters(), lr=0.1)
    x, y = tiny_data(0, 8)
    for step in range(2):  # the calls of DataParallel.train_step, in its order
        assert sync.trains(step)
        torch.nn.functional.cross_entropy(sync.model(x), y).backward()
        sync.after_backward(step)
        optimizer.step()
        sync.after_step(step)
        assert {"virtual_s", "virtual_compute_s", "virtual_comm_s"} <= set(sync.step_metrics())
    sync.settle("checkpoint")
    sync.load_state_dict(sync.state_dict())
    sync.finish()
    assert sync.summary()["sync"] == text and sync.summary()["sync_steps"] == 2
    sync.close()
