"""FedAvg, FedProx, SCAFFOLD and top-k on a simulated fleet, with and without churn, over several seeds.

Each run is one ``benchmarks/fleet_sim.py`` (Flower's simulation engine on Ray) with the same fleet: 1,000
devices, Dirichlet(0.5) label skew over 64,000 synthetic 16x16 images, 20 devices sampled a round, 5 local
steps of batch 8, the server scoring the global model on the 16,000 test images after every round. The runs
go one after another (this machine has 2 cores); each writes its records to ``OUT/ALGORITHM-AVAILABILITY-sSEED``
and the summary goes to ``OUT/summary.json`` and stdout: for each run the round, and the modelled clock, at
which the server's accuracy first reached 90% and 99% (this synthetic task is learnt to 100% within 30
rounds, so how soon is what tells the algorithms apart), the final accuracy and the mean of the last rounds
(measured), dropouts and the bytes sent up (counted).

Usage (from the repository root; hours on a 2-core machine)::

    PYTHONPATH=src nice -n 10 python benchmarks/fleet_algorithms.py --rounds 30 --seeds 0,1 \\
        --out benchmarks/results/fleet_algorithms_r30
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

ALGORITHMS = {"fedavg": {}, "fedprox": {"prox-mu": 0.01}, "scaffold": {"scaffold": True},
              "topk": {"compress": "topk:0.1"}}
AVAILABILITY = {"full": "always", "churn": "onoff:5s:5s"}
HERE = Path(__file__).resolve().parent


def run_one(out: Path, algorithm: str, availability: str, seed: int, rounds: int) -> Path:
    run_dir = out / f"{algorithm}-{availability}-s{seed}"
    if (run_dir / "fleet-rounds.jsonl").exists() and len(records(run_dir)) >= rounds:
        return run_dir  # done in an earlier invocation
    config = {"partition": "dirichlet:0.5", "synthetic-samples": 64000, "output-dir": str(run_dir), "seed": seed,
              **ALGORITHMS[algorithm]}
    cmd = [sys.executable, str(HERE / "fleet_sim.py"), "--devices", "1000", "--per-round", "20", "--rounds",
           str(rounds), "--availability", AVAILABILITY[availability], "--config", json.dumps(config),
           "--json", str(out / f"{algorithm}-{availability}-s{seed}.json")]
    start = time.perf_counter()
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    print(f"{run_dir.name}: {time.perf_counter() - start:.0f} s", flush=True)
    return run_dir


def records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "fleet-rounds.jsonl").read_text().splitlines()]


def first_reaching(rows: list[dict], target: float) -> tuple[int | None, float | None]:
    """(round, modelled clock) at which the server's accuracy first reached ``target`` (None: never)."""
    hit = next((r for r in rows if r["server_accuracy"] >= target), None)
    return (hit["round"], hit["modelled_clock_s"]) if hit else (None, None)


def summarise(run_dir: Path, last: int) -> dict:
    rows = records(run_dir)
    accuracy = [r["server_accuracy"] for r in rows]
    to_90, to_99 = first_reaching(rows, 0.90), first_reaching(rows, 0.99)
    return {"rounds": len(rows), "final_accuracy": accuracy[-1],
            "round_to_90": to_90[0], "modelled_clock_to_90_s": to_90[1],
            "round_to_99": to_99[0], "modelled_clock_to_99_s": to_99[1],
            f"mean_accuracy_last_{last}": statistics.fmean(accuracy[-last:]), "best_accuracy": max(accuracy),
            "modelled_clock_s": rows[-1]["modelled_clock_s"],
            "aggregated": sum(r["aggregated"] for r in rows), "sampled": sum(r["sampled"] for r in rows),
            "dropouts": sum(r["dropouts"] for r in rows), "mb_up": sum(r["bytes_up"] for r in rows) / 1e6,
            "measured_round_train_s_median": statistics.median(r["measured_train_wall_s"] for r in rows[1:])}


def _s(seconds: float | None) -> str:
    return "never" if seconds is None else f"{seconds:.1f} s modelled"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--seeds", default="0,1")
    ap.add_argument("--last", type=int, default=5, help="the mean over this many last rounds (the curves swing)")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--summarise", action="store_true",
                    help="train nothing: summarise the runs in --out that reached --rounds (a grid stopped early)")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    seeds = [int(s) for s in args.seeds.split(",")]
    grid = [(a, v, s) for s in seeds for v in AVAILABILITY for a in ALGORITHMS]  # seed-major: a whole seed first
    if args.summarise:
        runs = {key: args.out / f"{key[0]}-{key[1]}-s{key[2]}" for key in grid}
        runs = {key: d for key, d in runs.items()
                if (d / "fleet-rounds.jsonl").exists() and len(records(d)) >= args.rounds}
    else:
        runs = {key: run_one(args.out, *key, args.rounds) for key in grid}
    summary = []
    for a in ALGORITHMS:
        for v in AVAILABILITY:
            done = [s for s in seeds if (a, v, s) in runs]
            if not done:
                continue
            per_seed = [summarise(runs[a, v, s], args.last) for s in done]
            key = f"mean_accuracy_last_{args.last}"
            summary.append({"algorithm": a, "availability": AVAILABILITY[v], "seeds": done, "per_seed": per_seed,
                            f"{key}_mean_over_seeds": statistics.fmean(p[key] for p in per_seed)})
            print(f"{a:9s} {AVAILABILITY[v]:12s} " + "  ".join(
                f"s{s}: to 90% round {p['round_to_90']} ({_s(p['modelled_clock_to_90_s'])}), to 99% round "
                f"{p['round_to_99']} ({_s(p['modelled_clock_to_99_s'])}), final {p['final_accuracy']:.1%}, "
                f"last-{args.last} {p[key]:.1%}, dropouts {p['dropouts']}, MB up {p['mb_up']:.0f}"
                for s, p in zip(done, per_seed)), flush=True)
    (args.out / "summary.json").write_text(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
