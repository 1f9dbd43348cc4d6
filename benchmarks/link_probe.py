"""Measures the link model's constants between two test hosts: TCP goodput and gloo's per-collective overhead.

Two test hosts (tests/hosts.py: network namespaces on a bridge, root needed), each link shaped to RATE both
ways by ``tc tbf`` (``--rate none``: unshaped veths). Prints

* TCP goodput of a bulk transfer one way, and both ways at once (what a ring all-reduce does: each host
  sends while it receives, so its ACKs share the link with its data), against the rate;
* gloo's time for ``all_reduce`` of a 4-byte tensor (the per-collective overhead: rendezvous-free, after
  warm-up, median of ``--reps``) and of ``--floats`` float32 values (small_cnn's gradients by default), with
  the link model's time for the same collective beside it (modelled).

docs/benchmarks/real-links.md has the results.

    python benchmarks/link_probe.py --rate 10mbit
    python benchmarks/link_probe.py --rate 1gbit
"""
from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))
sys.path.insert(0, str(REPO / "src"))
os.environ["PYTHONPATH"] = os.pathsep.join([str(REPO / "src"), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)

import hosts as test_hosts  # noqa: E402

SINK = """
import socket, sys, time
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); s.bind(('{addr}', {port})); s.listen(1)
c, _ = s.accept(); n = 0; t0 = None
while True:
    b = c.recv(1 << 16)
    if not b: break
    if t0 is None: t0 = time.perf_counter()
    n += len(b)
print(n, time.perf_counter() - t0)
"""

SOURCE = """
import socket, time
for _ in range(100):
    try: c = socket.create_connection(('{addr}', {port}), 2); break
    except OSError: time.sleep(0.05)
c.settimeout(None)
c.sendall(b'x' * {nbytes}); c.shutdown(socket.SHUT_WR); c.recv(1); c.close()
"""

GLOO = """
import os, statistics, time, json, torch, torch.distributed as dist
torch.set_num_threads(1)
dist.init_process_group('gloo', init_method='tcp://{master}:29511', rank={rank}, world_size=2)
def stat(name):
    with open('/sys/class/net/eth0/statistics/' + name) as f: return int(f.read())
out = {{}}
for n in (1, *{floats}):
    t = torch.ones(n)
    times = []
    dist.barrier(); tx0, pk0 = stat('tx_bytes'), stat('tx_packets')
    for i in range({reps} + 3):
        dist.barrier()
        s = time.perf_counter(); dist.all_reduce(t); e = time.perf_counter() - s
        if i >= 3: times.append(e)
    out[n] = times
    out['tx%d' % n] = (stat('tx_bytes') - tx0, stat('tx_packets') - pk0)
dist.barrier()
print(json.dumps(out))
"""


def qdisc_sent(hosts, i: int) -> tuple[int, int]:
    """(bytes, packets) host ``i``'s eth0 qdisc (the tbf) has sent so far: frames as the shaper counts them."""
    out = hosts.run(i, ["tc", "-s", "qdisc", "show", "dev", "eth0"], timeout=10).stdout
    m = re.search(r"Sent (\d+) bytes (\d+) pkt", out)
    return int(m.group(1)), int(m.group(2))


def tcp(hosts, both: bool, nbytes: int) -> tuple[list[float], tuple[int, int]]:
    """Goodput (bits/s) of each transfer: host 0 -> 1, and 1 -> 0 at the same time if ``both``; and the
    (bytes, packets) host 0's shaper sent meanwhile."""
    before = qdisc_sent(hosts, 0)
    pairs = [(0, 1), (1, 0)] if both else [(0, 1)]
    sinks = [hosts.popen(dst, [sys.executable, "-c", SINK.format(addr=hosts.addresses[dst], port=5100 + k)],
                         stdout=subprocess.PIPE, text=True) for k, (src, dst) in enumerate(pairs)]
    sources = [hosts.popen(src, [sys.executable, "-c", SOURCE.format(addr=hosts.addresses[dst], port=5100 + k,
                                                                      nbytes=nbytes)])
               for k, (src, dst) in enumerate(pairs)]
    rates = []
    for sink in sinks:
        n, seconds = sink.communicate(timeout=300)[0].split()
        rates.append(int(n) * 8 / float(seconds))
    for source in sources:
        source.wait(timeout=30)
    after = qdisc_sent(hosts, 0)
    return rates, (after[0] - before[0], after[1] - before[1])


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rate", default="10mbit", help="tbf rate of each link, or none")
    p.add_argument("--burst", default="32kbit", help="tbf bucket size (tc units: 32kbit, 500kb)")
    p.add_argument("--floats", default="94186", help="float32 values of the larger all-reduces, comma-separated")
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--tcp-bytes", type=int, default=0, help="bytes of each bulk transfer (default: ~3 s at the rate)")
    args = p.parse_args()
    why = test_hosts.unavailable()
    if why:
        sys.exit(f"link_probe: {why}")
    from edgetrain.cluster.links import collective_time
    from edgetrain.comm.accounting import ring_allreduce_bytes
    from edgetrain.spec import get_link, parse_rate

    sizes = tuple(int(f) for f in args.floats.split(","))
    shaped = args.rate != "none"
    nbytes = args.tcp_bytes or (int(parse_rate(args.rate) / 8 * 3) if shaped else 1 << 28)
    with tempfile.TemporaryDirectory(prefix="link_probe") as tmp:
        hosts = test_hosts.Hosts(2, Path(tmp) / "hosts", rate=args.rate if shaped else None, ssh=False,
                                 burst=args.burst)
        try:
            for both in (False, True):
                rates, (wire, packets) = tcp(hosts, both, nbytes)
                print(f"tcp {'both ways at once' if both else 'one way'}, {nbytes} bytes each: goodput "
                      + " / ".join(f"{r / 1e6:.3f}" for r in rates) + f" Mbit/s; host 0's shaper sent {wire} bytes "
                      f"in {packets} frames: {wire / nbytes:.4f} bytes on the wire per byte sent")
            env = dict(os.environ, GLOO_SOCKET_IFNAME="eth0")
            procs = [hosts.popen(i, [sys.executable, "-c", GLOO.format(master=hosts.addresses[0], rank=i,
                                                                      floats=sizes, reps=args.reps)],
                                 env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                     for i in range(2)]
            results = []
            for proc in procs:
                out, err = proc.communicate(timeout=600)
                if proc.returncode:
                    sys.exit(f"link_probe: gloo probe failed: {err[-2000:]}")
                results.append(json.loads(out.strip().splitlines()[-1]))
        finally:
            hosts.close()
    link = get_link(f"{args.rate}:0ms") if shaped else None
    for n in ("1", *map(str, sizes)):
        medians = [statistics.median(r[n]) for r in results]
        sent = ring_allreduce_bytes(4 * int(n), 2)
        model = collective_time([link, link], "allreduce", sent) if link else float("nan")
        wire = [r["tx" + n][0] / (args.reps + 3) for r in results]
        frames = [r["tx" + n][1] / (args.reps + 3) for r in results]
        print(f"gloo all_reduce of {n} float32 ({sent} bytes sent per host): median {medians[0] * 1e3:.2f} / "
              f"{medians[1] * 1e3:.2f} ms (rank 0 / 1, {args.reps} reps); link model {model * 1e3:.2f} ms; "
              f"eth0 sent per collective (with its barrier) {wire[0]:.0f} / {wire[1]:.0f} bytes in "
              f"{frames[0]:.0f} / {frames[1]:.0f} frames")


if __name__ == "__main__":
    main()
