"""The peer: torchft's DiLoCo (torchft.local_sgd.DiLoCo) on the model, data and devices of benchmarks/diloco.py.

torchft (PyTorch's fault-tolerance library) runs each device as a *replica
group* of one process; a lighthouse (torchft's Rust quorum server, started
here in the parent) forms the quorum, and the replicas average their
pseudo-gradients with torchft's ``ProcessGroupGloo`` all-reduce every
``sync_every`` inner steps, then take the outer Nesterov step (DiLoCo), or
fragment by fragment with ``--fragments F`` (Streaming DiLoCo:
``fragment_sync_delay`` steps of overlap, ``fragment_update_alpha`` mixing).

Same as edgetrain's runs of benchmarks/diloco.py: the model (``--model``, the
script's MODELS) initialised with ``torch.manual_seed(seed)``, the CIFAR-10
subset without augmentation, each device a quarter of every global batch of
one shuffled order per epoch (``--data-order edgetrain``, the default:
edgetrain's own ``GlobalBatchSampler``, so both see the same batches in the
same order; ``numpy``: a numpy permutation, as the first peer rows used), SGD
(momentum 0.9, weight decay 5e-4) with the cosine schedule over the run's
steps (``--steps`` stops early, as edgetrain's ``steps``), outer SGD lr 0.7,
momentum 0.9, Nesterov. Not the same: the all-reduce (torchft hands gloo
one tensor per parameter, edgetrain the flat model: other sums in another
order; ``--flat``: torchft's bucketised all-reduce, one flat tensor in
parameter order as edgetrain's; bytes counted from the tensors handed to it
as a ring all-reduce sends them, as edgetrain counts its own).

torchft does not import from edgetrain's virtual environment's packages
alone (it needs opentelemetry); ``--torchft-path`` puts a ``pip install
--target`` directory first on the replicas' path. Prints one JSON line.
"""
from __future__ import annotations

import argparse
import json
import math
import multiprocessing as mp
import os
import queue
import sys
import time
from datetime import timedelta
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
DATA = ROOT.parent / "shared/data/cifar10-subset/cifar-10-batches-py"


def replica(index: int, args: argparse.Namespace, lighthouse: str, out: mp.Queue) -> None:
    for path in reversed(args.torchft_path):
        sys.path.insert(0, path)
    sys.path[:0] = [str(HERE), str(ROOT / "src")]
    import numpy as np
    import torch
    from torch import nn
    from torchft import Manager, ProcessGroupGloo
    from torchft.local_sgd import DiLoCo

    from diloco import MODELS
    from edgetrain.data.datasets import cifar10
    from edgetrain.data.sampler import GlobalBatchSampler

    torch.set_num_threads(1)
    sent = [0]

    class CountingGloo(ProcessGroupGloo):
        """torchft's gloo group, counting what each all-reduce hands to gloo (ring traffic, as edgetrain)."""

        def allreduce(self, tensors, opts):
            world = self.size()
            for t in tensors:
                sent[0] += int(2 * (world - 1) * t.numel() * t.element_size() / world) if world > 1 else 0
            return super().allreduce(tensors, opts)

    data = cifar10(str(args.data_dir), augment=False)
    train, test = data.train, data.test
    torch.manual_seed(args.seed)
    model = MODELS[args.model]()
    fragments = [model] if args.fragments == 1 else _fragments(model, args.fragments)
    store = torch.distributed.TCPStore("localhost", 0, is_master=True, wait_for_workers=False)
    # init_sync=False: every replica starts from the same seeded weights. torchft's default (True) heals the
    # replicas from the first quorum's primary, and DiLoCo's first quorum comes at the end of the first
    # period: replicas 1..N-1 would take replica 0's locally trained model and their own period's work be lost.
    manager = Manager(pg=CountingGloo(timeout=timedelta(seconds=120)), min_replica_size=args.devices,
                      use_async_quorum=False, init_sync=False, load_state_dict=model.load_state_dict, state_dict=model.state_dict,
                      replica_id=f"edge{index}", store_addr="localhost", store_port=store.port, rank=0, world_size=1,
                      lighthouse_addr=lighthouse, timeout=timedelta(seconds=120),
                      quorum_timeout=timedelta(seconds=120), connect_timeout=timedelta(seconds=60))
    steps_per_epoch = len(train) // args.batch_size
    total = min(args.steps or steps_per_epoch * args.epochs, steps_per_epoch * args.epochs)
    inner = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9, weight_decay=5e-4)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(inner, T_max=total)
    outers = [torch.optim.SGD(f.parameters(), lr=args.outer_lr, momentum=args.outer_momentum, nesterov=True)
              for f in fragments]
    local = args.batch_size // args.devices
    step_s = []
    with DiLoCo(manager, fragments, inner, outers, sync_every=args.sync_every, backup_device=torch.device("cpu"),
                pin_memory=False, fragment_sync_delay=args.overlap, fragment_update_alpha=args.mix,
                use_bucketization=args.flat):
        sampler = GlobalBatchSampler(len(train), [local] * args.devices, index, seed=args.seed)
        for epoch in range(math.ceil(total / steps_per_epoch)):
            if args.data_order == "numpy":
                order = np.random.default_rng((args.seed, epoch)).permutation(len(train))
                batches = [[(int(i), epoch) for i in order[s * args.batch_size + index * local:
                                                          s * args.batch_size + (index + 1) * local]]
                           for s in range(steps_per_epoch)]
            else:
                sampler.set_epoch(epoch)
                batches = list(sampler)
            for keys in batches[:total - len(step_s)]:
                started = time.perf_counter()
                x, y = zip(*(train[key] for key in keys))
                loss = nn.functional.cross_entropy(model(torch.stack(x)), torch.stack(y))
                inner.zero_grad()
                loss.backward()
                inner.step()  # DiLoCo's hook syncs a fragment here every sync_every / F steps
                sched.step()
                step_s.append(time.perf_counter() - started)
    model.eval()
    correct = 0
    with torch.no_grad():
        for a in range(0, len(test), 500):
            x, y = zip(*(test[i] for i in range(a, min(a + 500, len(test)))))
            correct += int((model(torch.stack(x)).argmax(1) == torch.stack(y)).sum())
    if args.save and index == 0:  # the final model, to hold against edgetrain's checkpoint.pt
        torch.save(model.state_dict(), args.save)
    out.put({"replica": index, "accuracy": correct / len(test), "bytes_sent": sent[0], "steps": len(step_s),
             "step_s_mean": sum(step_s) / len(step_s), "wall_s": sum(step_s)})
    manager.shutdown(wait=False)


