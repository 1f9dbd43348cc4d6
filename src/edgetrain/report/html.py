"""One self-contained HTML page for one run or a comparison of runs.

Design: docs/design/report.md ("The HTML report").
"""
from __future__ import annotations

import datetime as _dt
import html
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from edgetrain.errors import EdgetrainError
from edgetrain.files import remove_stale_temps
from edgetrain.records import RunSummary, modelled_throughput
from edgetrain.report import training
from edgetrain.report.fleet import ROUNDS_FILE, FleetRounds, fleet_section, load_fleet
from edgetrain.report.cells import (ABOVE_PEAK_NOTE, NOISY_NOTE, ROUNDS_COLUMN, ROUNDS_NOTE, efficiency_cell,
                                    energy_cells, energy_note, flag_notes, img, kv, percent_of_peak,
                                    round_cells, spread_cell, table)
from edgetrain.report.plan_page import plan_section
from edgetrain.report.tables import clipped_note, stall_lines
from edgetrain.results import (BatchResult, BenchResult, CountersResult, PeakResult, PlanResult, PowerResult,
                               ScalingResult, StallsResult, VariabilityResult)

# Imported inside functions: edgetrain.report.plots (matplotlib), which only drawing a figure needs.

AXES = [  # (key, label, unit, higher is better)
    ("throughput", "throughput", "samples/s", True),
    ("memory", "memory", "MB peak RSS", False),
    ("energy", "energy", "J/epoch", False),
    ("communication", "communication", "% of step", False),
    ("accuracy", "accuracy", "% test", True),
]

CSS = """
body{font-family:-apple-system,"Segoe UI",Roboto,"DejaVu Sans",sans-serif;margin:0;background:#f4f5f7;color:#1d2330}
header{background:#1f3a5f;color:#fff;padding:18px 32px}
header h1{margin:0;font-size:24px} header p{margin:4px 0 0;opacity:.85;font-size:13px}
main{max-width:1120px;margin:0 auto;padding:20px 24px 40px}
section{background:#fff;border-radius:8px;box-shadow:0 1px 3px rgba(0,0,0,.12);padding:18px 22px;margin:18px 0}
h2{margin:0 0 4px;font-size:19px} h3{font-size:15px;margin:16px 0 6px;color:#34405a}
.meta{color:#5b6475;font-size:12px;margin-bottom:10px}
table{border-collapse:collapse;font-size:13px;margin:6px 0 10px}
th,td{padding:4px 10px;border-bottom:1px solid #e3e6eb;text-align:right}
th{background:#eef1f5;font-weight:600} td:first-child,th:first-child{text-align:left}
table.kv td:first-child{color:#5b6475}
.imgs img{max-width:100%;display:block;margin:10px auto;border:1px solid #e3e6eb;border-radius:4px}
.note{background:#fff7e0;border-left:3px solid #e0a800;padding:6px 10px;margin:6px 0;font-size:13px}
.flex{display:flex;gap:18px;flex-wrap:wrap;align-items:flex-start} .flex>*{flex:1 1 420px}
.modelled{color:#b35c00;font-weight:600}
"""

# Marks images that failed to decode, so a headless browser's DOM dump can be checked.
CHECK_SCRIPT = """
window.addEventListener('load',function(){var bad=0;document.querySelectorAll('img').forEach(function(i){
var ok=i.complete&&i.naturalWidth>0;i.setAttribute('data-loaded',ok?'yes':'no');if(!ok)bad++;});
document.body.setAttribute('data-broken-images',String(bad));});
"""


RUN_FILES = (("result.json", BenchResult), ("summary.json", RunSummary),
             ("plan.json", PlanResult))  # what each kind of run directory holds, and its schema


@dataclass(frozen=True)
class Run:
    """One run directory, read: its typed result (a bench's, a training run's or a plan) and its images;
    a training run also its step records, evaluations and config."""
    dir: Path
    data: BenchResult | RunSummary | PlanResult | FleetRounds
    pngs: tuple[Path, ...] = ()
    training: training.TrainingFiles | None = None


