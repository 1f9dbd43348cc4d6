"""Joules per sample of training (train/energy.py): modelled from a profile's power model, measured from fake
sensors (RAPL with wrap-around, a power file, Jetson INA3221 on hwmon), labelled, in summary.json and tables."""
import io
import json
import time
from pathlib import Path

import pytest
import yaml
from rich.console import Console

from edgetrain import train
from edgetrain.cluster.sensors import hwmon_watts, ina_hwmon_rails
from edgetrain.cluster.profiles import BUILTIN_PROFILES, DeviceProfile, load_cluster
from edgetrain.errors import EdgetrainError
from edgetrain.records import DeviceSummary, EnergyRecord, RunSummary
from edgetrain.report.html import headline
from edgetrain.report.tables import print_train_summary
from edgetrain.train.energy import Clocks, EnergyMeter, Sensors
from edgetrain_testing import FAST, run_main

PI = DeviceProfile("pi", cores=4, idle_w=2.7, core_w=1.2)


class FakeClock:
    def __init__(self, *times: float):
        self.times = list(times)

    def __call__(self) -> float:
        return self.times.pop(0)


def no_sensors(tmp_path: Path, **found) -> Sensors:
    """Sensors where there are none, but for those ``found`` names."""
    return Sensors(**{**dict(rapl_root=str(tmp_path / "no-rapl"), ina_roots=(str(tmp_path / "no-ina"),),
                             hwmon_root=str(tmp_path / "no-hwmon")), **found})


def test_modelled_energy_is_the_profiles_watts_times_time_over_samples(tmp_path):
    meter = EnergyMeter(PI, 4, shared=True, sensors=no_sensors(tmp_path), clocks=Clocks(wall=FakeClock(100.0, 110.0)))
    meter.start()
    e = meter.stop(samples=300)
    assert (e.measured, e.joules, e.seconds, e.samples, e.watts) == (False, 75.0, 10.0, 300, 7.5)
    assert e.joules_per_sample == 75.0 / 300 and e.host_share is None
    assert e.source == "modelled (pi: 2.7 W + 1.2 W x 4 cores = 7.5 W)"


def test_no_sensor_and_no_power_model_gives_no_energy(tmp_path):
    meter = EnergyMeter(BUILTIN_PROFILES["jetson-nano"], 4, shared=False, sensors=no_sensors(tmp_path))
    meter.start()
    assert meter.stop(samples=10) is None


def fake_rapl(root: Path, uj: int, max_uj: int) -> Path:
    domain = root / "intel-rapl:0"
    domain.mkdir(parents=True, exist_ok=True)
    (domain / "energy_uj").write_text(f"{uj}\n")
    (domain / "max_energy_range_uj").write_text(f"{max_uj}\n")
    (root / "intel-rapl:0:0").mkdir(exist_ok=True)  # a sub-domain (core): not counted twice
    return domain


@pytest.mark.parametrize("shared", [False, True])
def test_rapl_energy_is_measured_across_the_counters_wrap(tmp_path, shared):
    max_uj = 262_143_328_850
    domain = fake_rapl(tmp_path / "powercap", max_uj - 1_000_000, max_uj)
    meter = EnergyMeter(PI, 4, shared=shared, sensors=no_sensors(tmp_path, rapl_root=str(tmp_path / "powercap")),
                        clocks=Clocks(wall=FakeClock(0.0, 2.0), cpu=FakeClock(5.0, 6.0, 6.0),
                                      host_cpu=FakeClock(100.0, 104.0)))
    meter.start()
    (domain / "energy_uj").write_text("2000000\n")  # wrapped: 1 J before the wrap, 2 J after
    e = meter.stop(samples=60)
    assert e.measured and e.seconds == 2.0
    if shared:  # 1 CPU second of the host's 4 busy ones: a quarter of the package's joules
        assert e.host_share == 0.25 and e.joules == pytest.approx(0.75)
        assert e.source == "measured (RAPL, host x 25% CPU-time share)"
    else:
        assert e.joules == pytest.approx(3.0) and e.host_share is None and e.source == "measured (RAPL)"
    assert e.joules_per_sample == pytest.approx(e.joules / 60) and e.watts == pytest.approx(e.joules / 2)


