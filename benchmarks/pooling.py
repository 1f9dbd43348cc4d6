"""Pooling memory (issue 13): the planner's split against an even one; pipeline against fsdp on wifi-20m;
a model over a device's memory.

    PYTHONPATH=src python benchmarks/pooling.py [--part split|wifi|all] [--steps 20] [--rounds 2] [--cluster FILE]
    PYTHONPATH=src python benchmarks/pooling.py --part memory [--steps 3] [--data-dir CIFAR]

**Planned against even split** (``--part split``):

A heterogeneous cluster (default: 2 ``rpi5`` and 2 ``rpi-zero-2w``, emulated
with their profiles' speeds by the throttle) trains a deep MLP (no
BatchNorm: its FLOPs are matrix products, which the planner counts) on
digits with ``--strategy pipeline``, GPipe, global batch 256 in 8
micro-batches, once with ``--stages auto`` (the planner) and once with
``--stages even`` (the same number of layers per device), alternating for
``--rounds`` rounds because the host is shared and its load drifts.
Throughput is measured (samples per second of the last stage, after the
first step); the planner's own figures, printed first, are modelled.

**Memory** (``--part memory``): 2 GB ``smart-speaker-2g`` devices, CIFAR-10
(the subset at ``--data-dir``), a ``WideMlp`` (Flatten, 8 hidden W x W
linear layers with ReLU, no BatchNorm), global batch 32, SGD with momentum.
Every device builds the model on the meta device and materialises only what
it holds (models/init.py). Devices run unthrottled (host speed, so the
throughput is the host's, not a smart speaker's) but each is checked against
its profile's 2,048 MiB: a step whose measured peak RSS passes it stops the
run with the loop's memory error.

- *Over one device's memory*: W = 3584 (114M parameters). The planner
  (``plan.strategies``, modelled) predicts ddp, fsdp and pipeline on 4
  devices; then real runs: ddp (on 2 devices: its per-device memory does not
  depend on their number, and 4 would need about 9 GB of this shared host),
  fsdp and pipeline on 4. Per device: measured peak RSS against the limit,
  throughput and bytes sent per step.
- *Memory pooled*: the largest W (multiple of 256) the planner fits on one
  device (ddp) and on 4 (fsdp or pipeline, whichever fits more), modelled;
  then a real run at each size confirms it trains under the limit
  (measured), and the parameter counts give the pooled ratio (target >= 3x).

``--part wifi`` (``pipeline_against_fsdp``): on ``--link wifi-20m``, two
emulated host devices train two models with ``--strategy pipeline``
(GPipe, 4 micro-batches, ``--stages auto``) and ``--strategy fsdp``: the
deep MLP above (many parameters, small activations) and ``small_cnn`` on
32x32 synthetic images (few parameters, large activations at its cuts).
Bytes per step per device are counted; virtual time per step is this
host's measured compute plus the modelled link time (the device clocks of
``comm/emulation.py``, ``virtual_time_max_device_s / steps``), with its link
part (``comm_time_s``) beside it. Next to each: what ``edgetrain plan
--strategy compare`` predicts for the same job (modelled: the host profile's
GFLOPS, the same link model), so a user sees which strategy their network
favours and how far the plan is from a run.
"""
from __future__ import annotations

import argparse
import functools
import os
import statistics
import sys
import tempfile
from pathlib import Path

import torch
from torch import nn

from edgetrain import train
from edgetrain.config import TrainConfig
from edgetrain.errors import EdgetrainError
from edgetrain.models import register_model
from edgetrain.plan.config import plan_inputs, predict_inputs
from edgetrain.plan.strategies import compare


class DeepMlp(nn.Module):
    """Flatten, then ``depth + 2`` linear layers with ReLU between them: 64 inputs (digits), 10 classes."""

    def __init__(self, width: int = 512, depth: int = 8):
        super().__init__()
        layers = [nn.Flatten(), nn.Linear(64, width), nn.ReLU()]
        for _ in range(depth):
            layers += [nn.Linear(width, width), nn.ReLU()]
        self.body = nn.Sequential(*layers, nn.Linear(width, 10))

    def forward(self, x):
        return self.body(x)


class WideMlp(nn.Module):
    """Flatten, Linear(3 x 32 x 32, W), ReLU, ``depth`` x (Linear(W, W), ReLU), Linear(W, classes)."""

    def __init__(self, in_channels: int = 3, num_classes: int = 10, width: int = 1024, depth: int = 8):
        super().__init__()
        layers = [nn.Flatten(), nn.Linear(in_channels * 32 * 32, width), nn.ReLU()]
        for _ in range(depth):
            layers += [nn.Linear(width, width), nn.ReLU()]
        self.body = nn.Sequential(*layers, nn.Linear(width, num_classes))

    def forward(self, x):
        return self.body(x)


def wide_mlp(width: int) -> str:
    """Register the ``WideMlp`` of this width (the devices build it themselves, on meta) and return its name."""
    name = f"wide_mlp_{width}"
    register_model(name, functools.partial(WideMlp, width=width))
    return name


