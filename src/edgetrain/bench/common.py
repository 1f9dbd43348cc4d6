"""What every bench shares: the run directory, the result file, the table it prints.

Each bench writes ``RUN_DIR/result.json`` (``{"bench": NAME, "environment":
..., "params": ..., ...}``) and one or more PNGs beside it, then prints a short
table. ``edgetrain report`` reads those files back, so the layout is the
contract between the two.
"""
from __future__ import annotations

import datetime as _dt
import os
import platform
import socket
from pathlib import Path
from typing import Any, Iterable, Sequence

from edgetrain.report.files import new_run_dir, write_json

RESULT_FILE = "result.json"


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


def save_result(run_dir: Path, bench: str, params: dict, **sections: Any) -> dict:
    result = {"bench": bench, "environment": environment(), "params": params, **sections}
    write_json(run_dir / RESULT_FILE, result)
    return result


def fmt(value: Any, digits: int = 3) -> str:
    """A number for a table: a few significant digits, ``-`` for missing."""
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if value != value:  # NaN
            return "-"
        if abs(value) >= 10 ** digits:
            return f"{value:,.0f}"
        return f"{value:.{digits}g}"
    return str(value)


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
