"""One plot per bench, drawn from its ``result.json``, the training run's charts and the radar chart of the report.

matplotlib with the Agg backend (no display needed); every figure has a
title, labelled axes with units and a legend, and is written atomically.
Training charts take series that ``report.training`` builds from the run's
typed records (what each point is: see that module).
"""
from __future__ import annotations

import io
import math
import os
import textwrap
from dataclasses import dataclass, field
from typing import Any, Sequence

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from edgetrain.files import atomic_write  # noqa: E402
from edgetrain.records import CLASSIFICATION  # noqa: E402

plt.rcParams.update({"figure.dpi": 110, "axes.grid": True, "grid.alpha": 0.3, "font.size": 10,
                     "axes.spines.top": False, "axes.spines.right": False})
COLORS = plt.rcParams["axes.prop_cycle"].by_key()["color"]
LINE_STYLES = ("-", "--", ":", "-.")


def save(fig, path: str | os.PathLike) -> None:
    fig.tight_layout()
    with atomic_write(path, "wb") as f:
        fig.savefig(f, format="png")
    plt.close(fig)


def png_bytes(fig) -> bytes:
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    plt.close(fig)
    return buf.getvalue()


def plot_peak(result: dict[str, Any], path) -> None:
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, kind, title in ((axes[0], "gemm", "GEMM (float32, 2n³ flops)"),
                            (axes[1], "linpack", "LINPACK LU solve (float64, ⅔n³+2n² flops)")):
        rows = [r for r in result["rows"] if r["kind"] == kind]
        for i, t in enumerate(sorted({r["threads"] for r in rows})):
            pts = sorted((r["n"], r["gflops_best"], r["gflops_median"]) for r in rows if r["threads"] == t)
            if not pts:
                continue
            ns, best, med = zip(*pts)
            ax.plot(ns, best, "o-", color=COLORS[i % 10], label=f"{t} thread(s), best")
            ax.plot(ns, med, "x--", color=COLORS[i % 10], alpha=0.6, label=f"{t} thread(s), median")
        for j, agg in enumerate(r for r in result.get("aggregate", []) if r["kind"] == kind):
            ax.scatter([agg["n"]], [agg["gflops_median_sum"]], marker="*", s=150, color="black",
                       zorder=5, label=f"{agg['devices']} devices at once (sum)" if j == 0 else None)
        sizes = sorted({r["n"] for r in rows})
        ax.set_xscale("log", base=2)
        ax.set_xticks(sizes, [str(n) for n in sizes])
        ax.minorticks_off()
        ax.set_xlabel("matrix size n")
        ax.set_ylabel("GFLOPS")
        ax.set_title(title)
        ax.set_ylim(bottom=0)
        ax.legend(fontsize=8)
    fig.suptitle("Device peak")
    save(fig, path)


def plot_batch(result: dict[str, Any], path) -> None:
    ok = [r for r in result["rows"] if r["status"] == "ok"]
    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    bs = [r["batch_size"] for r in ok]
    ax.plot(bs, [r["samples_per_s"] for r in ok], "o-", color=COLORS[0], label="throughput")
    ax.set_xscale("log", base=2)
    ticks = bs + ([result["limit_hit"]["batch_size"]] if result.get("limit_hit") else [])
    ax.set_xticks(ticks, [str(b) for b in ticks])
    ax.minorticks_off()
    ax.set_xlabel("batch size")
    ax.set_ylabel("throughput (samples/s)", color=COLORS[0])
    ax.set_ylim(bottom=0)
    mem = ax.twinx()
    mem.grid(False)
    mem.plot(bs, [r["peak_rss_mb"] for r in ok], "s--", color=COLORS[1], label="peak memory (RSS)")
    limit = result["profile"]["memory_limit_mb"]
    hit = result.get("limit_hit")
    if hit or limit < 2 * max(r["peak_rss_mb"] for r in ok):  # a far-off limit would flatten the curve
        mem.axhline(limit, color="red", lw=1, ls=":", label=f"memory limit {limit:.0f} MB")
    if hit:
        mem.scatter([hit["batch_size"]], [hit.get("rss_mb", limit)], marker="X", s=120, color="red",
                    zorder=5, label=f"limit hit at batch {hit['batch_size']}")
    mem.set_ylabel("peak memory (MB)", color=COLORS[1])
    mem.set_ylim(bottom=0)
    lines = ax.get_legend_handles_labels()
    lines2 = mem.get_legend_handles_labels()
    ax.legend(lines[0] + lines2[0], lines[1] + lines2[1], fontsize=8, loc="upper center",
              bbox_to_anchor=(0.5, -0.14), ncol=2, frameon=False)
    p = result["params"]
    ax.set_title(f"{p['model']} on {p['profile']} ({p['threads']} thread(s), memory limit {limit:.0f} MB)")
    save(fig, path)


