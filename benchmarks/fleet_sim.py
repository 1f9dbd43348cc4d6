"""The fleet on Flower's simulation runtime at scale: rounds per hour, memory and CPU for N virtual devices.

One run of ``edgetrain.fleet.simulation.simulate`` (Flower's ``run_simulation`` on Ray) with ``--devices``
virtual SuperNodes, ``--per-round`` sampled per round, ``--local-steps`` steps of small_cnn on the synthetic
dataset (enough samples for every device's partition); or, with ``--own-mode``, the same rounds on
``edgetrain train --sync fedavg``. The run is a child process of this one, measured from outside:

- its CPU seconds, exactly: the child joins a cgroup v1 ``cpuacct`` group of its own before it starts anything,
  so every process below it counts, those that end before it too (Ray's workers, the emulated devices); where
  no such group can be made, the sum of ``wait4``'s usage of every process of the tree (this process their
  subreaper), said once in the output;
- the CPU seconds at each round's end (the group's, read when the round's record appears), so that a round's
  cost is the slope over the rounds after ``--warmup-rounds``, without the start and the end;
- every second, the resident memory (RSS) and the CPU seconds of each process of the tree by role: a sampled
  breakdown, which misses what a process spends after its last sample; and the 1-minute load average.

Usage (from the repository root; the machine is shared, so run it niced: CPU seconds are the figure)::

    PYTHONPATH=src nice -n 10 python benchmarks/fleet_sim.py --devices 1000 --per-round 50 --rounds 100 \\
        --json benchmarks/results/fleet_sim_1000.json
"""
from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Callable

import psutil

CGROUP_ROOTS = ("/sys/fs/cgroup/cpuacct", "/sys/fs/cgroup/cpu,cpuacct")
PR_SET_CHILD_SUBREAPER = 36  # prctl(2)
LEFT_BEHIND_WAIT_S = 30.0    # how long the tree's last processes may take to end after the child
KILL_WAIT_S = 10.0           # ... and to go once killed


class TreeCpu:
    """Every CPU second of a child process and of all it starts, those that end before it too: a cgroup v1
    ``cpuacct`` group of its own, which the child joins before it runs anything (so the live figure can be read
    at any moment); where no such group can be made, the sum of ``wait4``'s usage of every process of the tree
    as it ends (this process their subreaper, so orphans come back to it; a figure only at the end)."""

    def __init__(self):
        self.group = make_group()
        self.reaped_user_s = self.reaped_system_s = 0.0
        if self.group is None:
            ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
            self.method = "wait4 rusage of every process of the tree (no cgroup v1 cpuacct group could be made)"
        else:
            self.method = f"cgroup v1 cpuacct group {self.group}"

    def join(self) -> None:
        """In the child, before it runs anything (``preexec_fn``): into the group."""
        if self.group is not None:
            (self.group / "cgroup.procs").write_text(str(os.getpid()))

    def usage_s(self) -> float | None:
        """The tree's CPU seconds so far (None under the fallback, which knows them only at the end)."""
        if self.group is None:
            return None
        return int((self.group / "cpuacct.usage").read_text()) / 1e9

    def ended(self, child: subprocess.Popen) -> bool:
        if self.group is not None:
            return child.poll() is not None
        self.reap(child)
        return child.returncode is not None

    def reap(self, child: subprocess.Popen | None = None) -> bool:
        """Under the fallback: the usage of every process of the tree that has ended, added (the child's exit
        status put into ``child``, which must not wait for itself: its usage would be lost); whether any is left."""
        while True:
            try:
                pid, status, usage = os.wait4(-1, os.WNOHANG)
            except ChildProcessError:
                return False
            if pid == 0:
                return True
            self.reaped_user_s += usage.ru_utime
            self.reaped_system_s += usage.ru_stime
            if child is not None and pid == child.pid:
                child.returncode = os.waitstatus_to_exitcode(status)

    def finish(self, child: subprocess.Popen, wait_s: float = LEFT_BEHIND_WAIT_S) -> dict:
        """The tree's CPU seconds, once all of it has ended (what is still running after ``wait_s`` is ended,
        and counted); the group removed."""
        left = self.end_the_rest(child, wait_s)
        if self.group is None:
            return {"method": self.method, "cpu_s": self.reaped_user_s + self.reaped_system_s,
                    "user_s": self.reaped_user_s, "system_s": self.reaped_system_s, "left_behind": left}
        ticks = dict(line.split() for line in (self.group / "cpuacct.stat").read_text().splitlines())
        hz = os.sysconf("SC_CLK_TCK")
        result = {"method": self.method, "cpu_s": self.usage_s(), "user_s": int(ticks["user"]) / hz,
                  "system_s": int(ticks["system"]) / hz, "left_behind": left}
        self.group.rmdir()
        return result

    def end_the_rest(self, child: subprocess.Popen, wait_s: float) -> int:
        """Wait for the processes the child left behind; end those still there after the wait (every one of
        them started under this run's child; killed until none is left, since a parent may start another
        meanwhile, for at most ``KILL_WAIT_S``); how many were ended."""
        deadline = time.monotonic() + wait_s
        while self.members() and time.monotonic() < deadline:
            self.ended(child)
            time.sleep(0.2)
        ended: set[int] = set()
        deadline = time.monotonic() + KILL_WAIT_S
        while (pids := self.members()) and time.monotonic() < deadline:
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
                ended.add(pid)
            self.ended(child)  # reaps the child itself once it is gone
            time.sleep(0.1)
        if self.members():
            raise SystemExit(f"processes of the run could not be ended: {self.members()} ({self.method})")
        return len(ended)

    def members(self) -> list[int]:
        if self.group is not None:
            return [int(pid) for pid in (self.group / "cgroup.procs").read_text().split()]
        return [proc.pid for proc in psutil.Process().children(recursive=True)] if self.reap() else []


