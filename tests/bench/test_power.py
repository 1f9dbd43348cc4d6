import pytest

from edgetrain.bench import power
from edgetrain.cluster import sensors
from edgetrain.cli import main

from bench_helpers import assert_png, read_result


def _args(tmp_path, name, *extra):
    missing = str(tmp_path / "missing")
    return ["bench", "power", "--model", "small_cnn", "--dataset", "digits", "--threads", "1,2", "--batch-size", "8", "--steps", "3",
            "--epoch-samples", "1000", "--rapl-root", missing, "--ina-root", missing, "--cpu-root", missing,
            "--output", str(tmp_path), "--name", name, *extra]


def test_missing_sensor_is_reported_and_times_still_measured(tmp_path, capsys):
    assert main(_args(tmp_path, "none")) == 0
    out = capsys.readouterr().out
    assert "no energy sensor found" in out and "cpufreq not writable" in out
    result = read_result(tmp_path / "none")
    assert result["energy_source"]["kind"] == "none"
    assert [r["threads"] for r in result["rows"]] == [1, 2]
    for r in result["rows"]:
        assert r["energy_j_per_epoch"] is None and r["epoch_s"] == pytest.approx(1000 / r["samples_per_s"])
    assert result["pareto"] == []
    assert_png(tmp_path / "none" / "power.png")


def test_power_model_is_labelled_modelled(tmp_path, capsys):
    assert main(_args(tmp_path, "model", "--power-model", "2.5,1.5")) == 0
    assert "MODELLED" in capsys.readouterr().out
    result = read_result(tmp_path / "model")
    assert result["energy_source"]["modelled"] is True
    for r in result["rows"]:
        assert r["energy_modelled"] is True
        assert r["avg_power_w"] == pytest.approx(2.5 + 1.5 * r["threads"], rel=1e-6)
        assert r["energy_j_per_epoch"] > 0
    front = result["pareto"]
    assert front and all(f["setting"] in {r["setting"] for r in result["rows"]} for f in front)
    assert_png(tmp_path / "model" / "power.png")


def test_rapl_counter_detection_and_wraparound(tmp_path):
    d = tmp_path / "intel-rapl:0"
    d.mkdir()
    (d / "energy_uj").write_text("1000\n")
    (d / "max_energy_range_uj").write_text("5000\n")
    (tmp_path / "intel-rapl:0:0").mkdir()  # a sub-domain: not counted twice
    assert sensors.rapl_domains(str(tmp_path)) == [d]
    src = power.energy_source(str(tmp_path), (str(tmp_path / "none"),), None)
    assert src["kind"].startswith("Intel RAPL") and not src["modelled"]
    with sensors.rapl_meter([d]) as joules:
        (d / "energy_uj").write_text("500\n")  # wrapped past 5000
        assert joules() == pytest.approx((5000 - 1000 + 500) / 1e6)
    assert sensors.rapl_delta_uj(100, 400, 5000) == 300


def test_pareto_front():
    rows = [{"setting": s, "epoch_s": t, "energy_j_per_epoch": e}
            for s, t, e in [("a", 1, 10), ("b", 2, 5), ("c", 2, 11), ("d", 3, 5), ("e", 4, 1)]]
    assert [r["setting"] for r in power.pareto_front(rows)] == ["a", "b", "e"]


def test_bad_power_model_is_one_clear_error(tmp_path, capsys):
    assert main(_args(tmp_path, "bad", "--power-model", "lots")) == 2
    assert "--power-model wants IDLE_W,PER_CORE_W" in capsys.readouterr().err
