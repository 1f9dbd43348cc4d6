"""Kill devices mid-run and measure what it cost: with elastic membership, or with checkpoints and resume.

Two runs of the same training (same seed, same data order): one fault-free,
and one with devices SIGKILLed (``EDGETRAIN_FAULT``, cluster/faults.py).

``--mode elastic`` (default; issue 12's benchmark): both runs with
``--min-devices 2``, so the fault-free one pays the same per-step state
snapshot. A device chosen at random (seeded; not the one killed last, which
may still be on its way back) is killed every 30-60 s of training (seeded)
and started again 20 s later (``kill:rank=R:step=S:back=20``, all faults in
one ``;``-separated value). Faults are injected at steps, so each time
(from the start of the run) is turned into the step the fault-free run had
reached then: modelled from that run's measured evaluation times, steps
spread evenly between them, not read off the clock of the chaos run. Printed, measured: wall time of each run; time to a target
test accuracy (``--target``, default 90% of the fault-free run's final
accuracy; from the train call to the moment the evaluation's line appears
in ``evals.jsonl``, polled every 0.1 s; evaluations happen once per epoch);
final test accuracy; kills done (``leave`` records) and rejoins (``join``);
steps lost per fault (steps some device trained twice or no device trained,
from the run's ``metrics.jsonl``, all devices' records: 0 when the state comes from a
peer); the time each membership change took (``took_s`` of
``membership.jsonl``: noticed to state restored); and issue 12's targets
with MET or MISSED.

``--mode restart``: fail-stop membership; after each kill (``--faults`` of
them, at seeded random steps) the run fails in one line and is continued
with ``--resume`` from its newest checkpoint. Printed, all measured:

* wall time of each run (the chaos run's includes the failed attempts, the
  launcher's stop and each resume's start-up), and the ratio;
* final test accuracy of both, and the largest difference between their
  final parameters (float rounding only: a resumed run computes the same
  steps, but DDP's first step after a resume sums some gradients in
  another order);
* per fault: the step killed, the checkpoint resumed from, the steps lost
  (trained again: fewer than ``--checkpoint-every``), and the time to
  recover (from starting ``--resume`` to the first new step on rank 0: the
  launch, the rendezvous and loading the checkpoint).

Usage (from the repository root)::

    PYTHONPATH=src python benchmarks/chaos.py                        # CIFAR-10 subset if present, else digits
    PYTHONPATH=src python benchmarks/chaos.py --mode restart --epochs 2
    PYTHONPATH=src python benchmarks/chaos.py --dataset digits --devices 2 --epochs 1 --faults 1 --mode restart
"""
from __future__ import annotations

import argparse
import json
import os
import random
import threading
import time
from bisect import bisect_left
from collections import Counter
from pathlib import Path

import torch

from edgetrain import train
from edgetrain.errors import EdgetrainError
from edgetrain.train.checkpoint import checkpoint_files, checkpoint_step

CIFAR = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "cifar10-subset" / "cifar-10-batches-py"


def first_new_step(run_dir: Path, after_step: int, started: float, found: dict, timeout_s: float = 600) -> None:
    """Poll rank 0's live metrics until the resumed run has rewritten them (a new file: atomic rename) and
    trained a step from ``after_step`` on; note when (bounded)."""
    live = run_dir / "metrics-0.jsonl"
    killed_runs_file = live.stat().st_ino if live.exists() else None
    while time.perf_counter() - started < timeout_s and "at" not in found:
        try:
            if live.stat().st_ino != killed_runs_file and any(
                    json.loads(line)["step"] >= after_step for line in live.read_text().splitlines() if line):
                found["at"] = time.perf_counter()
                return
        except (OSError, ValueError):
            pass  # being rewritten at this moment: look again
        time.sleep(0.05)