def load_run(run_dir: str | Path) -> Run:
    d = Path(run_dir)
    for name, schema in RUN_FILES:
        path = d / name
        if path.is_file():
            try:
                data = json.loads(path.read_text(encoding="utf-8"))
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                raise EdgetrainError(f"{path} is not valid JSON ({e}); was the run interrupted?") from None
            result = schema.from_dict(data, str(path))
            files = training.load_training(d, result) if isinstance(result, RunSummary) else None  # checked here too
            return Run(d, result, tuple(sorted(d.glob("*.png"))), files)
    if (d / ROUNDS_FILE).is_file():
        return Run(d, load_fleet(d))
    if (d / "config.yaml").is_file():
        removed = remove_stale_temps(d)
        note = f"; removed {len(removed)} partial file(s) it left" if removed else ""
        raise EdgetrainError(f"{run_dir} is an incomplete run: config.yaml but no summary.json, so the run was stopped "
                             f"before it ended{note}; rerun it to get a report")
    raise EdgetrainError(f"{run_dir} is not an edgetrain run directory (no result.json, summary.json, plan.json or "
                         f"{ROUNDS_FILE})")


# ---- what each kind of run shows ----

def peak_reference(runs: list[Run]) -> tuple[float, str] | None:
    """The best GEMM GFLOPS among the ``bench peak`` runs shown (all devices at once where measured)."""
    best: tuple[float, str] | None = None
    for run in runs:
        d = run.data
        if not isinstance(d, PeakResult):
            continue
        for a in d.aggregate:
            if a["kind"] == "gemm" and (best is None or a["gflops_median_sum"] > best[0]):
                best = (a["gflops_median_sum"], f"GEMM n={a['n']}, {a['devices']} devices at once ({run.dir.name})")
        if not d.aggregate:
            for r in d.rows:
                if r["kind"] == "gemm" and (best is None or r["gflops_best"] > best[0]):
                    best = (r["gflops_best"], f"GEMM n={r['n']}, {r['threads']} thread(s) ({run.dir.name})")
    return best


def achieved_note(d: RunSummary, peak: tuple[float, str] | None) -> str | None:
    """Achieved GFLOPS of a training run: the FLOPs per sample it counted (its own model, at its own input
    shape) x its throughput, against its devices' profile ratings or else the host ``peak`` shown."""
    counted = d.flops_per_sample
    if not counted or not d.throughput_samples_per_s:
        return None  # a summary without its own count: recounting a guessed model and shape would be wrong
    per_sample = counted["total_flops"]
    gflops = per_sample * d.throughput_samples_per_s / 1e9
    shape = "x".join(str(v) for v in counted.get("input_shape", []))
    text = (f"achieved {gflops:.2f} GFLOPS ({per_sample / 1e9:.3f} GFLOP per training sample of {d.model} "
            f"at {shape}, FlopCounterMode)")
    rated = [p.details["peak_gflops"] for p in d.per_device if p.details.get("peak_gflops")]
    if d.per_device and len(rated) == len(d.per_device):
        text += (f" = {percent_of_peak(gflops / sum(rated))} of the {sum(rated):.1f} GFLOPS its devices are rated "
                 f"at (modelled: each device against its own profile's peak, see the table)")
    elif peak and not rated:
        text += f" = {percent_of_peak(gflops / peak[0])} of the {peak[0]:.1f} GFLOPS peak ({peak[1]})"
    return text


