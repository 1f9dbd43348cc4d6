"""The section of ``edgetrain report`` for a plan run: a directory with ``plan.json`` (``edgetrain plan``).

Rendered from the typed ``results.PlanResult`` that ``html.load_run`` read:

- notes: the model costs (counted), the analytic prediction (step time,
  throughput, communication+waiting share of the step), the exchange, the
  simulation, and devices over their memory limit;
- a table of the device groups (devices with the same prediction merged, as
  ``edgetrain plan`` prints them): per-device step time split into compute,
  communication and waiting, throughput, memory and its limit, and the share
  of the step spent communicating or waiting;
- the scaling table of ``--scale`` (analytic and simulated), and the
  ``scaling.png`` the plan drew, if any;
- with ``--strategy fsdp|pipeline|compare``, the strategies side by side
  (step time, throughput, memory against the limits, bytes per step, the
  pipeline's bubble, why one is refused), the recommendation and every
  device's role (shard or stage) under each;
- what was planned (``config``) and the model's knobs.

Every number on it is modelled (the model costs are counted): the section
says so in its title and every note is styled as modelled. A plan has no
place on the radar chart, which compares measured runs (``html.configurations``).
"""
from __future__ import annotations

import html
from collections.abc import Sequence
from pathlib import Path

from edgetrain.report.cells import fmt, img, kv, table
from edgetrain.results import PlanComparison, PlanResult


def plan_section(plan: PlanResult, run_dir: Path, pngs: Sequence[Path] = ()) -> str:
    pred, sim = plan.prediction, plan.simulation
    meta = " · ".join([str(run_dir), "edgetrain " + " ".join(plan.argv)] if plan.argv else [str(run_dir)])
    parts = [f"<section><h2>plan (modelled)</h2><div class='meta'>{html.escape(meta)}</div>"]
    parts += [f'<div class="note modelled">{html.escape(n)}</div>' for n in notes(plan)]
    parts.append("<h3>Per device, modelled (devices with the same prediction are one row)</h3>")
    parts.append(table(["ranks", "devices", "profile", "GFLOPS", "batch", "link", "compute s", "comm s", "wait s",
                         "step s", "samples/s", "memory MiB", "limit MiB", "comm+wait %"],
                        [[g.ranks, g.count, g.profile, g.gflops, g.batch, g.link, g.compute_s, g.comm_s, g.wait_s,
                          g.step_s, g.samples_per_s, g.memory_total_mb,
                          fmt(g.memory_limit_mb) + (" OVER LIMIT" if g.over_limit else ""),
                          f"{100 * (g.comm_s + g.wait_s) / g.step_s:.1f}%" if g.step_s else "-"]
                         for g in pred.device_groups]))
    if plan.scaling:
        parts.append(f"<h3>Scaling, modelled ({html.escape(plan.scaling.mode)}: every device keeps its local batch)"
                     f"</h3>")
        parts.append(table(["devices", "step s", "samples/s", "speedup", "efficiency", "sim step s", "sim p99 s",
                             "sim samples/s", "sim speedup", "sim efficiency", "comm %", "wait %"],
                            [[r.devices, r.analytic_step_s, r.analytic_throughput, r.analytic_speedup,
                              r.analytic_efficiency, r.simulated_step_s, r.simulated_p99_step_s,
                              r.simulated_throughput, r.simulated_speedup, r.simulated_efficiency,
                              f"{100 * r.comm_fraction:.0f}%", f"{100 * r.wait_fraction:.0f}%"]
                             for r in plan.scaling.rows]))
    if plan.strategies:
        parts.append(strategies_section(plan.strategies))
    knobs = {"efficiency": pred.efficiency, "overlap": pred.overlap, "runtime_mb": pred.runtime_mb,
             "sim_steps": sim.steps, "compute_cv": sim.compute_cv, "stragglers": sim.straggler_prob or None,
             "link_jitter": sim.link_jitter}
    parts.append("<h3>Planned</h3>" + kv({**plan.config, **knobs}))
    if pngs:
        parts.append('<div class="imgs">' + "".join(img(p.read_bytes(), p.name) for p in pngs) + "</div>")
    parts.append("</section>")
    return "".join(parts)


def strategies_section(comparison: PlanComparison) -> str:
    """``--strategy fsdp|pipeline|compare``: each strategy in one row, the recommendation, then every device."""
    parts = [f"<h3>Strategies, modelled (link {html.escape(comparison.link)}, the same global batch)</h3>"]
    if comparison.reason:
        parts.append(f'<div class="note modelled">recommended: {html.escape(comparison.reason)}</div>')
    parts.append(table(["strategy", "fits", "step s", "samples/s", "memory MiB (max)", "sent MB/step (max)",
                         "bubble", "refused"],
                        [[s.strategy, "yes" if s.fits else "NO", s.step_s, s.throughput_samples_per_s,
                          s.memory_total_mb_max, None if s.step_s is None else s.sent_bytes_per_step_max / 1e6,
                          None if s.bubble_fraction is None else f"{s.bubble_fraction:.1%}", s.refused or ""]
                         for s in comparison.strategies]))
    parts.append(table(["strategy", "rank", "profile", "role", "compute s", "comm+wait s", "step s", "memory MiB",
                         "limit MiB", "sent MB/step"],
                        [[s.strategy, d.rank, d.profile, d.role, d.compute_s, d.comm_s, d.step_s, d.memory_total_mb,
                          fmt(d.memory_limit_mb) + (" OVER LIMIT" if d.over_limit else ""),
                          d.sent_bytes_per_step / 1e6]
                         for s in comparison.strategies for d in s.devices]))
    parts += [f'<div class="note modelled">{html.escape(s.strategy)}: {html.escape(n)}</div>'
              for s in comparison.strategies for n in s.notes]
    return "".join(parts)


def notes(plan: PlanResult) -> list[str]:
    """What ``edgetrain plan`` printed around its tables, from the file."""
    pred, costs, traffic = plan.prediction, plan.prediction.model, plan.prediction.traffic
    out = [f"{costs['model']} input {'x'.join(map(str, costs['input_shape']))}: {costs['params']:,} parameters, "
           f"{costs['train_flops_per_sample'] / 1e9:,.3f} GFLOP/sample train, "
           f"{costs['activation_bytes_per_sample'] / 2**20:,.2f} MiB activations/sample (counted)"]
    if traffic.get("collectives"):
        out.append(f"exchange ({traffic['sync']}, compress {traffic['compress']}): payload "
                   f"{traffic['payload_bytes'] / 1e6:,.3f} MB vs fp32 {traffic['fp32_bytes'] / 1e6:,.3f} MB, "
                   f"modelled {pred.exchange_s:,.3f} s")
    out.append(f"modelled ({pred.devices:,} devices): step {pred.step_s:,.3f} s, throughput "
               f"{pred.throughput_samples_per_s:,.2f} samples/s, communication+waiting {pred.comm_fraction:.1%} of "
               f"the step")
    out.append(plan.simulation.describe())
    if pred.over_limit_ranks:
        out.append(f"modelled: {len(pred.over_limit_ranks):,} device(s) need more memory than their profile has")
    return out
