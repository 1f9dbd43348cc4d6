"""The fleet simulation on a Ray cluster across hosts: a head and workers on the project's test hosts.

As root: ``1 + --workers`` test hosts (tests/hosts.py: network namespaces on a bridge, 10.213.x.y), a Ray
head on host 0 (``ray start --head``, no CPUs of its own: it runs the GCS and the driver) and a Ray worker
node on each other host (``ray start --address HEAD:PORT``, ``--cpus-per-node`` CPUs each); then, on host 0,
``edgetrain.fleet.simulation.simulate`` with ``SimulationResources(address="HEAD:PORT")``: Flower's
``run_simulation`` joins that cluster instead of starting a Ray of its own, and its ClientApp actors are
placed on the worker nodes. Measured and printed: each round's records, the wall time, each host's CPU
seconds and peak memory (its processes sampled every second) and the bytes that crossed its link, the
actors and the ClientApp calls per node (Ray's GCS: its actor table and its task events). The run fails
(exit 1) unless the ClientApp calls ran on more than one node. docs/benchmarks/fleet-simulation.md has the
results.

Every Ray process runs in a test host, so the teardown ends them by namespace (SIGTERM, then SIGKILL) and
deletes the hosts, on success, error, Ctrl-C or SIGTERM; not with ``ray stop``, which stops every Ray
process on the machine, other users' included. Every wait is bounded.

    sudo PYTHONPATH=src nice -n 10 .venv/bin/python benchmarks/fleet_ray_cluster.py --devices 40 --per-round 10 \\
        --rounds 3 --json benchmarks/results/fleet_ray_cluster.json
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))
os.environ["PYTHONPATH"] = os.pathsep.join([str(REPO / "src"), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)

RAY = str(Path(sys.executable).with_name("ray"))
PORT = 6379
START_TIMEOUT_S = 120         # one `ray start`
NODES_TIMEOUT_S = 60          # every worker node registered with the head, as the driver sees it
STOP_GRACE_S = 10             # SIGTERM to SIGKILL


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workers", type=int, default=2, help="Ray worker nodes, one test host each (1..8)")
    ap.add_argument("--cpus-per-node", type=int, default=1, help="CPUs each worker node gives Ray (1 actor each)")
    ap.add_argument("--devices", type=int, default=40)
    ap.add_argument("--per-round", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--local-steps", type=int, default=5)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--timeout", type=float, default=900.0, help="seconds the driver may run")
    ap.add_argument("--worker-niceness", type=int, default=0,
                    help="RAY_worker_niceness of every node: added to the actors' niceness (Ray's own default: 15)")
    ap.add_argument("--join", choices=("explicit", "auto"), default="explicit",
                    help="how the driver names the cluster: SimulationResources(address=HEAD:PORT), or "
                         "address='auto' with temp_dir= the head's --temp-dir")
    ap.add_argument("--json", help="write the result here")
    ap.add_argument("--driver", help=argparse.SUPPRESS)  # internal: run the simulation on the head, output path
    ap.add_argument("--head", help=argparse.SUPPRESS)
    ap.add_argument("--head-temp-dir", help=argparse.SUPPRESS)
    return ap.parse_args()


# ---------------------------------------------------------------- the driver, on the head's host

def run_config(args: argparse.Namespace, output_dir: str) -> dict:
    """small_cnn on 16x16 synthetic data, enough samples for every device's IID partition to hold two batches;
    fleet_sim.py's population (its modelled clock writes each round's record)."""
    return {"model": "small_cnn", "dataset": "synthetic", "image-size": 16,
            "synthetic-samples": args.devices * args.batch_size * 2, "partition": "iid",
            "num-rounds": args.rounds, "local-steps": args.local_steps, "batch-size": args.batch_size,
            "fraction-train": args.per_round / args.devices, "fraction-evaluate": 0.0, "server-evaluate": True,
            "min-nodes": args.devices, "round-timeout": 600.0, "output-dir": output_dir,
            "population": "60% rpi4@wifi-20m, 30% smart-speaker-2g@lte-10m, 10% jetson-orin-nano"}


def wait_for_nodes(address: str, expected: int) -> list[dict]:
    """The cluster's live nodes once ``expected`` have registered (bounded)."""
    import ray

    ray.init(address=address, logging_level="warning")
    try:
        end = time.monotonic() + NODES_TIMEOUT_S
        while True:
            alive = [n for n in ray.nodes() if n["Alive"]]
            if len(alive) >= expected or time.monotonic() > end:
                return [{"ip": n["NodeManagerAddress"], "cpus": n["Resources"].get("CPU", 0)} for n in alive]
            time.sleep(0.5)
    finally:
        ray.shutdown()


