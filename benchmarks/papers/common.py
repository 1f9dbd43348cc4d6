"""What every paper's experiment prints: the paper's figure beside edgetrain's, each cell labelled.

A ``Row`` is one figure: what the paper reports (and where), what edgetrain got, how edgetrain's was
obtained (``measured``, ``modelled`` or ``counted``) and, where the two differ, a sentence saying why.
A figure the issue and the repository's docs do not give is "not reported here", never guessed.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

NOT_REPORTED = "not reported here"
HOW = ("measured", "modelled", "counted")


@dataclass
class Row:
    figure: str
    paper: str
    edgetrain: str
    how: str
    note: str = ""

    def __post_init__(self) -> None:
        if self.how not in HOW:
            raise ValueError(f"how must be one of {HOW}, got {self.how!r}")


def load_average() -> str:
    one, five, fifteen = os.getloadavg()
    return f"load average {one:.2f}, {five:.2f}, {fifteen:.2f} on {os.cpu_count()} cores"


def print_table(title: str, rows: list[Row]) -> None:
    """The rows as a plain-text table, the notes numbered below it."""
    print(f"\n{title}")
    widths = [max(len(h), *(len(getattr(r, k)) for r in rows)) for h, k in
              (("figure", "figure"), ("paper", "paper"), ("edgetrain", "edgetrain"), ("how", "how"))]
    head = ("figure", "paper", "edgetrain", "how")
    print("  " + "  ".join(h.ljust(w) for h, w in zip(head, widths)) + "  note")
    notes = 0
    for r in rows:
        mark = ""
        if r.note:
            notes += 1
            mark = f"[{notes}]"
        print("  " + "  ".join(getattr(r, k).ljust(w) for k, w in zip(("figure", "paper", "edgetrain", "how"), widths))
              + f"  {mark}")
    notes = 0
    for r in rows:
        if r.note:
            notes += 1
            print(f"  [{notes}] {r.note}")


def save(path: str | None, name: str, started: float, sections: dict) -> None:
    """Write the rows and raw numbers as JSON (``--out``), with the command, date and load beside them."""
    if not path:
        return
    data = {"paper": name, "command": " ".join([Path(sys.argv[0]).as_posix(), *sys.argv[1:]]),
            "date_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime(started)), "seconds": round(time.time() - started),
            "load": load_average(),
            **{k: [asdict(r) for r in v] if isinstance(v, list) and v and isinstance(v[0], Row) else v
               for k, v in sections.items()}}
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(data, indent=1, default=str) + "\n")
    print(f"\nwrote {path}")


def ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}x" if b else "-"


def paper_arguments(doc: str, fast: str, runs: str, default_runs: str | None = None) -> argparse.ArgumentParser:
    """The options every paper's script takes: ``--fast`` (the suite's version), ``--out`` and ``--runs``."""
    ap = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    ap.add_argument("--fast", action="store_true", help=fast)
    ap.add_argument("--out", help="also write the rows and numbers as JSON here")
    ap.add_argument("--runs", default=default_runs, help=runs)
    return ap


def parse_arguments(doc: str, fast: str, runs: str, argv: list[str] | None) -> tuple[argparse.Namespace, float]:
    """A script's options (``paper_arguments``) parsed from ``argv``, and the time its experiment starts."""
    return paper_arguments(doc, fast, runs).parse_args(argv), time.time()


@contextlib.contextmanager
def runs_folder(paper: str, runs: str | None):
    """Says the paper and the host's load, then gives the folder the runs go to: ``runs``, else a temporary one."""
    print(f"{paper}\n{load_average()} at the start")
    with tempfile.TemporaryDirectory() as tmp:
        yield runs or tmp


def report(paper: str, rows: list[Row], started: float, out: str | None, sections: dict) -> int:
    """The closing table beside the paper's figures, the host's load and time, and the JSON (``save``)."""
    print_table(f"{paper}: the paper's figures beside edgetrain's", rows)
    print(f"\n{load_average()} at the end; {time.time() - started:.0f} s")
    save(out, paper, started, {"rows": rows, **sections})
    return 0
