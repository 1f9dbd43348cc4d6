"""``edgetrain train`` with compression, local SGD and an emulated LTE link, end to end."""
from __future__ import annotations

import json

import pytest

from edgetrain_testing import run_main


def test_train_topk_local_sgd_on_lte(tmp_path):
    run = run_main("train", "--devices", "2", "--dataset", "digits", "--epochs", "2",
                   "--steps", "24", "--batch-size", "64", "--compress", "topk:0.01", "--sync", "local:8",
                   "--link", "lte-10m", "--output", str(tmp_path), "--run-name", "e2e", "--no-progress")
    assert run.returncode == 0, run.stderr[-3000:]
    summary = json.loads((tmp_path / "e2e" / "summary.json").read_text())
    assert summary["sync"] == "local:8" and summary["compress"] == "topk:0.01"
    assert summary["link"].startswith("lte-10m") and summary["link_mode"] == "virtual"
    assert summary["averages"] == 3 and summary["sync_steps"] == 24
    # top-k at 1% every 8th step: far fewer bytes than fp32 all-reduce every step
    assert summary["compression_ratio"] > 100
    assert summary["bytes_per_step_per_device"] * summary["compression_ratio"] == pytest.approx(
        summary["fp32_allreduce_bytes_per_step"] * 24 / summary["sync_steps"])
    assert 0 < summary["comm_fraction"] < 1 and summary["virtual_time_s"] > summary["compute_s"]
    # the terminal shows the virtual clock's figures beside the host's, labelled as modelled
    step_s = summary["virtual_time_max_device_s"] / 24
    assert (f"modelled on {summary['link']} (virtual clock: this host's compute + modelled link time): "
            f"step {step_s:,.3f} s, throughput {64 / step_s:,.1f} samples/s") in " ".join(run.stdout.split())
    assert summary["test_accuracy"] is not None
    records = [json.loads(line) for line in (tmp_path / "e2e" / "metrics.jsonl").read_text().splitlines()]
    assert len(records) == 2 * 24
    assert all({"virtual_s", "virtual_comm_s", "comm_s", "compute_s"} <= set(r) for r in records)
    averaging = [r for r in records if r["local_steps"] == 0]
    # a 2-device all-gather is one round: at least about one 50 ms LTE latency (jitter 5 ms)
    assert len(averaging) == 2 * 3 and all(r["virtual_comm_s"] > 0.03 for r in averaging)


@pytest.mark.parametrize("flags, message", [
    (["--compress", "topk:0"], "topk ratio must be a fraction in (0, 1]"),
    (["--compress", "topk:2"], "topk ratio must be a fraction in (0, 1]"),
    (["--sync", "local:0"], "local SGD period H must be >= 1"),
    (["--link", "lte-5g"], "unknown link preset 'lte-5g'"),
])
def test_bad_flags_are_one_line_errors(flags, message, tmp_path, capsys):
    from edgetrain.cli import main  # in-process: the flags are refused before any device starts

    assert main(["train", "--devices", "2", "--output", str(tmp_path), *flags]) == 2
    err = capsys.readouterr().err
    assert err.startswith("edgetrain: error: ") and err.strip().count("\n") == 0 and message in err
