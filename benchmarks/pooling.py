"""Pooling memory (issue 13): the planner's split against an even one; pipeline against fsdp on wifi-20m;
a model over a device's memory.

    PYTHONPATH=src python benchmarks/pooling.py [--part split|wifi|all] [--steps 20] [--rounds 2] [--cluster FILE]
    PYTHONPATH=src python benchmarks/pooling.py --part memory [--steps 2] [--pooled pipeline,fsdp] [--data-dir CIFAR]

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
linear layers with ReLU, no BatchNorm), global batch 32 (pipeline: 4
micro-batches, GPipe, ``--stages auto``), SGD with momentum, ``--steps``
(default 2) steps per run, no evaluation. Every device builds the model on
the meta device and materialises only what it holds (models/init.py).
Devices run unthrottled (host speed, so throughput is this shared host's,
not a smart speaker's) but each is checked against its profile's 2,048 MiB:
a step whose measured peak RSS (VmHWM) passes it stops the run with the
loop's memory error. Every figure of a run is measured; the planner's lines
are marked modelled.

- *Largest on one device*: real runs of ddp on 1 device, from
  ``--start-width`` up or down by 1.125x until one trains and one does not,
  then bisection to a multiple of 256.
- *Over one device's memory*: at the smallest width that did not train on
  one device, the planner (modelled) for ddp, fsdp and pipeline on 4
  devices, then real runs: ddp on 2 devices (its per-device memory does not
  depend on their number past one, and 4 devices near 2 GB each would take
  more of the shared host than needed), fsdp and pipeline on 4. Per device:
  peak RSS in the steps against the limit, and after the end of the run
  (``run_peak_rss_mb``: the final exchange and the final checkpoint, which
  each device of a pooled run writes its own part of, ``RUN_DIR/checkpoint/``),
  throughput and bytes sent per step.
- *Largest on 4 devices*: the same search for each of ``--pooled``
  (pipeline, fsdp), from the width where the 3x target would be; a width
  "trains" when its steps stay under the limit (the loop's check). The
  ratio of parameters, best of 4 devices against 1, is judged against the
  target (>= 3x). Where rank 0 passed the limit at the end, the line says so.
- ``--widths W,W``: only single runs of ``--pooled`` on 4 devices at those
  widths (e.g. to find where the end of the run also stays under).

Planning is not used to search: ``count_costs`` builds the model for real
in the launching process (about 3 x 4 bytes per parameter; at W 8704 this
process reached 10 GB), so the planner runs at the over-memory width only.

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
import time
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


LIMIT_MB = 2048
WIDTH_STEP = 256  # the search's resolution: widths are multiples of it


def _memory_config(data_dir: str, steps: int, output: str, **overrides) -> dict:
    return dict(dataset="cifar10", data_dir=data_dir, profile="smart-speaker-2g", batch_size=32, microbatches=4,
                lr=0.01, momentum=0.9, steps=steps, output=output, eval=False, progress=False, throttle=False,
                timeout=600, **overrides)


def planned(cfg: dict, strategies: tuple[str, ...], runtime_mb: float):
    """The planner's prediction (modelled) of ``strategies`` for ``cfg``: a ``PlanComparison``.

    It counts costs on the model built for real in this process (plan/costs.py), about 3 x 4 bytes per
    parameter: called at the one width of the over-memory section only, not in the search (at W 8704,
    633M parameters, this process reached 10 GB)."""
    inputs = plan_inputs(TrainConfig(**{k: v for k, v in cfg.items() if k != "strategy"}))
    pred = predict_inputs(inputs, runtime_mb=runtime_mb)
    return compare(inputs, pred, strategies, cfg["microbatches"], "gpipe")


def wait_for_memory(need_mb: float, max_wait_s: float = 600) -> None:
    """Start a run only when the shared host has ``need_mb`` available (its devices may reach their limits)."""
    import psutil

    waited = 0.0
    while psutil.virtual_memory().available / 2**20 < need_mb and waited < max_wait_s:
        time.sleep(10)
        waited += 10
    if waited:
        print(f"  (waited {waited:.0f} s for {need_mb:,.0f} MiB of host memory)", flush=True)


def attempt(cfg: dict, label: str) -> tuple[str, dict | None]:
    """A real run (measured): ``("trained", summary)``, ``("over", None)`` when a device's peak RSS passed its
    limit at the end of a step (the loop's memory error), ``("refused", None)`` when the pipeline planner
    refused the split (modelled, before the first step). Any other error stops the benchmark."""
    wait_for_memory(cfg.get("devices", 1) * LIMIT_MB * 1.3 + 1024)
    try:
        summary = train(cfg, run_name=label)
    except EdgetrainError as e:
        text = str(e)
        if "ran out of memory" in text:
            print(f"  {label}: stopped (measured): {text}", flush=True)
            return "over", None
        if "does not fit" in text or "alone needs" in text:
            print(f"  {label}: refused by the planner (modelled, no step ran): {text}", flush=True)
            return "refused", None
        raise
    per = summary["per_device"]
    steps_peaks = ", ".join(f"{d['peak_rss_mb']:,.0f}" for d in per)
    run_peaks = ", ".join(f"{d['run_peak_rss_mb']:,.0f}" for d in per)
    over_at_end = [d["rank"] for d in per if d["run_peak_rss_mb"] > LIMIT_MB]
    print(f"  {label}: trained {summary['steps']} steps (measured): peak RSS per device in the steps {steps_peaks} "
          f"MiB of {LIMIT_MB:,}; after the end (final checkpoint written) {run_peaks} MiB"
          + (f" (device {', '.join(map(str, over_at_end))} over its limit at the end)" if over_at_end else "")
          + f"; {summary['throughput_samples_per_s']:,.1f} samples/s (host speed, unthrottled); "
          f"{summary['bytes_sent_per_step_per_device'] / 1e6:,.1f} MB sent per device per step", flush=True)
    return "trained", summary


def largest_trained(name: str, cfg_at, start: int, grow: float = 1.125) -> tuple[int, int, dict]:
    """The largest width (multiple of ``WIDTH_STEP``) whose real run trains (measured), by bracketing from
    ``start`` (up or down by ``grow``) then bisecting: ``(largest that trained, smallest that did not, runs)``,
    ``runs`` mapping each width tried to its outcome and summary."""
    runs: dict[int, tuple[str, dict | None]] = {}

    def trains(width: int) -> bool:
        runs[width] = attempt(cfg_at(width), f"{name}-W{width}")
        return runs[width][0] == "trained"

    def snap(width: float) -> int:
        return max(WIDTH_STEP, int(round(width / WIDTH_STEP)) * WIDTH_STEP)

    print(f"  [{name}] W {start} ({mlp_params(start) / 1e6:,.1f}M parameters):", flush=True)
    if trains(start):
        low, high = start, None
        while high is None:
            width = max(snap(low * grow), low + WIDTH_STEP)
            print(f"  [{name}] W {width} ({mlp_params(width) / 1e6:,.1f}M parameters):", flush=True)
            low, high = (width, None) if trains(width) else (low, width)
    else:
        low, high = None, start
        while low is None:
            width = min(snap(high / grow), high - WIDTH_STEP)
            if width < WIDTH_STEP:
                return 0, high, runs
            print(f"  [{name}] W {width} ({mlp_params(width) / 1e6:,.1f}M parameters):", flush=True)
            low, high = (width, high) if trains(width) else (None, width)
    while high - low > WIDTH_STEP:
        width = (low + high) // 2 // WIDTH_STEP * WIDTH_STEP
        print(f"  [{name}] W {width} ({mlp_params(width) / 1e6:,.1f}M parameters):", flush=True)
        low, high = (width, high) if trains(width) else (low, width)
    return low, high, runs


def memory_benchmark(data_dir: str, steps: int, scratch: str, pooled: tuple[str, ...], start_one: int,
                     widths: tuple[int, ...] = ()) -> None:
    from edgetrain.cluster.launch import idle_process_mb

    runtime_mb = idle_process_mb()
    print(f"idle device process (measured): {runtime_mb:,.0f} MiB; limit per smart-speaker-2g: {LIMIT_MB:,} MiB; "
          f"{steps} steps per run, devices unthrottled (host speed), batch 32, SGD momentum 0.9", flush=True)

    def config(width: int, devices: int, **extra) -> dict:
        return _memory_config(data_dir, steps, scratch, model=wide_mlp(width), devices=devices, **extra)

    if widths:  # --widths: single runs on 4 devices at these widths, no search (e.g. where the end stays under)
        for strategy in pooled:
            for width in widths:
                print(f"  [{strategy}-4] W {width} ({mlp_params(width) / 1e6:,.1f}M parameters):", flush=True)
                attempt(config(width, 4, strategy=strategy), f"{strategy}-4-W{width}")
        return

    print("\n== the largest WideMlp that trains on one device (ddp on 1 device; real runs, measured) ==", flush=True)
    one, one_over, _ = largest_trained("ddp-1", lambda w: config(w, 1), start_one)
    print(f"  largest on 1 device: W {one} ({mlp_params(one) / 1e6:,.1f}M parameters) trained; "
          f"W {one_over} ({mlp_params(one_over) / 1e6:,.1f}M) did not (measured)", flush=True)

    over = one_over
    print(f"\n== over one device's memory: WideMlp W {over}, {mlp_params(over) / 1e6:,.1f}M parameters "
          f"(the smallest width that did not train on one device) ==", flush=True)
    for row in planned(config(over, 4), ("ddp", "fsdp", "pipeline"), runtime_mb).strategies:
        print(f"  plan (modelled): {row.describe()}", flush=True)
    # ddp on 2 devices: its per-device memory does not depend on their number past 1 (a replica and its
    # buckets each), and 4 devices near 2 GB each would take more of this shared host than needed
    attempt(config(over, 2), f"ddp-2-W{over}")
    for strategy in ("fsdp", "pipeline"):
        attempt(config(over, 4, strategy=strategy), f"{strategy}-4-W{over}")

    print("\n== the largest WideMlp that trains on 4 devices (real runs, measured) ==", flush=True)
    # Start where the 3x target would be (parameters grow about as W^2), then bracket and bisect.
    start = max(int(round(one * 3 ** 0.5 / WIDTH_STEP)) * WIDTH_STEP, over)
    four = {}
    for strategy in pooled:
        low, high, runs = largest_trained(f"{strategy}-4", lambda w: config(w, 4, strategy=strategy), start)
        how = "measured" if runs[high][0] == "over" else "refused by the planner, modelled"
        end_peak = max(d["run_peak_rss_mb"] for d in runs[low][1]["per_device"]) if low else float("nan")
        print(f"  largest with {strategy} on 4 devices: W {low} ({mlp_params(low) / 1e6:,.1f}M parameters) "
              f"trained; W {high} ({mlp_params(high) / 1e6:,.1f}M) did not ({how}); at W {low} the highest "
              f"peak after the end was {end_peak:,.0f} MiB", flush=True)
        four[strategy] = low
    best = max(four, key=four.get)
    ratio = mlp_params(four[best]) / mlp_params(one)
    print(f"\nmemory pooled (measured): {mlp_params(four[best]) / 1e6:,.1f}M parameters on 4 devices ({best}, "
          f"W {four[best]}) / {mlp_params(one) / 1e6:,.1f}M on 1 (W {one}) = {ratio:.2f}x (target >= 3) "
          f"{'MET' if ratio >= 3 else 'MISSED'}; widths to the nearest {WIDTH_STEP} below the first that did "
          f"not train, so each side's largest is short by less than one step", flush=True)


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
    parser.add_argument("--steps", type=int, help="steps per run (default: 20; --part memory: 2)")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--cluster", help="cluster file (default: 2 rpi5 + 2 rpi-zero-2w)")
    parser.add_argument("--part", choices=("split", "wifi", "memory", "all"), default="all",
                        help="split: planned against even split; wifi: pipeline against fsdp on wifi-20m; "
                             "memory: a model over one device's memory, and the largest model pooled (not in all)")
    parser.add_argument("--data-dir", default=str(Path(__file__).resolve().parents[1].parent / "shared" / "data" /
                                                  "cifar10-subset" / "cifar-10-batches-py"))
    parser.add_argument("--pooled", default="pipeline,fsdp",
                        help="--part memory: strategies searched on 4 devices (pipeline, fsdp or both)")
    parser.add_argument("--start-width", type=int, default=3584,
                        help="--part memory: where the one-device search starts (a multiple of 256)")
    parser.add_argument("--widths", help="--part memory: only single runs of --pooled on 4 devices at these widths "
                                         "(comma-separated), no search")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="pooling-") as scratch:
        print(f"host load average at start: {', '.join(f'{v:.1f}' for v in os.getloadavg())}", flush=True)
        if args.part == "memory":
            memory_benchmark(args.data_dir, args.steps or 2, scratch, tuple(args.pooled.split(",")), args.start_width,
                             tuple(int(w) for w in args.widths.split(",")) if args.widths else ())
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