def mlp_params(width: int, depth: int = 8, inputs: int = 3 * 32 * 32, classes: int = 10) -> int:
    return inputs * width + width + depth * (width * width + width) + width * classes + classes


MEMORY_LIMIT_WIDTH = 3584
LIMIT_MB = 2048


def _memory_config(data_dir: str, steps: int, output: str, **overrides) -> dict:
    return dict(dataset="cifar10", data_dir=data_dir, profile="smart-speaker-2g", batch_size=32, microbatches=4,
                lr=0.01, momentum=0.9, steps=steps, output=output, eval=False, progress=False, throttle=False,
                timeout=600, **overrides)


def planned(cfg: dict, strategies: tuple[str, ...], runtime_mb: float):
    """The planner's prediction (modelled) of ``strategies`` for ``cfg``: a ``PlanComparison``."""
    inputs = plan_inputs(TrainConfig(**{k: v for k, v in cfg.items() if k != "strategy"}))
    pred = predict_inputs(inputs, runtime_mb=runtime_mb)
    return compare(inputs, pred, strategies, cfg["microbatches"], "gpipe")


def measured(cfg: dict, label: str) -> dict | None:
    """A real run (measured): per device peak RSS against the limit, throughput, bytes; None if it stopped."""
    try:
        summary = train(cfg, run_name=label)
    except EdgetrainError as e:
        print(f"  {label}: stopped (measured): {e}", flush=True)
        return None
    peaks = ", ".join(f"{d['peak_rss_mb']:,.0f}" for d in summary["per_device"])
    print(f"  {label}: trained {summary['steps']} steps (measured): peak RSS per device {peaks} MiB of "
          f"{LIMIT_MB:,}; {summary['throughput_samples_per_s']:,.1f} samples/s (host speed, unthrottled); "
          f"{summary['bytes_sent_per_step_per_device'] / 1e6:,.1f} MB sent per device per step", flush=True)
    return summary


def largest_width(cfg: dict, strategies: tuple[str, ...], runtime_mb: float, low: int, high: int) -> tuple[int, str]:
    """The largest width (multiple of 256) at which one of ``strategies`` fits every device (modelled)."""
    best = (0, "")
    while low <= high:
        width = (low + high) // 2 // 256 * 256
        comparison = planned({**cfg, "model": wide_mlp(width)}, strategies, runtime_mb)
        fits = [r for r in comparison.strategies if r.fits]
        print(f"  W {width} ({mlp_params(width) / 1e6:,.0f}M parameters): "
              + "; ".join(f"{r.strategy} {r.memory_total_mb_max or 0:,.0f} MiB" if r.memory_total_mb_max
                          else f"{r.strategy} refused" for r in comparison.strategies)
              + f" (modelled) -> {'fits' if fits else 'does not fit'}", flush=True)
        if fits:
            best = (width, min(fits, key=lambda r: r.memory_total_mb_max).strategy)
            low = width + 256
        else:
            high = width - 256
    return best


def memory_benchmark(data_dir: str, steps: int, scratch: str) -> None:
    from edgetrain.plan.model import idle_process_mb

    runtime_mb = idle_process_mb()
    print(f"idle device process (measured): {runtime_mb:,.0f} MiB; limit per smart-speaker-2g: {LIMIT_MB:,} MiB")
    model = wide_mlp(MEMORY_LIMIT_WIDTH)
    print(f"\n== over one device's memory: WideMlp W {MEMORY_LIMIT_WIDTH}, "
          f"{mlp_params(MEMORY_LIMIT_WIDTH) / 1e6:,.1f}M parameters ==")
    base = _memory_config(data_dir, steps, scratch, model=model, devices=4)
    for row in planned(base, ("ddp", "fsdp", "pipeline"), runtime_mb).strategies:
        print(f"  plan (modelled): {row.describe()}", flush=True)
    measured({**base, "devices": 2}, "ddp-2-devices")
    for strategy in ("fsdp", "pipeline"):
        measured({**base, "strategy": strategy}, f"{strategy}-4-devices")

    print("\n== memory pooled: the largest WideMlp on 1 device and on 4 (planner, modelled) ==")
    one, _ = largest_width({**base, "devices": 1}, ("ddp",), runtime_mb, 1024, 8192)
    four, strategy = largest_width(base, ("fsdp", "pipeline"), runtime_mb, 1024, 16384)
    print(f"  largest on 1 device: W {one} ({mlp_params(one) / 1e6:,.1f}M parameters), ddp (modelled)")
    print(f"  largest on 4 devices: W {four} ({mlp_params(four) / 1e6:,.1f}M parameters), {strategy} (modelled)")
    confirmed_one = measured(_memory_config(data_dir, steps, scratch, model=wide_mlp(one), devices=1), f"ddp-1-W{one}")
    confirmed_four = measured({**base, "model": wide_mlp(four), "strategy": strategy}, f"{strategy}-4-W{four}")
    ratio = mlp_params(four) / mlp_params(one)
    verdict = "MET" if ratio >= 3 and confirmed_one and confirmed_four else "MISSED"
    print(f"memory pooled: {mlp_params(four) / 1e6:,.1f}M / {mlp_params(one) / 1e6:,.1f}M parameters = {ratio:.2f}x "
          f"(target >= 3; sizes modelled, both {'confirmed' if confirmed_one and confirmed_four else 'NOT confirmed'} "
          f"by a measured run) {verdict}")


