"""Memory and storage that bind like a device's (``--device-limits cgroup``): kernel limits, not checks.

An emulated device process moves itself (its loader workers follow, as children) into two cgroup v1 groups
of its own: ``memory`` with its profile's ``memory_mb`` as ``memory.limit_in_bytes`` (the kernel charges the
page cache of what it reads there too, so a device whose dataset exceeds its memory really re-reads from
storage), and ``blkio`` with its storage's read MB/s and IOPS (``profiles.STORAGES``) as throttles on the
block device that holds its data. On joining, a device takes its own copy of the memory it still shares
with the fork server it was forked from (torch and edgetrain, about 220 MiB, charged to the server's group),
and what it held alone before joining comes off its limit: its group covers all its anonymous memory
(docs/how-to/storage.md, "What is charged"). Both go when the device ends: it moves back to the root
groups, stops any process left in them and removes them; groups a killed run left are removed by the next
run that sets limits (``sweep``). Where the host has no writable cgroup v1 hierarchy, or the data is on a
file system without a block device (tmpfs, overlay), that limit falls back (said once by rank 0, and
labelled in the summary's ``details.limits``); a write the kernel refuses is one line naming the file.
"""
from __future__ import annotations

import ctypes
import errno
import os
import signal
import time
from pathlib import Path

import numpy as np
import psutil

from edgetrain.cluster.profiles import STORAGES, Storage
from edgetrain.errors import EdgetrainError

ROOT = Path(os.environ.get("EDGETRAIN_CGROUP_ROOT", "/sys/fs/cgroup"))
PREFIX = "edgetrain-"
_MADV_POPULATE_WRITE = 23  # Linux 5.14: fault pages in as if written, which gives a shared page a copy of its own
_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
# /proc/self/pagemap, one 64-bit entry per page: present, a file page (or shared memory), mapped by this process only
_PRESENT, _FILE_OR_SHARED, _EXCLUSIVE = 1 << 63, 1 << 61, 1 << 56


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
        self.held_alone_bytes = 0  # anonymous memory it held alone before joining: charged elsewhere, off its limit
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
                self._join_memory(group, pid)
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

    def _join_memory(self, group: Path, pid: str) -> None:
        """Join ``group``, limited to the profile's memory, charged for every anonymous page the process maps:
        its copy of the pages it shared with the fork server is charged to it, what it held alone before (charged
        elsewhere) comes off the limit."""
        shared, rest = _anonymous_pages()
        limit = self.memory_mb * 2 ** 20
        holds = sum(size for _, size in shared) + rest
        if holds >= limit:
            raise EdgetrainError(f"its profile's memory_mb of {self.memory_mb} MiB is less than the {holds >> 20} MiB "
                                 "of memory its process holds before training (torch and edgetrain loaded); give "
                                 "its profile more memory_mb, or use --device-limits off")
        # The profile's figure, for the out-of-memory line (``oom_killed``): a soft limit above the hard one
        # never acts (the kernel reclaims a group down to its soft limit only under the host's memory pressure).
        _write(group / "memory.soft_limit_in_bytes", str(limit))
        _write(group / "memory.limit_in_bytes", str(limit))
        _write(group / "cgroup.procs", pid)
        _own_inherited_pages(shared)
        # Measured, not taken from the scan: a page the server wrote since is ours alone without a copy.
        self.held_alone_bytes = max(0, _rss_anon() - _charged_anon(group))
        _write(group / "memory.limit_in_bytes", str(limit - self.held_alone_bytes))
        self.memory_bound = True
        self.applied.append(f"memory {self.memory_mb} MiB, page cache included (cgroup v1; "
                            f"{self.held_alone_bytes >> 20} MiB its process held before joining count against it)")

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


