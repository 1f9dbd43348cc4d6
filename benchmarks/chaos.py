"""Kill devices mid-run, resume from the last checkpoint, and measure what it cost.

Two runs of the same training (same seed, same data order): one fault-free,
and one where a device chosen at random (seeded) is SIGKILLed at a random
step (``EDGETRAIN_FAULT=kill:rank=R:step=S``, cluster/faults.py) ``--faults``
times. After each kill the run fails (one line, as any lost device does
today: membership is fail-stop) and is continued with ``--resume`` from its
newest checkpoint. Printed, all measured:

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

Elastic membership (survivors continue without a restart) is not built yet,
so no step is saved by peers here; this measures the checkpoint path only.

Usage (from the repository root)::

    PYTHONPATH=src python benchmarks/chaos.py                        # CIFAR-10 subset if present, else digits
    PYTHONPATH=src python benchmarks/chaos.py --dataset digits --devices 2 --epochs 1 --faults 1
"""
from __future__ import annotations

import argparse
import json
import os
import random
import threading
import time
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dataset", choices=("cifar10", "digits"), default="cifar10" if CIFAR.is_dir() else "digits")
    ap.add_argument("--devices", type=int, default=4)
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--checkpoint-every", type=int, default=10)
    ap.add_argument("--faults", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--output", default="/tmp/edgetrain-chaos")
    args = ap.parse_args()

    cfg = dict(model="small_cnn", dataset=args.dataset, devices=args.devices, epochs=args.epochs,
               batch_size=args.batch_size, throttle=False, progress=False, timeout=60, seed=args.seed,
               checkpoint_every=args.checkpoint_every, keep_checkpoints=2,
               output=str(Path(args.output) / time.strftime("%Y%m%d-%H%M%S")))
    if args.dataset == "cifar10":
        cfg["data_dir"] = str(CIFAR)
    os.environ.pop("EDGETRAIN_FAULT", None)

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