def make_group() -> Path | None:
    """A fresh cpuacct group (None where there is no cgroup v1 cpuacct hierarchy or no right to make one)."""
    for root in CGROUP_ROOTS:
        group = Path(root) / f"edgetrain-fleet-sim-{os.getpid()}"
        try:
            group.mkdir()
            return group
        except OSError:
            continue
    return None


class RoundClock:
    """At each round's end, as soon as the round shows in the run's files (``rounds_done``, polled every
    ``interval`` seconds): the tree's CPU seconds (exact), the wall time, and each process role's CPU seconds
    (``by_role``: sampled, those of the processes alive then)."""

    def __init__(self, rounds_done: Callable[[], int], cpu: TreeCpu, by_role: Callable[[], dict[str, float]],
                 interval: float = 0.02):
        self.rounds_done, self.cpu, self.by_role, self.interval = rounds_done, cpu, by_role, interval
        self.start, self.points = time.perf_counter(), []  # {"round", "cpu_s", "wall_s", "cpu_s_by_process"}

    def poll(self) -> None:
        done = self.rounds_done()
        while len(self.points) < done:
            self.points.append({"round": len(self.points) + 1, "cpu_s": self.cpu.usage_s(),
                                "wall_s": time.perf_counter() - self.start, "cpu_s_by_process": self.by_role()})

    def per_round(self, warmup: int, value: Callable[[dict], float | None]) -> float | None:
        """The least-squares slope of ``value`` (of a round's end) against the round, over the rounds' ends from
        ``warmup`` on."""
        points = [(p["round"], value(p)) for p in self.points if p["round"] >= warmup and value(p) is not None]
        if len(points) < 2:
            return None
        mean_x = sum(x for x, _ in points) / len(points)
        mean_y = sum(y for _, y in points) / len(points)
        return (sum((x - mean_x) * (y - mean_y) for x, y in points)
                / sum((x - mean_x) ** 2 for x, _ in points))

    def per_round_by_role(self, warmup: int) -> dict[str, float]:
        roles = {role for p in self.points for role in p["cpu_s_by_process"]}
        slopes = {role: self.per_round(warmup, lambda p, role=role: p["cpu_s_by_process"].get(role, 0.0))
                  for role in roles}
        return dict(sorted(((role, s) for role, s in slopes.items() if s is not None), key=lambda item: -item[1]))


def lines_in(path: Path) -> int:
    try:
        return path.read_bytes().count(b"\n")
    except OSError:
        return 0


def tree_sample(root: psutil.Process, root_role: str, cpu: dict[int, float], names: dict[int, str],
                niceness: dict[str, int]) -> int:
    """Bytes resident in ``root`` and all its descendants now (processes that end meanwhile count zero); each
    one's CPU seconds so far (user + system) into ``cpu`` and its role into ``names``, by pid (``root_role``
    the root's); the highest niceness seen of each role into ``niceness``."""
    total = 0
    for proc in [root, *root.children(recursive=True)]:
        try:
            total += proc.memory_info().rss
            times = proc.cpu_times()
            cpu[proc.pid] = times.user + times.system
            names[proc.pid] = root_role if proc.pid == root.pid else process_role(proc)
            niceness[names[proc.pid]] = max(niceness.get(names[proc.pid], -20), proc.nice())
        except psutil.Error:
            pass
    return total


