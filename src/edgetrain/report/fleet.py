"""The report's part for a Flower fleet's run: its ``fleet-rounds.jsonl`` (``records.FleetRoundRecord``), read
line by line through the schema, drawn as accuracy against rounds and against the modelled clock, with the
devices each round aggregated, one colour per run, and a table of each run's totals."""
from __future__ import annotations

import html
import math
from dataclasses import dataclass
from pathlib import Path

from edgetrain.errors import EdgetrainError
from edgetrain.records import FleetRoundRecord
from edgetrain.report.cells import img, table
from edgetrain.report.training import read_records

# Imported inside functions: edgetrain.report.plots (matplotlib), which only drawing a figure needs.

ROUNDS_FILE = "fleet-rounds.jsonl"
# the accuracy a fleet's round is scored by, first found: the server's on the whole test set, else the devices'
ACCURACY_KEYS = (("server_accuracy", "server, whole test set"),
                 ("federated_eval-accuracy", "devices' own test splits"))


@dataclass(frozen=True)
class FleetRounds:
    """A fleet run's rounds, read."""

    rounds: list[FleetRoundRecord]

    def accuracy(self) -> tuple[str, list[float]]:
        """(what it is, per round: NaN where the round was not scored) of the first ``ACCURACY_KEYS`` present."""
        for key, what in ACCURACY_KEYS:
            if any(key in r.scores for r in self.rounds):
                return what, [_number(r.scores.get(key)) for r in self.rounds]
        return "none", [math.nan] * len(self.rounds)


def _number(value) -> float:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else math.nan


def load_fleet(run_dir: Path) -> FleetRounds:
    rounds = read_records(run_dir / ROUNDS_FILE, FleetRoundRecord)
    if not rounds:
        raise EdgetrainError(f"{run_dir / ROUNDS_FILE} holds no round; was the run stopped before its first "
                             "round ended? re-run it or give another run directory")
    return FleetRounds(rounds)


def totals_row(name: str, fleet: FleetRounds) -> list:
    what, accuracy = fleet.accuracy()
    scored = [a for a in accuracy if not math.isnan(a)]
    walls = [r.measured_train_wall_s for r in fleet.rounds if r.measured_train_wall_s is not None]
    last = fleet.rounds[-1]
    return [name, len(fleet.rounds), last.devices, f"{100 * scored[-1]:.1f}%" if scored else "n/a",
            f"{100 * max(scored):.1f}%" if scored else "n/a", f"{last.modelled_clock_s:,.1f}",
            f"{sum(r.online for r in fleet.rounds) / len(fleet.rounds):,.0f}",
            sum(r.sampled for r in fleet.rounds), sum(r.aggregated for r in fleet.rounds),
            sum(r.dropouts for r in fleet.rounds), sum(r.late for r in fleet.rounds),
            f"{sum(r.bytes_up for r in fleet.rounds) / 1e6:,.1f}",
            f"{sorted(walls)[len(walls) // 2]:.2f}" if walls else "n/a"]


COLUMNS = ["run", "rounds", "devices", "final accuracy", "best accuracy", "modelled clock (s)", "online (mean)",
           "sampled", "aggregated", "dropouts", "late", "MB up", "measured round s (median)"]


def fleet_section(runs: list[tuple[str, FleetRounds]]) -> str:
    """The fleet runs' section: their curves on shared axes and their totals."""
    if not runs:
        return ""
    from edgetrain.report import plots

    whats = sorted({fleet.accuracy()[0] for _, fleet in runs})
    meta = (f"{len(runs)} fleet run(s) (fleet-rounds.jsonl); accuracy: {', '.join(whats)}; time on the fleet's "
            "clock is MODELLED (each sampled device's profile and link: the model down, its local steps, its update "
            "up; the round waits for the slowest kept device or the deadline); the measured round time is this "
            "machine's wall time of the round's training (Flower's simulation runtime)")
    figure = plots.plot_fleet_rounds([(name, fleet.rounds, fleet.accuracy()[1]) for name, fleet in runs])
    rows = [totals_row(name, fleet) for name, fleet in runs]
    return (f'<section><h2>Fleet rounds</h2><div class="meta">{html.escape(meta)}</div><div class="imgs">'
            f'{img(plots.png_bytes(figure), "fleet accuracy against rounds and modelled time")}</div>'
            f'{table(COLUMNS, rows)}</section>')
