"""The network interface gloo uses, and a hard deadline on waits that gloo does not bound itself.

Interface: without ``GLOO_SOCKET_IFNAME``, gloo binds to the address this host's name resolves to, or to
127.0.0.1 when that address is loopback. Raspberry Pi OS (and many Debian images) map the hostname to
127.0.1.1, so gloo advertises a loopback address to its peers and the run fails after its timeout with an
error about the peers' connections. ``choose_gloo_interface`` sets ``GLOO_SOCKET_IFNAME`` to the interface
whose address routes to ``MASTER_ADDR`` (the one the rendezvous uses anyway), unless it is set or every
device is on this host (``MASTER_ADDR`` loopback). ``describe_gloo_interface`` is the phrase the
rendezvous error uses to name it.

Deadline: gloo retries a failed connection to a peer three times, each with the full timeout, so a
rendezvous whose peers advertised a wrong address ends after about four ``--timeout``s; ``deadline``
ends the process with one line when a block outlasts its bound, whatever gloo does.
"""
from __future__ import annotations

import contextlib
import ipaddress
import os
import socket
import sys
import threading

import psutil

IFNAME_ENV = "GLOO_SOCKET_IFNAME"


def _is_loopback(address: str) -> bool:
    try:
        return ipaddress.ip_address(address.split("%")[0]).is_loopback
    except ValueError:
        return False


def _resolve(host: str) -> list[tuple[int, str]]:
    try:
        return [(family, info[0]) for family, _, _, _, info in
                socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)]
    except (OSError, UnicodeError):
        return []


def route_source(master_addr: str) -> tuple[str, str] | None:
    """(interface, local address) this host would use to reach ``master_addr``; None if there is no route."""
    for family, address in _resolve(master_addr):
        try:
            with socket.socket(family, socket.SOCK_DGRAM) as s:
                s.connect((address, 9))  # UDP: no packet is sent, the kernel only picks the route
                local = s.getsockname()[0]
        except OSError:
            continue
        for name, addrs in psutil.net_if_addrs().items():
            if any(a.address.split("%")[0] == local for a in addrs):
                return name, local
    return None


def choose_gloo_interface(master_addr: str | None) -> str | None:
    """Set ``GLOO_SOCKET_IFNAME`` to the interface that reaches ``master_addr``; the name set, or None where it
    was given, every device is on this host, or no interface routes there (the rendezvous then fails and its
    error names the interface: ``describe_gloo_interface``)."""
    if os.environ.get(IFNAME_ENV) or not master_addr:
        return None
    resolved = _resolve(master_addr)
    if not resolved or all(_is_loopback(a) for _, a in resolved):
        return None
    found = route_source(master_addr)
    if found is None or _is_loopback(found[1]):
        return None
    os.environ[IFNAME_ENV] = found[0]
    return found[0]


def describe_gloo_interface() -> str:
    """Which interface gloo uses here, for an error line: the variable, or the hostname's address."""
    if os.environ.get(IFNAME_ENV):
        return f"{IFNAME_ENV}={os.environ[IFNAME_ENV]}"
    name = socket.gethostname()
    addresses = sorted({a for _, a in _resolve(name)})
    where = ", ".join(addresses) or "nothing"
    loop = " (loopback: peers on other hosts cannot reach it)" if addresses and all(map(_is_loopback, addresses)) \
        else ""
    return f"{IFNAME_ENV} unset, so the address of hostname {name}: {where}{loop}"


@contextlib.contextmanager
def deadline(seconds: float, message: str):
    """Run the block; if it has not ended after ``seconds``, print ``edgetrain: error: <message>`` and end
    the process (exit 2): for C++ waits (gloo's connections) that Python cannot interrupt."""
    done = threading.Event()

    def watch() -> None:
        if not done.wait(seconds):
            print(f"edgetrain: error: {message}", file=sys.stderr, flush=True)
            sys.stdout.flush()
            os._exit(2)

    watcher = threading.Thread(target=watch, name="edgetrain-deadline", daemon=True)
    watcher.start()
    try:
        yield
    finally:
        done.set()
        watcher.join()
