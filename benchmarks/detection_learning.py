"""Does ``edgetrain train --task detection --devices 2`` learn, with its own defaults, in under 10 minutes?

    PYTHONPATH=src python benchmarks/detection_learning.py [--out benchmarks/results/detection_learning.json]
        [--plot docs/images/detection-learning.png]

Runs exactly that command (the task's defaults: the embedded ``shapes`` set, ``yolov2_tiny_small`` at
128x128, see its descriptor in ``kinds.py``), timestamps each evaluation line as the trainer prints it, and reports
the test mAP@0.5 and mAP@0.5:0.95 (pycocotools' COCOeval) after every epoch, read from the run's
``summary.json``, with the wall time from the command's start. Target: mAP@0.5 >= 0.5 within 600 s.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

TARGET_MAP50, LIMIT_S = 0.5, 600.0


def plot(rows: list[dict], path: str) -> None:
    """mAP@0.5 and mAP@0.5:0.95 against wall time, one point per epoch."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.4), dpi=110)
    t = [r["elapsed_s"] for r in rows]
    ax.plot(t, [r["map50"] for r in rows], "o-", label="mAP@0.5")
    ax.plot(t, [r["map50_95"] for r in rows], "s-", label="mAP@0.5:0.95")
    for r in rows:
        ax.annotate(str(r["epoch"]), (r["elapsed_s"], r["map50"]), textcoords="offset points", xytext=(0, 6),
                    ha="center", fontsize=7)
    ax.axhline(TARGET_MAP50, color="grey", lw=0.8, ls="--")
    ax.axvline(LIMIT_S, color="grey", lw=0.8, ls=":")
    ax.set(xlabel="seconds since the command started", ylabel="test mAP (COCOeval)", ylim=(0, 1),
           xlim=(0, max(LIMIT_S, max(t)) * 1.02),
           title="edgetrain train --task detection --devices 2 (epochs numbered)")
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", help="also write the results as JSON here")
    ap.add_argument("--plot", help="also draw the mAP per epoch against time into this PNG")
    ap.add_argument("--plot-from", help="draw --plot from this results JSON instead of running")
    args = ap.parse_args()
    if args.plot_from:
        plot(json.loads(Path(args.plot_from).read_text())["epochs"], args.plot)
        return 0
    out_dir = Path(tempfile.mkdtemp(prefix="detection-learning-"))
    command = [sys.executable, "-m", "edgetrain", "train", "--task", "detection", "--devices", "2",
               "--output", str(out_dir), "--run-name", "run", "--no-progress"]
    print("command: edgetrain train --task detection --devices 2  (output in a temporary directory)", flush=True)
    started = time.perf_counter()
    stamps = []
    with subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          env=dict(os.environ)) as proc:
        for line in proc.stdout:
            print("  | " + line.rstrip(), flush=True)
            if line.startswith("epoch ") and "test" in line:
                stamps.append(time.perf_counter() - started)
    wall = time.perf_counter() - started
    if proc.returncode != 0:
        print(f"the run failed (exit {proc.returncode})")
        return 1
    summary = json.loads((out_dir / "run" / "summary.json").read_text())
    rows = []
    print(f"\n{'epoch':>5} {'step':>5} {'mAP@0.5':>8} {'mAP@.5:.95':>10} {'test loss':>10} {'elapsed s':>10}")
    for record, at in zip(summary["evals"], stamps):
        m = record["metrics"]
        # epochs counted from 1, as the trainer prints them (records count from 0)
        rows.append({"epoch": record["epoch"] + 1, "step": record["step"], "map50": m["map50"],
                     "map50_95": m["map50_95"], "test_loss": record["test_loss"], "elapsed_s": at})
        print(f"{record['epoch'] + 1:>5} {record['step']:>5} {m['map50']:>8.3f} {m['map50_95']:>10.3f} "
              f"{record['test_loss']:>10.3f} {at:>10.0f}")
    first = next((r for r in rows if r["map50"] >= TARGET_MAP50), None)
    met = first is not None and first["elapsed_s"] < LIMIT_S
    print(f"\nwhole command {wall:.0f} s; mAP@0.5 >= {TARGET_MAP50} first after epoch "
          f"{first['epoch'] if first else '-'} at {first['elapsed_s']:.0f} s" if first else
          f"\nwhole command {wall:.0f} s; mAP@0.5 never reached {TARGET_MAP50}")
    print(f"target (mAP@0.5 >= {TARGET_MAP50} in under {LIMIT_S:.0f} s): {'met' if met else 'NOT met'}")
    if args.plot:
        plot(rows, args.plot)
    if args.out:
        keep = {k: summary.get(k) for k in ("model", "dataset", "input_shape", "devices", "global_batch", "steps",
                                              "params", "throughput_samples_per_s", "wall_time_s")}
        Path(args.out).write_text(json.dumps({"command": "edgetrain train --task detection --devices 2",
                                              "wall_s": wall, "epochs": rows, "target_met": met,
                                              "config": summary.get("config"), **keep}, indent=2) + "\n")
    return 0 if met else 1


if __name__ == "__main__":
    sys.exit(main())
