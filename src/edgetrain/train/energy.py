"""Joules per sample of a device's training steps: measured where a sensor can be read, else modelled.

Sources, first found first (design and limits: docs/how-to/energy.md):

1. ``--power-file PATH``: a file holding the device's watts (a USB meter's logger), sampled and integrated;
2. Intel RAPL package counters (``cluster.sensors.rapl_domains``, wrap-around handled);
3. a Jetson's INA3221 rails (iio ``in_power*_input`` or hwmon ``inN_input`` x ``currN_input``), sampled;
4. the device profile's power model (``DeviceProfile.power_w``: idle + per busy core), labelled modelled.

A sensor meters its whole host. Where several devices of a run share the host (emulated devices, or a
host given more than one), each device is given the host's joules times its share of the host's busy CPU
time over the window (``/proc/stat``), and the label says so. The window is the training loop: from the
first step to the last, evaluations included.
"""
from __future__ import annotations

import os
import time
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from edgetrain.cluster.profiles import DeviceProfile
from edgetrain.cluster.sensors import (HWMON_ROOT, INA_ROOTS, RAPL_ROOT, hwmon_watts, ina_hwmon_rails, ina_power_files,
                                       rapl_domains, rapl_meter, read_watts_file, sampled_meter)
from edgetrain.records import EnergyRecord

PROC_STAT = "/proc/stat"


def host_busy_cpu_s(proc_stat: str = PROC_STAT) -> float | None:
    """Busy CPU seconds of the whole host since boot (every core: all but idle and iowait), or None."""
    try:
        fields = [int(v) for v in Path(proc_stat).read_text().splitlines()[0].split()[1:]]
    except (OSError, ValueError, IndexError):
        return None
    busy = sum(fields[:8]) - fields[3] - (fields[4] if len(fields) > 4 else 0)  # user..steal less idle, iowait
    return busy / os.sysconf("SC_CLK_TCK")


@dataclass(frozen=True)
class Sensors:
    """Where the host's power is read, first found first: ``--power-file``, RAPL, INA3221 (iio), INA3221
    (hwmon); a file or rail is sampled every ``sample_every_s``. Tests point the roots at fake sensors."""
    power_file: str | None = None
    rapl_root: str = RAPL_ROOT
    ina_roots: tuple[str, ...] = INA_ROOTS
    hwmon_root: str = HWMON_ROOT
    sample_every_s: float = 0.05


@dataclass(frozen=True)
class Clocks:
    """The meter's clocks: the wall's, this process's CPU time and the host's busy CPU time (fakes in tests
    give exact arithmetic)."""
    wall: Callable[[], float] = time.perf_counter
    cpu: Callable[[], float] = time.process_time
    host_cpu: Callable[[], float | None] = host_busy_cpu_s


class EnergyMeter:
    """Started before the first step, stopped after the last: ``stop`` gives the ``EnergyRecord``, or None
    where there is neither a sensor nor a power model."""

    def __init__(self, profile: DeviceProfile, busy_cores: int, shared: bool, *, sensors: Sensors = Sensors(),
                 clocks: Clocks = Clocks()):
        self.clock, self.cpu_clock, self.host_cpu = clocks.wall, clocks.cpu, clocks.host_cpu
        self.shared = shared
        self._stack = ExitStack()
        self._joules: Callable[[], float] | None = None
        self.measured, self.source, self.watts = True, "", None
        domains = rapl_domains(sensors.rapl_root)
        ina = ina_power_files(sensors.ina_roots)
        rails = ina_hwmon_rails(sensors.hwmon_root)
        power_file, sample_every_s = sensors.power_file, sensors.sample_every_s
        if power_file:
            read_watts_file(power_file)  # a bad file is one line before training, not a thread's traceback
            self._sensor, self.source = (lambda: sampled_meter(lambda: read_watts_file(power_file), sample_every_s),
                                         f"power file {power_file}")
        elif domains:
            self._sensor, self.source = lambda: rapl_meter(domains), "RAPL"
        elif ina:
            self._sensor, self.source = (lambda: sampled_meter(lambda: sum(float(f.read_text()) for f in ina) / 1000,
                                                               sample_every_s), "INA3221")
        elif rails:
            self._sensor, self.source = lambda: sampled_meter(lambda: hwmon_watts(rails), sample_every_s), "INA3221"
        else:
            self._sensor = None
            self.measured = False
            self.watts = profile.power_w(busy_cores)
            if self.watts is not None:
                self.source = (f"modelled ({profile.name}: {profile.idle_w:g} W + {profile.core_w:g} W x "
                               f"{busy_cores} cores = {self.watts:g} W)")

    def start(self) -> None:
        self.t0, self.cpu0, self.host0 = self.clock(), self.cpu_clock(), self.host_cpu()
        if self._sensor is not None:
            self._joules = self._stack.enter_context(self._sensor())

    def stop(self, samples: int) -> EnergyRecord | None:
        seconds = self.clock() - self.t0
        try:
            if self._sensor is None:
                if self.watts is None:
                    return None
                return EnergyRecord.of(self.source, False, self.watts * seconds, seconds, samples)
            joules = self._joules()
        finally:
            self._stack.close()
        if not self.shared:
            return EnergyRecord.of(f"measured ({self.source})", True, joules, seconds, samples)
        host_now = self.host_cpu()
        host_s = None if host_now is None or self.host0 is None else host_now - self.host0
        if not host_s or host_s <= 0:  # no /proc/stat: the host's joules, said so
            return EnergyRecord.of(f"measured ({self.source}, whole host, shared by its devices)", True, joules,
                                   seconds, samples)
        share = min(1.0, (self.cpu_clock() - self.cpu0) / host_s)
        return EnergyRecord.of(f"measured ({self.source}, host x {share:.0%} CPU-time share)", True,
                               joules * share, seconds, samples, host_share=share)

    def close(self) -> None:
        """Stops a sampler still running (a run that failed before ``stop``)."""
        self._stack.close()