def headline(d: RunSummary | BenchResult, peak: tuple[float, str] | None = None
             ) -> tuple[list[str], list[list[Any]], list[str]]:
    """(columns, rows, notes) summarising a run's result; ``peak`` is what training runs' GFLOPS are set against."""
    if isinstance(d, RunSummary):
        cols = ["rank", "profile", "local batch", "samples/s", "GFLOPS", "rated GFLOPS", "% of rated", "peak RSS MB",
                "data s", "compute s", "comm s", "MB sent", "MB recv"]
        per_device = d.per_device
        rows = [[p.rank, p.profile, p.local_batch, p.samples_per_s,
                 p.details.get("achieved_gflops"), p.details.get("peak_gflops"),
                 percent_of_peak(p.details.get("fraction_of_peak")),
                 p.peak_rss_mb, p.data_s, p.compute_s, p.comm_s, _mb(p.bytes_sent), _mb(p.bytes_recv)]
                for p in per_device]
        notes = [f"throughput {d.throughput_samples_per_s:.1f} samples/s; {_headline(d)}"]
        if any(p.energy is not None for p in per_device):  # joules per sample, measured or modelled (the note)
            cols += ["J/sample", "avg W"]
            rows = [row + energy_cells(p.energy) for row, p in zip(rows, per_device)]
            notes.append(energy_note(per_device))
        rounds = round_cells(d.details)
        if rounds:
            cols.append(ROUNDS_COLUMN)
            rows = [row + [rounds[p.rank]] for row, p in zip(rows, per_device)]
            notes.append(ROUNDS_NOTE)
        modelled = modelled_throughput(d)
        if modelled:
            notes.append(f"modelled on {d.details['link']} (virtual clock: this host's compute + modelled link "
                         f"time): step {modelled['step_s']:,.3f} s, throughput {modelled['samples_per_s']:,.1f} "
                         f"samples/s, communication+waiting {modelled['comm_fraction']:.0%} of the step; "
                         f"the other figures are this host's")
        notes += [clipped_note(d.clipped_boxes)] if d.clipped_boxes else []
        notes += [d.privacy.describe()] if d.privacy is not None else []
        notes += stall_lines(d)  # each device's data stall and DS-Analyzer's what-ifs (modelled)
        achieved = achieved_note(d, peak)
        notes += [achieved] if achieved else []
        notes += sorted({f"rated GFLOPS of {p.profile}: {p.details['peak_source']}" for p in per_device
                         if p.details.get("peak_source")})
        notes += [ABOVE_PEAK_NOTE] if any(p.details.get("above_peak") for p in per_device) else []
        return cols, rows, notes
    notes = list(d.notes)
    cols, rows = BENCH_HEADLINES[type(d)](d, notes)
    return cols, rows, notes


def _peak_rows(d: PeakResult, notes: list[str]) -> tuple[list[str], list[list[Any]]]:
    cols = ["kind", "n", "threads", "GFLOPS best", "GFLOPS median", "scaled residual"]
    rows = [[r["kind"], r["n"], r["threads"], r["gflops_best"], r["gflops_median"],
             r.get("max_scaled_residual")] for r in d.rows]
    notes += [f"{a['devices']} devices at once, {a['kind']} n={a['n']}: {a['gflops_median_sum']:.1f} GFLOPS"
              for a in d.aggregate]
    return cols, rows


def _batch_rows(d: BatchResult, notes: list[str]) -> tuple[list[str], list[list[Any]]]:
    cols = ["batch", "status", "samples/s", "median step s", "spread", "peak RSS MB", "GFLOPS", "peak GFLOPS",
            "% of peak"]
    rows = [[r["batch_size"], r["status"], r.get("samples_per_s"), r.get("step_s_median"),
             spread_cell(r.get("spread"), r.get("noisy", False)), r.get("peak_rss_mb") or r.get("rss_mb"),
             r.get("achieved_gflops"), r.get("peak_gflops_median"), percent_of_peak(r.get("fraction_of_peak"))]
            for r in d.rows]
    notes += [ABOVE_PEAK_NOTE] if any(r.get("above_peak") for r in d.rows) else []
    notes += [NOISY_NOTE] if any(r.get("noisy") for r in d.rows) else []
    notes.append(f"best batch {d.best}; largest that fits {d.largest_fitting_batch}; memory limit "
                 f"{d.profile['memory_limit_mb']:.0f} MB ({d.profile['limit_source']}); "
                 f"{d.flops_per_sample['total_flops'] / 1e9:.3f} GFLOP per training sample; peak: "
                 f"{d.peak_source}")
    return cols, rows


def _scaling_rows(d: ScalingResult, notes: list[str]) -> tuple[list[str], list[list[Any]]]:
    cols = ["devices", "samples/s", "speedup", "efficiency", "data ms", "compute ms", "comm ms", "wait ms"]
    rows = [[r["devices"], r["throughput_samples_per_s"], r["speedup"],
             efficiency_cell(r) if "flags" in r else _pct(r["efficiency"]),
             *(1000 * r["split_s_per_step"][k] for k in ("data", "compute", "comm", "wait"))] for r in d.rows]
    notes += flag_notes(d.rows) if all("flags" in r for r in d.rows) else []
    return cols, rows


