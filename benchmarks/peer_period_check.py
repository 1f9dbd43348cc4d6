"""edgetrain's DiLoCo against torchft's after whole periods: the same weights, or where they part.

Runs ``diloco16`` of benchmarks/diloco.py (edgetrain) and ``peer-diloco16``
(torchft, benchmarks/torchft_peer.py) for ``--steps`` steps (default 16: one
period) from the same seeded model on the same batches, and prints the
largest absolute difference of each parameter between the two final models,
and each one's test accuracy; and each one's distance to DiLoCo written out
by hand in plain torch in this process (``reference``: four model copies,
their own inner SGD, the mean pseudo-gradient, the outer Nesterov step).
What is left between the libraries is the order in which the all-reduce sums
(one flat tensor in edgetrain, a tensor per parameter in torchft unless
``--peer peer-diloco16-flat``).

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


def reference(model_factory, data_dir, steps: int, seed: int, period: int = 16, devices: int = 4) -> dict:
    """DiLoCo by hand: ``devices`` copies train on their share of edgetrain's batches (``GlobalBatchSampler``),
    each with its own SGD (momentum 0.9, weight decay 5e-4, lr 0.02 cosine over ``steps``), and every ``period``
    steps the global model takes an outer SGD step (lr 0.7, momentum 0.9, Nesterov) on the mean of
    ``global - local``; the copies continue from it. The final global model's state_dict."""
    import copy

    import torch
    from torch import nn

    from edgetrain.data.datasets import cifar10
    from edgetrain.data.sampler import GlobalBatchSampler

    torch.set_num_threads(1)  # as each device runs: a conv sums in another order on more threads
    train = cifar10(str(data_dir), augment=False).train
    torch.manual_seed(seed)
    glob = model_factory()
    local = [copy.deepcopy(glob) for _ in range(devices)]
    inner = [torch.optim.SGD(m.parameters(), lr=0.02, momentum=0.9, weight_decay=5e-4) for m in local]
    scheds = [torch.optim.lr_scheduler.CosineAnnealingLR(o, T_max=steps) for o in inner]
    outer = torch.optim.SGD(glob.parameters(), lr=0.7, momentum=0.9, nesterov=True)
    samplers = [GlobalBatchSampler(len(train), [128 // devices] * devices, r, seed=seed) for r in range(devices)]
    batches: list[list] = [[] for _ in range(devices)]
    for step in range(steps):
        for r in range(devices):
            if not batches[r]:
                samplers[r].set_epoch(step // len(samplers[r]))
                batches[r] = list(samplers[r])
            x, y = zip(*(train[k] for k in batches[r].pop(0)))
            loss = nn.functional.cross_entropy(local[r](torch.stack(x)), torch.stack(y))
            inner[r].zero_grad()
            loss.backward()
            inner[r].step()
            scheds[r].step()
        if (step + 1) % period == 0:
            with torch.no_grad():
                for p, *mine in zip(glob.parameters(), *(m.parameters() for m in local)):
                    p.grad = sum(p - q for q in mine) / devices
                outer.step()
                for m in local:
                    m.load_state_dict(glob.state_dict())
    return glob.state_dict()


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
    by_hand = reference(diloco.MODELS[args.model], diloco.DATA, args.steps, args.seed)
    for name, value in mine.items():
        print(f"  {name:24} max |edgetrain - torchft| {float((value - theirs[name]).abs().max()):.2e}   "
              f"|edgetrain - by hand| {float((value - by_hand[name]).abs().max()):.2e}   "
              f"|torchft - by hand| {float((theirs[name] - by_hand[name]).abs().max()):.2e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
