"""Power modes: time and energy per epoch for each setting of the knobs a device exposes.

The Jetson study found that power modes (active cores, clock frequencies)
trade time against energy, with a sweet spot that has to be searched for.
This bench sweeps what the device offers:

* training threads (active cores): everywhere;
* the CPU frequency ceiling (``cpufreq/scaling_max_freq``): where writable,
  restored afterwards;
* ``nvpmodel`` power modes: on Jetsons, restored afterwards;

and reports for each setting the measured throughput, the time per epoch
(epoch samples / measured samples/s) and the energy per epoch, then the
Pareto front of (time, energy): the settings no other beats on both.

Energy comes from a real sensor where one can be read: Intel RAPL package
counters (``/sys/class/powercap/intel-rapl:N/energy_uj``, wrap-around
handled) or the Jetson's INA3221 rail monitors (power sampled at 20 Hz and
integrated). Otherwise the user may supply a power model, ``idle + per-core x
active cores`` watts; energies from it are labelled *modelled* everywhere.
"""
from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import time
from contextlib import closing, contextmanager
from pathlib import Path
from typing import Any, Iterator

from edgetrain.arguments import non_negative_int, positive_int
from edgetrain.bench import workload
from edgetrain.bench.common import print_table, save_result, say, start_run
from edgetrain.bench.peak import _ints
from edgetrain.cluster.profiles import model_power_w
from edgetrain.cluster.sensors import INA_ROOTS, RAPL_ROOT, ina_power_files, rapl_domains, rapl_meter, sampled_meter
from edgetrain.errors import EdgetrainError
from edgetrain.results import PowerResult
from edgetrain.spec import DATASET_SHAPES

# Imported inside functions: torch and edgetrain.report.plots (matplotlib), so that bench's flags and --help answer
# without them.

CPU_ROOT = "/sys/devices/system/cpu"


def parse_power_model(text: str | None) -> tuple[float, float] | None:
    if not text:
        return None
    try:
        idle, per_core = (float(v) for v in text.split(","))
    except ValueError:
        raise EdgetrainError(f"--power-model wants IDLE_W,PER_CORE_W (e.g. 2.7,1.2), got {text!r}") from None
    if idle < 0 or per_core < 0:
        raise EdgetrainError("--power-model watts must be >= 0")
    return idle, per_core


def energy_source(rapl_root: str, ina_roots: tuple[str, ...], model: tuple[float, float] | None) -> dict:
    """The best energy source available, as a description (kind, modelled, paths...)."""
    domains = rapl_domains(rapl_root)
    if domains:
        return {"kind": "Intel RAPL (powercap)", "modelled": False, "paths": [str(d) for d in domains]}
    ina = ina_power_files(ina_roots)
    if ina:
        return {"kind": "Jetson INA3221", "modelled": False, "paths": [str(f) for f in ina]}
    if model:
        return {"kind": "power model (idle + per-core x active cores)", "modelled": True,
                "idle_w": model[0], "per_core_w": model[1]}
    return {"kind": "none", "modelled": False,
            "message": f"no energy sensor found (no readable Intel RAPL counters under {rapl_root}, "
                       f"no Jetson INA3221 under {', '.join(ina_roots)}); pass --power-model IDLE_W,PER_CORE_W "
                       "for modelled energy. Times are measured"}


def meter(source: dict):
    """A context manager yielding a joules-so-far function for a real sensor."""
    if source["kind"].startswith("Intel RAPL"):
        return rapl_meter([Path(p) for p in source["paths"]])
    files = [Path(p) for p in source["paths"]]
    return sampled_meter(lambda: sum(float(f.read_text()) for f in files) / 1000)


# ---- knobs ----

def writable_cpufreq(root: str = CPU_ROOT) -> list[Path]:
    """``cpuN/cpufreq`` directories whose frequency ceiling we may write."""
    dirs = sorted(Path(root).glob("cpu[0-9]*/cpufreq"))
    return [d for d in dirs if (d / "scaling_max_freq").exists() and os.access(d / "scaling_max_freq", os.W_OK)]


