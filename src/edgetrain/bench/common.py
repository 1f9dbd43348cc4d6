"""What every bench shares: the run directory, the result file, the table it prints.

Each bench builds its typed result (``edgetrain.results``: ``PeakResult``,
``BatchResult``...), writes it as ``RUN_DIR/result.json`` (``{"bench": NAME,
"environment": ..., "params": ..., ...}``) and one or more PNGs beside it,
then prints a short table. ``edgetrain report`` reads those files back through
the same classes, so the schema is the contract between the two.

One statistic throughout: a timing is summarised by its median, and every
rate printed beside it is derived from that same median (samples/s = batch /
median step s), so two columns of a table never disagree. Its spread is the
interquartile range over the median (``relative_spread``), which outliers
disturb as little as they disturb the median; a spread above ``NOISY_SPREAD``
makes the number too noisy to compare with another, and the table says so
with a ``!`` and a note, and the JSON with ``noisy: true``.
"""
from __future__ import annotations

import datetime as _dt
import os
import platform
import socket
import statistics
from pathlib import Path
from typing import Any, Iterable, Sequence

from edgetrain.report.cells import (ABOVE_PEAK_NOTE, NOISY_NOTE, NOISY_SPREAD, fmt,  # noqa: F401  (benches' names)
                                    percent_of_peak, spread_cell)
from edgetrain.files import new_run_dir, write_json
from edgetrain.results import BENCH_FILE, BenchResult

# Imported inside functions: torch and rich, so that edgetrain --help and bench's flags answer without them.


def relative_spread(values: Sequence[float]) -> float | None:
    """Interquartile range over the median; None for fewer than two values."""
    if len(values) < 2:
        return None
    q1, _, q3 = statistics.quantiles(values, n=4, method="inclusive")
    median = statistics.median(values)
    return (q3 - q1) / median if median else None


def timing_summary(step_s: Sequence[float], samples_per_step: float) -> dict[str, Any]:
    """The median step, the rate derived from it, its spread and whether that spread makes it noise."""
    median = statistics.median(step_s)
    spread = relative_spread(step_s)
    return {"step_s_median": median, "samples_per_s": samples_per_step / median, "spread": spread,
            "noisy": spread is not None and spread > NOISY_SPREAD}


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def environment() -> dict[str, Any]:
    """Where the numbers were taken: they mean little without it."""
    import torch

    return {
        "host": socket.gethostname(),
        "cpu": cpu_model(),
        "logical_cpus": os.cpu_count(),
        "machine": platform.machine(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "created": _dt.datetime.now().isoformat(timespec="seconds"),
    }


def start_run(output: str | os.PathLike, name: str | None, bench: str) -> Path:
    return new_run_dir(output, name, prefix=f"bench-{bench}")


def save_result(run_dir: Path, result: BenchResult) -> BenchResult:
    """Stamp ``result`` with where it was measured and where it is written, and write ``RUN_DIR/result.json``."""
    result.environment = environment()
    result.run_dir = str(run_dir)
    write_json(run_dir / BENCH_FILE, result.to_dict())
    return result


def print_table(title: str, columns: Sequence[str], rows: Iterable[Sequence[Any]],
                notes: Iterable[str] = ()) -> None:
    """A compact rich table, then one line per note (modelled values, skipped knobs...)."""
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    table = Table()
    for i, col in enumerate(columns):
        table.add_column(escape(col), justify="left" if i == 0 else "right")
    for row in rows:
        table.add_row(*(escape(fmt(v)) for v in row))
    console = Console(width=max(100, Console().width))
    console.print(f"[bold]{escape(title)}[/bold]", highlight=False)
    console.print(table)
    for note in notes:
        console.print(f"  note: {escape(note)}", highlight=False)


def say(message: str, style: str = "yellow") -> None:
    """One line for the user (a missing sensor, a skipped knob), printed as is."""
    from rich.console import Console
    from rich.markup import escape

    Console(width=max(100, Console().width)).print(f"[{style}]{escape(message)}[/{style}]", highlight=False)
