"""Gradient inversion against what an observer of a device's traffic sees, on CIFAR-10 images.

For each model, batch size and view (``edgetrain.privacy.observe``) the device
computes its update from the first B images of ``data_batch_1`` at freshly
initialised weights (seeded), the attacker (``edgetrain.privacy.attack``)
reconstructs the images from the view alone (labels recovered by iDLG at
batch 1, given above it), and the reconstructions are scored against the true
images (``edgetrain.privacy.metrics``: PSNR, SSIM, the noise floor). Views:

* ``fp32``: one step's fp32 gradient;
* ``topk``: that gradient through ``--compress topk:RATIO`` (edgetrain's
  compressor, fresh error feedback), decoded from the bytes on the wire;
* ``diloco``: the pseudo-gradient after H local steps of the trainer's default
  optimizer (SGD, lr 0.05, momentum 0.9) on the batch;
* ``sparseloco``: that pseudo-gradient through SparseLoCo's payload
  (``--compress topk:RATIO:bits=2``, fresh error feedback), decoded;
* ``fedavg``: FedAvg's model delta after E local steps of plain SGD (lr 0.05);
* ``secagg``: one step's fp32 gradient as ``--secure-aggregation`` sends it among ``--members`` devices (the
  others on the next images), masked, decoded at the shared scale as a peer reads it;
* ``aggregate``: what secure aggregation reveals, the mean of the ``--members`` devices' gradients, each on its
  own B images: attacked as one batch of B x members images, scored against all of them;
* ``dp``: one DP-SGD step's gradient (``--dp``: Opacus's per-sample gradients, each
  clipped, summed, Gaussian noise added, divided by the batch), the noise multiplier
  derived by the RDP accountant for ``--dp`` (default ``clip=1.0,epsilon=8``, delta
  1e-5) over ``--dp-steps`` steps at sampling rate ``--dp-sample-rate`` (default: the
  accuracy benchmark's run, ``benchmarks/dp_accuracy.py``: 78 steps at 1/39).

Writes ``results.json``, ``table.md`` and one PNG per model and batch (true
images in the first row, each view's reconstructions below) into ``--out``.

Usage (from the repository root)::

    PYTHONPATH=src python benchmarks/privacy_attack.py --batches 1,4,16 --views fp32,topk,diloco,fedavg \
        --models lenet,resnet18 --iterations 300 --out benchmarks/results/privacy
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from edgetrain.comm.compress.spec import build_compressor  # noqa: E402
from edgetrain.errors import EdgetrainError  # noqa: E402
from edgetrain.data.cifar import MEAN, STD, read_batch  # noqa: E402
from edgetrain.models import build_model  # noqa: E402
from edgetrain.privacy.attack import AttackConfig, invert  # noqa: E402
from edgetrain.privacy.metrics import noise_floor, scores  # noqa: E402
from edgetrain.privacy.dp import plan_privacy  # noqa: E402
from edgetrain.privacy.observe import (LocalTraining, Normalized, aggregate_view, compressed_view,  # noqa: E402
                                       dp_view, gradient_view, local_update_view, secagg_view)
from edgetrain.spec import parse_compress, parse_dp  # noqa: E402

DATA = ROOT.parent / "shared/data/cifar10-subset/cifar-10-batches-py"
VIEWS = ("fp32", "topk", "diloco", "sparseloco", "fedavg", "secagg", "aggregate", "dp")
SPREAD = ("aggregate",)  # views whose observer sees the images of every member, not one device's


def build_view(name: str, model, images, labels, args):
    if name == "fp32":
        return gradient_view(model, images, labels)
    if name == "topk":
        compressor, memory = build_compressor(parse_compress(f"topk:{args.topk_ratio}"))
        return compressed_view(gradient_view(model, images, labels), compressor, memory)
    if name == "diloco":
        return local_update_view(model, images, labels, LocalTraining(args.local_steps, 0.05, 0.9))
    if name == "sparseloco":
        compressor, memory = build_compressor(parse_compress(f"topk:{args.topk_ratio}:bits=2"))
        return compressed_view(build_view("diloco", model, images, labels, args), compressor, memory)
    if name == "fedavg":
        return local_update_view(model, images, labels, LocalTraining(args.local_steps, 0.05, 0.0))
    if name in ("secagg", "aggregate"):
        batch = len(images) // (args.members if name in SPREAD else 1)
        pool_x, pool_y = device_images(args.pool, batch * args.members)
        every = [gradient_view(model, pool_x[i * batch:(i + 1) * batch], pool_y[i * batch:(i + 1) * batch])
                 for i in range(args.members)]
        return secagg_view(every, rank=0, seed=args.seed) if name == "secagg" else aggregate_view(every)
    if name == "dp":
        return dp_view(model, images, labels, args.dp_plan.spec.clip, args.dp_plan.noise_multiplier, args.seed)
    raise ValueError(f"unknown view {name!r}")


def device_images(pool, count: int):
    """The first ``count`` images of the batch file, in [0, 1], and their labels."""
    x, y = pool
    return torch.from_numpy(x[:count]).float() / 255, torch.from_numpy(y[:count]).long()


def attack_one(model_name: str, batch: int, view: str, images, labels, args) -> tuple[dict, torch.Tensor]:
    torch.manual_seed(args.seed)
    model = Normalized(build_model(model_name), MEAN, STD)
    observed = build_view(view, model, images, labels, args)
    start = time.perf_counter()
    given = None if len(images) == 1 else labels
    config = AttackConfig(method=args.method, iterations=args.iterations, seed=args.seed, restarts=args.restarts)
    reconstructed, found = invert(model, observed, tuple(images.shape), given, config)
    psnr, ssim = scores(reconstructed, images)
    row = {"model": model_name, "batch": batch, "view": view, "method": args.method,
           "psnr_db": round(psnr, 2), "ssim": round(ssim, 3),
           "floor_db": round(noise_floor(images, torch.tensor(MEAN).view(1, 3, 1, 1), args.seed), 2),
           "label_recovered": bool((found == labels).all()) if len(images) == 1 else None,
           "members": args.members if view in ("secagg", "aggregate") else 1,
           "attack_s": round(time.perf_counter() - start, 1)}
    print(json.dumps(row), flush=True)
    return row, reconstructed


def save_grid(path: Path, images, reconstructions: dict[str, torch.Tensor], title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    rows = {"true": images, **reconstructions}
    cols = len(images)
    fig, axes = plt.subplots(len(rows), cols, figsize=(1.2 * cols + 0.8, 1.2 * len(rows)), squeeze=False)
    for r, (name, batch) in enumerate(rows.items()):
        for c in range(cols):
            axes[r][c].imshow(batch[c].permute(1, 2, 0).clamp(0, 1).numpy())
            axes[r][c].set_xticks([])
            axes[r][c].set_yticks([])
        axes[r][0].set_ylabel(name, fontsize=8)
    fig.suptitle(title, fontsize=9)
    fig.savefig(path, dpi=80, bbox_inches="tight")
    plt.close(fig)


def write_table(path: Path, rows: list[dict]) -> None:
    lines = ["| model | batch | view | attack | PSNR dB | SSIM | floor dB | label (B=1) | attack s |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        label = "-" if r["label_recovered"] is None else ("yes" if r["label_recovered"] else "no")
        lines.append(f"| {r['model']} | {r['batch']} | {r['view']} | {r['method']} | {r['psnr_db']} | {r['ssim']} | "
                     f"{r['floor_db']} | {label} | {r['attack_s']} |")
    path.write_text("\n".join(lines) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batches", default="1,4,16")
    parser.add_argument("--views", default="fp32,topk,diloco,fedavg")
    parser.add_argument("--models", default="lenet,resnet18")
    parser.add_argument("--iterations", type=int, default=300)
    parser.add_argument("--method", default="dlg", choices=("ig", "dlg"))
    parser.add_argument("--restarts", type=int, default=1, help="random starts; the best-matching one is kept")
    parser.add_argument("--topk-ratio", type=float, default=0.01)
    parser.add_argument("--local-steps", type=int, default=4, help="H of diloco, E of fedavg")
    parser.add_argument("--members", type=int, default=4, help="devices of secagg's and aggregate's sums")
    parser.add_argument("--dp", default="clip=1.0,epsilon=8", help="the dp view's --dp")
    parser.add_argument("--dp-sample-rate", type=float, default=1 / 39)
    parser.add_argument("--dp-steps", type=int, default=78)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--data", type=Path, default=DATA)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/privacy")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    unknown = sorted(set(args.views.split(",")) - set(VIEWS))
    if unknown:
        print(f"privacy_attack: unknown view(s) {', '.join(unknown)}; use some of {','.join(VIEWS)}", file=sys.stderr)
        raise SystemExit(2)
    try:
        x, y = read_batch(args.data / "data_batch_1")
    except EdgetrainError as err:
        print(f"privacy_attack: {err}; pass --data DIR", file=sys.stderr)
        raise SystemExit(2) from None
    args.pool = (x, y)
    args.dp_plan = plan_privacy(parse_dp(args.dp), args.dp_sample_rate, args.dp_steps, "")
    if "dp" in args.views.split(","):
        print(args.dp_plan.describe(), flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    rows = []
    for model_name in args.models.split(","):
        for batch in (int(b) for b in args.batches.split(",")):
            images, labels = device_images(args.pool, batch)
            pictures = {}
            for view in args.views.split(","):
                seen = device_images(args.pool, batch * args.members) if view in SPREAD else (images, labels)
                row, reconstructed = attack_one(model_name, batch, view, *seen, args)
                pictures[view] = reconstructed[:batch]  # the first device's images, as the others' rows
                rows.append(row)
                write_table(args.out / "table.md", rows)  # partial results survive an interrupted run
            save_grid(args.out / f"{model_name}_b{batch}.png", images, pictures,
                      f"{model_name}, batch {batch}, {args.method}, {args.iterations} iterations")
    meta = {"command": " ".join(sys.argv), "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
            "loadavg": os.getloadavg(), "threads": args.threads, "rows": rows,
            **({"dp_noise_multiplier": args.dp_plan.noise_multiplier} if "dp" in args.views.split(",") else {})}
    (args.out / "results.json").write_text(json.dumps(meta, indent=1) + "\n")


if __name__ == "__main__":
    main()