def placement(address: str) -> dict:
    """Where the run's ClientApp actors lived and where their calls ran, from the head's GCS: its actor table
    (dead actors included) and its task events (one ``task::ClientAppActor.run`` profile event per device-round:
    what ``ray timeline`` draws)."""
    import ray
    from ray._private import state

    ray.init(address=address, logging_level="warning")
    try:
        actors: dict[str, int] = {}
        for actor in state.actors().values():
            if actor["ActorClassName"] == "ClientAppActor":
                actors[actor["Address"]["IPAddress"]] = actors.get(actor["Address"]["IPAddress"], 0) + 1
        calls: dict[str, int] = {}
        for events in state.state.profile_events().values():
            for event in events:
                if event["event_type"] == "task::ClientAppActor.run":
                    calls[event["node_ip_address"]] = calls.get(event["node_ip_address"], 0) + 1
        return {"actors_by_node": actors, "calls_by_node": calls}
    finally:
        ray.shutdown()


def driver(args: argparse.Namespace) -> None:
    """On the head's host: wait for the nodes, run the fleet on the cluster, read where it ran; JSON to
    ``args.driver``."""
    from edgetrain.fleet.simulation import SimulationResources, simulate

    address = f"{args.head}:{PORT}"
    nodes = wait_for_nodes(address, 1 + args.workers)
    print(f"driver: {len(nodes)} Ray node(s): {nodes}", flush=True)
    if len(nodes) < 1 + args.workers:
        sys.exit(f"driver: {len(nodes)} of {1 + args.workers} Ray nodes registered in {NODES_TIMEOUT_S} s")
    output_dir = str(Path(args.driver).with_name("records"))
    start = time.perf_counter()
    joined = (SimulationResources(cpus_per_device=1.0, address=address) if args.join == "explicit" else
              SimulationResources(cpus_per_device=1.0, address="auto", temp_dir=args.head_temp_dir))
    print(f"driver: simulate() with {joined}", flush=True)
    simulate(run_config(args, output_dir), args.devices, joined)
    wall = time.perf_counter() - start
    rounds = [json.loads(line) for line in (Path(output_dir) / "fleet-rounds.jsonl").read_text().splitlines()]
    Path(args.driver).write_text(json.dumps({"nodes": nodes, "simulate_wall_s": wall, "rounds": rounds,
                                             **placement(address)}))


# ---------------------------------------------------------------- the hosts' processes, measured from outside

def netns_inode(name: str) -> int:
    return os.stat(f"/run/netns/{name}").st_ino


def role(proc: psutil.Process) -> str:
    cmdline = proc.cmdline()
    title = " ".join(cmdline)
    if title.startswith("ray::"):
        return title.split()[0]  # ray::ClientAppActor, ray::IDLE, ray::DashboardAgent, ...
    if "--driver" in cmdline:
        return "driver"
    if len(cmdline) > 2 and cmdline[1].endswith("/ray"):
        return f"ray {cmdline[2]}"  # the CLI itself, `ray start`
    if cmdline and Path(cmdline[0]).name in ("gcs_server", "raylet"):
        return Path(cmdline[0]).name
    if "ray.util.client.server" in cmdline:
        return "ray client server"
    scripts = [Path(part).name for part in cmdline if part.endswith(".py")]  # log_monitor.py, default_worker.py ...
    return scripts[-1] if scripts else Path(cmdline[0]).name if cmdline else "?"


