"""Checkpoints with fsdp (each device's shards) and pipeline (each device's stage): resumed == uninterrupted."""
from pathlib import Path

import pytest
import torch

from edgetrain import train
from edgetrain.train.checkpoint import checkpoint_files, checkpoint_step
from edgetrain_testing import FAST

# 64 synthetic 8x8 images in global batches of 16: 4 steps an epoch, so the checkpoint of step 4 starts epoch 1.
SMALL = dict(model="small_cnn", dataset="synthetic", image_size=8, synthetic_samples=64, batch_size=16, steps=6,
             lr=0.1, checkpoint_every=2, keep_checkpoints=3, devices=2, **FAST)


@pytest.mark.slow
@pytest.mark.parametrize("options", [dict(strategy="fsdp"), dict(strategy="pipeline", microbatches=2)],
                         ids=["fsdp", "pipeline"])
def test_a_sharded_or_staged_run_resumes_as_the_uninterrupted_one(tmp_path, options):
    run_dir = Path(train(SMALL, output=str(tmp_path), **options)["run_dir"])
    uninterrupted = torch.load(run_dir / "checkpoint.pt", weights_only=True)["model"]
    assert [checkpoint_step(p) for p in checkpoint_files(run_dir)] == [2, 4]
    # Each device's entry holds its own part: a shard of every parameter, or its stage's layers only.
    devices = torch.load(checkpoint_files(run_dir)[-1], weights_only=False)["devices"]
    held = [device["strategy"]["model"] for device in devices]
    if options["strategy"] == "fsdp":
        assert held[0]["classifier.weight"].to_local().shape == (5, 128)  # 10 rows over 2 devices
    else:
        assert len(held[0]) + len(held[1]) == len(uninterrupted) and held[0] and held[1]
    checkpoint_files(run_dir)[-1].unlink()  # as if killed after step 2's checkpoint
    summary = train({"resume": str(run_dir)})
    assert summary["steps"] == 6 and summary["strategy"] == options["strategy"]
    resumed = torch.load(run_dir / "checkpoint.pt", weights_only=True)["model"]
    for name, value in uninterrupted.items():
        assert torch.equal(value, resumed[name]), name
