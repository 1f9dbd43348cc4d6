"""The short tables edgetrain prints at the end of a command."""
from __future__ import annotations

from rich import box
from rich.console import Console
from rich.table import Table

from edgetrain.records import RunSummary, modelled_throughput, stall_what_ifs
from edgetrain.report.cells import (ABOVE_PEAK_NOTE, ROUNDS_COLUMN, ROUNDS_NOTE, energy_cells, energy_note, fmt,
                                    percent_of_peak, round_cells)


def _mb(n: float) -> str:
    return f"{n / 1e6:,.1f}"


def _console() -> Console:
    console = Console()
    # Logs and pipes are not terminals: rich would assume 80 columns and squeeze the table.
    return console if console.is_terminal else Console(width=140)


def print_train_summary(summary: dict | RunSummary, console: Console | None = None) -> None:
    s = summary if isinstance(summary, RunSummary) else RunSummary.from_dict(summary, "the run summary")
    console = console or _console()
    table = Table(title="per device, measured (means per step after the first)", title_justify="left",
                  box=box.SIMPLE_HEAD, pad_edge=False)
    rounds = round_cells(s.details)
    energy = any(d.energy is not None for d in s.per_device)
    for col in ("rank", "profile", "batch", "samples/s", "step ms", "GFLOPS", "% rated", "data%", "comp%", "comm%",
                "RSS MiB", "MB sent", *(["J/smp", "W"] if energy else []), *([ROUNDS_COLUMN] if rounds else [])):
        table.add_column(col, justify="left" if col == "profile" else "right", no_wrap=True)
    for d in s.per_device:
        step = d.step_s or float("nan")
        table.add_row(str(d.rank), d.profile, str(d.local_batch), f"{d.samples_per_s:,.1f}",
                      f"{1000 * step:,.1f}", fmt(d.details.get("achieved_gflops")),
                      percent_of_peak(d.details.get("fraction_of_peak")),
                      f"{100 * d.data_s / step:.0f}", f"{100 * d.compute_s / step:.0f}",
                      f"{100 * d.comm_s / step:.0f}", f"{d.peak_rss_mb:,.0f}", _mb(d.bytes_sent),
                      *(energy_cells(d.energy) if energy else []), *([rounds[d.rank]] if rounds else []))
    console.print(table)
    if rounds:
        console.print(ROUNDS_NOTE, highlight=False)
    if energy:
        console.print(energy_note(s.per_device), highlight=False)
    # "% rated" is against each device's profile rating (modelled, not measured): say which, and flag > 100%.
    for source in sorted({f"{d.profile}: {d.details['peak_source']}" for d in s.per_device
                          if d.details.get("peak_source")}):
        console.print(f"rated GFLOPS of {source}", highlight=False)
    if any(d.details.get("above_peak") for d in s.per_device):
        console.print(ABOVE_PEAK_NOTE, highlight=False)
    for line in stall_lines(s):
        console.print(line, highlight=False)
    modelled = modelled_throughput(s)
    if modelled:
        console.print(f"modelled on {s.details['link']} (virtual clock: this host's compute + modelled link time): "
                      f"step {modelled['step_s']:,.3f} s, throughput {modelled['samples_per_s']:,.1f} samples/s, "
                      f"communication+waiting {modelled['comm_fraction']:.0%} of the step; the figures above "
                      f"are this host's", highlight=False)
    if s.clipped_boxes:
        console.print(clipped_note(s.clipped_boxes), highlight=False)
    if s.privacy is not None:
        console.print(s.privacy.describe(), highlight=False)
    headline = s.task.headline_metric if s.task else None
    if headline is not None and s.test_accuracy is None:  # not a classifier: the headline its task record names
        value = (s.test_metrics or {}).get(headline.name)
        result = f"test {headline.label or headline.name} " + (headline.format(value) if value is not None
                                                                else "not evaluated")
    else:  # a classifier, as runs before tasks printed it
        result = "test accuracy " + (f"{s.test_accuracy:.2%}" if s.test_accuracy is not None else "not evaluated")
    console.print(f"[bold]{result}[/]  train loss {s.train_loss:.4f}  "
                  f"throughput {s.throughput_samples_per_s:,.1f} samples/s  "
                  f"{s.steps} steps in {s.wall_time_s:.1f} s  ->  {s.run_dir}")



def clipped_note(count: int) -> str:
    return f"labels: {count:,} box(es) passed the image's edge and were clipped to it (as Ultralytics clips them)"


def stall_lines(s: RunSummary) -> list[str]:
    """Each device's data stall and DS-Analyzer's what-ifs, for runs whose data comes from storage or from loader
    workers (a run in memory without workers has nothing to split)."""
    lines = []
    for d in s.per_device:
        w = stall_what_ifs(d)
        if w is None or not (d.workers or d.storage_items_per_epoch or d.cache_items_per_epoch):
            continue
        ms = lambda v: f"{1000 * v:,.1f} ms"  # noqa: E731
        items = (f"; {d.storage_items_per_epoch:,.0f} items/epoch from storage, {d.cache_items_per_epoch or 0:,.0f} "
                 "from the cache" if d.storage_items_per_epoch is not None else "")
        lines.append(f"data, rank {d.rank}: stall {w['stall_share']:.0%} of the step ({ms(d.data_s)} waiting; the "
                     f"loader read {ms(d.read_s)} and decoded {ms(d.decode_s)} per batch, {d.workers} worker(s)"
                     f"{items}); modelled (DS-Analyzer what-ifs): cached in memory {ms(w['cached_step_s'])}/step, "
                     f"{w['more_workers']} worker(s) {ms(w['more_workers_step_s'])}/step, measured {ms(w['step_s'])}")
    return lines