def test_power_file_is_read_through_the_window(tmp_path):
    watts = tmp_path / "usb-meter"
    watts.write_text("1700000000.5 4.0\n")  # a logger's line: time, then watts
    meter = EnergyMeter(PI, 4, shared=False, sensors=no_sensors(tmp_path, power_file=str(watts), sample_every_s=0.01))
    meter.start()
    time.sleep(0.3)
    e = meter.stop(samples=10)
    assert e.measured and e.source == f"measured (power file {watts})"
    assert e.watts == pytest.approx(4.0, rel=0.1)


def test_unreadable_power_file_is_one_clear_error(tmp_path):
    (tmp_path / "watts").write_text("n/a\n")
    with pytest.raises(EdgetrainError, match="cannot read watts from --power-file"):
        EnergyMeter(PI, 4, shared=False, sensors=no_sensors(tmp_path, power_file=str(tmp_path / "watts")))
    done = run_main("train", "--power-file", str(tmp_path / "watts"), "--steps", "1", "--output",
                    str(tmp_path / "runs"))
    assert done.returncode == 2 and done.stderr.count("\n") == 1, done.stderr
    assert done.stderr.startswith("edgetrain: error: cannot read watts from --power-file")
    assert not (tmp_path / "runs").exists()


def test_jetson_ina3221_rails_on_hwmon(tmp_path):
    ina, other = tmp_path / "hwmon1", tmp_path / "hwmon0"
    for d, name in ((ina, "ina3221"), (other, "cpu_thermal")):
        d.mkdir()
        (d / "name").write_text(name + "\n")
    (ina / "in1_input").write_text("5000\n")    # mV
    (ina / "curr1_input").write_text("1200\n")  # mA: 6 W
    (ina / "in2_input").write_text("1000\n")
    (ina / "curr2_input").write_text("500\n")   # 0.5 W
    (other / "in1_input").write_text("9999\n")
    rails = ina_hwmon_rails(str(tmp_path))
    assert [v.name for v, _ in rails] == ["in1_input", "in2_input"]
    assert hwmon_watts(rails) == pytest.approx(6.5)
    meter = EnergyMeter(PI, 4, shared=False, sensors=Sensors(rapl_root=str(tmp_path / "none"),
                                                             ina_roots=(str(tmp_path / "none"),),
                                                             hwmon_root=str(tmp_path), sample_every_s=0.01))
    meter.start()
    time.sleep(0.2)
    e = meter.stop(samples=5)
    assert e.source == "measured (INA3221)" and e.watts == pytest.approx(6.5, rel=0.1)


def test_profile_power_model_in_a_cluster_file(tmp_path):
    cluster = tmp_path / "cluster.yaml"
    cluster.write_text(yaml.safe_dump({"profiles": {"pi": {"base": "rpi4", "idle_w": 2.7, "core_w": 1.2}},
                                       "devices": ["pi"]}))
    [device] = load_cluster(cluster)
    assert device.profile.power_w(4) == pytest.approx(7.5) and BUILTIN_PROFILES["jetson-nano"].power_w(4) is None
    cluster.write_text(yaml.safe_dump({"profiles": {"pi": {"base": "rpi4", "idle_w": 2.7}}, "devices": ["pi"]}))
    [device] = load_cluster(cluster)  # rpi4's own core_w (published figures) with the idle watts given
    assert device.profile.power_w(4) == pytest.approx(2.7 + 4 * 0.765)
    cluster.write_text(yaml.safe_dump({"profiles": {"nano": {"base": "jetson-nano", "idle_w": 2.7}},
                                       "devices": ["nano"]}))
    with pytest.raises(EdgetrainError, match="needs both idle_w and core_w"):
        load_cluster(cluster)
    cluster.write_text(yaml.safe_dump({"profiles": {"pi": {"idle_w": "lots", "core_w": 1}}, "devices": ["pi"]}))
    with pytest.raises(EdgetrainError, match="idle_w must be a number of watts >= 0"):
        load_cluster(cluster)