def plot_scaling(result: dict[str, Any], path) -> None:
    rows = result["rows"]
    n = [r["devices"] for r in rows]
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    ax = axes[0]
    ax.plot(n, [r["speedup"] for r in rows], "o-", label="measured speedup")
    ax.plot(n, n, ":", color="gray", label="linear")
    flagged = [r for r in rows if r.get("flags")]  # noisy, a noisy baseline, or above 100% efficiency
    if flagged:
        ax.scatter([r["devices"] for r in flagged], [r["speedup"] for r in flagged], marker="x", s=90, color="red",
                   zorder=3, label="flagged: " + ", ".join(sorted({f for r in flagged for f in r["flags"]})))
    ax.set_xlabel("devices")
    ax.set_ylabel("speedup over 1 device")
    ax.set_xticks(n)
    eff = ax.twinx()
    eff.grid(False)
    eff.plot(n, [100 * r["efficiency"] for r in rows], "s--", color=COLORS[2], label="efficiency")
    eff.set_ylabel("efficiency (%)", color=COLORS[2])
    eff.set_ylim(0, max(110, 110 * max(r["efficiency"] for r in rows)))
    ax.set_ylim(0, max(max(n), max(r["speedup"] for r in rows)) * 1.1)
    h1, l1 = ax.get_legend_handles_labels()
    h2, l2 = eff.get_legend_handles_labels()
    ax.legend(h1 + h2, l1 + l2, fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.15), ncol=3,
              frameon=False)
    ax.set_title("Speedup and efficiency")
    ax = axes[1]
    stacked_bars(ax, [str(x) for x in n], {part: [r["split_s_per_step"][part] * 1000 for r in rows]
                                           for part in ("data", "compute", "comm", "wait")})
    ax.set_xlabel("devices")
    ax.set_ylabel("time per step (ms, mean over devices)")
    ax.set_title("Where a step's time goes")
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.15), ncol=4, frameon=False)
    save(fig, path)


def stacked_bars(ax, labels: Sequence[str], parts: dict[str, Sequence[float]]) -> None:
    """One bar per label, ``parts`` stacked bottom to top in order, a colour and a legend entry each."""
    bottom = [0.0] * len(labels)
    for i, (part, values) in enumerate(parts.items()):
        ax.bar(labels, values, bottom=bottom, color=COLORS[i], label=part)
        bottom = [b + v for b, v in zip(bottom, values)]


def plot_stalls(result: dict[str, Any], path) -> None:
    rows = result["rows"]
    if rows and "storage" in rows[0]:
        return _plot_storage_stalls(result, path)
    _plot_cifar_stalls(result, path)


