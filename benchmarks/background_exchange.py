"""Background exchanges beside evaluation and checkpoints, on devices of unequal speed: repeated runs, pass counts.

Every sync mode that exchanges in the background (its kind's ``timing`` is ``bounded`` or ``background`` in
``edgetrain.kinds``: today ``async:S`` and ``streaming:H``) trains each task (classification, regression,
detection) on a host device and a Raspberry Pi 4 throttled to a tenth of a host core (so that one device is
the slow one whatever else loads the host), 9 steps with an evaluation after steps 8 and 9, every other run
with a checkpoint every 3 steps, ``--repeats`` times. A run passes when it ends
with its summary; a hang is bounded by ``--timeout`` (every collective) and counted as a failure with its line.
Before settling (``SyncMode.settle``), ``async:2`` with detection hung every time on such a pair.

Usage (from the repository root)::

    .venv/bin/python benchmarks/background_exchange.py --repeats 20

Prints one row per (mode, task) and writes every run to ``--out`` (JSON), with the host's load averages
before and after, as the runs are timing-dependent.
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"
sys.path.insert(0, str(SRC))

from edgetrain import train  # noqa: E402
from edgetrain.errors import EdgetrainError  # noqa: E402
from edgetrain.spec import KINDS  # noqa: E402

BACKGROUND = ("bounded", "background")  # the kinds' timings of modes that exchange while the devices train
SETTINGS = {"async": "async:2", "streaming": "streaming:4"}  # each mode's setting here (another: NAME:2)
# 8 steps an epoch each, 9 steps: evaluations at steps 8 and 9 (the slow device is 4+ rounds behind by then)
TASKS = {"classification": dict(dataset="synthetic", synthetic_samples=64, image_size=16, batch_size=8),
         "regression": dict(task="regression", batch_size=40),
         "detection": dict(task="detection", synthetic_samples=64, image_size=32, batch_size=8)}
RUN = dict(steps=9, progress=False, lr=0.01)
CLUSTER = "profiles:\n  slow: {base: rpi4, speed: 0.1}\ndevices: [{profile: host}, {profile: slow}]\n"


def background_modes() -> list[str]:
    """The ``--sync`` setting of every registered mode that exchanges in the background."""
    return [SETTINGS.get(kind.name, f"{kind.name}:2") for kind in KINDS["sync"].values() if kind.timing in BACKGROUND]


def one_run(cluster: Path, sync: str, task: str, output: str, timeout_s: float, seed: int) -> dict:
    started = time.perf_counter()
    try:
        summary = train(dict(cluster=str(cluster), sync=sync, output=output, timeout=timeout_s, seed=seed,
                             checkpoint_every=3 if seed % 2 else None, **RUN, **TASKS[task]))
        ok, line = summary["steps"] == RUN["steps"], ""
    except EdgetrainError as e:
        ok, line = False, str(e)
    return {"sync": sync, "task": task, "seed": seed, "passed": ok, "wall_s": round(time.perf_counter() - started, 2),
            "error": line}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--modes", default=",".join(background_modes()))
    parser.add_argument("--tasks", default=",".join(TASKS))
    parser.add_argument("--timeout", type=float, default=30.0, help="every collective's bound, seconds")
    parser.add_argument("--out", default="benchmarks/results/background_exchange.json")
    args = parser.parse_args(argv)
    load_before = os.getloadavg()
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        cluster = Path(tmp) / "cluster.yaml"
        cluster.write_text(CLUSTER)
        for sync in args.modes.split(","):
            for task in args.tasks.split(","):
                for repeat in range(args.repeats):
                    run = one_run(cluster, sync, task, str(Path(tmp) / "runs"), args.timeout, seed=repeat)
                    runs.append(run)
                    print(f"{sync:12} {task:15} run {repeat + 1:2}: {'pass' if run['passed'] else 'FAIL'} "
                          f"{run['wall_s']:6.1f} s {run['error']}", flush=True)
    print(f"\n{'mode':12} {'task':15} passed")
    for sync in args.modes.split(","):
        for task in args.tasks.split(","):
            mine = [r for r in runs if r["sync"] == sync and r["task"] == task]
            print(f"{sync:12} {task:15} {sum(r['passed'] for r in mine)}/{len(mine)}")
    result = {"date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"), "host": platform.node(),
              "cpus": os.cpu_count(), "load_before": load_before, "load_after": os.getloadavg(),
              "cluster": CLUSTER, "run": RUN, "tasks": TASKS, "runs": runs}
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(f"load averages (1, 5, 15 min): before {load_before}, after {os.getloadavg()} on {os.cpu_count()} CPUs")
    return 0 if all(r["passed"] for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
