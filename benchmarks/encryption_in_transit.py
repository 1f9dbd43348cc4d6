"""What an observer of one device's link reads of a training run across hosts, without and with the SSH tunnel
of docs/how-to/encryption-in-transit.md.

Three test hosts (tests/hosts.py: network namespaces on a bridge, an sshd each; root needed). The how-to's
``ssh-tunnel`` recipe on hosts 1 and 2 (a star through host 0), then the tutorial's plain recipe (``edgetrain
train``, small_cnn on digits, ``--steps`` steps) twice: ``MASTER_ADDR`` host 0's own address, then its tunnel
address. Every frame on host 1's link is read from a raw packet socket while each run trains. Prints, per
run: its wall time, the bytes on the link, those of SSH (port 22), and whether the records every device sends
rank 0 at the end (JSON with ``"samples_per_s"`` and ``"loss"``) are readable in the captured bytes.

``--fleet``: instead, a Flower SuperLink on host 0 and a SuperNode on host 1, with ``--insecure`` and then with
TLS (``edgetrain certs make``); whether the Fleet API's requests (``/v1/fleet/``) are readable on host 1's link.

    python benchmarks/encryption_in_transit.py --steps 20
    python benchmarks/encryption_in_transit.py --fleet
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO / "tests"), str(REPO / "tests" / "cluster"), str(REPO / "src")]
os.environ["PYTHONPATH"] = os.pathsep.join([str(REPO / "src"), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)

import hosts as test_hosts  # noqa: E402
from test_hosts import ENCRYPTION, finish, recipe, recipe_env, short_run, ssh_bytes  # noqa: E402


def tunnels(h, tmp: Path) -> str:
    """The how-to's SSH tunnels from hosts 1 and 2 to host 0; the tunnel network's first three numbers."""
    vpn = f"10.213.{test_hosts._free_subnet()}"
    recipe_env(h, tmp, 0)  # makes bin/, where ssh gets the test hosts' key and known_hosts
    ssh = tmp / "bin" / "ssh"
    ssh.write_text(f"#!/bin/sh\nexec /usr/bin/ssh -i {h.key} -o UserKnownHostsFile={h.known_hosts} "
                   f"-o StrictHostKeyChecking=yes -o BatchMode=yes \"$@\"\n")
    ssh.chmod(0o755)
    h.run(0, ["sysctl", "-w", "net.ipv4.ip_forward=1"], timeout=10)
    for i in (1, 2):
        made = h.popen(i, ["bash", "-euc", recipe("ssh-tunnel", page=ENCRYPTION)],
                       env=dict(recipe_env(h, tmp, i), VPN=vpn))
        if made.wait(timeout=60) != 0:
            raise SystemExit(f"the ssh-tunnel recipe failed on host {i}")
    return vpn


def observed_run(h, tmp: Path, name: str, master: str, steps: int) -> None:
    wire = h.capture(1)
    started = time.monotonic()
    script = recipe("plain", short_run(tmp / f"runs-{name}", steps=steps, timeout=120)).replace("$FIRST", master)
    procs = [h.popen(i, ["bash", "-euc", script], env=recipe_env(h, tmp, i), cwd=tmp, stdout=subprocess.PIPE,
                     stderr=subprocess.PIPE, text=True) for i in range(3)]
    results = finish(procs, 600)
    took = time.monotonic() - started
    seen = wire.stop()
    for code, _, err in results:
        if code != 0:
            raise SystemExit(f"{name}: a device failed: {err[-2000:]}")
    readable = ", ".join(f"{marker.decode()} {marker in seen}" for marker in (b'"samples_per_s"', b'"loss"'))
    print(f"{name:7s} MASTER_ADDR {master:14s} {took:6.1f} s   on host 1's link: {len(seen):,} bytes, "
          f"{ssh_bytes(wire.frames):,} of them SSH; records readable: {readable}")


def observed_fleet(h, tmp: Path, name: str, link_flags: list[str], node_flags: list[str]) -> None:
    """A SuperLink on host 0 and a SuperNode on host 1 until the node is activated; what host 1's link showed."""
    bin_dir = Path(sys.executable).parent
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "FLWR_HOME": str(tmp)}
    log = tmp / f"superlink-{name}.log"
    wire = h.capture(1)
    link = h.popen(0, [str(bin_dir / "flower-superlink"), *link_flags, "--disable-runtime-dependency-installation",
                       "--host", h.addresses[0], "--port", "9091"], env=env, cwd=tmp, stdout=log.open("w"),
                   stderr=subprocess.STDOUT, start_new_session=True)
    node = h.popen(1, [str(bin_dir / "flower-supernode"), *node_flags, "--superlink", f"{h.addresses[0]}:9091"],
                   env=env, cwd=tmp, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + 120
    while "Activated node_id" not in log.read_text() and time.monotonic() < deadline:
        time.sleep(0.5)
    time.sleep(3)  # a few heartbeats
    seen = wire.stop()
    for proc in (node, link):
        os.killpg(proc.pid, 9)
        proc.wait(timeout=10)
    print(f"fleet {name:8s} node activated {'Activated node_id' in log.read_text()}; on host 1's link: "
          f"{len(seen):,} bytes; '/v1/fleet/' readable {b'/v1/fleet/' in seen}")


def fleets(h, tmp: Path) -> None:
    from edgetrain.certs import make_files, write_new_directory

    certs = tmp / "fleet-certs"
    write_new_directory(certs, make_files([h.addresses[0]], 1))
    observed_fleet(h, tmp, "insecure", ["--insecure"], ["--insecure"])
    observed_fleet(h, tmp, "tls", ["--ssl-ca-certfile", str(certs / "ca.crt"), "--ssl-certfile",
                                   str(certs / "server.crt"), "--ssl-keyfile", str(certs / "server.key")],
                   ["--root-certificates", str(certs / "ca.crt")])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--fleet", action="store_true", help="Flower's fleet API, insecure and with TLS")
    args = parser.parse_args()
    why = test_hosts.unavailable()
    if why:
        raise SystemExit(why)
    with tempfile.TemporaryDirectory() as tmp_dir:
        tmp = Path(tmp_dir)
        if args.fleet:
            with test_hosts.Hosts(2, tmp / "hosts", ssh=False) as h:
                fleets(h, tmp)
            return
        with test_hosts.Hosts(3, tmp / "hosts") as h:
            vpn = tunnels(h, tmp)
            observed_run(h, tmp, "plain", h.addresses[0], args.steps)
            observed_run(h, tmp, "tunnel", f"{vpn}.1", args.steps)


if __name__ == "__main__":
    main()