def _plot_storage_stalls(result: dict[str, Any], path) -> None:
    """bench stalls over workers x storage x page cache: training rate and stall share per worker count."""
    rows = result["rows"]
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    series = sorted({(r["storage"], r["cache"], r["throttled"]) for r in rows}, key=lambda k: (k[0], k[1]))
    for k, (storage, cache, throttled) in enumerate(series):
        mine = sorted((r for r in rows if (r["storage"], r["cache"]) == (storage, cache)), key=lambda r: r["workers"])
        w = [r["workers"] for r in mine]
        label = f"{storage}{'' if throttled else ' (unthrottled)'}, {cache} page cache"
        style = "o-" if cache == "cold" else "s--"
        axes[0].plot(w, [r["train_samples_per_s"] for r in mine], style, color=COLORS[k // 2 % len(COLORS)],
                     label=label)
        axes[1].plot(w, [100 * r["stall_fraction"] for r in mine], style, color=COLORS[k // 2 % len(COLORS)],
                     label=label)
    axes[0].axhline(result["ingestion_samples_per_s"], color="k", ls=":", label="ingestion (no stall)")
    for ax, title, unit in ((axes[0], "Training rate", "samples/s"), (axes[1], "Stall share of the pass", "%")):
        ax.set_xlabel("loader workers")
        ax.set_ylabel(unit)
        ax.set_title(title)
        ax.set_xticks(sorted({r["workers"] for r in rows}))
    axes[0].legend(fontsize=7, frameon=False)
    fig.suptitle("bench stalls: training's loader, storage throttled by blkio (measured)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _plot_cifar_stalls(result: dict[str, Any], path) -> None:
    rows = result["rows"]
    w = [r["workers"] for r in rows]
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    ax = axes[0]
    ax.plot(w, [r.get("ingestion_samples_per_s", result["ingestion_samples_per_s"]) for r in rows], "k:",
            label="ingestion (synthetic, no stall)")
    ax.plot(w, [r["train_cached_samples_per_s"] for r in rows], "o-", label="training, cached data")
    ax.plot(w, [r["train_cold_samples_per_s"] for r in rows], "s-", label="training, cold page cache")
    ax.plot(w, [r["prep_samples_per_s"] for r in rows], "^--", alpha=0.7, label="loader alone, cached (prep)")
    ax.plot(w, [r["fetch_samples_per_s"] for r in rows], "v--", alpha=0.7, label="loader alone, cold (fetch)")
    ax.set_yscale("log")
    ax.set_xlabel("loader workers")
    ax.set_ylabel("samples/s")
    ax.set_xticks(w)
    ax.set_title("Rates (log scale)")
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.15), ncol=2, frameon=False)
    ax = axes[1]
    compute = [r["epoch_compute_s"] for r in rows]
    prep = [r["prep_stall_s"] for r in rows]
    fetch = [r["fetch_stall_s"] for r in rows]
    labels = [str(x) for x in w]
    ax.bar(labels, compute, label="compute (ingestion)", color=COLORS[0])
    ax.bar(labels, prep, bottom=compute, label="prep stall", color=COLORS[1])
    ax.bar(labels, fetch, bottom=[c + p for c, p in zip(compute, prep)], label="fetch stall", color=COLORS[3])
    ax.set_xlabel("loader workers")
    ax.set_ylabel(f"seconds per epoch ({result['params']['epoch_samples']} samples)")
    ax.set_title("Epoch time split (DS-Analyzer)")
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.15), ncol=3, frameon=False)
    save(fig, path)


def plot_power(result: dict[str, Any], path) -> None:
    rows = [r for r in result["rows"] if r.get("energy_j_per_epoch") is not None]
    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    if not rows:
        rows = result["rows"]
        ax.bar([r["setting"] for r in rows], [r["epoch_s"] for r in rows])
        ax.set_ylabel("time per epoch (s)")
        ax.set_title("Time per epoch (no energy: no sensor and no power model)")
        save(fig, path)
        return
    source = result["energy_source"]
    front = {r["setting"] for r in result.get("pareto", [])}
    for r in rows:
        on = r["setting"] in front
        ax.scatter(r["epoch_s"], r["energy_j_per_epoch"], s=60 if on else 35,
                   color=COLORS[3] if on else COLORS[0], zorder=3)
        ax.annotate(r["setting"], (r["epoch_s"], r["energy_j_per_epoch"]), fontsize=8,
                    xytext=(4, 4), textcoords="offset points")
    pts = sorted((r["epoch_s"], r["energy_j_per_epoch"]) for r in rows if r["setting"] in front)
    if pts:
        ax.plot(*zip(*pts), "-", color=COLORS[3], label="Pareto front")
        ax.legend(fontsize=8)
    ax.set_xlabel("time per epoch (s)")
    ax.set_ylabel("energy per epoch (J)" + (", MODELLED" if source["modelled"] else ""))
    ax.set_title("Time vs energy per epoch" + (" (energy modelled: no sensor)" if source["modelled"]
                                                else f" ({source['kind']})"))
    save(fig, path)