def frequency_levels(cpufreq: list[Path], count: int = 3) -> list[int]:
    """Up to ``count`` frequency ceilings (kHz) from the available list, or min..max."""
    d = cpufreq[0]
    avail = d / "scaling_available_frequencies"
    if avail.exists():
        freqs = sorted(int(f) for f in avail.read_text().split())
    else:
        lo, hi = int((d / "cpuinfo_min_freq").read_text()), int((d / "cpuinfo_max_freq").read_text())
        freqs = [lo + (hi - lo) * i // (count - 1) for i in range(count)]
    if len(freqs) <= count:
        return freqs
    return [freqs[round(i * (len(freqs) - 1) / (count - 1))] for i in range(count)]


@contextmanager
def frequency_ceiling(cpufreq: list[Path], khz: int) -> Iterator[None]:
    old = [(d / "scaling_max_freq").read_text().strip() for d in cpufreq]
    try:
        for d in cpufreq:
            (d / "scaling_max_freq").write_text(str(khz))
        yield
    finally:
        for d, v in zip(cpufreq, old):
            (d / "scaling_max_freq").write_text(v)


def nvpmodel_modes() -> tuple[int | None, list[int]]:
    """(current mode, modes to try) from ``nvpmodel``; (None, []) where absent."""
    exe = shutil.which("nvpmodel")
    if not exe:
        return None, []
    q = subprocess.run([exe, "-q"], capture_output=True, text=True, timeout=30)
    current = next((int(line.split()[-1]) for line in q.stdout.splitlines() if line.strip().split()
                    and line.strip().split()[-1].isdigit()), None)
    conf = Path("/etc/nvpmodel.conf")
    modes = []
    if conf.exists():
        for line in conf.read_text().splitlines():
            if line.startswith("< POWER_MODEL") and "ID=" in line:
                modes.append(int(line.split("ID=")[1].split()[0]))
    return current, modes


@contextmanager
def nvpmodel_mode(mode: int, restore: int | None) -> Iterator[None]:
    subprocess.run(["nvpmodel", "-m", str(mode)], check=True, capture_output=True, timeout=60)
    try:
        yield
    finally:
        if restore is not None:
            subprocess.run(["nvpmodel", "-m", str(restore)], capture_output=True, timeout=60)


# ---- the sweep ----

def pareto_front(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Rows no other row beats on both time and energy per epoch, fastest first."""
    pts = [r for r in rows if r.get("energy_j_per_epoch") is not None]
    front = [r for r in pts if not any(
        o["epoch_s"] <= r["epoch_s"] and o["energy_j_per_epoch"] <= r["energy_j_per_epoch"]
        and (o["epoch_s"] < r["epoch_s"] or o["energy_j_per_epoch"] < r["energy_j_per_epoch"])
        for o in pts)]
    return sorted(front, key=lambda r: r["epoch_s"])


def _measure(net, batch_size: int, steps: int, warmup: int, dataset: str, threads: int,
             source: dict) -> dict[str, Any]:
    """Timed steps and the joules they used (None without a sensor or a model)."""
    workload.time_steps(net, batch_size, 0, warmup, dataset, threads)
    if source["kind"] == "none" or source["modelled"]:
        t0 = time.perf_counter()
        timing = workload.time_steps(net, batch_size, steps, 0, dataset, threads)
        metered_s = time.perf_counter() - t0
        joules = metered_s * model_power_w(source["idle_w"], source["per_core_w"], threads) if source["modelled"] \
            else None
        return {"timing": timing, "joules": joules, "metered_s": metered_s}
    with meter(source) as read_joules:
        t0 = time.perf_counter()
        timing = workload.time_steps(net, batch_size, steps, 0, dataset, threads)
        joules = read_joules()
        metered_s = time.perf_counter() - t0
    return {"timing": timing, "joules": joules, "metered_s": metered_s}


def run(model: str = "resnet18", dataset: str = "cifar10", *, threads: list[int] | None = None,
        batch_size: int = 32, steps: int = 5, warmup: int = 1, epoch_samples: int = 50000,
        power_model: str | None = None, rapl_root: str = RAPL_ROOT, ina_roots: tuple[str, ...] = INA_ROOTS,
        cpu_root: str = CPU_ROOT, output: str = "runs", name: str | None = None) -> PowerResult:
    threads = threads or list(range(1, (os.cpu_count() or 1) + 1))
    source = energy_source(rapl_root, ina_roots, parse_power_model(power_model))
    notes = []
    if source["kind"] == "none":
        notes.append(source["message"])
    elif source["modelled"]:
        notes.append(f"energy is MODELLED: {source['idle_w']} W idle + {source['per_core_w']} W per active core "
                     "(no sensor found)")
    cpufreq = writable_cpufreq(cpu_root)
    freqs = frequency_levels(cpufreq) if cpufreq else []
    if not cpufreq:
        notes.append(f"cpufreq not writable here (no writable {cpu_root}/cpu*/cpufreq/scaling_max_freq): "
                     "frequency not swept")
    current_mode, modes = nvpmodel_modes()
    if not modes:
        notes.append("nvpmodel not present: power modes not swept")
    notes.append(f"epoch = {epoch_samples} samples; time per epoch = epoch samples / measured samples/s "
                 f"of {steps} timed steps")
    net = workload.build_model(model, dataset)
    rows = []
    with closing(_settings(modes, current_mode, cpufreq, freqs, threads)) as settings:
        for mode, khz, t in settings:
            m = _measure(net, batch_size, steps, warmup, dataset, t, source)
            rows.append(_row(m, (mode, khz, t), batch_size * steps, epoch_samples, source))
    front = pareto_front(rows)
    params = dict(model=model, dataset=dataset, threads=threads, batch_size=batch_size, steps=steps,
                  warmup=warmup, epoch_samples=epoch_samples, frequencies_khz=freqs, nvpmodel_modes=modes)
    run_dir = start_run(output, name, "power")
    result = save_result(run_dir, PowerResult(params=params, energy_source=source, rows=rows, pareto=front,
                                              notes=notes))
    from edgetrain.report import plots

    plots.plot_power(result.to_dict(), run_dir / "power.png")
    if source["kind"] == "none":
        say(f"bench power: {source['message']}")
    _print(result, f"bench power: {model}, batch {batch_size}, energy: {source['kind']} -> {run_dir}")
    return result


def _settings(modes: list, current_mode, cpufreq, freqs: list[int], threads: list[int]
              ) -> Iterator[tuple[Any, int | None, int]]:
    """Every setting swept, (nvpmodel mode, frequency ceiling kHz, threads), each applied while it is measured
    and the device's own restored after it."""
    import torch

    for mode in modes or [None]:
        with (nvpmodel_mode(mode, current_mode) if mode is not None else _nothing()):
            for khz in freqs or [None]:
                with (frequency_ceiling(cpufreq, khz) if khz is not None else _nothing()):
                    for t in threads:
                        torch.set_num_threads(t)
                        yield mode, khz, t


def _row(m: dict, setting: tuple[Any, int | None, int], metered_samples: int, epoch_samples: int,
         source: dict) -> dict:
    """One setting's row from ``_measure``'s timing and joules (over ``metered_samples``), scaled to an epoch."""
    mode, khz, t = setting
    # Energy is metered over the whole timed loop, so time per epoch must be too: the mean.
    sps = m["timing"]["samples_per_s_mean"]
    label = f"{t} thr" + (f", {khz // 1000} MHz" if khz else "") + (f", nvp {mode}" if mode is not None else "")
    row = {"setting": label, "threads": t, "max_freq_khz": khz, "nvpmodel": mode,
           "samples_per_s": sps, "epoch_s": epoch_samples / sps,
           "energy_j_per_epoch": None, "avg_power_w": None}
    if m["joules"] is not None:
        row["energy_j_per_epoch"] = m["joules"] / metered_samples * epoch_samples
        row["avg_power_w"] = m["joules"] / m["metered_s"]
        row["energy_modelled"] = source["modelled"]
    return row


def _print(result: PowerResult, title: str) -> None:
    tag = " (modelled)" if result.energy_source["modelled"] else ""
    on_front = {r["setting"] for r in result.pareto}
    print_table(title, ["setting", "samples/s", "s/epoch", f"J/epoch{tag}", f"avg W{tag}", "Pareto"],
                [(r["setting"], r["samples_per_s"], r["epoch_s"], r["energy_j_per_epoch"], r["avg_power_w"],
                  r["setting"] in on_front if r["energy_j_per_epoch"] is not None else None) for r in result.rows],
                result.notes)


@contextmanager
def _nothing() -> Iterator[None]:
    yield


def add_parser(sub) -> None:
    p = sub.add_parser("power", help="time and energy per epoch over threads, frequencies, power modes")
    p.add_argument("--model", default="resnet18")
    p.add_argument("--dataset", default="cifar10", choices=sorted(DATASET_SHAPES))
    p.add_argument("--threads", type=_ints, default=None, metavar="T,T,...", help="default: 1..all cores")
    p.add_argument("--batch-size", type=positive_int, default=32)
    p.add_argument("--steps", type=positive_int, default=5)
    p.add_argument("--warmup", type=non_negative_int, default=1)
    p.add_argument("--epoch-samples", type=positive_int, default=50000, help="samples in one epoch (CIFAR-10: 50000)")
    p.add_argument("--power-model", default=None, metavar="IDLE_W,PER_CORE_W",
                   help="model energy when no sensor exists (labelled modelled)")
    p.add_argument("--rapl-root", default=RAPL_ROOT, help=argparse.SUPPRESS)
    p.add_argument("--ina-root", action="append", default=None, help=argparse.SUPPRESS)
    p.add_argument("--cpu-root", default=CPU_ROOT, help=argparse.SUPPRESS)
    p.set_defaults(bench_func=lambda a: run(
        a.model, a.dataset, threads=a.threads, batch_size=a.batch_size, steps=a.steps, warmup=a.warmup,
        epoch_samples=a.epoch_samples, power_model=a.power_model, rapl_root=a.rapl_root,
        ina_roots=tuple(a.ina_root) if a.ina_root else INA_ROOTS, cpu_root=a.cpu_root,
        output=a.output, name=a.name))