class HostSampler(threading.Thread):
    """Every ``interval`` s: each host's processes (found by their network namespace), their CPU seconds so far
    (a process that ends loses what it spent after its last sample), resident memory (the host's total, and
    the largest of each kind of process) and niceness."""

    def __init__(self, names: list[str], interval: float = 1.0):
        super().__init__(daemon=True)
        self.inodes = {f"net:[{netns_inode(n)}]": i for i, n in enumerate(names)}
        self.interval, self.stop = interval, threading.Event()
        self.cpu: list[dict[int, tuple[str, float]]] = [{} for _ in names]
        self.peak_rss = [0] * len(names)
        self.niceness: list[dict[str, int]] = [{} for _ in names]
        self.peak_rss_by_role: list[dict[str, int]] = [{} for _ in names]

    def host_of(self, pid: int) -> int | None:
        try:
            return self.inodes.get(os.readlink(f"/proc/{pid}/ns/net"))
        except OSError:
            return None

    def sample(self) -> None:
        rss = [0] * len(self.peak_rss)
        for pid in psutil.pids():
            host = self.host_of(pid)
            if host is None:
                continue
            try:
                proc = psutil.Process(pid)
                with proc.oneshot():
                    times, name = proc.cpu_times(), role(proc)
                    resident = proc.memory_info().rss
                    rss[host] += resident
                    peaks = self.peak_rss_by_role[host]
                    peaks[name] = max(peaks.get(name, 0), resident)  # the largest one process of the role had
                    self.cpu[host][pid] = (name, times.user + times.system)
                    self.niceness[host][name] = proc.nice()
            except psutil.Error:
                pass
        self.peak_rss = [max(a, b) for a, b in zip(self.peak_rss, rss)]

    def run(self) -> None:
        while not self.stop.wait(self.interval):
            self.sample()

    def cpu_by_role(self, host: int) -> dict[str, float]:
        roles: dict[str, float] = {}
        for name, seconds in self.cpu[host].values():
            roles[name] = roles.get(name, 0.0) + seconds
        return dict(sorted(roles.items(), key=lambda item: -item[1]))


def link_bytes(hosts, i: int) -> int:
    """Bytes that crossed host ``i``'s link so far, both ways (its veth's counters on the bridge side)."""
    stats = Path(f"/sys/class/net/{hosts.veth(i)}/statistics")
    return int((stats / "rx_bytes").read_text()) + int((stats / "tx_bytes").read_text())


# ---------------------------------------------------------------- the cluster's start and teardown

def ray_start(hosts, i: int, temp_dir: Path, args: argparse.Namespace) -> None:
    """``ray start`` on host ``i`` (the head on host 0), its files under ``temp_dir``, at this process's niceness
    (run the script under ``nice``), the actors ``--worker-niceness`` above it (``RAY_worker_niceness``)."""
    common = ["--node-ip-address", hosts.addresses[i], "--temp-dir", str(temp_dir), "--object-store-memory",
              str(100 * 2**20), "--disable-usage-stats"]
    if i == 0:
        role_args = ["--head", "--port", str(PORT), "--num-cpus", "0", "--include-dashboard=false"]
    else:
        role_args = ["--address", f"{hosts.addresses[0]}:{PORT}", "--num-cpus", str(args.cpus_per_node)]
    env = {**os.environ, "RAY_worker_niceness": str(args.worker_niceness)}
    done = hosts.run(i, [RAY, "start", *role_args, *common], timeout=START_TIMEOUT_S, env=env)
    if done.returncode != 0:
        raise RuntimeError(f"ray start on host {i} failed ({done.returncode}): {done.stderr.strip()[-800:]}")


