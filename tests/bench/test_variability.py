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
    assert main(["bench", "variability", "--model", "small_cnn", "--repeats", "2", "--steps", "4",
                 "--batch-size", "4", "--threads", "1", "--output", str(tmp_path), "--name", "v"]) == 0
    result = read_result(tmp_path / "v")
    runs = result["runs"]
    assert len(runs) == 2 and all(len(r["devices"][0]["step_s"]) == 4 for r in runs)
    means = [statistics.fmean(r["devices"][0]["step_s"]) for r in runs]
    assert result["summary"]["cv_across_runs"] == pytest.approx(statistics.stdev(means) / statistics.fmean(means))
    for r in runs:
        assert r["samples_per_s"] == pytest.approx(4 * 4 / sum(r["devices"][0]["step_s"]))
    assert_png(tmp_path / "v" / "variability.png")
