"""The Jetson position paper's experiment (Prashanthi et al.): data stalls, power modes, per-instance variability.

    PYTHONPATH=src python benchmarks/papers/jetson_paper.py [--fast] [--out FILE.json]

1. Data stalls on NVMe against HDD for 0 to 4 loader workers (measured with ``edgetrain bench stalls``: the
   same image folder read through training's own loader, each storage's data-sheet read rate and IOPS
   enforced on this process where the host allows, cold and warm page cache).
2. Power modes as an energy/time trade-off: not emulated (see the row).
3. Training time per epoch across device instances (measured with ``edgetrain bench variability``: repeated
   runs of the same training on this host; their spread is this host's, not a board's).
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import NOT_REPORTED, Row, parse_arguments, runs_folder, report  # noqa: E402

PAPER = "Prashanthi et al., DNN training on Jetson devices (the Jetson position paper)"


def stalls(output: str, fast: bool) -> dict:
    from edgetrain.bench import stalls as bench

    return bench.run(None, "small_cnn", batch_size=32, epoch_samples=64 if fast else 256,
                     workers=(0,) if fast else (0, 2, 4), storages=("nvme", "hdd"), output=output,
                     name="jetson-stalls").to_dict()


def variability(output: str, fast: bool) -> dict:
    from edgetrain.bench import variability as bench

    return bench.run("small_cnn", "cifar10", repeats=2 if fast else 3, batch_size=32, steps=2 if fast else 6,
                     warmup=1, threads=1, output=output, name="jetson-variability").to_dict()


def stall_rows(result: dict) -> list[Row]:
    rows = []
    for r in result["rows"]:
        if r["cache"] != "cold":
            continue
        note = "" if r["throttled"] else "this host's disk, not throttled to the storage's rate (see the bench's notes)"
        rows.append(Row(f"stall, {r['storage']}, {r['workers']} workers, cold cache", NOT_REPORTED,
                        f"{100 * r['stall_fraction']:.0f}% of the pass ({r['train_samples_per_s']:.0f} samples/s, "
                        f"{r['limiting_stage']}-bound)", "measured", note))
    rows.append(Row("does HDD with more workers match NVMe?", "stalls depend on storage and worker count (the issue)",
                    result["verdict"], "measured"))
    return rows


def main(argv: list[str] | None = None) -> int:
    args, started = parse_arguments(__doc__, "small passes (the test suite's version)",
                                    "where the bench runs go (default: a temporary folder)", argv)
    with runs_folder(PAPER, args.runs) as runs:
        print("\n1. Data stalls, NVMe against HDD, by loader workers (measured)")
        stall = stalls(runs, args.fast)
        print("\n3. Time per step across repeated runs (measured)")
        spread = variability(runs, args.fast)
    rows = stall_rows(stall)
    rows.append(Row("power modes: energy against time", "a trade-off across the Jetson's power modes (the issue)",
                    "not emulated", "modelled",
                    "a power mode sets cores online and clocks; the emulation throttles compute but has no sourced "
                    "power model for the Jetson profiles (docs/reference/profiles.md: NVIDIA gives budgets, not "
                    "draws), so no joules are claimed; edgetrain bench power measures a real board's sensors"))
    s = spread["summary"]
    rows.append(Row("training time per epoch across device instances",
                    "consistent across device instances (the issue)",
                    f"CV across runs {100 * (s.get('cv_across_runs') or 0):.2f}%, within a run "
                    f"{100 * (s.get('cv_within_mean') or 0):.2f}%", "measured",
                    "repeated runs on one emulating host measure this host's noise under its load, not the spread "
                    "between boards of one model, which emulation cannot show"))
    return report(PAPER, rows, started, args.out, {"stalls": stall, "variability": spread})


if __name__ == "__main__":
    sys.exit(main())
