"""Tables and the scaling plot of ``edgetrain plan``. Every title says the numbers are modelled."""
from __future__ import annotations

from dataclasses import fields
from pathlib import Path

from rich import box
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from edgetrain.plan.model import HOST_PROFILE_ERROR, DevicePrediction, Prediction, step_timing
from edgetrain.files import atomic_write
from edgetrain.results import PlanComparison, PlanDevice, PlanDeviceGroup, PlanScalingRow, PlanSimulation

# Imported inside functions: matplotlib (only a --scale sweep is drawn; plan's flags, --help and bad input answer
# without it).


def console() -> Console:
    c = Console()
    return c if c.is_terminal else Console(width=140)  # pipes and logs: do not squeeze to 80 columns


def _ranks(ranks: list[int]) -> str:
    """0,1,2,3,7 -> '0-3,7'."""
    parts, start = [], ranks[0]
    for prev, cur in zip(ranks, ranks[1:] + [None]):
        if cur != prev + 1:
            parts.append(str(start) if start == prev else f"{start}-{prev}")
            start = cur
    return ",".join(parts)


def device_groups(pred: Prediction) -> list[PlanDeviceGroup]:
    """Devices with identical predictions, merged (a cluster of 4096 identical devices is one row)."""
    exact: dict[tuple, dict] = {}  # first by exact values: rounding once per distinct row, not per device
    for d in pred.devices:
        key = (d.profile, d.batch, d.link, d.compute_s, d.step_s, d.memory_total_mb)
        if key not in exact:
            exact[key] = {"ranks": [], "device": d}
        exact[key]["ranks"].append(d.rank)
    groups: dict[tuple, dict] = {}
    for (profile, batch, link, compute_s, step_s, memory_mb), group in exact.items():
        key = (profile, batch, link, round(compute_s, 9), round(step_s, 9), round(memory_mb, 6))
        if key in groups:
            groups[key]["ranks"] = sorted(groups[key]["ranks"] + group["ranks"])
        else:
            groups[key] = group
    return [_group(_ranks(g["ranks"]), len(g["ranks"]), g["device"]) for g in groups.values()]


def _group(ranks: str, count: int, d: DevicePrediction) -> PlanDeviceGroup:
    return PlanDeviceGroup(ranks=ranks, count=count, **{f.name: getattr(d, f.name) for f in fields(PlanDevice)})


def print_prediction(pred: Prediction, out: Console) -> None:
    c = pred.costs
    t = pred.traffic
    out.print(f"[bold]{c.model}[/] input {'x'.join(map(str, c.input_shape))}: {c.params:,} parameters, "
              f"{c.train_flops_per_sample / 1e9:,.3f} GFLOP/sample train (fwd {c.forward_flops_per_sample / 1e9:,.3f}), "
              f"{c.activation_bytes_per_sample / 2**20:,.2f} MiB activations/sample  [dim](counted)[/]")
    table = Table(title=f"per device, modelled (efficiency {pred.efficiency:g}, overlap {pred.overlap:g}, "
                        f"{t.sync}, compress {t.compress})", title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False)
    for col in ("ranks", "profile", "GFLOPS", "batch", "link", "compute s", "comm s", "wait s", "step s",
                "samples/s", "memory MiB", "limit MiB", ""):
        table.add_column(col, justify="left" if col in ("ranks", "profile", "link", "") else "right", no_wrap=True)
    for g in device_groups(pred):
        limit = g.memory_limit_mb
        table.add_row(g.ranks, g.profile, f"{g.gflops:,.1f}", str(g.batch), g.link, f"{g.compute_s:,.3f}",
                      f"{g.comm_s:,.3f}", f"{g.wait_s:,.3f}", f"{g.step_s:,.3f}", f"{g.samples_per_s:,.2f}",
                      f"{g.memory_total_mb:,.0f}", "-" if limit is None else f"{limit:,}",
                      "[red]OVER LIMIT[/]" if g.over_limit else "")
    out.print(table)
    m = pred.devices[0].memory_mb
    out.print("memory per device (rank 0), MiB: " + ", ".join(f"{k} {v:,.1f}" for k, v in m.items())
              + f"  [dim](runtime = measured idle process RSS {pred.runtime_mb:,.0f} MiB)[/]")
    if t.collectives:
        kinds = ", ".join(f"{k} {b / 1e6:,.3f} MB" for k, b in t.collectives)
        every = "" if t.period == 1 else f" every {t.period} steps" if step_timing(t) != "bounded" else ""
        out.print(f"exchange{every}: {len(t.collectives)} collective(s) ({escape(kinds)}) sent per device, "
                  f"payload {t.payload_bytes / 1e6:,.3f} MB vs fp32 {t.fp32_bytes / 1e6:,.3f} MB, "
                  f"modelled {pred.exchange_s:,.3f} s")
    else:
        out.print("no communication (one device)")
    out.print(f"[bold]modelled[/]: step {pred.step_s:,.3f} s, throughput {pred.throughput:,.2f} samples/s, "
              f"communication+waiting {pred.comm_fraction:.1%} of the step")
    if HOST_PROFILE_ERROR in pred.assumptions:
        out.print(f"[yellow]compute error[/]: {escape(HOST_PROFILE_ERROR)}")
    if pred.over_limit:
        out.print(f"[red]devices {_ranks(pred.over_limit)} need more memory than their profile has[/]")


