"""The short tables edgetrain prints at the end of a command."""
from __future__ import annotations

from rich.console import Console
from rich.table import Table


def _mb(n: float) -> str:
    return f"{n / 1e6:,.1f}"


def print_train_summary(summary: dict, console: Console | None = None) -> None:
    console = console or Console()
    table = Table(title="devices (measured; times are means per step after the first)", title_justify="left")
    for col in ("rank", "profile", "batch", "samples/s", "step ms", "data %", "compute %", "comm %",
                "peak RSS MiB", "MB sent"):
        table.add_column(col, justify="right" if col not in ("profile",) else "left")
    for d in summary["per_device"]:
        step = d["step_s"] or float("nan")
        table.add_row(str(d["rank"]), d["profile"], str(d["local_batch"]), f"{d['samples_per_s']:,.1f}",
                      f"{1000 * step:,.1f}", f"{100 * d['data_s'] / step:.0f}", f"{100 * d['compute_s'] / step:.0f}",
                      f"{100 * d['comm_s'] / step:.0f}", f"{d['peak_rss_mb']:,.0f}", _mb(d["bytes_sent"]))
    console.print(table)
    acc = summary.get("test_accuracy")
    acc_text = f"{acc:.2%}" if acc is not None else "not evaluated"
    console.print(f"[bold]test accuracy {acc_text}[/]  train loss {summary['train_loss']:.4f}  "
                  f"throughput {summary['throughput_samples_per_s']:,.1f} samples/s  "
                  f"{summary['steps']} steps in {summary['wall_time_s']:.1f} s  ->  {summary['run_dir']}")
