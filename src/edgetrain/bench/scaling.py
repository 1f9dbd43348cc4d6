"""Speedup and efficiency versus the number of devices, with the split of a step.

The Raspberry Pi study measured 15.5 GFLOPS LINPACK on one board and 47 on
four, and training that scaled far worse than that: every step waits for the
gradient all-reduce over a slow link and for the slowest board. This bench
runs the real trainer on 1, 2, 4, ... devices and reports

* speedup ``S_N = throughput_N / throughput_1`` and efficiency ``S_N / N``;
* where a step's time goes, averaged over devices: data loading, compute,
  communication (the transfer) and waiting for the slowest device (see
  ``trainer_runs.split_per_step``).

*Weak* scaling (default) keeps the per-device batch fixed, so the global batch
grows with N, as data-parallel training on more boards usually does; *strong*
scaling keeps the global batch fixed and splits it. Emulated devices share
this host's cores, so their speedup is bounded by the cores there are.

Throughput is global samples per step over the median cluster step (the
slowest device's, ``trainer_runs.cluster_timing``), so a few stalled steps of
a short run do not make the baseline slow and the speedup huge. A row whose
step times spread more than ``common.NOISY_SPREAD`` (IQR / median) is flagged
``noisy``; every row is flagged when the one-device baseline is, as all
speedups are divided by it; and an efficiency above 100% (more than N times
one device, which N devices sharing one host cannot do) is flagged
``superlinear``. Flags are in each row's ``flags`` and marked ``!`` in the table.
"""
from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

from edgetrain.arguments import non_negative_int, positive_int
from edgetrain.bench import trainer_runs
from edgetrain.bench.common import print_table, save_result, spread_cell, start_run
from edgetrain.bench.peak import _ints
from edgetrain.config import load_run
from edgetrain.errors import EdgetrainError
from edgetrain.records import RunSummary, StepRecord
from edgetrain.report.cells import efficiency_cell, flag_notes
from edgetrain.results import ScalingResult
from edgetrain.yamlfile import read_yaml_mapping

# Imported inside functions: edgetrain.report.plots (matplotlib), so that bench's flags and --help answer without it.


def scaling_rows(metrics: dict[int, list[StepRecord]],
                 summaries: dict[int, RunSummary] | None = None) -> list[dict[str, Any]]:
    """One row per device count from each run's metrics.jsonl records, ``speedup = throughput_N / throughput_1``."""
    summaries = summaries or {}
    timings = {n: trainer_runs.cluster_timing(records) for n, records in metrics.items()}
    base = timings[1]
    rows = []
    for n in sorted(metrics):
        timing = timings[n]
        speedup = timing["samples_per_s"] / base["samples_per_s"]
        flags = [f for f, on in (("noisy", timing["noisy"]), ("noisy baseline", n != 1 and base["noisy"]),
                                 ("superlinear", speedup / n > 1)) if on]
        summary = summaries.get(n)
        rows.append({"devices": n, "throughput_samples_per_s": timing["samples_per_s"],
                     "step_s_median": timing["step_s_median"], "spread": timing["spread"], "noisy": timing["noisy"],
                     "speedup": speedup, "efficiency": speedup / n, "flags": flags,
                     "split_s_per_step": trainer_runs.split_per_step(metrics[n]),
                     "bytes_sent_per_device": _mean([d.bytes_sent for d in summary.per_device] if summary else []),
                     "run_dir": summary and summary.run_dir})
    return rows


def _mean(values: list) -> float | None:
    values = [v for v in values if v is not None]
    return sum(values) / len(values) if values else None