def final(run_dir: Path) -> tuple[dict, float | None]:
    summary = json.loads((run_dir / "summary.json").read_text())
    model = torch.load(run_dir / "checkpoint.pt", weights_only=True)["model"]
    return model, summary["test_accuracy"]


def watch_evals(run_dir: Path, started: float, seen: list, stop: threading.Event) -> None:
    """Note (seconds since ``started``, test accuracy, step) as each evaluation's line appears in ``evals.jsonl``."""
    path = run_dir / "evals.jsonl"
    while not stop.is_set():
        try:
            lines = [line for line in path.read_text().splitlines() if line.strip()]
        except OSError:
            lines = []
        for line in lines[len(seen):]:
            record = json.loads(line)
            seen.append((time.perf_counter() - started, record["test_accuracy"], record["step"]))
        stop.wait(0.1)


def timed_run(cfg: dict, name: str) -> dict:
    """``train`` with its evaluations timed; what the elastic report needs from the run directory."""
    run_dir, seen, stop = Path(cfg["output"]) / name, [], threading.Event()
    started = time.perf_counter()
    watcher = threading.Thread(target=watch_evals, args=(run_dir, started, seen, stop), daemon=True)
    watcher.start()
    try:
        summary = train(cfg, run_name=name)
    finally:
        stop.set()
        watcher.join()
    wall_s = time.perf_counter() - started
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    membership = [json.loads(line) for line in (run_dir / "membership.jsonl").read_text().splitlines()
                  if line.strip()] if (run_dir / "membership.jsonl").exists() else []
    return {"summary": summary, "wall_s": wall_s, "evals": seen, "records": records, "membership": membership}


def steps_lost(records: list[dict], total_steps: int) -> int:
    """Steps with two records of one rank (trained again after a change) or with none."""
    per_rank = Counter((r["rank"], r["step"]) for r in records)
    redone = {step for (_, step), n in per_rank.items() if n > 1}
    return len(redone) + len(set(range(total_steps)) - {r["step"] for r in records})


def fault_schedule(args, clean: dict) -> list[tuple[int, int]]:
    """(rank, step) of each kill: every ``--every`` seconds (seeded) from the start of the run, at the step the
    fault-free run had reached then (between its evaluations, whose times are measured, steps are assumed
    evenly spread); never the device killed last; none in the last 2 x ``--back`` seconds."""
    times = [0.0] + [t for t, _, _ in clean["evals"]]
    steps = [0] + [step for _, _, step in clean["evals"]]
    low, high = (float(x) for x in args.every.split("-"))
    rng, at, faults = random.Random(args.seed), 0.0, []
    while True:
        at += rng.uniform(low, high)
        if at > times[-1] - 2 * args.back:  # leave time to come back
            return faults
        k = bisect_left(times, at)  # between evaluations k - 1 and k
        step = int(steps[k - 1] + (steps[k] - steps[k - 1]) * (at - times[k - 1]) / (times[k] - times[k - 1]))
        rank = rng.choice([d for d in range(args.devices) if not faults or d != faults[-1][0]])
        faults.append((rank, step))


