"""What a run says and writes beside its records: start-up phase lines, TensorBoard event files."""
import importlib.util
import json
import sys

import pytest

from edgetrain.cli import main
from edgetrain.config import TrainConfig
from edgetrain.records import StepRecord
from edgetrain.train.loop import phase
from edgetrain_testing import run_cli

HAS_TENSORBOARD = importlib.util.find_spec("tensorboard") is not None
STEPS = 3
PHASES = ["starting 2 emulated device(s) on this host", "rendezvous: 2 device(s) at 127.0.0.1:",
          "admitting peers:", "loading data: digits", "counting FLOPs: small_cnn at 1x8x8",
          "setting up strategy ddp", f"training: {STEPS} steps, 1 epoch(s)"]


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    """Two devices, three steps, with the progress on (and TensorBoard where the package is installed)."""
    out = tmp_path_factory.mktemp("runs")
    proc = run_cli("train", "--devices", "2", "--steps", str(STEPS), "--batch-size", "256", "--no-throttle",
                   "--timeout", "30", "--output", str(out), "--run-name", "tiny",
                   *(["--tensorboard"] if HAS_TENSORBOARD else []), timeout=120)
    assert proc.returncode == 0, proc.stderr
    return proc, out / "tiny"


def test_start_up_phases_are_one_line_each_in_order(tiny_run):
    proc, _ = tiny_run
    lines = [line for line in proc.stderr.splitlines() if line.startswith("edgetrain: ")]
    assert len(lines) == len(PHASES), proc.stderr
    for line, expected in zip(lines, PHASES):
        assert line.startswith(f"edgetrain: {expected}"), (line, expected)


def test_phases_are_rank_0s_and_silent_without_progress(capsys):
    phase(TrainConfig(progress=False), 0, "loading data")
    phase(TrainConfig(), 1, "loading data")
    assert capsys.readouterr().err == ""
    phase(TrainConfig(), 0, "loading data: digits")
    assert capsys.readouterr().err == "edgetrain: loading data: digits\n"


@pytest.mark.skipif(not HAS_TENSORBOARD, reason="the tensorboard package is not installed (make setup installs "
                                                "it: pip install -e '.[test,tensorboard]')")
def test_tensorboard_event_files_read_back_with_every_step_and_evaluation(tiny_run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    _, run = tiny_run
    records = [StepRecord.from_dict(json.loads(line)) for line in (run / "metrics.jsonl").read_text().splitlines()]
    for rank in range(2):
        events = EventAccumulator(str(run / "tensorboard" / f"rank-{rank}"))
        events.Reload()
        tags = set(events.Tags()["scalars"])
        assert {"train/loss", "train/samples_per_s", "train/lr", "time/step_s", "time/data_s", "time/compute_s",
                "time/comm_s", "comm/bytes_sent", "memory/peak_rss_mb"} <= tags
        assert ({"eval/loss", "eval/accuracy"} <= tags) == (rank == 0)  # the whole test set: rank 0 writes it
        loss = events.Scalars("train/loss")
        mine = [r for r in records if r.rank == rank]
        assert [e.step for e in loss] == list(range(1, STEPS + 1))
        assert [e.value for e in loss] == pytest.approx([r.loss for r in mine])  # the records' own numbers
    summary = json.loads((run / "summary.json").read_text())
    [accuracy] = EventAccumulator(str(run / "tensorboard" / "rank-0")).Reload().Scalars("eval/accuracy")
    assert (accuracy.step, accuracy.value) == (STEPS, pytest.approx(summary["test_accuracy"]))


@pytest.mark.skipif(not HAS_TENSORBOARD, reason="the tensorboard package is not installed")
def test_rank_0_writes_the_event_files_of_devices_without_the_run_directory(tmp_path):
    """Under torchrun only rank 0 has the run directory: the others' steps arrive at the end."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from edgetrain.train.tensorboard_log import device_dir, write_missing_devices

    device_dir(tmp_path, 0).mkdir(parents=True)  # rank 0 wrote its own as it trained
    record = dict(epoch=0, loss=1.0, samples=8, samples_per_s=80.0, step_s=0.1, data_s=0.0, compute_s=0.1,
                  comm_s=0.0, comm_busy_s=None, bytes_sent=0, bytes_recv=0, cpu_s=0.1, lr=0.1, peak_rss_mb=1.0)
    write_missing_devices(tmp_path, [StepRecord(step=s, rank=r, **record) for s in range(2) for r in range(2)], 2)
    assert list(device_dir(tmp_path, 0).iterdir()) == []  # left alone
    events = EventAccumulator(str(device_dir(tmp_path, 1))).Reload()
    assert [e.step for e in events.Scalars("train/loss")] == [1, 2]


def test_tensorboard_without_the_package_is_one_line_before_anything_starts(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "tensorboard", None)  # as if not installed: find_spec finds nothing
    code = main(["train", "--tensorboard", "--output", str(tmp_path / "runs")])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1, err
    assert err.startswith("edgetrain: error: config key 'tensorboard' needs the tensorboard package") and \
        "pip install tensorboard" in err
    assert not (tmp_path / "runs").exists()
