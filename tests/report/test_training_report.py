"""The training part of the report: curves from the step records, per-device charts, the parameter table."""
import json
from pathlib import Path

import pytest
import yaml

from edgetrain.cli import main
from edgetrain.records import EvalRecord, RunSummary, StepRecord
from edgetrain.report import plots, training
from edgetrain.report.html import render


def _step(step: int, rank: int, loss: float, samples: int, step_s: float, virtual_s: float | None = None,
          bytes_sent: int = 1000) -> StepRecord:
    return StepRecord(step=step, epoch=0, rank=rank, loss=loss, samples=samples, samples_per_s=samples / step_s,
                      step_s=step_s, data_s=0.001, compute_s=step_s - 0.002, comm_s=0.001, comm_busy_s=None,
                      bytes_sent=bytes_sent, bytes_recv=bytes_sent, cpu_s=step_s, lr=0.05, peak_rss_mb=400.0,
                      virtual_s=virtual_s)


def _device(rank: int) -> dict:
    return {"rank": rank, "profile": "host", "local_batch": 16, "samples_per_s": 450.0, "step_s": 0.02,
            "data_s": 0.001, "compute_s": 0.015, "comm_s": 0.004, "bytes_sent": 3000, "bytes_recv": 3000}


def _write_run(root: Path, name: str, link: str | None) -> Path:
    """A two-device, three-step run as ``edgetrain train`` writes it (config, metrics, evaluations, summary)."""
    run = root / name
    run.mkdir()
    steps = [_step(s, r, loss=2.0 - s / 2 + r / 10, samples=16, step_s=0.02 + r / 100, virtual_s=(s + 1) * (1 + r))
             for s in range(3) for r in range(2)]
    evals = [EvalRecord(epoch=0, step=2, test_loss=1.5, test_accuracy=0.5),
             EvalRecord(epoch=1, step=3, test_loss=1.0, test_accuracy=0.75)]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r.to_dict()) + "\n" for r in steps))
    (run / "evals.jsonl").write_text("".join(json.dumps(e.to_dict()) + "\n" for e in evals))
    (run / "config.yaml").write_text(yaml.safe_dump({
        "model": "small_cnn", "dataset": "digits", "devices": 2, "profile": "host", "epochs": 2, "steps": None,
        "batch_size": 32, "optimizer": "sgd", "lr": 0.05, "momentum": 0.9, "weight_decay": 0.0005,
        "schedule": "cosine", "compress": "topk:0.01", "sync": "sync", "link": link, "link_mode": "virtual",
        "strategy": "ddp", "grid": "1x1", "seed": 7, "accelerator": "auto", "throttle": True}))
    details = {"compress": "topk:0.01", "sync": "sync", "link": link, "link_mode": "virtual" if link else "none"}
    (run / "summary.json").write_text(json.dumps({
        "run_dir": str(run), "model": "small_cnn", "params": 94186, "dataset": "digits", "input_shape": [1, 8, 8],
        "devices": 2, "profiles": ["host", "host"], "strategy": "ddp", "accelerator": "cpu", "global_batch": 32,
        "local_batches": [16, 16], "steps": 3, "throughput_samples_per_s": 900.0, "test_accuracy": 0.75,
        "evals": [e.to_dict() for e in evals], "per_device": [_device(0), _device(1)], **details}))
    return run


def test_curves_are_the_devices_mean_loss_against_steps_host_time_and_modelled_time(tmp_path):
    run = _write_run(tmp_path, "lte", link="lte-10m")
    summary = RunSummary.from_dict(json.loads((run / "summary.json").read_text()))
    loaded = training.load_training(run, summary)
    curves = training.curves("lte", summary, loaded.steps, loaded.evals)
    assert curves.steps == [1, 2, 3]
    assert curves.train_loss == pytest.approx([2.05, 1.55, 1.05])  # the two devices' losses, weighted by samples
    assert curves.host_s == pytest.approx([0.03, 0.06, 0.09])  # the slower device's step times, summed
    assert curves.modelled_s == [2, 4, 6]  # the later device clock at each step
    assert (curves.eval_steps, curves.eval_accuracy) == ([2, 3], [0.5, 0.75])
    assert curves.at(curves.host_s, curves.eval_steps) == pytest.approx([0.06, 0.09])
    labels, split, sent = training.device_split(summary, loaded.steps)  # the device chart's numbers
    assert labels == ["0: host", "1: host"] and split["compute"] == pytest.approx([15.0, 15.0])  # ms per step
    assert sent["1: host"] == ([1, 2, 3], [1000, 1000, 1000])
    # without an emulated link the device clocks are this host's: no modelled axis
    plain = RunSummary.from_dict(json.loads((_write_run(tmp_path, "plain", link=None) / "summary.json").read_text()))
    assert training.curves("plain", plain, loaded.steps, loaded.evals).modelled_s is None