def plot_variability(result: dict[str, Any], path) -> None:
    runs = result["runs"]
    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    data, labels = [], []
    for run in runs:
        for dev in run["devices"]:
            data.append([s * 1000 for s in dev["step_s"]])
            labels.append(f"run {run['run']}\ndev {dev['rank']}")
    ax.boxplot(data, tick_labels=labels)
    ax.set_ylabel("step time (ms)")
    s = result["summary"]
    ax.set_title(f"Step time per run and device: CV within {100 * s['cv_within_mean']:.2f}% (mean), "
                 f"across runs {100 * s['cv_across_runs']:.2f}%", fontsize=9)
    if len(labels) > 8:
        ax.tick_params(axis="x", labelsize=7)
    save(fig, path)


def plot_counters(result: dict[str, Any], path) -> None:
    vals = {k: v for k, v in result.get("ratios", {}).items() if v is not None}
    fig, ax = plt.subplots(figsize=(7, 3.5))
    if vals:
        ax.barh(list(vals), list(vals.values()), color=COLORS[0])
        for i, v in enumerate(vals.values()):
            ax.annotate(f"{v:.3g}", (v, i), xytext=(3, -3), textcoords="offset points", fontsize=8)
        ax.set_xlabel("value (IPC, or miss ratio)")
        ax.set_title("Hardware counters of a training step")
    else:
        ax.axis("off")
        message = textwrap.fill(result.get("message") or "", 70)
        ax.text(0.5, 0.5, f"Hardware counters not available\n\n{message}", ha="center", va="center", fontsize=10)
    save(fig, path)


def radar(labels: Sequence[str], configs: Sequence[tuple[str, Sequence[float | None]]], title: str):
    """A radar chart of scores in [0, 1] (1 = best of the configurations); ``None`` is drawn at 0."""
    k = len(labels)
    angles = [2 * math.pi * i / k for i in range(k)] + [0.0]
    fig = plt.figure(figsize=(6.5, 5.5))
    ax = fig.add_subplot(111, polar=True)
    for i, (name, scores) in enumerate(configs):
        vals = [0.0 if s is None else s for s in scores]
        vals.append(vals[0])
        ax.plot(angles, vals, "o-", lw=1.5, color=COLORS[i % 10], label=name)
        ax.fill(angles, vals, alpha=0.1, color=COLORS[i % 10])
    ax.set_xticks(angles[:-1])
    ax.set_xticklabels(labels)
    ax.tick_params(axis="x", pad=14)
    ax.set_ylim(0, 1.05)
    ax.set_yticks([0.25, 0.5, 0.75, 1.0])
    ax.set_yticklabels(["0.25", "0.5", "0.75", "1"], fontsize=7)
    ax.set_title(title, pad=18)
    ax.legend(loc="upper right", bbox_to_anchor=(1.35, 1.1), fontsize=8)
    return fig


