"""The report plots each run's own metrics (names, units from its task record) and overlays runs of one task."""
import json
from pathlib import Path

from edgetrain.cli import main
from edgetrain.records import EvalRecord, MetricRecord, RunSummary, StepRecord, TaskRecord
from edgetrain.report import plots, training

REGRESSION = TaskRecord("regression", "rmse", [MetricRecord("rmse", "mmol/L", False, "RMSE"),
                                               MetricRecord("mae", "mmol/L", False, "MAE")], "squared error")


def _run(root: Path, name: str, task: TaskRecord | None, metrics: list[dict]) -> Path:
    run = root / name
    run.mkdir()
    steps = [StepRecord(step=s, epoch=0, rank=0, loss=1.0 / (s + 1), samples=8, samples_per_s=800.0, step_s=0.01,
                        data_s=0.001, compute_s=0.008, comm_s=0.001, comm_busy_s=None, bytes_sent=0, bytes_recv=0,
                        cpu_s=0.01, lr=0.05, peak_rss_mb=300.0) for s in range(3)]
    evals = [EvalRecord(epoch=i, step=i + 2, test_loss=0.5 / (i + 1), metrics=m,
                        test_accuracy=m.get("accuracy") if task is None else None) for i, m in enumerate(metrics)]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r.to_dict()) + "\n" for r in steps))
    summary = {"run_dir": str(run), "steps": 3, "throughput_samples_per_s": 800.0, "evals": [e.to_dict() for e in evals],
               "per_device": [{"rank": 0, "profile": "host", "local_batch": 8, "samples_per_s": 800.0}],
               "test_accuracy": evals[-1].test_accuracy, "test_metrics": metrics[-1]}
    if task is not None:
        summary["task"] = task.to_dict()
    (run / "summary.json").write_text(json.dumps(summary))
    return run


def _curves(run: Path):
    summary = RunSummary.from_dict(json.loads((run / "summary.json").read_text()))
    loaded = training.load_training(run, summary)
    return training.curves(run.name, summary, loaded.steps, loaded.evals)


def test_a_regression_run_plots_its_own_metrics_with_their_names_and_units(tmp_path):
    runs = [_run(tmp_path, "a", REGRESSION, [{"rmse": 60.0, "mae": 50.0}, {"rmse": 55.0, "mae": 45.0}]),
            _run(tmp_path, "b", REGRESSION, [{"rmse": 58.0, "mae": 47.0}, {"rmse": 54.0, "mae": 44.0}])]
    curves = [_curves(r) for r in runs]
    assert curves[0].eval_metrics == {"rmse": [60.0, 55.0], "mae": [50.0, 45.0]}
    axes = plots.plot_training_curves(curves).get_axes()
    assert len(axes) == 6  # loss, RMSE, MAE against step and host time
    assert axes[0].get_ylabel() == "loss (squared error)"
    assert axes[1].get_ylabel() == "test RMSE (mmol/L)" and axes[2].get_ylabel() == "test MAE (mmol/L)"
    assert axes[1].get_title() == "Test RMSE vs step"
    assert [t.get_text() for t in axes[1].get_legend().get_texts()] == ["a: test RMSE", "b: test RMSE"]  # overlaid
    assert list(axes[1].get_lines()[0].get_ydata()) == [60.0, 55.0]  # in the unit, not scaled


def test_runs_of_several_tasks_get_a_figure_each_and_a_classifier_keeps_its_accuracy(tmp_path):
    runs = [_run(tmp_path, "reg", REGRESSION, [{"rmse": 60.0, "mae": 50.0}]),
            _run(tmp_path, "cls", None, [{"accuracy": 0.5}, {"accuracy": 0.75}])]
    assert _curves(runs[1]).eval_metrics == {"accuracy": [0.5, 0.75]}  # a run before tasks: a classifier
    out = tmp_path / "report.html"
    assert main(["report", *map(str, runs), "-o", str(out)]) == 0
    page = out.read_text()
    assert 'alt="loss and RMSE and MAE curves (regression)"' in page
    assert 'alt="loss and accuracy curves (classification)"' in page
    assert "test RMSE 60 mmol/L" in page and "test accuracy 75" in page
    summary = RunSummary.from_dict(json.loads((runs[0] / "summary.json").read_text()))
    assert training.parameters(summary, {})["task"] == "regression"