def _stalls_rows(d: StallsResult, notes: list[str]) -> tuple[list[str], list[list[Any]]]:
    if d.rows and "storage" in d.rows[0]:  # workers x storage x page cache, on training's loader
        cols = ["storage", "workers", "page cache", "train/s", "stall %", "read ms/batch", "decode ms/batch",
                "limiting"]
        rows = [[r["storage"] + ("" if r["throttled"] else " (unthrottled)"), r["workers"], r["cache"],
                 r["train_samples_per_s"], 100 * r["stall_fraction"], r["read_ms_per_batch"],
                 r["decode_ms_per_batch"], r["limiting_stage"]] for r in d.rows]
    else:  # a result of the bench's earlier CIFAR reader
        cols = ["workers", "loader cached/s", "loader cold/s", "train cached/s", "train cold/s", "prep stall s",
                "fetch stall s", "limiting"]
        rows = [[r["workers"], r["prep_samples_per_s"], r["fetch_samples_per_s"], r["train_cached_samples_per_s"],
                 r["train_cold_samples_per_s"], r["prep_stall_s"], r["fetch_stall_s"], r["limiting_stage"]]
                for r in d.rows]
    notes += [f"ingestion rate (no stall) {d.ingestion_samples_per_s:.1f} samples/s", d.verdict]
    return cols, rows


def _counters_rows(d: CountersResult, notes: list[str]) -> tuple[list[str], list[list[Any]]]:
    cols = ["event", "count", "per sample"]
    rows = [[k, v, d.per_sample.get(k)] for k, v in d.counts.items()]
    rows += [[k, v, None] for k, v in d.ratios.items()]
    notes += [d.message] if d.message else []
    return cols, rows


def _power_rows(d: PowerResult, notes: list[str]) -> tuple[list[str], list[list[Any]]]:
    m = " (modelled)" if d.energy_source["modelled"] else ""
    cols = ["setting", "samples/s", "s/epoch", f"J/epoch{m}", f"avg W{m}", "Pareto"]
    front = {r["setting"] for r in d.pareto}
    rows = [[r["setting"], r["samples_per_s"], r["epoch_s"], r["energy_j_per_epoch"], r["avg_power_w"],
             r["setting"] in front] for r in d.rows]
    notes.insert(0, f"energy source: {d.energy_source['kind']}")
    return cols, rows


def _variability_rows(d: VariabilityResult, notes: list[str]) -> tuple[list[str], list[list[Any]]]:
    cols = ["run", "device", "mean step ms", "CV within"]
    rows = [[run_["run"], dev["rank"], 1000 * dev["mean_step_s"], _pct(dev["cv_within"])]
            for run_ in d.runs for dev in run_["devices"]]
    s = d.summary
    notes.append(f"CV within a run {_pct(s['cv_within_mean'])}, across runs {_pct(s['cv_across_runs'])}, "
                 f"across devices {_pct(s['cv_across_devices'])}")
    return cols, rows


# Each bench result's table, by its result type (results.BENCH_RESULTS); a type without one here is a KeyError,
# which tests/report/test_html.py checks for every registered type.
BENCH_HEADLINES = {PeakResult: _peak_rows, BatchResult: _batch_rows, ScalingResult: _scaling_rows,
                   StallsResult: _stalls_rows, CountersResult: _counters_rows, PowerResult: _power_rows,
                   VariabilityResult: _variability_rows}


def _headline(d) -> str:
    """A training run's headline result: a classifier's test accuracy, else its task's headline metric, by the
    names and unit its task record gives."""
    headline = d.task.headline_metric if d.task else None
    if headline is None or d.test_accuracy is not None:
        return f"test accuracy {_pct(d.test_accuracy)}"
    value = (d.test_metrics or {}).get(headline.name)
    return f"test {headline.label or headline.name} " + (headline.format(value) if value is not None else "n/a")


Configurations = list[tuple[str, dict[str, float | None]]]


def configurations(run: Run) -> Configurations:
    """The configurations a run measured, each with whichever radar metrics it has."""
    return RADAR_CONFIGURATIONS[type(run.data)](run.data, run.dir.name)


def _train_configurations(d: RunSummary, name: str) -> Configurations:
    per = d.per_device
    comm = [p.comm_s / t for p in per
            if (t := (p.data_s or 0) + (p.compute_s or 0) + (p.comm_s or 0)) and p.comm_s is not None]
    return [(name, {"throughput": d.throughput_samples_per_s,
                    "memory": max((p.peak_rss_mb for p in per if p.peak_rss_mb), default=None),
                    "energy": d.energy_j_per_epoch,
                    "communication": 100 * sum(comm) / len(comm) if comm else None,
                    "accuracy": None if d.test_accuracy is None else 100 * d.test_accuracy})]


