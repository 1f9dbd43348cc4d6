import os
import shutil
import statistics

import pytest

from edgetrain.bench import counters
from edgetrain.cli import main

from bench_helpers import assert_png, read_result

PERF_CSV = """# started on Sun Nov 22
1000000,,instructions:u,500,100.00,,
400000,,cycles:u,500,100.00,,
<not supported>,,cache-references,0,100.00,,
50,,cache-misses,500,100.00,,
2000,,branches,500,100.00,,
20,,branch-misses,500,100.00,,
12.5,msec,task-clock,12500000,100.00,0.9,CPUs utilized
"""


def test_parse_perf_csv_and_ratios():
    counts = counters.parse_perf_csv(PERF_CSV)
    assert counts["instructions"] == 1e6 and counts["cycles"] == 4e5 and counts["task-clock"] == 12.5
    assert counts["cache-references"] is None
    r = counters.ratios(counts)
    assert r["IPC"] == pytest.approx(2.5)
    assert r["branch_miss_ratio"] == pytest.approx(0.01)
    assert r["cache_miss_ratio"] is None and r["L1d_miss_ratio"] is None


def test_without_perf_the_bench_says_so_and_keeps_the_rest(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("PATH", str(tmp_path / "no-perf-here"))
    assert main(["bench", "counters", "--model", "small_cnn", "--dataset", "digits", "--batch-size", "4", "--steps", "2",
                 "--threads", "1", "--output", str(tmp_path), "--name", "c"]) == 0
    assert "perf not found on PATH" in capsys.readouterr().out
    result = read_result(tmp_path / "c")
    assert result["available"] is False and "perf not found" in result["message"]
    assert result["samples_per_s"] == pytest.approx(4 / statistics.median(result["step_s"]))
    assert_png(tmp_path / "c" / "counters.png")


@pytest.mark.skipif(shutil.which("perf") is None, reason="perf is not installed on this machine")
def test_with_perf_counts_or_explains(tmp_path):
    assert main(["bench", "counters", "--model", "small_cnn", "--dataset", "digits", "--batch-size", "4", "--steps", "2",
                 "--threads", "1", "--output", str(tmp_path), "--name", "c"]) == 0
    result = read_result(tmp_path / "c")
    assert result["samples_per_s"] > 0
    if result["available"]:
        c = result["counts"]
        assert result["ratios"]["IPC"] == pytest.approx(c["instructions"] / c["cycles"])
        assert result["per_sample"]["instructions"] == pytest.approx(c["instructions"] / 8)
    else:
        assert result["message"]  # why not: no PMU, paranoid setting, or perf failure
    if os.path.exists("/proc/sys/kernel/perf_event_paranoid") and result["counts"]:
        assert result["counts"].get("task-clock", 0) > 0
