"""``edgetrain plan``: predict step time, throughput and memory of a cluster before training on it.

Takes the options of ``edgetrain train`` that describe the job and the
cluster (same names, same validation), plus the model's knobs::

    edgetrain plan --model resnet18 --dataset synthetic --devices 4 --profile rpi4 --link lte-10m \\
        --batch-size 128 --compress topk:0.01 --scale 1,2,4,...,4096

Prints the per-device prediction, the simulation and (``--scale``) the
scaling table; ``--strategy fsdp|pipeline`` adds that strategy's per-device
memory and step time, ``compare`` all three and the one to use
(``plan.strategies``); writes ``plan.json`` (a ``results.PlanResult``, which
``edgetrain report`` renders) and ``scaling.png`` into a new run directory. Every number is modelled except the counted model costs.
Options are checked when parsed (finite numbers, fractions in [0, 1],
positive counts) and the output directory before anything is computed.
``--dataset cifar10`` needs no ``--data-dir``: without one, the data set's
memory is counted from CIFAR-10's published size (``plan.config``).
"""
from __future__ import annotations

import argparse
import dataclasses
import math
import sys

from edgetrain.arguments import fraction, non_negative_float, positive_float, positive_int
from edgetrain.config import TrainConfig, add_config_arguments, check_output_dir, load_config, resolve
from edgetrain.errors import EdgetrainError
from edgetrain.files import new_run_dir, write_json
from edgetrain.kinds import STRATEGY_KINDS
from edgetrain.plan.model import DEFAULT_EFFICIENCY, step_timing
from edgetrain.results import PLAN_FILE, PlanPrediction, PlanResult, PlanScaling, PlanSimulation

# Imported inside functions: edgetrain.plan.config, edgetrain.plan.simulation and edgetrain.plan.strategies (torch) and
# edgetrain.plan.report (rich), so that plan's flags, --help and bad input answer without them (seconds on a Pi).

# The TrainConfig options that describe what is planned (the rest only matter to a real run).
PLAN_FIELDS = ("model", "dataset", "data_dir", "image_size", "synthetic_samples", "devices", "profile", "cluster",
               "batch_size", "local_batch", "optimizer", "momentum", "compress", "sync", "link", "seed", "output",
               "run_name", "microbatches", "pipeline_schedule")
# --strategy: the strategies each choice predicts
_PLANNED = tuple(name for name, kind in STRATEGY_KINDS.items() if kind.planner is not None)
# (a strategy without a planner model is refused in its own line: edgetrain.kinds)
PLAN_STRATEGIES = {**{name: (name,) for name in STRATEGY_KINDS}, "compare": _PLANNED}
MAX_DEVICES = 1 << 20


