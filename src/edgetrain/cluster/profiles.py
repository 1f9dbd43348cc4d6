"""Device profiles and cluster files.

Design: docs/design/links.md ("Device profiles").
"""
from __future__ import annotations

import dataclasses
import functools
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from edgetrain.errors import EdgetrainError
from edgetrain.spec import PRESETS as LINK_PRESETS, Link, get_link, parse_local_batch
from edgetrain.yamlfile import read_yaml_mapping

# Imported inside functions: torch (the commands that read profiles answer --help and bad input without it).


@dataclass(frozen=True)
class DeviceProfile:
    name: str
    cores: int | None = None          # cores of the real device; None = the host's
    gflops: float | None = None       # sustained dense fp32 GFLOPS of the whole device; None = host speed
    speed: float | None = None        # compute speed relative to one host core; overrides gflops
    memory_mb: int | None = None      # memory the device has; None = no limit
    memory_gbps: float | None = None  # rated memory bandwidth (bus width x transfer rate), GB/s; None = unknown
    link: str | None = None           # link preset or spec (see edgetrain.spec)
    description: str = ""
    idle_w: float | None = None       # power model: watts at idle ...
    core_w: float | None = None       # ... plus these per busy core (None: no model; see power_w)
    storage: str | None = None        # where its data lives: a STORAGES name; None = this host's disk, unthrottled

    def power_w(self, cores: int) -> float | None:
        """Modelled power with ``cores`` busy, or None where the profile has no power model."""
        if self.idle_w is None or self.core_w is None:
            return None
        return model_power_w(self.idle_w, self.core_w, cores)


def model_power_w(idle_w: float, core_w: float, cores: int) -> float:
    """The one power model of edgetrain: idle watts plus watts per busy core (``bench power --power-model``,
    a profile's ``idle_w``/``core_w``). Its figures are always labelled modelled."""
    return idle_w + core_w * cores


@dataclass(frozen=True)
class Storage:
    name: str
    read_mb_s: float    # sequential read, MB/s
    read_iops: int      # random 4 KiB reads per second
    source: str


# Read rates from data sheets and bus specifications (approximate: a real part varies with its make and fill).
STORAGES: dict[str, Storage] = {s.name: s for s in (
    # SD Association: the UHS-I DDR50 bus of the Raspberry Pi 4's and Pi Zero's card slots carries at most
    # 50 MB/s; Application Performance Class A1 guarantees 1500 random-read IOPS (A2: 4000).
    Storage("sd-card", 50.0, 1500, "SD Association: UHS-I DDR50 bus 50 MB/s, A1 class 1500 read IOPS"),
    # JEDEC eMMC 5.1 (HS400 bus, 400 MB/s); a 16 GB part as on the Jetson Nano module: ~250 MB/s sequential read,
    # ~7000 random-read IOPS (Samsung KLMAG1JETD-B041 class data sheets).
    Storage("emmc", 250.0, 7000, "eMMC 5.1 16 GB part (Samsung KLMAG1JETD class): 250 MB/s, 7000 read IOPS"),
    # Samsung 980 (PCIe 3.0 x4, M.2 2280, fits the Jetson Orin Nano dev kit): 3500 MB/s sequential read, up to
    # 500K random-read IOPS (QD32), Samsung's data sheet.
    Storage("nvme", 3500.0, 500_000, "Samsung 980 NVMe data sheet: 3500 MB/s, 500K read IOPS"),
    # WD Red Plus 4 TB (WD40EFZX): 175 MB/s sustained transfer (WD data sheet); random IOPS of a 5400 rpm class
    # disk are seek-bound, ~100 (not on the data sheet: average seek + half a rotation ~ 10 ms).
    Storage("hdd", 175.0, 100, "WD Red Plus 4 TB data sheet: 175 MB/s; ~100 IOPS (seek-bound, modelled)"),
)}


