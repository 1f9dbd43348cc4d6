import statistics

import pytest

from edgetrain.bench import variability
from edgetrain.cli import main

from bench_helpers import assert_png, read_result


def test_cv_statistics():
    runs = [{"run": 0, "devices": [{"rank": 0, "step_s": [1.0, 1.2]}, {"rank": 1, "step_s": [2.0, 2.0]}]},
            {"run": 1, "devices": [{"rank": 0, "step_s": [1.0, 1.0]}, {"rank": 1, "step_s": [3.0, 3.0]}]}]
    s = variability.summarise(runs)
    assert runs[0]["devices"][0]["cv_within"] == pytest.approx(statistics.stdev([1.0, 1.2]) / 1.1)
    assert runs[0]["devices"][1]["cv_within"] == 0
    assert runs[1]["cv_across_devices"] == pytest.approx(statistics.stdev([1.0, 3.0]) / 2.0)
    assert s["per_device"][1]["cv_across_runs"] == pytest.approx(statistics.stdev([2.0, 3.0]) / 2.5)
    assert variability.cv([5.0]) is None


def test_variability_run(tmp_path):
    assert main(["bench", "variability", "--model", "small_cnn", "--dataset", "digits", "--repeats", "2", "--steps", "4",
                 "--batch-size", "4", "--threads", "1", "--output", str(tmp_path), "--name", "v"]) == 0
    result = read_result(tmp_path / "v")
    runs = result["runs"]
    assert len(runs) == 2 and all(len(r["devices"][0]["step_s"]) == 4 for r in runs)
    means = [statistics.fmean(r["devices"][0]["step_s"]) for r in runs]
    assert result["summary"]["cv_across_runs"] == pytest.approx(statistics.stdev(means) / statistics.fmean(means))
    for r in runs:
        assert r["samples_per_s"] == pytest.approx(4 * 4 / sum(r["devices"][0]["step_s"]))
    assert_png(tmp_path / "v" / "variability.png")


@pytest.mark.slow
def test_variability_across_devices_uses_the_trainer(tmp_path):
    assert main(["bench", "variability", "--model", "small_cnn", "--dataset", "digits", "--repeats", "2",
                 "--devices", "2", "--steps", "3", "--warmup", "1", "--batch-size", "8",
                 "--output", str(tmp_path), "--name", "v2"]) == 0
    result = read_result(tmp_path / "v2")
    for run in result["runs"]:
        assert [d["rank"] for d in run["devices"]] == [0, 1]
        assert all(len(d["step_s"]) == 3 for d in run["devices"])  # the warm-up step is dropped
        means = [statistics.fmean(d["step_s"]) for d in run["devices"]]
        assert run["cv_across_devices"] == pytest.approx(statistics.stdev(means) / statistics.fmean(means))
    assert result["summary"]["cv_across_devices"] is not None