def register(sub) -> None:
    p = sub.add_parser("plan", help="predict step time, throughput and memory of a cluster (modelled, no training)",
                       description="Analytic cost model and step simulator: counted FLOPs and bytes of the real "
                                   "model, device profiles and the link model. Everything printed is modelled.",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--config", metavar="FILE", help="YAML file of edgetrain train config keys (plan reads the ones it needs)")
    add_config_arguments(p, PLAN_FIELDS)
    p.add_argument("--efficiency", type=positive_float, default=DEFAULT_EFFICIENCY,
                   help="fraction of the profile's GFLOPS a training step achieves (0.6: the middle of 0.4-0.9 "
                        "measured for small CNNs and ResNet-18 on the development host; see edgetrain.plan.model)")
    p.add_argument("--overlap", type=fraction, default=0.0,
                   help="fraction of synchronous communication hidden behind backward (edgetrain's hooks: 0)")
    p.add_argument("--runtime-mb", type=non_negative_float, default=None,
                   help="memory baseline per device in MiB (default: RSS of an idle edgetrain process, measured now)")
    p.add_argument("--sim-steps", type=positive_int, default=100,
                   help="steps to simulate (local:H and gossip:H round up to whole periods)")
    p.add_argument("--compute-cv", type=non_negative_float, default=0.05,
                   help="coefficient of variation of a device's step compute time in the simulation (0.05: "
                        "CPU time of one-thread training steps on the shared development host varied by 5-9%%)")
    p.add_argument("--stragglers", default="0", metavar="P[:SLOWDOWN]",
                   help="probability that a device's step is a straggler, and how much slower it is (default x3)")
    p.add_argument("--jitter", action=argparse.BooleanOptionalAction, default=True,
                   help="simulate the links' latency jitter")
    p.add_argument("--strategy", default="ddp", choices=PLAN_STRATEGIES,
                   help="what to predict: ddp (data parallel), fsdp, pipeline (stages from the split planner), or "
                        "compare: every strategy the planner models side by side and the one to use "
                        "(edgetrain.plan.strategies)")
    p.add_argument("--scale", default=None, metavar="N,N,...",
                   help="device counts for the scaling table, e.g. 1,2,4,...,4096 ('...' keeps doubling)")
    p.set_defaults(func=run)


def parse_scale(text: str) -> list[int]:
    """``"1,2,4,...,64"`` -> [1, 2, 4, 8, 16, 32, 64]; ``"1,3,9"`` as given."""
    parts = [t.strip() for t in text.split(",") if t.strip()]
    counts: list[int] = []
    try:
        for i, t in enumerate(parts):
            if t == "...":
                if len(counts) < 2 or i + 1 >= len(parts):
                    raise ValueError
                ratio, last = counts[-1] / counts[-2], int(parts[i + 1])
                if ratio <= 1:
                    raise ValueError
                while counts[-1] * ratio < last:
                    counts.append(round(counts[-1] * ratio))
            else:
                counts.append(int(t))
    except ValueError:
        raise EdgetrainError(f"bad --scale {text!r}; give device counts like 1,2,4,8 or 1,2,4,...,4096") from None
    if not counts or any(n < 1 or n > MAX_DEVICES for n in counts) or counts != sorted(set(counts)):
        raise EdgetrainError(f"--scale needs increasing device counts between 1 and {MAX_DEVICES:,}, got {text!r}")
    return counts


def parse_stragglers(text: str) -> tuple[float, float]:
    prob, _, factor = text.partition(":")
    try:
        p, f = float(prob), float(factor) if factor else 3.0
    except ValueError:
        raise EdgetrainError(f"bad --stragglers {text!r}; write P or P:SLOWDOWN, e.g. 0.01:3") from None
    if not 0 <= p <= 1 or not 1 <= f < math.inf:  # written so that nan fails too
        raise EdgetrainError(f"--stragglers {text!r}: probability must be in [0, 1] and the slowdown >= 1 "
                             f"(finite); write P or P:SLOWDOWN, e.g. 0.01:3")
    return p, f


def _load(args: argparse.Namespace) -> TrainConfig:
    """The config the plan is for: the file with plan's options on top, refused where plan has no model of it."""
    overrides = {k: v for k, v in vars(args).items() if k in PLAN_FIELDS}
    cfg = load_config(args.config, **overrides)
    if cfg.pipeline_replicas != 1:  # a config file's: the option itself is not one of plan's
        raise EdgetrainError(f"config key 'pipeline_replicas' {cfg.pipeline_replicas}: edgetrain plan does not model "
                             f"pipeline replicas yet (it plans one pipeline over the devices); drop it from the "
                             f"config file to plan one pipeline")
    if cfg.fsdp_replicas != 1:
        raise EdgetrainError(f"config key 'fsdp_replicas' {cfg.fsdp_replicas}: edgetrain plan does not model sharded "
                             f"replicas yet (it plans fsdp over all the devices); drop it from the config file to "
                             f"plan one sharded model")
    check_output_dir(cfg.output, "config key 'output'")
    return cfg


def run(args: argparse.Namespace) -> int:
    cfg = _load(args)
    straggler_prob, straggler_factor = parse_stragglers(args.stragglers)
    counts = parse_scale(args.scale) if args.scale else None
    strategies = PLAN_STRATEGIES[args.strategy]
    for name in strategies:
        STRATEGY_KINDS[name].check_planned()  # one the planner has no model of: refused before anything is computed
    # the checks edgetrain train --strategy NAME makes (link aside: here it is modelled)
    specs = {name: resolve(dataclasses.replace(cfg, strategy=name, link=None)) for name in strategies}
    # after the checks above: bad input is answered before torch loads
    from edgetrain.plan.config import plan_inputs, predict_inputs
    from edgetrain.plan.report import (console, device_groups, plot_scaling, print_prediction, print_scaling,
                                       print_simulation, print_strategies)
    from edgetrain.plan.simulation import scaling, simulate
    from edgetrain.plan.strategies import compare
    sim_options = dict(compute_cv=args.compute_cv, straggler_prob=straggler_prob, straggler_factor=straggler_factor,
                       jitter=args.jitter, seed=cfg.seed)

    inputs = plan_inputs(cfg)
    knobs = dict(efficiency=args.efficiency, overlap=args.overlap, runtime_mb=args.runtime_mb)
    pred = predict_inputs(inputs, **knobs)
    knobs["runtime_mb"] = pred.runtime_mb  # measured once
    steps = args.sim_steps
    if step_timing(pred.traffic) == "periodic":  # whole periods, or the mean would miss part of an exchange
        steps = math.ceil(steps / pred.traffic.period) * pred.traffic.period
    sim = PlanSimulation.from_dict(simulate(pred, steps=steps, **sim_options).to_dict())
    rows = scaling(lambda n: predict_inputs(inputs, n, **knobs), counts, steps, **sim_options) if counts else None

    out = console()
    print_prediction(pred, out)
    print_simulation(sim, out)
    if rows:
        print_scaling(rows, out)
    comparison = None
    if strategies != ("ddp",):
        pipeline = next((spec.pipeline for spec in specs.values() if spec.pipeline is not None), None)
        comparison = compare(inputs, pred, strategies, pipeline.microbatches if pipeline else cfg.microbatches,
                             pipeline.schedule if pipeline else cfg.pipeline_schedule)
        print_strategies(comparison, out)

    run_dir = new_run_dir(cfg.output, cfg.run_name, prefix="plan")
    # The model's own dict, less the groups, checked and typed by the schema the report reads.
    prediction = PlanPrediction.from_dict(pred.to_dict(per_device=len(pred.devices) <= 1024)
                                          | {"device_groups": [g.to_dict() for g in device_groups(pred)]})
    result = PlanResult(argv=sys.argv[1:], config={k: getattr(cfg, k) for k in PLAN_FIELDS}, prediction=prediction,
                        simulation=sim, scaling=PlanScaling(mode="weak", rows=rows) if rows else None,
                        strategies=comparison)
    write_json(run_dir / PLAN_FILE, result.to_dict())
    if rows:
        title = f"{cfg.model}, {pred.devices[0].profile}, {pred.devices[0].link}, {cfg.sync}, compress {cfg.compress}"
        plot_scaling(rows, run_dir / "scaling.png", title)
    out.print(f"wrote {run_dir / PLAN_FILE}" + (f" and {run_dir / 'scaling.png'}" if rows else ""))
    return 0