def process_role(proc: psutil.Process) -> str:
    """What a process below the run's first is: a Ray actor (its title ``ray::ClientAppActor``, or
    ``ray::IDLE`` before its first task), one of Ray's own processes (named by its program), the own mode's
    fork server and its emulated devices, or another."""
    cmdline = proc.cmdline()
    title = " ".join(cmdline)
    if title.startswith("ray::"):
        return "Ray worker / ClientApp actor"
    if "multiprocessing.forkserver" in title:  # the own mode's: its devices are the fork server's children
        parent = proc.parent()
        return "emulated device" if parent is not None and "multiprocessing.forkserver" in " ".join(
            parent.cmdline()) else "fork server"
    if "multiprocessing.resource_tracker" in title:
        return "multiprocessing resource tracker"
    for part in cmdline:
        for name in ("gcs_server", "raylet", "dashboard", "log_monitor", "monitor.py", "runtime_env", "agent"):
            if name in part:
                return f"Ray: {name}"
    return "other: " + Path(cmdline[0]).name if cmdline else "other"


def cpu_by_role(cpu: dict[int, float], names: dict[int, str]) -> dict[str, float]:
    """The run's CPU seconds summed by process role."""
    roles: dict[str, float] = {}
    for pid, seconds in cpu.items():
        roles[names.get(pid, "other")] = roles.get(names.get(pid, "other"), 0.0) + seconds
    return dict(sorted(roles.items(), key=lambda item: -item[1]))


class PollTimer:
    """The CPU seconds of Flower's simulation engine looking for messages: its loop asks the in-memory state for
    each node's waiting message every 0.1 s (``vce_api.add_messages_to_queue``); ``get_message_ins`` is wrapped
    with a thread-CPU timer (measured, the call itself unchanged)."""

    def __init__(self):
        from flwr.server.superlink.linkstate.in_memory_linkstate import InMemoryLinkState
        self.cpu_s, self.calls, original = 0.0, 0, InMemoryLinkState.get_message_ins

        def timed(state, *args, **kwargs):
            start = time.thread_time()
            try:
                return original(state, *args, **kwargs)
            finally:
                self.cpu_s += time.thread_time() - start
                self.calls += 1
        InMemoryLinkState.get_message_ins = timed




class Sampler(threading.Thread):
    """Peak tree RSS, the tree's CPU seconds by process and the load averages seen, sampled every ``interval``
    seconds (a breakdown: what a process spends after its last sample is missed; ``TreeCpu`` is the total)."""

    def __init__(self, root: psutil.Process, root_role: str, interval: float = 1.0):
        super().__init__(daemon=True)
        self.interval, self.stop, self.peak, self.loads = interval, threading.Event(), 0, []
        self.root, self.root_role, self.cpu, self.names, self.niceness = root, root_role, {}, {}, {}

    def run(self):
        while not self.stop.wait(self.interval):
            try:
                rss = tree_sample(self.root, self.root_role, self.cpu, self.names, self.niceness)
            except psutil.Error:  # the run's first process has ended
                continue
            self.peak = max(self.peak, rss)
            self.loads.append(os.getloadavg()[0])
            if len(self.loads) % 60 == 0:  # a long run's progress, readable from its log
                print(f"PROGRESS peak_rss_mb={self.peak / 2**20:.0f} sampled_cpu_s={sum(self.cpu.values()):.0f} "
                      f"load_1min={self.loads[-1]:.1f}", flush=True)


def arguments() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--devices", type=int, default=1000)
    ap.add_argument("--per-round", type=int, default=50)
    ap.add_argument("--rounds", type=int, default=100)
    ap.add_argument("--local-steps", type=int, default=5)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--image-size", type=int, default=16)
    ap.add_argument("--cpus-per-device", type=float, default=1.0)
    ap.add_argument("--worker-niceness", type=int, default=0,
                    help="added to the Ray actors' niceness (Ray's own default is 15; SimulationResources')")
    ap.add_argument("--population", default="60% rpi4@wifi-20m, 30% smart-speaker-2g@lte-10m, 10% jetson-orin-nano")
    ap.add_argument("--availability", default="always")
    ap.add_argument("--config", default="", help="more run-config keys, as JSON")
    ap.add_argument("--own-mode", action="store_true",
                    help="instead: the same rounds on edgetrain's own federated mode (edgetrain train --sync "
                         "fedavg:steps=H, one emulated device process per device; --per-round must equal --devices)")
    ap.add_argument("--warmup-rounds", type=int, default=2,
                    help="the CPU seconds a round are the slope from this round's end on (the start left out)")
    ap.add_argument("--json", help="write the result here")
    ap.add_argument("--inner", help=argparse.SUPPRESS)  # the measured child: the simulation, config from this file
    return ap.parse_args()


