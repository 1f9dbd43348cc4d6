"""Fault injection (cluster/faults.py, EDGETRAIN_FAULT): parsing, and a device killed mid-run then resumed."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from edgetrain import train
from edgetrain.errors import EdgetrainError
from edgetrain.spec import FaultSpec, parse_fault, parse_faults
from edgetrain.train.checkpoint import checkpoint_files, checkpoint_step
from edgetrain_testing import FAST

SMALL = dict(model="small_cnn", dataset="synthetic", image_size=8, synthetic_samples=128, batch_size=32, steps=10,
             lr=0.1, devices=2, compress="topk:0.1", **FAST)


def test_fault_spec_is_parsed_once_and_checked():
    assert parse_fault("kill:rank=1:step=5") == FaultSpec("kill", 1, 5)
    assert parse_fault("STOP:step=0:rank=0") == FaultSpec("stop", 0, 0)
    assert parse_fault("") is None and parse_fault(None) is None
    for bad in ("kill", "explode:rank=1:step=2", "kill:rank=one:step=2", "kill:rank=1:step=2:rank=3",
                "kill:rank=-1:step=2"):
        with pytest.raises(EdgetrainError, match="must be ACTION:rank=R:step=S"):
            parse_fault(bad)


def test_several_faults_are_separated_by_semicolons():
    assert parse_faults("kill:rank=1:step=3:back=20; kill:rank=2:step=6:back=20") == (
        FaultSpec("kill", 1, 3, 20.0), FaultSpec("kill", 2, 6, 20.0))
    assert parse_faults("stop:rank=0:step=1;") == (FaultSpec("stop", 0, 1),)
    assert parse_faults("") == () and parse_faults(None) == ()
    refused = {"kill:rank=1:step=3;kill:rank=1:step=3:back=2": "gives one device two faults at one step",
               "kill:rank=1:step=3:back=1;kill:rank=2:step=6:back=2": "give every kill the same :back=SECONDS",
               "kill:rank=1:step=3;kill:rank=2": "must be ACTION:rank=R:step=S"}
    for bad, message in refused.items():
        with pytest.raises(EdgetrainError, match=message):
            parse_faults(bad)


def test_two_faults_in_one_elastic_run_both_happen(tmp_path, monkeypatch):
    monkeypatch.setenv("EDGETRAIN_FAULT", "kill:rank=1:step=3;kill:rank=2:step=6")
    summary = train(SMALL, devices=3, min_devices=1, compress="none", output=str(tmp_path), run_name="two")
    changes = [json.loads(line) for line in (tmp_path / "two" / "membership.jsonl").read_text().splitlines()]
    assert [(c["kind"], c["devices"], c["step"], c["world"]) for c in changes] == [
        ("leave", [1], 3, 2), ("leave", [2], 6, 1)]
    steps = [json.loads(line)["step"] for line in (tmp_path / "two" / "metrics.jsonl").read_text().splitlines()]
    assert sorted(set(steps)) == list(range(10)) and summary["steps"] == 10  # every step trained, none twice
    assert len(steps) == 3 * 3 + 2 * 3 + 1 * 4  # 3 devices for steps 0-2, 2 for 3-5, 1 for 6-9


def test_a_malformed_fault_is_one_line_before_any_device_starts(tmp_path):
    done = subprocess.run([sys.executable, "-m", "edgetrain", "train", "--output", str(tmp_path)],
                          env={**os.environ, "EDGETRAIN_FAULT": "kill:rank=1"}, capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 2 and done.stderr.count("\n") == 1, done.stderr
    assert done.stderr.startswith("edgetrain: error: EDGETRAIN_FAULT='kill:rank=1' must be ACTION:rank=R:step=S")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.slow
def test_device_killed_mid_run_then_resumed_ends_as_an_uninterrupted_run(tmp_path, monkeypatch):
    uninterrupted = torch.load(Path(train(SMALL, output=str(tmp_path / "clean"))["run_dir"]) / "checkpoint.pt",
                               weights_only=True)["model"]
    monkeypatch.setenv("EDGETRAIN_FAULT", "kill:rank=1:step=5")
    with pytest.raises(EdgetrainError, match=r"^device 1 \(host\) failed: its process was killed by signal SIGKILL"):
        train(SMALL, checkpoint_every=2, output=str(tmp_path), run_name="chaos")
    run_dir = tmp_path / "chaos"
    assert [checkpoint_step(p) for p in checkpoint_files(run_dir)] == [2, 4]  # the newest 2; step 5 never began
    monkeypatch.delenv("EDGETRAIN_FAULT")
    summary = train({"resume": str(run_dir)})
    resumed = torch.load(run_dir / "checkpoint.pt", weights_only=True)["model"]
    for name, value in uninterrupted.items():
        assert torch.allclose(value.double(), resumed[name].double(), rtol=0, atol=1e-6), name
    assert summary["steps"] == 10


@pytest.mark.slow
@pytest.mark.parametrize("fault, blame", [
    ("stop:rank=1:step=3", "its process was stopped (SIGSTOP?) and its peers timed out waiting for it"),
    ("disconnect:rank=1:step=3", "fault injected: device 1 disconnected at step 3 and gave up after 5 s"),
])
def test_a_stopped_or_disconnected_device_is_the_one_blamed(tmp_path, fault, blame):
    done = subprocess.run([sys.executable, "-m", "edgetrain", "train", "--devices", "2", "--steps", "10",
                           "--no-progress", "--no-eval", "--no-throttle", "--timeout", "5", "--output", str(tmp_path)],
                          env={**os.environ, "EDGETRAIN_FAULT": fault}, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and done.stderr.count("\n") == 1, done.stderr
    assert done.stderr == f"edgetrain: error: device 1 (host) failed: {blame}; the other devices were stopped\n"