# Compute rates: rpi4 from LINPACK on one Raspberry Pi 4 (15.5 GFLOPS, the Pi study cited in
# docs/reference/profiles.md); jetson-nano is its quad Cortex-A57 CPU (4 cores x 1.43 GHz x 8 fp32 FLOP/cycle
# = 45.8 GFLOPS peak, at the same ~30% LINPACK efficiency as the Pi's A72): about 13.7 GFLOPS.
# Power (modelled from published figures, not measured here): rpi4 from the Raspberry Pi documentation's
# "Typical power requirements" table (https://www.raspberrypi.com/documentation/computers/raspberry-pi.html,
# source documentation/asciidoc/computers/raspberry-pi/power-supplies.adoc), which measured a Pi 4 B on the
# June 2019 Raspberry Pi OS with an HDMI monitor, USB keyboard and mouse and Ethernet attached: idle 0.6 A, the
# stress test (taken as its 4 cores busy) 1.2 A, at the 5.1 V its supply gives: 3.06 W idle and 6.12 W loaded,
# so 0.765 W per busy core. The same table gives the Zero 2 W only one "typical active" current (350 mA), and
# NVIDIA gives the Jetson Nano and Orin Nano power-mode budgets (caps, not idle or loaded draws): no model.
BUILTIN_PROFILES: dict[str, DeviceProfile] = {
    "host": DeviceProfile("host", description="this machine, unthrottled"),
    "rpi4": DeviceProfile("rpi4", cores=4, gflops=15.5, memory_mb=4096, memory_gbps=12.8, link="lan-1g",
                          description="Raspberry Pi 4 Model B, 4x Cortex-A72 1.5 GHz, 4 GB", storage="sd-card",
                          idle_w=3.06, core_w=0.765),
    "jetson-nano": DeviceProfile("jetson-nano", cores=4, gflops=13.7, memory_mb=4096, memory_gbps=25.6, link="lan-1g",
                                 description="Jetson Nano CPU, 4x Cortex-A57 1.43 GHz, 4 GB (GPU not emulated)",
                                 storage="emmc"),
}
# The small devices of memory pooling (issue 13). Cores, clocks and memory from the vendors' pages
# (docs/reference/profiles.md); GFLOPS modelled as the jetson-nano's: cores x GHz x fp32 FLOP/cycle (128-bit FMA:
# 8 on Cortex-A53, two pipes: 16 on A76 and A78AE) x 15.5 / 48, the rpi4's LINPACK over its peak.
# Memory GB/s: rated, bus width x transfer rate of the SDRAM the vendors name (docs/reference/profiles.md).
BUILTIN_PROFILES.update({name: DeviceProfile(name, cores, gflops, memory_mb=memory_mb, memory_gbps=gbps, link=link,
                                             description=text, storage=storage)
                         for name, cores, gflops, memory_mb, gbps, link, text, storage in (
    ("smart-speaker-2g", 4, 15.5, 2048, 12.8, "wifi-20m", "generic 2 GB smart speaker, 4x Cortex-A53 1.5 GHz", "emmc"),
    ("rpi-zero-2w", 4, 10.3, 512, 3.6, "wifi-20m", "Raspberry Pi Zero 2 W, 4x Cortex-A53 1 GHz, 512 MB", "sd-card"),
    ("rpi5", 4, 49.6, 4096, 17.1, "lan-1g", "Raspberry Pi 5 (4 GB), 4x Cortex-A76 2.4 GHz", "sd-card"),
    ("jetson-orin-nano", 6, 46.5, 8192, 68.0, "lan-1g",
     "Jetson Orin Nano 8 GB CPU, 6x Cortex-A78AE 1.5 GHz (GPU not emulated)", "nvme"),
    # The tiled-training paper's device (Rama, Threadgill, Gerstlauer). Raspberry Pi 3 Model B product page:
    # BCM2837, 4x Cortex-A53 at 1.2 GHz, 1 GB LPDDR2, 10/100 Ethernet (on the USB 2.0 hub chip): 100 Mbit/s,
    # its latency assumed as lan-1g's 0.2 ms. GFLOPS modelled as above: 4 x 1.2 x 8 x 15.5/48 = 12.4.
    ("rpi3", 4, 12.4, 1024, 3.6, "100mbit:0.2ms", "Raspberry Pi 3 Model B, 4x Cortex-A53 1.2 GHz, 1 GB", "sd-card"),
)})