def run(config: dict[str, Any], devices: list[int], *, mode: str = "weak", output: str = "runs",
        name: str | None = None, train_fn: trainer_runs.TrainFn | None = None) -> ScalingResult:
    if mode not in ("weak", "strong"):
        raise EdgetrainError(f"--mode must be weak or strong, got {mode!r}")
    if not devices or min(devices) < 1 or 1 not in devices:
        raise EdgetrainError(f"--devices needs positive device counts including 1 (the baseline), e.g. 1,2,4; "
                             f"got {devices}")
    run_dir = start_run(output, name, "scaling")
    summaries, metrics = _train_each(config, sorted(set(devices)), mode, run_dir,
                                     train_fn or trainer_runs.train_in_subprocess)
    rows = scaling_rows(metrics, summaries)
    params = dict(config, devices=sorted(set(devices)), mode=mode,
                  batch_size_note="per device" if mode == "weak" else "global")
    result = save_result(run_dir, ScalingResult(params=params, rows=rows))
    from edgetrain.report import plots

    plots.plot_scaling(result.to_dict(), run_dir / "scaling.png")
    print_table(f"bench scaling ({mode}): {config.get('model')} -> {run_dir}",
                ["devices", "samples/s", "median step ms", "spread", "speedup", "efficiency", "data ms", "compute ms",
                 "comm ms", "wait ms"],
                [(r["devices"], r["throughput_samples_per_s"], 1000 * r["step_s_median"],
                  spread_cell(r["spread"], r["noisy"]), r["speedup"],
                  efficiency_cell(r), *(1000 * r["split_s_per_step"][k] for k in ("data", "compute", "comm", "wait")))
                 for r in rows],
                ["samples/s = global batch / median step (the slowest device's step, after the first); split = "
                 "mean ms per step over devices; comm = the transfer (the least blocked device's comm time), wait = "
                 "the rest of a device's comm time, spent waiting for peers",
                 "emulated devices share this host's cores: speedup is bounded by the cores there are",
                 *flag_notes(rows)])
    return result


def _train_each(config: dict[str, Any], devices: list[int], mode: str, run_dir: Path, train_fn: trainer_runs.TrainFn
                ) -> tuple[dict[int, RunSummary], dict[int, list[StepRecord]]]:
    """One training run per device count, each the trainer's own process. The trainer checks the model and
    the data before it starts (train/preflight.py): a config it refuses before any run finished leaves no
    bench run directory behind either."""
    local_batch = int(config.get("batch_size", 32))
    summaries, metrics = {}, {}
    for n in devices:
        cfg = dict(config, devices=n, output=str(run_dir / "runs"), run_name=f"devices-{n}", progress=False,
                   eval=False, batch_size=local_batch * n if mode == "weak" else local_batch)
        try:
            summaries[n] = train_fn(cfg)
        except EdgetrainError:
            if not summaries:
                shutil.rmtree(run_dir, ignore_errors=True)
            raise
        metrics[n] = trainer_runs.read_metrics(summaries[n].run_dir)
    return summaries, metrics


def add_parser(sub) -> None:
    p = sub.add_parser("scaling", help="speedup and efficiency versus number of devices (runs the trainer)")
    p.add_argument("--config", default=None, help="training config YAML to start from")
    p.add_argument("--devices", type=_ints, default=[1, 2, 4], metavar="N,N,...")
    p.add_argument("--mode", default="weak", choices=["weak", "strong"])
    p.add_argument("--model", default=None)
    p.add_argument("--dataset", default=None)
    p.add_argument("--data-dir", default=None)
    p.add_argument("--profile", default=None)
    p.add_argument("--batch-size", type=positive_int, default=None, help="per device (weak) or global (strong)")
    p.add_argument("--steps", type=positive_int, default=None, help="training steps per run (default 20)")
    p.add_argument("--workers", type=non_negative_int, default=None, help="loader workers per device")
    p.add_argument("--threads", type=positive_int, default=None,
                   help="torch threads per device (default: the cores each device gets; 1 keeps the work per "
                        "device the same at every count)")
    p.add_argument("--no-throttle", dest="throttle", action="store_false", default=None,
                   help="devices run at host speed whatever their profile")
    p.set_defaults(bench_func=lambda a: run(_config(a), a.devices, mode=a.mode, output=a.output, name=a.name))


def _config(a) -> dict[str, Any]:
    config = read_yaml_mapping(a.config, "--config") if a.config else {}
    config.setdefault("model", "small_cnn")
    config.setdefault("dataset", "synthetic")
    config.setdefault("steps", 20)
    for key in ("model", "dataset", "data_dir", "profile", "batch_size", "steps", "workers", "throttle", "threads"):
        value = getattr(a, key)
        if value is not None:
            config[key] = value
    # Every key and value checked before the bench makes its run directory (the model and the data: the trainer).
    load_run(config, output=a.output)
    return config