def _summary(energy: EnergyRecord | None) -> RunSummary:
    device = DeviceSummary(rank=0, profile="pi", local_batch=8, samples_per_s=10.0, step_s=0.8, data_s=0.1,
                           compute_s=0.5, comm_s=0.2, peak_rss_mb=100.0, bytes_sent=0, energy=energy)
    return RunSummary(per_device=[device], throughput_samples_per_s=10.0, train_loss=1.0, steps=3, wall_time_s=1.0)


def test_energy_in_summary_json_the_terminal_table_and_the_report():
    modelled = EnergyRecord.of("modelled (pi: 2.7 W + 1.2 W x 4 cores = 7.5 W)", False, 75.0, 10.0, 300)
    again = RunSummary.from_dict(json.loads(json.dumps(_summary(modelled).to_dict())))
    assert again.per_device[0].energy == modelled
    out = io.StringIO()
    print_train_summary(_summary(modelled), Console(file=out, width=200))
    text = out.getvalue()
    assert "J/smp" in text and "0.25*" in text and "7.5*" in text
    assert "device 0: modelled (pi: 2.7 W" in text and "modelled, not measured" in text
    cols, rows, notes = headline(_summary(modelled))
    assert rows[0][cols.index("J/sample")] == "0.25*" and any("device 0: modelled" in n for n in notes)
    measured = EnergyRecord.of("measured (RAPL)", True, 30.0, 10.0, 300)
    cols, rows, notes = headline(_summary(measured))
    assert rows[0][cols.index("J/sample")] == "0.1" and "modelled, not measured" not in " ".join(notes)
    cols, _, _ = headline(_summary(None))  # older runs: no column
    assert "J/sample" not in cols


def test_a_short_run_reports_modelled_joules_per_sample(tmp_path):
    cluster = tmp_path / "cluster.yaml"
    cluster.write_text(yaml.safe_dump({"profiles": {"pi": {"base": "rpi4", "idle_w": 2.7, "core_w": 1.2}},
                                       "devices": [{"profile": "pi", "count": 2}]}))
    summary = RunSummary.from_dict(train(dict(FAST, steps=3, batch_size=16, output=str(tmp_path),
                                              cluster=str(cluster))))
    for d in summary.per_device:
        e = d.energy
        assert not e.measured and e.source.startswith("modelled (pi: 2.7 W + 1.2 W x 4 cores")
        assert e.samples == 3 * 8 and e.watts == pytest.approx(7.5)
        assert e.joules_per_sample == pytest.approx(7.5 * e.seconds / 24)


def test_builtin_rpi4_gives_modelled_joules_from_its_published_figures(tmp_path):
    """rpi4 carries the Raspberry Pi documentation's Pi 4 B figures (idle 0.6 A, stress 1.2 A at 5.1 V): a short
    run on it reports modelled joules per sample with no cluster file; a profile with no published figures none."""
    rpi4 = BUILTIN_PROFILES["rpi4"]
    assert (rpi4.idle_w, rpi4.power_w(4)) == (pytest.approx(0.6 * 5.1), pytest.approx(1.2 * 5.1))
    assert all(BUILTIN_PROFILES[name].power_w(4) is None
               for name in ("host", "jetson-nano", "rpi5", "rpi-zero-2w", "jetson-orin-nano", "smart-speaker-2g"))
    summary = RunSummary.from_dict(train(dict(FAST, steps=3, batch_size=16, output=str(tmp_path), profile="rpi4",
                                              devices=1)))
    (device,) = summary.per_device
    e = device.energy
    assert not e.measured and e.source == "modelled (rpi4: 3.06 W + 0.765 W x 4 cores = 6.12 W)"
    assert e.samples == 3 * 16 and e.watts == pytest.approx(6.12)
    assert e.joules_per_sample == pytest.approx(6.12 * e.seconds / 48)