def print_simulation(sim: PlanSimulation, out: Console) -> None:
    out.print("[bold]simulated[/]" + escape(sim.describe().removeprefix("simulated")))


def print_strategies(comparison: PlanComparison, out: Console) -> None:
    """Each strategy's devices (role, time, memory against the limit, bytes), its line, and the recommendation."""
    for strategy in comparison.strategies:
        out.print(f"[bold]{strategy.strategy}[/], modelled on link {escape(comparison.link)}: "
                  + escape(strategy.describe().removeprefix(f"{strategy.strategy}: ")))
        if not strategy.devices:
            continue
        table = Table(box=box.SIMPLE_HEAD, pad_edge=False)
        for col in ("rank", "profile", "role", "compute s", "comm+wait s", "step s", "memory MiB", "limit MiB",
                    "sent MB/step", ""):
            table.add_column(col, justify="left" if col in ("profile", "role", "") else "right")
        for d in strategy.devices:
            table.add_row(str(d.rank), d.profile, escape(d.role), f"{d.compute_s:,.3f}", f"{d.comm_s:,.3f}",
                          f"{d.step_s:,.3f}", f"{d.memory_total_mb:,.0f}",
                          "-" if d.memory_limit_mb is None else f"{d.memory_limit_mb:,.0f}",
                          f"{d.sent_bytes_per_step / 1e6:,.3f}", "[red]OVER LIMIT[/]" if d.over_limit else "")
        out.print(table)
        for note in strategy.notes:
            out.print(f"  [dim]{escape(note)}[/]")
    if comparison.reason:
        out.print(f"[bold]recommended (modelled)[/]: {escape(comparison.reason)}")


def print_scaling(rows: list[PlanScalingRow], out: Console) -> None:
    table = Table(title="scaling, modelled (weak: every device keeps its local batch)", title_justify="left",
                  box=box.SIMPLE_HEAD, pad_edge=False)
    for col in ("devices", "step s", "samples/s", "speedup", "efficiency", "sim step s", "sim p99 s",
                "sim samples/s", "sim speedup", "sim eff.", "comm %", "wait %"):
        table.add_column(col, justify="right", no_wrap=True)
    for r in rows:
        table.add_row(f"{r.devices:,}", f"{r.analytic_step_s:,.3f}", f"{r.analytic_throughput:,.2f}",
                      f"{r.analytic_speedup:,.2f}", f"{r.analytic_efficiency:.3f}", f"{r.simulated_step_s:,.3f}",
                      f"{r.simulated_p99_step_s:,.3f}", f"{r.simulated_throughput:,.2f}",
                      f"{r.simulated_speedup:,.2f}", f"{r.simulated_efficiency:.3f}", f"{100 * r.comm_fraction:.0f}",
                      f"{100 * r.wait_fraction:.0f}")
    out.print(table)


def plot_scaling(rows: list[PlanScalingRow], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import ScalarFormatter

    n = [r.devices for r in rows]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    ideal = [rows[0].analytic_throughput * k / n[0] for k in n]
    ax1.plot(n, ideal, "k:", label="linear")
    ax1.plot(n, [r.analytic_throughput for r in rows], "o-", label="analytic")
    ax1.plot(n, [r.simulated_throughput for r in rows], "s--", label="simulated")
    ax1.set(xscale="log", yscale="log", xlabel="devices", ylabel="samples/s (modelled)", title="throughput")
    ax2.plot(n, [r.analytic_efficiency for r in rows], "o-", label="analytic")
    ax2.plot(n, [r.simulated_efficiency for r in rows], "s--", label="simulated")
    ax2.set(xscale="log", ylim=(0, 1.05), xlabel="devices", ylabel="speedup / devices (modelled)",
            title="scaling efficiency")
    for ax in (ax1, ax2):
        ax.set_xscale("log", base=2)
        ax.xaxis.set_major_formatter(ScalarFormatter())
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    fig.suptitle(f"modelled, not measured: {title}", fontsize=10)
    fig.tight_layout()
    with atomic_write(path, "wb") as f:
        fig.savefig(f, format="png", dpi=110)
    plt.close(fig)
