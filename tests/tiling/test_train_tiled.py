"""``edgetrain train --strategy tiled``: the trainer drives TiledTraining end to end."""
from __future__ import annotations

import json

import torch

from edgetrain.models import register_model
from edgetrain.train import train

from edgetrain_testing import FAST, run_main
from .models import rel_err, resnet18_w4

RUN = dict(FAST, model="tiling_resnet18_w4", dataset="synthetic", image_size=12, synthetic_samples=48,
           batch_size=8, steps=3, lr=0.05, weight_decay=0.0)


def test_tiled_training_run_equals_one_device(tmp_path):
    register_model("tiling_resnet18_w4", resnet18_w4)
    tiled = train(dict(RUN, devices=2, strategy="tiled", grid="1x2", groups="auto", output=str(tmp_path / "t")))
    single = train(dict(RUN, devices=1, output=str(tmp_path / "s")))
    assert tiled["steps"] == single["steps"] == 3
    assert abs(tiled["train_loss"] - single["train_loss"]) <= 1e-4 * abs(single["train_loss"])
    a = torch.load(tmp_path / "t" / tiled["run_dir"].split("/")[-1] / "checkpoint.pt", weights_only=False)["model"]
    b = torch.load(tmp_path / "s" / single["run_dir"].split("/")[-1] / "checkpoint.pt", weights_only=False)["model"]
    assert a.keys() == b.keys()
    for k in a:
        if a[k].is_floating_point():
            assert rel_err(a[k].double(), b[k].double()) <= 1e-4, k
    report = tiled["tiling"]
    assert report["grid"] == "1x2" and report["groups"] and report["bytes_exchanged_per_step"] > 0
    assert len(report["peak_memory_bytes_tiled_section"]) == 2
    assert tiled["bytes_sent_total"] > 0 and tiled["devices"] == 2


def test_cli_strategy_tiled(tmp_path):
    r = run_main("train", "--strategy", "tiled", "--grid", "1x2", "--groups", "auto", "--devices", "2",
                 "--steps", "2", "--batch-size", "8", "--no-progress", "--no-eval", "--no-throttle",
                 "--output", str(tmp_path), "--run-name", "tiled")
    assert r.returncode == 0, r.stderr
    summary = json.loads((tmp_path / "tiled" / "summary.json").read_text())
    assert summary["sync"] == "tiled" and summary["steps"] == 2
    assert summary["tiling"]["grid"] == "1x2" and "auto grouping" in summary["tiling"]["groups_why"]
