"""Checkpoints and --resume (train/checkpoint.py): resumed == uninterrupted, atomic files, last K kept, refusals."""
import json
import time
from pathlib import Path

import pytest
import torch

from edgetrain import train
from edgetrain.comm.compress.memory import DGCMemory, ResidualMemory
from edgetrain.config import load_config
from edgetrain.data import GlobalBatchSampler
from edgetrain.errors import EdgetrainError
from edgetrain.spec import CheckpointSpec
from edgetrain.train.checkpoint import Checkpointer, check_resumable, checkpoint_files, checkpoint_step
from edgetrain_testing import FAST, run_cli

# 128 synthetic images in global batches of 32: 4 steps an epoch, so step 6 is in the middle of epoch 1.
SMALL = dict(model="small_cnn", dataset="synthetic", image_size=8, synthetic_samples=128, batch_size=32, steps=10,
             lr=0.1, checkpoint_every=3, keep_checkpoints=3, **FAST)


def final_model(run_dir) -> dict:
    return torch.load(Path(run_dir) / "checkpoint.pt", weights_only=True)["model"]


@pytest.mark.slow
@pytest.mark.parametrize("devices, compress, sync", [
    (1, "none", "sync"),
    (2, "topk:0.1", "sync"),         # error-feedback residuals of the DDP hook, per parameter
    (2, "topk:0.1", "local:4"),      # reference model and residuals in the middle of a local period
])
def test_resumed_run_ends_as_the_uninterrupted_one(tmp_path, devices, compress, sync):
    run_dir = Path(train(SMALL, devices=devices, compress=compress, sync=sync, output=str(tmp_path))["run_dir"])
    uninterrupted = final_model(run_dir)
    assert [checkpoint_step(p) for p in checkpoint_files(run_dir)] == [3, 6, 9]
    # As if the run had been killed after step 6's checkpoint: step 9's never happened.
    checkpoint_files(run_dir)[-1].unlink()
    summary = train({"resume": str(run_dir)})
    assert summary["run_dir"] == str(run_dir)
    resumed = final_model(run_dir)
    for name, value in uninterrupted.items():
        assert torch.allclose(value.double(), resumed[name].double(), rtol=0, atol=1e-6), name
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert sorted((r["step"], r["rank"]) for r in lines) == [(s, r) for s in range(10) for r in range(devices)]
    assert summary["steps"] == 10
    assert not list(run_dir.glob("metrics-*.jsonl"))


def test_sampler_resumes_in_the_middle_of_an_epoch():
    whole = GlobalBatchSampler(100, [6, 4], rank=1, seed=3)
    whole.set_epoch(2)
    resumed = GlobalBatchSampler(100, [6, 4], rank=1, seed=3)
    resumed.resume_at(2, 7)
    assert list(resumed) == list(whole)[7:]
    assert len(list(resumed)) == len(resumed)  # the next epoch starts from its first batch again


@pytest.mark.parametrize("memory", [ResidualMemory(), DGCMemory()])
def test_error_feedback_memory_survives_a_checkpoint(memory):
    x = torch.randn(10)
    memory.update(memory.compensate(x, "params"), torch.zeros(10), "params")
    copy = type(memory)()
    copy.load_state_dict(torch.load(_saved(memory.state_dict()), weights_only=True))
    y = torch.randn(10)
    assert torch.equal(copy.compensate(y, "params"), memory.compensate(y, "params"))


def _saved(obj):
    import io

    buffer = io.BytesIO()
    torch.save(obj, buffer)
    buffer.seek(0)
    return buffer


def test_only_the_newest_checkpoints_are_kept(tmp_path):
    checkpoints = Checkpointer(CheckpointSpec(every_steps=1, keep=2), str(tmp_path), rank=0, world=1, timeout_s=5)
    for step in (1, 2, 3):
        checkpoints.save(step, {"step": step}, {"weights": torch.ones(3) * step})
    assert [checkpoint_step(p) for p in checkpoint_files(tmp_path)] == [2, 3]


def test_a_checkpoint_is_due_every_n_steps_and_after_s_seconds(tmp_path, monkeypatch):
    by_steps = Checkpointer(CheckpointSpec(every_steps=3), str(tmp_path), rank=0, world=1, timeout_s=5)
    assert [s for s in range(10) if by_steps.due(s, start_step=0)] == [3, 6, 9]
    by_time = Checkpointer(CheckpointSpec(every_s=60.0), str(tmp_path), rank=0, world=1, timeout_s=5)
    assert not by_time.due(1, start_step=0)
    clock = time.monotonic() + 61
    monkeypatch.setattr(time, "monotonic", lambda: clock)
    assert by_time.due(2, start_step=0)


def test_a_write_that_dies_half_way_leaves_no_partial_checkpoint(tmp_path, monkeypatch):
    checkpoints = Checkpointer(CheckpointSpec(every_steps=1, keep=2), str(tmp_path), rank=0, world=1, timeout_s=5)
    checkpoints.save(1, {"step": 1}, {"weights": torch.ones(3)})
    real_save = torch.save

    def dies_half_way(obj, f, *args, **kwargs):
        if hasattr(f, "fileno"):  # the checkpoint file, not the in-memory serialisation of a device's state
            f.write(b"half a checkpoint")
            raise KeyboardInterrupt  # as a kill would, in the middle of the write
        return real_save(obj, f, *args, **kwargs)

    monkeypatch.setattr(torch, "save", dies_half_way)
    with pytest.raises(KeyboardInterrupt):
        checkpoints.save(2, {"step": 2}, {"weights": torch.ones(3)})
    assert [p.name for p in (tmp_path / "checkpoints").iterdir()] == ["step-00000001.pt"]  # no temporary either
    assert torch.load(checkpoint_files(tmp_path)[0], weights_only=True)["step"] == 1


def test_resume_refuses_an_option_that_changes_the_training(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "config.yaml").write_text("lr: 0.05\ndevices: 2\n")
    assert load_config(resume=str(run_dir), progress=False, timeout=10).devices == 2  # how it is watched: fine
    with pytest.raises(EdgetrainError, match=r"option 'lr' is 0.1 but the run in .* was trained with 0.05; "
                                             r".*drop --lr"):
        load_config(resume=str(run_dir), lr=0.1)
    with pytest.raises(EdgetrainError, match="no checkpoint to resume from"):
        check_resumable(run_dir)


def test_resume_of_a_directory_that_is_no_run_is_one_line(tmp_path):
    done = run_cli("train", "--resume", str(tmp_path / "nothing"), timeout=60)
    assert done.returncode == 2
    assert done.stderr.startswith("edgetrain: error: --resume ") and done.stderr.count("\n") == 1, done.stderr
    assert "not a run directory" in done.stderr


def test_resume_reads_the_newest_whole_checkpoint_and_removes_a_killed_writers_temporary(tmp_path):
    writer = Checkpointer(CheckpointSpec(every_steps=1), str(tmp_path), rank=0, world=1, timeout_s=5)
    writer.save(1, {"step": 1}, {"weights": torch.ones(3)})
    killed_write = tmp_path / "checkpoints" / ".step-00000002.pt.999999999.x1y2.tmp"  # pid 999999999: gone
    killed_write.write_bytes(b"half a checkpoint")
    reader = Checkpointer(CheckpointSpec(resume_dir=str(tmp_path)), None, rank=0, world=1, timeout_s=5)
    run_state, mine = reader.load()
    assert run_state["step"] == 1 and torch.equal(mine["weights"], torch.ones(3))
    assert not killed_write.exists()
