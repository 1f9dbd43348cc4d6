import pytest

from edgetrain.bench import scaling, trainer_runs
from edgetrain.cli import main

from bench_helpers import assert_png, read_result


def test_split_separates_transfer_from_waiting():
    records = [  # step 0 is start-up and skipped
        {"step": 0, "rank": 0, "step_s": 9.0, "data_s": 9.0, "compute_s": 0.0, "comm_s": 0.0},
        {"step": 1, "rank": 0, "step_s": 1.0, "data_s": 0.1, "compute_s": 0.4, "comm_s": 0.5},
        {"step": 1, "rank": 1, "step_s": 1.0, "data_s": 0.1, "compute_s": 0.7, "comm_s": 0.2},
    ]
    split = trainer_runs.split_per_step(records)
    assert split["comm"] == pytest.approx(0.2)  # the last device to arrive only pays for the transfer
    assert split["wait"] == pytest.approx((0.3 + 0.0) / 2)
    assert split["compute"] == pytest.approx(0.55) and split["data"] == pytest.approx(0.1)
    assert sum(split[k] for k in ("data", "compute", "comm", "wait")) == pytest.approx(split["step"])


def test_devices_must_include_one(tmp_path):
    from edgetrain.errors import EdgetrainError

    with pytest.raises(EdgetrainError, match="including 1"):
        scaling.run({"model": "small_cnn"}, [2, 4], output=str(tmp_path))


def test_scaling_runs_the_trainer(tmp_path):
    assert main(["bench", "scaling", "--devices", "1,2", "--model", "small_cnn", "--dataset", "digits",
                 "--batch-size", "16", "--steps", "4", "--output", str(tmp_path), "--name", "s"]) == 0
    result = read_result(tmp_path / "s")
    rows = {r["devices"]: r for r in result["rows"]}
    assert set(rows) == {1, 2}
    for n, r in rows.items():
        summary = __import__("json").loads((tmp_path / "s" / "runs" / f"devices-{n}" / "summary.json").read_text())
        assert summary["devices"] == n and summary["global_batch"] == 16 * n  # weak scaling
        assert r["throughput_samples_per_s"] == summary["throughput_samples_per_s"]
        assert r["speedup"] == pytest.approx(r["throughput_samples_per_s"] / rows[1]["throughput_samples_per_s"])
        assert r["efficiency"] == pytest.approx(r["speedup"] / n)
        split = r["split_s_per_step"]
        assert all(split[k] >= 0 for k in ("data", "compute", "comm", "wait"))
    assert rows[1]["split_s_per_step"]["wait"] == 0
    assert_png(tmp_path / "s" / "scaling.png")
