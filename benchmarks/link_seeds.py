"""The shaped-link runs of benchmarks/diloco.py over several seeds: speed-up to fp32's target and the virtual
clock's error, each with its one-sided 95% bound as benchmarks/paired.py reads a target.

Reads the ``--results`` .json files of ``diloco.py --link-methods fp32,METHOD`` runs (one or more seeds each) and
prints, per model and seed, METHOD's measured speed-up to fp32's target over fp32 on the shaped link and every run's
measured / predicted clock (time to the target and at the end); then over the seeds:

- speed-up: the geometric mean and the one-sided 95% lower bound of the mean log speed-up (Student's t,
  ``paired.lower_bound``), exponentiated; the target (>= 30x) is met with confidence when that bound is;
- measured / predicted, per method: the mean and both one-sided 95% bounds of the mean log ratio (a 90% interval); the
  target (within 15%) is met with confidence when the interval lies within 0.85 to 1.15.

Usage::

    python benchmarks/link_seeds.py /tmp/cc/bench/mlp*/diloco.json
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from paired import lower_bound  # noqa: E402


def bounds(logs: list[float]) -> tuple[float, float, float]:
    """(geometric mean, one-sided 95% lower bound, upper bound) of the values whose logs are ``logs``."""
    mean = float(np.mean(logs))
    return math.exp(mean), math.exp(lower_bound(logs)), math.exp(-lower_bound([-x for x in logs]))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("results", type=Path, nargs="+", help="diloco.py --results .json files with a link part")
    p.add_argument("--method", default="sparseloco16-lr3")
    args = p.parse_args()
    by_model: dict[str, tuple[dict, dict]] = {}
    for path in args.results:
        results = json.loads(path.read_text())
        measured, predicted = by_model.setdefault(results["args"].get("model", "edgecnn"), ({}, {}))
        for r in results["link"]["measured"]:
            measured[(r["label"], r["seed"])] = r
        for r in results["link"]["predicted"]:
            predicted[(r["label"], r["seed"])] = r
    for model, (measured, predicted) in by_model.items():
        print(f"model {model}")
        summarise(measured, predicted, args.method)
    return 0


def summarise(measured: dict, predicted: dict, method: str) -> None:
    seeds = sorted(s for label, s in measured if label == method and ("fp32", s) in measured)
    speedups, ratios = [], {(label, name): [] for label in ("fp32", method) for name in ("t->target", "end")}
    print(f"{'seed':>4} {'fp32 t->target s':>16} {method + ' s':>22} {'speed-up':>9}   measured / predicted "
          f"(t->target, end): fp32, {method}")
    for seed in seeds:
        base, run = measured[("fp32", seed)], measured[(method, seed)]
        tb, tm = base["time_to_target_s"], run["time_to_target_s"]
        speedup = tb / tm if tb and tm else None
        if speedup:
            speedups.append(math.log(speedup))
        cells = []
        for label in ("fp32", method):
            m, pr = measured[(label, seed)], predicted[(label, seed)]
            t = m["time_to_target_s"] / pr["time_to_target_s"] if m["time_to_target_s"] and pr["time_to_target_s"] \
                else None
            end = m["curve"][-1][0] / pr["curve"][-1][0]
            if t:
                ratios[(label, "t->target")].append(math.log(t))
            ratios[(label, "end")].append(math.log(end))
            cells.append(f"{'-' if t is None else f'{t:.2f}'}, {end:.2f}")
        print(f"{seed:4} {'never' if tb is None else f'{tb:.1f}':>16} {'never' if tm is None else f'{tm:.1f}':>22} "
              f"{'-' if speedup is None else f'{speedup:.1f}x':>9}   {cells[0]}; {cells[1]}")
    if len(speedups) < len(seeds):
        print(f"{len(seeds) - len(speedups)} seed(s) of {len(seeds)} never reached fp32's target: no speed-up, and "
              f"the bounds below leave them out")
    if len(speedups) >= 2:
        mean, low, _ = bounds(speedups)
        print(f"speed-up over {len(speedups)} seeds: geometric mean {mean:.1f}x, one-sided 95% lower bound {low:.1f}x "
              f"(target >= 30x: {'met' if low >= 30 else 'not met'} with confidence; mean "
              f"{'meets' if mean >= 30 else 'misses'} it)")
    for (label, name), logs in ratios.items():
        if len(logs) >= 2:
            mean, low, high = bounds(logs)
            inside = 0.85 <= low and high <= 1.15
            print(f"measured / predicted, {label}, {name} ({len(logs)} seeds): mean {mean:.2f}, 90% interval "
                  f"{low:.2f} to {high:.2f} (target within 15%: {'met' if inside else 'not met'} with confidence)")


if __name__ == "__main__":
    sys.exit(main())
