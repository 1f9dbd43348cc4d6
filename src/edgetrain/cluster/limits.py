"""Memory and storage that bind like a device's (``--device-limits cgroup``): kernel limits, not checks.

An emulated device process moves itself (its loader workers follow, as children) into two cgroup v1 groups
of its own: ``memory`` with its profile's ``memory_mb`` as ``memory.limit_in_bytes`` (the kernel charges the
page cache of what it reads there too, so a device whose dataset exceeds its memory really re-reads from
storage), and ``blkio`` with its storage's read MB/s and IOPS (``profiles.STORAGES``) as throttles on the
block device that holds its data. Both go when the device ends: it moves back to the root groups, stops any
process left in them and removes them; groups a killed run left are removed by the next run that sets limits
(``sweep``). Where the host has no writable cgroup v1 hierarchy, or the data is on a file system without a
block device (tmpfs, overlay), that limit falls back (said once by rank 0, and labelled in the summary's
``details.limits``); a write the kernel refuses is one line naming the file.
"""
from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import psutil

from edgetrain.cluster.profiles import STORAGES, Storage
from edgetrain.errors import EdgetrainError

ROOT = Path(os.environ.get("EDGETRAIN_CGROUP_ROOT", "/sys/fs/cgroup"))
PREFIX = "edgetrain-"


def _write(path: Path, value: str) -> None:
    try:
        path.write_text(value)
    except OSError as e:
        raise EdgetrainError(f"cgroup write refused: '{value}' to {path} ({e.strerror or e}); run edgetrain as root "
                             "on a host with cgroup v1 (memory, blkio), or use --device-limits off") from None


def block_device(path: str | os.PathLike) -> tuple[str | None, str]:
    """("major:minor" of the whole disk holding ``path``, or None, and why not)."""
    try:
        dev = os.stat(path).st_dev
    except OSError as e:
        return None, f"{path} cannot be inspected ({e.strerror})"
    major, minor = os.major(dev), os.minor(dev)
    if major == 0:
        return None, f"{path} is on a file system without a block device (tmpfs, overlay, network)"
    sys_dev = Path(f"/sys/dev/block/{major}:{minor}")
    if (sys_dev / "partition").exists():  # throttles apply to whole disks
        parent = (sys_dev.resolve().parent / "dev")
        if parent.is_file():
            return parent.read_text().strip(), ""
    return f"{major}:{minor}", ""


def sweep() -> None:
    """Remove the groups of runs that ended without removing theirs (their process is gone)."""
    for controller in ("memory", "blkio"):
        base = ROOT / controller
        for group in base.glob(PREFIX + "*") if base.is_dir() else []:
            try:
                pid = int(group.name[len(PREFIX):].split("-")[0])
            except ValueError:
                continue
            try:
                if not psutil.pid_exists(pid) and not (group / "cgroup.procs").read_text().split():
                    group.rmdir()
            except OSError:
                pass


class DeviceLimits:
    """The limits of one device process (``apply``, then ``close`` whatever happens in between)."""

    def __init__(self, label: str, memory_mb: int | None, storage: Storage | None, data_path: str | None):
        self.label, self.memory_mb, self.storage, self.data_path = label, memory_mb, storage, data_path
        self.made: list[Path] = []
        self.memory_bound = False  # the kernel holds the device to its memory (page cache included)
        self.applied: list[str] = []
        self.fallbacks: list[str] = []

    def describe(self) -> str:
        return "; ".join([*self.applied, *(f"fallback: {f}" for f in self.fallbacks)]) or "none"

    def apply(self) -> "DeviceLimits":
        try:
            self._apply()
        except BaseException:
            self.close()
            raise
        return self

    def _group(self, controller: str) -> Path | None:
        base = ROOT / controller
        if not (base / "cgroup.procs").is_file() or not os.access(base, os.W_OK):
            self.fallbacks.append(f"no writable cgroup v1 {controller} hierarchy at {base}")
            return None
        group = base / f"{PREFIX}{os.getpid()}-{controller}"
        try:
            group.mkdir()
        except OSError as e:
            raise EdgetrainError(f"cgroup {group} cannot be made ({e.strerror}); run edgetrain as root on a host with "
                                 "cgroup v1, or use --device-limits off") from None
        self.made.append(group)
        return group

    def _apply(self) -> None:
        sweep()
        pid = str(os.getpid())
        if self.memory_mb:
            group = self._group("memory")
            if group is not None:
                _write(group / "memory.limit_in_bytes", str(self.memory_mb * 2 ** 20))
                _write(group / "cgroup.procs", pid)
                self.memory_bound = True
                self.applied.append(f"memory {self.memory_mb} MiB, page cache included (cgroup v1)")
        else:
            self.fallbacks.append("its profile gives no memory_mb: memory not limited")
        if self.storage is None:
            return
        device, why = block_device(self.data_path or ".")
        if device is None:
            self.fallbacks.append(f"{why}: storage {self.storage.name} not throttled")
            return
        group = self._group("blkio")
        if group is not None:
            _write(group / "blkio.throttle.read_bps_device", f"{device} {int(self.storage.read_mb_s * 1e6)}")
            _write(group / "blkio.throttle.read_iops_device", f"{device} {self.storage.read_iops}")
            _write(group / "cgroup.procs", pid)
            self.applied.append(f"storage {self.storage.name}: reads of {device} at {self.storage.read_mb_s:g} MB/s, "
                                f"{self.storage.read_iops} IOPS (blkio throttle)")

    def close(self) -> None:
        """Back to the root groups; stop what is left in ours (loader workers); remove them."""
        for group in reversed(self.made):
            try:
                (group.parent / "cgroup.procs").write_text(str(os.getpid()))
            except OSError:
                pass
            deadline = time.monotonic() + 5.0
            while True:
                try:
                    left = [int(p) for p in (group / "cgroup.procs").read_text().split()]
                except OSError:
                    left = []
                for p in left:
                    try:
                        os.kill(p, signal.SIGKILL)  # our own loader workers: nothing else is put here
                    except ProcessLookupError:
                        pass
                try:
                    group.rmdir()
                    break
                except FileNotFoundError:
                    break
                except OSError:
                    if time.monotonic() > deadline:
                        break
                    time.sleep(0.05)
        self.made = []


def oom_killed(pid: int) -> int | None:
    """The memory limit (MiB) of device process ``pid``'s group if the kernel's out-of-memory killer killed a
    process in it (cgroup v1 ``memory.oom_control``'s ``oom_kill``), else None: what a device's SIGKILL meant."""
    group = ROOT / "memory" / f"{PREFIX}{pid}-memory"
    try:
        control = dict(line.split() for line in (group / "memory.oom_control").read_text().splitlines())
        limit = int((group / "memory.limit_in_bytes").read_text())
    except (OSError, ValueError):
        return None  # no group of ours (limits off, another host, a kernel before 4.13 counts no kills)
    return limit // 2 ** 20 if int(control.get("oom_kill", 0)) > 0 else None


def device_limits(mode: str, label: str, memory_mb: int | None, storage_name: str | None,
                  data_path: str | None) -> DeviceLimits | None:
    """The limits ``--device-limits`` asks for, applied to this process; None for ``off``."""
    if mode == "off":
        return None
    storage = STORAGES[storage_name] if storage_name else None
    return DeviceLimits(label, memory_mb, storage, data_path).apply()