_PROFILE_KEYS = {f.name for f in dataclasses.fields(DeviceProfile)} - {"name"}


@dataclass(frozen=True)
class DeviceSpec:
    """One device of a run: its rank, profile and share of the global batch."""

    rank: int
    profile: DeviceProfile
    batch: int | None = None          # local batch, if the cluster file fixes it
    link: str | None = None
    data: str | None = None           # this device's own training data (image folder or .npz), if it has one

    @property
    def label(self) -> str:
        return f"device {self.rank} ({self.profile.name})"


@functools.lru_cache(maxsize=1)
def host_core_gflops(seconds: float = 0.3, n: int = 384) -> float:
    """GFLOPS of one host core on a float32 GEMM, measured now by CPU time (single thread)."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        a, b = torch.randn(n, n), torch.randn(n, n)
        torch.mm(a, b)
        # CPU time, not wall time: the throttle counts CPU time too, and on a busy host the
        # wall clock would charge other processes' time to this core and make devices too fast.
        reps, start = 0, time.thread_time()
        while time.thread_time() - start < seconds:
            torch.mm(a, b)
            reps += 1
        elapsed = time.thread_time() - start
    finally:
        torch.set_num_threads(threads)
    return 2 * n**3 * reps / elapsed / 1e9


def device_gflops(profile: DeviceProfile, sharing: int = 1) -> tuple[float, str]:
    """(GFLOPS, where the number comes from) of a profile. ``sharing``: how many devices of an unthrottled
    profile without ``cores`` (``host``: this machine) the plan puts on this machine; they split its cores
    as the training loop pins them (``throttle.assign_cores``: ``cores // n`` each, a time share of
    one core when there are more devices than cores)."""
    if profile.speed is not None:
        return profile.speed * host_core_gflops(), "speed x measured host core"
    if profile.gflops is not None:
        return float(profile.gflops), "profile"
    if profile.cores:
        return host_core_gflops() * profile.cores, "measured host cores"
    cores = os.cpu_count() or 1
    share = cores // sharing if sharing <= cores else cores / sharing
    return host_core_gflops() * share, f"measured host core x {share:g} ({sharing} device(s) on {cores} cores)"


def device_links(devices: list[DeviceSpec]) -> list[Link | None]:
    """Every device's link; as ``comm.gather_links``, a device without one among devices with one is on lan-1g."""
    cache: dict = {}
    links = []
    for d in devices:
        key = d.link if not isinstance(d.link, dict) else repr(sorted(d.link.items()))
        if key not in cache:
            cache[key] = get_link(d.link)
        links.append(cache[key])
    if any(link is not None for link in links):
        links = [LINK_PRESETS["lan-1g"] if link is None else link for link in links]
    return links


def device_speed(profile: DeviceProfile) -> float | None:
    """Speed relative to one host core, or None for an unthrottled device."""
    if profile.speed is not None:
        return profile.speed
    if profile.gflops is not None:
        return profile.gflops / host_core_gflops()
    return None


