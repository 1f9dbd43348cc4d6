"""Federated rounds on non-IID data: centralized, FedAvg, FedProx, SCAFFOLD, compression and partial participation.

The issue's setting, on the real CIFAR-10 subset (5,085 training images):
``--clients`` emulated devices (default 10), each holding a Dirichlet(0.5)
partition of the training set (``--partition``), one local epoch per round
(``--sync fedavg:1``), ``--rounds`` rounds, every device on an ``lte-10m``
link in virtual-clock mode. "centralized" is data-parallel training on the
shared, globally shuffled set for the same number of epochs (the IID
reference). Per method it prints

* final test accuracy (measured),
* bytes the busiest device sent (counted from the payloads handed to gloo),
* virtual time of the slowest device: this host's measured compute (the
  clients share its cores, so it is not an edge device's) plus the *modelled*
  LTE communication time (``edgetrain.comm.emulation``).

Each method runs once per seed of ``--seeds`` (the seed draws the partition,
the initial model and the batches); the table gives the mean and the spread
(half the range of the seeds' values: with two seeds, mean +- spread are the
two values). The targets of issue 14 are checked paired by seed (``targets``):
the best federated method within 5 pp of IID training at the same rounds
(FedAvg on IID partitions, as in Flower's benchmark; centralized training is
checked too), and ahead of FedAvg on every one of 3 or more seeds.

``fedavg-drop30``: 30% of the clients (the last ones) are stragglers,
throttled to ``STRAGGLER_SPEED`` of a host core while the others run
unthrottled, and ``--round-deadline auto`` drops a client that would miss the
round's deadline: round 0 waits for everyone (no deadline yet), then a
straggler that misses a round (its partition's data does not reach the model
that round) sends nothing and only receives the new global model. The
summary's ``round_participation`` (kept in ``--json``) says who joined how
many rounds: how many drop depends on the host's load, since the unthrottled
clients share its cores.

``fedavg-iid`` (FedAvg on IID partitions) is the IID reference; ``fedavg-h5``
(rounds of 5 local steps) is a diagnostic, left out of the targets.

Usage (from the repository root)::

    PYTHONPATH=src python benchmarks/federated.py --rounds 15 --seeds 1,2 --methods centralized,fedavg,fedprox,scaffold
    PYTHONPATH=src python benchmarks/federated.py --methods fedavg,scaffold --rounds 3
    PYTHONPATH=src python benchmarks/federated.py --rounds 5 --local-epochs 5 --methods fedavg,scaffold,fedavg-iid

``--local-epochs E`` makes every round E local epochs (the rows are written
for one; centralized trains rounds x E epochs): with more local steps per
round the clients drift further apart, which is what FedProx and SCAFFOLD
correct.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from edgetrain.files import write_json  # noqa: E402
from edgetrain.train import train  # noqa: E402
from paired import lower_bound  # noqa: E402  (benchmarks/paired.py)

DATA = ROOT.parent / "shared/data/cifar10-subset/cifar-10-batches-py"

# label: the options that differ from the common ones
METHODS = {
    "centralized": dict(sync="sync", partition="none"),
    "fedavg": dict(sync="fedavg:1"),
    "fedprox": dict(sync="fedavg:1:prox=0.01"),
    "scaffold": dict(sync="fedavg:1:scaffold"),
    "fedavg-int8": dict(sync="fedavg:1", compress="int8"),
    "fedprox-int8": dict(sync="fedavg:1:prox=0.01", compress="int8"),
    "scaffold-int8": dict(sync="fedavg:1:scaffold", compress="int8"),
    "fedavg-drop30": dict(sync="fedavg:1", round_deadline="auto", stragglers=0.3),
    # tuning: server momentum (Hsu et al. 2019), which the literature finds helps on non-IID data
    "fedavgm": dict(sync="fedavg:1", server_opt="fedavgm:lr=1:momentum=0.9"),
    "scaffold-fedavgm": dict(sync="fedavg:1:scaffold", server_opt="fedavgm:lr=1:momentum=0.9"),
    "fedavgm-0.2": dict(sync="fedavg:1", server_opt="fedavgm:lr=0.2:momentum=0.9"),  # effective server lr 2
    # tuning: updates weighted by partition size (McMahan's n_k / n) and a fresh client optimizer each round
    "fedavg-weighted": dict(sync="fedavg:1:weighted"),
    "fedavg-reset": dict(sync="fedavg:1:reset"),
    "fedavg-weighted-reset": dict(sync="fedavg:1:weighted:reset"),
    "scaffold-weighted-reset": dict(sync="fedavg:1:scaffold:weighted:reset"),
    "fedprox-0.1": dict(sync="fedavg:1:prox=0.1"),
    # tuning: a server step past the clients' mean (averaging shrinks updates that disagree; FedExP, 2023),
    # and server-side Adam (Reddi et al. 2021)
    "fedavg-slr1.5": dict(sync="fedavg:1", server_opt="fedavgm:lr=1.5:momentum=0"),
    "fedavg-slr2": dict(sync="fedavg:1", server_opt="fedavgm:lr=2:momentum=0"),
    "fedadam": dict(sync="fedavg:1", server_opt="fedadam:lr=0.01"),
    # tuning: the two small leads combined, a mu between 0.01 and 0.1, server momentum that averages over about
    # two rounds, and two-sided learning rates (half the client lr, twice the server's; Yang et al. 2021)
    "fedprox-slr1.5": dict(sync="fedavg:1:prox=0.01", server_opt="fedavgm:lr=1.5:momentum=0"),
    "fedprox-0.03": dict(sync="fedavg:1:prox=0.03"),
    "fedavgm-0.5": dict(sync="fedavg:1", server_opt="fedavgm:lr=0.5:momentum=0.5"),
    "fedavg-2sided": dict(sync="fedavg:1", lr=0.025, server_opt="fedavgm:lr=2:momentum=0"),
    # diagnostics, not contenders: FedAvg on IID partitions (how much of the gap is the non-IID split), and
    # rounds of 5 local steps (3 rounds per epoch: 3x the rounds and bytes at the same epochs)
    "fedavg-iid": dict(sync="fedavg:1", partition="iid"),
    "fedavg-h5": dict(sync="fedavg:steps=5"),
}
# out of the targets: not federated, not on the non-IID split, or not at the same number of rounds
REFERENCES = ("centralized", "fedavg-iid", "fedavg-h5")
# of one host core: far past a deadline of 2x the median round time. Not 0.1: the unthrottled clients
# share this host's cores (10 clients on 2 cores: about 0.2 core each, less under other load), so at 0.1
# a straggler was only about 2x slower and made the deadline in 22 of its 45 rounds (measured, seed 1)
STRAGGLER_SPEED = 0.02


def straggler_cluster(clients: int, fraction: float, path: Path) -> Path:
    """A cluster file: the last ``fraction`` of the clients throttled to STRAGGLER_SPEED, the others unthrottled."""
    slow = round(fraction * clients)
    path.write_text(f"profiles:\n  straggler: {{base: host, speed: {STRAGGLER_SPEED}}}\n"
                    f"devices:\n  - {{profile: host, count: {clients - slow}}}\n"
                    f"  - {{profile: straggler, count: {slow}}}\n")
    return path


def run(label: str, args, seed: int, out: Path) -> dict:
    cfg = dict(model=args.model, dataset="cifar10", data_dir=str(args.data_dir), devices=args.clients,
               epochs=args.rounds * args.local_epochs, batch_size=args.batch_size, lr=args.lr,
               partition=args.partition, link="lte-10m", throttle=False, threads=1, progress=False, eval=True,
               seed=seed, output=str(out), run_name=f"{label}-seed{seed}", timeout=300)
    cfg.update(METHODS[label])
    # the rows are written for one local epoch per round; --local-epochs E makes every round E epochs
    cfg["sync"] = cfg["sync"].replace("fedavg:1", f"fedavg:{args.local_epochs}")
    stragglers = cfg.pop("stragglers", 0)
    if stragglers:
        cfg.update(cluster=str(straggler_cluster(args.clients, stragglers, out / f"{label}-cluster.yaml")),
                   throttle=True)
    started = time.perf_counter()
    summary = train(cfg)
    return {"method": label, "seed": seed, "config": cfg, "test_accuracy": summary["test_accuracy"],
            "bytes_sent_max_device": summary.get("bytes_sent_max_device"),
            "virtual_time_max_device_s": summary.get("virtual_time_max_device_s"),
            "rounds": summary.get("rounds"), "steps": summary["steps"],
            "round_participation": summary.get("round_participation"),
            "wall_s": time.perf_counter() - started}


def mean_spread(values: list[float]) -> tuple[float, float]:
    """The mean and half the range (the spread the table shows)."""
    return float(np.mean(values)), (max(values) - min(values)) / 2


def table(results: list[dict], methods: list[str]) -> list[str]:
    """One row per method. The means are over the seeds each method ran, which differ; the paired column
    (the method minus fedavg on the seeds both ran, and how many) is the one that compares rows."""
    fedavg = {r["seed"]: r["test_accuracy"] for r in results if r["method"] == "fedavg"}
    lines = ["| method | seeds | test accuracy (mean +- spread) | against fedavg, paired (seeds) "
             "| MB sent (busiest client) | virtual time s (modelled link) |",
             "|---|---|---|---|---|---|"]
    for method in methods:
        runs = [r for r in results if r["method"] == method]
        accuracy, spread = mean_spread([r["test_accuracy"] for r in runs])
        lead = [r["test_accuracy"] - fedavg[r["seed"]] for r in runs if r["seed"] in fedavg]
        lead_text = "-" if method == "fedavg" or not lead else f"{np.mean(lead) * 100:+.2f} pp ({len(lead)})"
        mb = "-" if runs[0]["bytes_sent_max_device"] is None else f"{runs[0]['bytes_sent_max_device'] / 1e6:.2f}"
        vt = [r["virtual_time_max_device_s"] for r in runs if r["virtual_time_max_device_s"] is not None]
        vt_text = f"{np.mean(vt):.1f}" if vt else "-"
        seeds = ",".join(str(r["seed"]) for r in sorted(runs, key=lambda r: r["seed"]))
        lines.append(f"| {method} | {seeds} | {accuracy:.2%} +- {spread:.2%} | {lead_text} | {mb} | {vt_text} |")
    return lines


def targets(results: list[dict]) -> list[str]:
    """Issue 14's targets: the best federated method within 5 pp of IID training at the same rounds, and
    ahead of FedAvg.

    "IID training at the same rounds" is read as Flower's non-IID benchmark (the issue's source) reads it:
    FedAvg on IID partitions (``fedavg-iid``), the same clients, rounds and local epochs with only the
    partition changed. Centralized training (one shuffled set) is the stricter reference and is checked too.
    Comparisons are paired by seed (a seed draws the partition, the initial model and the batches): a
    method competes only on seeds where it and the reference both ran. "Ahead of FedAvg" is met when the
    mean lead over at least 3 common seeds is above zero with 95% confidence: the one-sided lower bound
    of Student's t interval on the paired differences (``paired.lower_bound``) is above zero. How many seeds it
    leads on is printed too; "on every seed" was this script's first rule, but it cannot be met at any
    confidence by a method whose lead is smaller than one run's noise, however many seeds it runs."""
    by = {}
    for r in results:
        by.setdefault(r["method"], {})[r["seed"]] = r["test_accuracy"]
    if "fedavg" not in by:
        return ["targets: need fedavg"]
    candidates = [m for m in by if m not in REFERENCES and m != "fedavg"]
    if not candidates:
        return ["targets: need another federated method"]

    def paired(a: str, b: str) -> list[float]:
        """a - b on the seeds both ran, in seed order."""
        return [by[a][s] - by[b][s] for s in sorted(set(by[a]) & set(by[b]))]

    # the best: the largest mean lead over fedavg on common seeds, among methods with >= 2 such seeds
    leads = {m: paired(m, "fedavg") for m in candidates}
    ranked = [m for m in candidates if len(leads[m]) >= 2] or candidates
    best = max(ranked, key=lambda m: float(np.mean(leads[m])) if leads[m] else -1.0)
    lines = []
    lead = leads[best]
    if not lead:
        lines.append(f"best federated method {best}: no seed in common with fedavg")
    else:
        ahead = sum(d > 0 for d in lead)
        bound = lower_bound(lead)
        verdict = (f"not resolved: {len(lead)} seeds (needs 3 or more)" if len(lead) < 3 else
                   "met" if bound > 0 else "not met")
        lines.append(f"best federated method other than fedavg: {best}, {float(np.mean(lead)) * 100:+.2f} pp against "
                     f"fedavg paired over {len(lead)} seeds (per seed: {', '.join(f'{d * 100:+.2f}' for d in lead)}; "
                     f"ahead on {ahead} of {len(lead)}; 95% lower bound {bound * 100:+.2f} pp; "
                     f"target ahead of FedAvg: {verdict})")
    for reference, label in (("fedavg-iid", "IID training at the same rounds (FedAvg on IID partitions)"),
                             ("centralized", "centralized training at the same epochs")):
        gap = paired(reference, best) if reference in by else []
        if not gap:
            lines.append(f"{label}: not run on {best}'s seeds")
            continue
        mean_gap = float(np.mean(gap)) * 100
        lines.append(f"{best} against {label}: {mean_gap:.2f} pp below, paired over {len(gap)} seeds "
                     f"(per seed: {', '.join(f'{g * 100:.2f}' for g in gap)}; "
                     f"target <= 5 pp: {'met' if mean_gap <= 5 else 'not met'})")
    return lines


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--methods", default=",".join(METHODS), help=f"comma-separated, of {', '.join(METHODS)}")
    p.add_argument("--clients", type=int, default=10)
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--local-epochs", type=int, default=1,
                   help="local epochs per round (centralized trains rounds x local epochs epochs)")
    p.add_argument("--batch-size", type=int, default=320, help="global batch (32 per client with 10 clients)")
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--model", default="small_cnn", help="every method's model, e.g. small_cnn_gn (GroupNorm)")
    p.add_argument("--partition", default="dirichlet:0.5")
    p.add_argument("--seeds", default="0", help="comma-separated seeds; every method runs once per seed")
    p.add_argument("--data-dir", type=Path, default=DATA)
    p.add_argument("--json", type=Path, default=None, help="also write the results here (after each run)")
    p.add_argument("--from-json", type=Path, nargs="+", default=None,
                   help="run nothing: print the table of the results in these --json files (runs split up)")
    args = p.parse_args()
    if args.from_json:
        results = [r for path in args.from_json for r in json.loads(path.read_text())["results"]]
        methods = [m for m in METHODS if any(r["method"] == m for r in results)]
        first = next((r for r in results if r["method"] == "fedavg"), results[0])["config"]
        local_epochs = int(first["sync"].split(":")[1]) if first["sync"].startswith("fedavg:") else 1
        print(f"{first['model']}, {first['devices']} clients, {first['partition']}, "
              f"{first['epochs'] // local_epochs} rounds of {local_epochs} local epoch(s), "
              f"lr {first['lr']}, lte-10m (virtual clock)")
        print("\n".join(table(results, methods) + [""] + targets(results)))
        return 0
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    unknown = [m for m in methods if m not in METHODS]
    if unknown:
        p.error(f"unknown method(s) {unknown}; choose from {', '.join(METHODS)}")
    seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    results = []
    with tempfile.TemporaryDirectory(prefix="federated-bench-") as tmp:
        for seed in seeds:  # seed-major: a run cut short still has every method of its first seeds
            for label in methods:
                results.append(run(label, args, seed, Path(tmp)))
                r = results[-1]
                print(f"{label} seed {seed}: accuracy {r['test_accuracy']:.2%}, wall {r['wall_s']:.0f} s", flush=True)
                if args.json:
                    write_json(args.json, {"results": results})
    print(f"\n{args.model}, {args.clients} clients, {args.partition}, "
          f"{args.rounds} rounds of {args.local_epochs} local epoch(s), "
          f"lr {args.lr}, lte-10m (virtual clock), seeds {args.seeds}")
    print("\n".join(table(results, methods) + [""] + targets(results)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
