"""Test hosts: N Linux network namespaces joined by a bridge, each with its own address and an OpenSSH sshd.

What a real cluster has and 127.0.0.1 does not: an address per host that is not loopback (gloo must pick
the right interface, the rendezvous store must be reachable on it), links that can be shaped (``tc tbf``:
rate only; this kernel has no ``netem``, so no added delay or loss) or cut (``Hosts.cut``), a real
``sshd`` with key authentication for ``edgetrain launch`` (and TUN forwarding, ``ssh -w``), and what crosses
a link read as it crosses (``Hosts.capture``). The hosts share this machine's file system,
processes' view and cores; only the network is separate.

Names carry this process's pid (``et<pid>...``), so parallel runs do not clash, and every namespace, link,
sshd and process started in a namespace is removed on ``close`` (the fixture calls it whether the test
passed or failed); namespaces left by a killed run (its pid gone) are removed at the next start. Addresses:
``10.213.S.H`` with one free subnet S per ``Hosts`` and H = 1.. for the hosts. Needs root, ``ip`` and
``sshd``; ``unavailable()`` says what is missing (the fixture skips with it).
"""
from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil

SSHD = shutil.which("sshd") or "/usr/sbin/sshd"
PREFIX = "et"


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check, timeout=30)


def unavailable() -> str | None:
    """Why test hosts cannot be made here, or None."""
    if not sys.platform.startswith("linux"):
        return "test hosts need Linux network namespaces"
    if os.geteuid() != 0:
        return "test hosts need root (ip netns add); run the suite as root or in CI (.ci/run)"
    if shutil.which("ip") is None:
        return "test hosts need iproute2's ip (apt-get install iproute2)"
    if not os.access(SSHD, os.X_OK):
        return "test hosts need OpenSSH's sshd (apt-get install openssh-server)"
    if shutil.which("ssh-keygen") is None:
        return "test hosts need ssh-keygen (apt-get install openssh-client)"
    probe = f"{PREFIX}{os.getpid()}probe"
    made = _ip("netns", "add", probe, check=False)
    if made.returncode != 0:
        return f"network namespaces cannot be made here ({made.stderr.strip()})"
    _ip("netns", "del", probe, check=False)
    return None


def remove_stale() -> None:
    """Namespaces and links of earlier runs whose process is gone (a killed pytest cannot clean up)."""
    for line in _ip("netns", "list", check=False).stdout.splitlines():
        m = re.match(rf"({PREFIX}(\d+)h\d+)\b", line)
        if m and not psutil.pid_exists(int(m.group(2))):
            _kill_namespace(m.group(1))
            _ip("netns", "del", m.group(1), check=False)
    for line in _ip("-o", "link", "show", check=False).stdout.splitlines():
        m = re.match(rf"\d+: ({PREFIX}(\d+)[bv]\w*)[@:]", line)
        if m and not psutil.pid_exists(int(m.group(2))):
            _ip("link", "del", m.group(1), check=False)


def _kill_namespace(ns: str) -> None:
    """SIGKILL every process still in namespace ``ns`` (all of them were started by the test hosts)."""
    pids = _ip("netns", "pids", ns, check=False).stdout.split()
    for pid in pids:
        try:
            os.kill(int(pid), signal.SIGKILL)
        except (ProcessLookupError, ValueError):
            pass


def _free_subnet() -> int:
    used = set(int(m) for m in re.findall(r"10\.213\.(\d+)\.", _ip("-o", "addr", check=False).stdout))
    for ns in _ip("netns", "list", check=False).stdout.split():
        if ns.startswith(PREFIX):
            out = _ip("-n", ns, "-o", "addr", check=False).stdout
            used |= set(int(m) for m in re.findall(r"10\.213\.(\d+)\.", out))
    start = os.getpid() % 250 + 1
    for k in range(250):
        s = (start + k) % 250 + 1
        if s not in used:
            return s
    raise RuntimeError("no free 10.213.x.0/24 subnet for test hosts")


class Capture:
    """The frames crossing one interface, read from a raw packet socket (AF_PACKET, root) on a thread: what an
    observer of the link sees, without tcpdump."""

    def __init__(self, interface: str):
        import socket
        import threading

        self.frames: list[bytes] = []
        self.drops = 0
        self.sock = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.ntohs(0x0003))  # ETH_P_ALL
        # a busy machine can leave this thread behind by seconds: the kernel keeps what it has not read yet
        self.sock.setsockopt(socket.SOL_SOCKET, 33, 1 << 26)  # SO_RCVBUFFORCE (root)
        self.sock.bind((interface, 0))
        self.sock.settimeout(0.2)
        self.running = True
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self) -> None:
        while self.running:
            try:
                self.frames.append(self.sock.recv(1 << 18))  # a segmentation offload's frame can pass 64 KiB
            except TimeoutError:
                continue
            except OSError:
                return

    def stop(self) -> bytes:
        """Stop; every frame's bytes, joined. ``drops``: frames the kernel dropped as the buffer was full (a
        capture with drops shows less than crossed)."""
        import struct

        self.running = False
        self.thread.join(timeout=5)
        stats = self.sock.getsockopt(263, 6, 8)  # SOL_PACKET, PACKET_STATISTICS: packets, drops (reset on read)
        self.drops = struct.unpack("II", stats)[1]
        self.sock.close()
        return b"".join(self.frames)