def test_several_runs_share_the_curves_with_a_legend_entry_each(tmp_path):
    runs = [_write_run(tmp_path, "plain", link=None), _write_run(tmp_path, "lte", link="lte-10m")]
    summaries = [RunSummary.from_dict(json.loads((r / "summary.json").read_text())) for r in runs]
    loaded = [training.load_training(r, s) for r, s in zip(runs, summaries)]
    curves = [training.curves(r.name, s, f.steps, f.evals) for r, s, f in zip(runs, summaries, loaded)]
    fig = plots.plot_training_curves(curves)
    axes = fig.get_axes()
    assert len(axes) == 6  # loss and accuracy against step, host time and (the lte run only) modelled time
    labels = [t.get_text() for t in axes[0].get_legend().get_texts()]
    assert labels == ["plain: train loss", "plain: test loss", "lte: train loss", "lte: test loss"]
    assert [t.get_text() for t in axes[5].get_legend().get_texts()] == ["lte: test accuracy"]
    assert "MODELLED" in axes[4].get_xlabel() and "measured" in axes[2].get_xlabel()


def test_the_report_of_training_runs_has_curves_charts_and_every_parameter(tmp_path, capsys):
    runs = [_write_run(tmp_path, "plain", link=None), _write_run(tmp_path, "lte", link="lte-10m")]
    out = tmp_path / "report.html"
    assert main(["report", *map(str, runs), "-o", str(out)]) == 0
    page = out.read_text()
    assert page.count('alt="loss and accuracy curves"') == 1  # one overlay for both runs
    assert page.count('alt="time split and bytes per device"') == 2  # one per run
    assert "2 training run(s)" in page and "time on the device clocks is modelled" in page
    for shown in ("small_cnn", "94186", "1x8x8", "host x2", "16, 16", "sgd, lr 0.05, momentum 0.9, weight decay "
                  "0.0005, cosine schedule", "topk:0.01", "lte-10m (virtual)", "none (not emulated)", "cpu", ">7<"):
        assert shown in page, shown


def test_a_broken_metrics_line_is_one_error_naming_the_file_and_line(tmp_path, capsys):
    run = _write_run(tmp_path, "broken", link=None)
    with open(run / "metrics.jsonl", "a") as f:
        f.write('{"step": 3, "rank": 0}\n')
    assert main(["report", str(run), "-o", str(tmp_path / "r.html")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "metrics.jsonl line 7 lacks key 'epoch'" in err, err
    assert not (tmp_path / "r.html").exists()


def test_a_summary_without_records_still_renders_without_curves(tmp_path):
    run = tmp_path / "bare"
    run.mkdir()
    (run / "summary.json").write_text(json.dumps({"throughput_samples_per_s": 1.0, "per_device": []}))
    page = render([run])
    assert "Training curves" not in page and "time split" not in page


def test_megabytes_sent_read_the_same_in_the_report_as_in_the_terminal(tmp_path):
    """The report divided by 2**20 under an "MB" heading: 3,000,000 bytes read 2.86 there and 3.0 in the terminal."""
    run = _write_run(tmp_path, "mb", link=None)
    summary = json.loads((run / "summary.json").read_text())
    summary["per_device"][0]["bytes_sent"] = 3_000_000
    (run / "summary.json").write_text(json.dumps(summary))
    row = next(r for r in render([run]).split("<tr>") if r.startswith("<td>0</td><td>host</td>"))
    assert "<td>3</td>" in row and "2.86" not in row
