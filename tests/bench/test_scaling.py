import pytest

from edgetrain.bench import scaling, trainer_runs
from edgetrain.cli import main
from edgetrain.records import StepRecord

from bench_helpers import assert_png, read_result


def test_split_separates_transfer_from_waiting():
    records = [  # step 0 is start-up and skipped
        _step(0, 0, 9.0, data_s=9.0, compute_s=0.0, comm_s=0.0),
        _step(1, 0, 1.0, data_s=0.1, compute_s=0.4, comm_s=0.5),
        _step(1, 1, 1.0, data_s=0.1, compute_s=0.7, comm_s=0.2),
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


def test_a_failed_training_run_is_one_line_naming_it(tmp_path):
    from edgetrain.errors import EdgetrainError

    with pytest.raises(EdgetrainError) as e:
        trainer_runs.train_in_subprocess({"lr": -1.0, "output": str(tmp_path), "run_name": "devices-1"})
    assert str(e.value).startswith(f"training run {tmp_path / 'devices-1'} failed: config key 'lr'")
    assert "\n" not in str(e.value) and not (tmp_path / "devices-1").exists()


@pytest.mark.slow
def test_sigterm_to_the_bench_stops_its_trainer_and_devices(tmp_path):
    import signal
    import subprocess
    import sys
    import time

    import psutil

    from edgetrain.cluster.launch import device_processes

    bench = subprocess.Popen([sys.executable, "-m", "edgetrain", "bench", "scaling", "--devices", "1,2", "--model",
                              "small_cnn", "--dataset", "digits", "--steps", "100000", "--output", str(tmp_path)],
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline, bench_process = time.monotonic() + 90, psutil.Process(bench.pid)
        while time.monotonic() < deadline and not any(  # the trainer has started its device
                device_processes(p) for p in [bench_process, *bench_process.children(recursive=True)]):
            time.sleep(0.5)
        family = psutil.Process(bench.pid).children(recursive=True)
        assert family, "the bench started no trainer within 90 s"
        bench.send_signal(signal.SIGTERM)
        _, err = bench.communicate(timeout=60)
        assert bench.returncode == 128 + signal.SIGTERM and "terminated (SIGTERM)" in err
        gone, alive = psutil.wait_procs(family, timeout=30)
        assert not alive, [p.cmdline() for p in alive]
    finally:
        if bench.poll() is None:
            bench.kill()


@pytest.mark.slow
def test_scaling_runs_the_trainer(tmp_path):
    assert main(["bench", "scaling", "--devices", "1,2", "--model", "small_cnn", "--dataset", "digits",
                 "--batch-size", "16", "--steps", "4", "--output", str(tmp_path), "--name", "s"]) == 0
    result = read_result(tmp_path / "s")
    rows = {r["devices"]: r for r in result["rows"]}
    assert set(rows) == {1, 2}
    for n, r in rows.items():
        summary = __import__("json").loads((tmp_path / "s" / "runs" / f"devices-{n}" / "summary.json").read_text())
        assert summary["devices"] == n and summary["global_batch"] == 16 * n  # weak scaling
        timing = trainer_runs.cluster_timing(trainer_runs.read_metrics(summary["run_dir"]))
        assert r["throughput_samples_per_s"] == pytest.approx(16 * n / r["step_s_median"])  # same median
        assert r["step_s_median"] == timing["step_s_median"] and isinstance(r["flags"], list)
        assert r["speedup"] == pytest.approx(r["throughput_samples_per_s"] / rows[1]["throughput_samples_per_s"])
        assert r["efficiency"] == pytest.approx(r["speedup"] / n)
        split = r["split_s_per_step"]
        assert all(split[k] >= 0 for k in ("data", "compute", "comm", "wait"))
    assert rows[1]["split_s_per_step"]["wait"] == 0
    assert_png(tmp_path / "s" / "scaling.png")


def _step(step: int, rank: int, step_s: float, samples: int = 8, **times: float) -> StepRecord:
    """One metrics.jsonl line; what a test does not set is zero."""
    times = {"data_s": 0.0, "compute_s": step_s, "comm_s": 0.0, **times}
    return StepRecord(step=step, epoch=0, rank=rank, loss=1.0, samples=samples, samples_per_s=samples / step_s,
                      step_s=step_s, comm_busy_s=None, bytes_sent=0, bytes_recv=0, cpu_s=0.0, lr=0.1,
                      peak_rss_mb=100.0, **times)


def _records(devices: int, step_s: list[float], local_batch: int = 8) -> list[StepRecord]:
    """metrics.jsonl records of a run whose devices all take ``step_s[i]`` at step ``i``."""
    return [_step(i, r, s, local_batch) for i, s in enumerate(step_s) for r in range(devices)]


def test_a_noisy_baseline_and_a_superlinear_efficiency_are_flagged():
    # The 1-device baseline's steps spread widely (a shared machine's bursts); 2 devices look 4x faster.
    noisy = _records(1, [1.0, 0.4, 1.2, 0.4, 1.2, 0.8])
    steady = _records(2, [1.0, 0.2, 0.2, 0.21, 0.2, 0.2])
    rows = {r["devices"]: r for r in scaling.scaling_rows({1: noisy, 2: steady})}
    assert rows[1]["noisy"] and rows[1]["flags"] == ["noisy"]
    assert rows[2]["efficiency"] > 1 and rows[2]["flags"] == ["noisy baseline", "superlinear"]
    # samples/s is the global batch over the median step shown beside it, on both rows
    assert rows[1]["throughput_samples_per_s"] == pytest.approx(8 / 0.8)
    assert rows[2]["throughput_samples_per_s"] == pytest.approx(16 / 0.2)
    assert scaling.efficiency_cell(rows[2]).endswith("% !")
    notes = " ".join(scaling.flag_notes(list(rows.values())))
    assert "baseline is noisy" in notes and "more than 100%" in notes


def test_steady_runs_carry_no_flags():
    rows = scaling.scaling_rows({1: _records(1, [1.0] + [0.2] * 5), 2: _records(2, [1.0] + [0.25] * 5)})
    assert all(r["flags"] == [] for r in rows) and rows[1]["efficiency"] == pytest.approx(0.8)
    assert scaling.flag_notes(rows) == [] and scaling.efficiency_cell(rows[1]) == "80.0%"


def test_a_config_the_trainer_refuses_leaves_no_bench_run_directory(tmp_path):
    """The trainer's own checks (its process) refuse what the bench's config check cannot see: the model and
    the data. Refused before any run finished, the bench's run directory goes too; a later failure keeps it."""
    from edgetrain.errors import EdgetrainError

    def refused(cfg):
        raise EdgetrainError(f"training run {cfg['run_name']} failed: model small_cnn cannot take ...; choose one")

    with pytest.raises(EdgetrainError, match="devices-1 failed"):
        scaling.run({"model": "small_cnn"}, [1, 2], output=str(tmp_path / "out"), train_fn=refused)
    assert list((tmp_path / "out").iterdir()) == []