def _make_profile(name: str, spec: dict, known: dict[str, DeviceProfile], source: str) -> DeviceProfile:
    if not isinstance(spec, dict):
        raise EdgetrainError(f"profile '{name}' in {source} must be a mapping, not {spec!r}")
    spec = dict(spec)
    base_name = spec.pop("base", None)
    unknown = set(spec) - _PROFILE_KEYS
    if unknown:
        raise EdgetrainError(f"profile '{name}' in {source} has unknown key '{sorted(unknown)[0]}'; "
                             f"valid keys: base, {', '.join(sorted(_PROFILE_KEYS))}")
    base = DeviceProfile(name)
    if base_name is not None:
        if base_name not in known:
            raise EdgetrainError(f"profile '{name}' in {source} is based on unknown profile '{base_name}'; "
                                 f"known: {', '.join(known)}")
        base = dataclasses.replace(known[base_name], name=name)
    for key in ("cores", "memory_mb"):
        if key in spec and (not isinstance(spec[key], int) or spec[key] < 1):
            raise EdgetrainError(f"profile '{name}' in {source}: {key} must be a positive integer, not {spec[key]!r}")
    if "storage" in spec and spec["storage"] is not None and spec["storage"] not in STORAGES:
        raise EdgetrainError(f"profile '{name}' in {source}: storage {spec['storage']!r} is unknown; use one of "
                             f"{', '.join(STORAGES)}")
    for key in ("idle_w", "core_w"):
        if key in spec and (not isinstance(spec[key], (int, float)) or isinstance(spec[key], bool) or spec[key] < 0):
            raise EdgetrainError(f"profile '{name}' in {source}: {key} must be a number of watts >= 0, "
                                 f"not {spec[key]!r}")
    if ("idle_w" in spec) != ("core_w" in spec) and base.idle_w is None:
        raise EdgetrainError(f"profile '{name}' in {source}: the power model needs both idle_w and core_w "
                             f"(watts at idle, watts per busy core)")
    for key in ("gflops", "speed", "memory_gbps"):
        if key in spec and (not isinstance(spec[key], (int, float)) or spec[key] <= 0):
            raise EdgetrainError(f"profile '{name}' in {source}: {key} must be a positive number, not {spec[key]!r}")
    if "gflops" in spec and "speed" not in spec:
        spec["speed"] = None
    return dataclasses.replace(base, **spec)


def get_profile(name: str, extra: dict[str, DeviceProfile] | None = None) -> DeviceProfile:
    known = {**BUILTIN_PROFILES, **(extra or {})}
    if name not in known:
        raise EdgetrainError(f"unknown device profile '{name}'; known profiles: {', '.join(known)} "
                             f"(define your own under 'profiles:' in a cluster file)")
    return known[name]


def load_cluster(path: str | os.PathLike) -> list[DeviceSpec]:
    """Devices listed in a cluster file, ranks in file order."""
    source = str(path)
    data = read_yaml_mapping(Path(path), "cluster file")
    unknown = set(data) - {"profiles", "devices"}
    if unknown:
        raise EdgetrainError(f"cluster file {source} has unknown key '{sorted(unknown)[0]}'; valid keys: profiles, devices")
    profiles: dict[str, DeviceProfile] = {}
    for name, spec in (data.get("profiles") or {}).items():
        profiles[name] = _make_profile(str(name), spec, {**BUILTIN_PROFILES, **profiles}, source)
    entries = data.get("devices")
    if not entries or not isinstance(entries, list):
        raise EdgetrainError(f"cluster file {source} needs a non-empty list under 'devices:'")
    devices: list[DeviceSpec] = []
    for i, entry in enumerate(entries):
        if isinstance(entry, str):
            entry = {"profile": entry}
        if not isinstance(entry, dict) or "profile" not in entry:
            raise EdgetrainError(f"cluster file {source}: device entry {i + 1} needs a 'profile' key, got {entry!r}")
        bad = set(entry) - {"profile", "batch", "link", "count", "data"}
        if bad:
            raise EdgetrainError(f"cluster file {source}: device entry {i + 1} has unknown key '{sorted(bad)[0]}'; "
                                 f"valid keys: profile, batch, link, count, data")
        count = entry.get("count", 1)
        batch = entry.get("batch")
        if not isinstance(count, int) or count < 1:
            raise EdgetrainError(f"cluster file {source}: device entry {i + 1} count must be a positive integer")
        if batch is not None and (not isinstance(batch, int) or batch < 1):
            raise EdgetrainError(f"cluster file {source}: device entry {i + 1} batch must be a positive integer")
        data_path = entry.get("data")
        if data_path is not None and (not isinstance(data_path, str) or not data_path):
            raise EdgetrainError(f"cluster file {source}: device entry {i + 1} data must be the path of an image "
                                 f"folder or a .npz file, not {data_path!r}")
        if data_path is not None:
            data_path = str(Path(path).parent / Path(data_path).expanduser())  # an absolute path stays as it is
        profile = get_profile(str(entry["profile"]), profiles)
        for _ in range(count):
            devices.append(DeviceSpec(len(devices), profile, batch, entry.get("link") or profile.link, data_path))
    return devices