@dataclass
class RunCurves:
    """One training run's loss and accuracy series (``report.training.curves`` builds it)."""

    name: str
    steps: list[int]                # steps done after each step (1, 2, ...)
    train_loss: list[float]
    host_s: list[float]             # measured host time after each step
    modelled_s: list[float] | None  # modelled device-clock time after each step; None: not a virtual link run
    eval_steps: list[int]           # steps done at each evaluation
    eval_loss: list[float]
    eval_accuracy: list[float]
    changes: list[tuple[int, str]] = field(default_factory=list)  # elastic runs: (step, "leave"/"join")
    task: Any = None                # its TaskRecord (records.py): the metrics' names, labels, units; None: accuracy
    eval_metrics: dict[str, list[float]] = field(default_factory=dict)  # each metric at each evaluation

    def metric_series(self, name: str) -> list[float]:
        if name in self.eval_metrics:
            return self.eval_metrics[name]
        return self.eval_accuracy if name == "accuracy" else []

    def at(self, xs: list[float], steps: list[int]) -> list[float]:
        """``xs`` (a time series over ``self.steps``) at the given step counts."""
        index = {s: i for i, s in enumerate(self.steps)}
        return [xs[index[s]] if s in index else math.nan for s in steps]


def running_mean(values: Sequence[float], window: int) -> list[float]:
    """The mean of the last ``window`` values at each point (fewer at the start)."""
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v - (values[i - window] if i >= window else 0.0)
        out.append(total / min(i + 1, window))
    return out


def _metric_axis(metric) -> tuple[str, float, str]:
    """(axis label, scale, legend word) of a task's metric: a fraction printed as a percentage is plotted in %."""
    label = metric.label or metric.name
    if metric.fmt.endswith("%"):
        return f"test {label} (%)", 100.0, label
    return f"test {label}" + (f" ({metric.unit})" if metric.unit else ""), 1.0, label


def plot_training_curves(runs: Sequence[RunCurves]):
    """Loss and each metric of the runs' task (a classifier: accuracy) against step, host time and (where a run
    has one) modelled time; one colour per run. The runs share one task (``RunCurves.task``; the first run's
    decides the columns)."""
    task = next((r.task for r in runs if r.task is not None), None) or CLASSIFICATION
    metrics = task.metrics or [task.headline_metric]
    axes_x = [("step", "steps", None), ("host", "host time (s, measured; evaluation excluded)", "host_s")]
    if any(r.modelled_s for r in runs):
        axes_x.append(("modelled", "time on the device clocks (s, MODELLED: host compute + link model)",
                       "modelled_s"))
    width = 5.5 * (1 + len(metrics))
    fig, axes = plt.subplots(len(axes_x), 1 + len(metrics), figsize=(width, 3.4 * len(axes_x)), squeeze=False)
    for row, (kind, xlabel, time_field) in zip(axes, axes_x):
        loss_ax, metric_axes = row[0], row[1:]
        for i, run in enumerate(runs):
            color = COLORS[i % 10]
            xs = run.steps if time_field is None else getattr(run, time_field)
            if xs is None:
                continue
            window = max(1, len(run.steps) // 20)
            loss_ax.plot(xs, run.train_loss, color=color, lw=0.6, alpha=0.35)
            mean = "" if window == 1 else f" (mean of {window} steps)"
            loss_ax.plot(xs, running_mean(run.train_loss, window), color=color, lw=1.6,
                         label=f"{run.name}: train loss{mean}")
            # membership changes of an elastic run: a dashed line where a device left, dotted where one joined
            for step, kind in run.changes:
                x = step if time_field is None else run.at(xs, [step])[0]
                for ax in row:
                    ax.axvline(x, color=color, lw=0.8, ls="--" if kind == "leave" else ":")
            eval_x = run.eval_steps if time_field is None else run.at(xs, run.eval_steps)
            if run.eval_steps:
                loss_ax.plot(eval_x, run.eval_loss, "o--", color=color, ms=4, label=f"{run.name}: test loss")
                for metric, ax in zip(metrics, metric_axes):
                    values = run.metric_series(metric.name)
                    if values:
                        _, scale, word = _metric_axis(metric)
                        ax.plot(eval_x, [scale * v if v is not None else math.nan for v in values], "o-",
                                color=color, ms=4, label=f"{run.name}: test {word}")
        loss_ax.set_ylabel(f"loss ({task.loss or 'the task' + chr(39) + 's'})")
        for ax in row:
            ax.set_xlabel(xlabel)
            ax.set_xlim(left=0)
        loss_ax.set_ylim(bottom=0)
        loss_ax.set_title(f"Loss vs {kind}" + (" time" if time_field else ""))
        for metric, ax in zip(metrics, metric_axes):
            axis, _, word = _metric_axis(metric)
            ax.set_ylabel(axis)
            ax.set_title(f"Test {word} vs {kind}" + (" time" if time_field else ""))
            if not any(r.eval_steps for r in runs):
                ax.text(0.5, 0.5, "no evaluation (the run had --no-eval)", ha="center", va="center",
                        transform=ax.transAxes)
        for ax in row:
            if ax.get_legend_handles_labels()[0]:
                ax.legend(fontsize=7)
    return fig


def plot_device_split(ranks: Sequence[str], split_ms: dict[str, Sequence[float]],
                      bytes_per_step: dict[str, tuple[list[int], list[float]]]):
    """Left: each device's time per step, stacked by part; right: bytes each device sent at every step."""
    fig, (split_ax, bytes_ax) = plt.subplots(1, 2, figsize=(11, 3.8))
    stacked_bars(split_ax, ranks, split_ms)
    split_ax.set_xlabel("device (rank: profile)")
    split_ax.set_ylabel("time per step (ms, measured mean)")
    split_ax.set_title("Where each device's step goes (after the first step)", fontsize=10)
    split_ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.18), ncol=3, frameon=False)
    largest = max((max(sent, default=0) for _, sent in bytes_per_step.values()), default=0)
    unit, scale = ("MB", 1e6) if largest >= 1e6 else ("kB", 1e3)
    for i, (rank, (steps, sent)) in enumerate(bytes_per_step.items()):
        # dashes differ too: devices that send the same bytes draw the same line
        bytes_ax.plot(steps, [b / scale for b in sent], color=COLORS[i % 10], lw=1.2, ls=LINE_STYLES[i % 4],
                      label=f"{rank}: {sum(sent) / 1e6:,.2f} MB in all")
    bytes_ax.set_xlabel("step")
    bytes_ax.set_ylabel(f"{unit} sent in the step")
    bytes_ax.set_ylim(bottom=0)
    bytes_ax.set_title("Bytes sent per step, per device (counted)", fontsize=10)
    if bytes_per_step:
        bytes_ax.legend(fontsize=8)
    return fig


