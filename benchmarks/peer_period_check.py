"""edgetrain's DiLoCo against torchft's after whole periods: the same weights, or where they part.

Runs ``diloco16`` of benchmarks/diloco.py (edgetrain) and ``peer-diloco16``
(torchft, benchmarks/torchft_peer.py) for ``--steps`` steps (default 16: one
period) from the same seeded model on the same batches, and prints the
largest absolute difference of each parameter between the two final models,
and each one's test accuracy. Both are DiLoCo by the paper; what is left
between them is the order in which the all-reduce sums (one flat tensor in
edgetrain, a tensor per parameter in torchft), about 1e-10 after a period.

Usage (from the repository root)::

    PYTHONPATH=src python benchmarks/peer_period_check.py --torchft-path /tmp/tft --torchft-path /tmp/tft-deps
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent


def main() -> int:
    sys.path[:0] = [str(HERE), str(HERE.parent / "src")]
    import torch

    import diloco

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--model", choices=sorted(diloco.MODELS), default="edgecnn")
    p.add_argument("--peer", choices=[k for k in diloco.PEERS if k.startswith("peer-diloco16")], default="peer-diloco16")
    p.add_argument("--torchft-path", action="append", default=[])
    args = p.parse_args()
    out = Path(tempfile.mkdtemp(prefix="peer-check-"))
    bench = argparse.Namespace(data_dir=diloco.DATA, devices=4, batch_size=128, lr=0.02, model=args.model)
    torch.manual_seed(args.seed)
    summary = diloco.train(diloco.config("diloco16", bench, args.seed, out, diloco.LINK, 8, args.steps),
                           model=diloco.MODELS[args.model]())
    mine = torch.load(Path(summary["run_dir"]) / "checkpoint.pt", weights_only=False)["model"]
    cmd = [sys.executable, str(HERE / "torchft_peer.py"), "--steps", str(args.steps), "--seed", str(args.seed),
           "--model", args.model, "--save", str(out / "peer.pt"), *diloco.PEERS[args.peer]]
    for path in args.torchft_path:
        cmd += ["--torchft-path", path]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    if done.returncode != 0:
        print(done.stderr[-2000:], file=sys.stderr)
        return 1
    peer = json.loads(done.stdout.strip().splitlines()[-1])
    theirs = torch.load(out / "peer.pt")
    print(f"{args.model}, seed {args.seed}, {args.steps} steps, {args.peer}: accuracy edgetrain {100 * summary['test_accuracy']:.2f}%, "
          f"torchft {100 * peer['accuracy']:.2f}%")
    for name, value in mine.items():
        print(f"  {name:24} max |edgetrain - torchft| {float((value - theirs[name]).abs().max()):.2e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
