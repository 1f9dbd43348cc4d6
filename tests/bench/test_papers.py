"""The papers' experiments (benchmarks/papers/), each in its fast version: a few steps, small sizes."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

PAPERS = Path(__file__).resolve().parents[2] / "benchmarks" / "papers"
sys.path.insert(0, str(PAPERS))

import common  # noqa: E402


def _rows(path: Path) -> list[dict]:
    data = json.loads(path.read_text())
    assert data["command"] and data["date_utc"] and data["load"].startswith("load average")
    for row in data["rows"]:
        assert row["how"] in ("measured", "modelled", "counted") and row["paper"] and row["edgetrain"]
    return data["rows"]


def test_a_cell_must_say_how_it_was_obtained():
    with pytest.raises(ValueError, match="how must be one of"):
        common.Row("figure", "paper", "1.0x", "guessed")


def test_tiling_paper_fast(tmp_path, capsys):
    import tiling_paper

    assert tiling_paper.main(["--fast", "--out", str(tmp_path / "t.json")]) == 0
    data = json.loads((tmp_path / "t.json").read_text())
    rows = _rows(tmp_path / "t.json")
    one, two = data["memory"]["yolov2-tiny"]
    assert one["grid"] == "1x1" and two["grid"] == "1x2"
    # measured per-device memory of the tiled section falls with the tiles, and the table says by how much
    assert two["worst_bytes"] < 0.8 * one["worst_bytes"] and two["owned_share"] == pytest.approx(0.5)
    assert any(r["how"] == "measured" and "grid 1x2" in r["figure"] for r in rows)
    assert any(r["how"] == "modelled" and "speed-up" in r["figure"] for r in rows)
    gains = data["grouping"]
    assert {g["profile"] for g in gains} == {"rpi3", "rpi4", "jetson-nano"}
    assert all(g["gain_over_every_layer"] >= 1.0 - 1e-9 for g in gains)  # auto is the cheapest by construction
    assert "the paper's figures beside edgetrain's" in capsys.readouterr().out


def test_tiling_paper_modelled_speedup_is_the_sum_of_its_parts():
    import tiling_paper

    (row,) = tiling_paper.modelled_speedups("yolov2-tiny", 4, 64, (2,))
    parts = row["section_s"] + row["handoff_s"] + row["tail_s"] + row["gradients_s"]
    assert row["step_s"] == pytest.approx(parts) and row["speedup"] == pytest.approx(row["one_core_s"] / parts)
    assert row["gradients_s"] > 0 and row["handoff_s"] > 0


@pytest.mark.slow
def test_pi_study_fast(tmp_path):
    import pi_study

    assert pi_study.main(["--fast", "--out", str(tmp_path / "p.json"), "--runs", str(tmp_path)]) == 0
    rows = _rows(tmp_path / "p.json")
    sweep = json.loads((tmp_path / "p.json").read_text())["batch_sweep"]
    assert [r["batch_size"] for r in sweep["rows"]] == [1, 2, 4] and sweep["largest_fitting_batch"] == 4
    assert any(r["figure"].endswith("largest batch that fits 4 GB (PyTorch)") and r["edgetrain"] == "4" for r in rows)
    assert any(r["paper"] == "47 GFLOPS (the issue)" for r in rows)


@pytest.mark.slow
def test_iot_paper_fast(tmp_path):
    import iot_paper

    assert iot_paper.main(["--fast", "--out", str(tmp_path / "i.json"), "--runs", str(tmp_path)]) == 0
    plain, two_step = json.loads((tmp_path / "i.json").read_text())["runs"]
    assert plain["compress"] == "none" and two_step["compress"].startswith("threshold")
    assert two_step["bytes_per_step_per_device"] < plain["bytes_per_step_per_device"]
    assert plain["virtual_step_s"] > 2 * 0.039  # a round trip of the paper's link at the least


@pytest.mark.slow
def test_jetson_paper_fast(tmp_path):
    import jetson_paper

    assert jetson_paper.main(["--fast", "--out", str(tmp_path / "j.json"), "--runs", str(tmp_path)]) == 0
    rows = _rows(tmp_path / "j.json")
    stalls = [r for r in rows if r["figure"].startswith("stall, ")]
    assert {r["figure"].split(", ")[1] for r in stalls} == {"nvme", "hdd"}
    assert any(r["edgetrain"] == "not emulated" for r in rows)