def _batch_configurations(d: BatchResult, name: str) -> Configurations:
    return [(f"{name} b={r['batch_size']}", {"throughput": r["samples_per_s"], "memory": r["peak_rss_mb"]})
            for r in d.rows if r["status"] == "ok"]


def _power_configurations(d: PowerResult, name: str) -> Configurations:
    return [(f"{name} {r['setting']}", {"throughput": r["samples_per_s"], "energy": r["energy_j_per_epoch"]})
            for r in d.rows]


def _scaling_configurations(d: ScalingResult, name: str) -> Configurations:
    return [(f"{name} N={r['devices']}", {
        "throughput": r["throughput_samples_per_s"],
        "communication": 100 * r["split_s_per_step"]["comm"] / r["split_s_per_step"]["step"]
        if r["split_s_per_step"].get("step") else None}) for r in d.rows]


def _not_compared(d: Any, name: str) -> Configurations:
    return []  # a plan is modelled, not measured; these benches measure no radar axis as a configuration


# What each kind of result puts on the radar, by its type; one missing here is a KeyError, which
# tests/report/test_html.py checks for every registered bench result.
RADAR_CONFIGURATIONS = {RunSummary: _train_configurations, PlanResult: _not_compared,
                        BatchResult: _batch_configurations, PowerResult: _power_configurations,
                        ScalingResult: _scaling_configurations, PeakResult: _not_compared,
                        StallsResult: _not_compared, CountersResult: _not_compared, VariabilityResult: _not_compared}


def best_configuration(configs: list[tuple[str, dict]]) -> tuple[str, dict]:
    return max(configs, key=lambda c: c[1].get("throughput") or 0.0)


def radar_scores(configs: list[tuple[str, dict]], axes=AXES) -> list[tuple[str, list[float | None]]]:
    """Each metric scored against the best configuration: 1 is best, ``None`` where missing."""
    out = []
    for name, m in configs:
        scores: list[float | None] = []
        for key, _, _, higher in axes:
            values = [c[1].get(key) for c in configs if c[1].get(key) is not None and c[1].get(key) > 0]
            v = m.get(key)
            if v is None or v <= 0 or not values:
                scores.append(None)
            else:
                scores.append(v / max(values) if higher else min(values) / v)
        out.append((name, scores))
    return out


def comparison(runs: list[Run], max_configs: int = 8) -> str:
    if len(runs) == 1:
        configs = configurations(runs[0])
    else:
        configs = [best_configuration(c) for c in map(configurations, runs) if c]
    configs = configs[:max_configs]
    if len(configs) < 2:
        return ""
    cols = ["configuration"] + [f"{label} ({unit})" for _, label, unit, _ in AXES]
    rows = [[name] + [m.get(key) if m.get(key) is not None else "n/a" for key, _, _, _ in AXES]
            for name, m in configs]
    shared = shared_axes(configs)
    if len(shared) < 3:
        # A radar of one or two axes, or of axes most runs lack, draws a shape the data do not have.
        return (f'<section><h2>Comparison</h2><div class="meta">{len(configs)} configurations; no radar chart: '
                f'they share {len(shared)} measured axis/axes ({", ".join(shared) or "none"}), and a radar needs '
                f'at least 3</div><div>{table(cols, rows)}</div></section>')
    from edgetrain.report import plots

    axes = [axis for axis in AXES if axis[0] in shared]
    scores = radar_scores(configs, axes)
    fig = plots.radar([f"{label}\n({'higher' if hi else 'lower'} is better)" for _, label, _, hi in axes], scores,
                      "Configurations compared (1 = best shown)")
    return (f'<section><h2>Comparison</h2><div class="meta">{len(configs)} configurations; the radar shows the '
            f'{len(axes)} axes every one of them measured, each scored against the best configuration shown</div>'
            f'<div class="flex"><div class="imgs">{img(plots.png_bytes(fig), "radar chart")}</div>'
            f'<div>{table(cols, rows)}</div></div></section>')


def shared_axes(configs: list[tuple[str, dict]]) -> list[str]:
    """The radar axes on which every configuration has a measured (positive) value."""
    return [key for key, _, _, _ in AXES if all((m.get(key) or 0) > 0 for _, m in configs)]