def main() -> None:
    args = arguments()
    if args.inner:
        return run_inner(Path(args.inner), args)
    if args.own_mode and args.per_round != args.devices:
        raise SystemExit("--own-mode samples every device each round: give --per-round equal to --devices")
    result = own_mode(args) if args.own_mode else simulation(args)
    print(json.dumps({k: v for k, v in result.items()
                      if k not in ("records", "config", "measured_round_train_s", "measured_round_ends", "command")},
                     indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))


def measure(cmd: list[str], root_role: str, rounds_done: Callable[[], int], args) -> dict:
    """Run ``cmd`` as a child in a CPU account of its own; its CPU seconds (all, and a round's), wall time,
    peak memory, sampled breakdown and the load."""
    cpu = TreeCpu()
    print(f"CPU accounting: {cpu.method}", flush=True)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so that the run is ended with this process
    child = subprocess.Popen(cmd, preexec_fn=cpu.join, stdout=subprocess.DEVNULL)
    sampler = Sampler(psutil.Process(child.pid), root_role)
    sampler.start()
    def by_role() -> dict[str, float]:
        cpu_now, names = {}, {}
        try:
            tree_sample(sampler.root, root_role, cpu_now, names, {})
        except psutil.Error:  # the run's first process has ended
            return {}
        return cpu_by_role(cpu_now, names)
    clock = RoundClock(rounds_done, cpu, by_role)
    try:
        while not cpu.ended(child):
            clock.poll()
            time.sleep(clock.interval)
    except BaseException:  # Ctrl-C or an error here: the run's processes ended and the group removed too
        cpu.finish(child, wait_s=0.0)
        raise
    wall = time.perf_counter() - clock.start
    clock.poll()
    sampler.stop.set()
    sampler.join()
    total = cpu.finish(child)
    if child.returncode:
        raise SystemExit(f"the measured run failed (exit {child.returncode}): {' '.join(cmd)}")
    per_round = clock.per_round(args.warmup_rounds, lambda point: point["cpu_s"])
    return {"cpu_accounting": total["method"], "measured_cpu_s": total["cpu_s"],
            "measured_cpu_user_s": total["user_s"], "measured_cpu_system_s": total["system_s"],
            "processes_left_behind": total["left_behind"],
            "measured_cpu_s_per_round": per_round, "measured_cpu_s_per_device_round":
                per_round / args.per_round if per_round is not None else None,
            "measured_wall_s_per_round": clock.per_round(args.warmup_rounds, lambda point: point["wall_s"]),
            "sampled_cpu_s_per_round_by_process": clock.per_round_by_role(args.warmup_rounds),
            "warmup_rounds": args.warmup_rounds, "measured_round_ends": clock.points,
            "measured_wall_s": wall, "measured_peak_rss_mb": sampler.peak / 2**20,
            "sampled_cpu_s": sum(sampler.cpu.values()),
            "sampled_cpu_s_by_process": cpu_by_role(sampler.cpu, sampler.names),
            "niceness_by_process": sampler.niceness, "nice": os.nice(0), "cores": os.cpu_count(),
            "load_average_1min_mean": sum(sampler.loads) / max(len(sampler.loads), 1),
            "load_average_1min_max": max(sampler.loads, default=0.0)}