class Hosts:
    """``n`` hosts: ``names[i]`` (namespace), ``addresses[i]``; ``run``/``popen`` a command on one; ``ssh``."""

    def __init__(self, n: int, tmp: Path, rate: str | None = None, ssh: bool = True, burst: str = "32kbit"):
        self.tag = f"{PREFIX}{os.getpid()}"
        self.tmp = Path(tmp)
        self.tmp.mkdir(parents=True, exist_ok=True)
        self.names: list[str] = []
        self.bridge = f"{self.tag}b"
        self.procs: list[subprocess.Popen] = []
        self.sshd: list[subprocess.Popen] = []
        self.burst = burst
        remove_stale()
        self.subnet = _free_subnet()
        try:
            _ip("link", "add", self.bridge, "type", "bridge")
            _ip("link", "set", self.bridge, "up")
            self.addresses = [f"10.213.{self.subnet}.{i + 1}" for i in range(n)]
            for i in range(n):
                self._add_host(i, rate)
            if ssh:
                self._start_sshd()
        except BaseException:
            self.close()
            raise

    def veth(self, i: int) -> str:
        """The bridge side of host ``i``'s link (cut or shape it here)."""
        return f"{self.tag}v{i}"

    def _add_host(self, i: int, rate: str | None) -> None:
        ns = f"{self.tag}h{i}"
        _ip("netns", "add", ns)
        self.names.append(ns)
        inside = f"{self.tag}i{i}"
        _ip("link", "add", self.veth(i), "type", "veth", "peer", "name", inside)
        _ip("link", "set", inside, "netns", ns)
        _ip("-n", ns, "link", "set", inside, "name", "eth0")
        _ip("link", "set", self.veth(i), "master", self.bridge)
        _ip("link", "set", self.veth(i), "up")
        _ip("-n", ns, "addr", "add", f"{self.addresses[i]}/24", "dev", "eth0")
        _ip("-n", ns, "link", "set", "eth0", "up")
        _ip("-n", ns, "link", "set", "lo", "up")
        if rate:
            self.shape(i, rate)

    def shape(self, i: int, rate: str) -> None:
        """Host ``i``'s link at ``rate`` (e.g. ``10mbit``) both ways: tc tbf on each end of its veth, with the
        bucket ``burst`` given to ``Hosts`` (tc's units: ``32kbit``, ``500kb``). A bucket smaller than what the
        rate earns between two of the shaper's timer wake-ups holds the link below its rate (tc-tbf(8): at
        least rate / HZ): 32 kbit is right for 10 Mbit/s, not for 1 Gbit/s (docs/benchmarks/real-links.md)."""
        tbf = ["tbf", "rate", rate, "burst", self.burst, "latency", "50ms"]
        for cmd in (["tc", "qdisc", "replace", "dev", self.veth(i), "root", *tbf],
                    ["ip", "netns", "exec", self.names[i], "tc", "qdisc", "replace", "dev", "eth0", "root", *tbf]):
            subprocess.run(cmd, check=True, capture_output=True, timeout=30)

    def capture(self, i: int) -> "Capture":
        """Every frame on host ``i``'s link from now (its bytes as they cross the wire), until ``stop``."""
        return Capture(self.veth(i))

    def cut(self, i: int, down: bool = True) -> None:
        """Host ``i``'s link down (a partition: its packets go nowhere, nothing tells the peers) or up again."""
        _ip("link", "set", self.veth(i), "down" if down else "up")

    def _start_sshd(self) -> None:
        ssh = self.tmp / "ssh"
        ssh.mkdir(mode=0o700, exist_ok=True)
        self.key = ssh / "id_ed25519"
        host_key = ssh / "host_ed25519"
        for path in (self.key, host_key):
            subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(path)], check=True, timeout=30)
        (ssh / "authorized_keys").write_text(Path(f"{self.key}.pub").read_text())
        self.known_hosts = ssh / "known_hosts"
        self.known_hosts.write_text("".join(f"{a} {Path(f'{host_key}.pub').read_text()}" for a in self.addresses))
        Path("/run/sshd").mkdir(mode=0o755, exist_ok=True)  # sshd's privilege separation directory
        for i, ns in enumerate(self.names):
            config = ssh / f"sshd_config_{i}"
            config.write_text("\n".join([
                f"ListenAddress {self.addresses[i]}", "Port 22", f"HostKey {host_key}",
                f"AuthorizedKeysFile {ssh / 'authorized_keys'}", "PubkeyAuthentication yes",
                "PasswordAuthentication no", "KbdInteractiveAuthentication no", "UsePAM no",
                "PermitRootLogin yes", "StrictModes no", f"PidFile {ssh / f'sshd_{i}.pid'}",
                "AcceptEnv NONE", "MaxStartups 100", "LogLevel ERROR", "PermitTunnel point-to-point", ""]))
            log = open(ssh / f"sshd_{i}.log", "w")
            self.sshd.append(subprocess.Popen(["ip", "netns", "exec", ns, SSHD, "-D", "-e", "-f", str(config)],
                                              stdout=log, stderr=subprocess.STDOUT))
        for i in range(len(self.names)):
            self._wait_port(i, 22, 20)

    def _wait_port(self, i: int, port: int, timeout: float) -> None:
        code = (f"import socket,time,sys\nend=time.time()+{timeout}\nwhile time.time()<end:\n"
                f"  try: socket.create_connection(('{self.addresses[i]}',{port}),1).close(); sys.exit(0)\n"
                f"  except OSError: time.sleep(0.1)\nsys.exit(1)")
        if self.run(i, [sys.executable, "-c", code], timeout=timeout + 10).returncode != 0:
            raise RuntimeError(f"sshd on test host {i} did not listen on {self.addresses[i]}:{port}: "
                               f"{(self.tmp / 'ssh' / f'sshd_{i}.log').read_text()}")

    def command(self, i: int, argv: list[str]) -> list[str]:
        return ["ip", "netns", "exec", self.names[i], *argv]

    def popen(self, i: int, argv: list[str], **kwargs) -> subprocess.Popen:
        """Start ``argv`` on host ``i`` (stopped by ``close`` if still running)."""
        proc = subprocess.Popen(self.command(i, argv), **kwargs)
        self.procs.append(proc)
        return proc

    def run(self, i: int, argv: list[str], timeout: float, **kwargs) -> subprocess.CompletedProcess:
        return subprocess.run(self.command(i, argv), capture_output=True, text=True, timeout=timeout, **kwargs)

    def leftovers(self, i: int) -> list[str]:
        """Command lines of the processes on host ``i`` other than its sshd listener."""
        listener = self.sshd[i].pid if self.sshd else None
        out = []
        for pid in _ip("netns", "pids", self.names[i], check=False).stdout.split():
            if int(pid) != listener:
                try:
                    out.append(" ".join(psutil.Process(int(pid)).cmdline()))
                except psutil.Error:
                    pass
        return out

    def wait_idle(self, i: int, timeout: float) -> bool:
        """Whether host ``i`` runs nothing but its sshd within ``timeout`` seconds."""
        end = time.monotonic() + timeout
        while self.leftovers(i):
            if time.monotonic() > end:
                return False
            time.sleep(0.2)
        return True

    def hosts_yaml(self, path: Path, workdir: Path, env: dict | None = None, only: list[int] | None = None) -> Path:
        """A hosts.yaml for ``edgetrain launch`` naming these hosts (this python, its PYTHONPATH)."""
        import yaml

        env = {"PYTHONPATH": os.environ.get("PYTHONPATH", ""), **(env or {})}
        data = {"defaults": {"user": "root", "key": str(self.key), "known_hosts": str(self.known_hosts),
                             "python": sys.executable, "workdir": str(workdir), "env": env},
                "hosts": [{"address": self.addresses[i], "name": f"h{i}"}
                          for i in (only if only is not None else range(len(self.names)))]}
        path.write_text(yaml.safe_dump(data))
        return path

    def close(self) -> None:
        for proc in [*self.procs, *self.sshd]:
            if proc.poll() is None:
                proc.kill()
        for proc in [*self.procs, *self.sshd]:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        for ns in self.names:
            _kill_namespace(ns)  # what the commands started there (sshd's sessions, torchrun's workers)
        deadline = time.time() + 10
        for ns in self.names:
            while _ip("netns", "pids", ns, check=False).stdout.split() and time.time() < deadline:
                time.sleep(0.1)
            _ip("netns", "del", ns, check=False)
        for i in range(len(self.names)):
            _ip("link", "del", self.veth(i), check=False)
        _ip("link", "del", self.bridge, check=False)
        self.names = []

    def __enter__(self) -> "Hosts":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
