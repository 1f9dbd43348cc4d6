"""Power sensors a device may have, read where they are: Intel RAPL package counters (``/sys/class/powercap``,
wrap-around handled), Jetson INA3221 rails (iio or hwmon), or a file a power meter's logger keeps current.
Each meter is a context manager yielding a function that returns joules so far. Used by the trainer's energy
record (train/energy.py) and ``edgetrain bench power``."""
from __future__ import annotations

import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator

from edgetrain.errors import EdgetrainError

RAPL_ROOT = "/sys/class/powercap"
INA_ROOTS = ("/sys/bus/i2c/drivers/ina3221x", "/sys/bus/i2c/drivers/ina3221")


def rapl_domains(root: str = RAPL_ROOT) -> list[Path]:
    """Readable top-level RAPL package domains (``intel-rapl:N``, not the sub-domains)."""
    base = Path(root)
    if not base.is_dir():
        return []
    found = []
    for d in sorted(base.glob("intel-rapl:*")):
        if d.name.count(":") != 1:
            continue
        try:
            int((d / "energy_uj").read_text())
            found.append(d)
        except (OSError, ValueError):
            continue
    return found


def rapl_delta_uj(before: int, after: int, max_range_uj: int) -> int:
    """Energy between two readings of a counter that wraps at ``max_range_uj``."""
    return after - before if after >= before else after + max_range_uj - before


@contextmanager
def rapl_meter(domains: list[Path]) -> Iterator[Callable[[], float]]:
    def read() -> list[int]:
        return [int((d / "energy_uj").read_text()) for d in domains]

    ranges = [int((d / "max_energy_range_uj").read_text()) for d in domains]
    start = read()
    yield lambda: sum(rapl_delta_uj(s, e, r) for s, e, r in zip(start, read(), ranges)) / 1e6


def ina_power_files(roots: tuple[str, ...] = INA_ROOTS) -> list[Path]:
    """Jetson INA3221 power inputs in milliwatts (``in_power*_input``, L4T 32)."""
    files: list[Path] = []
    for root in roots:
        if Path(root).is_dir():
            files += sorted(Path(root).glob("*/iio:device*/in_power*_input"))
    readable = []
    for f in files:
        try:
            float(f.read_text())
            readable.append(f)
        except (OSError, ValueError):
            continue
    return readable


HWMON_ROOT = "/sys/class/hwmon"


def ina_hwmon_rails(root: str = HWMON_ROOT) -> list[tuple[Path, Path]]:
    """Jetson INA3221 rails as hwmon exposes them (JetPack 5/6: a ``hwmon*`` whose ``name`` is ``ina3221``):
    (``inN_input`` millivolts, ``currN_input`` milliamps) pairs that can be read."""
    rails = []
    for d in sorted(Path(root).glob("hwmon*")) if Path(root).is_dir() else []:
        try:
            if (d / "name").read_text().strip() != "ina3221":
                continue
        except OSError:
            continue
        for volts in sorted(d.glob("in[0-9]*_input")):
            amps = d / volts.name.replace("in", "curr", 1)
            try:
                float(volts.read_text()), float(amps.read_text())
                rails.append((volts, amps))
            except (OSError, ValueError):
                continue
    return rails


def hwmon_watts(rails: list[tuple[Path, Path]]) -> float:
    return sum(float(v.read_text()) * float(a.read_text()) for v, a in rails) / 1e6


def read_watts_file(path: str | Path) -> float:
    """Watts from a file a power meter's logger keeps current (its last number: a line may carry a time too)."""
    try:
        return float(Path(path).read_text().split()[-1])
    except (OSError, ValueError, IndexError) as e:
        raise EdgetrainError(f"cannot read watts from --power-file {path} ({e}); the file must hold a number "
                             f"of watts, e.g. 4.2") from None


@contextmanager
def sampled_meter(read_watts: Callable[[], float], period_s: float = 0.05) -> Iterator[Callable[[], float]]:
    """Integrate a power reading (trapezoid rule) in a background thread."""
    state = {"joules": 0.0, "t": time.perf_counter(), "w": read_watts()}
    lock = threading.Lock()
    stop = threading.Event()

    def tick() -> None:
        t, w = time.perf_counter(), read_watts()
        with lock:
            state["joules"] += (t - state["t"]) * (w + state["w"]) / 2
            state["t"], state["w"] = t, w

    def loop() -> None:
        while not stop.wait(period_s):
            tick()

    thread = threading.Thread(target=loop, daemon=True, name="power-sampler")
    thread.start()

    def joules() -> float:
        tick()
        with lock:
            return state["joules"]
    try:
        yield joules
    finally:
        stop.set()
        thread.join(timeout=2)