def simulation(args) -> dict:
    """The simulation in a child process (this script, ``--inner``), measured by ``measure``."""
    out = Path(tempfile.mkdtemp(prefix="fleet-sim-"))
    config = {"model": "small_cnn", "dataset": "synthetic", "image-size": args.image_size,
              "synthetic-samples": args.devices * args.batch_size * 2, "partition": "iid",
              "num-rounds": args.rounds, "local-steps": args.local_steps, "batch-size": args.batch_size,
              "fraction-train": args.per_round / args.devices, "fraction-evaluate": 0.0, "server-evaluate": True,
              "min-nodes": args.devices, "population": args.population, "availability": args.availability,
              "round-timeout": 600.0, "output-dir": str(out), **json.loads(args.config or "{}")}
    rounds_file = Path(config["output-dir"]) / "fleet-rounds.jsonl"  # --config may name its own output-dir
    print(f"records: {rounds_file}", flush=True)
    (out / "config.json").write_text(json.dumps(config))
    cmd = [sys.executable, __file__, "--inner", str(out / "config.json"), "--devices", str(args.devices),
           "--cpus-per-device", str(args.cpus_per_device), "--worker-niceness", str(args.worker_niceness)]
    measured = measure(cmd, "driver (ServerApp, Flower's simulation engine)", lambda: lines_in(rounds_file), args)
    inner = json.loads((out / "inner.json").read_text())
    records = [json.loads(line) for line in rounds_file.read_text().splitlines()]
    if len(records) != args.rounds:
        raise SystemExit(f"the simulation recorded {len(records)} rounds, not {args.rounds}: {rounds_file}")
    train_walls = [r["measured_train_wall_s"] for r in records]
    return {"mode": "Flower simulation (Ray)", "devices": args.devices, "per_round": args.per_round,
            "rounds": args.rounds, "worker_niceness": args.worker_niceness, "local_steps": args.local_steps,
            "batch_size": args.batch_size, "image_size": args.image_size, "cpus_per_device": args.cpus_per_device,
            **measured, "measured_simulate_wall_s": inner["wall_s"],
            "measured_rounds_per_hour": args.rounds / inner["wall_s"] * 3600,
            "measured_mean_round_train_s": sum(train_walls) / len(train_walls),
            "measured_first_round_train_s": train_walls[0], "measured_round_train_s": train_walls,
            "measured_flower_poll_cpu_s": inner["flower_poll_cpu_s"], "flower_poll_calls": inner["flower_poll_calls"],
            "final_server_accuracy": records[-1].get("server_accuracy"),
            "modelled_clock_s": records[-1].get("modelled_clock_s"), "config": config, "records": records}


def run_inner(config_file: Path, args) -> None:
    """The measured child: the simulation itself, with Flower's polling timed; its figures beside the config."""
    from edgetrain.fleet.simulation import SimulationResources, simulate

    config = json.loads(config_file.read_text())
    poll = PollTimer()
    start = time.perf_counter()
    simulate(config, args.devices, SimulationResources(cpus_per_device=args.cpus_per_device,
                                                          worker_niceness=args.worker_niceness))
    (config_file.parent / "inner.json").write_text(json.dumps({
        "wall_s": time.perf_counter() - start, "flower_poll_cpu_s": poll.cpu_s, "flower_poll_calls": poll.calls}))


def own_mode(args) -> dict:
    """``edgetrain train --sync fedavg:steps=H`` with ``--devices`` emulated devices, every one in every round
    (the same per-device batch, steps and data), measured as the simulation is; the devices' own CPU seconds
    in their steps (``cpu_s`` of their step records) beside it."""
    out = Path(tempfile.mkdtemp(prefix="fleet-own-"))
    cmd = [sys.executable, "-m", "edgetrain", "train", "--devices", str(args.devices), "--model", "small_cnn",
           "--dataset", "synthetic", "--image-size", str(args.image_size),
           "--synthetic-samples", str(args.devices * args.batch_size * 2), "--partition", "iid",
           "--sync", f"fedavg:steps={args.local_steps}", "--steps", str(args.rounds * args.local_steps),
           "--epochs", str(args.rounds * args.local_steps),  # --steps stops at --epochs' end (default 10) too
           "--batch-size", str(args.batch_size * args.devices), "--no-eval", "--output", str(out)]
    def rounds_done() -> int:  # rank 0's steps as they happen (metrics.jsonl replaces its file at the end)
        return sum(lines_in(live) for live in out.glob("*/metrics-0.jsonl")) // args.local_steps
    measured = measure(cmd, "edgetrain train (launcher)", rounds_done, args)
    steps = [json.loads(line) for line in next(out.rglob("metrics.jsonl")).read_text().splitlines()]
    if len(steps) != args.rounds * args.local_steps * args.devices:
        raise SystemExit(f"the own mode ran {len(steps)} device-steps, not {args.rounds} rounds' "
                         f"{args.rounds * args.local_steps * args.devices}: {out}")
    steady = [s for s in steps if s["step"] > args.warmup_rounds * args.local_steps]
    return {"mode": "edgetrain train --sync fedavg", "devices": args.devices, "per_round": args.per_round,
            "rounds": args.rounds, "local_steps": args.local_steps, "batch_size": args.batch_size, **measured,
            "measured_device_step_cpu_s": sum(s["cpu_s"] for s in steps),
            "measured_device_step_cpu_s_per_round_after_warmup":
                sum(s["cpu_s"] for s in steady) / max(args.rounds - args.warmup_rounds, 1),
            "command": cmd}


if __name__ == "__main__":
    main()
