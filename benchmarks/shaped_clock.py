"""Each device's clock in one short run on the shaped link beside the virtual clock's: where the time goes.

benchmarks/diloco.py's shaped-link table gives one clock per run (the slowest device's). This prints, for one
method and a few steps, each device's clock at the end, at the first exchange, and its median local step (a step
that exchanges nothing), on the 4 shaped hosts (benchmarks/shaped_link.py, 10 Mbit/s tbf) and on loopback in
virtual mode (link ``10mbit:0ms``, the prediction). Needs root. One epoch of the CIFAR subset is 39 steps.

Usage::

    PYTHONPATH=src python benchmarks/shaped_clock.py --model mlp --steps 39
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent / "src")]

import diloco  # noqa: E402
from shaped_link import ShapedHosts  # noqa: E402


def devices(run_dir: Path) -> list[str]:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    lines = []
    for rank in sorted({r["rank"] for r in records}):
        mine = [r for r in records if r["rank"] == rank]
        first = next(r for r in mine if r.get("local_steps") == 0)
        local = [r["step_s"] for r in mine[1:] if r.get("local_steps") != 0]
        lines.append(f"    device {rank}: clock {mine[-1]['virtual_s']:6.2f} s; first exchange (step {first['step']}) "
                     f"took {first['step_s']:.3f} s; median local step {statistics.median(local):.4f} s")
    return lines


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", choices=sorted(diloco.MODELS), default="mlp")
    p.add_argument("--method", choices=sorted(diloco.METHODS), default="sparseloco16-lr3")
    p.add_argument("--steps", type=int, default=39)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--data-dir", type=Path, default=diloco.DATA)
    args = p.parse_args()
    run = argparse.Namespace(data_dir=args.data_dir, devices=4, batch_size=128, lr=0.02, model=args.model,
                             link_epochs=1)
    out = Path(tempfile.mkdtemp(prefix="shaped-clock-"))
    config = diloco.config
    diloco.config = lambda *a, **k: {**config(*a, **k), "steps": args.steps}  # shaped_run's runs stop there too
    with ShapedHosts(4, "10mbit") as hosts:
        shaped = diloco.shaped_run(args.method, run, args.seed, out, hosts)
    print(f"{args.method}, {args.model}, {args.steps} steps; shaped link (no link emulated: wall time of the steps):")
    print("\n".join(devices(out / f"{args.method}-seed{args.seed}-shaped")))
    torch.manual_seed(args.seed)
    cfg = {**config(args.method, run, args.seed, out, diloco.LINK, 1, args.steps), "run_name": "virtual"}
    predicted = diloco.train(cfg, model=diloco.MODELS[args.model]())
    print(f"loopback, virtual clock ({diloco.LINK}), the prediction:")
    print("\n".join(devices(Path(predicted["run_dir"]))))
    print(f"run clock (slowest device): shaped {shaped['curve'][-1][0]:.2f} s, predicted "
          f"{predicted['virtual_time_max_device_s']:.2f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
