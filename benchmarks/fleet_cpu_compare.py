"""A round's CPU cost on Flower's simulation runtime against edgetrain's own federated mode, from
``fleet_sim.py`` results (``--json``): for each mode and fleet size, the in-run slope (CPU seconds between rounds'
ends after the warm-up, every process of the run counted) of each run, and, where runs of two lengths exist, the
difference of their whole runs' CPU seconds per extra round; then the simulation's ratio to the own mode.

Usage (from the repository root)::

    python benchmarks/fleet_cpu_compare.py benchmarks/results/fleet_cpu_*.json
"""
from __future__ import annotations

import json
import sys
from collections import defaultdict
from pathlib import Path
from statistics import mean


def load(paths: list[str]) -> dict[tuple[str, int], list[dict]]:
    """The results by (mode, devices)."""
    runs: dict[tuple[str, int], list[dict]] = defaultdict(list)
    for path in paths:
        result = json.loads(Path(path).read_text())
        result["file"] = Path(path).name
        runs[(result["mode"], result["devices"])].append(result)
    return runs


def difference_per_round(results: list[dict]) -> float | None:
    """(mean CPU of the longest runs - mean CPU of the shortest) / the rounds between; None with one length."""
    lengths = sorted({r["rounds"] for r in results})
    if len(lengths) < 2:
        return None
    cpu = {n: mean(r["measured_cpu_s"] for r in results if r["rounds"] == n) for n in (lengths[0], lengths[-1])}
    return (cpu[lengths[-1]] - cpu[lengths[0]]) / (lengths[-1] - lengths[0])


def summary(runs: dict[tuple[str, int], list[dict]]) -> dict[tuple[str, int], dict]:
    rows = {}
    for key, results in sorted(runs.items(), key=lambda item: (item[0][1], item[0][0])):
        slopes = [r["measured_cpu_s_per_round"] for r in results if r["measured_cpu_s_per_round"] is not None]
        rows[key] = {"runs": ", ".join(f"{r['file']} ({r['rounds']} rounds, {r['measured_cpu_s']:.2f} CPU s, "
                                       f"load {r['load_average_1min_mean']:.1f})" for r in results),
                     "slopes": slopes, "slope": mean(slopes) if slopes else None,
                     "difference": difference_per_round(results)}
    return rows


def main() -> None:
    rows = summary(load(sys.argv[1:]))
    print("| mode | devices | CPU s a round (slope, each run) | mean | per device-round | CPU s a round "
          "(2 against 12 rounds) | runs |")
    print("|---|---|---|---|---|---|---|")
    for (mode, devices), row in rows.items():
        slope, diff = row["slope"], row["difference"]
        print(f"| {mode} | {devices} | {', '.join(f'{s:.3f}' for s in row['slopes'])} | "
              f"{slope:.3f} | {slope / devices * 1000:.1f} ms | {'-' if diff is None else f'{diff:.3f}'} | "
              f"{row['runs']} |")
    for devices in sorted({d for _, d in rows}):
        sim = rows.get(("Flower simulation (Ray)", devices))
        own = rows.get(("edgetrain train --sync fedavg", devices))
        if sim and own and sim["slope"] and own["slope"]:
            print(f"{devices} devices: the simulation's round costs {sim['slope'] / own['slope']:.2f}x the own "
                  f"mode's CPU seconds (slopes)" + (
                      f", {sim['difference'] / own['difference']:.2f}x (2 against 12 rounds)"
                      if sim["difference"] and own["difference"] else ""))


if __name__ == "__main__":
    main()