def _fragments(model, count: int) -> list:
    """``count`` runs of the model's layers with parameters (in order), as equal in parameters as possible."""
    from torch import nn

    layers = [m for m in model.modules() if any(True for _ in m.parameters(recurse=False))]
    sizes = [sum(p.numel() for p in m.parameters()) for m in layers]
    total, runs, current, done = sum(sizes), [], [], 0
    for layer, size in zip(layers, sizes):
        current.append(layer)
        done += size
        left = len(layers) - layers.index(layer) - 1
        if (done >= total * (len(runs) + 1) / count or left == count - len(runs) - 1) and len(runs) < count - 1:
            runs.append(nn.ModuleList(current))
            current = []
    runs.append(nn.ModuleList(current))
    return runs


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--devices", type=int, default=4)
    p.add_argument("--epochs", type=int, default=8)
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--lr", type=float, default=0.02)
    p.add_argument("--steps", type=int, default=None, help="stop after this many steps (the schedule's length)")
    p.add_argument("--model", default="edgecnn", help="a name of benchmarks/diloco.py's MODELS")
    p.add_argument("--data-order", choices=("edgetrain", "numpy"), default="edgetrain",
                   help="whose shuffle: edgetrain's GlobalBatchSampler (the same batches as edgetrain) or numpy's")
    p.add_argument("--flat", action="store_true",
                   help="torchft's bucketised all-reduce (one flat tensor, as edgetrain sends) instead of one per parameter")
    p.add_argument("--sync-every", type=int, default=16)
    p.add_argument("--fragments", type=int, default=1)
    p.add_argument("--overlap", type=int, default=0, help="fragment_sync_delay")
    p.add_argument("--mix", type=float, default=0.0, help="fragment_update_alpha")
    p.add_argument("--outer-lr", type=float, default=0.7)
    p.add_argument("--outer-momentum", type=float, default=0.9)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--data-dir", type=Path, default=DATA)
    p.add_argument("--torchft-path", action="append", default=[], help="directories to import torchft from")
    p.add_argument("--timeout", type=float, default=1800)
    p.add_argument("--save", type=Path, default=None, help="write replica 0's final state_dict here")
    args = p.parse_args()
    for path in reversed(args.torchft_path):
        sys.path.insert(0, path)
    from torchft.coordination import LighthouseServer

    os.environ.setdefault("TORCHFT_LIGHTHOUSE", "")
    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=args.devices)
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=replica, args=(i, args, lighthouse.address(), out)) for i in range(args.devices)]
    started = time.perf_counter()
    for proc in procs:
        proc.start()
    results = []
    try:
        while len(results) < args.devices:
            try:
                results.append(out.get(timeout=5))
            except queue.Empty:
                dead = [i for i, proc in enumerate(procs) if proc.exitcode not in (None, 0)]
                if dead or time.perf_counter() - started > args.timeout:
                    why = f"replica(s) {dead} failed" if dead else f"no result after {args.timeout:g} s"
                    print(f"torchft_peer: error: {why}; see the traceback above", file=sys.stderr)
                    return 2
    finally:
        for proc in procs:
            proc.join(timeout=30)
            if proc.is_alive():
                proc.kill()
        lighthouse.shutdown()
    results.sort(key=lambda r: r["replica"])
    print(json.dumps({"accuracy": results[0]["accuracy"], "accuracies": [r["accuracy"] for r in results],
                      "bytes_per_device": max(r["bytes_sent"] for r in results), "steps": results[0]["steps"],
                      "step_s_mean": sum(r["step_s_mean"] for r in results) / len(results),
                      "wall_s": time.perf_counter() - started}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
