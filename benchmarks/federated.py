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

One seed per method (``--seed``): on a run this short single runs of one
method differ by a point or two, so small differences are not resolved.

Usage (from the repository root)::

    PYTHONPATH=src python benchmarks/federated.py                       # every method, 10 rounds
    PYTHONPATH=src python benchmarks/federated.py --methods fedavg,scaffold --rounds 3
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from edgetrain.report.files import write_json  # noqa: E402
from edgetrain.train import train  # noqa: E402

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
    "fedavg-drop30": dict(sync="fedavg:1", participation=0.7),
}


def run(label: str, args, out: Path) -> dict:
    cfg = dict(model="small_cnn", dataset="cifar10", data_dir=str(args.data_dir), devices=args.clients,
               epochs=args.rounds, batch_size=args.batch_size, lr=args.lr, partition=args.partition,
               link="lte-10m", throttle=False, threads=1, progress=False, eval=True, seed=args.seed,
               output=str(out), run_name=label, timeout=300)
    cfg.update(METHODS[label])
    started = time.perf_counter()
    summary = train(cfg)
    return {"method": label, "config": cfg, "test_accuracy": summary["test_accuracy"],
            "bytes_sent_max_device": summary.get("bytes_sent_max_device"),
            "virtual_time_max_device_s": summary.get("virtual_time_max_device_s"),
            "rounds": summary.get("rounds"), "steps": summary["steps"],
            "wall_s": time.perf_counter() - started}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--methods", default=",".join(METHODS), help=f"comma-separated, of {', '.join(METHODS)}")
    p.add_argument("--clients", type=int, default=10)
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--batch-size", type=int, default=320, help="global batch (32 per client with 10 clients)")
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--partition", default="dirichlet:0.5")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--data-dir", type=Path, default=DATA)
    p.add_argument("--json", type=Path, default=None, help="also write the results here")
    args = p.parse_args()
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    unknown = [m for m in methods if m not in METHODS]
    if unknown:
        p.error(f"unknown method(s) {unknown}; choose from {', '.join(METHODS)}")
    results = []
    with tempfile.TemporaryDirectory(prefix="federated-bench-") as tmp:
        for label in methods:
            results.append(run(label, args, Path(tmp)))
            r = results[-1]
            print(f"{label}: accuracy {r['test_accuracy']:.2%}, wall {r['wall_s']:.0f} s", flush=True)
    print(f"\n{args.clients} clients, {args.partition}, {args.rounds} rounds of 1 local epoch, lte-10m (virtual clock), "
          f"seed {args.seed}")
    print("| method | test accuracy | MB sent (busiest client) | virtual time s (modelled link) |")
    print("|---|---|---|---|")
    for r in results:
        mb = "-" if r["bytes_sent_max_device"] is None else f"{r['bytes_sent_max_device'] / 1e6:.2f}"
        vt = "-" if r["virtual_time_max_device_s"] is None else f"{r['virtual_time_max_device_s']:.1f}"
        print(f"| {r['method']} | {r['test_accuracy']:.2%} | {mb} | {vt} |")
    if args.json:
        write_json(args.json, {"results": results})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
