"""Hosts on a link shaped by the kernel: network namespaces on a bridge, ``tc tbf`` on both ends of each veth.

What benchmarks/diloco.py needs to measure a run on a real slow link: one
namespace per device with its own address (``10.213.250.H``), joined by a
bridge, each device's link limited to ``rate`` both ways by a token bucket
(``tc qdisc ... tbf``). This kernel has no ``netem``, so the link adds no delay
and loses nothing: a rate limit only. Needs root and iproute2. Everything made
is removed on ``close`` (also on an error), and the processes started in a
namespace are killed by their ids first.
"""
from __future__ import annotations

import os
import subprocess

SUBNET = "10.213.250"


def _run(*argv: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(list(argv), capture_output=True, text=True, check=check, timeout=30)


class ShapedHosts:
    def __init__(self, n: int, rate: str = "10mbit"):
        self.tag = f"dl{os.getpid() % 100000}"
        self.bridge = f"{self.tag}br"
        self.names: list[str] = []
        self.addresses = [f"{SUBNET}.{i + 1}" for i in range(n)]
        self.rate = rate
        try:
            _run("ip", "link", "add", self.bridge, "type", "bridge")
            _run("ip", "link", "set", self.bridge, "up")
            for i in range(n):
                self._add(i)
        except BaseException:
            self.close()
            raise

    def _add(self, i: int) -> None:
        ns, outside, inside = f"{self.tag}h{i}", f"{self.tag}v{i}", f"{self.tag}i{i}"
        _run("ip", "netns", "add", ns)
        self.names.append(ns)
        _run("ip", "link", "add", outside, "type", "veth", "peer", "name", inside)
        _run("ip", "link", "set", inside, "netns", ns)
        _run("ip", "-n", ns, "link", "set", inside, "name", "eth0")
        _run("ip", "link", "set", outside, "master", self.bridge)
        _run("ip", "link", "set", outside, "up")
        _run("ip", "-n", ns, "addr", "add", f"{self.addresses[i]}/24", "dev", "eth0")
        _run("ip", "-n", ns, "link", "set", "eth0", "up")
        _run("ip", "-n", ns, "link", "set", "lo", "up")
        # the token bucket: rate, a 32 kbit burst, packets queued at most 50 ms, on both ends (egress each way)
        tbf = ["tbf", "rate", self.rate, "burst", "32kbit", "latency", "50ms"]
        _run("tc", "qdisc", "replace", "dev", outside, "root", *tbf)
        _run("ip", "netns", "exec", ns, "tc", "qdisc", "replace", "dev", "eth0", "root", *tbf)

    def command(self, i: int, argv: list[str]) -> list[str]:
        return ["ip", "netns", "exec", self.names[i], *argv]

    def close(self) -> None:
        for ns in self.names:
            for pid in _run("ip", "netns", "pids", ns, check=False).stdout.split():
                try:
                    os.kill(int(pid), 9)
                except (ProcessLookupError, ValueError):
                    pass
            _run("ip", "netns", "del", ns, check=False)
        _run("ip", "link", "del", self.bridge, check=False)
        self.names = []

    def __enter__(self) -> "ShapedHosts":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