def plan_devices(cfg: Any, world_size: int | None = None) -> list[DeviceSpec]:
    """The devices of a run from ``cfg.cluster`` or ``cfg.devices`` x ``cfg.profile``."""
    if cfg.cluster:
        devices = load_cluster(cfg.cluster)
        if world_size is not None and world_size != len(devices):
            raise EdgetrainError(f"cluster file {cfg.cluster} lists {len(devices)} devices but "
                                 f"WORLD_SIZE is {world_size}; launch one process per listed device")
        if cfg.link:
            devices = [dataclasses.replace(d, link=cfg.link) for d in devices]
    else:
        profile = get_profile(cfg.profile)
        n = world_size if world_size is not None else cfg.devices
        link = cfg.link or profile.link
        devices = [DeviceSpec(r, profile, None, link) for r in range(n)]
    # A bad link in the cluster file fails here, before any device starts; each distinct link is
    # checked once, as a million devices share a handful of links.
    for link in {repr(d.link): d.link for d in devices}.values():
        get_link(link)
    return devices


def split_batch(cfg: Any, devices: list[DeviceSpec], rule: str | tuple[int, ...] | None = None) -> list[int]:
    """Local batch of every device; they sum to the global batch and every one is at least 1. ``rule``: the
    run's ``RunSpec.local_batch`` (left out: ``cfg.local_batch`` parsed here).

    O(devices log devices): the planner splits batches over up to a million devices.
    """
    n, total = len(devices), cfg.batch_size
    rule = parse_local_batch(cfg.local_batch) if rule is None else rule
    if isinstance(rule, tuple):
        sizes = list(rule)
        if len(sizes) != n:
            raise EdgetrainError(f"config key 'local_batch' lists {len(sizes)} batches for {n} devices")
        return sizes
    fixed = [d.batch for d in devices]
    if any(b is not None for b in fixed) and not all(b is not None for b in fixed):
        raise EdgetrainError("the cluster file gives 'batch' for some devices but not all: give it for every device or none")
    if all(b is not None for b in fixed):
        if sum(fixed) != total:
            raise EdgetrainError(f"the cluster file's device batches sum to {sum(fixed)}, but batch_size is {total}; "
                                 f"set batch_size to {sum(fixed)}")
        return fixed  # type: ignore[return-value]
    if total < n:
        raise EdgetrainError(f"batch_size {total} is smaller than the {n} devices: every device needs at least one sample")
    if rule == "balanced":
        speeds: dict[DeviceProfile, float] = {}  # one per profile, not per device
        for d in devices:
            if d.profile not in speeds:
                speeds[d.profile] = device_speed(d.profile) or float(d.profile.cores or os.cpu_count() or 1)
        weights = [speeds[d.profile] for d in devices]
    else:
        weights = [1.0] * n
    return split_by_weights(total, weights)


def split_by_weights(total: int, weights: list[float]) -> list[int]:
    """``total`` samples in shares proportional to ``weights``, each >= 1 (``total`` >= len(weights)).

    Also how an elastic run re-splits its global batch over the devices that remain (cluster/membership.py).
    """
    n = len(weights)
    # Largest-remainder rounding keeps the sum exact and every share >= 1. sum() of the list, left
    # to right, keeps the shares bit for bit what they were when this was a per-device Python loop.
    raw = total * np.array(weights) / sum(weights)
    sizes = np.maximum(1, raw.astype(np.int64))
    missing = total - int(sizes.sum())
    if missing > 0:  # one more sample each, largest remainders first (ties: lower rank first)
        order = np.argsort(-(raw - np.trunc(raw)), kind="stable")
        rounds, rest = divmod(missing, n)
        sizes += rounds
        sizes[order[:rest]] += 1
    excess = int(sizes.sum()) - total
    while excess > 0:  # from shares raised to 1: take one back where rounding gave most, never below 1
        spare = np.flatnonzero(sizes > 1)
        take = spare[np.argsort(-(sizes[spare] - raw[spare]), kind="stable")[:excess]]
        sizes[take] -= 1
        excess -= len(take)
    return sizes.tolist()