def plot_fleet_rounds(runs: Sequence[tuple[str, Sequence[Any], Sequence[float]]]):
    """Fleet runs (name, ``FleetRoundRecord`` per round, accuracy per round): accuracy against rounds and against
    the modelled clock, and the devices each round aggregated of those sampled; one colour per run."""
    fig, (by_round, by_time, kept) = plt.subplots(1, 3, figsize=(16.5, 4.2))
    for i, (name, rounds, accuracy) in enumerate(runs):
        color, style = COLORS[i % 10], LINE_STYLES[(i // 10) % 4]
        numbers = [r.round for r in rounds]
        percent = [100 * a for a in accuracy]
        by_round.plot(numbers, percent, color=color, ls=style, lw=1.4, label=name)
        by_time.plot([r.modelled_clock_s for r in rounds], percent, color=color, ls=style, lw=1.4, label=name)
        kept.plot(numbers, [r.aggregated for r in rounds], color=color, ls=style, lw=1.2, label=f"{name}: aggregated")
        kept.plot(numbers, [r.sampled for r in rounds], color=color, ls=":", lw=0.8)
    by_round.set(xlabel="round", ylabel="test accuracy (%)", title="Accuracy vs round")
    by_time.set(xlabel="fleet clock (s, MODELLED: device profiles and links)", ylabel="test accuracy (%)",
                title="Accuracy vs modelled time")
    kept.set(xlabel="round", ylabel="devices", title="Devices aggregated (solid) of those sampled (dotted)")
    kept.set_ylim(bottom=0)
    for ax in (by_round, by_time, kept):
        ax.set_xlim(left=0)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
    return fig