def _anonymous_pages() -> tuple[list[tuple[int, int]], int]:
    """This process's anonymous memory in its private mappings: (runs of writable pages it still shares with
    another process, such as the fork server it was forked from, as (address, bytes); bytes of the rest: pages
    it maps alone, and shared ones it cannot write, such as libraries' relocated data)."""
    shared: list[tuple[int, int]] = []
    rest = 0
    with open("/proc/self/maps") as maps, open("/proc/self/pagemap", "rb") as pagemap:
        for line in maps:
            span, perms = line.split()[:2]
            if not perms.endswith("p"):
                continue
            low, high = (int(x, 16) for x in span.split("-"))
            pagemap.seek(low // _PAGE * 8)
            entries = np.frombuffer(pagemap.read((high - low) // _PAGE * 8), dtype=np.uint64)
            anonymous = (entries & np.uint64(_PRESENT | _FILE_OR_SHARED)) == np.uint64(_PRESENT)
            writable = perms[1] == "w"  # a page it cannot write it cannot copy either
            inherited = anonymous & ((entries & np.uint64(_EXCLUSIVE)) == 0) & writable
            rest += int(np.count_nonzero(anonymous & ~inherited)) * _PAGE
            edges = np.flatnonzero(np.diff(np.concatenate(([0], inherited.astype(np.int8), [0]))))  # runs' ends
            shared += [(low + int(a) * _PAGE, int(b - a) * _PAGE) for a, b in zip(edges[::2], edges[1::2])]
    return shared, rest


def _own_inherited_pages(shared: list[tuple[int, int]]) -> None:
    """Give this process its own copy of the pages in ``shared`` (as a write would, their contents unchanged),
    charged to the memory group it is in now. Before Linux 5.14 the kernel cannot: they stay shared."""
    madvise = ctypes.CDLL(None, use_errno=True).madvise
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    for address, size in shared:
        if madvise(address, size, _MADV_POPULATE_WRITE) != 0 and ctypes.get_errno() == errno.EINVAL:
            return  # an unknown advice (ENOMEM: a run unmapped since the scan, nothing to own)


def _rss_anon() -> int:
    """Bytes of anonymous memory this process maps (``RssAnon``)."""
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) * 1024 for line in status if line.startswith("RssAnon:"))


def _charged_anon(group: Path) -> int:
    """Bytes of anonymous memory charged to memory ``group`` (its ``memory.stat`` ``rss``)."""
    stat = dict(line.split() for line in (group / "memory.stat").read_text().splitlines())
    return int(stat["rss"])


def memory_group(pid: int) -> tuple[int, int] | None:
    """Device process ``pid``'s memory group as (its profile's memory in MiB, the processes the kernel's
    out-of-memory killer killed in it: the device or its loader workers, cgroup v1 ``memory.oom_control``'s
    ``oom_kill``); None where it has none (limits off, another host, a kernel before 4.13 counts no kills)."""
    group = ROOT / "memory" / f"{PREFIX}{pid}-memory"
    try:
        control = dict(line.split() for line in (group / "memory.oom_control").read_text().splitlines())
        limit, profile = (int((group / name).read_text()) for name in ("memory.limit_in_bytes",
                                                                        "memory.soft_limit_in_bytes"))
        kills = int(control["oom_kill"])
    except (OSError, ValueError, KeyError):
        return None
    if profile > 2 ** 50:  # the kernel's "unlimited": no profile figure recorded (``_join_memory``)
        profile = limit
    return profile // 2 ** 20, kills


def oom_killed(pid: int) -> int | None:
    """The profile's memory (MiB) of device process ``pid``'s group if the out-of-memory killer killed a process
    in it, else None: what a SIGKILL there meant."""
    group = memory_group(pid)
    return group[0] if group and group[1] else None


def device_limits(mode: str, label: str, memory_mb: int | None, storage_name: str | None,
                  data_path: str | None) -> DeviceLimits | None:
    """The limits ``--device-limits`` asks for, applied to this process; None for ``off``."""
    if mode == "off":
        return None
    storage = STORAGES[storage_name] if storage_name else None
    return DeviceLimits(label, memory_mb, storage, data_path).apply()
