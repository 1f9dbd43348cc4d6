"""How a measured number is written in a table cell, the same in the terminal and in the HTML report.

Benches print their tables with these (``bench.common.print_table``) and
``report.html`` renders the result files with them, so a cell and its
``!`` flag read the same everywhere. They sit here, under both, so that
``report`` never imports ``bench`` (``bench`` writes results with
``files.py`` and plots them with ``report.plots``).

A ``!`` on a spread marks a timing whose interquartile range over its median
is above ``NOISY_SPREAD``; a ``!`` on a percentage of peak marks a rate above
the peak it is set against; on a scaling efficiency, more than 100% or a
noisy baseline. Each comes with its note.
"""
from __future__ import annotations

import base64
import html
import json
from typing import Any

from edgetrain.records import DeviceSummary, EnergyRecord

NOISY_SPREAD = 0.25
NOISY_NOTE = (f"a '!' on a spread marks a timing whose interquartile range is above {NOISY_SPREAD:.0%} of its "
              "median: too noisy to compare; run more steps (or --min-time where the bench has it) on a quieter machine")


def spread_cell(spread: float | None, noisy: bool) -> str:
    """A spread for a table: a percentage, ``!`` when noisy (see ``NOISY_NOTE``)."""
    return "-" if spread is None else f"{100 * spread:.0f}%" + (" !" if noisy else "")


ABOVE_PEAK_NOTE = ("a '!' marks a rate above the peak it is set against, which a correct count cannot reach: "
                   "the peak measurement came out below the achieved rate (noise, load, or a throttled peak); "
                   "re-measure the peak with more time or on a quiet machine")


def percent_of_peak(fraction: float | None) -> str:
    """``fraction`` as a percentage for a table, with ``!`` where it is above the peak (see ``ABOVE_PEAK_NOTE``)."""
    if fraction is None:
        return "-"
    return f"{100 * fraction:.1f}%" + (" !" if fraction > 1 else "")


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


def flag_notes(rows: list[dict[str, Any]]) -> list[str]:
    """One line for each kind of flag the rows carry, saying what it means for the numbers."""
    flags = {f for r in rows for f in r["flags"]}
    notes = [NOISY_NOTE] if flags & {"noisy", "noisy baseline"} else []
    if "noisy baseline" in flags:
        notes.append("the 1-device baseline is noisy: every speedup and efficiency is divided by it and is unreliable")
    if "superlinear" in flags:
        notes.append("a '!' on an efficiency marks more than 100%: more than N times one device, which devices "
                     "sharing this host cannot reach; the baseline was slow (noise, a cold start); re-run with "
                     "more --steps")
    return notes


def efficiency_cell(row: dict[str, Any]) -> str:
    """Efficiency as a percentage, ``!`` where it is flagged (superlinear, or divided by a noisy baseline)."""
    flagged = {"superlinear", "noisy baseline"} & set(row["flags"])
    return f"{100 * row['efficiency']:.1f}%" + (" !" if flagged else "")


ROUNDS_COLUMN = "rounds"
ROUNDS_NOTE = "rounds: how many rounds each device joined / missed the deadline of / was not sampled for"


def round_cells(details: dict) -> list[str] | None:
    """Per device, the rounds it joined, missed the deadline of and was not sampled for (local SGD and
    federated rounds: the summary's ``round_participation``); None for a run without rounds."""
    counts = details.get("round_participation")
    if not counts:
        return None
    return [f"{c['joined']}/{c['missed_deadline']}/{c['not_sampled']}" for c in counts]


# ---- HTML pieces of the report page (report/html.py, report/plan_page.py) ----

def img(png: bytes, alt: str) -> str:
    """An inline PNG of the report page."""
    return f'<img alt="{html.escape(alt)}" src="data:image/png;base64,{base64.b64encode(png).decode()}">'


def table(columns: list[str], rows: list[list[Any]], cls: str = "") -> str:
    """An HTML table of ``rows``, each cell through ``fmt``."""
    head = "".join(f"<th>{html.escape(c)}</th>" for c in columns)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(fmt(v))}</td>" for v in r) + "</tr>" for r in rows)
    return f'<table class="{cls}"><tr>{head}</tr>{body}</table>'


def kv(d: dict[str, Any]) -> str:
    """A two-column table of a mapping's set values."""
    rows = [[k, json.dumps(v) if isinstance(v, (list, dict)) else v] for k, v in d.items() if v is not None]
    return table(["parameter", "value"], rows, "kv")


def energy_cells(energy: EnergyRecord | None) -> list[str]:
    """J/sample and average watts of a device, ``*`` after a modelled figure (see ``energy_note``)."""
    if energy is None or energy.joules_per_sample is None:
        return ["-", "-"]
    mark = "" if energy.measured else "*"
    return [f"{energy.joules_per_sample:.3g}{mark}", f"{energy.watts:.3g}{mark}" if energy.watts else "-"]


def energy_note(per_device: list[DeviceSummary]) -> str:
    """Where each device's energy came from: a sensor (measured) or its profile's power model (modelled, ``*``)."""
    sources = {}
    for d in per_device:
        sources.setdefault(d.energy.source if d.energy else "none (no sensor, no power model in the profile)",
                           []).append(str(d.rank))
    return "energy over the training steps: " + "; ".join(
        f"device{'s' if len(ranks) > 1 else ''} {','.join(ranks)}: {source}" for source, ranks in sources.items()) + \
        (" (* modelled, not measured)" if any(d.energy and not d.energy.measured for d in per_device) else "")