def end_host_processes(hosts) -> None:
    """SIGTERM every process in every host, SIGKILL what is left after ``STOP_GRACE_S`` (bounded)."""
    def pids() -> list[int]:
        found = []
        for name in hosts.names:
            out = subprocess.run(["ip", "netns", "pids", name], capture_output=True, text=True, timeout=30).stdout
            found += [int(p) for p in out.split()]
        return found

    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in pids():
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        end = time.monotonic() + STOP_GRACE_S
        while pids() and time.monotonic() < end:
            time.sleep(0.2)


def left_behind(temp_root: Path, names: list[str]) -> list[str]:
    """Processes still running that this run started: any naming its temp directory or in one of its hosts."""
    inodes = set()
    for name in names:
        try:
            inodes.add(f"net:[{netns_inode(name)}]")
        except OSError:
            pass
    found = []
    for proc in psutil.process_iter(["pid", "cmdline"]):
        try:
            title = " ".join(proc.info["cmdline"] or [])
            in_host = os.readlink(f"/proc/{proc.pid}/ns/net") in inodes
        except (psutil.Error, OSError):
            continue
        if proc.pid != os.getpid() and (str(temp_root) in title or in_host):
            found.append(f"{proc.pid} {title[:120]}")
    return found


def teardown(hosts, temp_root: Path, keep_logs: bool) -> list[str]:
    """End every process of the hosts, delete them, remove the temp files (a failed run keeps Ray's logs);
    signals are ignored meanwhile, so a second Ctrl-C cannot cut it short (each step is bounded). What this run
    left running: printed and returned."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    names = list(hosts.names) if hosts else []
    if hosts:
        end_host_processes(hosts)
    leftovers = left_behind(temp_root, names)
    if hosts:
        hosts.close()
    if keep_logs:
        print(f"Ray's logs kept: {temp_root}/n*/session_latest/logs (remove {temp_root} when read)", file=sys.stderr)
    else:
        shutil.rmtree(temp_root, ignore_errors=True)
    print(f"torn down: {len(names)} host(s) deleted; processes left behind: {leftovers or 'none'}; "
          f"namespaces left: {[n for n in names if Path(f'/run/netns/{n}').exists()] or 'none'}")
    return leftovers


def raise_on_sigterm(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


# ---------------------------------------------------------------- the run

def report(args, result: dict, sampler: HostSampler, bytes_moved: list[int], hosts) -> dict:
    for r in result["rounds"]:
        print(f"round {r.get('round')}: sampled {r.get('sampled')}, aggregated {r.get('aggregated')}, "
              f"training {r.get('measured_train_wall_s', 0):.1f} s, server accuracy {r.get('server_accuracy', 0):.3f}")
    print(f"simulate() wall time: {result['simulate_wall_s']:.1f} s; whole run (hosts up to torn down): "
          f"{result['total_wall_s']:.1f} s")
    per_host = []
    for i, name in enumerate(hosts.names):
        ip = hosts.addresses[i]
        entry = {"host": i, "ip": ip, "role": "head + driver" if i == 0 else "worker",
                 "cpu_s": round(sum(sampler.cpu_by_role(i).values()), 1),
                 "cpu_s_by_process": {k: round(v, 1) for k, v in sampler.cpu_by_role(i).items()},
                 "peak_rss_mb": round(sampler.peak_rss[i] / 2**20),
                 "peak_rss_mb_by_process": {k: round(v / 2**20) for k, v in sorted(
                     sampler.peak_rss_by_role[i].items(), key=lambda item: -item[1]) if v >= 2**20},
                 "link_mb": round(bytes_moved[i] / 1e6, 2),
                 "actors": result["actors_by_node"].get(ip, 0), "clientapp_calls": result["calls_by_node"].get(ip, 0),
                 "niceness": sampler.niceness[i]}
        per_host.append(entry)
        print(f"host {i} {ip} ({entry['role']}): {entry['cpu_s']} CPU-s, peak {entry['peak_rss_mb']} MB, "
              f"{entry['link_mb']} MB over its link, {entry['actors']} ClientApp actor(s), "
              f"{entry['clientapp_calls']} ClientApp call(s); CPU-s by process {entry['cpu_s_by_process']}; "
              f"peak MB by process {entry['peak_rss_mb_by_process']}; "
              f"niceness {entry['niceness']}")
    return {"args": {k: v for k, v in vars(args).items() if k not in ("driver", "head", "head_temp_dir")},
            "hosts": per_host, "load_average_1min_end": os.getloadavg()[0], **result}


def run_cluster(args: argparse.Namespace, hosts, temp_root: Path) -> dict:
    start = time.perf_counter()
    sampler = HostSampler(hosts.names)
    sampler.start()
    for i in range(len(hosts.names)):
        ray_start(hosts, i, temp_root / f"n{i}", args)
        print(f"ray start on host {i} ({hosts.addresses[i]}) done at {time.perf_counter() - start:.1f} s", flush=True)
    out = temp_root / "driver.json"
    before = [link_bytes(hosts, i) for i in range(len(hosts.names))]
    passed = ("workers", "devices", "per_round", "rounds", "local_steps", "batch_size", "join")
    driver_proc = hosts.popen(0, [sys.executable, __file__, "--driver", str(out), "--head", hosts.addresses[0],
                                  "--head-temp-dir", str(temp_root / "n0"),
                                  *[f"--{k.replace('_', '-')}={v}" for k, v in vars(args).items() if k in passed]])
    try:
        code = driver_proc.wait(timeout=args.timeout)
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"the driver did not finish in {args.timeout:g} s") from None
    sampler.sample()
    sampler.stop.set()
    if code != 0:
        raise RuntimeError(f"the driver failed (exit {code})")
    moved = [link_bytes(hosts, i) - before[i] for i in range(len(hosts.names))]
    result = json.loads(out.read_text())
    result["total_wall_s"] = time.perf_counter() - start
    return report(args, result, sampler, moved, hosts)


def main() -> int:
    args = parse_args()
    if args.driver:
        driver(args)
        return 0
    import hosts as test_hosts

    why = test_hosts.unavailable()
    if why or not 1 <= args.workers <= 8 or args.per_round > args.devices or not 0 <= args.worker_niceness <= 19:
        print(f"fleet_ray_cluster: {why or 'need 1..8 workers, --per-round <= --devices, --worker-niceness 0..19'}",
              file=sys.stderr)
        return 2
    signal.signal(signal.SIGTERM, raise_on_sigterm)
    temp_root = Path(f"/tmp/rc{os.getpid()}")  # short: Ray's sockets live below it (108-byte limit)
    temp_root.mkdir()
    hosts, summary, failed, keep_logs = None, None, None, False
    try:
        hosts = test_hosts.Hosts(1 + args.workers, temp_root / "hosts", ssh=False)
        summary = run_cluster(args, hosts, temp_root)
    except RuntimeError as exc:
        failed, keep_logs = f"fleet_ray_cluster: {exc}", True
    except KeyboardInterrupt as exc:
        failed = f"fleet_ray_cluster: interrupted ({exc or 'Ctrl-C'}); torn down"
    finally:
        leftovers = teardown(hosts, temp_root, keep_logs)
    if failed:
        print(failed, file=sys.stderr)
        return 1
    spread = [ip for ip, calls in summary["calls_by_node"].items() if calls]
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=1))
    if len(spread) < 2:
        print(f"fleet_ray_cluster: the ClientApp calls ran on {spread or 'no node'}, not on more than one",
              file=sys.stderr)
        return 1
    sampled = sum(r["sampled"] for r in summary["rounds"])
    print(f"the ClientApp calls ran on {len(spread)} nodes: {summary['calls_by_node']} "
          f"({sum(summary['calls_by_node'].values())} calls for {sampled} devices sampled)")
    return 1 if leftovers else 0


if __name__ == "__main__":
    sys.exit(main())