def training_curves(runs: list[Run]) -> str:
    """Loss and the task's metrics of every training run shown (a classifier's: accuracy), one figure per task
    with that task's runs overlaid on shared axes (``report.training``)."""
    curves = [training.curves(r.dir.name, r.data, r.training.steps, r.training.evals) for r in runs if r.training]
    curves = [c for c in curves if c.steps or c.eval_steps]
    if not curves:
        return ""
    from edgetrain.report import plots

    by_task: dict[str, list] = {}
    for c in curves:
        by_task.setdefault(c.task.name, []).append(c)
    modelled = any(c.modelled_s for c in curves)
    images = []
    for name, group in by_task.items():
        labels = " and ".join((m.label or m.name) for m in group[0].task.metrics)
        alt = f"loss and {labels} curves" + (f" ({name})" if len(by_task) > 1 else "")
        images.append(img(plots.png_bytes(plots.plot_training_curves(group)), alt))
    metrics = "accuracy" if set(by_task) == {"classification"} else "each task's metrics"
    meta = (f"{len(curves)} training run(s); train loss: mean over the devices at each step, thin, with a running "
            f"mean; test loss and {metrics} at each evaluation; host time is measured (sum of the slowest device's "
            f"step times)" + ("; time on the device clocks is modelled (this host's compute plus the link model)"
                              if modelled else "") + ("; one figure per task" if len(by_task) > 1 else ""))
    return (f'<section><h2>Training curves</h2><div class="meta">{html.escape(meta)}</div><div class="imgs">'
            f'{"".join(images)}</div></section>')


def run_section(run: Run, peak: tuple[float, str] | None = None) -> str:
    d = run.data
    if isinstance(d, PlanResult):
        return plan_section(d, run.dir, run.pngs)
    if isinstance(d, RunSummary):
        title, env = "training run", {}
        params = training.parameters(d, run.training.config if run.training else {})
    else:
        title, env, params = f"bench {d.name}", d.environment, d.params
    meta = " · ".join(str(v) for v in (run.dir, env.get("cpu"), env.get("logical_cpus") and
                                         f"{env['logical_cpus']} CPUs", env.get("torch"), env.get("created")) if v)
    cols, rows, notes = headline(d, peak)
    parts = [f"<section><h2>{html.escape(title)}</h2><div class='meta'>{html.escape(meta)}</div>"]
    for n in notes:
        cls = " modelled" if "modelled" in n.lower() else ""
        parts.append(f'<div class="note{cls}">{html.escape(n)}</div>')
    parts.append('<div class="flex"><div>')
    if rows:
        parts.append("<h3>Results</h3>" + table(cols, rows))
    parts.append("</div><div><h3>Parameters</h3>" + kv(params or {}) + "</div></div>")
    if run.pngs:
        parts.append('<div class="imgs">' + "".join(img(p.read_bytes(), p.name) for p in run.pngs) + "</div>")
    split = training.device_split(d, run.training.steps) if run.training else None
    if split:
        from edgetrain.report import plots

        parts.append('<div class="imgs">' + img(plots.png_bytes(plots.plot_device_split(*split)),
                                                 "time split and bytes per device") + "</div>")
    parts.append("</section>")
    return "".join(parts)


def render(run_dirs: list[str | Path]) -> str:
    if not run_dirs:
        raise EdgetrainError("give at least one run directory")
    runs = [load_run(d) for d in run_dirs]
    when = _dt.datetime.now().strftime("%Y-%m-%d %H:%M")
    peak = peak_reference(runs)
    fleets = [(r.dir.name, r.data) for r in runs if isinstance(r.data, FleetRounds)]  # a section of their own
    others = [r for r in runs if not isinstance(r.data, FleetRounds)]
    body = (comparison(others) + training_curves(others) + fleet_section(fleets)
            + "".join(run_section(r, peak) for r in others))
    return (f"<!DOCTYPE html><html lang='en'><head><meta charset='utf-8'><title>edgetrain report</title>"
            f"<meta name='viewport' content='width=device-width,initial-scale=1'><style>{CSS}</style></head>"
            f"<body><header><h1>edgetrain report</h1><p>{len(runs)} run(s) · generated {when}</p></header>"
            f"<main>{body}</main><script>{CHECK_SCRIPT}</script></body></html>")


def _mb(b: float | None) -> float | None:
    """Bytes in MB (10^6), as the terminal's table and the charts count them."""
    return None if b is None else b / 1e6


def _pct(v: float | None) -> str:
    return "-" if v is None else f"{100 * v:.1f}%"
