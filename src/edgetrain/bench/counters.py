"""Hardware counters of a training step: instructions, cycles, IPC, cache and branch misses.

The Raspberry Pi study compared frameworks by instruction count and L1 miss
ratio as well as by time. Linux ``perf stat`` reads those counters; here it
wraps a child process that builds the model and warms up with counting
disabled (``-D -1``), then enables the counters through perf's control FIFO
(``--control fifo:CTL,ACK``, perf >= 5.9) only around the timed steps, so
imports and warm-up are not in the counts.

Counters are often missing: no ``perf`` binary, ``perf_event_paranoid`` too
strict, or a virtual machine that exposes no PMU (events read
``<not supported>``). Then the bench says which, keeps what it could measure
(step time, software events) and exits cleanly.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

from edgetrain.arguments import non_negative_int, positive_int
from edgetrain.bench import workload
from edgetrain.bench.common import print_table, save_result, say, start_run
from edgetrain.results import CountersResult
from edgetrain.spec import DATASET_SHAPES

# Imported inside functions: torch and edgetrain.report.plots (matplotlib), so that bench's flags and --help answer
# without them.

HARDWARE_EVENTS = ["instructions", "cycles", "cache-references", "cache-misses", "branches",
                   "branch-misses", "L1-dcache-loads", "L1-dcache-load-misses"]
SOFTWARE_EVENTS = ["task-clock", "context-switches", "page-faults"]
RATIOS = {  # name: (numerator, denominator)
    "IPC": ("instructions", "cycles"),
    "cache_miss_ratio": ("cache-misses", "cache-references"),
    "branch_miss_ratio": ("branch-misses", "branches"),
    "L1d_miss_ratio": ("L1-dcache-load-misses", "L1-dcache-loads"),
}


def parse_perf_csv(text: str) -> dict[str, float | None]:
    """``perf stat -x,`` lines -> {event: count, or None where not supported/counted}."""
    counts: dict[str, float | None] = {}
    for line in text.splitlines():
        fields = line.split(",")
        if len(fields) < 3 or line.startswith("#"):
            continue
        value, event = fields[0], fields[2]
        event = event.split(":")[0].split("/")[0] or event
        try:
            counts[event] = float(value)
        except ValueError:  # <not supported>, <not counted>
            counts[event] = None
    return counts


def ratios(counts: dict[str, float | None]) -> dict[str, float | None]:
    out: dict[str, float | None] = {}
    for name, (num, den) in RATIOS.items():
        n, d = counts.get(num), counts.get(den)
        out[name] = n / d if n is not None and d else None
    return out


def _child(ctl: str, ack: str, spec: dict) -> dict:
    """Runs under perf: warm up uncounted, count only the timed steps."""
    import torch

    torch.set_num_threads(spec["threads"])
    model = workload.build_model(spec["model"], spec["dataset"])
    workload.time_steps(model, spec["batch_size"], 0, spec["warmup"], spec["dataset"], spec["threads"])
    with open(ctl, "w") as c, open(ack) as a:
        c.write("enable\n")
        c.flush()
        a.readline()
        out = workload.time_steps(model, spec["batch_size"], spec["steps"], 0, spec["dataset"], spec["threads"])
        c.write("disable\n")
        c.flush()
        a.readline()
    return out


def measure(perf: str, spec: dict, timeout_s: float) -> tuple[dict, dict[str, float | None], str]:
    """Run the counted child under ``perf``; return (step timing, counts, perf's complaint or '')."""
    with tempfile.TemporaryDirectory() as tmp:
        ctl, ack, out = (os.path.join(tmp, n) for n in ("ctl", "ack", "perf.csv"))
        os.mkfifo(ctl)
        os.mkfifo(ack)
        cmd = [perf, "stat", "-x,", "-o", out, "-D", "-1", "--control", f"fifo:{ctl},{ack}",
               "-e", ",".join(HARDWARE_EVENTS + SOFTWARE_EVENTS), "--",
               sys.executable, "-m", "edgetrain.bench.counters", ctl, ack, json.dumps(spec)]
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                env=workload.child_env(spec["threads"]), start_new_session=True)
        try:
            stdout, stderr = proc.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
            return {}, {}, f"perf stat did not finish in {timeout_s:.0f}s"
        text = Path(out).read_text() if os.path.exists(out) else ""
    lines = [ln for ln in stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        why = (stderr.strip().splitlines() or text.strip().splitlines() or [f"exit {proc.returncode}"])
        return {}, {}, f"perf stat failed: {why[-1]}"
    return json.loads(lines[-1]), parse_perf_csv(text), ""


def _paranoid() -> str:
    try:
        return Path("/proc/sys/kernel/perf_event_paranoid").read_text().strip()
    except OSError:
        return "unknown"


def run(model: str = "resnet18", dataset: str = "cifar10", *, batch_size: int = 32, steps: int = 3,
        warmup: int = 1, threads: int | None = None, timeout_s: float = 600,
        output: str = "runs", name: str | None = None) -> CountersResult:
    threads = threads or os.cpu_count() or 1
    spec = dict(model=model, dataset=dataset, batch_size=batch_size, steps=steps, warmup=warmup, threads=threads)
    perf = shutil.which("perf")
    counts: dict[str, float | None] = {}
    if perf is None:
        message = ("perf not found on PATH: install it (Debian: linux-perf; Ubuntu/Raspberry Pi OS: "
                   "linux-tools) to read hardware counters; step time was measured without them")
        timing, complaint = None, "no perf"
    else:
        timing, counts, complaint = measure(perf, spec, timeout_s)
        hardware = {e: counts.get(e) for e in HARDWARE_EVENTS}
        if complaint:
            message = (f"{complaint} (perf_event_paranoid={_paranoid()}); "
                       "hardware counters not read, step time measured without perf")
        elif all(v is None for v in hardware.values()):
            message = ("perf runs, but this machine exposes no hardware counters: every hardware event "
                       "reads <not supported> (typical of virtual machines and some containers); "
                       "software events and step time are measured")
        elif any(v is None for v in hardware.values()):
            missing = ", ".join(e for e, v in hardware.items() if v is None)
            message = f"some hardware events are not supported here: {missing}"
        else:
            message = ""
    if not timing:  # no perf, or perf failed: still time the steps
        import torch

        torch.set_num_threads(threads)
        net = workload.build_model(model, dataset)
        timing = workload.time_steps(net, batch_size, steps, warmup, dataset, threads)
    samples = batch_size * steps
    per_sample = {e: (v / samples if v is not None else None) for e, v in counts.items()}
    available = any(counts.get(e) is not None for e in HARDWARE_EVENTS)
    run_dir = start_run(output, name, "counters")
    result = save_result(run_dir, CountersResult(
        params=dict(spec, perf=perf), available=available, message=message, counts=counts, per_sample=per_sample,
        ratios=ratios(counts), samples_per_s=timing["samples_per_s"], step_s=timing["step_s"]))
    from edgetrain.report import plots

    plots.plot_counters(result.to_dict(), run_dir / "counters.png")
    rows = [(e + (" (ms)" if e == "task-clock" else ""), counts.get(e), per_sample.get(e)) for e in HARDWARE_EVENTS + SOFTWARE_EVENTS if e in counts]
    rows += [(k, v, None) for k, v in result.ratios.items()]
    if message:
        say(f"bench counters: {message}")
    print_table(f"bench counters: {model}, batch {batch_size}, {steps} steps -> {run_dir}",
                ["event", "count", "per sample"], rows,
                [f"step time measured: {timing['samples_per_s']:.1f} samples/s (batch / median step)"])
    return result


def add_parser(sub) -> None:
    p = sub.add_parser("counters", help="instructions, cycles, IPC, cache and branch misses via Linux perf")
    p.add_argument("--model", default="resnet18")
    p.add_argument("--dataset", default="cifar10", choices=sorted(DATASET_SHAPES))
    p.add_argument("--batch-size", type=positive_int, default=32)
    p.add_argument("--steps", type=positive_int, default=3)
    p.add_argument("--warmup", type=non_negative_int, default=1)
    p.add_argument("--threads", type=positive_int, default=None)
    p.set_defaults(bench_func=lambda a: run(
        a.model, a.dataset, batch_size=a.batch_size, steps=a.steps, warmup=a.warmup, threads=a.threads,
        output=a.output, name=a.name))


if __name__ == "__main__":
    print(json.dumps(_child(sys.argv[1], sys.argv[2], json.loads(sys.argv[3]))))