def elastic(args, cfg: dict) -> None:
    """Survivors go on without a restart; killed devices come back ``--back`` s later and get the state from a
    peer."""
    clean = timed_run(cfg, "fault-free")
    total_steps = clean["summary"]["steps"]
    faults = fault_schedule(args, clean)
    if not faults:
        print(f"no kill fits in {total_steps} steps with kills every {args.every} s: give more --epochs")
    os.environ["EDGETRAIN_FAULT"] = ";".join(f"kill:rank={r}:step={s}:back={args.back:g}" for r, s in faults)
    try:
        chaos = timed_run(cfg, "chaos")
    except EdgetrainError as e:
        chaos = None
        print(f"the chaos run was lost: {e}")
    finally:
        os.environ.pop("EDGETRAIN_FAULT")
    target = args.target if args.target is not None else 0.9 * clean["summary"]["test_accuracy"]
    print(f"{args.devices} devices, {args.dataset}, {args.epochs} epochs ({total_steps} steps), --min-devices "
          f"{args.min_devices}, sync; kills every {args.every} s of training, back after {args.back:g} s "
          f"(seed {args.seed}); target test accuracy {target:.2%}")
    print(f"planned kills (device@step): {', '.join(f'{r}@{s}' for r, s in faults)}")
    verdicts = {}
    for name, run in (("fault-free", clean), ("with kills", chaos)):
        if run is None:
            continue
        reached = next((t for t, acc, _ in run["evals"] if acc >= target), None)
        run["to_target_s"] = reached
        leaves = [m for m in run["membership"] if m["kind"] == "leave"]
        joins = [m for m in run["membership"] if m["kind"] == "join"]
        lost = steps_lost(run["records"], total_steps)
        print(f"{name}: {run['wall_s']:.1f} s, time to target "
              + (f"{reached:.1f} s" if reached is not None else "not reached")
              + f", final test accuracy {run['summary']['test_accuracy']:.2%}, steps {run['summary']['steps']}, "
              f"{len(leaves)} kills seen, {len(joins)} rejoins, {lost} steps lost")
        for m in run["membership"]:
            print(f"  step {m['step']}: device(s) {m['devices']} {m['kind']}, {m['world']} devices on, "
                  f"state from {m['state_from']}, took {m['took_s']:.1f} s")
        run["lost_per_fault"] = lost / len(leaves) if leaves else 0.0
    if chaos is None:
        verdicts["no run lost"] = False
    else:
        ratio = (chaos["to_target_s"] / clean["to_target_s"]
                 if chaos["to_target_s"] is not None and clean["to_target_s"] is not None else float("inf"))
        gap = abs(chaos["summary"]["test_accuracy"] - clean["summary"]["test_accuracy"])
        changes = [m["took_s"] for m in chaos["membership"]]
        verdicts[f"time to target <= 1.25x fault-free ({ratio:.2f}x)"] = ratio <= 1.25
        verdicts[f"final accuracy within 1 pp ({100 * gap:.2f} pp)"] = gap <= 0.01
        verdicts["no run lost (every step trained, all kills seen)"] = (
            chaos["summary"]["steps"] == total_steps
            and sum(m["kind"] == "leave" for m in chaos["membership"]) == len(faults) > 0)
        verdicts[f"steps lost per fault 0, state from peers ({chaos['lost_per_fault']:.2f})"] = (
            chaos["lost_per_fault"] == 0 and all(m["state_from"] == "peer" for m in chaos["membership"]))
        verdicts[f"membership change under 10 s (longest {max(changes, default=0):.1f} s)"] = (
            max(changes, default=0) < 10)
    print("targets (issue 12):")
    for what, met in verdicts.items():
        print(f"  {'MET   ' if met else 'MISSED'} {what}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mode", choices=("elastic", "restart"), default="elastic")
    ap.add_argument("--dataset", choices=("cifar10", "digits"), default="cifar10" if CIFAR.is_dir() else "digits")
    ap.add_argument("--devices", type=int, default=4)
    ap.add_argument("--epochs", type=int, default=10)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--checkpoint-every", type=int, default=10, help="restart mode")
    ap.add_argument("--faults", type=int, default=2, help="restart mode")
    ap.add_argument("--every", default="30-60", help="elastic mode: seconds between kills, MIN-MAX")
    ap.add_argument("--back", type=float, default=20, help="elastic mode: seconds until a killed device is started")
    ap.add_argument("--min-devices", type=int, default=2, help="elastic mode")
    ap.add_argument("--target", type=float, default=None, help="elastic mode: test accuracy to reach (0-1)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--output", default="/tmp/edgetrain-chaos")
    args = ap.parse_args()

    cfg = dict(model="small_cnn", dataset=args.dataset, devices=args.devices, epochs=args.epochs,
               batch_size=args.batch_size, throttle=False, progress=False, timeout=60, seed=args.seed,
               output=str(Path(args.output) / time.strftime("%Y%m%d-%H%M%S")))
    if args.dataset == "cifar10":
        cfg["data_dir"] = str(CIFAR)
    os.environ.pop("EDGETRAIN_FAULT", None)
    print(f"load average before: {' '.join(f'{x:.1f}' for x in os.getloadavg())} on {os.cpu_count()} cores", flush=True)
    if args.mode == "elastic":
        elastic(args, {**cfg, "min_devices": args.min_devices})
    else:
        restart(args, {**cfg, "checkpoint_every": args.checkpoint_every, "keep_checkpoints": 2})
    print(f"load average after: {' '.join(f'{x:.1f}' for x in os.getloadavg())}")


