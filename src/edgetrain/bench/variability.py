"""Run-to-run variability: the coefficient of variation of step time.

The Jetson study repeated identical runs and found step times varied little
across devices (CV < 1%) but a lot across software versions: a measurement
needs its spread to be known before two numbers can be compared. This bench
repeats a short run ``R`` times, each in a fresh process, and reports

* CV *within* a run: std / mean of a device's step times (after warm-up);
* CV *across runs*: of each device's mean step time over the R runs;
* CV *across devices*: of the devices' mean step times within a run.

CVs use the sample standard deviation. With one device the runs are this
bench's own isolated step loop (``workload``); with several, the trainer
(``edgetrain train`` in its own process, ``trainer_runs``), whose
``metrics.jsonl`` gives each device's steps.
"""
from __future__ import annotations

import os
import statistics
from typing import Any

from edgetrain.arguments import non_negative_int, positive_int
from edgetrain.bench import trainer_runs, workload
from edgetrain.bench.common import print_table, save_result, start_run
from edgetrain.errors import EdgetrainError
from edgetrain.results import VariabilityResult
from edgetrain.spec import DATASET_SHAPES

# Imported inside functions: edgetrain.report.plots (matplotlib), so that bench's flags and --help answer without it.


def cv(values: list[float]) -> float | None:
    """Coefficient of variation (sample std / mean); None for fewer than two values."""
    if len(values) < 2:
        return None
    mean = statistics.fmean(values)
    return statistics.stdev(values) / mean if mean else None


def summarise(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """``runs``: ``[{"run": i, "devices": [{"rank": r, "step_s": [...]}, ...]}, ...]``; adds per-device stats."""
    for run in runs:
        for dev in run["devices"]:
            dev["mean_step_s"] = statistics.fmean(dev["step_s"])
            dev["cv_within"] = cv(dev["step_s"])
        run["cv_across_devices"] = cv([d["mean_step_s"] for d in run["devices"]])
    ranks = sorted({d["rank"] for run in runs for d in run["devices"]})
    per_device = []
    for rank in ranks:
        means = [d["mean_step_s"] for run in runs for d in run["devices"] if d["rank"] == rank]
        per_device.append({"rank": rank, "mean_step_s": statistics.fmean(means), "cv_across_runs": cv(means)})
    within = [d["cv_within"] for run in runs for d in run["devices"] if d["cv_within"] is not None]
    across_runs = [d["cv_across_runs"] for d in per_device if d["cv_across_runs"] is not None]
    across_devices = [run["cv_across_devices"] for run in runs if run["cv_across_devices"] is not None]
    return {
        "per_device": per_device,
        "cv_within_mean": statistics.fmean(within) if within else None,
        "cv_across_runs": statistics.fmean(across_runs) if across_runs else None,
        "cv_across_devices": statistics.fmean(across_devices) if across_devices else None,
    }


def run(model: str = "resnet18", dataset: str = "cifar10", *, repeats: int = 3, devices: int = 1,
        batch_size: int = 32, steps: int = 10, warmup: int = 2, threads: int | None = None,
        config: dict[str, Any] | None = None, output: str = "runs", name: str | None = None,
        train_fn: trainer_runs.TrainFn | None = None) -> VariabilityResult:
    if repeats < 2:
        raise EdgetrainError("--repeats must be at least 2 to measure variability across runs")
    if steps < 2:
        raise EdgetrainError("--steps must be at least 2 to measure variability within a run")
    run_dir = start_run(output, name, "variability")
    runs = []
    if devices == 1:
        threads = threads or os.cpu_count() or 1
        source = "isolated step loop (edgetrain.bench.workload), synthetic data in memory"
        for i in range(repeats):
            r = workload.measure_steps_isolated(model, batch_size, dataset=dataset, steps=steps,
                                                warmup=warmup, threads=threads, seed=i)
            if r["status"] != "ok":
                raise EdgetrainError(f"run {i} did not finish: {r['status']}")
            # Mean-based like the mean step time and the CV beside it in this bench's table.
            runs.append({"run": i, "samples_per_s": r["samples_per_s_mean"],
                         "devices": [{"rank": 0, "step_s": r["step_s"]}]})
    else:
        train_fn = train_fn or trainer_runs.train_in_subprocess
        source = "edgetrain train (one process per run), metrics.jsonl"
        for i in range(repeats):
            cfg = dict(config or {}, model=model, dataset=dataset, devices=devices, batch_size=batch_size * devices,
                       steps=steps + warmup, output=str(run_dir / "runs"), run_name=f"repeat-{i}", progress=False,
                       eval=False)
            trained = train_fn(cfg)
            by_rank = trainer_runs.step_times_by_rank(trainer_runs.read_metrics(trained.run_dir), skip=warmup)
            runs.append({"run": i, "samples_per_s": trained.throughput_samples_per_s,
                         "devices": [{"rank": k, "step_s": v} for k, v in by_rank.items()]})
    summary = summarise(runs)
    params = dict(model=model, dataset=dataset, repeats=repeats, devices=devices, batch_size=batch_size,
                  steps=steps, warmup=warmup, threads=threads, source=source)
    result = save_result(run_dir, VariabilityResult(params=params, runs=runs, summary=summary))
    from edgetrain.report import plots

    plots.plot_variability(result.to_dict(), run_dir / "variability.png")
    rows = [(f"run {run['run']} dev {d['rank']}", 1000 * d["mean_step_s"],
             None if d["cv_within"] is None else 100 * d["cv_within"], run["samples_per_s"])
            for run in runs for d in run["devices"]]
    pct = lambda v: "-" if v is None else f"{100 * v:.2f}%"  # noqa: E731
    print_table(f"bench variability: {model}, {repeats} runs x {devices} device(s) -> {run_dir}",
                ["run / device", "mean step ms", "CV within %", "run samples/s"], rows,
                [f"CV within a run (mean) {pct(summary['cv_within_mean'])}; across runs "
                 f"{pct(summary['cv_across_runs'])}; across devices {pct(summary['cv_across_devices'])}"])
    return result


def add_parser(sub) -> None:
    p = sub.add_parser("variability", help="coefficient of variation of step time, per device and across")
    p.add_argument("--model", default="resnet18")
    p.add_argument("--dataset", default="cifar10", choices=sorted(DATASET_SHAPES))
    p.add_argument("--repeats", type=positive_int, default=3)
    p.add_argument("--devices", type=positive_int, default=1, help="more than 1 runs the trainer on emulated devices")
    p.add_argument("--batch-size", type=positive_int, default=32, help="per device")
    p.add_argument("--steps", type=positive_int, default=10, help="timed steps per run")
    p.add_argument("--warmup", type=non_negative_int, default=2)
    p.add_argument("--threads", type=positive_int, default=None)
    p.set_defaults(bench_func=lambda a: run(
        a.model, a.dataset, repeats=a.repeats, devices=a.devices, batch_size=a.batch_size, steps=a.steps,
        warmup=a.warmup, threads=a.threads, output=a.output, name=a.name))