def deep_mlp(in_channels: int = 1, num_classes: int = 10) -> DeepMlp:
    """``DeepMlp`` as a registered model (``edgetrain plan`` builds models by name); digits only (64 inputs)."""
    return DeepMlp()


DEFAULT_CLUSTER = "devices:\n  - {profile: rpi5, count: 2}\n  - {profile: rpi-zero-2w, count: 2}\n"
WIFI_JOBS = {"deep_mlp": dict(model="deep_mlp", dataset="digits"),
             "small_cnn": dict(model="small_cnn", dataset="synthetic", image_size=32, synthetic_samples=1024)}


def pipeline_against_fsdp(steps: int, scratch: str) -> None:
    """Measured bytes and virtual time per step of pipeline and fsdp on wifi-20m, beside the plan's (docstring)."""
    register_model("deep_mlp", deep_mlp)
    common = dict(devices=2, batch_size=64, microbatches=4, link="wifi-20m", lr=0.05, output=scratch)
    print(f"pipeline against fsdp on wifi-20m: 2 host devices, global batch 64, gpipe with 4 micro-batches, "
          f"{steps} steps; virtual time = this host's measured compute + modelled link time", flush=True)
    for name, job in WIFI_JOBS.items():
        cfg = TrainConfig(**job, **common)
        inputs = plan_inputs(cfg)
        planned = {row.strategy: row for row in compare(inputs, predict_inputs(inputs), ("fsdp", "pipeline"),
                                                        cfg.microbatches, cfg.pipeline_schedule).strategies}
        for strategy in ("fsdp", "pipeline"):
            torch.manual_seed(0)
            run = train(dict(**job, **common, steps=steps, eval=False, progress=False, timeout=120),
                        strategy=strategy)
            step_s = run["virtual_time_max_device_s"] / run["sync_steps"]
            link_s = run["comm_time_s"] / run["sync_steps"]  # rank 0's
            plan = planned[strategy]
            print(f"{name:9s} {strategy:8s} measured: {run['bytes_sent_per_step_per_device']:>12,.0f} B/step/device, "
                  f"virtual {step_s:7.3f} s/step (link {link_s:6.3f} s on rank 0) | planned: "
                  f"{plan.sent_bytes_per_step_max:>12,} B/step/device (max), {plan.step_s:7.3f} s/step", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, help="steps per run (default: 20; --part memory: 3)")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--cluster", help="cluster file (default: 2 rpi5 + 2 rpi-zero-2w)")
    parser.add_argument("--part", choices=("split", "wifi", "memory", "all"), default="all",
                        help="split: planned against even split; wifi: pipeline against fsdp on wifi-20m; "
                             "memory: a model over one device's memory, and the largest model pooled (not in all)")
    parser.add_argument("--data-dir", default=str(Path(__file__).resolve().parents[1].parent / "shared" / "data" /
                                                  "cifar10-subset" / "cifar-10-batches-py"))
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="pooling-") as scratch:
        print(f"host load average at start: {', '.join(f'{v:.1f}' for v in os.getloadavg())}", flush=True)
        if args.part == "memory":
            memory_benchmark(args.data_dir, args.steps or 3, scratch)
            print(f"host load average at end: {', '.join(f'{v:.1f}' for v in os.getloadavg())}")
            return
        if args.part in ("wifi", "all"):
            pipeline_against_fsdp(args.steps or 20, scratch)
        if args.part == "wifi":
            return
        cluster = args.cluster
        if cluster is None:
            cluster = os.path.join(scratch, "cluster.yaml")
            Path(cluster).write_text(DEFAULT_CLUSTER)
        cfg = dict(dataset="digits", steps=args.steps or 20, batch_size=256, microbatches=8, lr=0.05, cluster=cluster,
                   strategy="pipeline", output=scratch, eval=False, progress=False, timeout=120)
        throughput: dict[str, list[float]] = {"auto": [], "even": []}
        for round_ in range(args.rounds):
            for stages in throughput:
                torch.manual_seed(0)
                summary = train(cfg, model=DeepMlp(), stages=stages)
                throughput[stages].append(summary["throughput_samples_per_s"])
                print(f"round {round_} stages {stages}: {throughput[stages][-1]:.1f} samples/s (measured), "
                      f"{', '.join(summary['pipeline']['stages'])}", flush=True)
        ratios = [a / e for a, e in zip(throughput["auto"], throughput["even"])]
        verdict = "MET" if statistics.median(ratios) >= 1.3 else "MISSED"
        print(f"planned / even throughput per round: {', '.join(f'{r:.2f}' for r in ratios)}; median "
              f"{statistics.median(ratios):.2f} (target >= 1.3) {verdict}")
        print(f"host load average at end: {', '.join(f'{v:.1f}' for v in os.getloadavg())}")


if __name__ == "__main__":
    sys.exit(main())