def restart(args, cfg: dict) -> None:
    """Fail-stop membership: each kill ends the run, which ``--resume`` continues from its newest checkpoint."""
    t0 = time.perf_counter()
    clean = Path(train(cfg, run_name="fault-free")["run_dir"])
    clean_s = time.perf_counter() - t0
    total_steps = json.loads((clean / "summary.json").read_text())["steps"]

    rng = random.Random(args.seed)
    fault_steps = sorted(rng.sample(range(args.checkpoint_every + 1, total_steps), args.faults))
    faults = []
    run_dir, t0 = None, time.perf_counter()
    for step in fault_steps + [None]:
        if step is None:
            os.environ.pop("EDGETRAIN_FAULT", None)
        else:
            rank = rng.randrange(args.devices)
            os.environ["EDGETRAIN_FAULT"] = f"kill:rank={rank}:step={step}"
        resumed_from = checkpoint_step(checkpoint_files(run_dir)[-1]) if run_dir else None
        started, found = time.perf_counter(), {}
        if run_dir:
            watcher = threading.Thread(target=first_new_step, args=(run_dir, resumed_from, started, found), daemon=True)
            watcher.start()
        try:
            if run_dir is None:
                train(cfg, run_name="chaos")
            else:
                train({"resume": str(run_dir)})
            failed_at = None
        except EdgetrainError as e:
            failed_at = time.perf_counter()
            message = str(e)
        if run_dir and faults:
            faults[-1]["recover_s"] = found.get("at", float("nan")) - started
        run_dir = Path(cfg["output"]) / "chaos"
        if step is not None:
            assert failed_at is not None, "the injected kill did not stop the run"
            faults.append({"rank": rank, "step": step, "message": message,
                           "checkpoint": checkpoint_step(checkpoint_files(run_dir)[-1])})
    chaos_s = time.perf_counter() - t0

    clean_model, clean_acc = final(clean)
    chaos_model, chaos_acc = final(run_dir)
    # Not bit-equal in general: DDP rebuilds its gradient buckets in a resumed run's first step, which
    # changes the order gloo sums some gradient entries in (float rounding, ~1e-7).
    gap = max((clean_model[k].double() - chaos_model[k].double()).abs().max().item() for k in clean_model)
    print(f"{args.devices} devices, {args.dataset}, {args.epochs} epochs ({total_steps} steps), "
          f"checkpoint every {args.checkpoint_every} steps, {args.faults} kills (seed {args.seed})")
    print(f"fault-free: {clean_s:.1f} s, test accuracy {clean_acc:.2%}")
    print(f"with kills: {chaos_s:.1f} s ({chaos_s / clean_s:.2f}x), test accuracy {chaos_acc:.2%}, "
          f"final parameters differ from the fault-free run's by at most {gap:.2g}")
    for f in faults:
        print(f"  killed device {f['rank']} at step {f['step']}: resumed from step {f['checkpoint']}, "
              f"{f['step'] - f['checkpoint']} steps lost, {f['recover_s']:.1f} s from --resume to the first new step")
        print(f"    the failed attempt said: {f['message']}")


if __name__ == "__main__":
    main()
