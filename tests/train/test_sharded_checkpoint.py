"""Checkpoints with fsdp (each device's shards) and pipeline (each device's stage): every device writes its own
part (torch.distributed.checkpoint), resumed == uninterrupted, and a killed write leaves the previous one usable."""
from pathlib import Path

import pytest
import torch

from edgetrain import load_checkpoint, train
from edgetrain.errors import EdgetrainError
from edgetrain.train.checkpoint import checkpoint_files, checkpoint_step, check_resume_devices
from edgetrain_testing import NEEDS_POOLED, FAST, keys_written_by_rank

pytestmark = NEEDS_POOLED

# 64 synthetic 8x8 images in global batches of 16: 4 steps an epoch, so the checkpoint of step 4 starts epoch 1.
SMALL = dict(model="small_cnn", dataset="synthetic", image_size=8, synthetic_samples=64, batch_size=16, steps=6,
             lr=0.1, checkpoint_every=2, keep_checkpoints=3, devices=2, **FAST)


@pytest.mark.slow
@pytest.mark.parametrize("options", [dict(strategy="fsdp"), dict(strategy="pipeline", microbatches=2)],
                         ids=["fsdp", "pipeline"])
def test_a_sharded_or_staged_run_resumes_as_the_uninterrupted_one(tmp_path, options):
    summary = train(SMALL, output=str(tmp_path), **options)
    run_dir = Path(summary["run_dir"])
    assert summary["checkpoint"] == "checkpoint" and not (run_dir / "checkpoint.pt").exists()
    final = load_checkpoint(run_dir)
    uninterrupted = final["model"]
    assert final["step"] == 6 and final["optimizer"]["state"]
    assert [checkpoint_step(p) for p in checkpoint_files(run_dir)] == [2, 4]
    newest = checkpoint_files(run_dir)[-1]
    assert sorted(p.name for p in newest.iterdir()) == [".metadata", "__0_0.distcp", "__1_0.distcp", "device-0.pt",
                                                        "device-1.pt", "run.pt"]
    # Each device's file holds its own part: a shard of every parameter (fsdp: each parameter in both files, with
    # half its rows), or its stage's layers only (pipeline: no key in both files).
    written = keys_written_by_rank(newest)
    models = [{k for k in written[r] if k.startswith("model.")} for r in (0, 1)]
    if options["strategy"] == "fsdp":
        assert models[0] == models[1] and "model.classifier.weight" in models[0]
        from torch.distributed.checkpoint import FileSystemReader
        chunks = FileSystemReader(newest).read_metadata().state_dict_metadata["model.classifier.weight"].chunks
        assert sorted(tuple(c.sizes) for c in chunks) == [(5, 128), (5, 128)]  # 10 rows over 2 devices
    else:
        assert models[0] and models[1] and not models[0] & models[1]
        assert {k[len("model."):] for k in models[0] | models[1]} == set(uninterrupted)
    # As if killed during step 4's write: its parts half-written in the hidden directory, the checkpoint gone.
    partial = newest.parent / f".{newest.name}.tmp"
    newest.rename(partial)
    (partial / ".metadata").unlink()
    (partial / "run.pt").unlink()
    assert [checkpoint_step(p) for p in checkpoint_files(run_dir)] == [2]
    resumed_summary = train({"resume": str(run_dir)})
    assert resumed_summary["steps"] == 6 and resumed_summary["strategy"] == options["strategy"]
    assert not partial.exists()  # removed at the resume
    resumed = load_checkpoint(run_dir)["model"]
    for name, value in uninterrupted.items():
        assert torch.equal(value, resumed[name]), name
    with pytest.raises(EdgetrainError, match=r"written by 2 devices, each with its own part of the model "
                                             r"\(pipeline or fsdp\); resume it with --devices 2"):
        check_resume_devices(run_dir, devices=1, partitioned=False)
